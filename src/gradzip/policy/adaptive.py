"""Layer-wise adaptive compression levels (CGX's adaptive bit widths, chosen as L-GreCo does).

One uniform level (4 bits, 1 % of values, rank 4) is a poor fit for a whole model: a layer whose
gradient varies little loses almost nothing at 2 bits, one with wide outliers needs 6. CGX
(Markov et al., Middleware'22) adapts bit widths per layer; L-GreCo (Markov et al., MLSys'24)
states the choice as a knapsack and solves it by dynamic programming: per layer ``l`` and
candidate level ``k``, measure the compression error ``e[l, k]`` (the squared L2 distance between
a gradient and its decoded encoding) and the wire bytes ``b[l, k]``, then

* ``objective="bytes"``: least total bytes with total error at most that of the uniform level
  the codec was configured with;
* ``objective="error"``: least total error with total bytes at most the uniform level's.

The errors are summed over a few sampled steps and over every rank (one all-reduce), the choice
is made on every rank from those sums and rank 0's choice is broadcast, so every rank exchanges
at the same levels. It is re-planned every ``every`` steps. The error is measured on the
error-compensated input (what the codec really encodes) with separate probe codecs, so measuring
leaves the exchange's state (PowerSGD's Q, random streams) untouched.

The knapsack is solved exactly over a discretised budget (units of 1/``resolution`` of it, the
resolution growing with the number of layers); every plan is checked against the true budget
before it is taken, and where nothing better is found the uniform level stays.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..codecs import registry as _registry
from ..codecs.base import Codec
from ..config import ADAPTIVE

# the option that sets a codec's level, and its candidate values (the configured one is added)
LEVELS: Dict[str, Tuple[str, Tuple[Any, ...]]] = {
    "maxmin": ("bits", (2, 3, 4, 5, 6, 8)),
    "qsgd": ("bits", (2, 3, 4, 5, 6, 8)),
    "topk": ("ratio", (0.001, 0.003, 0.01, 0.03, 0.1)),
    "randomk": ("ratio", (0.001, 0.003, 0.01, 0.03, 0.1)),
    "dgc": ("ratio", (0.0003, 0.001, 0.003, 0.01, 0.03)),
    "powersgd": ("rank", (1, 2, 4, 8, 16)),
}
OBJECTIVES = ADAPTIVE  # "off", "bytes", "error"
SAMPLES = 2  # steps whose errors are summed before each plan


def check(codec_name: str, objective: str, ramp: int = 0) -> None:
    """Raise ``ValueError`` when ``objective`` is not one of :data:`OBJECTIVES`, or when levels
    are asked of a codec that has none (adaptive levels, or a ramp)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"adaptive must be one of {', '.join(OBJECTIVES)} (or True/False), got {objective!r}")
    for asked, what in ((objective != "off", "adaptive compression chooses"), (ramp > 0, "a ramp passes through")):
        if asked and codec_name not in LEVELS:
            raise ValueError(f"{what} levels of {', '.join(sorted(LEVELS))}; codec {codec_name!r} has none")


class LevelCodecs:
    """The codec at every level of one configured codec (the configured level is that codec
    itself), made when first asked for; their state (PowerSGD's Q of another rank) is saved."""

    def __init__(self, codec: Codec, memory: Any = None) -> None:
        self.name = codec.name
        self.memory = memory  # the error feedback (a Memory) or None: a level that cannot take it is not offered
        self.option = LEVELS[codec.name][0]
        self.configured = getattr(codec, self.option)
        self._base = codec
        self._codecs: Dict[Any, Codec] = {self.configured: codec}

    def get(self, level: Any) -> Codec:
        c = self._codecs.get(level)
        if c is None:
            c = self._codecs[level] = self.make(level)
        return c

    def make(self, level: Any) -> Codec:
        """A fresh codec at ``level`` (no state shared with the exchange's)."""
        return _registry.codec(self._base.name, **{**self._base.config(), self.option: level})

    def allowed(self, level: Any) -> bool:
        """Whether the codec at ``level`` takes this error feedback (QSGD's residual is bounded
        only at enough bits for its buckets: :meth:`~gradzip.codecs.base.Codec.memory_problem`)."""
        return self.memory is None or self.memory.refused_by(self.get(level)) is None

    def wire_bytes(self, level: Any, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Bytes of a gradient of ``shape`` and ``dtype`` at ``level``: what goes as it is goes in
        the gradient's width, also where error feedback compensates a 16-bit one in fp32."""
        wide = dtype if dtype.itemsize >= 4 else torch.float32  # (a 16-bit one compensated in fp32, or not)
        return self.get(level).wire_bytes(math.prod(shape), wide, shape, wire=dtype)

    def state_dict(self) -> Dict[str, Any]:
        """The state of the codecs of other levels (the configured codec saves its own)."""
        return {lv: c.state_dict() for lv, c in self._codecs.items() if lv != self.configured}

    def load_state_dict(self, state: Mapping[Any, Any]) -> None:
        for level, value in state.items():
            if level != self.configured:
                self.get(level).load_state_dict(value)


def ramp_levels(codec_name: str, target: Any) -> List[Any]:
    """The levels a ramp passes through before ``target``: DGC's densities 25 %, 6.25 %, ...
    (a quarter each stage) down to the target ratio; ranks 4× and 2× the target; 8 and 6 bits."""
    option = LEVELS[codec_name][0]
    if option == "ratio":
        out, r = [], 0.25
        while r > target:
            out.append(r)
            r /= 4
        return out
    if option == "rank":
        return [target * 4, target * 2]
    return [b for b in (8, 6) if b > target]


class Ramp:
    """DGC's warm-up schedule: from ``start`` (the first compressed step), ``steps`` steps
    split evenly over :func:`ramp_levels`; :meth:`level_at` is None outside it."""

    def __init__(self, codec: Codec, steps: int, start: int = 0) -> None:
        self.stages = ramp_levels(codec.name, getattr(codec, LEVELS[codec.name][0])) if steps > 0 else []
        self.steps = steps if self.stages else 0
        self.start = start

    def level_at(self, step: int) -> Any:
        k = step - self.start
        if not 0 <= k < self.steps:
            return None
        return self.stages[k * len(self.stages) // self.steps]

    @property
    def end(self) -> int:
        """The first step at the configured level."""
        return self.start + self.steps


def knapsack(units: torch.Tensor, costs: torch.Tensor, capacity: int) -> Optional[List[int]]:
    """One option per row minimising the summed ``costs`` with summed ``units`` <= ``capacity``.

    ``units`` (non-negative integers) and ``costs`` are (layers, options); an exact dynamic
    programme over the capacity. None when no choice fits.
    """
    layers, options = units.shape
    if capacity < 0 or layers == 0:
        return None
    inf = float("inf")
    best = torch.full((capacity + 1,), inf, dtype=torch.float64)
    best[0] = 0.0  # best[u]: least cost of the layers so far using exactly u units
    picks = torch.empty((layers, capacity + 1), dtype=torch.int16)
    cost = costs.double()
    for layer in range(layers):
        nxt = torch.full_like(best, inf)
        pick = torch.zeros(capacity + 1, dtype=torch.int16)
        for k in range(options):
            u = int(units[layer, k])
            if u > capacity or not math.isfinite(float(cost[layer, k])):
                continue
            cand = torch.full_like(best, inf)
            cand[u:] = best[: capacity + 1 - u] + cost[layer, k]
            better = cand < nxt
            nxt = torch.where(better, cand, nxt)
            pick = torch.where(better, torch.full_like(pick, k), pick)
        best, picks[layer] = nxt, pick
    end = int(torch.argmin(best))
    if not math.isfinite(float(best[end])):
        return None
    choice = [0] * layers
    for layer in range(layers - 1, -1, -1):
        k = int(picks[layer, end])
        choice[layer] = k
        end -= int(units[layer, k])
    return choice


def choose(
    errors: torch.Tensor, nbytes: torch.Tensor, default: int, objective: str, fixed: Optional[torch.Tensor] = None,
) -> List[int]:
    """Per layer, the index of its level: the knapsack of ``objective`` against the uniform
    ``default`` level's total, or ``default`` everywhere when that is at least as good.
    ``fixed``: layers that keep ``default`` (those never measured: no gradient while sampling).

    The constrained quantity is discretised into units of 1/``resolution`` of the uniform
    total, rounded up, and the capacity is the uniform choice's own units, so the uniform
    choice always fits. A plan that fits in units but not in the true values (rounding) is
    searched again with less capacity, then given up for the uniform choice.
    """
    layers = errors.shape[0]
    uniform = [default] * layers
    if layers == 0:
        return uniform
    weights, costs = (errors, nbytes) if objective == "bytes" else (nbytes, errors)
    weights, costs = weights.double(), costs.double()
    rows = torch.arange(layers)
    total = float(weights[rows, default].sum())
    if not total > 0 or not math.isfinite(total):
        return uniform
    resolution = max(1000, 50 * layers)
    units = torch.ceil(weights * (resolution / total) - 1e-9).clamp_(min=0)
    units = torch.where(torch.isfinite(units), units, torch.full_like(units, 10 * resolution)).long()
    if fixed is not None and bool(fixed.any()):
        others = torch.ones_like(units, dtype=torch.bool)
        others[:, default] = False
        units[fixed.bool().unsqueeze(1) & others] = 10 * resolution  # beyond any capacity
    capacity = int(units[rows, default].sum())
    baseline = float(costs[rows, default].sum())
    for _ in range(4):
        picked = knapsack(units, costs, capacity)
        if picked is None:
            break
        index = torch.tensor(picked)
        if float(costs[rows, index].sum()) >= baseline:
            break
        over = float(weights[rows, index].sum()) - total
        if over <= total * 1e-12:
            return picked
        capacity -= max(1, math.ceil(over * resolution / total))
    return uniform


class AdaptiveLevels:
    """Per-parameter levels of one codec family: measured, planned, and the codecs that apply them.

    ``names``/``shapes``: the compressed parameters, in the same order on every rank;
    ``dtypes``: their gradients' (fp32 where not given), by which each level is priced.
    ``warmup``: the first step that is compressed; errors are sampled on :data:`SAMPLES` steps
    and a plan is made at the end of the last one, then every ``every`` steps.
    """

    def __init__(
        self, codecs: LevelCodecs, objective: str, every: int, names: Sequence[str], shapes: Sequence[Tuple[int, ...]],
        warmup: int = 0, dtypes: Optional[Sequence[torch.dtype]] = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < SAMPLES:
            raise ValueError(f"adaptive_every must be an integer of at least {SAMPLES} steps, got {every!r}")
        self.option, candidates = LEVELS[codecs.name]
        self.levels: List[Any] = sorted({lv for lv in candidates if codecs.allowed(lv)} | {codecs.configured})
        self.default = self.levels.index(codecs.configured)
        self.objective, self.every, self.warmup = objective, every, warmup
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.shapes = [tuple(sh) for sh in shapes]
        self._codecs = codecs
        self.choice: List[int] = [self.default] * len(self.names)
        self.errors = torch.zeros(len(self.names), len(self.levels), dtype=torch.float64)
        self.last_errors: Optional[torch.Tensor] = None  # the summed errors of the latest plan
        self.seen = torch.zeros(len(self.names), dtype=torch.float64)  # measurements per parameter
        self.plans = 0
        self.sampling = False
        self.nbytes = torch.tensor(
            [[codecs.wire_bytes(lv, sh, dt) for lv in self.levels]
             for sh, dt in zip(self.shapes, dtypes or [torch.float32] * len(self.shapes))], dtype=torch.float64,
        ).reshape(len(self.shapes), len(self.levels))

    # ------------------------------------------------------------ schedule
    def sample_at(self, step: int) -> bool:
        """Whether the errors of ``step`` (counted by the hook) are measured."""
        k = step - self.warmup
        return k >= 0 and k % self.every < SAMPLES

    def plan_after(self, step: int) -> bool:
        """Whether a plan is made once ``step``'s exchanges are done."""
        k = step - self.warmup
        return k >= 0 and k % self.every == SAMPLES - 1

    # ------------------------------------------------------------ levels
    def level(self, name: str) -> Any:
        i = self.index.get(name)
        return self.levels[self.choice[i] if i is not None else self.default]

    def codec_for(self, name: str) -> Codec:
        """The codec that exchanges ``name`` at its present level."""
        return self._codecs.get(self.level(name))

    # ------------------------------------------------------------ measuring
    def observe(self, name: str, x: torch.Tensor, step: int) -> None:
        """Add the squared error of every candidate level on ``x`` (what the codec encodes)."""
        i = self.index.get(name)
        if i is None or x.numel() == 0:
            return
        flat = x.detach().float()
        self.seen[i] += 1
        sums = []
        for level in self.levels:
            probe = self._codecs.make(level)
            decoded = probe.decode(probe.encode(flat, name=f"probe:{name}", step=step)).float().reshape(-1)
            if decoded.data_ptr() == flat.data_ptr():  # sent raw: the input itself, no error
                decoded = decoded.clone()
            diff = decoded.sub_(flat.reshape(-1))  # in place: no further tensor of the gradient's size
            sums.append(torch.dot(diff, diff))
        errs = torch.stack(sums).double().cpu()  # one host sync per parameter, on sampled steps only
        self.errors[i] += torch.where(torch.isfinite(errs), errs, torch.zeros_like(errs))

    def replan(self, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> bool:
        """Sum the sampled errors over ranks, choose levels, take rank 0's choice; True if changed.

        ``device``: where the group's collectives run (CUDA for NCCL; default CPU)."""
        device = torch.device("cpu") if device is None else device
        both = torch.cat([self.errors, self.seen.unsqueeze(1)], dim=1).to(device)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.all_reduce(both, group=group)
        both = both.cpu()
        errors, seen = both[:, :-1], both[:, -1]
        picked = torch.tensor(
            choose(errors, self.nbytes, self.default, self.objective, fixed=seen == 0), dtype=torch.int64,
        ).to(device)
        if distributed:
            dist.broadcast(picked, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        new = [int(k) for k in picked.cpu()]
        changed = new != self.choice
        self.choice = new
        self.last_errors = errors
        self.errors.zero_()
        self.seen.zero_()
        self.plans += 1
        return changed

    # ------------------------------------------------------------ reports and state
    def describe(self) -> Dict[str, Any]:
        """The per-parameter levels, the plan's totals and the uniform level's, for ``state.plan()``."""
        rows = torch.arange(len(self.names))
        chosen = torch.tensor(self.choice, dtype=torch.int64)
        errors = self.last_errors
        out: Dict[str, Any] = {
            "option": self.option, "objective": self.objective, "every": self.every, "plans": self.plans,
            "uniform": self.levels[self.default],
            "per_parameter": {n: self.levels[k] for n, k in zip(self.names, self.choice)},
            "bytes": int(self.nbytes[rows, chosen].sum()) if self.names else 0,
            "uniform_bytes": int(self.nbytes[:, self.default].sum()) if self.names else 0,
        }
        if errors is not None and self.names:
            out["error"] = float(errors[rows, chosen].sum())
            out["uniform_error"] = float(errors[:, self.default].sum())
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {
            "option": self.option,
            "levels": list(self.levels),
            "choice": {n: self.levels[k] for n, k in zip(self.names, self.choice)},
            "errors": self.errors.clone(),
            "seen": self.seen.clone(),
            "plans": self.plans,
        }

    def carry_over(self, old: "AdaptiveLevels") -> None:
        """Take ``old``'s levels for the parameters both hold, and its count of plans (a new set
        of compressed parameters); the errors measured so far start again."""
        self.choice = [old.choice[old.index[n]] if n in old.index else self.default for n in self.names]
        self.plans = old.plans

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; names or levels it does not know keep the uniform level."""
        choice = state.get("choice", {})
        self.choice = [
            self.levels.index(choice[n]) if choice.get(n) in self.levels else self.default for n in self.names
        ]
        errors = state.get("errors")
        seen = state.get("seen")
        if isinstance(errors, torch.Tensor) and errors.shape == self.errors.shape and isinstance(seen, torch.Tensor):
            self.errors, self.seen = errors.clone().double(), seen.clone().double()
        else:
            self.errors.zero_()
            self.seen.zero_()
        self.plans = int(state.get("plans", 0))
