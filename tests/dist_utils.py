"""Start real worker processes (gloo on CPU) for multi-rank tests.

Starting W ranks costs time on two cores (each forks from a server that has imported torch, as
``spawn_local``'s do, imports gradzip and meets the others), more than many tests take
themselves. So the ranks of :func:`run_workers` are started once per world size and kept for
the session: each joins the gloo job once, then runs one test function after another. A call's
node layout (``ranks_per_node``) is set in the environment for that call only, where gradzip
reads it (when a communicator is built), so the layouts share the ranks. Between two functions
a rank puts back what a fresh process would have: its environment, torch's default random
generator (seeded at random when the rank started) and the module-level names of gradzip's
modules (a test may patch a device choice there). A function that fails, or a rank that dies
or hangs, ends the pool: its ranks are killed and the next call starts fresh ones.
``GRADZIP_FRESH_WORKERS=1`` starts new ranks for every call instead, as
:func:`gradzip.comm.launch.spawn_local` does.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

from gradzip.comm.launch import ParentEnvironment, begin_rank, free_port, local_context, spawn_local

TIMEOUT_S = 120  # a collective that waits longer has hung


def _serve(environ: Dict[str, str], launcher: int, rank: int, world_size: int, port: int, conn: Any) -> None:
    """One kept rank: join the job, then run each function sent until told to stop. (The
    environment, first, is the parent's once unpickled: see ``gradzip.comm.launch``.)"""
    begin_rank(launcher)  # (its own random seed, as a fresh process has)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as spawn_local's ranks: several share few cores
    for key in [k for k in os.environ if k.startswith("GRADZIP_")]:
        del os.environ[key]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    seed = torch.initial_seed()
    environ = dict(os.environ)
    while True:
        message = conn.recv_bytes()
        if not message:
            break
        fn, args, ranks_per_node = pickle.loads(message)
        torch.manual_seed(seed)  # the generator as a fresh process has it
        # gradzip's module-level names as they were (a function may patch a device choice)
        names = {key: dict(vars(module)) for key, module in list(sys.modules.items()) if key.startswith("gradzip")}
        if ranks_per_node:  # told its node as torchrun tells the ranks of one (spawn_local's ranks_per_node)
            os.environ.update(
                GROUP_RANK=str(rank // ranks_per_node), LOCAL_RANK=str(rank % ranks_per_node),
                LOCAL_WORLD_SIZE=str(ranks_per_node),
            )
        try:
            record = {"ok": True, "result": fn(rank, world_size, *args)}
        except BaseException:  # noqa: BLE001 - sent back to the test
            record = {"ok": False, "error": traceback.format_exc()}
        os.environ.clear()
        os.environ.update(environ)
        for key, before in names.items():
            module = vars(sys.modules[key]) if key in sys.modules else {}  # (a function may drop a module)
            for name, value in before.items():
                if module.get(name) is not value:
                    module[name] = value
        conn.send_bytes(pickle.dumps(record))
    dist.destroy_process_group()
    os._exit(0)


class _Pool:
    """W kept ranks and a pipe to each."""

    def __init__(self, world_size: int) -> None:
        ctx = local_context()  # (forked from a server that has imported torch, as spawn_local's ranks)
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(ParentEnvironment(), os.getpid(), rank, world_size, port, child),
                               daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn: Callable, args: tuple, ranks_per_node: Optional[int]) -> List[Dict[str, Any]]:
        """Every rank's record of ``fn``; raises where a rank died or the job hung."""
        message = pickle.dumps((fn, args, ranks_per_node))
        for conn in self.conns:
            conn.send_bytes(message)
        records: Dict[int, Dict[str, Any]] = {}
        deadline = time.monotonic() + TIMEOUT_S + 30
        failed_at = None
        while len(records) < len(self.conns):
            waiting = [c for r, c in enumerate(self.conns) if r not in records]
            # once one rank failed, the others are given a moment (they may wait on it forever)
            limit = deadline if failed_at is None else min(deadline, failed_at + 5)
            ready = mp.connection.wait(waiting, timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                missing = sorted(set(range(len(self.conns))) - set(records))
                if failed_at is None:
                    raise RuntimeError(f"ranks {missing} still running after {TIMEOUT_S + 30} s: hung")
                for r in missing:
                    records[r] = {"ok": False, "error": "stopped: another rank failed\n"}
                break
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    records[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    records[rank] = {"ok": False, "error": f"rank {rank} died (exit code {self.procs[rank].exitcode})\n"}
                if not records[rank]["ok"] and failed_at is None:
                    failed_at = time.monotonic()
        return [records[r] for r in range(len(self.conns))]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


_POOLS: Dict[int, _Pool] = {}  # by world size


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_workers(fn: Callable, world_size: int, *args: Any, ranks_per_node: Optional[int] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; every rank's result.
    ``ranks_per_node``: rank r is told it is local rank r mod L of node r // L, as torchrun tells it.

    A failure (or a hang past two minutes of a collective) on any rank raises with its traceback.
    """
    if os.environ.get("GRADZIP_FRESH_WORKERS") == "1":
        return spawn_local(fn, world_size, *args, all_ranks=True, timeout_s=TIMEOUT_S, ranks_per_node=ranks_per_node)
    key = world_size
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool(world_size)
    try:
        records = pool.run(fn, args, ranks_per_node)
    except BaseException:
        _POOLS.pop(key).kill()
        raise
    failures = [(r, rec["error"]) for r, rec in enumerate(records) if not rec["ok"]]
    if failures:
        _POOLS.pop(key).kill()  # its ranks may be stuck in a collective
        raise RuntimeError("local ranks failed:\n" + "\n".join(f"rank {r}:\n{err}" for r, err in failures))
    return [rec["result"] for rec in records]


def completed(proc: "subprocess.Popen", timeout: float = 120) -> "subprocess.CompletedProcess":
    """Wait for a started process (its output piped as text) at most ``timeout`` seconds; killed
    if it is still running then (the wait's TimeoutExpired is raised), reaped in any case."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
