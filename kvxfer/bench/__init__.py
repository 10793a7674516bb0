"""Benchmarks behind ``kvxfer bench``: each prints a table, writes JSON, and runs its baseline in the same run."""
