"""Runnable examples of Mersal services."""
