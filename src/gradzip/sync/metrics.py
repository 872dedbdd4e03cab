"""What compression did, per parameter: bytes, the compression ratio, encode/decode time.

Every figure is this rank's, summed over the calls (steps) it made:

``raw_bytes``
    the gradients' size in their own dtype (4 bytes a value for fp32), as handed to gradzip.
``wire_bytes``
    their compressed size: the payload bytes of one encoding of each gradient as its collective
    cuts it (``allreduce``: the payload, every round of a multi-round codec; ``allgather``: the
    payload; ``sra``: the W chunk payloads of the first round; ``ps``: the partition payloads of
    the first round), without the 8-byte alignment and the one-byte non-finite flag. An
    uncompressed gradient counts its raw size. Each collective reports this count itself
    (``Result.payload_bytes``), exact also for payloads whose size depends on the data.
``ratio``
    ``raw_bytes / wire_bytes``. It does not depend on the world size W: every collective sends
    ``f(W)`` times these bytes, compressed or not, so the ratio equals the bytes a rank would
    have sent with the same collectives uncompressed divided by those it did send.
``sent_bytes``
    what this rank sends: ``f(W) · wire_bytes``, modelled on bandwidth-optimal algorithms,
    with ``f(W) = 2(W−1)/W`` for ``allreduce`` (ring: reduce-scatter then all-gather), ``sra``
    (all-to-all of ``(W−1)/W`` of its chunks, then its re-encoded chunk, ``1/W`` of the
    payload, to W−1 ranks) and ``ps`` (the partitions others aggregate, then the merged ones
    it aggregated to W−1 ranks: ``2(W−1)/W`` on average over the round-robin) and
    ``f(W) = W−1`` for ``allgather`` (its payload to every other rank). 0 at W = 1.

Encode and decode times are wall time. The thread CPU time of the codec
(``encode_cpu_s``/``decode_cpu_s``) is reported only while
:func:`gradzip.comm.base.measure_cpu_time` is on (the benchmarks turn it on for untimed
runs; reading the clock is a system call that costs as much as encoding a small tensor).
"""
from __future__ import annotations

import csv
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..codecs.base import Codec
from ..comm import base as _collective_base


@dataclass
class TensorStats:
    calls: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    sent_bytes: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0
    encode_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0
    compressed: bool = True
    codec: str = ""
    latest: int = 0  # the number of the call that set ``compressed`` and ``codec``

    @property
    def ratio(self) -> float:
        return _ratio(self.raw_bytes, self.wire_bytes)


def _ratio(raw: float, wire: float) -> float:
    return raw / wire if wire else (float("inf") if raw else 1.0)


def _rounded_ratio(raw: float, wire: float) -> float:
    r = _ratio(raw, wire)
    return round(r, 2) if r != float("inf") else r


class Metrics:
    """Per-parameter counters, filled by the communication worker and read by ``stats()``.

    See the module docstring for the definition of every figure. Gradients sent together (one
    fused exchange) are recorded per parameter, each with its share of the bytes and of the
    time, so the counts do not change when DDP rebuilds its buckets. A fused group's calls are
    summed as they come and shared out among its members only when the figures are read
    (:attr:`tensors`): the comm thread pays one update a group and step, not one a parameter.
    """

    def __init__(self) -> None:
        self._tensors: Dict[str, TensorStats] = {}
        # members -> their group's calls not yet shared out (``raw_bytes`` unused)
        self._groups: Dict[Tuple[Tuple[str, int], ...], TensorStats] = {}
        self._calls = 0  # calls so far, numbering them (which call set a parameter's codec last)
        self._lock = threading.Lock()  # the worker records while another thread reads
        self.cpu_measured = False
        self.exposed_s: List[float] = []
        self.group_times: Dict[str, List[float]] = {}  # fused group -> seconds of each exchange

    @property
    def tensors(self) -> Dict[str, TensorStats]:
        """Per parameter name, a snapshot of its counters (the fused groups' calls shared out
        first), taken under the lock: no figure of it is from a call the others miss."""
        with self._lock:
            self._share_out()
            return {name: dataclasses.replace(s) for name, s in self._tensors.items()}

    def record_group_time(self, key: str, seconds: float) -> None:
        """One compressed exchange of group ``key`` (``communicator.group_key``) took ``seconds``
        from its first stage to its last (for ``state.plan()``'s measured column)."""
        self.group_times.setdefault(key, []).append(seconds)

    def record_exposed(self, seconds: float) -> None:
        """One backward pass waited ``seconds`` after its last gradient for the exchanges to end."""
        self.exposed_s.append(seconds)

    def record(
        self, name: str, raw: int, wire: int, encode_s: float, decode_s: float, compressed: bool = True,
        encode_cpu_s: Optional[float] = None, decode_cpu_s: Optional[float] = None,
        sent: Optional[float] = None, codec: str = "",
    ) -> None:
        """One call on ``name``. ``sent`` defaults to ``wire``; a CPU time of None: not measured.
        The parameter's ``compressed`` and ``codec`` are those of its latest call (a warm-up sends
        it dense first, the codec afterwards)."""
        with self._lock:
            self._add_call(self._stats(name), raw, wire, sent, encode_s, decode_s, encode_cpu_s, decode_cpu_s, compressed, codec)

    def record_group(
        self, members: Sequence[Tuple[str, int]], wire: int, encode_s: float, decode_s: float,
        compressed: bool = False, encode_cpu_s: Optional[float] = None, decode_cpu_s: Optional[float] = None,
        sent: Optional[float] = None, codec: str = "",
    ) -> None:
        """One call that sent several parameters fused: ``members`` holds ``(name, raw bytes)``;
        the wire bytes and times are shared out in proportion to the raw bytes (when read:
        each member gets its share of the group's sums, the wire bytes as integers that add up
        to the group's exactly)."""
        key = members if isinstance(members, tuple) else tuple(members)
        with self._lock:
            g = self._groups.get(key)
            if g is None:
                g = self._groups[key] = TensorStats()
            self._add_call(g, 0, wire, sent, encode_s, decode_s, encode_cpu_s, decode_cpu_s, compressed, codec)

    def _add_call(
        self, s: TensorStats, raw: int, wire: int, sent: Optional[float], encode_s: float, decode_s: float,
        encode_cpu_s: Optional[float], decode_cpu_s: Optional[float], compressed: bool, codec: str,
    ) -> None:
        """One call added to the counters ``s`` (the lock held); it becomes their latest."""
        self._calls += 1
        s.calls += 1
        s.raw_bytes += raw
        s.wire_bytes += wire
        s.sent_bytes += wire if sent is None else sent
        s.encode_s += encode_s
        s.decode_s += decode_s
        if encode_cpu_s is not None and decode_cpu_s is not None:
            s.encode_cpu_s += encode_cpu_s
            s.decode_cpu_s += decode_cpu_s
            self.cpu_measured = True
        s.compressed, s.codec, s.latest = compressed, codec, self._calls

    def _stats(self, name: str) -> TensorStats:
        s = self._tensors.get(name)
        if s is None:
            s = self._tensors[name] = TensorStats()
        return s

    def _share_out(self) -> None:
        """Add the groups' pending calls to their members' counters (the lock held)."""
        groups, self._groups = self._groups, {}
        for members, g in groups.items():
            total = sum(raw for _, raw in members)
            denom = total or len(members)  # equal shares where every member is empty
            given = before = 0
            for i, (name, raw) in enumerate(members):
                weight = raw if total else 1
                share = weight / denom
                # whole bytes from the running total: each share ≥ 0, together the group's exactly
                before += weight
                upto = g.wire_bytes if i == len(members) - 1 else int(round(g.wire_bytes * before / denom))
                w, given = upto - given, upto
                s = self._stats(name)
                s.calls += g.calls
                s.raw_bytes += raw * g.calls
                s.wire_bytes += w
                s.sent_bytes += g.sent_bytes * share
                s.encode_s += g.encode_s * share
                s.decode_s += g.decode_s * share
                s.encode_cpu_s += g.encode_cpu_s * share
                s.decode_cpu_s += g.decode_cpu_s * share
                if g.latest > s.latest:
                    s.compressed, s.codec, s.latest = g.compressed, g.codec, g.latest

    def reset(self) -> None:
        with self._lock:
            self._tensors.clear()
            self._groups.clear()
            self.cpu_measured = False
        self.exposed_s = []
        self.group_times = {}

    def summary(self, per_tensor: bool = False) -> Dict[str, Any]:
        """Totals (rounded): ``steps`` (the most calls any one parameter had: one per step),
        ``params_compressed``/``params_uncompressed`` (parameters seen, by whether the codec
        compressed them; also as ``tensors_*``), ``raw_bytes``, ``wire_bytes``, ``ratio``
        (2 decimals), ``sent_bytes``, ``encode_s``/``decode_s`` (wall seconds, 4 decimals),
        ``encode_cpu_s``/``decode_cpu_s`` only where measured. ``per_tensor``: the same per
        parameter name (``calls``, ``raw_bytes``, ``wire_bytes``, ``sent_bytes``, ``ratio``,
        ``compressed``, ``encode_ms``, ``decode_ms``)."""
        items = list(self.tensors.items())  # a snapshot: the worker thread may be adding entries
        stats = [s for _, s in items]
        raw = sum(s.raw_bytes for s in stats)
        wire = sum(s.wire_bytes for s in stats)
        compressed = sum(1 for s in stats if s.compressed)
        out: Dict[str, Any] = {
            "steps": max((s.calls for s in stats), default=0),
            "params_compressed": compressed,
            "params_uncompressed": len(stats) - compressed,
            "raw_bytes": raw,
            "wire_bytes": wire,
            "ratio": _rounded_ratio(raw, wire),
            "sent_bytes": int(round(sum(s.sent_bytes for s in stats))),
            "encode_s": round(sum(s.encode_s for s in stats), 4),
            "decode_s": round(sum(s.decode_s for s in stats), 4),
        }
        if self.exposed_s:
            out["exposed_s"] = round(sum(self.exposed_s), 4)
        if self.cpu_measured:
            out["encode_cpu_s"] = round(sum(s.encode_cpu_s for s in stats), 4)
            out["decode_cpu_s"] = round(sum(s.decode_cpu_s for s in stats), 4)
        out["tensors_compressed"] = out["params_compressed"]  # the names of earlier versions
        out["tensors_uncompressed"] = out["params_uncompressed"]
        if per_tensor:
            out["per_tensor"] = {name: _row(s) for name, s in items}
        return out


def _row(s: TensorStats) -> Dict[str, Any]:
    return {
        "calls": s.calls,
        "raw_bytes": s.raw_bytes,
        "wire_bytes": s.wire_bytes,
        "sent_bytes": int(round(s.sent_bytes)),
        "ratio": _rounded_ratio(s.raw_bytes, s.wire_bytes),
        "compressed": s.compressed,
        "encode_ms": round(s.encode_s * 1e3, 3),
        "decode_ms": round(s.decode_s * 1e3, 3),
    }


# ----------------------------------------------------------------------------- reporting
def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


def _x(r: float) -> str:
    return "inf" if r == float("inf") else f"{r:.2f}x"


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """A plain-text table: the first ``left`` columns left-aligned, the others right-aligned."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line([str(h) for h in header]), line(["-" * w for w in widths])] + [line(r) for r in rows])


def summary_table(metrics: Metrics, title: str = "", per_layer: bool = False, steps: Optional[int] = None) -> str:
    """The readable form of :meth:`Metrics.summary`: totals per codec, and per parameter if asked.

    Times are per step (wall ms); ``steps`` defaults to the most calls any parameter had.
    """
    items = list(metrics.tensors.items())
    n_steps = steps if steps else max((s.calls for _, s in items), default=0)
    per = max(n_steps, 1)
    groups: Dict[str, List[TensorStats]] = {}
    for _, s in items:
        groups.setdefault((s.codec or "compressed") if s.compressed else "uncompressed", []).append(s)
    header = ["codec", "params", "raw MB", "wire MB", "sent MB", "ratio", "encode ms/step", "decode ms/step"]

    def agg(label: str, ss: List[TensorStats]) -> List[str]:
        raw, wire = sum(s.raw_bytes for s in ss), sum(s.wire_bytes for s in ss)
        return [
            label, str(len(ss)), _mb(raw), _mb(wire), _mb(sum(s.sent_bytes for s in ss)), _x(_ratio(raw, wire)),
            f"{sum(s.encode_s for s in ss) * 1e3 / per:.2f}", f"{sum(s.decode_s for s in ss) * 1e3 / per:.2f}",
        ]

    rows = [agg(label, ss) for label, ss in groups.items()]
    rows.append(agg("total", [s for _, s in items]))
    parts = [title] if title else []
    parts.append(format_table(header, rows))
    if per_layer:
        layer_header = ["parameter", "raw MB", "wire MB", "ratio", "compressed", "encode ms/step", "decode ms/step"]
        layer_rows = [
            [
                name, _mb(s.raw_bytes), _mb(s.wire_bytes), _x(s.ratio), "yes" if s.compressed else "no",
                f"{s.encode_s * 1e3 / per:.3f}", f"{s.decode_s * 1e3 / per:.3f}",
            ]
            for name, s in items
        ]
        parts.append(format_table(layer_header, layer_rows))
    return "\n\n".join(parts)


def scalars(stats: Mapping[str, Any]) -> Dict[str, float]:
    """The numeric fields of a ``stats()`` dict (what :meth:`GradzipState.log_to` writes)."""
    return {
        k: v for k, v in stats.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("tensors_")
    }


class CSVLogger:
    """Appends one row per :meth:`log` call to a CSV file: ``step`` then the metrics' columns.

    The columns are fixed by the first row (or by the header of an existing file it appends to);
    later metrics missing from a row are left empty, new ones are ignored.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"]) -> None:
        self.path = os.fspath(path)
        self.columns: Optional[List[str]] = None
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as f:
                self.columns = next(csv.reader(f), None)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        new = self.columns is None
        if new:
            self.columns = ["step"] + list(values)
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(self.columns)
            w.writerow([step if c == "step" else values.get(c, "") for c in self.columns])  # type: ignore[union-attr]


def record_of(res: Any, wire: int, factor: float, compress: bool, codec: Codec) -> Dict[str, Any]:
    """The keyword arguments of :meth:`Metrics.record` for one call (``res``: its Result, or None)."""
    if res is None:
        return dict(wire=0, encode_s=0.0, decode_s=0.0, compressed=compress, sent=0.0, codec=codec.name)
    measured = _collective_base._measure_cpu or res.encode_cpu_s or res.decode_cpu_s
    return dict(
        wire=wire, encode_s=res.encode_s, decode_s=res.decode_s, compressed=compress,
        encode_cpu_s=res.encode_cpu_s if measured else None, decode_cpu_s=res.decode_cpu_s if measured else None,
        sent=factor * wire, codec=codec.name,
    )
