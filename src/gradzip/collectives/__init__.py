"""Collectives that move encoded payloads over ``torch.distributed``.

``allreduce`` sums summable payloads, ``allgather`` gathers anything (variable sizes included)
and lets the codec aggregate, ``sra`` is CGX's compressed scatter-reduce + all-gather.
"""
from . import allgather, allreduce, sra  # noqa: F401  (registers the collectives)
from .base import Collective, Result, get, names

__all__ = ["Collective", "Result", "get", "names"]
