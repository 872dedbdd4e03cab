"""The planner: whether compressing a group pays on this link and this CPU (HiPress's cost model).

HiPress (Bai et al., SOSP'21) decides offline, per gradient, whether to compress, from a cost
model of the network and the codec. gradzip calibrates its model online, once, at
registration, on the process group the gradients will cross, and from what will really run:

- A throwaway communicator with the same codec, memory and collective, on the same process
  group, exchanges groups of 32 Ki, 256 Ki and 1 Mi fp32 values (128 KiB to 4 MiB) both ways:
  compressed (error feedback, encode, the collective, decode) and plain (gradzip's in-place
  all-reduce), a few times each, on every rank at once. Ranks that share cores or a link
  measure the sharing. Each time, ``GROUPS`` groups go side by side, stage by stage, as the
  pipeline runs a step's groups, so one group's encode overlaps another's transfer; a group's
  cost is the total over ``GROUPS``. (Timed one at a time, CPU and wire add up, and on a slow
  link that undervalued compression.)
- A line ``t = alpha + beta·values`` is fitted to each way's medians: latency and per-value
  cost, the wire and the CPU together, as this machine and this link give them. Composing the
  cost from separately timed parts (an all-reduce, the codec on one core, a memory copy)
  missed most of the compressed path's CPU work on shared cores, and picked compression on
  loopback, where it lost.
- Every rank takes the slowest rank's figures (one all-reduce with MAX), so every rank holds
  the same floats and makes the same decisions without another exchange.

A group of ``n`` values (a fused group priced at its size padded to codec blocks) is
compressed only where the compressed line is below 0.4 of the plain one at its size
(``MARGIN``). Timed alone, a plain all-reduce costs up to twice what it costs inside a DDP
step, where part of it hides behind the backward pass (on loopback with 4 ranks on 2 cores:
ResNet-50's gradients 391 ms predicted, 194 ms measured), while the compressed predictions
held (226 against 237 ms); and a bucket of plain and compressed gradients copies its plain ones
into one buffer, where a bucket left wholly plain is all-reduced in place. So compression must
win even against a plain all-reduce half as dear as calibrated, and by a further tenth: on
loopback, where it never pays here, the lines put compression at 0.50–0.65 of the plain cost
for groups of 1–2 Mi values (a ViT-B/16 plan at 0.498 compressed half its groups and ran at
0.71× fp32's speed), and at 10 Gbit/s at 0.40–0.47. A 16-bit
gradient's plain all-reduce moves half the bytes: its plain cost per value is halved.

What it does not yet do: choose the collective or the number of partitions per group, model
the overlap the pipeline gives, and re-calibrate when measured times drift from the
predictions (``state.plan()`` shows both).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .codecs.base import Codec
from .plan import padding

SIZES = (1 << 15, 1 << 18, 1 << 20)  # values per group of the calibration exchanges
GROUPS = 4  # groups exchanged side by side per timing
REPEATS = 3
MARGIN = 0.6  # compression must save this fraction of the plain all-reduce's predicted time


@dataclass
class Line:
    """Seconds of one exchange: ``alpha + beta·values``."""

    alpha: float
    beta: float

    def at(self, values: float) -> float:
        return self.alpha + self.beta * values


@dataclass
class Costs:
    """The calibrated model: a line for the plain all-reduce and one for the compressed exchange."""

    plain: Line
    compressed: Line
    world_size: int

    def plain_s(self, numel: int, element_size: int = 4) -> float:
        """Predicted seconds of a plain all-reduce of ``numel`` values of ``element_size`` bytes."""
        return self.plain.at(numel * element_size / 4)

    def compressed_s(self, numel: int) -> float:
        """Predicted seconds of one compressed exchange of ``numel`` values (padding included)."""
        return self.compressed.at(numel)

    def as_dict(self) -> Dict[str, float]:
        return {
            "plain_alpha_s": self.plain.alpha, "plain_s_per_value": self.plain.beta,
            "compressed_alpha_s": self.compressed.alpha, "compressed_s_per_value": self.compressed.beta,
            "world_size": self.world_size,
        }


def calibrate(comm: Any, device: Optional[torch.device] = None, repeats: int = REPEATS) -> Costs:
    """Time ``comm``'s plain and compressed exchanges on its process group, with tensors on
    ``device`` (the gradients' device: CUDA for NCCL); the slowest rank's lines.

    Every rank must call it at the same point (registration): it issues collectives on the group.
    """
    device = torch.device("cpu") if device is None else device
    from .communicator import Communicator
    from .pipeline import drive

    probe = Communicator(
        comm.codec.name, memory=comm.memory.name, collective=comm.collective_name, group=comm.group,
        memory_options=comm.memory.config(),
        collective_options=comm.collective.config(),
        dedicated_group=False, verify_settings=False, fusion=False, pipeline=False, **comm.codec.config(),
    )
    w = probe.world_size
    plain, packed = [], []
    try:
        for n in SIZES:
            x = torch.randn(GROUPS * n, generator=torch.Generator().manual_seed(n)).to(device)
            buf = torch.empty(GROUPS * n, device=device)  # groups back to back, as in a DDP bucket
            parts = [buf[i * n : (i + 1) * n] for i in range(GROUPS)]
            for compress, points in ((False, plain), (True, packed)):
                names = [f"planner.{n}.{int(compress)}.{i}" for i in range(GROUPS)]

                def once() -> None:
                    drive(probe.reduce_many_stages(
                        parts, names, [compress] * GROUPS, inplace=True, groups=[[i] for i in range(GROUPS)],
                    ))
                    if device.type == "cuda":  # host timers: wait for the kernels and collectives
                        torch.cuda.synchronize(device)

                def fresh() -> None:
                    buf.copy_(x)  # the exchanges average in place: the same input every time

                fresh()
                once()  # first touch of the buffers, connections
                if w > 1:
                    dist.barrier(group=comm.group)
                points.append((n, median_seconds(once, repeats, before=fresh) / GROUPS))
    finally:
        probe.close()
    figures = torch.tensor([*fit(plain), *fit(packed)], dtype=torch.float64, device=device)
    if w > 1:
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=comm.group)
    a_p, b_p, a_c, b_c = figures.cpu().tolist()
    return Costs(Line(a_p, b_p), Line(a_c, b_c), world_size=w)


def median_seconds(fn, repeats: int, before=None) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` (``before()``, untimed, ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """Least-squares ``t = alpha + beta·x`` through ``(x, seconds)`` points, both kept ≥ 0."""
    xs = [float(b) for b, _ in points]
    ys = [float(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    beta = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    alpha = max(0.0, my - beta * mx)
    return alpha, beta


@dataclass
class Decision:
    """One group's choice: ``compress`` or not, with both predictions in seconds (NaN: not planned)."""

    group: int
    members: List[str]
    numel: int
    compress: bool
    plain_s: float
    compressed_s: float

    @property
    def predicted_s(self) -> float:
        return self.compressed_s if self.compress else self.plain_s


def padded_numel(codec: Codec, params: Sequence[torch.Tensor]) -> int:
    """Values one encoding of a group covers: each member padded to whole blocks of
    :meth:`Codec.fusion_block` in a fused buffer, or the members as they are where the codec
    cannot fuse (then each goes on its own)."""
    block = codec.fusion_block()
    if len(params) > 1 and block > 0:
        return sum(p.numel() + padding(p.numel(), block) for p in params)
    return sum(p.numel() for p in params)


def decide(
    groups: Sequence[Sequence[str]], params: Mapping[str, torch.Tensor], codec: Codec, costs: Optional[Costs],
) -> List[Decision]:
    """Compress a group only where its predicted exchange beats the plain all-reduce by
    ``MARGIN``; every group, with NaN predictions, when there is no model (``costs`` None:
    planning is off)."""
    out = []
    for g, members in enumerate(groups):
        tensors = [params[m] for m in members]
        n = sum(t.numel() for t in tensors)
        if costs is None:
            out.append(Decision(g, list(members), n, True, float("nan"), float("nan")))
            continue
        plain = costs.plain_s(n, tensors[0].element_size())
        packed = costs.compressed_s(padded_numel(codec, tensors))
        out.append(Decision(g, list(members), n, packed < (1 - MARGIN) * plain, plain, packed))
    return out


def report(decisions: Sequence[Decision], measured: Mapping[int, List[float]], costs: Optional[Costs]) -> Dict[str, Any]:
    """What ``state.plan()`` returns: the model and one row per group with prediction and measurement."""
    rows = []
    for d in decisions:
        times = measured.get(d.group, [])
        rows.append({
            "group": d.group, "params": len(d.members), "first": d.members[0] if d.members else "",
            "mb": round(d.numel * 4 / 2**20, 3), "compress": d.compress,
            "predicted_plain_ms": round(d.plain_s * 1e3, 3), "predicted_compressed_ms": round(d.compressed_s * 1e3, 3),
            "predicted_ms": round(d.predicted_s * 1e3, 3),
            "measured_ms": round(statistics.median(times) * 1e3, 3) if times else None,
        })
    # groups exchanged side by side, as calibrated: their costs add up to the step's exchange
    total = sum(d.predicted_s for d in decisions) if costs is not None else float("nan")
    return {"costs": costs.as_dict() if costs else None, "predicted_total_ms": round(total * 1e3, 3), "groups": rows}
