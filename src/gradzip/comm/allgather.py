"""All-gather of arbitrary payloads, fixed or variable in size, aggregated by the codec."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..codecs.base import Codec, Payload
from .base import (
    Call,
    Collective,
    Exchanged,
    Stages,
    all_gather_bytes,
    all_gather_flat,
    all_gather_ints,
    any_flag,
    payload_column,
    payload_views,
    register_collective,
    sent_as,
    spec_bytes,
    spec_of,
    to_bytes,
    world,
)
from .sra import SEGMENT, whole_segment


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
    tensor lengths. Fixed-size payloads need one all-gather per segment of ``segment`` values
    (as the SRA's: 4 Mi on the CPU, the whole tensor on an accelerator), cut on the codec's
    block boundaries (:meth:`~gradzip.codecs.base.Codec.fusion_block`; a codec without blocks,
    such as one with a scale per tensor, goes whole), issued asynchronously while the next
    segment is encoded; the exchange yields while they are on the wire (a
    pipeline encodes or decodes other groups meanwhile), and their average is decoded straight
    into ``out``. A fixed-size message is encoded into this rank's own row of the gathered
    messages and all-gathered in place (the input a view of the output at this rank's offset,
    as FSDP2 gathers its shards), so no send buffer is held beside the W rows.

    At two ranks this moves the bytes of the SRA's two rounds in one round, with no second
    quantisation: the communicator takes it by default there, and at one rank (see
    :func:`default_collective`).
    """

    name = "allgather"
    releases_input = True  # it calls release_input before it writes ``out``
    reads_input_first = True  # every segment is encoded before the first wait
    carries_parts = True  # a codec without independent blocks is sent whole, in one segment
    options = {"segment": SEGMENT}

    @classmethod
    def traffic_factor(cls, world_size: int) -> float:
        return float(max(int(world_size), 1) - 1)  # its payload to each of the others

    def exchange(self, call: Call) -> Stages:
        w = call.world_size
        if not call.codec.fixed_size:
            return self._exchange_variable(call)
        x = call.flat
        n, block = x.numel(), call.codec.fusion_block()
        if block > 0 and call.parts is None:  # a value's encoding depends on its block alone: segments start on block boundaries
            align = math.lcm(call.align, block)
            seg = whole_segment(self.segment, n, x.device, 1, align)
        else:  # a per-tensor scale, a shape a CompLL body reads, a fused group's parts: the input goes whole
            seg = max(n, 1)
        bounds = [(a, min(a + seg, n)) for a in range(0, n, seg)] or [(0, 0)]
        if len(bounds) == 1:  # the input as it is, in its shape
            parts = [self._send(call, call.x, 0, n, call.name)]
        else:  # per segment: encoded into its message, the all-gather issued (asynchronously), so
            # the next segment is encoded while this one is on the wire
            parts = [self._send(call, x[a:b], a, b, f"{call.name}/{s}") for s, (a, b) in enumerate(bounds)]
        call.input_read()
        if w > 1:
            yield  # the payloads are on the wire
        for part in parts:
            if part["work"] is not None:
                part["work"].wait()
        flags = [any_flag(part["gathered"], part["spec"]) for part in parts]
        nonfinite = flags[0] if len(flags) == 1 else torch.stack(flags).any()  # each covers its segments so far
        call.release_input(nonfinite)  # the input is read no more: the average may overwrite it
        out = call.output()
        into = out is not None and out.dtype == torch.float32  # summed in its place: no tensor of its size made
        poisoned, pieces = True, []
        for part in parts:
            done, poisoned_here = self._average(call, part, nonfinite, out.view(-1)[part["a"] : part["b"]] if into else None)
            pieces.append(done)
            poisoned = poisoned and poisoned_here
        avg = out.view(-1) if into else pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return Exchanged(avg, nonfinite, sum(part["payload"].nbytes for part in parts), poisoned=poisoned)

    def _send(self, call: Call, x: torch.Tensor, a: int, b: int, name: str) -> dict:
        """Encode segment ``x`` (values ``a`` to ``b`` of the input, or the input itself) into
        its message and issue the all-gather of the messages of every rank."""
        w = call.world_size
        parts = call.parts if x is call.x else None  # (a fused group's parts: sent whole)
        fmt = spec = call.codec.payload_spec(x.numel(), x.dtype, parts, call.wire)
        buf = gathered = None
        if fmt is not None:  # encoded straight into the message (only its flag slot written apart):
            # at several ranks this rank's row of the gathered messages, so the all-gather works
            # in place (no send buffer beside the W rows; the row is left as sent)
            gathered = self._lend(call, (w, spec_bytes(fmt)), x.device)
            buf = gathered[call.rank]
            payload = call.encode(x, name, out=payload_views(buf, fmt), parts=parts)
        else:  # encoded first, then copied into this rank's row (a raw tensor, a codec's own form),
            # which stands for it from then on: the encoded tensors are not kept while in flight
            payload = call.encode(x, name, parts=parts)
            spec = spec_of(payload.tensors)
            gathered = self._lend(call, (w, spec_bytes(spec)), x.device)
            buf = gathered[call.rank]
            payload = sent_as(payload, buf, spec)
        call.keep_own(payload, a, b)
        buf = to_bytes(payload.tensors, call.flag, out=buf)
        work = all_gather_flat(gathered.view(-1), buf, self.group, async_op=True) if w > 1 else None
        # where every decoded value comes from the payload's statistics (in the codec's own
        # format; at one rank those are this rank's own payload's, left alone)
        stats = call.codec.stats_tensor if fmt is not None and w > 1 else None
        return {"payload": payload, "spec": spec, "gathered": gathered, "work": work,
                "stats": stats, "a": a, "b": b}

    def _average(self, call: Call, part: dict, nonfinite: torch.Tensor, dest: Optional[torch.Tensor]):
        """A segment's average, summed into ``dest`` where given, and whether it was poisoned.
        Where the values come from the statistics (a max-min scale, a QSGD norm), those of the
        received payloads are divided by W and the payloads summed: no division pass over the
        average, no overflow of a sum of large finite values; and a flagged step is poisoned
        through them (one small fill) instead of a pass over the result."""
        codec, w, spec, stats = call.codec, call.world_size, part["spec"], part["stats"]
        mean = not (stats is not None and codec.averages_by_stats())
        poisoned = stats is not None and call.flagged
        rows = [payload_views(part["gathered"][r], spec) for r in range(w)]
        if stats is not None and (poisoned or not mean):
            # a copy of the statistics alone (a few values a block, in a pool buffer): this rank's
            # row of the gathered messages is its own payload, which error feedback decodes as sent
            sent = payload_column(part["gathered"], spec, stats)
            column = self._lend(call, (w, sent.shape[1] * sent.element_size()), sent.device).view(sent.dtype)
            torch.div(sent, w, out=column) if not mean else column.copy_(sent)
            if poisoned:  # on the device: the flag is not read on the host
                column.masked_fill_(nonfinite, float("nan"))
            for r, tensors in enumerate(rows):
                tensors[stats] = column[r]
        payloads = [Payload(tensors, part["payload"].ctx) for tensors in rows]
        if dest is not None:
            return call.decode(lambda ps, o: codec.aggregate_into(ps, o, mean=mean), payloads, dest), poisoned
        aggregate = codec.aggregate if mean else (lambda ps: codec.aggregate(ps, mean=False))
        return call.decode(aggregate, payloads).reshape(-1), poisoned

    def _exchange_variable(self, call: Call) -> Exchanged:
        """Payloads whose size depends on the data: their lengths first (one host wait: they lay
        out the buffer), then the payloads, each rank's message in its row of the gathered ones
        (padded to the longest), so the all-gather works in place and the row stands for this
        rank's payload from then on (no message or padded copy beside it, and the encoded payload
        freed)."""
        w = call.world_size
        payload = call.encode(call.x, parts=call.parts)
        spec = spec_of(payload.tensors)
        length = spec_bytes(spec)
        table = all_gather_ints([n for _, n in spec] + [length], w, self.group, call.x.device)
        specs = [[(dtype, n) for (dtype, _), n in zip(spec, row[:-1])] for row in table]
        # made for the call, not lent: sizes that move with the data would keep the pool's
        # buffers of every size class they ever reached
        gathered = torch.empty((w, max(row[-1] for row in table)), dtype=torch.uint8, device=call.x.device)
        row = gathered[call.rank]
        mine = sent_as(payload, row, spec)
        ctx, payload = payload.ctx, None  # the row stands for it: the encoded tensors are freed now, not at return
        call.keep_own(mine)
        to_bytes(mine.tensors, call.flag, out=row[:length])
        if w > 1:
            all_gather_flat(gathered.view(-1), row, self.group)
        nonfinite = any_flag(gathered, specs[0], specs)
        payloads = [Payload(payload_views(gathered[r], specs[r]), ctx) for r in range(w)]
        call.release_input(nonfinite)  # the input is read no more: the average may overwrite it
        out = call.output()
        if out is not None and out.dtype == torch.float32 and out.is_contiguous():  # summed in its place
            avg = call.decode(call.codec.aggregate_into, payloads, out.view(-1))
        else:
            avg = call.decode(call.codec.aggregate, payloads).reshape(-1)
        return Exchanged(avg, nonfinite, mine.nbytes)


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
