"""All-gather of arbitrary payloads, fixed or variable in size, aggregated by the codec."""
from __future__ import annotations

import torch

from ..codecs.base import Codec, Payload
from .base import (
    Call,
    Collective,
    Exchanged,
    Stages,
    all_gather_bytes,
    all_gather_flat,
    any_flag,
    payload_column,
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
    tensor lengths; fixed-size payloads need a single all-gather, issued asynchronously (the
    exchange yields while it is on the wire, so a pipeline encodes or decodes other groups
    meanwhile), and their average is decoded straight into ``out``.

    At two ranks this moves the bytes of the SRA's two rounds in one round, with no second
    quantisation: the communicator takes it by default there, and at one rank (see
    :func:`default_collective`).
    """

    name = "allgather"
    releases_input = True  # it calls release_input before it writes ``out``

    @classmethod
    def traffic_factor(cls, world_size: int) -> float:
        return float(max(int(world_size), 1) - 1)  # its payload to each of the others

    def exchange(self, call: Call) -> Stages:
        w = call.world_size
        fmt = spec = call.codec.payload_spec(call.x.numel(), call.x.dtype)
        buf = None
        if spec is not None:  # encoded straight into the message (only its flag slot written apart)
            buf = self._lend(call, (spec_bytes(spec),), call.x.device)
            payload = call.encode(call.x, out=payload_views(buf, spec))
        else:
            payload = call.encode(call.x)
        call.keep_own(payload)
        buf = to_bytes(payload.tensors, call.flag, out=buf)
        if not call.codec.fixed_size:
            specs, gathered = self._gather_variable(payload, buf, w)
            nonfinite = any_flag(gathered, specs[0], specs)
            payloads = [Payload(payload_views(gathered[r], specs[r]), payload.ctx) for r in range(w)]
            avg = call.decode(call.codec.aggregate, payloads).reshape(-1)
            return Exchanged(avg, nonfinite, payload.nbytes)
        spec = spec_of(payload.tensors)
        if w > 1:
            gathered = self._lend(call, (w, buf.numel()), buf.device)
            work = all_gather_flat(gathered.view(-1), buf, self.group, async_op=True)
            yield  # the payloads are on the wire
            work.wait()
        else:  # one rank receives what it sent (its own payload, kept intact for error feedback)
            gathered = buf.view(1, -1)
        nonfinite = any_flag(gathered, spec)
        call.release_input(nonfinite)  # the input is read no more: the average may overwrite it
        # where every decoded value comes from the payload's statistics (a max-min scale, a QSGD
        # norm), those of the received payloads are divided by W and the payloads summed: no
        # division pass over the average, no overflow of a sum of large finite values; and a
        # flagged step is poisoned through them (one small fill) instead of a pass over the result
        # (in the codec's own format only; at one rank the statistics are this rank's own payload's)
        stats = call.codec.stats_tensor if fmt is not None and w > 1 else None
        mean = not (stats is not None and call.codec.stats_scale)
        poisoned = stats is not None and call.flagged
        if stats is not None:
            column = payload_column(gathered, spec, stats)
            if not mean:
                column.div_(w)
            if poisoned:  # on the device: the flag is not read on the host
                column.masked_fill_(nonfinite, float("nan"))
        payloads = [Payload(payload_views(gathered[r], spec), payload.ctx) for r in range(w)]
        out = call.out
        if out is not None and out.dtype == torch.float32:  # summed in its place: no tensor of its size made
            avg = call.decode(lambda ps, o: call.codec.aggregate_into(ps, o, mean=mean), payloads, out.view(-1))
        else:
            aggregate = call.codec.aggregate if mean else (lambda ps: call.codec.aggregate(ps, mean=False))
            avg = call.decode(aggregate, payloads).reshape(-1)
        return Exchanged(avg, nonfinite, payload.nbytes, poisoned=poisoned)

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


def default_collective(codec: Codec, world_size: int) -> str:
    """The collective a communicator uses when none is named: the codec's own, except that a
    codec whose own is the SRA goes through the all-gather at two ranks, where both send one
    payload's bytes a rank but the all-gather does it in one round and without re-encoding
    the average (one latency and one quantisation fewer), and at one rank, where the SRA would
    quantise every value twice and the all-gather is one round trip through the codec. Depends
    on the codec and the world size alone, so every rank picks the same."""
    own = codec.collective
    if own == "sra" and world_size <= 2 and "allgather" in codec.collectives:
        return "allgather"
    return own
