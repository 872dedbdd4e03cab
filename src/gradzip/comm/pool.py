"""Buffers lent to one exchange at a time and reused by the next, whatever its group.

A fresh buffer costs a page fault per 4 KiB on every touch, so exchanges keep theirs from step
to step; kept per group, though, every group's buffers would stay resident although only the
groups in flight (a few, see :mod:`gradzip.sync.pipeline`) use them. A pool lends a free buffer
of the request's size class (sizes 2^(k/4): at most 19% more than asked) and takes it back when
the exchange ends, so groups of nearly the same size share buffers and the pool holds, per
class, what the exchanges in flight at once needed; a buffer nobody borrowed in the present
step or the one before (a group that no longer exists) is dropped, unless the plan below still
counts on it.

Classes of neighbouring sizes are often not in flight at once, or not at their peaks at once:
held apart, each keeps as many buffers as its own busiest moment needed, and the sum is more
than was ever lent together (ResNet-50's payloads at two ranks: a third more). So the pool
notes, step by step, when each class's buffers are lent and given back, and at the next step
serves a class by the buffers of a larger one (up to :data:`MERGE_CLASSES` classes up, about
twice the size) where that larger class's buffers, as many as the two were lent together at
most, cost fewer bytes than each class's own (:func:`plan_serving`; the busiest moments of the
last two steps, so steps that take turns in two patterns keep one plan). A training step repeats
the one before it, so the plan holds; where the pattern changes it is made again.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

MERGE_CLASSES = 4  # a class may be served by buffers up to this many classes larger (about 2x)
RECORD_LIMIT = 1 << 16  # lends and returns noted per step; past it (no steps counted) no plan is made

Key = Tuple[int, torch.device]  # (size class, device)


def size_class(numel: int) -> int:
    """``numel`` rounded up to the next of the sizes 2^(k/4) (at most 19% more): requests of
    nearly the same size share buffers, and a buffer always serves the same class."""
    if numel <= 16:
        return max(numel, 1)
    k = math.ceil(4 * math.log2(numel))
    while math.ceil(2 ** ((k - 1) / 4)) >= numel:  # the smallest class that holds it
        k -= 1
    return math.ceil(2 ** (k / 4))


def classes_up(cls: int, n: int) -> int:
    """The size class ``n`` classes above ``cls``."""
    for _ in range(n):
        cls = size_class(cls + 1)
    return cls


def plan_serving(
    classes: Sequence[int], records: Sequence[Sequence[Tuple[int, int]]],
) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Which class's buffers serve each class, from the records of the last steps: each a list of
    (index into the ascending ``classes``, +1 lent / -1 given back) in order, the busiest
    moments taken over them all (so steps that take turns in two patterns keep one plan that
    fits both). From the largest class down, a run of neighbouring classes is served by buffers
    of its largest where as many of them as the run had lent at once, at most, cost no more bytes
    than each class's own busiest moment in buffers of its own size; a class more than
    :data:`MERGE_CLASSES` below the run's largest starts a run of its own. Returns the classes served by another (the rest serve
    themselves), and how many buffers each serving class needs at most."""
    c = len(classes)
    if not c:
        return {}, {}
    width = min(MERGE_CLASSES, c - 1)
    # buffers lent together, now and at most, per run of classes lo..lo+k (k <= width):
    # index lo * (width + 1) + k; each event changes the runs that hold its class
    most = [0] * (c * (width + 1))
    for deltas in records:
        now = [0] * (c * (width + 1))
        for i, d in deltas:
            for lo in range(max(0, i - width), i + 1):
                for k in range(i - lo, min(width, c - 1 - lo) + 1):
                    at = lo * (width + 1) + k
                    now[at] += d
                    if now[at] > most[at]:
                        most[at] = now[at]

    def peak(lo: int, hi: int) -> int:
        return most[lo * (width + 1) + hi - lo]

    serves: Dict[int, int] = {}
    needs: Dict[int, int] = {}
    top = c - 1
    while top >= 0:
        lo, cost = top, peak(top, top) * classes[top]
        while lo > 0 and top - (lo - 1) <= MERGE_CLASSES and classes[top] <= classes_up(classes[lo - 1], MERGE_CLASSES):
            merged = peak(lo - 1, top) * classes[top]
            if merged > cost + peak(lo - 1, lo - 1) * classes[lo - 1]:
                break
            lo, cost = lo - 1, merged
        for i in range(lo, top):
            serves[classes[i]] = classes[top]
        needs[classes[top]] = peak(lo, top)
        top = lo - 1
    return serves, needs


def indexed(device: "torch.device | str") -> torch.device:
    """``device`` with its index (``cuda`` is ``cuda:<current>``): the device a buffer made on
    it reports, so a buffer given back serves the next request for the same device."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        current = getattr(torch.get_device_module(device.type), "current_device", None)
        if current is not None:  # (a type without one, such as mps, has one device)
            device = torch.device(device.type, current())
    return device


class BufferPool:
    """Flat buffers of one dtype, lent as views of the shape asked for."""

    def __init__(self, dtype: torch.dtype = torch.uint8) -> None:
        self.dtype = dtype
        self._free: Dict[Key, List[Tuple[torch.Tensor, int]]] = {}  # per class: (buffer, last lent)
        self._step = 0
        self._lent: Dict[int, Key] = {}  # id of a buffer lent -> the class of the request it serves
        # this step's (request's class, +1 lent / -1 back); None past RECORD_LIMIT
        self._record: Optional[List[Tuple[Key, int]]] = []
        self._last_record: Optional[List[Tuple[Key, int]]] = []
        self._planned_from: List[Optional[List[Tuple[Key, int]]]] = []  # the records of the plan in use
        self._skipped_first = False  # the record of the first step that lent anything was left out
        self._serves: Dict[Key, int] = {}  # a request's class -> the class of the buffers serving it
        self._needs: Dict[Key, int] = {}  # a serving class -> the buffers the plan saw it need at once
        self._planned: set = set()  # the classes the plan was made from

    def lend(self, shape: Tuple[int, ...], device: torch.device, into: List[torch.Tensor]) -> torch.Tensor:
        """A buffer of ``shape``; the whole buffer is appended to ``into``, the borrower's list of
        what it gives back (:meth:`give_back`) when it ends."""
        need = math.prod(shape)
        device = indexed(device)
        own = (size_class(need), device)
        cls = self._serves.get(own, own[0])
        free = self._free.get((cls, device))
        if not free and own not in self._planned:  # (a class the plan knows gets what it planned)
            free = self._larger_free(cls, device)
        buf = free.pop()[0] if free else torch.empty(cls, dtype=self.dtype, device=device)
        self._lent[id(buf)] = own
        self._note(own, 1)
        into.append(buf)
        return buf[:need].view(shape)

    def _larger_free(self, cls: int, device: torch.device) -> List[Tuple[torch.Tensor, int]]:
        """The free list of the smallest class above ``cls``, up to :data:`MERGE_CLASSES` classes
        up, that holds a buffer on ``device`` (empty if none does): for a class the plan does not
        know yet (the first steps), so that exchanges not in flight together share a buffer
        rather than allocate."""
        limit = classes_up(cls, MERGE_CLASSES)
        best: List[Tuple[torch.Tensor, int]] = []
        for (numel, dev), free in self._free.items():
            if free and dev == device and cls < numel <= limit and (not best or numel < best[0][0].numel()):
                best = free
        return best

    def give_back(self, lent: List[torch.Tensor]) -> None:
        """Take back what a borrower was lent (its transfers have completed). Last lent, first
        back on the free list: a borrower that asks in the same order at the next step gets the
        same buffers, so views of them made once stay valid (:class:`~gradzip.sync.groups.FusedLayout`)."""
        for buf in reversed(lent):
            own = self._lent.pop(id(buf), None)
            if own is not None:
                self._note(own, -1)
            self._free.setdefault((buf.numel(), buf.device), []).append((buf, self._step))
        lent.clear()

    def _note(self, own: Key, delta: int) -> None:
        if self._record is not None:
            self._record.append((own, delta))
            if len(self._record) > RECORD_LIMIT:  # a step too long to plan from (or no steps counted)
                self._record = None

    def new_step(self, step: int) -> None:
        """Plan which buffers serve which class from the steps that ended (see the module's
        docstring), and drop the free buffers nobody borrowed in ``step`` or the one before,
        but for those the plan needs."""
        if step > self._step:
            self._step = step
            if self._record and not self._skipped_first:
                # the first step that lent anything lends it all anew (and DDP rebuilds its
                # buckets after it): no plan is made from it
                self._record, self._skipped_first = None, True
            records = [self._record, self._last_record]
            if self._record is not None and records != self._planned_from:  # (the same two steps: the same plan)
                self._plan(records)
                self._planned_from = records
            self._last_record = self._record
            self._record = [(own, 1) for own in self._lent.values()]  # lent across the boundary
            for key, free in list(self._free.items()):
                # kept: the buffers borrowed in this step or the one before, and older ones as
                # far as the plan needs them (steps that take turns in two patterns)
                recent = [(buf, used) for buf, used in free if used >= step - 1]
                older = [(buf, used) for buf, used in free if used < step - 1]
                spare = max(0, self._needs.get(key, 0) - len(recent))
                free[:] = older[len(older) - spare:] + recent if spare else recent
                if not free:
                    del self._free[key]

    def _plan(self, records: Sequence[Optional[List[Tuple[Key, int]]]]) -> None:
        """:attr:`_serves` from the records of the last step and the one before it (None or
        empty where there is none)."""
        records = [r for r in records if r]
        self._planned = {own for record in records for own, _ in record}
        serves: Dict[Key, int] = {}
        needs: Dict[Key, int] = {}
        for device in {dev for record in records for (_, dev), _ in record}:
            classes = sorted({cls for record in records for (cls, dev), _ in record if dev == device})
            index = {cls: i for i, cls in enumerate(classes)}
            deltas = [[(index[cls], d) for (cls, dev), d in record if dev == device] for record in records]
            by, count = plan_serving(classes, deltas)
            serves.update(((cls, device), b) for cls, b in by.items())
            needs.update(((cls, device), n) for cls, n in count.items())
        self._serves, self._needs = serves, needs
        for key in serves:  # served by larger buffers from now on: its own are not lent again
            self._free.pop(key, None)

    def clear(self) -> None:
        self._free.clear()
        self._lent.clear()
        self._record, self._last_record, self._planned_from = [], [], []
        self._skipped_first = False
        self._serves.clear()
        self._needs.clear()
        self._planned = set()

    @property
    def nbytes(self) -> int:
        """Bytes held free."""
        return sum(buf.numel() * buf.element_size() for free in self._free.values() for buf, _ in free)
