"""Start real worker processes (gloo on CPU) for multi-rank tests."""
from __future__ import annotations

from typing import Any, Callable, List

from gradzip.comm.launch import spawn_local


def run_workers(fn: Callable, world_size: int, *args: Any) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; every rank's result.

    A failure (or a hang past two minutes of a collective) on any rank raises with its traceback.
    """
    return spawn_local(fn, world_size, *args, all_ranks=True, timeout_s=120)
