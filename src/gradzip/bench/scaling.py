"""``gradzip bench scale``: calibrate the scaling model here, check it against measured runs, predict.

:mod:`gradzip.policy.scaling` predicts a DDP step on N nodes × L ranks from a few rates. This
module measures those rates on this machine, one core each, with what really runs: a memory
copy, an fp32 sum, the codec's encode and decode, and the CPU that gloo's sockets cost per byte
(two loopback ranks, their process CPU time over the bytes they sent and received); the link's
rate is the emulated one (its efficiency: a plain all-reduce over it, when an emulated cluster
can be built). It then

- **validates**: for each saved ``gradzip bench models`` report of several nodes, the model's
  prediction of every row beside the measured median (the report's own compute row is the model's
  compute; the ranks share this machine's cores, so the CPU is stretched by ranks/cores);
- **predicts** speed-ups over fp32 DDP and the fp16 hook for 2…128 nodes × 1…8 ranks at 1, 10,
  25 and 100 Gbit/s with a core per rank, and the link rate where compression stops paying.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..policy.scaling import METHODS, Rates, break_even_bps, predict, speedups
from . import write_json

NODES = (2, 4, 8, 16, 32, 64, 128)
RANKS = (1, 2, 4, 8)
LINKS_GBIT = (1, 10, 25, 100)
ROW_METHOD = {
    "fp32": "fp32", "torch-fp16": "fp16", "maxmin4": "gradzip", "maxmin:bits=4:hierarchy=off": "gradzip-flat",
    "maxmin:bits=4:memory=residual:hierarchy=off": "gradzip-flat",
}


def _per(op, units: float, repeats: int = 5) -> float:
    op()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / units


def cpu_rates(values: int = 1 << 22, codec: str = "maxmin", **options: Any) -> Dict[str, float]:
    """Seconds per byte or value of one core's memory copy, fp32 sum, and ``codec``'s encode and
    decode (4-bit max-min with its default buckets unless told), and its wire bytes per fp32 byte."""
    from .. import codecs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(values, generator=g), torch.randn(values, generator=g)
        c = codecs.codec(codec, **(options or {"bits": 4}))
        payload = c.encode(x)
        return {
            "copy_s_per_byte": _per(lambda: y.copy_(x), 4 * values),
            "add_s_per_value": _per(lambda: y.add_(x), values),
            "encode_s_per_value": _per(lambda: c.encode(x), values),
            "decode_s_per_value": _per(lambda: c.decode_into(payload, y, accumulate=True), values),
            "payload_ratio": c.wire_bytes(values) / (4 * values),
        }
    finally:
        torch.set_num_threads(threads)


def _socket_worker(rank: int, world: int, values: int, repeats: int) -> float:
    t = torch.ones(values)
    dist.all_reduce(t)
    cpu0 = time.process_time()
    for _ in range(repeats):
        dist.all_reduce(t)
    cpu = time.process_time() - cpu0
    moved = 2 * 2 * (world - 1) / world * 4 * values * repeats  # sent and received, ring
    adds = (world - 1) / world * values * repeats
    return cpu, moved, adds


def socket_rate(values: int = 1 << 22, repeats: int = 5) -> float:
    """CPU seconds gloo spends per byte sent or received (loopback; the sum's share taken out)."""
    from ..comm.launch import spawn_local

    add = cpu_rates(1 << 20)["add_s_per_value"]
    cpu, moved, adds = spawn_local(_socket_worker, 2, values, repeats)
    return max(0.0, cpu - adds * add) / moved


def link_efficiency(rate: str, values: int = 1 << 22) -> Optional[float]:
    """The share of an emulated link's rate a plain 2-node all-reduce reaches (None: no emulation)."""
    from ..comm.launch import spawn_local
    from . import cluster

    if cluster.available() is not None:
        return None
    with cluster.EmulatedCluster(2, rate, prefix=cluster.own_prefix("s")) as c:
        seconds = spawn_local(_timed_allreduce, 2, values, cluster=c)
    return (2 * 4 * values / 2) * 8 / cluster.parse_rate(rate) / seconds


def _timed_allreduce(rank: int, world: int, values: int) -> float:
    t = torch.ones(values)
    dist.all_reduce(t)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_factors(rates: Rates, model: str = "resnet50", repeats: int = 3) -> tuple:
    """Measured over modelled exchange CPU of fp32 DDP, the fp16 hook, gradzip flat and gradzip
    hierarchical: DDP steps over ``model``'s gradients on loopback (no shaped link), 2 ranks flat,
    then 2 nodes x 2 ranks, each run ``repeats`` times (the median factor: on a shared machine one
    run's CPU times vary by tens of percent). What the rates of single operations miss: Python,
    the autograd hooks, caches and memory bandwidth shared between processes, fresh pages."""
    from .models import run_models

    runs: List[List[float]] = []
    for _ in range(repeats):
        out = []
        for workers, per_node, rows in (
            (2, 1, (("fp32", "fp32"), ("torch-fp16", "fp16"), ("maxmin4", "gradzip-flat"))),
            (4, 2, (("maxmin4", "gradzip"),)),
        ):
            report = run_models([model], workers=workers, rate=None, steps=4, warmup=2, ranks_per_node=per_node)
            m = report["models"][0]
            compute = statistics.median(m["compute_cpu_s"])
            ddp_copies = 2 * 4 * m["numel"] * rates.copy_s_per_byte
            for row_name, method in rows:
                row = next(r for r in m["rows"] if r["method"] == row_name)
                measured = statistics.median(row["cpu_s"]) - compute - ddp_copies
                modelled = predict(method, workers // per_node, per_node, m["numel"], rates).cpu_s - ddp_copies
                out.append(max(measured, 0.0) / modelled)
        runs.append(out)
    return tuple(statistics.median(run[k] for run in runs) for k in range(len(METHODS)))


def calibrate(rate: str = "1gbit") -> Rates:
    """The rates of this machine with a core per rank, on a link of ``rate``."""
    from . import cluster

    cpu = cpu_rates()
    eff = link_efficiency(rate)
    rates = Rates(
        link_bps=cluster.parse_rate(rate), link_alpha_s=0.0 if eff is not None else 50e-6,
        link_efficiency=eff if eff is not None else 0.9, node_bytes_per_s=1 / cpu["copy_s_per_byte"],
        socket_s_per_byte=socket_rate(), **cpu,
    )
    return rates.with_(cpu_factor=cpu_factors(rates))


def validate(report: Dict[str, Any], rates: Rates) -> List[Dict[str, Any]]:
    """Every row of a ``bench models`` report that the model knows, predicted beside measured."""
    from . import cluster

    W, L = report["workers"], report.get("ranks_per_node") or 1
    r = rates.with_(link_bps=cluster.parse_rate(report["rate"]), ranks_per_core=W / report["cores"])
    out = []
    for model in report["models"]:
        compute = statistics.median(model["compute_cpu_s"])  # one rank's forward + backward CPU
        for row in model["rows"]:
            method = ROW_METHOD.get(row["method"])
            if method is None:
                continue
            p = predict(method, W // L, L, model["numel"], r, compute, groups=model.get("buckets") or 1)
            out.append({
                "model": model["model"], "nodes": W // L, "ranks_per_node": L, "rate": report["rate"],
                "method": row["method"], "measured_s": row["median_s"], "predicted_s": p.step_s,
                "error": p.step_s / row["median_s"] - 1, "bound": "wire" if p.wire_s >= p.cpu_s else "cpu",
            })
    return out


def models_report(path: str) -> Dict[str, Any]:
    """A saved ``bench models`` report over an emulated link, or a ``ValueError`` that says why
    ``path`` is not one."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a 'gradzip bench models' report ({exc})") from exc
    if not isinstance(report, dict) or not {"models", "workers", "cores"} <= report.keys():
        raise ValueError(f"{path}: not a 'gradzip bench models' report (it has no models, workers and cores)")
    if not report.get("rate"):
        raise ValueError(f"{path}: ran on loopback, without a link to check the model against: give a run "
                         "over an emulated link (gradzip bench models --rate 1gbit, ...)")
    return report


def load_rates(path: str) -> Rates:
    """The calibrated rates saved in an earlier ``bench scale`` report."""
    with open(path) as f:
        saved = json.load(f)
    if not isinstance(saved, dict) or "rates" not in saved:
        raise ValueError(f"{path}: not a 'gradzip bench scale' report (it has no calibrated rates)")
    saved = saved["rates"]
    return Rates(**{**saved, "cpu_factor": tuple(saved["cpu_factor"])})


def run_scale(reports: Sequence[str] = (), rate: str = "1gbit", json_path: Optional[str] = None,
              values: int = 25_557_032, compute_s: float = 0.0, rates: Optional[Rates] = None) -> Dict[str, Any]:
    """Calibrate (unless given ``rates``), validate against ``reports`` (paths of saved model
    reports), predict the grid."""
    loaded = [models_report(path) for path in reports]  # (before calibrating: a bad one says so at once)
    rates = calibrate(rate) if rates is None else rates
    checks = []
    for report in loaded:
        checks += validate(report, rates)
    grid = []
    for gbit in LINKS_GBIT:
        grid += speedups(values, rates.with_(link_bps=gbit * 1e9, link_alpha_s=50e-6), NODES, RANKS, compute_s)
    even = {L: break_even_bps(values, rates.with_(link_alpha_s=50e-6), 16, L, compute_s) for L in RANKS}
    report = {
        "rates": rates.__dict__, "values": values, "compute_s": compute_s, "validation": checks, "grid": grid,
        "break_even_bps_16_nodes": even, "methods": list(METHODS),
    }
    return write_json(report, json_path)


def tables(report: Dict[str, Any]) -> List[Any]:
    """The validation (predicted beside measured) and the prediction grid at 16 nodes, as tables."""
    from .tables import table as new_table

    out = []
    if report["validation"]:
        t = new_table(title="Scaling model against the emulated cluster (ranks share this machine's cores)")
        for header in ["model", "nodes x ranks", "rate", "method", "measured s", "predicted s", "error", "bound"]:
            t.add_column(header, justify="left" if header in ("model", "method", "bound") else "right")
        for v in report["validation"]:
            t.add_row(
                v["model"], f"{v['nodes']}x{v['ranks_per_node']}", v["rate"], v["method"], f"{v['measured_s']:.3f}",
                f"{v['predicted_s']:.3f}", f"{v['error']:+.0%}", v["bound"],
            )
        out.append(t)
    t = new_table(
        title=f"Predicted speed-up of gradzip 4-bit over fp32 DDP / the fp16 hook, {report['values'] / 1e6:.1f} M "
        "values, a core per rank (hierarchical where ranks/node > 1)",
    )
    t.add_column("nodes x ranks", justify="right")
    for gbit in LINKS_GBIT:
        t.add_column(f"{gbit} Gbit/s", justify="right")
    cells: Dict[tuple, Dict[float, str]] = {}
    for g in report["grid"]:
        cells.setdefault((g["nodes"], g["ranks_per_node"]), {})[g["link_bps"]] = f"{g['vs_fp32']:.1f}× / {g['vs_fp16']:.1f}×"
    for (n, l), by_rate in cells.items():
        if n in (2, 8, 32, 128):
            t.add_row(f"{n}x{l}", *[by_rate.get(gbit * 1e9, "-") for gbit in LINKS_GBIT])
    out.append(t)
    return out


def plot(report: Dict[str, Any], path: str) -> None:
    """Predicted speed-up over fp32 DDP and over the fp16 hook against node count, a line per link
    rate (8 ranks per node, hierarchical), with the validation points measured here."""
    from .plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, key, label in ((axes[0], "vs_fp32", "fp32 DDP"), (axes[1], "vs_fp16", "PyTorch fp16 hook")):
        for k, gbit in enumerate(LINKS_GBIT):
            for L, style in ((8, "-"), (1, ":")):
                pts = [g for g in report["grid"] if g["link_bps"] == gbit * 1e9 and g["ranks_per_node"] == L]
                ax.plot([g["nodes"] for g in pts], [g[key] for g in pts], style, marker="o", ms=3, color=f"C{k}",
                        label=f"{gbit} Gbit/s, {L} rank{'s' if L > 1 else ''}/node")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel(f"speed-up over {label}")
        ax.set_title(f"gradzip 4-bit vs {label}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Predicted by the scaling model, {report['values'] / 1e6:.1f} M gradients, a core per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
