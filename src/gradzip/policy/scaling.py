"""Step time on N nodes × L ranks, on paper: an α–β model per link class, codec and CPU costs.

The planner (:mod:`gradzip.policy.planner`) times the exchanges it may choose on the job's own
groups; this model instead predicts what a configuration *would* cost, for clusters larger than
the machine at hand (2…128 nodes × 1…8 ranks at 1–100 Gbit/s), from a few calibrated rates:

- **inter-node link** (``link_bps``, ``link_alpha_s``, ``link_efficiency``): a node's one link to
  the others. A ring all-reduce over node-contiguous ranks crosses it once each way per node;
  an exchange between every pair of ranks (gradzip's SRA) sends over it the share of each of its
  L ranks' bytes that goes to other nodes; the hierarchical exchange sends only its compressed
  inter-node stage, 2(N−1)/N payloads per node, whatever L.
- **intra-node** (``node_bytes_per_s``): the copies into and out of the memory the node's ranks
  share, and the sum of their shares.
- **CPU per byte and per value, one core** (``socket_s_per_byte``, ``add_s_per_value``,
  ``copy_s_per_byte``, ``encode_s_per_value``, ``decode_s_per_value``): what sending and
  receiving through gloo's TCP sockets, summing, copying and the codec cost a rank.

A step is ``max(wire, cpu) + (1 − hidden)·min(wire, cpu) + rounds × α``: the pipeline overlaps
the link with the CPU, so the slower of the two sets the pace, but only part of the shorter one
hides behind it (``hidden`` = 0.6: fp32 DDP's rows on the emulated cluster, whose link is the
limit, took 0.35–0.45 of their CPU time on top of the wire's). Each collective round adds a
latency. ``cpu`` is the model's compute (forward + backward, an input: it is the user's), DDP's
own two copies of the gradients (into its buckets and back), and the exchange's CPU work scaled
by a measured ``cpu_factor`` per method (what single-operation rates miss: Python, autograd
hooks, caches and memory bandwidth shared between processes, fresh pages), all stretched by
``ranks_per_core`` where the ranks of a machine share fewer cores than they are (on this 2-core
machine, emulated clusters of 4 or 8 ranks). On real nodes with a core per rank it is 1, and the
codec's throughput decides where compression stops paying.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Iterable, List, Optional, Tuple

METHODS = ("fp32", "fp16", "gradzip-flat", "gradzip")
"""fp32 DDP (ring), PyTorch's fp16 hook (ring, half the bytes), gradzip's compressed SRA over
every rank, and gradzip's hierarchical exchange (intra-node sum, SRA across nodes, spread)."""


@dataclass(frozen=True)
class Rates:
    """Calibrated rates of one cluster class (see the module's notes for each)."""

    link_bps: float
    link_alpha_s: float = 50e-6
    link_efficiency: float = 0.9
    node_bytes_per_s: float = 5e9
    socket_s_per_byte: float = 1e-9
    add_s_per_value: float = 1e-9
    copy_s_per_byte: float = 1e-10
    encode_s_per_value: float = 2e-9
    decode_s_per_value: float = 1e-9
    payload_ratio: float = 4.5 / 32  # the codec's wire bytes over fp32 bytes (4-bit max-min, 512-value buckets)
    ranks_per_core: float = 1.0
    cpu_factor: Tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # measured / modelled exchange CPU, per method (METHODS)
    hidden: float = 0.6  # the share of the shorter of wire and CPU that hides behind the longer

    def with_(self, **changes: Any) -> "Rates":
        return replace(self, **changes)


@dataclass
class Prediction:
    method: str
    nodes: int
    ranks_per_node: int
    wire_s: float
    cpu_s: float
    latency_s: float
    step_s: float
    link_bytes: float

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _ring(n_bytes: float, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``n_bytes``."""
    return 2 * (ranks - 1) / ranks * n_bytes if ranks > 1 else 0.0


def predict(
    method: str, nodes: int, ranks_per_node: int, values: int, rates: Rates, compute_s: float = 0.0,
    groups: int = 1,
) -> Prediction:
    """Predicted seconds of one DDP step exchanging ``values`` fp32 gradients in ``groups``
    buckets or fused groups, ``compute_s`` being the model's own forward + backward on one rank."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes and ranks_per_node must be positive, got {nodes} x {ranks_per_node}")
    n, L, N = float(values), ranks_per_node, nodes
    W = N * L
    r = rates
    B = 4 * n  # fp32 bytes
    payload = r.payload_ratio * B
    if method in ("fp32", "fp16"):
        wire_bytes = B if method == "fp32" else B / 2
        sent = _ring(wire_bytes, W)
        link = sent if N > 1 else 0.0  # one crossing edge of the ring leaves each node
        cpu = 2 * sent * r.socket_s_per_byte + (W - 1) / W * n * r.add_s_per_value
        if method == "fp16":  # the hook's cast down, and back up with the division
            cpu += 3 * B / 2 * r.copy_s_per_byte * 2
        rounds = 2 * (W - 1)
    elif method == "gradzip-flat" or N == 1 or L == 1:
        sent = _ring(payload, W)  # SRA: a chunk to every other rank, then every average back
        link = L * sent * (W - L) / (W - 1) if N > 1 else 0.0
        cpu = (
            2 * sent * r.socket_s_per_byte
            + 2 * B * r.copy_s_per_byte  # into the fused group (with the residual) and out of it
            + (n + n / W) * r.encode_s_per_value  # the group, then this rank's averaged chunk
            + ((W - 1) / W * n + n + n) * r.decode_s_per_value  # others' chunks; all averages; own (residual)
            + 2 * n * r.add_s_per_value  # the residual: compensate and subtract
        )
        rounds = 2
    else:  # hierarchical: exact sum inside the node, SRA on a 1/L share across nodes, spread
        share = n / L
        sent = _ring(r.payload_ratio * 4 * share, N)
        link = L * sent
        cpu = (
            2 * sent * r.socket_s_per_byte
            + 2 * B * r.copy_s_per_byte  # into the node's shared memory, and the spread back
            + (L - 1) * share * r.add_s_per_value  # this rank's share summed over the node
            + (share + share / N) * r.encode_s_per_value
            + ((N - 1) / N * share + share + share) * r.decode_s_per_value
            + 2 * share * r.add_s_per_value
        )
        cpu += 2 * B / r.node_bytes_per_s if L > 1 else 0.0  # the node's memory moves every share twice
        rounds = 2 + (2 if L > 1 else 0)  # inter-node SRA's two phases, the node's two barriers
    cpu *= r.cpu_factor[METHODS.index("gradzip-flat" if method == "gradzip" and (N == 1 or L == 1) else method)]
    cpu += 2 * B * r.copy_s_per_byte  # DDP's own: gradients into its buckets, and back
    wire = link * 8 / (r.link_bps * r.link_efficiency)
    cpu_s = (compute_s + cpu) * max(1.0, r.ranks_per_core)
    latency = rounds * groups * r.link_alpha_s
    step = max(wire, cpu_s) + (1 - r.hidden) * min(wire, cpu_s) + latency
    return Prediction(method, N, L, wire, cpu_s, latency, step, link)


def speedups(
    values: int, rates: Rates, nodes: Iterable[int], ranks_per_node: Iterable[int], compute_s: float = 0.0,
    groups: int = 1,
) -> List[Dict[str, Any]]:
    """For every nodes × ranks_per_node: each method's predicted step and gradzip's speed-up
    over fp32 DDP and over the fp16 hook (hierarchical where L > 1, flat otherwise)."""
    out = []
    for N in nodes:
        for L in ranks_per_node:
            p = {m: predict(m, N, L, values, rates, compute_s, groups) for m in METHODS}
            out.append({
                "nodes": N, "ranks_per_node": L, "link_bps": rates.link_bps,
                **{f"{m}_s": p[m].step_s for m in METHODS},
                "vs_fp32": p["fp32"].step_s / p["gradzip"].step_s,
                "vs_fp16": p["fp16"].step_s / p["gradzip"].step_s,
                "hier_vs_flat": p["gradzip-flat"].step_s / p["gradzip"].step_s,
                "bound": "wire" if p["gradzip"].wire_s >= p["gradzip"].cpu_s else "cpu",
            })
    return out


def break_even_bps(values: int, rates: Rates, nodes: int, ranks_per_node: int, compute_s: float = 0.0) -> Optional[float]:
    """The link rate above which gradzip stops beating the fp16 hook (None: it wins up to 1 Tbit/s)."""
    lo, hi = 1e8, 1e12
    if _wins(lo, values, rates, nodes, ranks_per_node, compute_s) is False:
        return lo
    if _wins(hi, values, rates, nodes, ranks_per_node, compute_s):
        return None
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if _wins(mid, values, rates, nodes, ranks_per_node, compute_s) else (lo, mid)
    return hi


def _wins(bps: float, values: int, rates: Rates, nodes: int, ranks_per_node: int, compute_s: float) -> bool:
    r = rates.with_(link_bps=bps)
    return predict("gradzip", nodes, ranks_per_node, values, r, compute_s).step_s < predict(
        "fp16", nodes, ranks_per_node, values, r, compute_s
    ).step_s
