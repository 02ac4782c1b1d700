"""The code samples of the docs site: each page shows sections of these modules.

tests/docs runs every one of them, so the text cannot drift from code that
works; scripts/docs-samples copies the sections into the pages.
"""
