"""Benchmarks: ``gradzip bench allreduce`` (micro) lives in :mod:`gradzip.bench.micro`."""
from ..launch import free_port, spawn_local

__all__ = ["free_port", "spawn_local"]
