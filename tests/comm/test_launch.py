"""``spawn_local``: local gloo ranks, forked from a server that has imported torch, each with
the environment its parent has when it starts them."""
from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

from gradzip.comm.launch import local_context, spawn_local


def _where(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"parent": os.getppid(), "marker": os.environ.get("LAUNCH_TEST_MARKER"),
            "threads": torch.get_num_threads(), "sum": total.item(), "path": sys.path[:]}


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here")
def test_ranks_start_from_the_fork_server_with_the_environment_the_parent_has_then(monkeypatch):
    assert local_context().get_start_method() == "forkserver"
    # (not a GRADZIP_ variable: a rank drops those, as the jobs pick their settings themselves)
    for value in ("first", "second"):  # the second job's ranks come from a server already running
        monkeypatch.setenv("LAUNCH_TEST_MARKER", value)
        ranks = spawn_local(_where, 2, all_ranks=True)
        assert [r["marker"] for r in ranks] == [value, value]
        assert all(r["parent"] != os.getpid() for r in ranks)  # forked by the server, not by this process
        assert all(r["threads"] == 1 and r["sum"] == 3.0 for r in ranks)
        assert all(r["path"] == sys.path for r in ranks)  # (the task's module is importable there)
    # where a rank must be a fresh interpreter (the memory benchmark): started by this process
    ranks = spawn_local(_where, 2, all_ranks=True, start_method="spawn")
    assert all(r["parent"] == os.getpid() and r["marker"] == "second" and r["sum"] == 3.0 for r in ranks)
