"""Start W local gloo ranks with ``torch.multiprocessing`` and collect what they return.

Used by ``gradzip demo``, ``gradzip bench`` and the multi-process tests, so a command-line tool
can run a distributed job and then report in the parent process (where printing and plotting
live). Every rank's result (or its traceback) travels back through a file.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous port of one local job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CLONE_NEWNET = 0x40000000


def enter_namespace(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into network namespace ``name``.

    Called first thing in a spawned rank, before torch.distributed starts its threads.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _entry(
    rank: int, world_size: int, port: int, outdir: str, timeout_s: float, network: Optional[Tuple[List[str], str, str]],
    ranks_per_node: Optional[int], fn: Callable, args: tuple,
) -> None:
    master = "127.0.0.1"
    if ranks_per_node:  # what torchrun tells the ranks of a node, one torchrun per node
        os.environ.update(
            GROUP_RANK=str(rank // ranks_per_node), LOCAL_RANK=str(rank % ranks_per_node),
            LOCAL_WORLD_SIZE=str(ranks_per_node),
        )
    if network is not None:  # an emulated cluster: this rank's namespace, gloo on its interface
        namespaces, master, iface = network
        enter_namespace(namespaces[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    import torch
    import torch.distributed as dist

    # One compute thread per rank: W ranks share few cores, and oversubscription would make
    # every timing meaningless.
    torch.set_num_threads(1)
    # Jobs pick their configurations explicitly; a stray GRADZIP_CODEC in the shell would
    # silently turn every configuration of gradzip.register() into the same one.
    for key in [k for k in os.environ if k.startswith("GRADZIP_")]:
        del os.environ[key]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        record = {"ok": True, "result": fn(rank, world_size, *args)}
    except BaseException:
        record = {"ok": False, "error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(record, f)
    # Leave without interpreter finalisation. A gloo worker thread drops its reference to a
    # finished collective a moment after the caller's wait() returns; if that releases tensors
    # owned by Python, it takes the GIL, and a thread that asks for it while Python finalises is
    # ended by pthread_exit, whose unwinding through C++ aborts the process ("terminate called
    # without an active exception", seen on a rank whose work had all succeeded).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if record["ok"] else 1)


def spawn_local(
    fn: Callable, world_size: int, *args: Any, all_ranks: bool = False, timeout_s: float = 300, cluster: Any = None,
    deadline_s: Optional[float] = None, missing_ok: bool = False, ranks_per_node: Optional[int] = None,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks.

    Returns rank 0's result, or the list of every rank's result with ``all_ranks=True``. ``fn``
    must be a module-level function (it is pickled into spawned processes). A failure on any
    rank raises ``RuntimeError`` carrying the failing ranks' tracebacks. With ``cluster`` (an
    entered :class:`gradzip.bench.cluster.EmulatedCluster`) rank r runs in namespace r and
    gloo talks over the shaped links. ``timeout_s`` bounds each collective; ``deadline_s``
    bounds the whole job: ranks still running then are killed and ``RuntimeError`` says so.
    With ``missing_ok`` a rank that exits with status 0 but no result (one that dies on purpose,
    in a fault test) gives ``None`` instead of an error. ``ranks_per_node``: rank r is told, as
    torchrun tells it, that it is local rank ``r % L`` of node ``r // L`` (``GROUP_RANK``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); a cluster of nodes puts it in its node's namespace.
    """
    import torch.multiprocessing as mp

    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # children inherit it before they import torch
    try:
        with tempfile.TemporaryDirectory(prefix="gradzip-") as outdir:
            network = None
            if cluster is not None:
                network = ([cluster.namespace_of(r) for r in range(world_size)], cluster.address(0), cluster.iface)
                ranks_per_node = ranks_per_node or (cluster.ranks_per_node if cluster.ranks_per_node > 1 else None)
            args_ = (world_size, free_port(), outdir, timeout_s, network, ranks_per_node, fn, args)
            failure = None
            ctx = mp.spawn(_entry, args=args_, nprocs=world_size, join=False)
            start = time.monotonic()
            try:
                while not ctx.join(timeout=1.0):
                    if deadline_s is not None and time.monotonic() - start > deadline_s:
                        for proc in ctx.processes:
                            if proc.is_alive():
                                proc.kill()
                        failure = RuntimeError(f"ranks still running after {deadline_s:g} s: killed (hung)")
                        break
            except Exception as exc:  # collect every rank's story before raising
                failure = exc
            records: List[Any] = []
            for r in range(world_size):
                path = os.path.join(outdir, f"{r}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        records.append(pickle.load(f))
                elif missing_ok:
                    records.append({"ok": True, "result": None})
                else:
                    records.append({"ok": False, "error": f"rank {r} exited without a result"})
            errors = [f"rank {r}:\n{rec['error']}" for r, rec in enumerate(records) if not rec["ok"]]
            if errors or failure is not None:
                raise RuntimeError("local ranks failed:\n" + "\n".join(errors + ([str(failure)] if failure else [])))
            results = [rec["result"] for rec in records]
            return results if all_ranks else results[0]
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
