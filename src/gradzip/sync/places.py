"""Scattered places of a flat bucket, moved with a number of operations that does not grow with
the number of gradients.

A DDP bucket averaged in place (:meth:`gradzip.sync.engine.Communicator.bucket_stages`) leaves
some gradients uncompressed: biases and normalisation weights, a hundred of ResNet-50's 161. They
are gathered out of the bucket, zeroed there, summed in one plain all-reduce and scattered back.
Done tensor by tensor, that is three operations per gradient per step, each a kernel launch on a
GPU, where the bucket's whole codec work is two or three. Here adjacent places are merged into
runs; long runs move as slices (few of them fit in a bucket) and all the short ones through one
index, built once per bucket layout on the bucket's device, so a step costs one gather, one fill
and one scatter for them whatever their count.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

LONG_RUN = 1 << 16  # values: a run this long moves as a slice (an index would cost 8 bytes a value)


class Places:
    """The places ``(start, numel)`` of some gradients in a flat buffer, in ascending order.

    :meth:`gather` packs their values into a flat tensor of :attr:`numel` values (long runs
    first, then the short ones in order); :meth:`scatter_` puts such a tensor back and
    :meth:`fill_` overwrites the places. The packed order is this object's own: what is
    scattered back must have been laid out by :meth:`gather` of the same ``Places``.
    """

    def __init__(self, places: Sequence[Tuple[int, int]], device: torch.device, long_run: int = LONG_RUN) -> None:
        runs: List[List[int]] = []
        for start, n in places:
            if n == 0:
                continue
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += n
            else:
                runs.append([start, n])
        # the long runs as (start in the buffer, length, start in the packed tensor)
        self.long: List[Tuple[int, int, int]] = []
        offset = 0
        for start, n in runs:
            if n >= long_run:
                self.long.append((start, n, offset))
                offset += n
        short = [(start, n) for start, n in runs if n < long_run]
        self.long_numel = offset
        self.numel = self.long_numel + sum(n for _, n in short)
        self.index = None
        if short:
            self.index = torch.cat([torch.arange(start, start + n, dtype=torch.long) for start, n in short]).to(device)

    def gather(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (:attr:`numel` values) = the values of ``flat`` at these places."""
        for start, n, at in self.long:
            out[at : at + n].copy_(flat[start : start + n])
        if self.index is not None:
            torch.index_select(flat, 0, self.index, out=out[self.long_numel :])
        return out

    def fill_(self, flat: torch.Tensor, value: float) -> torch.Tensor:
        """``flat`` with ``value`` at these places."""
        for start, n, _ in self.long:
            flat[start : start + n].fill_(value)
        if self.index is not None:
            flat.index_fill_(0, self.index, value)
        return flat

    def scatter_(self, flat: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``flat`` with the values of ``packed`` (laid out by :meth:`gather`) at these places."""
        for start, n, at in self.long:
            flat[start : start + n].copy_(packed[at : at + n])
        if self.index is not None:
            flat.index_copy_(0, self.index, packed[self.long_numel :])
        return flat
