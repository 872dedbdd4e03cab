"""Start real worker processes (gloo on CPU) for multi-rank tests."""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    for key in [k for k in os.environ if k.startswith("GRADZIP_")]:
        del os.environ[key]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args: Any) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled into spawned processes). A failure on
    any rank raises with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        try:
            mp.spawn(_entry, args=(world_size, port, outdir, fn, args), nprocs=world_size, join=True)
        except Exception as exc:
            errors = []
            for r in range(world_size):
                path = os.path.join(outdir, f"{r}.pt")
                if os.path.exists(path):
                    rec = torch.load(path, weights_only=False)
                    if not rec["ok"]:
                        errors.append(f"rank {r}:\n{rec['error']}")
            raise AssertionError("worker failed:\n" + ("\n".join(errors) or str(exc))) from None
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)["result"] for r in range(world_size)]
