"""Benchmarks and workload generators (``agentkv bench ...``)."""
