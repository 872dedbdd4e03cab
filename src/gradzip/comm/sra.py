"""CGX's compressed scatter-reduce + all-gather (SRA), pipelined over segments."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..codecs.base import Codec, Payload
from ..options import Option, int_in, optional
from .base import (
    Call,
    Collective,
    Exchanged,
    Stages,
    all_gather_flat,
    any_flag,
    payload_column,
    payload_views,
    overlaps,
    reencoder,
    register_collective,
    sent_as,
    spec_bytes,
    spec_of,
    to_bytes,
    world,
)


# the values per pipelined segment (also the all-gather's)
SEGMENT = Option(
    None, optional(int_in(1)), "a positive integer or None",
    "values per segment (None: 4 Mi on the CPU, the whole tensor on an accelerator)",
)


@register_collective
class ScatterReduceAllGather(Collective):
    """Compressed reduce-scatter then all-gather (Markov et al., CGX, Middleware'22).

    The tensor is cut into one chunk per rank. Each rank encodes every chunk and sends chunk j
    to rank j (all-to-all); rank j decodes the W payloads of its chunk, averages them, encodes
    that average once more and all-gathers it. Each value is thus quantised twice, every rank
    decodes the same bytes (the owner of a chunk included), and traffic per rank is about
    ``2 · wire_bytes`` whatever the world size.

    Large tensors are processed in segments of ``segment`` values (default 4 Mi on the CPU, one
    segment on a GPU), pipelined as in HiPress's CaSync: while segment s is on the wire
    (asynchronous collectives), segment s+1 is encoded and segment s−1 decoded. Every rank
    issues the same collectives in the same order: all the all-to-alls, then all the all-gathers.
    """

    name = "sra"
    releases_input = True
    reads_input_first = True  # every chunk of every segment is encoded before the first wait

    options = {"segment": SEGMENT}

    def supports(self, codec: Codec) -> bool:
        return codec.fixed_size and super().supports(codec)  # chunk payloads must line up

    def fused_length(self, numel: int, align: int, device: torch.device) -> int:
        """A whole number of W chunks of whole blocks: the last chunk of a segment that W does
        not divide is padded by a copy of it (a third of the segment at three ranks), which a
        group's own buffer avoids by ending in zeros. The segments and chunks, and so the bytes,
        are those of the group unpadded (which stays so where the zeros would cut it in two)."""
        w = world(self.group)[1]
        unit = w * align
        padded = -(-numel // unit) * unit
        one = whole_segment(self.segment, numel, device, w, align) >= numel
        return numel if one and whole_segment(self.segment, padded, device, w, align) < padded else padded

    def exchange(self, call: Call) -> Stages:
        x = call.flat
        n, align = x.numel(), call.align
        seg = whole_segment(self.segment, n, x.device, call.world_size, align)
        bounds = [(a, min(a + seg, n)) for a in range(0, n, seg)]
        tag = (lambda s: call.name) if len(bounds) == 1 else (lambda s: f"{call.name}/{s}")

        # phase 1, per segment: encode every chunk, send chunk j to rank j (asynchronously)
        phase1 = [self._scatter(call, x[a:b], a, tag(s)) for s, (a, b) in enumerate(bounds)]
        call.input_read()
        yield  # the all-to-alls are on the wire
        # phase 2, per segment: average my chunk, re-encode it once, all-gather (asynchronously)
        if len(phase1) == 1:
            # every rank's message of this chunk carries its flag over its whole input: the
            # agreed flag is known here, so the input is released now, not after the all-gather
            # (error feedback settles, and an input lent for the exchange goes back)
            got = self._received(call, phase1[0])
            call.release_input(got[1])
            phase2 = [self._reduce(call, phase1[0], tag(0), got)]
        else:  # (a segment's flag covers the segments encoded before it: the last one's is known last)
            last = None
            if call.on_release is not None:
                # error feedback settles once the last segment's messages, flagged over every
                # rank's whole input, are here: the input is released before the chunks are
                # averaged, which then go straight into the result (not into buffers of their
                # own), and this rank's payloads go back before the all-gathers
                last = self._received(call, phase1[-1])
                call.release_input(last[1])
            phase2 = [self._reduce(call, p, tag(s), last if s == len(phase1) - 1 else None)
                      for s, p in enumerate(phase1)]
        if not call.need_own or (call.released and call.on_release is not None):
            # this rank's payloads are read no more (no error feedback, or settled already):
            # their send buffers serve other calls while the all-gathers are on the wire
            for p1 in phase1:
                if p1["recv"] is not p1["send"]:
                    self._give_back_now(call, p1["send"])
        yield  # the all-gathers are on the wire
        flags = [self._gathered_flag(call, p2) for p2 in phase2]
        nonfinite = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        call.release_input(nonfinite)  # read no more (if not released already): the result may overwrite it
        # every rank's decoded chunks land straight in their place in the result
        avg = call.output()
        if avg is None:
            avg = torch.empty(n, dtype=x.dtype, device=x.device)
        wire, first_round = 0, 0
        poisoned = call.flagged
        for (a, b), p1, p2 in zip(bounds, phase1, phase2):
            poisoned = self._gather(call, p1, p2, avg[a:b], nonfinite if call.flagged else None) and poisoned
            first = sum(p.nbytes for p in p1["encoded"])
            first_round += first
            wire += first + p2["second"].nbytes
        return Exchanged(avg, nonfinite, wire, payload_bytes=first_round, poisoned=poisoned)

    def _scatter(self, call: Call, x: torch.Tensor, start: int, name: str) -> dict:
        w = call.world_size
        n = x.numel()
        chunk = chunk_length(n, w, call.align)
        # every chunk has ``chunk`` values: the short tail ones are padded with zeros (copied
        # alone, not the whole segment; a fused group is made as long as its chunks, see
        # fused_length, and only a segment that ends the input may have one: whole_segment)
        chunks = [x[j * chunk : (j + 1) * chunk] for j in range(w)]
        chunks = [c if c.numel() == chunk else torch.cat([c, x.new_zeros(chunk - c.numel())]) for c in chunks]
        spec = call.codec.payload_spec(chunk, x.dtype, wire=call.wire)
        if spec is not None:  # each chunk encoded straight into its row of the send buffer
            send = self._lend(call, (w, spec_bytes(spec)), x.device)
            encoded = [call.encode(chunks[j], f"{name}#{j}", out=payload_views(send[j], spec)) for j in range(w)]
        else:  # each chunk encoded, then copied into its row, which stands for it from then on
            encoded, send = [], None
            for j in range(w):
                payload = call.encode(chunks[j], f"{name}#{j}")
                form = spec_of(payload.tensors)  # (every chunk's alike: a fixed-size codec)
                if send is None:
                    send = self._lend(call, (w, spec_bytes(form)), x.device)
                encoded.append(sent_as(payload, send[j], form))
        for j, payload in enumerate(encoded):
            call.keep_own(payload, start + min(j * chunk, n), start + n)  # a chunk's padding is not own
            to_bytes(payload.tensors, call.flag, out=send[j])  # the flag (and the payload, if not there)
        shape = tuple(send.shape)
        work = None
        if w > 1:
            recv = self._lend(call, shape, x.device)
            work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group, async_op=True)
        else:  # one rank receives what it sent
            recv = send
        return {
            "encoded": encoded, "spec": spec_of(encoded[0].tensors), "send": send, "recv": recv, "work": work,
            "start": start, "numel": n, "chunk": chunk,
            "stats": _stats_of(call.codec, spec),
        }

    @staticmethod
    def _received(call: Call, p1: dict) -> Tuple[List[Payload], torch.Tensor]:
        """Wait for a segment's all-to-all: the W payloads of this rank's chunk (decoded with its
        own chunk's context) and the OR of the non-finite flags their senders put on them."""
        if p1["work"] is not None:
            p1["work"].wait()
        mine = p1["encoded"][call.rank].ctx
        parts = [Payload(payload_views(p1["recv"][r], p1["spec"]), mine) for r in range(call.world_size)]
        return parts, any_flag(p1["recv"], p1["spec"])

    def _reduce(self, call: Call, p1: dict, name: str,
                got: Optional[Tuple[List[Payload], torch.Tensor]] = None) -> dict:
        rank, w = call.rank, call.world_size
        parts, flag = self._received(call, p1) if got is None else got
        dest = self._own_chunk_of_out(call, p1)
        # the received statistics divided by W, then the payloads summed: the average with no
        # pass over it for the division, and no overflow of the sum of large finite values
        mean = not (w > 1 and p1["stats"] is not None and call.codec.averages_by_stats())
        if not mean:
            payload_column(p1["recv"], p1["spec"], p1["stats"]).div_(w)
        spare = None
        if dest is None and parts[0].ctx.dtype == torch.float32 and parts[0].ctx.numel:
            # the result's memory still holds the input (error feedback reads it as the exchange
            # ends), or is lent only for the decode: the chunk's average waits in a buffer of the
            # pool, not a tensor made each step, given back once it is re-encoded (the next
            # segment or group takes it)
            dest = spare = self._lend_values(call, parts[0].ctx.numel, p1["recv"], torch.float32)
        if dest is None:
            reduced = call.decode(lambda ps: call.codec.aggregate(ps, mean=mean), parts).reshape(-1)
        else:  # averaged where this chunk of the result goes: decoding the gathered bytes overwrites it
            reduced = call.decode(lambda ps, out: call.codec.aggregate_into(ps, out, mean=mean), parts, dest)
        # re-encode under the chunk's own name, with a codec whose state it cannot touch; the
        # received flags, not the aggregate's values, say whether some rank's input was not finite
        codec = reencoder(call.codec)
        spec, second = codec.payload_spec(reduced.numel(), reduced.dtype, wire=call.wire), None
        stats = _stats_of(codec, spec)
        if spec is None:  # the payload's form is known once it is encoded
            second = call.encode(reduced, f"{name}#{rank}", codec=codec, flag=False, own=True)
            spec = spec_of(second.tensors)
        shape = (w, spec_bytes(spec))
        # the received chunks are decoded: their buffer takes the gathered ones (same size), unless
        # it is the send buffer (one rank) holding this rank's own payloads, still to be decoded
        recv = p1["recv"]
        own = recv is p1["send"] and call.need_own
        gathered = recv if recv.shape == shape and not own else self._lend(call, shape, reduced.device)
        # what this rank sends: its own row of the gathered buffer (an in-place all-gather)
        buf = gathered[rank]
        if second is None:
            second = call.encode(reduced, f"{name}#{rank}", codec=codec, flag=False, own=True,
                                 out=payload_views(buf, spec))
        else:  # (not kept beside the message while it is on the wire)
            second = sent_as(second, buf, spec)
        to_bytes(second.tensors, flag, out=buf)
        if spare is not None:  # read no more (later work on it is queued after this on a GPU)
            self._give_back_now(call, spare)
        work = None
        if w > 1:
            work = all_gather_flat(gathered.view(-1), buf, self.group, async_op=True)
        return {"second": second, "gathered": gathered, "work": work, "stats": stats}

    @staticmethod
    def _own_chunk_of_out(call: Call, p1: dict):
        """Where this rank's chunk of the segment lands in ``call.out``, if the average of the
        chunk may be summed there now: the chunk is whole (not padded), the result is fp32, and
        writing it cannot change an input still to be read (an ``on_release`` reads the input
        until it has run).
        A result lent late (:class:`~gradzip.comm.base.LateOut`) is not lent for it: the chunk's
        average waits in a buffer of its own size, and the result is lent when it is decoded."""
        if call.out is None and call.late is not None:
            return None
        out, chunk = call.out, p1["chunk"]
        lo = call.rank * chunk
        if out is None or out.dtype != torch.float32 or lo + chunk > p1["numel"]:
            return None
        if call.on_release is not None and not call.released and overlaps(out, call.x):
            return None
        start = p1["start"] + lo
        return out.view(-1)[start : start + chunk]

    def _gathered_flag(self, call: Call, p2: dict) -> torch.Tensor:
        """Wait for a segment's all-gather; the OR of the non-finite flags it carried."""
        if p2["work"] is not None:
            p2["work"].wait()
        return any_flag(p2["gathered"], spec_of(p2["second"].tensors))

    def _gather(self, call: Call, p1: dict, p2: dict, out: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> bool:
        """Decode the all-gathered chunks into ``out`` (this segment of the result). With the
        agreed ``nonfinite`` flag, and a codec whose values all come from statistics
        (``Codec.stats_tensor``), the statistics of every gathered chunk are set to NaN first
        where the flag is set, so the decoded segment comes out all-NaN (the agreed outcome)
        with no pass over it: returns whether it did that."""
        spec2 = spec_of(p2["second"].tensors)
        poisoned = nonfinite is not None and p2["stats"] is not None
        if poisoned:  # one small operation, on the device: the flag is not read on the host
            payload_column(p2["gathered"], spec2, p2["stats"]).masked_fill_(nonfinite, float("nan"))
        for r, dst in enumerate(_chunks(out, call.world_size, call.align)):  # the same bytes, same context
            tensors = payload_views(p2["gathered"][r], spec2)
            call.decode(call.codec.decode_into, Payload(tensors, p1["encoded"][r].ctx), dst)
        return poisoned


def _stats_of(codec: Codec, spec) -> Optional[int]:
    """The payload tensor every decoded value comes from (``Codec.stats_tensor``), where the
    payloads are in the codec's own format (``spec``, its :meth:`~Codec.payload_spec`; None:
    sent raw or of a form known only once encoded)."""
    return codec.stats_tensor if spec is not None else None


CPU_SEGMENT = 1 << 22  # values: segments pipeline the CPU's codec work with the wire


def segment_values(segment, numel: int, device: torch.device) -> int:
    """Values per segment of a tensor of ``numel`` values on ``device``: ``segment`` if given,
    else :data:`CPU_SEGMENT` on the CPU and the whole tensor elsewhere, where a GPU encodes a
    segment in microseconds and every segment costs a fixed number of kernel launches (tens of
    microseconds of host time)."""
    if segment is not None:
        return segment
    return CPU_SEGMENT if device.type == "cpu" else max(numel, 1)


def whole_segment(segment, numel: int, device: torch.device, w: int, align: int) -> int:
    """Values per segment of an ``numel``-value input on ``device`` (:func:`segment_values`) at
    ``w`` ranks: the whole input where a segment holds it, else ``w`` chunks of whole
    ``align``-value blocks (or a multiple of that), so that only the last segment's chunks may be
    short (padded by a copy)."""
    seg, unit = segment_values(segment, numel, device), w * align
    return max(numel, 1) if seg >= numel else max(unit, seg // unit * unit)


def chunk_length(n: int, w: int, align: int = 1) -> int:
    """Values per rank's chunk of an ``n``-value segment: ``ceil(n / w)``, rounded up to ``align``."""
    return -(-(-(-n // w)) // align) * align


def _chunks(segment: torch.Tensor, w: int, align: int = 1) -> List[torch.Tensor]:
    """The W chunk views of a segment, as ``_scatter`` cut it (the last ones may be short or empty)."""
    chunk = chunk_length(segment.numel(), w, align)
    return [segment[r * chunk : (r + 1) * chunk] for r in range(w)]
