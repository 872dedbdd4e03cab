"""All-reduce of summable payloads (casts, random-k, PowerSGD's factors)."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ..codecs.base import Codec, Payload
from .base import Call, Collective, Exchanged, Stages, register_collective


@register_collective
class AllReduce(Collective):
    """Sums payload tensors with ``dist.all_reduce``; multi-round codecs get one sum per round.

    The input is divided by the world size before encoding, so sums stay in range (fp16) and
    decoding the sum gives the average directly. The non-finite flag is summed as a one-element
    tensor of its own next to the first round, so the payload is never copied to make room.
    Unflagged (``flagged = False``: gradzip's plain all-reduce of uncompressed gradients, which
    has no memory to spare) a NaN or Inf spreads through the sum exactly as in DDP's own
    all-reduce, the same on every rank.
    """

    name = "allreduce"
    releases_input = True

    def supports(self, codec: Codec) -> bool:
        return codec.summable and super().supports(codec)

    def exchange(self, call: Call) -> Stages:
        x, w, out = call.x, call.world_size, call.out
        if w > 1 and out is not None and not call.need_own and _same_memory(out, x):
            scaled = x.view(-1).div_(w)  # in place: the caller wants x overwritten with the average
        else:
            scaled = x / w if w > 1 else x
        payload = call.encode(scaled)
        flag = call.flag.to(torch.float32).reshape(1)  # read after encoding: it covers the input
        wire = 0
        first = True
        while True:
            tensors: List[torch.Tensor] = [t.reshape(-1) for t in payload.tensors]
            wire += sum(t.numel() * t.element_size() for t in tensors)
            if call.need_own or w == 1:  # all_reduce works in place: keep this rank's payload intact
                tensors = [t.clone() for t in tensors]
            if w > 1:
                extra = [flag] if first and self.flagged else []
                works = [dist.all_reduce(t, group=self.group, async_op=True) for t in tensors + extra]
                yield  # the sums are on the wire
                for work in works:
                    work.wait()
            first = False
            reduced = [r.view(t.shape) for r, t in zip(tensors, payload.tensors)]
            nxt = call.timer.encode(call.codec.next_round, payload, reduced)
            if nxt is None:
                break
            payload = nxt
        call.keep_own(payload, scale=float(w))  # the last round's own payload, before the sum
        call.release_input(flag[0] > 0)
        if out is None:
            avg = call.decode(call.codec.decode, Payload(reduced, payload.ctx)).reshape(-1)
        else:
            avg = call.decode(call.codec.decode_into, Payload(reduced, payload.ctx), out)
        return Exchanged(avg, flag[0] > 0, wire)


def _same_memory(out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``out`` is ``x``'s own contiguous memory (an in-place call)."""
    return (
        out.data_ptr() == x.data_ptr() and out.numel() == x.numel() and out.dtype == x.dtype
        and out.is_contiguous() and x.is_contiguous()
    )
