"""Start W local gloo ranks and collect what they return.

Used by ``gradzip demo``, ``gradzip bench`` and the multi-process tests, so a command-line tool
can run a distributed job and then report in the parent process (where printing and plotting
live). Every rank's result (or its traceback) travels back through a file.

On plain loopback the ranks are started with ``torch.multiprocessing``, forked from a server
that has imported torch (:func:`local_context`). On an emulated cluster
they are started as on real machines: one ``torchrun`` per node, inside the node's network
namespace, meeting the others through a c10d rendezvous on node 0's address; torchrun assigns
node ranks, sets ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK`` and the rest, and restarts the whole
job after a failure when asked to (``max_restarts``).
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous port of one local job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_context() -> Any:
    """The ``multiprocessing`` context local ranks start from: on Linux a fork server that
    imports torch once, elsewhere ``spawn`` (macOS spawns by default: forking after its system
    libraries are loaded is not safe).

    A spawned rank imports torch before it does anything, about 3 s of CPU on a small machine,
    and its first ``DistributedDataParallel`` imports ``torch._dynamo``, about 3 s more: most of
    what a short benchmark configuration or test job costs. A rank forked from the server has
    both already and starts in a fraction of a second. The server imports those alone (no CUDA,
    no thread pool, no gradzip). A rank then starts as a spawned one would
    (:class:`ParentEnvironment`, :func:`begin_rank`): with the environment its parent has when
    it starts the rank, in place before the task's module is imported; a random seed of its own
    for torch's default generator; and an end when its parent is gone. What a process reads
    only when it starts, it has from the server, as the server's parent had it when the server
    started (with the first ranks): glibc's ``MALLOC_*`` settings, Python's hash seed (the same
    on every rank), and what torch reads when it is imported (``OMP_NUM_THREADS``,
    ``TORCH_DISTRIBUTED_DEBUG``); ``spawn_local(..., start_method="spawn")`` starts fresh
    interpreters where that matters. The server is Python's own, one a parent process, its
    preloaded modules set here (one started before is used as it is).
    """
    import multiprocessing

    if not sys.platform.startswith("linux") or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])  # (read when the server starts)
    return ctx


def with_environment(environ: Dict[str, str]) -> Dict[str, str]:
    """Make this process's environment ``environ``; returns it."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    return environ


class ParentEnvironment:
    """This process's environment, which a rank makes its own as it unpickles it: first among a
    rank's arguments, it is in place before the task's module (or the parent's script) is
    imported to unpickle the arguments after it. A rank gets it as a dict."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)

    def __reduce__(self) -> Tuple[Callable, Tuple[Dict[str, str]]]:
        return with_environment, (self.environ,)


def begin_rank(launcher: int) -> None:
    """What a local rank does first, so one forked from the server starts as a spawned one
    would: a random seed of its own for torch's default generator (a fork would share the
    server's), and an end when ``launcher`` (the process that started it) is gone (the parent's
    death that torch's ranks wait for is the server's, which outlives it)."""
    import torch

    torch.seed()
    if os.getppid() != launcher:
        import threading

        threading.Thread(target=_end_with, args=(launcher,), name="gradzip-launcher-watch", daemon=True).start()


def _end_with(pid: int) -> None:
    """Exit this process once process ``pid`` has ended (a pidfd turns readable then, zombie or
    not; without one, polled)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        import select

        select.select([fd], [], [])
    else:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # (alive, another user's: a reused pid)
                pass
    os._exit(1)


def _entry(
    rank: int, environ: Dict[str, str], launcher: int, world_size: int, port: int, outdir: str, timeout_s: float,
    ranks_per_node: Optional[int], fn: Callable, args: tuple,
) -> None:
    # (``environ``, the parent's, was made this process's as it was unpickled: ParentEnvironment)
    begin_rank(launcher)
    if ranks_per_node:  # what torchrun tells the ranks of a node, one torchrun per node
        os.environ.update(
            GROUP_RANK=str(rank // ranks_per_node), LOCAL_RANK=str(rank % ranks_per_node),
            LOCAL_WORLD_SIZE=str(ranks_per_node),
        )
    _run_rank(rank, world_size, f"tcp://127.0.0.1:{port}", outdir, timeout_s, fn, args)


def _torchrun_entry(taskdir: str) -> None:
    """A rank started by torchrun: the task and the parent's import path come from ``taskdir``."""
    with open(os.path.join(taskdir, "path.json")) as f:
        where = json.load(f)
    sys.path[:0] = [p for p in where["path"] if p not in sys.path]
    if where["main"]:  # the parent's script, for a task defined in it (as multiprocessing does)
        main = types.ModuleType("__mp_main__")
        main.__file__ = where["main"]
        with open(where["main"]) as f:
            exec(compile(f.read(), where["main"], "exec"), main.__dict__)
        sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    with open(os.path.join(taskdir, "task.pkl"), "rb") as f:
        timeout_s, fn, args = pickle.load(f)
    _run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", taskdir, timeout_s, fn, args)


def _run_rank(rank: int, world_size: int, init_method: str, outdir: str, timeout_s: float, fn: Callable, args: tuple) -> None:
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
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
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


def _torchrun_per_node(
    cluster: Any, world_size: int, outdir: str, timeout_s: float, fn: Callable, args: tuple,
    deadline_s: Optional[float], max_restarts: int,
) -> Optional[Exception]:
    """One ``torchrun`` per node of ``cluster``, each in its node's namespace; None when all ended well."""
    if world_size != cluster.world_size:
        raise ValueError(
            f"the emulated cluster holds {cluster.nodes} nodes x {cluster.ranks_per_node} ranks = "
            f"{cluster.world_size}, not {world_size}"
        )
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    with open(os.path.join(outdir, "path.json"), "w") as f:
        json.dump({"path": [p for p in sys.path if p], "main": main if getattr(fn, "__module__", "") == "__main__" else None}, f)
    with open(os.path.join(outdir, "task.pkl"), "wb") as f:
        pickle.dump((timeout_s, fn, args), f)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=cluster.iface, PYTHONUNBUFFERED="1")
    # torchrun shares its rendezvous store with the job by default, and a restarted gloo job may
    # then read the dead attempt's addresses (pytorch/pytorch#135712): the job gets its own store
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])  # gradzip and the caller's modules
    endpoint = f"{cluster.address(0)}:{free_port()}"
    procs, logs = [], []
    for node in range(cluster.nodes):
        cmd = [
            "ip", "netns", "exec", cluster.namespaces[node], sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={cluster.nodes}", f"--nproc-per-node={cluster.ranks_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={os.path.basename(outdir)}",
            # the namespaces share one host name, so say which node holds the rendezvous store
            f"--rdzv-conf=is_host={int(node == 0)}", f"--local-addr={cluster.address(node)}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
            "-m", "gradzip.comm.launch", outdir,
        ]
        logs.append(os.path.join(outdir, f"node{node}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    start = time.monotonic()
    failure: Optional[Exception] = None
    try:
        while any(p.poll() is None for p in procs):
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                failure = RuntimeError(f"ranks still running after {deadline_s:g} s: killed (hung)")
                break
            time.sleep(0.2)
    except BaseException as exc:  # an interrupt: nothing may outlive the parent
        failure = exc
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    if isinstance(failure, (KeyboardInterrupt, SystemExit)):
        raise failure
    bad = [(k, p.returncode) for k, p in enumerate(procs) if p.returncode]
    if failure is None and bad:
        tails = []
        for k, code in bad:
            with open(logs[k]) as f:
                tail = f.read()[-3000:]
            tails.append(f"torchrun of node {k} exited with {code}:\n{tail}")
        failure = RuntimeError("\n".join(tails))
    return failure


def spawn_local(
    fn: Callable, world_size: int, *args: Any, all_ranks: bool = False, timeout_s: float = 300, cluster: Any = None,
    deadline_s: Optional[float] = None, missing_ok: bool = False, ranks_per_node: Optional[int] = None,
    max_restarts: int = 0, start_method: Optional[str] = None,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks.

    Returns rank 0's result, or the list of every rank's result with ``all_ranks=True``. ``fn``
    must be a module-level function (it is pickled into spawned processes). A failure on any
    rank raises ``RuntimeError`` carrying the failing ranks' tracebacks. With ``cluster`` (an
    entered :class:`gradzip.bench.cluster.EmulatedCluster`) one torchrun per node starts the
    node's ranks in its namespace, and gloo talks over the shaped links; ``max_restarts`` is
    torchrun's (the job starts again on every node after a rank fails, as often as that).
    ``start_method``: ``multiprocessing``'s, for loopback ranks (default: :func:`local_context`'s;
    ``"spawn"`` where a rank must start from a fresh interpreter).
    ``timeout_s`` bounds each collective; ``deadline_s`` bounds the whole job: ranks still
    running then are killed and ``RuntimeError`` says so.
    With ``missing_ok`` a rank that exits with status 0 but no result (one that dies on purpose,
    in a fault test) gives ``None`` instead of an error. ``ranks_per_node``: rank r is told, as
    torchrun tells it, that it is local rank ``r % L`` of node ``r // L`` (``GROUP_RANK``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); on a cluster the cluster's layout decides.
    """
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # (a spawned rank reads it as it imports torch; every rank sets one thread)
    try:
        with tempfile.TemporaryDirectory(prefix="gradzip-") as outdir:
            if cluster is not None:
                failure = _torchrun_per_node(cluster, world_size, outdir, timeout_s, fn, args, deadline_s, max_restarts)
            else:
                failure = _spawn(world_size, outdir, timeout_s, ranks_per_node, fn, args, deadline_s, start_method)
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


def _spawn(
    world_size: int, outdir: str, timeout_s: float, ranks_per_node: Optional[int], fn: Callable, args: tuple,
    deadline_s: Optional[float], start_method: Optional[str] = None,
) -> Optional[Exception]:
    """``world_size`` ranks from ``torch.multiprocessing``; None when all ended."""
    import torch.multiprocessing as mp

    default = local_context()  # (which also sets the fork server's preloaded modules, for either method)
    method = start_method or default.get_start_method()
    args_ = (ParentEnvironment(), os.getpid(), world_size, free_port(), outdir, timeout_s, ranks_per_node, fn, args)
    ctx = mp.start_processes(_entry, args=args_, nprocs=world_size, join=False, start_method=method)
    start = time.monotonic()
    try:
        while not ctx.join(timeout=1.0):
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                return RuntimeError(f"ranks still running after {deadline_s:g} s: killed (hung)")
    except Exception as exc:  # collect every rank's story before raising
        return exc
    return None


if __name__ == "__main__":  # a rank started by torchrun (see _torchrun_per_node)
    _torchrun_entry(sys.argv[1])
