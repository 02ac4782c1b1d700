"""The distribution Mersal installs as, and the unrelated one that cannot be installed beside it.

Mersal's distribution is `mersal-bus`; its import packages are `mersal`, `mersal_rabbitmq` and
`mersal_sqlalchemy`. The distribution `mersal` on PyPI is another project, which ships an import
package `mersal` too: in one environment the two packages' files mix (its `mersal/handlers/`
beside our `mersal/handlers.py`) and `import mersal` fails or imports the wrong modules.
"""

from __future__ import annotations

import os
from importlib.metadata import Distribution, distributions

from mersal.errors import ConfigurationError

NAME = "mersal-bus"
"""Mersal's distribution: what `pip install` and `importlib.metadata.version` name."""

UNRELATED = "mersal"
"""The other project's distribution, whose import package is also `mersal`."""

OUR_COMMAND = "mersal.cli:main"
"""The `mersal` command's function: a `mersal` distribution declaring it is this project."""


def refuse_unrelated() -> None:
    """Raise a `ConfigurationError` when the unrelated `mersal` distribution is installed.

    One name looked up among the path's metadata directories: about a millisecond, and the
    listing it makes is the one the adapters' entry points are found in later.
    """
    for found in distributions(name=UNRELATED):
        if not _ours(found):
            where = os.path.abspath(str(found.locate_file("")))
            raise ConfigurationError(
                f"the unrelated `mersal` distribution ({found.version}, in {where}) is installed "
                f"beside {NAME} and both ship the import package `mersal`: "
                f"`pip uninstall {UNRELATED} {NAME}`, then install {NAME} again "
                "(uninstalling `mersal` removes files the two share)"
            )


def _ours(found: Distribution) -> bool:
    """Whether `found` is this project installed under its former name, `mersal`.

    A checkout installed before the rename keeps that metadata until it is reinstalled; its
    files are this project's own, so it is no conflict.
    """
    return any(entry.value == OUR_COMMAND for entry in found.entry_points)
