"""``spawn_local``: local gloo ranks, forked from a server that has imported torch, each
starting as a spawned one would: the environment its parent has when it starts them (before
the task's module is imported), a random seed of its own, and an end when its parent is gone."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gradzip.comm.launch import local_context, spawn_local

from . import launch_task

FORKS = pytest.mark.skipif(local_context().get_start_method() != "forkserver", reason="ranks are spawned here")


@FORKS
def test_ranks_start_from_the_fork_server_as_spawned_ones_would(monkeypatch):
    seeds = set()
    # (not a GRADZIP_ variable: a rank drops those, as the jobs pick their settings themselves)
    for value in ("first", "second"):  # the second job's ranks come from a server already running
        monkeypatch.setenv("LAUNCH_TEST_MARKER", value)
        ranks = spawn_local(launch_task.where, 2, all_ranks=True)
        assert all(r["parent"] != os.getpid() for r in ranks)  # forked by the server, not by this process
        # the environment as the parent has it now, in place when the task's module was imported
        assert [(r["marker"], r["at_import"]) for r in ranks] == [(value, value)] * 2
        assert all(r["threads"] == 1 and r["sum"] == 3.0 for r in ranks)
        assert all(r["path"] == sys.path for r in ranks)
        assert all(r["preloaded"] for r in ranks)  # DDP's imports come with the fork, not in each rank
        seeds.update(r["seed"] for r in ranks)
    assert len(seeds) == 4  # each rank of each job seeded at random, as a fresh process is
    # where a rank must be a fresh interpreter (the memory benchmark): started by this process
    ranks = spawn_local(launch_task.where, 2, all_ranks=True, start_method="spawn")
    assert all(r["parent"] == os.getpid() and r["marker"] == "second" and r["sum"] == 3.0 for r in ranks)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@FORKS
@pytest.mark.timeout(120)
def test_ranks_end_when_the_process_that_started_them_is_killed(tmp_path: Path):
    root = str(Path(__file__).resolve().parents[2])
    # (its temporary folders in one of the test's own, which a killed launcher cannot remove
    # itself: short, as the forkserver's socket in it must fit an AF_UNIX path, 108 bytes, and
    # pytest's tmp_path can be near that already)
    scratch = Path(tempfile.mkdtemp(prefix="gzkill"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), "TMPDIR": str(scratch)}
    launcher = subprocess.Popen([sys.executable, "-m", "tests.comm.launch_task", str(tmp_path)], cwd=root, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)  # (no clean-up of its own: an out-of-memory kill, a CI timeout)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids), "ranks outlived the process that started them"
    finally:
        launcher.kill()
        launcher.wait()
        for p in tmp_path.glob("*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(scratch, ignore_errors=True)
