"""``gradzip bench allreduce``: time one all-reduce of a big fp32 tensor, plain vs compressed.

This is the micro benchmark of DESIGN.md: the all-reduce of N bytes over W local gloo ranks,
``dist.all_reduce`` in fp32 as the baseline, then gradzip's :class:`~gradzip.Communicator` per
codec (encode, collective and decode all inside the timed region, since that is what a training
step pays). Each method is warmed up once, then timed ``repeats`` times behind a barrier; a run's
time is the slowest rank's (the all-reduce is done when the last rank has its result), and the
report gives the median. On loopback the wire is nearly free, so this mostly measures codec
cost; on a shaped link (emulated cluster) compression pays off.

Bus bandwidth is ``2 (W-1)/W · raw bytes / time`` (the NCCL-tests convention) for every row, so
compressed rows show the *effective* bandwidth they deliver to the training job.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import gradzip
from gradzip.config import parse_value

from ..launch import spawn_local
from . import cluster, write_json

BASELINE_CODECS = ["maxmin:bits=4"]


def parse_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
    """``"maxmin:bits=2:bucket_size=512"`` → ``("maxmin", {"bits": 2, "bucket_size": 512})``.

    Options are ``Communicator`` keywords: codec options, ``memory`` or ``collective``.
    """
    name, *pairs = spec.split(":")
    opts = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"bad option {pair!r} in {spec!r}; expected name:key=value[:key=value]")
        opts[key] = parse_value(value)
    return name, opts


def _timed(op: Callable[[], Any], repeats: int) -> Tuple[List[float], Any]:
    """Warm up once, then time ``repeats`` runs, each behind a barrier; slowest rank per run."""
    out = op()
    times = torch.zeros(repeats, dtype=torch.float64)
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist(), out


def bench_worker(rank: int, world: int, size_mb: float, repeats: int, specs: List[str]) -> List[Dict[str, Any]]:
    """One rank of the benchmark; every rank returns the same rows."""
    numel = int(size_mb * 2**20) // 4
    # a weight-matrix shape, so that codecs which factor matrices (PowerSGD) have one to factor
    shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
    gen = torch.Generator().manual_seed(rank)
    grad = torch.randn(shape, generator=gen)
    raw = numel * 4
    rows = []

    buf = torch.empty_like(grad)

    def plain() -> torch.Tensor:
        buf.copy_(grad)  # all_reduce works in place; a 100 MB copy is small next to the reduce
        dist.all_reduce(buf)
        return buf

    times, out = _timed(plain, repeats)
    exact = out / world
    rows.append({"method": "fp32", "collective": "torch", "times_s": times, "wire_bytes": raw})

    for spec in specs:
        name, opts = parse_spec(spec)
        comm = gradzip.Communicator(name, **opts)
        try:
            times, out = _timed(lambda: comm.allreduce(grad, name="grad"), repeats)
            err = (torch.linalg.vector_norm(out - exact) / torch.linalg.vector_norm(exact)).item()
            rows.append({
                "method": spec,
                "collective": comm.collective_name,
                "times_s": times,
                "wire_bytes": comm.codec.wire_bytes(numel, shape=shape),
                "rel_error": err,
            })
        finally:
            comm.close()

    base = statistics.median(rows[0]["times_s"])
    for r in rows:
        med = statistics.median(r["times_s"])
        r.update(
            median_s=med,
            speedup=base / med,
            ratio=raw / r["wire_bytes"],
            busbw_gbps=2 * (world - 1) / world * raw / med / 1e9,
        )
    return rows


def run_allreduce(
    workers: int = 4, size_mb: float = 100, repeats: int = 5, codecs: Sequence[str] = (),
    json_path: Optional[str] = None, rate: Optional[str] = None,
) -> Dict[str, Any]:
    """Run the benchmark on ``workers`` local ranks; return (and optionally save) the report.

    With ``rate`` (e.g. "1gbit") the ranks run on an emulated cluster with links of that rate;
    where one cannot be built (no root, no iproute2) the report says why and uses loopback.
    """
    specs = BASELINE_CODECS + [c for c in codecs if c not in BASELINE_CODECS]
    for spec in specs:  # fail here, not in W processes: unknown codecs and options raise ValueError
        name, opts = parse_spec(spec)
        gradzip.codec(name, **{k: v for k, v in opts.items() if k not in ("memory", "collective")})
    report: Dict[str, Any] = {"workers": workers, "size_mb": size_mb, "repeats": repeats, "network": "loopback"}
    reason = cluster.available() if rate else None
    if rate and reason is None:
        with cluster.EmulatedCluster(workers, rate) as emu:
            report["network"] = emu.describe()
            rows = spawn_local(bench_worker, workers, size_mb, repeats, specs, cluster=emu)
    else:
        if rate:
            report["network"] = f"loopback (no emulation: {reason})"
        rows = spawn_local(bench_worker, workers, size_mb, repeats, specs)
    link_bps = cluster.parse_rate(rate) if rate and reason is None else None
    for r in rows:  # the physical limit: what each rank must push through its link
        # ring all-reduce, SRA and PS move about 2(W-1)/W payloads per rank; a ring all-gather W-1
        factor = workers - 1 if r["collective"] == "allgather" else 2 * (workers - 1) / workers
        traffic = factor * r["wire_bytes"]
        r["wire_limit_s"] = traffic * 8 / link_bps if link_bps else None
        r["vs_limit"] = r["median_s"] / r["wire_limit_s"] if link_bps else None
    report["rows"] = rows
    return write_json(report, json_path)


def table(report: Dict[str, Any]):
    """The report as a ``rich`` table."""
    from rich import box
    from rich.table import Table

    t = Table(
        title=f"all-reduce of {report['size_mb']:g} MiB fp32 over {report['workers']} gloo ranks (median of {report['repeats']}); {report['network']}",
        caption="time: median; error: ‖result − exact mean‖ / ‖exact mean‖; bus GB/s: 2(W−1)/W · uncompressed bytes / time; "
        "limit: bytes each rank's link carries / link rate (2(W−1)/W payloads; all-gather: W−1)",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
    )
    for col in ("method", "collective", "time s", "speedup", "MB/rank", "ratio", "bus GB/s", "limit s", "× limit", "error"):
        t.add_column(col, justify="left" if col in ("method", "collective") else "right", no_wrap=col != "method", min_width=12 if col == "method" else None)
    for r in report["rows"]:
        err = r.get("rel_error")
        t.add_row(
            # spaces let rich wrap between options; the collective has a column of its own
            " ".join(p for p in r["method"].split(":") if not p.startswith("collective=")),
            r["collective"],
            f"{r['median_s']:.3f}",
            f"{r['speedup']:.2f}×",
            f"{r['wire_bytes'] / 1e6:.2f}",
            f"{r['ratio']:.1f}×",
            f"{r['busbw_gbps']:.2f}",
            "-" if r.get("wire_limit_s") is None else f"{r['wire_limit_s']:.3f}",
            "-" if r.get("vs_limit") is None else f"{r['vs_limit']:.2f}",
            "-" if err is None else f"{err:.1e}",
        )
    return t
