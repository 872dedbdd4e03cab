"""Benchmarks, and the local launcher they share with ``gradzip demo``.

:func:`spawn_local` starts W gloo ranks on this machine with ``torch.multiprocessing`` and hands
back what rank 0 returned, so a command-line tool can run a distributed job and then report in
the parent process (where plotting and printing live).
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous port of one local job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, result_path: str, fn: Callable, args: tuple) -> None:
    # One compute thread per rank: W ranks share few cores, and oversubscription would make
    # every timing meaningless.
    torch.set_num_threads(1)
    # The jobs pick their configurations explicitly; a stray GRADZIP_CODEC in the shell would
    # silently turn every configuration of gradzip.register() into the same one.
    for key in [k for k in os.environ if k.startswith("GRADZIP_")]:
        del os.environ[key]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            with open(result_path, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn_local(fn: Callable, world_size: int, *args: Any) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks; return rank 0's result.

    ``fn`` must be a module-level function (it is pickled into spawned processes). A failure on
    any rank raises ``torch.multiprocessing.ProcessRaisedException`` with its traceback.
    """
    # Children inherit the environment at spawn: limit OpenMP before they import torch.
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with tempfile.TemporaryDirectory(prefix="gradzip-") as tmp:
            path = os.path.join(tmp, "result.pkl")
            mp.spawn(_entry, args=(world_size, free_port(), path, fn, args), nprocs=world_size, join=True)
            with open(path, "rb") as f:
                return pickle.load(f)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
