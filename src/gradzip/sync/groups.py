"""The plan: which gradients are compressed, and which of them share one encoding (a group).

DDP hands gradients over in buckets whose membership changes: it rebuilds them after the first
iteration in the order gradients became ready, and a restarted job starts again from the
initial ones. If the fused layout followed DDP's buckets, the bytes of a step (block
boundaries, keys of stochastic rounding) would depend on that history. So gradzip makes its own
groups once, from the parameters alone: compressible parameters in reverse registration order
(the order backward usually produces them), cut into groups of about ``group_bytes``. A group
is exchanged as soon as its last member's bucket arrives; a bucket is done when every group
holding one of its gradients is done. The same model and settings give the same groups on
every rank and in every run, and a resumed run moves exactly the bytes of an uninterrupted one.

Inside a group every gradient starts on a block boundary of the codec (see
:meth:`~gradzip.codecs.base.Codec.fusion_block`), so its last block is padded with zeros that go
on the wire. For a gradient of many blocks that costs little; for one of a few blocks (a
256-value weight under 1024-value max-min buckets is padded fourfold) it would cost more than
fusing saves, so a gradient whose padding exceeds ``MAX_PADDING`` of its size is exchanged alone,
with exactly the bytes of its own encoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..codecs.base import part_spans
from ..kernels.rng import stable_hash

MAX_PADDING = 1 / 8  # the most padding, relative to its size, a gradient may take on to join a group


@dataclass
class FusionPlan:
    """Groups of compressed parameter names; ``group_of`` maps a name to its group's index."""

    groups: List[List[str]]
    group_of: Dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_of = {name: g for g, names in enumerate(self.groups) for name in names}

    @classmethod
    def build(
        cls,
        params: Sequence[Tuple[str, torch.Tensor]],
        compress: Callable[[torch.Tensor], bool],
        block: int,
        group_bytes: int,
        level: Optional[Callable[[str], Any]] = None,
    ) -> "FusionPlan":
        """Group the parameters ``compress`` selects (in reverse order) into groups of about
        ``group_bytes``; singletons where ``block`` is 0 (the codec cannot fuse) or where padding
        a gradient to whole blocks of ``block`` values would cost more than ``MAX_PADDING``.
        ``level``: a parameter name's compression level (:mod:`gradzip.policy.adaptive`); a group
        holds one level only, so each level keeps a group of its own open."""
        groups: List[List[str]] = []
        open_group: Dict[Any, Tuple[int, int]] = {}  # level -> (index of its open group, its bytes)
        for name, p in reversed(list(params)):
            if not p.requires_grad or not compress(p):
                continue
            key = level(name) if level is not None else None
            nbytes = p.numel() * p.element_size()
            solo = block <= 0 or padding(p.numel(), block) > MAX_PADDING * p.numel()
            current = open_group.get(key)
            if solo or current is None or current[1] + nbytes > group_bytes and current[1] > 0:
                groups.append([])
                current = (len(groups) - 1, 0)
            groups[current[0]].append(name)
            open_group[key] = (current[0], current[1] + nbytes)
            if solo:  # a singleton stays one
                del open_group[key]
        return cls(groups)

    def __len__(self) -> int:
        return len(self.groups)

    def describe(self) -> List[Dict[str, object]]:
        """One row per group: its index and members (for logs and ``state.plan()``)."""
        return [{"group": g, "members": list(names)} for g, names in enumerate(self.groups)]


class FusedLayout:
    """Where the gradients of a fused group lie in its flat buffer, made once per group.

    ``order``: indices into the group's gradients in name order (the canonical layout, see
    :meth:`~gradzip.sync.fused.FusedGroups._reduce_fused`); ``spans[k] = (start, numel)`` of
    the k-th of them, each starting on a block boundary; ``gaps``: the padding after each, as
    ``(start, length)``, the last one to ``length(total)`` where given (the collective's
    :meth:`~gradzip.comm.base.Collective.fused_length`); ``total`` values; ``key``: the group's
    name. :meth:`views` keeps the views of the buffer last seen in each role, so a step that gets
    the same buffers from the pool as the last one (the usual case) makes no view per gradient:
    on an accelerator each of them costs host time in the comm thread.
    """

    def __init__(self, shapes: Sequence[torch.Size], names: Sequence[str], block: int, key: str,
                 length: Optional[Callable[[int], int]] = None) -> None:
        self.order = sorted(range(len(names)), key=lambda i: names[i])
        self.names = [names[i] for i in self.order]
        self.shapes = [shapes[i] for i in self.order]
        # ``(name, shape)`` of each gradient in order, for a codec that encodes the buffer by its
        # parts: their places are the codecs' rule (:func:`~gradzip.codecs.base.part_spans`)
        self.parts = tuple(zip(self.names, self.shapes))
        self.spans: List[Tuple[int, int]] = list(part_spans(self.parts, block))
        self.gaps: List[Tuple[int, int]] = [(a + n, padding(n, block)) for a, n in self.spans]
        total = sum(n + gap for (_, n), (_, gap) in zip(self.spans, self.gaps))
        if length is not None and self.gaps:  # zeros after the last gradient too (the collective's length)
            start, gap = self.gaps[-1]
            extra = length(total) - total
            self.gaps[-1] = (start, gap + extra)
            total += extra
        self.total = total
        self.key = key
        self.used = -1  # the last step that exchanged the group (the engine drops layouts left unused)
        self._views: Dict[str, Tuple[Tuple[Any, ...], List[torch.Tensor]]] = {}
        self._members: Dict[int, Tuple[Tuple[str, int], ...]] = {}

    def members(self, itemsize: int) -> Tuple[Tuple[str, int], ...]:
        """``(name, bytes)`` of each gradient in :attr:`order` at ``itemsize`` bytes a value: what
        the metrics record for the group (:meth:`~gradzip.sync.metrics.Metrics.record_group`), made once."""
        members = self._members.get(itemsize)
        if members is None:
            members = self._members[itemsize] = tuple((n, s.numel() * itemsize) for n, s in zip(self.names, self.shapes))
        return members

    def views(self, buf: torch.Tensor, role: str, keep: bool = True) -> List[torch.Tensor]:
        """The gradients' places in the flat ``buf``, shaped as the gradients, in :attr:`order`;
        kept for the next call in ``role`` unless ``keep`` is False (a buffer that is not the
        group's own: kept views would keep it alive)."""
        ident = (buf.data_ptr(), buf.numel(), buf.dtype, buf.device)
        kept = self._views.get(role)
        if kept is not None and kept[0] == ident:
            return kept[1]
        views = [buf[a : a + n].view(shape) for (a, n), shape in zip(self.spans, self.shapes)]
        if keep:
            self._views[role] = (ident, views)
        else:  # nor the views of the role's last buffer
            self._views.pop(role, None)
        return views


def padding(numel: int, block: int) -> int:
    """Zeros that follow ``numel`` values in a fused buffer to reach the next block boundary."""
    return -numel % block


class GroupCollector:
    """Gathers a step's gradients group by group as DDP's buckets arrive (hook thread only).

    It also holds the uncompressed gradients of a bucket that completes no group (:meth:`hold`):
    such a bucket waits for a later group anyway, so its plain sum can ride in the next job's
    instead of a job of its own. Where groups are larger than DDP's buckets (on a GPU, 32 or 128
    MiB against DDP's 25) most buckets complete none, and a job each costs the comm thread's
    host time (and the interpreter lock that backward's own Python needs) for a sum of a few
    bias and norm vectors; ``hold_bytes`` bounds what is held, so that no large plain sum waits
    for the end of backward.
    """

    def __init__(self, plan: FusionPlan, hold_bytes: int = 0) -> None:
        self.plan = plan
        self.hold_bytes = hold_bytes
        self._pending: Dict[int, Dict[str, torch.Tensor]] = {}
        self._futures: Dict[int, torch.futures.Future] = {}
        self._held: List[Tuple[str, torch.Tensor]] = []
        self._held_futures: List[torch.futures.Future] = []
        self._held_step: Optional[int] = None
        self._held_total = 0

    def add(self, name: str, grad: torch.Tensor) -> Tuple[int, torch.futures.Future]:
        """Record one gradient; its group's index and the future that completes with the group."""
        g = self.plan.group_of[name]
        self._pending.setdefault(g, {})[name] = grad
        fut = self._futures.get(g)
        if fut is None:
            fut = self._futures[g] = torch.futures.Future()
        return g, fut

    def ready(self, last: bool) -> List[Tuple[List[str], List[torch.Tensor], torch.futures.Future]]:
        """The groups now complete (every group when ``last``: a backward pass that left a member
        out, e.g. one without gradient, still ends), in plan order, with their futures; forgotten."""
        out = []
        for g in sorted(self._pending):
            members = self._pending[g]
            if last or len(members) == len(self.plan.groups[g]):
                names = [n for n in self.plan.groups[g] if n in members]
                out.append((names, [members[n] for n in names], self._futures.pop(g)))
        for names, _, _ in out:
            self._pending.pop(self.plan.group_of[names[0]], None)
        return out

    def hold(self, names: Sequence[str], grads: Sequence[torch.Tensor], step: int) -> Optional[torch.futures.Future]:
        """Keep these plain gradients of step ``step`` for the next job's plain sum; the future
        that completes with that job, or None where they would take the held bytes past
        :attr:`hold_bytes` (the caller sums them now, with what is held)."""
        if self._held_step != step:  # left from a backward pass that did not end: not this step's
            self._drop_held()
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        if self._held_total + nbytes > self.hold_bytes:
            return None
        self._held_step = step
        self._held.extend(zip(names, grads))
        self._held_total += nbytes
        fut = torch.futures.Future()
        self._held_futures.append(fut)
        return fut

    def take_held(self, step: int) -> Tuple[List[str], List[torch.Tensor], List[torch.futures.Future]]:
        """The plain gradients held for step ``step`` (names, gradients, the futures that wait
        for their sum), forgotten here: they go into the job now being made."""
        if self._held_step != step:
            self._drop_held()
            return [], [], []
        names = [n for n, _ in self._held]
        grads = [g for _, g in self._held]
        futures = self._held_futures
        self._drop_held()
        return names, grads, futures

    def _drop_held(self) -> None:
        self._held, self._held_futures, self._held_step, self._held_total = [], [], None, 0


def group_key(names: Sequence[str]) -> str:
    """The name a fused group is encoded under: the same for the same members, on every rank."""
    return f"fused:{len(names)}:{stable_hash(*names):08x}"
