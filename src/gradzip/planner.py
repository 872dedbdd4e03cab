"""The planner: whether compressing a group pays on this link and this CPU (HiPress's cost model).

HiPress (Bai et al., SOSP'21) decides offline, per gradient, whether to compress, from an α–β
model of the network and the codec's measured speed. gradzip calibrates the model online, once,
at registration, on the process group the gradients will cross:

- **Link.** Plain all-reduces of 16 KiB, 1 MiB and 8 MiB are timed (median of a few) and a line
  ``t = α + β·bytes`` is fitted: what moving bytes costs here, latency included.
- **CPU.** Every rank times the codec's encode and decode, and a memory copy, on 1 M values at
  the same moment as the others, so ranks that share cores measure the sharing too.
- The slowest rank's figures are used on every rank (one all-reduce with MAX): every rank holds
  the same floats and so makes the same decisions, without another exchange.

A group of ``n`` values and payload ``P`` bytes is predicted at

- plain: ``α + β·bytes(n) + 2·copy·n`` (the flag and averaging passes);
- compressed: ``rounds·α + β·f·P + encode·e·n + decode·d·n + copy·c·n``, where the collective
  sets the rounds (SRA and PS: a scatter and a gather; all-gather and all-reduce: one), the
  traffic ``f`` relative to an all-reduce of ``P`` (all-gather: W/2 times more), how often each
  value is encoded ``e`` (SRA and PS re-encode the reduced chunk: ``1 + 1/W``) and decoded ``d``
  (the reduction, the gathered average and, with error feedback, the own payload), and ``c``
  copies (error feedback reads and writes the residual).

The cheaper one wins, so the plan never predicts a group slower than plain fp32. What it does
not yet do: choose the collective or the number of partitions per group, and re-calibrate when
measured times drift from the predictions (``state.plan()`` shows both, to judge by).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .codecs.base import Codec

SIZES = (1 << 14, 1 << 20, 1 << 23)  # bytes of the calibration all-reduces
SAMPLE = 1 << 20  # values of the codec calibration


@dataclass
class Costs:
    """The calibrated model: seconds = alpha + beta·bytes per all-reduce; CPU seconds per value."""

    alpha: float
    beta: float
    encode: float
    decode: float
    copy: float
    world_size: int

    def plain(self, numel: int, element_size: int = 4) -> float:
        """Predicted seconds of a plain all-reduce of ``numel`` values."""
        return self.alpha + self.beta * numel * element_size + 2 * self.copy * numel

    def compressed(self, numel: int, payload_bytes: int, collective: str, memory: bool) -> float:
        """Predicted seconds of one compressed exchange of ``numel`` values through ``collective``."""
        w = self.world_size
        if w == 1:
            rounds, traffic = 0, 0.0
        else:
            rounds = 1 if collective in ("allgather", "allreduce") else 2
            traffic = w / 2 if collective == "allgather" else 1.0  # (W−1)·P against 2(W−1)/W·P
        enc = 1.0 if collective in ("allgather", "allreduce") else 1 + 1 / w
        dec = (float(w) if collective == "allgather" else 1.0 if collective == "allreduce" else 2.0) + memory
        cpu = numel * (self.encode * enc + self.decode * dec + self.copy * (3 if memory else 1))
        return rounds * self.alpha + self.beta * traffic * payload_bytes + cpu

    def as_dict(self) -> Dict[str, float]:
        return {
            "alpha_s": self.alpha, "beta_s_per_byte": self.beta, "encode_s_per_value": self.encode,
            "decode_s_per_value": self.decode, "copy_s_per_value": self.copy, "world_size": self.world_size,
        }


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(codec: Codec, group: Optional[dist.ProcessGroup], repeats: int = 5) -> Costs:
    """Measure the link and the codec on every rank of ``group``; the slowest rank's figures."""
    w = dist.get_world_size(group) if dist.is_initialized() else 1
    points = []
    for nbytes in SIZES:
        x = torch.zeros(nbytes // 4)
        if w > 1:
            dist.all_reduce(x, group=group)  # warm the connection and the buffers
            dist.barrier(group=group)
            points.append((nbytes, _median_time(lambda: dist.all_reduce(x, group=group), repeats)))
        else:
            points.append((nbytes, 0.0))
    alpha, beta = fit(points)
    sample = torch.randn(SAMPLE, generator=torch.Generator().manual_seed(0))
    payload = codec.encode(sample, "planner", 0)
    out = torch.empty_like(sample)
    encode = _median_time(lambda: codec.encode(sample, "planner", 0), repeats) / SAMPLE
    decode = _median_time(lambda: codec.decode_into(payload, out), repeats) / SAMPLE
    copy = _median_time(lambda: out.copy_(sample), repeats) / SAMPLE
    figures = torch.tensor([alpha, beta, encode, decode, copy], dtype=torch.float64)
    if w > 1:
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    return Costs(*figures.tolist(), world_size=w)


def fit(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """Least-squares ``t = alpha + beta·bytes`` through ``(bytes, seconds)`` points, both kept ≥ 0."""
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


def payload_bytes(codec: Codec, params: Sequence[torch.Tensor]) -> int:
    """Bytes of one encoding of a group: one fused buffer (each member padded to whole blocks of
    :meth:`Codec.fusion_block`), or each member on its own where the codec cannot fuse."""
    block = codec.fusion_block()
    if len(params) > 1 and block > 0:
        padded = sum(-(-p.numel() // block) * block for p in params)
        return codec.wire_bytes(padded, params[0].dtype)
    return sum(codec.wire_bytes(p.numel(), p.dtype, tuple(p.shape)) for p in params)


def decide(
    groups: Sequence[Sequence[str]], params: Mapping[str, torch.Tensor], codec: Codec, collective: str,
    costs: Optional[Costs], memory: bool,
) -> List[Decision]:
    """Compress a group only where its predicted exchange beats the plain all-reduce; every
    group, with NaN predictions, when there is no model (``costs`` None: planning is off)."""
    out = []
    for g, members in enumerate(groups):
        tensors = [params[m] for m in members]
        n = sum(t.numel() for t in tensors)
        if costs is None:
            out.append(Decision(g, list(members), n, True, float("nan"), float("nan")))
            continue
        plain = costs.plain(n, tensors[0].element_size())
        packed = costs.compressed(n, payload_bytes(codec, tensors), collective, memory)
        out.append(Decision(g, list(members), n, packed < plain, plain, packed))
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
    return {"costs": costs.as_dict() if costs else None, "groups": rows}
