"""Benchmarks for Mersal, each measured against a baseline without the framework."""
