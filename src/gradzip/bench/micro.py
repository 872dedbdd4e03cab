"""``gradzip bench allreduce``: time the all-reduce of a big fp32 tensor, plain vs compressed.

This is the micro benchmark of DESIGN.md: the all-reduce of N bytes over W local gloo ranks,
``dist.all_reduce`` in fp32 as the baseline, then gradzip's :class:`~gradzip.Communicator` per
codec (encode, collective and decode all inside the timed region, since that is what a training
step pays). Each method is warmed up once, then timed ``repeats`` times behind a barrier; a run's
time is the slowest rank's (the all-reduce is done when the last rank has its result), and the
report gives the median. On loopback the wire is nearly free, so this mostly measures codec
cost; on a shaped link (emulated cluster) compression pays off. Several sizes run in one job (one
spawn of the ranks, one emulated cluster), so the rows of a sweep are comparable.

Each row is set against two physical limits. The *wire limit* is the time the bytes each rank
must send need on its link (known only with a link rate). The *codec limit* is the CPU time the
codec needs: per rank, the median over the timed runs of the encode+decode thread CPU seconds,
and the ranks share this machine's cores, so it is the larger of the busiest rank's CPU time and
all ranks' CPU time spread over the usable cores. ``limit_s`` is the larger of the two.

Bus bandwidth is ``2 (W-1)/W · raw bytes / time`` (the NCCL-tests convention) for every row, so
compressed rows show the *effective* bandwidth they deliver to the training job.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import gradzip
from gradzip.comm.base import measure_cpu_time
from gradzip.config import parse_value
from gradzip.sync.engine import check_settings

from ..comm.launch import spawn_local
from . import cluster, write_json

BASELINE_CODECS = ["maxmin:bits=4"]


def parse_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
    """``"maxmin:bits=2:bucket_size=512"`` → ``("maxmin", {"bits": 2, "bucket_size": 512})``.

    Options are ``Communicator`` keywords: codec options, ``memory``, ``collective``,
    ``fusion`` (and, for DDP, ``min_numel`` and ``compress_1d``).
    """
    name, *pairs = spec.split(":")
    opts = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"bad option {pair!r} in {spec!r}; expected name:key=value[:key=value]")
        # (a memory or collective is a name: "none" is the memory of that name, not the default)
        opts[key] = value if key in ("memory", "collective") else parse_value(value)
    return name, opts


# spec keys that are not codec options: the Communicator's and register()'s own keywords (the
# fields of Config other than the codec and the option dictionaries)
NOT_CODEC_OPTIONS = tuple(
    f.name for f in dataclasses.fields(gradzip.Config)
    if f.name not in ("codec", "options", "collective_options", "sources", "given")
)


def collective_options(opts: Dict[str, Any]) -> Dict[str, Any]:
    """``opts`` with the collective's options (``partitions``, ``min_partition``) moved into
    ``collective_options``, as :class:`~gradzip.Communicator` and ``register`` take them."""
    from ..config import COLLECTIVE_OPTIONS

    out = {k: v for k, v in opts.items() if k not in COLLECTIVE_OPTIONS}
    coll = {k: v for k, v in opts.items() if k in COLLECTIVE_OPTIONS}
    if coll:
        out["collective_options"] = coll
    return out


def check_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
    """:func:`parse_spec`, then :func:`check_options`."""
    name, opts = parse_spec(spec)
    check_options(name, opts)
    return name, opts


def check_options(name: str, opts: Dict[str, Any]) -> None:
    """Build what ``register`` would of codec ``name`` with a spec's ``opts`` (its codec, memory
    and collective): ``ValueError`` for an unknown codec, option or setting."""
    resolved = gradzip.Config(codec=name).resolved()  # "auto" is maxmin under the planner
    codec_opts = collective_options(opts)
    coll_opts = codec_opts.pop("collective_options", None)
    options = {**resolved.options, **{k: v for k, v in codec_opts.items() if k not in NOT_CODEC_OPTIONS}}
    settings = {k: v for k, v in codec_opts.items() if k in NOT_CODEC_OPTIONS}
    gradzip.Config(codec=name, **settings)  # register's settings
    check_settings(resolved.codec, options, settings.get("memory", resolved.memory), settings.get("collective"),
                   coll_opts)


def numel_of(size_mb: float) -> int:
    """fp32 elements in ``size_mb`` MiB."""
    return int(size_mb * 2**20) // 4


def check_sizes(sizes_mb: Sequence[float]) -> List[float]:
    """The sizes, duplicates dropped (first kept); ``ValueError`` for one that holds no fp32 value."""
    out: List[float] = []
    for size in sizes_mb:
        if not (math.isfinite(size) and numel_of(size) >= 1):
            raise ValueError(f"size must be a positive number of MiB holding at least one fp32 value, got {size!r}")
        if size not in out:
            out.append(size)
    if not out:
        raise ValueError("no size given")
    return out


def huge_pages() -> str:
    """How Linux backs fresh memory with transparent huge pages (the bracketed choice of
    ``/sys/kernel/mm/transparent_hugepage/enabled``) and whether PyTorch's CPU allocator asks
    for them (``THP_MEM_ALLOC_ENABLE=1``): with 4 KiB pages, touching a fresh 64 MiB tensor
    costs more page faults than a codec's pass over it, so timings of fresh memory differ
    between machines set either way."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        mode = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"
    asked = os.environ.get("THP_MEM_ALLOC_ENABLE", "") == "1"
    return f"{mode}, PyTorch's CPU allocator {'asks for them' if asked else 'does not ask (THP_MEM_ALLOC_ENABLE unset)'}"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), which the ranks it spawns share."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def codec_limit(cpu_s_per_rank: Sequence[float], cores: int) -> float:
    """Seconds the codec work alone needs: the busiest rank, or all ranks' work over ``cores``."""
    if not cpu_s_per_rank:
        return 0.0
    return max(max(cpu_s_per_rank), sum(cpu_s_per_rank) / cores)


def _timed(
    op: Callable[[], Any], repeats: int, cpu_probe: Optional[Callable[[], float]] = None,
) -> Tuple[List[float], Any, float]:
    """Warm up once, then time ``repeats`` runs, each behind a barrier; slowest rank per run.

    Also returns this rank's median per run of ``cpu_probe`` (a running total of codec CPU
    seconds) over ``repeats`` further runs that are not timed, since reading CPU clocks slows a
    run down; 0 without a probe.
    """
    out = op()
    times = torch.zeros(repeats, dtype=torch.float64)
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    cpu: List[float] = [0.0]
    if cpu_probe is not None:
        cpu = []
        measure_cpu_time(True)
        try:
            for _ in range(repeats):
                dist.barrier()
                c0 = cpu_probe()
                op()
                cpu.append(cpu_probe() - c0)
        finally:
            measure_cpu_time(False)
    return times.tolist(), out, statistics.median(cpu)


def _per_rank(value: float, world: int) -> List[float]:
    """Every rank's ``value``, in rank order, on every rank."""
    mine = torch.tensor([value], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


def _codec_cpu_s(comm: gradzip.Communicator) -> float:
    stats = comm.stats()  # the CPU times are there once a call has measured them
    return stats.get("encode_cpu_s", 0.0) + stats.get("decode_cpu_s", 0.0)


def bench_worker(rank: int, world: int, sizes_mb: Sequence[float], repeats: int, specs: List[str]) -> List[Dict[str, Any]]:
    """One rank of the benchmark: every size in turn; every rank returns the same rows."""
    rows: List[Dict[str, Any]] = []
    for size_mb in sizes_mb:
        rows += _bench_size(rank, world, size_mb, repeats, specs)
    return rows


def _bench_size(rank: int, world: int, size_mb: float, repeats: int, specs: List[str]) -> List[Dict[str, Any]]:
    numel = numel_of(size_mb)
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

    times, out, _ = _timed(plain, repeats)
    exact = out / world
    rows.append({
        "size_mb": size_mb, "method": "fp32", "collective": "torch", "times_s": times, "wire_bytes": raw,
        "codec_cpu_s": [0.0] * world,
    })

    for spec in specs:
        name, opts = parse_spec(spec)
        comm = gradzip.Communicator(name, **collective_options(opts))
        try:
            times, out, cpu = _timed(partial(comm.allreduce, grad, name="grad", out=buf), repeats, partial(_codec_cpu_s, comm))  # into the same buffer as fp32
            err = (torch.linalg.vector_norm(out - exact) / torch.linalg.vector_norm(exact)).item()
            rows.append({
                "size_mb": size_mb,
                "method": spec,
                "collective": comm.collective_name,
                "times_s": times,
                "wire_bytes": comm.codec.wire_bytes(numel, shape=shape),
                "rel_error": err,
                "codec_cpu_s": _per_rank(cpu, world),  # per rank: encode+decode thread CPU s per run
            })
        finally:
            comm.close()

    base = statistics.median(rows[0]["times_s"])  # fp32 of this size
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
    workers: int = 4, size_mb: Optional[float] = None, repeats: int = 5, codecs: Sequence[str] = (),
    json_path: Optional[str] = None, rate: Optional[str] = None, sizes_mb: Optional[Sequence[float]] = None,
) -> Dict[str, Any]:
    """Run the benchmark on ``workers`` local ranks; return (and optionally save) the report.

    ``size_mb`` (one size) or ``sizes_mb`` (a sweep, all in one job); default 100 MiB. With
    ``rate`` (e.g. "1gbit") the ranks run on an emulated cluster with links of that rate; where
    one cannot be built (no root, no iproute2) the report says why and uses loopback.
    """
    if size_mb is not None and sizes_mb is not None:
        raise ValueError("give size_mb or sizes_mb, not both")
    sizes = check_sizes(sizes_mb if sizes_mb is not None else [100.0 if size_mb is None else size_mb])
    specs = BASELINE_CODECS + [c for c in codecs if c not in BASELINE_CODECS]
    for spec in specs:  # fail here, not in W processes: unknown codecs and options raise ValueError
        check_spec(spec)
    cores = usable_cores()
    report: Dict[str, Any] = {
        "workers": workers, "sizes_mb": sizes, "repeats": repeats, "network": "loopback", "cores": cores,
    }
    reason = cluster.available() if rate else None
    if rate and reason is None:
        with cluster.EmulatedCluster(workers, rate, prefix=cluster.own_prefix("m")) as emu:
            report["network"] = emu.describe()
            rows = spawn_local(bench_worker, workers, sizes, repeats, specs, cluster=emu)
    else:
        if rate:
            report["network"] = f"loopback (no emulation: {reason})"
        rows = spawn_local(bench_worker, workers, sizes, repeats, specs)
    link_bps = cluster.parse_rate(rate) if rate and reason is None else None
    for r in rows:
        # wire: what each rank must push through its link; ring all-reduce, SRA and PS move
        # about 2(W-1)/W payloads per rank, a ring all-gather W-1
        factor = workers - 1 if r["collective"] == "allgather" else 2 * (workers - 1) / workers
        traffic = factor * r["wire_bytes"]
        r["wire_limit_s"] = traffic * 8 / link_bps if link_bps else None
        # codec: the CPU work of encode and decode, on the cores the ranks share
        r["codec_limit_s"] = codec_limit(r["codec_cpu_s"], cores)
        limit = max(r["wire_limit_s"] or 0.0, r["codec_limit_s"])
        r["limit_s"] = limit or None  # None: no limit known (fp32 on loopback)
        r["vs_limit"] = r["median_s"] / limit if limit else None
    report["rows"] = rows
    return write_json(report, json_path)


def _mib(size_mb: float) -> str:
    return f"{size_mb:g}"


def table(report: Dict[str, Any]):
    """The report as a ``rich`` table (plain text without rich), one section per size."""
    from .tables import table as new_table

    sizes = ", ".join(_mib(s) for s in report["sizes_mb"])
    t = new_table(
        title=f"all-reduce of {sizes} MiB fp32 over {report['workers']} gloo ranks (median of {report['repeats']}); "
        f"{report['network']}",
        caption="time: median; speedup: vs fp32 of the same size; error: ‖result − exact mean‖ / ‖exact mean‖; "
        "bus GB/s: 2(W−1)/W · uncompressed bytes / time; "
        "wire limit: bytes each rank's link carries / link rate (2(W−1)/W payloads; all-gather: W−1); "
        f"codec limit: encode+decode CPU time, max(busiest rank, all ranks / {report['cores']} cores); "
        "× limit: time / the larger limit",
    )
    cols = (
        "size MiB", "method", "collective", "time s", "speedup", "MB/rank", "ratio", "bus GB/s",
        "wire limit s", "codec limit s", "× limit", "error",
    )
    for col in cols:
        t.add_column(col, justify="left" if col in ("method", "collective") else "right", no_wrap=col != "method", min_width=12 if col == "method" else None)
    rows = report["rows"]
    for i, r in enumerate(rows):
        err = r.get("rel_error")
        t.add_row(
            _mib(r["size_mb"]),
            # spaces let rich wrap between options; the collective has a column of its own
            " ".join(p for p in r["method"].split(":") if not p.startswith("collective=")),
            r["collective"],
            f"{r['median_s']:.3f}",
            f"{r['speedup']:.2f}×",
            f"{r['wire_bytes'] / 1e6:.2f}",
            f"{r['ratio']:.1f}×",
            f"{r['busbw_gbps']:.2f}",
            "-" if r.get("wire_limit_s") is None else f"{r['wire_limit_s']:.3f}",
            "-" if not r.get("codec_limit_s") else f"{r['codec_limit_s']:.3f}",
            "-" if r.get("vs_limit") is None else f"{r['vs_limit']:.2f}",
            "-" if err is None else f"{err:.1e}",
            end_section=i + 1 < len(rows) and rows[i + 1]["size_mb"] != r["size_mb"],
        )
    return t
