"""Buffers lent to one exchange at a time and reused by the next, whatever its group.

A fresh buffer costs a page fault per 4 KiB on every touch, so exchanges keep theirs from step
to step; kept per group, though, every group's buffers would stay resident although only the
groups in flight (a few, see :mod:`gradzip.sync.pipeline`) use them. A pool lends a
free buffer of the request's size class (sizes 2^(k/4): at most 19% more than asked) and takes
it back when the exchange ends, so groups of nearly the same size share buffers and the pool
holds, per class, what the exchanges in flight at once needed; a buffer nobody borrowed in the
present step or the one before (a group that no longer exists) is dropped. Where no buffer of
the request's class is free, a free one up to :data:`FIT_CLASSES` classes above it (about
twice the size) serves it, so exchanges of different sizes that are not in flight together
share one buffer, and the smaller class, no longer lent, is dropped. A class whose borrowing
once made a request of the larger class allocate anew (both were in flight together) borrows
no more: it gets buffers of its own, and the extra large one, no longer lent, is dropped.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

FIT_CLASSES = 4  # a free buffer up to this many classes larger serves a request whose own class has none


def size_class(numel: int) -> int:
    """``numel`` rounded up to the next of the sizes 2^(k/4) (at most 19% more): requests of
    nearly the same size share buffers, and a buffer always serves the same class."""
    if numel <= 16:
        return max(numel, 1)
    k = math.ceil(4 * math.log2(numel))
    while math.ceil(2 ** ((k - 1) / 4)) >= numel:  # the smallest class that holds it
        k -= 1
    return math.ceil(2 ** (k / 4))


class BufferPool:
    """Flat buffers of one dtype, lent as views of the shape asked for."""

    def __init__(self, dtype: torch.dtype = torch.uint8) -> None:
        self.dtype = dtype
        self._free: Dict[Tuple[int, torch.device], List[Tuple[torch.Tensor, int]]] = {}  # per class: (buffer, last lent)
        self._step = 0
        # id of a larger buffer lent -> (the borrower's class and device, the buffer's class)
        self._borrowed: Dict[int, Tuple[Tuple[int, torch.device], int]] = {}
        self._own_only: set = set()  # (class, device) that borrows no more (see the module's docstring)

    def lend(self, shape: Tuple[int, ...], device: torch.device, into: List[torch.Tensor]) -> torch.Tensor:
        """A buffer of ``shape``; the whole buffer is appended to ``into``, the borrower's list of
        what it gives back (:meth:`give_back`) when it ends."""
        need = math.prod(shape)
        device = torch.device(device)
        key = (size_class(need), device)
        free = self._free.get(key)
        if free:
            buf = free.pop()[0]
        else:
            free = [] if key in self._own_only else self._larger_free(need, device)
            if free:
                buf = free.pop()[0]
                self._borrowed[id(buf)] = (key, buf.numel())
            else:
                # a buffer of this class lent to a smaller request made this allocation: that
                # class gets its own from now on
                self._own_only.update(k for k, cls in self._borrowed.values() if k[1] == device and cls == key[0])
                buf = torch.empty(key[0], dtype=self.dtype, device=device)
        into.append(buf)
        return buf[:need].view(shape)

    def _larger_free(self, need: int, device: torch.device) -> List[Tuple[torch.Tensor, int]]:
        """The free list of the smallest class above ``need``'s, up to :data:`FIT_CLASSES` classes
        up, that holds a buffer on ``device`` (empty if none does)."""
        cls = limit = size_class(need)
        for _ in range(FIT_CLASSES):
            limit = size_class(limit + 1)
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
            self._borrowed.pop(id(buf), None)
            self._free.setdefault((buf.numel(), buf.device), []).append((buf, self._step))
        lent.clear()

    def new_step(self, step: int) -> None:
        """Drop the free buffers nobody borrowed in ``step`` or the one before."""
        if step > self._step:
            self._step = step
            for key, free in list(self._free.items()):
                free[:] = [(buf, used) for buf, used in free if used >= step - 1]
                if not free:
                    del self._free[key]

    def clear(self) -> None:
        self._free.clear()
        self._borrowed.clear()
        self._own_only.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held free."""
        return sum(buf.numel() * buf.element_size() for free in self._free.values() for buf, _ in free)
