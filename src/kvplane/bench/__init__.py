"""Benchmark cores used by ``kvplane bench`` and the scripts in benchmarks/."""
