"""The planner: whether compressing a group pays on this link and this CPU (HiPress's cost model).

HiPress (Bai et al., SOSP'21) decides offline, per gradient, whether to compress, from a cost
model of the network and the codec. gradzip calibrates its model online, once, at
registration, on the process group the gradients will cross, and from what will really run:

- A throwaway communicator with the same codec, memory and collective, on the same process
  group, exchanges groups of 32 Ki, 256 Ki and 1 Mi fp32 values (128 KiB to 4 MiB; matrices
  of them for a codec that factorises each tensor, PowerSGD) both ways: compressed (error
  feedback, encode, the collective, decode) and plain (gradzip's in-place all-reduce), a few
  times each, on every rank at once. Ranks that share cores or a link
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
compressed only where the compressed line is below half the plain one at its size
(``MARGIN``). The lines come from groups of at most 1 Mi values timed side by side, while a
step's largest groups are tens of Mi values exchanged beside backward on the same cores, and
there the compressed line is the optimistic one: at 10 Gbit/s, 4 ranks on 2 cores, two runs
put compression at 0.40–0.86 of the plain cost for groups of 8–23 Mi values, where compressing
every group ran 0.82–1.06× fp32 DDP's speed (ResNet-50, BERT-base), and loopback at 0.52–0.97.
So where the largest group to plan sits near the bar, one more size is timed, if that is
cheap (:func:`extra_size_due`). At 1 Gbit/s a group of 0.6 Mi values (a 768 × 768 matrix)
calibrates at 0.32–0.40 and larger ones at 0.12–0.30, and compressing them pays: with the bar
at 0.4 a transformer's 768 × 768 groups stayed plain (one group in four), and ViT-B/16 and
BERT-base ran at 2.84× and 3.10× fp32 DDP's speed, against 3.38× and 3.54× with the bar at 0.5.
A 16-bit gradient's plain all-reduce moves half the bytes: its plain cost per value is halved.

The collective is chosen per group too, when the user named none: the compressed exchange is
timed through every collective that supports the codec (``candidate_routes``: for 4-bit
max-min, ``sra``, ``allgather``, and ``ps`` with one and with two partitions per rank). A group
leaves the configured collective only for a route whose line is below ``1 - ROUTE_MARGIN`` of
the configured one's at its size. Lines within a few percent of each other are noise on shared
cores, and the calibration's groups (up to 1 Mi values) are smaller than a model's largest, so
a near tie is no reason to leave the default: in a run where ``ps`` with 8 partitions came out
5% under ``sra``, BERT-base took it for 36 of its 52 groups and ran 35% slower than with
``sra`` (2.98 against 2.21 s a step at 1 Gbit/s).

On several nodes of several CPU ranks the two link classes are calibrated apart, on the real
groups: the plain all-reduce of the node's shares across nodes alone (every rank with its node
peers, all at once, as in the exchange: the inter-node line) and the exact hierarchical
all-reduce (:mod:`gradzip.comm.hierarchy` with codec ``none``); the intra-node stages cost
the difference (:meth:`Costs.links`). Plain exchanges go hierarchically from the size at which
that line falls below ``1 - PLAIN_ROUTE_MARGIN`` of the flat one (gloo's ring sends 1.5× the
gradients over a node's link on 2 × 2, the hierarchy 1×; where 4 ranks share 2 cores at 10
Gbit/s the node's copies cost more than that saves), and every decision prices the plain side
with the cheaper of the two. NCCL's all-reduce is topology-aware already and is left as it is.

Online, a :class:`DriftWatch` compares measured with predicted times every ``CHECK_EVERY``
steps; when their ratio moves by more than ``DRIFT`` from its baseline, every rank calibrates
again at the same step and the plan is made anew (``GradzipState.replan``). The model does not
price the overlap the pipeline gives; ``state.plan()`` shows predictions and measurements.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..codecs.base import Codec
from ..comm.allgather import default_collective
from ..comm.hierarchy import plain_goes_hierarchical
from ..sync.groups import padding

SIZES = (1 << 15, 1 << 18, 1 << 20)  # values per group of the calibration exchanges
# one more size, beyond the caches, timed where a model's largest groups sit near the bar (see
# extra_size_due) and the lines say it takes at most EXTRA_BUDGET_S seconds
EXTRA_SIZE = 1 << 22
EXTRA_BUDGET_S = 5.0
GROUPS = 4  # groups exchanged side by side per timing
REPEATS = 3
MARGIN = 0.5  # compression must save this fraction of the plain all-reduce's predicted time
ROUTE_MARGIN = 0.25  # another collective must save this fraction of the configured one's predicted time
PLAIN_ROUTE_MARGIN = 0.1  # the hierarchical plain all-reduce must save this fraction of the flat one's
CHECK_EVERY = 50  # steps between two checks of measured against predicted times
DRIFT = 1.5  # the factor by which measured/predicted may move from its baseline before re-calibrating


@dataclass
class Line:
    """Seconds of one exchange: ``alpha + beta·values``."""

    alpha: float
    beta: float

    def at(self, values: float) -> float:
        return self.alpha + self.beta * values


@dataclass
class Costs:
    """The calibrated model: a line for the plain all-reduce, one for the compressed exchange
    through the configured collective, and one per other route the planner may choose
    (``routes``: a route's label, see :func:`~gradzip.comm.base.route_label`, to its line)."""

    plain: Line
    compressed: Line
    world_size: int
    routes: Dict[str, Line] = field(default_factory=dict)
    # on several nodes of several ranks (gloo): the exact hierarchical all-reduce, and the plain
    # all-reduce of the shares across nodes alone (the inter-node link), both per value of the
    # whole tensor; the intra-node stages cost the difference (see :meth:`links`)
    plain_hierarchical: Optional[Line] = None
    inter_node: Optional[Line] = None
    nodes: int = 1

    @property
    def plain_hierarchy_from(self) -> Optional[int]:
        """From how many values on a plain exchange goes hierarchically: where the hierarchical
        line is below ``1 - PLAIN_ROUTE_MARGIN`` of the flat one (None: nowhere, or only below
        some size, where it does not matter)."""
        hier, flat = self.plain_hierarchical, self.plain
        if hier is None:
            return None
        k = 1 - PLAIN_ROUTE_MARGIN
        gap = hier.alpha - k * flat.alpha  # hier < k·flat  <=>  gap < slope·n
        slope = k * flat.beta - hier.beta
        if slope <= 0:
            return None
        return max(0, math.floor(gap / slope) + 1)

    def plain_s(self, numel: int, element_size: int = 4) -> float:
        """Predicted seconds of a plain all-reduce of ``numel`` values of ``element_size`` bytes
        (hierarchical from :attr:`plain_hierarchy_from` values on)."""
        hierarchical = plain_goes_hierarchical(self.plain_hierarchy_from, numel, element_size)
        return (self.plain_hierarchical if hierarchical else self.plain).at(numel * element_size / 4)

    def links(self) -> Dict[str, Dict[str, float]]:
        """The two link classes as calibrated: seconds per value of a plain exchange inside the
        node (the hierarchical all-reduce less its inter-node part) and across nodes, and the
        rates they come to (the node's link carries 2(N−1)/N × 4 bytes a value, all L ranks of
        the node sending their shares at once); empty on a flat layout."""
        if self.plain_hierarchical is None or self.inter_node is None:
            return {}
        intra = Line(max(0.0, self.plain_hierarchical.alpha - self.inter_node.alpha),
                     max(0.0, self.plain_hierarchical.beta - self.inter_node.beta))
        crossing = 2 * (self.nodes - 1) / self.nodes * 4
        return {
            "intra-node": {"alpha_s": intra.alpha, "s_per_value": intra.beta,
                           "gb_per_s": 4 / intra.beta / 1e9 if intra.beta else None},  # None: too fast to tell
            "inter-node": {"alpha_s": self.inter_node.alpha, "s_per_value": self.inter_node.beta,
                           "gbit_per_s": crossing * 8 / self.inter_node.beta / 1e9 if self.inter_node.beta else None},
        }

    def to_dict(self) -> Dict[str, Any]:
        """Plain data (floats, ints, strings) for a checkpoint: :meth:`from_dict` makes these
        costs again, so a resumed run takes the plan it had (:func:`decide` is deterministic)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Costs":
        def line(d: Optional[Mapping[str, float]]) -> Optional[Line]:
            return None if d is None else Line(float(d["alpha"]), float(d["beta"]))

        return cls(plain=line(data["plain"]), compressed=line(data["compressed"]), world_size=int(data["world_size"]),
                   routes={str(k): line(v) for k, v in (data.get("routes") or {}).items()},
                   plain_hierarchical=line(data.get("plain_hierarchical")), inter_node=line(data.get("inter_node")),
                   nodes=int(data.get("nodes", 1)))

    def compressed_s(self, numel: int, route: Optional[str] = None) -> float:
        """Predicted seconds of one compressed exchange of ``numel`` values (padding included),
        through ``route`` (default the configured collective)."""
        return (self.compressed if route is None else self.routes[route]).at(numel)

    def cheapest(self, numel: int) -> Tuple[Optional[str], float]:
        """The way to exchange ``numel`` compressed values: (route, or None for the configured
        collective; predicted seconds). Another route is taken only where it costs under
        ``1 - ROUTE_MARGIN`` of the configured collective (see the module's notes); among
        those, the cheapest, ties to the first in order."""
        own = self.compressed.at(numel)
        best: Tuple[Optional[str], float] = (None, own)
        for route, line in self.routes.items():
            cost = line.at(numel)
            if cost < (1 - ROUTE_MARGIN) * own and cost < best[1]:
                best = (route, cost)
        return best

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "plain_alpha_s": self.plain.alpha, "plain_s_per_value": self.plain.beta,
            "compressed_alpha_s": self.compressed.alpha, "compressed_s_per_value": self.compressed.beta,
            "world_size": self.world_size,
        }
        if self.routes:
            out["routes"] = {r: {"alpha_s": line.alpha, "s_per_value": line.beta} for r, line in self.routes.items()}
        if self.plain_hierarchical is not None:
            out["plain_hierarchical_alpha_s"] = self.plain_hierarchical.alpha
            out["plain_hierarchical_s_per_value"] = self.plain_hierarchical.beta
            out["plain_hierarchy_from"] = self.plain_hierarchy_from
            out["links"] = self.links()
        return out


def candidate_routes(comm: Any) -> List[str]:
    """The routes other than ``comm``'s configured collective that could exchange its codec's
    payloads: every collective that supports the codec, and ``ps`` with one and with two
    partitions per rank (multi-round codecs such as PowerSGD have ``allreduce`` only); on a
    hierarchical layout also the configured collective flat (``hierarchy=0``) and with the other
    precision of its intra-node stage (``node=bf16`` where error feedback keeps its rounding, or
    ``node=fp32`` where bf16 is configured),
    so the measured cost decides between flat and hierarchical, and the node stage's bytes, per group."""
    from .. import comm as collectives
    from ..comm.base import route_label

    own = route_label(comm.collective_name, _changed(comm.collective))
    out = []
    if comm.describe_topology().get("hierarchical"):  # the configured collective flat, over every rank
        # (one the communicator chose for the group across nodes: the one it would choose flat)
        flat = default_collective(comm.codec, comm.world_size) if comm.collective_defaulted else comm.collective_name
        out.append(route_label(flat, {**_changed(comm.collective), "hierarchy": 0}))
        # and with the other precision of the intra-node stage: 16 bits where it is fp32 and error
        # feedback keeps the rounding (never without: that would lose what the user kept exact)
        if comm._node_dtype != "fp32" or comm.memory.stateful:
            other = "bf16" if comm._node_dtype == "fp32" else "fp32"
            out.append(route_label(comm.collective_name, {**_changed(comm.collective), "node": other}))
    for name in collectives.names():
        if not collectives.get(name)(None).supports(comm.codec):
            continue
        for options in [{}] if name != "ps" else [{}, {"partitions": 2 * comm.world_size}]:
            label = route_label(name, options)
            if label != own and label not in out:
                out.append(label)
    return out


def _changed(coll: Any) -> Dict[str, Any]:
    """A collective's options that differ from their defaults."""
    coll = getattr(coll, "inner", coll)  # a hierarchical exchange: the collective it runs across nodes
    return {k: v for k, v in coll.config().items() if v != type(coll).options[k].default}


def calibrate(
    comm: Any, device: Optional[torch.device] = None, repeats: int = REPEATS, routes: Sequence[str] = (),
    largest: int = 0,
) -> Costs:
    """Time ``comm``'s plain and compressed exchanges on its process group, with tensors on
    ``device`` (the gradients' device: CUDA for NCCL); the slowest rank's lines. ``routes``:
    other collectives to time the compressed exchange through (:func:`candidate_routes`).
    ``largest``: the values of the largest group to plan; where it lies beyond the sizes timed
    and near the bar, one more size is timed (:func:`extra_size_due`).

    Every rank must call it at the same point (registration) with the same routes and
    ``largest``: it issues collectives on the group.
    """
    device = torch.device("cpu") if device is None else device
    from ..sync.engine import Communicator
    from ..sync.pipeline import drive

    probe = Communicator(
        comm.codec.name, memory=comm.memory.name, collective=comm.collective_name, group=comm.group,
        memory_options=comm.memory.config(),
        collective_options=comm.collective.config(),
        dedicated_group=False, verify_settings=False, fusion=False, pipeline=False, hierarchy="off",
        node_dtype=comm._node_dtype, **comm.codec.config(),
    )
    probe.use_topology_of(comm)  # across nodes as the job exchanges, on its node groups
    w = probe.world_size
    ways: List[Tuple[str, bool, Optional[str]]] = [("plain", False, None), ("compressed", True, None)]
    ways += [(f"route{i}", True, route) for i, route in enumerate(routes)]
    # several nodes on gloo: the plain exchange hierarchically too, and its inter-node part alone
    layered = probe._plain_hierarchical is not None
    if layered:
        ways.append(("plain-hierarchical", False, None))
    points: Dict[str, List[Tuple[float, float]]] = {way: [] for way, _, _ in ways}
    points["inter-node"] = []  # the inter-node link alone, where layered
    fitted = [way for way, _, _ in ways] + (["inter-node"] if layered else [])

    def time_size(n: int) -> None:
        x = torch.randn(GROUPS * n, generator=torch.Generator().manual_seed(n)).to(device)
        buf = torch.empty(GROUPS * n, device=device)  # groups back to back, as in a DDP bucket
        shape = calibration_shape(probe.codec, n)
        parts = [buf[i * n : (i + 1) * n].view(shape) for i in range(GROUPS)]
        for way, compress, route in ways:
            names = [f"planner.{n}.{way}.{i}" for i in range(GROUPS)]
            if route is not None:
                probe.routes.update({name: route for name in names})
            probe.plain_hierarchy_from = 0 if way == "plain-hierarchical" else None

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
            points[way].append((n, median_seconds(once, repeats, before=fresh) / GROUPS))
        if layered:  # the inter-node link alone: every rank's share across nodes at once, as in the exchange
            share = torch.ones(GROUPS * -(-n // probe.topology.local_size), device=device)
            cross = probe._node_groups[1]
            dist.barrier(group=comm.group)
            seconds = median_seconds(lambda: dist.all_reduce(share, group=cross), repeats)
            points["inter-node"].append((n, seconds / GROUPS))

    def slowest_lines() -> Dict[str, Line]:
        figures = torch.tensor([v for way in fitted for v in fit(points[way])], dtype=torch.float64, device=device)
        if w > 1:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=comm.group)
        values = figures.cpu().tolist()
        return dict(zip(fitted, (Line(values[2 * i], values[2 * i + 1]) for i in range(len(fitted)))))

    def costs_of(lines: Dict[str, Line]) -> Costs:
        return Costs(
            lines["plain"], lines["compressed"], world_size=w,
            routes={route: lines[f"route{i}"] for i, route in enumerate(routes)},
            plain_hierarchical=lines.get("plain-hierarchical"), inter_node=lines.get("inter-node"),
            nodes=len(probe.topology.nodes) if layered else 1,
        )

    try:
        for n in SIZES:
            time_size(n)
        lines = slowest_lines()
        if extra_size_due(costs_of(lines), largest, repeats):
            time_size(EXTRA_SIZE)  # (every rank decides alike: from the slowest rank's lines)
            lines = slowest_lines()
    finally:
        probe.close()
    return costs_of(lines)


def extra_size_due(costs: Costs, largest: int, repeats: int = REPEATS) -> bool:
    """Whether to time :data:`EXTRA_SIZE` values too: the lines from groups of at most
    ``SIZES[-1]`` values are extrapolated to ``largest`` (more than twice that), and there the
    compressed line is the optimistic one (its CPU work leaves the caches); where they put
    ``largest`` within a factor of two of the bar (its compressed cost between half and twice
    ``1 - MARGIN`` of its plain cost), and timing that size every way (``GROUPS`` groups, once
    and ``repeats`` times) would take at most :data:`EXTRA_BUDGET_S` by the lines, one more
    point settles it.

    Measured at 10 Gbit/s, 4 ranks on 2 cores (two calibrations, one run): compressed over plain was
    0.75–0.82 at 1 Mi values, 0.54–0.69 at 4 Mi and 0.58–0.79 at 16 Mi, where the lines from
    the three sizes had put the largest groups (22 Mi values) at 0.40–0.86 in earlier runs, the
    low ones compressing a group that then ran slower than plain."""
    if largest <= 2 * SIZES[-1]:
        return False
    plain = costs.plain_s(largest)
    ratio = costs.cheapest(largest)[1] / plain if plain > 0 else math.inf
    bar = 1 - MARGIN
    if not bar / 2 < ratio < 2 * bar:
        return False
    lines = [costs.plain, costs.compressed, *costs.routes.values()]
    lines += [line for line in (costs.plain_hierarchical, costs.inter_node) if line is not None]
    return sum(line.at(EXTRA_SIZE) for line in lines) * GROUPS * (repeats + 1) <= EXTRA_BUDGET_S


def calibration_shape(codec: Codec, numel: int) -> Tuple[int, ...]:
    """The shape of a calibration group of ``numel`` values (a power of two): flat, or for a
    codec that factorises each tensor by its shape (:attr:`Codec.needs_shapes`, PowerSGD) a
    matrix as square as the count allows, as a layer's weight is; flat, PowerSGD would send
    it as it is and the compressed line would be a plain all-reduce's."""
    if not codec.needs_shapes:
        return (numel,)
    rows = 1 << (numel.bit_length() - 1) // 2
    return (rows, numel // rows)


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
    """One group's choice: ``compress`` or not, with both predictions in seconds (NaN: not
    planned), and the route of its compressed exchange (None: the configured collective)."""

    group: int
    members: List[str]
    numel: int
    compress: bool
    plain_s: float
    compressed_s: float
    route: Optional[str] = None

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
    """Compress a group only where its cheapest compressed exchange (over the configured
    collective and ``costs.routes``) beats the plain all-reduce by ``MARGIN``; every group,
    with NaN predictions, when there is no model (``costs`` None: planning is off)."""
    out = []
    for g, members in enumerate(groups):
        tensors = [params[m] for m in members]
        n = sum(t.numel() for t in tensors)
        if costs is None:
            out.append(Decision(g, list(members), n, True, float("nan"), float("nan")))
            continue
        plain = costs.plain_s(n, tensors[0].element_size())
        route, packed = costs.cheapest(padded_numel(codec, tensors))
        out.append(Decision(g, list(members), n, packed < (1 - MARGIN) * plain, plain, packed, route))
    return out


def report(decisions: Sequence[Decision], measured: Mapping[int, List[float]], costs: Optional[Costs]) -> Dict[str, Any]:
    """What ``state.plan()`` returns: the model and one row per group with prediction and measurement."""
    rows = []
    for d in decisions:
        times = measured.get(d.group, [])
        rows.append({
            "group": d.group, "params": len(d.members), "first": d.members[0] if d.members else "",
            "mb": round(d.numel * 4 / 2**20, 3), "compress": d.compress, "route": d.route,
            "predicted_plain_ms": round(d.plain_s * 1e3, 3), "predicted_compressed_ms": round(d.compressed_s * 1e3, 3),
            "predicted_ms": round(d.predicted_s * 1e3, 3),
            "measured_ms": round(statistics.median(times) * 1e3, 3) if times else None,
        })
    # groups exchanged side by side, as calibrated: their costs add up to the step's exchange
    total = sum(d.predicted_s for d in decisions) if costs is not None else float("nan")
    return {"costs": costs.as_dict() if costs else None, "predicted_total_ms": round(total * 1e3, 3), "groups": rows}


class DriftWatch:
    """Measured against predicted exchange times: when the model stops describing the link.

    Each exchange of a step (a bucket's job, or its plain all-reduce) adds its predicted and its
    measured seconds, from step ``start`` on (the first compressed step is left out: it opens
    connections and DDP rebuilds its buckets after it). Every ``every`` steps the window's ratio measured/predicted is taken on the
    slowest rank (one all-reduce with MAX), so every rank holds the same float. The first window
    after a calibration sets the baseline: measured times include what the pipeline overlaps and
    what backward hides, which the model does not price, so the ratio is compared with itself,
    not with 1. When it moves by more than ``limit`` either way (the link got slower or faster,
    other jobs took the cores), :meth:`check` says so and the planner calibrates again.
    """

    def __init__(self, every: int = CHECK_EVERY, limit: float = DRIFT, start: int = 0) -> None:
        self.every, self.limit, self.start = every, limit, start
        self.baseline: Optional[float] = None
        self.last_ratio: Optional[float] = None
        self.recalibrations = 0
        self._sums: Dict[int, List[float]] = {}  # step -> [predicted, measured] (this rank)
        self._checked = -1  # the last step a check covered
        self._lock = threading.Lock()  # plain all-reduces report from their completion callbacks

    def add(self, predicted_s: float, measured_s: float, step: int) -> None:
        """One exchange of ``step``; steps before ``start``, and steps a check has already
        covered (a completion reported after it), are not counted."""
        if step >= self.start and predicted_s > 0 and math.isfinite(predicted_s):
            with self._lock:
                if step > self._checked:
                    sums = self._sums.setdefault(step, [0.0, 0.0])
                    sums[0] += predicted_s
                    sums[1] += measured_s

    def due(self, step: int) -> bool:
        """Whether :meth:`check` runs once ``step``'s exchanges are done."""
        k = step - self.start
        return k >= 0 and k % self.every == self.every - 1

    def reset(self) -> None:
        """Start a new baseline (the plan changed: the next window sets it)."""
        self.baseline = None
        with self._lock:
            self._sums.clear()

    def check(self, step: int, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> bool:
        """Whether the times of the steps up to ``step`` drifted; a collective: every rank calls
        it after the same step."""
        with self._lock:
            window = [v for s, v in self._sums.items() if s <= step]
            self._sums = {s: v for s, v in self._sums.items() if s > step}
            self._checked = max(self._checked, step)
        predicted = sum(p for p, _ in window)
        ratio = sum(m for _, m in window) / predicted if predicted > 0 else 0.0
        figure = torch.tensor([ratio], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(figure, op=dist.ReduceOp.MAX, group=group)
        ratio = float(figure.item())
        self.last_ratio = ratio
        if ratio <= 0:  # nothing measured anywhere
            return False
        if self.baseline is None:
            self.baseline = ratio
            return False
        if max(ratio / self.baseline, self.baseline / ratio) <= self.limit:
            return False
        self.baseline = None
        self.recalibrations += 1
        return True

    def as_dict(self) -> Dict[str, Any]:
        return {
            "check_every": self.every, "limit": self.limit, "baseline": self.baseline,
            "last_ratio": self.last_ratio, "recalibrations": self.recalibrations,
        }

