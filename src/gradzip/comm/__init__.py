"""Collectives that move encoded payloads over ``torch.distributed``.

``allreduce`` sums summable payloads, ``allgather`` gathers anything (variable sizes included)
and lets the codec aggregate, ``sra`` is CGX's compressed scatter-reduce + all-gather, ``ps`` is
HiPress's CaSync-PS (partitions aggregated by round-robin aggregator ranks).
"""
from . import allgather, allreduce, ps, sra  # noqa: F401  (registers the collectives)
from .base import Collective, Result, get, names

__all__ = ["Collective", "Result", "get", "names"]
