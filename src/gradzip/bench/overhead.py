"""``gradzip bench overhead``: what a communication hook adds to a real training step.

One process (NCCL on a GPU, gloo on the CPU) sends nothing over a wire, so a DDP step with a
hook costs the step of plain fp32 DDP plus the hook's own work: encoding, decoding, copies and
launches. That is the cost compression must earn back on a real link. With ``workers > 1`` the
ranks share the device and exchange over gloo (CUDA tensors on a GPU), so the step includes a
real exchange and the speed-up over fp32 DDP is the measure. For each model (a real
ResNet-50 forward/backward, GPT-2 small from ``transformers`` under bf16 autocast on a GPU) and
method (fp32 DDP, PyTorch's fp16 and PowerSGD hooks, gradzip's methods) this measures the
median step (every method's model built side by side and timed two steps at a time in turns,
so a drift of the device's speed during the run falls on all methods alike), the overhead
over fp32 DDP (milliseconds and share of the step; and turn by turn, the method's step minus
fp32 DDP's in the same turn, whose quartiles say whether an overhead of a millisecond or two
stands out from the machine's noise), and the link rate at which the method's
exchange would hide behind the step: a rank of a large ring sends about twice its payload per
step, so ``2 · payload · 8 / step`` bits per second (the payload as gradzip counts it; the
gradients' bytes for fp32, half for the fp16 hook).
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import write_json
from .codecs import check_device
from .methods import CONFIGS, attach, describe, rank_group

MODELS = ("resnet50", "gpt2", "resnet18")
DEFAULT_MODELS = ["resnet50", "gpt2"]
DEFAULT_CONFIGS = ["fp32", "torch-fp16", "torch-powersgd", "maxmin4", "powersgd"]
_PER_TURN = 2  # steps a method is timed before the next method's turn (see _interleaved)
# PyTorch's PowerSGD hook chains its all-reduces in future callbacks; on gloo with several DDP
# buckets that deadlocks, even on one rank, so it is measured over NCCL only
GLOO_UNSUPPORTED = {"torch-powersgd": "PyTorch's PowerSGD hook hangs with several DDP buckets on gloo; measure it with --device cuda"}
# the batches of the GPU measurements (ResNet-50 at 32 × 224², GPT-2 small at 4 × 1024 tokens),
# and small ones for the CPU, where a step of the GPU batch would take minutes
BATCHES = {"cuda": {"resnet50": (32, 224), "gpt2": (4, 1024), "resnet18": (32, 224)},
           "cpu": {"resnet50": (2, 64), "gpt2": (1, 128), "resnet18": (2, 32)}}


def check_models(names: Sequence[str]) -> List[str]:
    """The models, each one of :data:`MODELS`; ValueError naming them otherwise."""
    bad = [n for n in names if n not in MODELS]
    if bad:
        raise ValueError(f"unknown model(s) {', '.join(bad)}; choose from {', '.join(MODELS)}")
    return list(names)


def check_config(name: str) -> str:
    """A method: a name of :data:`~gradzip.bench.methods.CONFIGS` (``maxmin4``, ``torch-powersgd``)
    or a codec spec as in ``bench models`` (``maxmin:bits=4``); ValueError naming the choices."""
    if name not in CONFIGS:
        from .models import resolve

        try:
            resolve(name)
        except ValueError as exc:
            raise ValueError(f"{exc}; or one of {', '.join(CONFIGS)}") from None
    return name


def _attach(ddp: Any, name: str, group: Any) -> Any:
    """The method on the DDP model (see :func:`check_config`); gradzip's state or None."""
    if name in CONFIGS:
        return attach(ddp, name, group)
    import gradzip

    from .models import resolve

    method = resolve(name)
    return gradzip.register(ddp, method["codec"], **method["options"])


def _build(name: str, device: torch.device, batch: int, size: int, rank: int = 0) -> Tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The model on ``device`` (the same weights every time, on every rank) and its loss on a
    fixed batch of this rank's."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + rank)
    if name == "gpt2":
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as exc:
            raise RuntimeError("the gpt2 model needs transformers (pip install transformers)") from exc
        model = GPT2LMHeadModel(GPT2Config()).to(device)
        ids = torch.randint(0, model.config.vocab_size, (batch, size), generator=gen).to(device)

        def loss(m: nn.Module) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                return m(input_ids=ids, labels=ids).loss

        return model, loss
    from .models import resnet18, resnet50

    model = (resnet50 if name == "resnet50" else resnet18)().to(device)
    images = torch.randn(batch, 3, size, size, generator=gen).to(device)
    labels = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    return model, lambda m: F.cross_entropy(m(images), labels)


def _median_step(step: Callable[[], None], device: torch.device, steps: int, warmup: int) -> float:
    for _ in range(warmup):  # DDP rebuilds its buckets after the first step; caches warm up
        step()
    return statistics.median(_step_times(step, device, steps))


def _step_times(step: Callable[[], None], device: torch.device, steps: int) -> List[float]:
    """Seconds of each of ``steps`` steps, the device idle before each and waited for after."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def _profile(step: Callable[[], None], device: torch.device, rows: int = 25, trace: Optional[str] = None) -> str:
    """The operators of three steps under ``torch.profiler``, the costliest first (device time on a
    GPU, host time on the CPU): where a method's overhead goes. ``trace``: also write the steps
    there as a Chrome trace (gzipped where the name ends in ``.gz``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(trace)
    averages = prof.key_averages()
    by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return averages.table(sort_by=by, row_limit=rows) + "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=rows)


def _interleaved(built: Sequence[Tuple[str, nn.Module, Any, Callable[[], None]]], device: torch.device,
                 steps: int) -> Dict[str, List[float]]:
    """``steps`` step times of every method, taken two at a time in rounds that rotate which
    method goes first: a device whose speed drifts (clocks, other tenants) shifts them all alike,
    where timing each method's steps in one block would put the drift into the differences."""
    times: Dict[str, List[float]] = {name: [] for name, *_ in built}
    for turn in range(-(-steps // _PER_TURN)):
        shift = turn % len(built)
        for name, _, _, step in [*built[shift:], *built[:shift]]:
            times[name].extend(_step_times(step, device, min(_PER_TURN, steps - len(times[name]))))
    return times


def _paired_overhead(times: Sequence[float], fp32: Sequence[float]) -> Optional[Tuple[float, float, float]]:
    """What a method adds to fp32 DDP's step turn by turn (its mean step in a turn minus fp32's in
    the same turn of :func:`_interleaved`): the median and the quartiles of those differences,
    or None with fewer than two turns. The machine's state moves both within a turn alike, so
    the spread of the differences says how far the overhead itself can be told apart, where the
    spread of the steps says more about the machine."""
    def means(v: Sequence[float]) -> List[float]:
        return [statistics.fmean(v[i : i + _PER_TURN]) for i in range(0, len(v), _PER_TURN)]

    diffs = [a - b for a, b in zip(means(times), means(fp32))]
    if len(diffs) < 2:
        return None
    q1, _, q3 = statistics.quantiles(diffs, n=4, method="inclusive")
    return statistics.median(diffs), q1, q3


def _trace_path(trace_dir: str, model: str, method: str) -> str:
    """``trace_dir/<model>-<method>.json.gz``, the method spec's ``:`` and ``=`` made file-safe."""
    os.makedirs(trace_dir, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in method)
    return os.path.join(trace_dir, f"{model}-{safe}.json.gz")


def _payload_bytes(name: str, model: nn.Module, state: Any, steps: int) -> Optional[float]:
    """Bytes a rank contributes to the exchange per step, or None where not known."""
    raw = sum(p.numel() * p.element_size() for p in model.parameters())
    if state is not None:
        return state.stats()["wire_bytes"] / steps
    spec = CONFIGS.get(name)
    if name == "fp32":
        return float(raw)
    return raw / 2 if spec is not None and spec[0] == "torch:fp16_compress_hook" else None


def _measure(rank: int, world: int, device_name: str, models: Sequence[str], configs: Sequence[str],
             steps: int, warmup: int, batches: Dict[str, Tuple[int, int]], profile: bool = False,
             trace_dir: Optional[str] = None, bucket_view: bool = False) -> Dict[str, Any]:
    """One rank: every model with every method, and each model's step without DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device(device_name)
    group = rank_group(device, world)
    report: Dict[str, Any] = {"models": []}
    for model_name in models:
        batch, size = batches[model_name]
        model, loss_of = _build(model_name, device, batch, size, rank)
        compute = _median_step(lambda: loss_of(model).backward(), device, steps, warmup)
        numel = sum(p.numel() for p in model.parameters())
        model = None  # before the copies of the methods are built
        built: List[Tuple[str, nn.Module, Any, Callable[[], None]]] = []
        try:
            for name in configs:
                model, loss_of = _build(model_name, device, batch, size, rank)
                ddp = DistributedDataParallel(model, device_ids=[device.index or 0] if device.type == "cuda" else None,
                                              process_group=group, gradient_as_bucket_view=bucket_view)
                state = _attach(ddp, name, group)
                built.append((name, model, state, lambda loss_of=loss_of, ddp=ddp: loss_of(ddp).backward()))
                for _ in range(warmup):
                    built[-1][3]()
                if state is not None:
                    state.comm.metrics.reset()
            times = _interleaved(built, device, steps)
            rows = []
            for name, model, state, step in built:
                rows.append({"method": name, "label": describe(name) if name in CONFIGS else f"gradzip {name}",
                             "step_s": statistics.median(times[name]), "step_times_s": times[name],
                             "payload_bytes": _payload_bytes(name, model, state, steps)})
                paired = _paired_overhead(times[name], times["fp32"]) if "fp32" in times else None
                if paired is not None:  # median and quartiles of the per-turn differences
                    rows[-1]["paired_overhead_s"] = list(paired)
                if profile or trace_dir is not None:  # every rank profiles (each step is a collective)
                    trace = _trace_path(trace_dir, model_name, name) if trace_dir is not None and rank == 0 else None
                    table = _profile(step, device, trace=trace)
                    if rank == 0 and profile:  # rank 0's table and trace are kept
                        rows[-1]["profile"] = table
                    if trace is not None:
                        rows[-1]["trace"] = trace
        finally:
            for _, _, state, _ in built:
                if state is not None:
                    state.close()
            built = model = ddp = state = None  # before collecting: the next model needs the memory
            gc.collect()
        fp32 = next((r["step_s"] for r in rows if r["method"] == "fp32"), None)
        for r in rows:
            r["vs_fp32"] = None if fp32 is None else fp32 / r["step_s"]
            r["overhead_s"] = None if fp32 is None else r["step_s"] - fp32
            r["overhead_share"] = None if fp32 is None else (r["step_s"] - fp32) / r["step_s"]
            # a rank of a large ring sends about twice its payload per step
            r["hide_gbps"] = None if r["payload_bytes"] is None else 2 * r["payload_bytes"] * 8 / r["step_s"] / 1e9
        report["models"].append({"model": model_name, "batch": batch, "size": size, "numel": numel,
                                 "compute_s": compute, "rows": rows})
    if group is not None:
        dist.destroy_process_group(group)
    return report


def run(models: Sequence[str] = DEFAULT_MODELS, configs: Optional[Sequence[str]] = None, device: str = "cpu",
        steps: int = 20, warmup: int = 3, json_path: Optional[str] = None, workers: int = 1,
        profile: bool = False, trace_dir: Optional[str] = None, bucket_view: bool = False) -> Dict[str, Any]:
    """Measure on ``workers`` spawned ranks sharing ``device`` (one rank on a GPU: NCCL; else
    gloo) and write rank 0's report. ``configs``: default :data:`DEFAULT_CONFIGS` (without
    PyTorch's PowerSGD hook where the exchange is gloo's). ``profile``: each row also holds the
    operator tables of three profiled steps after the timed ones (``row["profile"]``);
    ``trace_dir``: those steps are also written there as rank 0's Chrome trace per model and
    method (``row["trace"]``, the file's path). ``bucket_view``: every method's DDP (fp32's
    too) is built with ``gradient_as_bucket_view=True``, so its gradients are views of the
    buckets and DDP does not copy the averages into them after the exchange."""
    from ..comm.launch import spawn_local

    dev = check_device(device)
    warmup = max(warmup, 2)  # PyTorch's PowerSGD hook compresses from the second step on
    if workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers}")
    nccl = dev.type == "cuda" and workers == 1
    if configs is None:
        configs = [c for c in DEFAULT_CONFIGS if nccl or c not in GLOO_UNSUPPORTED]
    models, configs = check_models(models), [check_config(c) for c in dict.fromkeys(["fp32", *configs])]
    if not nccl:
        for name in configs:
            if name in GLOO_UNSUPPORTED:
                raise ValueError(f"{name}: {GLOO_UNSUPPORTED[name]}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    batches = BATCHES[dev.type]
    if trace_dir is not None:
        trace_dir = os.path.abspath(trace_dir)  # the ranks may start elsewhere
    report = spawn_local(_measure, workers, str(dev), models, configs, steps, warmup, batches, profile, trace_dir,
                         bucket_view, timeout_s=600, deadline_s=3600)
    backend = "NCCL" if nccl else "gloo"
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU"
    view = ", gradients as bucket views" if bucket_view else ""
    report.update(device=str(dev), steps=steps, warmup=warmup, workers=workers, bucket_view=bucket_view,
                  device_name=f"{where}, {workers} rank{'s' if workers > 1 else ''} over {backend}{view}")
    return write_json(report, json_path)


def table(report: Dict[str, Any]):
    """The report as a ``rich`` table (plain text without rich)."""
    from .tables import table as new_table

    t = new_table(
        title=f"what a hook adds to a step: {report['device_name']}, median of {report['steps']}",
        caption=("overhead: step − fp32 DDP's step, and its share of the step; per turn: the median and quartiles "
                 "of the method's step minus fp32 DDP's in the same turn; hides at: the link rate at which a "
                 "rank's exchange (about twice its payload per step on a large ring) fits in the step"),
    )
    for col in ("model", "method", "step ms", "vs fp32", "overhead ms", "share", "per turn ms", "payload MB",
                "hides at Gbit/s"):
        t.add_column(col, justify="left" if col in ("model", "method") else "right", no_wrap=True)
    for m in report["models"]:
        first = f"{m['model']} ({m['batch']}×{m['size']})"
        t.add_row(first, "no DDP (forward+backward)", f"{m['compute_s'] * 1e3:.1f}", "-", "-", "-", "-", "-", "-")
        for r in m["rows"]:
            t.add_row(
                "", r["method"], f"{r['step_s'] * 1e3:.1f}",
                "-" if r.get("vs_fp32") is None else f"{r['vs_fp32']:.2f}×",
                "-" if r["overhead_s"] is None else f"{r['overhead_s'] * 1e3:+.1f}",
                "-" if r["overhead_share"] is None else f"{r['overhead_share']:.0%}",
                _per_turn(r.get("paired_overhead_s")),
                "-" if r["payload_bytes"] is None else f"{r['payload_bytes'] / 1e6:.1f}",
                "-" if r["hide_gbps"] is None else f"{r['hide_gbps']:.1f}",
            )
    return t


def _per_turn(paired: Optional[Sequence[float]]) -> str:
    """``+1.2 (+0.4…+2.0)``: the median per-turn difference and its quartiles, in ms."""
    if not paired:
        return "-"
    mid, q1, q3 = (v * 1e3 for v in paired)
    return f"{mid:+.1f} ({q1:+.1f}…{q3:+.1f})"
