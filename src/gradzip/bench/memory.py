"""``gradzip bench memory``: the peak memory a rank adds during DDP steps, beside fp32 DDP.

Each method runs in processes of its own (a freed allocation stays resident in the allocator
of the process that made it, so methods sharing processes would hide each other's peaks). A
rank builds the model's gradient set (:mod:`gradzip.bench.models`), wraps it in DDP, registers
the method, notes its resident memory, runs ``warmup`` steps (DDP rebuilds its buckets at the
second, and gradzip's buffer pools plan from the step after it: see :mod:`gradzip.comm.pool`),
then resets the kernel's high-water mark of its resident memory (``VmHWM``, reset by writing 5
to ``/proc/self/clear_refs``) and runs the measured steps. What it adds is the high-water mark
minus the resident memory before the first step: DDP's gradients and buckets, the method's
buffers, residuals and temporaries. Reported in units of the gradient size, and as the excess
over fp32 DDP measured in the same run: the steady state of a long training run. The
warm-up steps' own peak (DDP's first pass in one bucket of the whole model, its rebuild, the
pools before their plan), measured the same way from a mark reset before the first step, is
reported beside it: a run's peak is the larger of the two.
With ``device="cuda"`` the gradient set lives on the GPU and the same is measured with the
caching allocator's statistics (its peak of allocated bytes, reset before the first step and
after the warm-up).
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from ..comm.launch import spawn_local
from .methods import rank_group
from .models import MODELS, ModelSpec, _build, numel, resolve

DEFAULT_CONFIGS = (
    "fp32", "torch-fp16", "maxmin:bits=4", "maxmin:bits=4:in_place=true", "maxmin:bits=4:memory=residual",
    "maxmin:bits=4:memory=residual:in_place=true",
)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def available() -> Optional[str]:
    """None where the peak can be measured here, else why not (Linux's /proc is needed)."""
    try:
        _status_kb("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, RuntimeError) as exc:
        return f"cannot read or reset the resident high-water mark: {exc}"
    return None


def memory_worker(rank: int, world: int, spec: ModelSpec, method: Dict[str, Any], steps: int, warmup: int = 3,
                  device: str = "cpu") -> Dict[str, Any]:
    """One rank: the memory it adds over ``warmup`` + ``steps`` DDP steps. On the CPU its peak
    resident memory; on a GPU the peak of what PyTorch's caching allocator has handed out on
    the device (``torch.cuda.max_memory_allocated``: tensors, not the cache's spare blocks),
    both from before the first step. One rank on a GPU exchanges over NCCL, several sharing it
    over gloo."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gradzip

    dev = torch.device(device)
    group = rank_group(dev, world)
    module, loss_of = _build(spec, rank, world, dev)
    ddp = DistributedDataParallel(module, device_ids=[dev.index or 0] if dev.type == "cuda" else None,
                                  process_group=group, init_sync=False)
    state = None
    if method["kind"] == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(group, getattr(default_hooks, method["hook"]))
    elif method["kind"] == "gradzip":
        state = gradzip.register(ddp, method["codec"], group=group, **method["options"])
    gc.collect()
    dist.barrier()

    def peak_so_far() -> int:
        """The peak since the last reset, after which the peak starts again from what is
        allocated (resident) now."""
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            return peak
        peak = _status_kb("VmHWM") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return peak

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
    else:
        before = _status_kb("VmRSS") * 1024
    peak_so_far()  # (building the model's transients are not the method's)
    # the first steps allocate what stays (gradients, residuals, buffers): counted, since the
    # peak is taken from before them; DDP rebuilds its buckets at the second, a one-off whose
    # transient copies the high-water mark then forgets: the measured steps are the steady state
    for _ in range(warmup):
        loss_of(ddp).backward()
    gc.collect()
    first = peak_so_far()
    for _ in range(steps):
        loss_of(ddp).backward()
    peak = peak_so_far()
    if state is not None:
        state.close()
    if group is not None:
        dist.destroy_process_group(group)
    return {"added_bytes": peak - before, "first_steps_bytes": first - before}


def run_memory(
    model: Union[str, ModelSpec] = "resnet50", configs: Sequence[str] = DEFAULT_CONFIGS, workers: int = 2,
    steps: int = 3, json_path: Optional[str] = None, warmup: int = 3, device: str = "cpu",
) -> Dict[str, Any]:
    """Every method in ``configs`` on ``workers`` local ranks over loopback; the report.
    ``model``: a name of :data:`gradzip.bench.models.MODELS` or a spec of one's own.
    ``device``: ``cpu`` (resident memory) or ``cuda[:index]`` (memory allocated on the GPU,
    which the ranks share); ValueError for one this machine does not have."""
    from .codecs import check_device

    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    why = available() if dev.type == "cpu" else None
    if why is not None:
        raise RuntimeError(f"gradzip bench memory: {why}")
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; valid models: {', '.join(MODELS)}")
        model = MODELS[model]
    methods = [resolve(c) for c in configs]
    grad_bytes = numel(model.shapes()) * 4
    rows: List[Dict[str, Any]] = []
    started = time.perf_counter()
    # large blocks straight from the kernel and back: what a rank holds is then what it uses,
    # not what glibc's heap kept of earlier steps (the same for every method)
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 17)
    try:  # (fresh interpreters: glibc reads that setting when a process starts, and a rank forked
        # from a server would count its first touch of torch's pages as memory it added)
        per_method = [spawn_local(memory_worker, workers, model, m, steps, warmup, str(dev), all_ranks=True,
                                   start_method="spawn")
                      for m in methods]
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    for method, per_rank in zip(methods, per_method):
        added = [r["added_bytes"] for r in per_rank]
        first = [r["first_steps_bytes"] for r in per_rank]
        rows.append({
            "method": method["method"], "label": method["label"], "added_bytes": added,
            "added_x": statistics.median(added) / grad_bytes,
            "first_steps_bytes": first, "first_steps_x": statistics.median(first) / grad_bytes,
        })
    fp32 = next((r for r in rows if r["method"] == "fp32"), None)
    for r in rows:
        r["over_fp32_x"] = None if fp32 is None else r["added_x"] - fp32["added_x"]
        r["first_steps_over_fp32_x"] = None if fp32 is None else r["first_steps_x"] - fp32["first_steps_x"]
    report = {
        "model": model.name, "workers": workers, "warmup": warmup, "steps": steps, "gradient_bytes": grad_bytes, "rows": rows,
        "wall_s": time.perf_counter() - started, "device": str(dev),
        "measure": "peak allocated on the GPU" if dev.type == "cuda" else "peak resident",
    }
    if dev.type == "cuda":
        report["device_name"] = torch.cuda.get_device_name(dev)
    if json_path:
        if os.path.dirname(json_path):
            os.makedirs(os.path.dirname(json_path), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def table(report: Dict[str, Any]):
    from .tables import table as new_table

    where = f" on {report.get('device_name', report['device'])}" if report.get("device", "cpu") != "cpu" else ""
    t = new_table(
        title=f"Peak memory a rank adds during {report['steps']} DDP steps, {report['model']} "
        f"({report['gradient_bytes'] / 1e6:.0f} MB of gradients), {report['workers']} ranks{where}",
    )
    headers = ["method", "added (MB, median rank)", "× gradients", "over fp32 DDP (× gradients)",
               f"warm-up steps ({report['warmup']}), over fp32"]
    for header in headers:
        t.add_column(header, justify="left" if header == "method" else "right")
    for r in report["rows"]:
        over = "-" if r["over_fp32_x"] is None else f"{r['over_fp32_x']:+.2f}"
        first = r.get("first_steps_over_fp32_x")  # (absent from reports made before it was measured)
        t.add_row(r["label"], f"{statistics.median(r['added_bytes']) / 1e6:.0f}", f"{r['added_x']:.2f}", over,
                  "-" if first is None else f"{first:+.2f}")
    return t
