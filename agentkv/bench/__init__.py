"""Benchmarks and workload generators (``agentkv bench ...``)."""

from ._defaults import SERVER_ENV

__all__ = ["SERVER_ENV"]
