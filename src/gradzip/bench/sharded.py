"""``gradzip bench fsdp``: FSDP2 steps over real models' gradient sets, fp32, bf16 reduce and gradzip.

The model has a real model's parameter shapes (:mod:`gradzip.bench.models`), grouped into its
blocks (ResNet-50: the stem, its 16 bottlenecks and the head; a transformer: its layers), each
block one ``fully_shard`` unit with a forward that costs next to nothing (``x · Σ ½‖p‖²`` over
its parameters), so a step is FSDP2's weight all-gather and gradient reduce-scatter.
``reshard_after_forward=False``, as for a model that fits unsharded between forward and
backward. Methods: fp32 FSDP2, FSDP2 with a bf16 reduce (``MixedPrecisionPolicy``), and
gradzip specs (``maxmin:bits=4:memory=residual``). The ranks run on the emulated cluster where
one can be built, as :mod:`gradzip.bench.models` does.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from . import write_json
from .models import MODELS

DEFAULT_CONFIGS = ("fp32", "bf16-reduce", "maxmin:bits=4:memory=residual", "maxmin:bits=4:memory=residual:weight_bits=8")


class Block(nn.Module):
    """One unit: parameters of the given shapes; ``forward(x)`` adds ``x · Σ ½‖p‖²`` to ``acc``."""

    def __init__(self, shapes: List[tuple], gen: torch.Generator) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.empty(s).normal_(0.0, 0.02, generator=gen)) for s in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * sum(torch.linalg.vector_norm(p).square() for p in self.params)


class BlockModel(nn.Module):
    """A model's parameter shapes grouped into blocks by name: ``layer1.0.conv1.weight`` belongs to
    block ``layer1.0``; names with fewer parts to the block of their first part."""

    def __init__(self, shapes: Sequence[tuple], seed: int = 0) -> None:
        super().__init__()
        groups: "OrderedDict[str, List[tuple]]" = OrderedDict()
        for name, shape in shapes:
            parts = name.split(".")
            key = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
            groups.setdefault(key, []).append(shape)
        gen = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(Block(s, gen) for s in groups.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b(x) for b in self.blocks)


def shard(model: nn.Module, units: Sequence[nn.Module], bf16_reduce: bool = False, **options: Any) -> nn.Module:
    """``model`` in FSDP2: each of ``units`` ``fully_shard``-ed, then the root (the benchmarks'
    wrapping); ``bf16_reduce``: FSDP2's own bf16 reduce (``MixedPrecisionPolicy``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if bf16_reduce:
        options["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for unit in units:
        fully_shard(unit, **options)
    return fully_shard(model, **options)


def _method(spec: str) -> Dict[str, Any]:
    from .micro import parse_spec

    if spec in ("fp32", "bf16-reduce"):
        return {"method": spec, "kind": spec}
    codec, opts = parse_spec(spec)
    return {"method": spec, "kind": "gradzip", "codec": codec, "options": opts}


def fsdp_worker(rank: int, world: int, model: str, methods: List[Dict[str, Any]], steps: int, warmup: int) -> Dict[str, Any]:
    import gradzip

    torch.set_num_threads(1)
    x = torch.tensor(1.0 + rank / world)  # the ranks' gradients differ
    rows = []
    numel = units = 0
    for m in methods:
        module = BlockModel(MODELS[model].shapes())
        numel, units = sum(p.numel() for p in module.parameters()), len(module.blocks) + 1
        shard(module, module.blocks, m["kind"] == "bf16-reduce", reshard_after_forward=False)
        state = gradzip.register(module, m["codec"], **m["options"]) if m["kind"] == "gradzip" else None
        times, cpu = [], []
        for i in range(warmup + steps):
            module.zero_grad(set_to_none=True)
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            module(x).backward()
            dist.barrier()
            if i >= warmup:
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times.append(float(took))
                cpu.append(time.process_time() - c0)
        row = {"method": m["method"], "times_s": times, "median_s": statistics.median(times), "cpu_s": statistics.median(cpu)}
        if state is not None:
            stats = state.stats()
            row["wire_bytes"] = stats["wire_bytes"] / (warmup + steps)
            row["sent_bytes"] = stats["sent_bytes"] / (warmup + steps)  # over the slow link, where hierarchical
            row["topology"] = state.plan()["topology"]
            row["units"] = stats["units"]
            state.close()
        rows.append(row)
        del module
    return {"model": model, "numel": numel, "units": units, "rows": rows}


def run_fsdp(model: str = "resnet50", configs: Sequence[str] = DEFAULT_CONFIGS, workers: int = 4,
             rate: Optional[str] = "1gbit", steps: int = 3, warmup: int = 2, json_path: Optional[str] = None,
             ranks_per_node: int = 1) -> Dict[str, Any]:
    """Every method on ``workers`` ranks (an emulated cluster of ``workers / ranks_per_node``
    nodes where it can; the ranks of a node share its link and are told their node as torchrun
    tells them)."""
    from ..comm.launch import spawn_local
    from . import cluster

    if workers % ranks_per_node:
        raise ValueError(f"workers ({workers}) must be a multiple of ranks_per_node ({ranks_per_node})")
    methods = [_method(c) for c in configs]
    report: Dict[str, Any] = {"workers": workers, "ranks_per_node": ranks_per_node, "rate": rate, "network": "loopback",
                              "steps": steps}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        emu = None
        if rate:
            reason = cluster.available()
            if reason is None:
                emu = stack.enter_context(
                    cluster.EmulatedCluster(workers // ranks_per_node, rate, prefix=cluster.own_prefix("f"), ranks_per_node=ranks_per_node)
                )
                report["network"] = emu.describe()
            else:
                report["network"] = f"loopback (no emulation: {reason})"
                print(f"gradzip bench fsdp: no emulated {rate} cluster ({reason}); running on loopback", file=sys.stderr)
        result = spawn_local(fsdp_worker, workers, model, methods, steps, warmup, cluster=emu,
                             ranks_per_node=ranks_per_node if ranks_per_node > 1 else None)
    fp32 = next((r["median_s"] for r in result["rows"] if r["method"] == "fp32"), None)
    bf16 = next((r["median_s"] for r in result["rows"] if r["method"] == "bf16-reduce"), None)
    raw = result["numel"] * 4 * (workers - 1) / workers  # fp32 reduce-scatter bytes a rank sends
    for r in result["rows"]:
        r["vs_fp32"] = fp32 / r["median_s"] if fp32 else None
        r["vs_bf16"] = bf16 / r["median_s"] if bf16 else None
        sent = {"fp32": raw, "bf16-reduce": raw / 2}.get(r["method"])
        if sent is None and "sent_bytes" in r:
            sent = r["sent_bytes"]
        r["reduce_scatter_bytes"] = sent
    report.update(result, wall_s=time.perf_counter() - t0)
    return write_json(report, json_path)


def table(report: Dict[str, Any]):
    from .tables import table as new_table

    t = new_table(
        title=f"FSDP2 over {report['model']}'s gradient set ({report['numel'] / 1e6:.1f} M values, {report['units']} units), "
        f"{report['workers']} ranks, {report['network']}",
    )
    for h in ["method", "s/step", "vs fp32 FSDP2", "vs bf16 reduce", "reduce-scatter MB/rank", "CPU s"]:
        t.add_column(h, justify="left" if h == "method" else "right")
    for r in report["rows"]:
        t.add_row(
            r["method"], f"{r['median_s']:.3f}", f"{r['vs_fp32']:.2f}×" if r["vs_fp32"] else "-",
            f"{r['vs_bf16']:.2f}×" if r["vs_bf16"] else "-",
            f"{r['reduce_scatter_bytes'] / 1e6:.1f}" if r.get("reduce_scatter_bytes") else "-", f"{r['cpu_s']:.3f}",
        )
    return t
