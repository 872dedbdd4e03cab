"""Buffers lent to one exchange at a time and reused by the next, whatever its group.

A fresh buffer costs a page fault per 4 KiB on every touch, so exchanges keep theirs from step
to step; kept per group, though, every group's buffers would stay resident although only the
groups in flight (a few, see :mod:`gradzip.sync.pipeline`) use them. A pool lends the smallest
free buffer that is large enough and takes it back when the exchange ends. When none is large
enough, the free ones (all too small) are dropped and a new one is made, so the pool never holds
more than the exchanges in flight at once needed; a buffer nobody borrowed in the present step
or the one before (a group that no longer exists) is dropped too.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch


class BufferPool:
    """Flat buffers of one dtype, lent as views of the shape asked for."""

    def __init__(self, dtype: torch.dtype = torch.uint8) -> None:
        self.dtype = dtype
        self._free: List[Tuple[torch.Tensor, int]] = []  # (buffer, the step it was last lent)
        self._step = 0

    def lend(self, shape: Tuple[int, ...], device: torch.device, into: List[torch.Tensor]) -> torch.Tensor:
        """A buffer of ``shape``; the whole buffer is appended to ``into``, the borrower's list of
        what it gives back (:meth:`give_back`) when it ends."""
        need = math.prod(shape)
        best = None
        for i, (buf, _) in enumerate(self._free):
            if buf.device == device and buf.numel() >= need and (best is None or buf.numel() < self._free[best][0].numel()):
                best = i
        if best is None:
            # free buffers too small for this request would otherwise stay beside the new one:
            # the pool holds at most what the exchanges in flight need at once
            self._free = [(b, used) for b, used in self._free if b.device != device]
            buf = torch.empty(need, dtype=self.dtype, device=device)
        else:
            buf = self._free.pop(best)[0]
        into.append(buf)
        return buf[:need].view(shape)

    def give_back(self, lent: List[torch.Tensor]) -> None:
        """Take back what a borrower was lent (its transfers have completed)."""
        self._free.extend((buf, self._step) for buf in lent)
        lent.clear()

    def new_step(self, step: int) -> None:
        """Drop the free buffers nobody borrowed in ``step`` or the one before."""
        if step > self._step:
            self._step = step
            self._free = [(buf, used) for buf, used in self._free if used >= step - 1]

    def clear(self) -> None:
        self._free.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held free."""
        return sum(buf.numel() * buf.element_size() for buf, _ in self._free)
