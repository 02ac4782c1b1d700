"""The code samples of the docs site: each page includes sections of these modules.

tests/docs runs every one of them, so the text cannot drift from code that works.
"""
