"""Benchmarks, grouped by area; each runs as a module: ``python -m bench.<area>.<name>`` (bench/README.md)."""
