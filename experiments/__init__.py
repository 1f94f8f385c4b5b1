"""Evaluations, benchmarks and the `kvjax` command line."""
