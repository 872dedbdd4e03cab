"""Counters of what compression did: bytes on the wire vs raw, encode/decode time, per tensor."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict


@dataclass
class TensorStats:
    calls: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    encode_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0
    compressed: bool = True

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else float("inf") if self.raw_bytes else 1.0


class Metrics:
    """Per-tensor counters, filled by the communication worker and read by ``stats()``.

    ``wire_bytes`` counts the payload bytes a rank contributes per call (what a parameter server
    would receive from it); ``raw_bytes`` is the size of the uncompressed gradient. A ring
    all-reduce moves about ``2 (W-1)/W`` times either figure per rank. ``encode_s``/``decode_s``
    are wall time, ``encode_cpu_s``/``decode_cpu_s`` the CPU time of the thread that ran the
    codec (what a benchmark needs when ranks share cores, see ``collectives.base.Timer``).
    """

    def __init__(self) -> None:
        self.tensors: Dict[str, TensorStats] = {}

    def record(
        self, name: str, raw: int, wire: int, encode_s: float, decode_s: float, compressed: bool = True,
        encode_cpu_s: float = 0.0, decode_cpu_s: float = 0.0,
    ) -> None:
        s = self.tensors.get(name)
        if s is None:
            s = self.tensors[name] = TensorStats(compressed=compressed)
        s.calls += 1
        s.raw_bytes += raw
        s.wire_bytes += wire
        s.encode_s += encode_s
        s.decode_s += decode_s
        s.encode_cpu_s += encode_cpu_s
        s.decode_cpu_s += decode_cpu_s

    def reset(self) -> None:
        self.tensors.clear()

    def summary(self, per_tensor: bool = False) -> Dict[str, Any]:
        items = list(self.tensors.items())  # a snapshot: the worker thread may be adding entries
        stats = [s for _, s in items]
        raw = sum(s.raw_bytes for s in stats)
        wire = sum(s.wire_bytes for s in stats)
        out: Dict[str, Any] = {
            "raw_bytes": raw,
            "wire_bytes": wire,
            "ratio": raw / wire if wire else (float("inf") if raw else 1.0),
            "encode_s": sum(s.encode_s for s in stats),
            "decode_s": sum(s.decode_s for s in stats),
            "encode_cpu_s": sum(s.encode_cpu_s for s in stats),
            "decode_cpu_s": sum(s.decode_cpu_s for s in stats),
            "calls": sum(s.calls for s in stats),
            "tensors_compressed": sum(1 for s in stats if s.compressed),
            "tensors_uncompressed": sum(1 for s in stats if not s.compressed),
        }
        if per_tensor:
            out["per_tensor"] = {k: dict(asdict(v), ratio=v.ratio) for k, v in items}
        return out
