"""All-gather of arbitrary payloads, fixed or variable in size, aggregated by the codec."""
from __future__ import annotations

import torch

from ..codecs.base import Payload
from .base import (
    Call,
    Collective,
    Exchanged,
    all_gather_bytes,
    all_gather_flat,
    any_flag,
    payload_views,
    register_collective,
    spec_bytes,
    spec_of,
    to_bytes,
    world,
)


def gather_encoded(codec, shard: torch.Tensor, out: torch.Tensor, group, name: str = "", step: int = 0) -> None:
    """A compressed all-gather: every rank's ``shard`` encoded by its owner, gathered, and
    decoded by every rank into ``out`` (``W × shard``, rank-major), its own shard included, so
    every rank holds the same values. ``shard`` may be a view of ``out`` (FSDP2 copies a rank's
    shard into its slot of the output): it is encoded before anything is decoded. For weights:
    ZeRO++'s qwZ (Wang et al., 2023) gathers int8 blocks the same way."""
    _, w = world(group)
    payload = codec.encode(shard.reshape(-1), name, step)
    gathered = all_gather_bytes(to_bytes(payload.tensors, torch.zeros((), dtype=torch.bool, device=shard.device)), w, group)
    spec = spec_of(payload.tensors)
    for r, dst in enumerate(out.view(w, -1)):
        tensors = payload_views(gathered[r], spec)
        codec.decode_into(Payload(tensors, payload.ctx), dst)


@register_collective
class AllGather(Collective):
    """Every rank receives every rank's payload and decodes them all (in rank order).

    Payloads whose size depends on the data (``codec.fixed_size`` false) first exchange their
    tensor lengths; fixed-size payloads need a single all-gather.
    """

    name = "allgather"
    releases_input = True  # it returns a fresh average: the frame releases the input before storing it

    @classmethod
    def traffic_factor(cls, world_size: int) -> float:
        return float(max(int(world_size), 1) - 1)  # its payload to each of the others

    def exchange(self, call: Call) -> Exchanged:
        w = call.world_size
        spec = call.codec.payload_spec(call.x.numel(), call.x.dtype)
        buf = None
        if spec is not None:  # encoded straight into the message (only its flag slot written apart)
            buf = self._lend(call, (spec_bytes(spec),), call.x.device)
            payload = call.encode(call.x, out=payload_views(buf, spec))
        else:
            payload = call.encode(call.x)
        call.keep_own(payload)
        buf = to_bytes(payload.tensors, call.flag, out=buf)
        if call.codec.fixed_size:
            specs = [spec_of(payload.tensors)] * w
            gathered = self._all_gather_bytes(buf, w)
        else:
            specs, gathered = self._gather_variable(payload, buf, w)
        payloads = [Payload(payload_views(gathered[r], specs[r]), payload.ctx) for r in range(w)]
        avg = call.decode(call.codec.aggregate, payloads).reshape(-1)
        return Exchanged(avg, any_flag(gathered, specs[0], specs), payload.nbytes)

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
