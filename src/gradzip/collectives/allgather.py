"""All-gather of arbitrary payloads, fixed or variable in size, aggregated by the codec."""
from __future__ import annotations

from typing import Optional

import torch

from ..codecs.base import Codec, Payload
from .base import (
    Collective,
    Result,
    Timer,
    all_gather_flat,
    deliver,
    from_bytes,
    nonfinite_flag,
    own_payload,
    register_collective,
    spec_of,
    to_bytes,
    world,
)


@register_collective
class AllGather(Collective):
    """Every rank receives every rank's payload and decodes them all (in rank order).

    Payloads whose size depends on the data (``codec.fixed_size`` false) first exchange their
    tensor lengths; fixed-size payloads need a single all-gather.
    """

    name = "allgather"

    def run(
        self, codec: Codec, x: torch.Tensor, name: str, step: int, need_own: bool, out: Optional[torch.Tensor] = None,
        align: int = 1,
    ) -> Result:
        _, w = world(self.group)
        timer = Timer()
        flag = nonfinite_flag(x)
        payload = timer.encode(codec.encode, x, name, step)
        spec = spec_of(payload.tensors)
        buf = to_bytes(payload.tensors, flag)
        if codec.fixed_size:
            specs = [spec] * w
            gathered = self._all_gather_bytes(buf, w)
        else:
            specs, gathered = self._gather_variable(payload, buf, w)
        payloads, flags = [], []
        for r in range(w):
            tensors, f = from_bytes(gathered[r], specs[r])
            payloads.append(Payload(tensors, payload.ctx))
            flags.append(f)
        avg = deliver(timer.decode(codec.aggregate, payloads).reshape(-1), out)
        own = own_payload(codec, payload, timer) if need_own else None
        return Result(avg, own, torch.stack(flags).any(), payload.nbytes, *timer.times())

    def _gather_variable(self, payload: Payload, buf: torch.Tensor, w: int):
        sizes = torch.tensor([t.numel() for t in payload.tensors] + [buf.numel()], dtype=torch.int64, device=buf.device)
        all_sizes = sizes.new_empty(w, sizes.numel())
        if w > 1:
            all_gather_flat(all_sizes.view(-1), sizes, self.group)
        else:
            all_sizes[0] = sizes
        table = all_sizes.tolist()  # one host sync: the sizes decide the buffer layout
        longest = max(row[-1] for row in table)
        padded = torch.cat([buf, buf.new_zeros(longest - buf.numel())])
        gathered = self._all_gather_bytes(padded, w)
        dtypes = [t.dtype for t in payload.tensors]
        specs = [list(zip(dtypes, row[:-1])) for row in table]
        return specs, gathered
