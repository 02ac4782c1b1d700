"""`python -m mersal.cli`: the `mersal` command."""

import sys

from mersal.cli import main

if __name__ == "__main__":
    sys.exit(main())
