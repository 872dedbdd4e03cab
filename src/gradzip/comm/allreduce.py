"""All-reduce of summable payloads (casts, random-k, PowerSGD's factors)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..codecs.base import Codec, Payload
from .base import Call, Collective, Exchanged, Stages, nonfinite_flag, overlaps, register_collective, shared_section


@register_collective
class AllReduce(Collective):
    """Sums payload tensors with ``dist.all_reduce``; multi-round codecs get one sum per round.

    The input is divided by the world size before encoding, so sums stay in range (fp16) and
    decoding the sum gives the average directly; where the codec's payload is linear in its
    input (:attr:`~gradzip.codecs.base.Codec.payload_linear`: PowerSGD's factors, random-k's
    values) the copies of the payload that are summed are divided instead, a fraction of the
    input, and the input is encoded as it is. The non-finite flag is summed as a one-element
    tensor of its own next to the first round, so the payload is never copied to make room.
    Unflagged (``flagged = False``: gradzip's plain all-reduce of uncompressed gradients, which
    has no memory to spare) a NaN or Inf spreads through the sum exactly as in DDP's own
    all-reduce, the same on every rank.
    """

    name = "allreduce"
    releases_input = True
    reads_input_first = True  # a one-round codec whose payload is not its input: see exchange
    carries_parts = True

    def supports(self, codec: Codec) -> bool:
        return codec.summable and super().supports(codec)

    def exchange(self, call: Call) -> Stages:
        w = call.world_size
        linear = w > 1 and call.codec.payload_linear
        again = not linear and _owns_again(call)
        payload = call.encode(call.x if linear else _scaled(call), parts=call.parts)
        if (call.late is not None and not _multi_round(call.codec)
                and not any(overlaps(t, call.x) for t in payload.tensors)):
            call.input_read()  # the sums are of the payload alone (a later round reads the input)
        # read after encoding (it covers the input); summed only where there is more than one rank
        flag = call.flag.to(torch.float32).reshape(1) if w > 1 and self.flagged else None
        wire = 0
        first = True
        rounds = 0
        while True:
            tensors: List[torch.Tensor] = [t.reshape(-1) for t in payload.tensors]
            wire += sum(t.numel() * t.element_size() for t in tensors)
            if linear:  # the sums' own copies, divided; this rank's payload stays as encoded
                tensors = [torch.div(t, w) for t in tensors]
            elif (call.need_own and not again) or w == 1:  # all_reduce works in place: keep this rank's payload intact
                tensors = [t.clone() for t in tensors]
            if w > 1:
                extra = [flag] if first and flag is not None else []
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
            rounds += 1
        nonfinite = call.flag if flag is None else flag[0] > 0
        saturate_16_bit_sums(self.flagged, reduced if w > 1 else [])
        if rounds and self.flagged:  # the sums of a later round: see _any_nonfinite
            nonfinite = nonfinite | _any_nonfinite(reduced)
        poisoned = _poison(self.flagged, call.codec, reduced, nonfinite)
        return _finish([call], [payload], [reduced], nonfinite, [wire], poisoned, own_scale=1.0 if linear else w,
                       again=again)[0]

    def exchange_many(self, calls: Sequence[Call]) -> Stages:
        """Several tensors' payloads summed together: per round, one all-reduce of all their
        payload tensors of a dtype, packed into one buffer (PyTorch's PowerSGD hook packs a
        bucket's factors the same way), and one of the non-finite flag for them all."""
        if len(calls) == 1:
            return [(yield from self.exchange(calls[0]))]
        w, codec = calls[0].world_size, calls[0].codec  # one codec for them all (Collective.stages_many)
        # where every NaN/Inf of an input reaches its payload, one pass over the packed payloads
        # flags them all (not one pass over each input)
        from_payloads = self.flagged and codec.payload_keeps_nonfinite
        linear = w > 1 and codec.payload_linear
        xs = [c.x for c in calls] if linear else _scaled_many(calls)
        first_packed, outs = _packed_for(calls)
        payloads = Call.encode_many(calls, xs, flag=not from_payloads, outs=outs, own=True)
        nonfinite = None if from_payloads else torch.stack([call.flag for call in calls]).any()
        flag_work = None
        wire = [0] * len(calls)
        reduced: List[List[torch.Tensor]] = [[] for _ in calls]
        live = list(range(len(calls)))
        later: List[torch.Tensor] = []  # the packed sums of the rounds after the first
        final: List[torch.Tensor] = []  # the packed sums that some call decodes its average from
        rounds = 0
        while live:
            entries = [(i, t) for i in live for t in payloads[i].tensors]
            for i, t in entries:
                wire[i] += t.numel() * t.element_size()
            # one buffer per dtype (a copy: this rank's payloads stay intact for error feedback),
            # or, in the first round, the one they were encoded into where nothing needs them after
            packed = {}
            if first_packed is not None and not rounds:
                packed = first_packed
            else:
                for dtype in dict.fromkeys(t.dtype for _, t in entries):
                    packed[dtype] = torch.cat([t.reshape(-1) for _, t in entries if t.dtype == dtype])
            if nonfinite is None:  # the first round's payloads, as this rank encoded them
                flags = [nonfinite_flag(buf) for buf in packed.values()]
                nonfinite = flags[0] if len(flags) == 1 else torch.stack(flags).any()
                for call in calls:
                    call.found = nonfinite
            if linear:  # the packed copies divided: the sums are of payloads of x / W
                for buf in packed.values():
                    buf.div_(w)
            if flag_work is None and w > 1 and self.flagged:  # summed beside the first round
                flag = nonfinite.to(torch.float32).reshape(1)
                flag_work = dist.all_reduce(flag, group=self.group, async_op=True)
            works = [dist.all_reduce(buf, group=self.group, async_op=True) for buf in packed.values()] if w > 1 else []
            yield  # the sums are on the wire
            for work in works:
                work.wait()
            if rounds:
                later.extend(packed.values())
            offsets = dict.fromkeys(packed, 0)
            for i in live:
                reduced[i] = []
                for t in payloads[i].tensors:
                    at = offsets[t.dtype]
                    reduced[i].append(packed[t.dtype][at : at + t.numel()].view(t.shape))
                    offsets[t.dtype] = at + t.numel()
            going = []
            nexts = shared_section([calls[i].timer for i in live], "encode", codec.next_round_many,
                                   [payloads[i] for i in live], [reduced[i] for i in live])
            for i, nxt in zip(live, nexts):
                if nxt is not None:
                    payloads[i] = nxt
                    going.append(i)
            if len(going) < len(live):
                final.extend(packed.values())
            live = going
            rounds += 1
        if flag_work is not None:
            flag_work.wait()
            nonfinite = flag[0] > 0
        saturate_16_bit_sums(self.flagged, final if w > 1 else [])
        if self.flagged and later:  # one flag per packed buffer: see _any_nonfinite
            nonfinite = nonfinite | _any_nonfinite(later)
        poisoned = _poison(self.flagged, codec, final, nonfinite)
        return _finish(calls, payloads, reduced, nonfinite, wire, poisoned, own_scale=1.0 if linear else w)


def _owns_again(call: Call) -> bool:
    """Whether this rank's own payload need not be kept beside the sum, which overwrites it:
    a one-round codec that encodes the same bytes every time, whose error feedback settles when
    the input is released, where the input is intact (or made again with the same bits:
    :attr:`LateOut.remade`), so the payload is encoded once more from it then, divided as
    :func:`_scaled` divided it (:meth:`Call.keep_own_again`): no copy of the payloads of every
    call in flight. (One call's exchange; a batch keeps its copy: see :func:`_packed_for`.)"""
    codec, late = call.codec, call.late
    return (call.need_own and call.world_size > 1 and call.on_release is not None
            and (late is None or late.remade) and not codec.stochastic
            and type(codec).next_round is Codec.next_round and call.parts is None)


def _packed_for(calls: Sequence[Call]) -> Tuple[Optional[Dict[torch.dtype, torch.Tensor]],
                                                Optional[List[List[torch.Tensor]]]]:
    """For a batch whose payloads are summed once and read no more (one round, no call keeping
    its own payload for error feedback), of a codec that encodes into given tensors
    (:meth:`~gradzip.codecs.base.Codec.payload_spec`: the casts): one buffer per payload dtype,
    and each call's payload tensors as views of it, so the payloads are encoded where they are
    summed (no payload beside its packed copy). (None, None) otherwise. (A batch with error
    feedback keeps the copy: its quotients are made by multi-tensor divisions, which an own
    payload encoded again at settle could not repeat bit for bit in every case, see
    :func:`_owns_again`.)"""
    codec = calls[0].codec
    if type(codec).next_round is not Codec.next_round or any(call.need_own for call in calls):
        return None, None
    specs = [codec.payload_spec(call.x.numel(), call.x.dtype, wire=call.wire) for call in calls]
    if any(spec is None for spec in specs):
        return None, None
    sizes: Dict[torch.dtype, int] = {}
    for spec in specs:
        for dtype, numel in spec:
            sizes[dtype] = sizes.get(dtype, 0) + numel
    device = calls[0].x.device
    packed = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
    at = dict.fromkeys(sizes, 0)
    outs = []
    for spec in specs:
        views = []
        for dtype, numel in spec:
            views.append(packed[dtype][at[dtype] : at[dtype] + numel])
            at[dtype] += numel
        outs.append(views)
    return packed, outs


def _any_nonfinite(sums: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim bool: whether the sums of a round after the first hold NaN or Inf. A later round's
    payload is made from products of the input (PowerSGD's ``Mᵀ P``), which a finite input can
    overflow where its first round, or the input's own flag, showed nothing; the sums are the
    same on every rank, so every rank reads the same flag from them, and a step that
    overflowed is treated as a non-finite one (error feedback keeps its residual). One pass over
    the sums, which are the small factors, packed."""
    flags = [nonfinite_flag(t) for t in sums]
    return flags[0] if len(flags) == 1 else torch.stack(flags).any()


def saturate_16_bit_sums(flagged: bool, sums: Sequence[torch.Tensor]) -> None:
    """Sums of 16-bit payload tensors (values sent as they are: a cast's, random-k's sample,
    PowerSGD's tensors it does not factorise; codes and statistics are never 16-bit floats)
    are shares of an average, saturated each, yet their sum can pass the type's range where the
    average itself does not (fp16: three shares of 65504 / 3 round up past 65504): clamped in
    place (one pass over the 2-byte sums), so such an average comes back as the type's largest
    value, as the all-gather's decode gives it, not as ±inf. (Where only a partial sum of the
    ring overflowed, large shares of both signs, the value is ±max where it was ±inf: wrong
    either way, as in PyTorch's fp16 hook.) Clamped before a later round's sums are read for
    overflow (:func:`_any_nonfinite`: that is for products such as PowerSGD's factors, in
    fp32). The parameter server clamps its sums of partitions the same way. A NaN or ±inf of
    an input is flagged before the sum, and that step is poisoned whatever its sums hold
    (unflagged, as gradzip's plain sum is, an overflow stays ±inf, as in DDP's own all-reduce)."""
    if not flagged:
        return
    for t in sums:
        if t.dtype in (torch.float16, torch.bfloat16):
            top = torch.finfo(t.dtype).max
            t.clamp_(-top, top)


def _poison(flagged: bool, codec: Codec, sums: Sequence[torch.Tensor], nonfinite: torch.Tensor) -> bool:
    """Where every decoded value comes from a payload tensor (``Codec.stats_tensor``: PowerSGD's
    factors, which its products spread over the whole matrix), NaN written into the ``sums``
    the averages are decoded from, where ``nonfinite`` is set, makes them all-NaN: a fill of the
    small factors instead of a pass over each average. Returns whether it did that."""
    if not flagged or codec.stats_tensor is None:
        return False
    for t in sums:
        t.masked_fill_(nonfinite, float("nan"))
    return True


def _scaled(call: Call) -> torch.Tensor:
    """The input divided by the world size before encoding, so sums stay in range and decode to
    the average: in place where the caller wants its input overwritten with the average, else
    into the memory the average will be decoded into where the call has one of its own (no
    buffer the size of the input for the exchange's length), else into a new tensor."""
    x, w = call.x, call.world_size
    if w > 1 and _divided_in_place(call):
        return x.div_(w)  # in its shape, as ``x / w``: a codec that factorises matrices needs it
    if w > 1 and _holds_quotient(call):
        return torch.div(x, w, out=call.out.view(x.shape))
    return x / w if w > 1 else x


def _scaled_many(calls: Sequence[Call]) -> List[torch.Tensor]:
    """:func:`_scaled` of several calls: the inputs divided into new tensors by one multi-tensor
    division (one launch on a GPU). On the CPU the values are those of one division each; on
    CUDA, where ``x / w`` multiplies by ``1 / w``, they may differ from it in the last bit for a
    world size that is not a power of two (every rank divides the same way)."""
    w = calls[0].world_size
    out: List[Optional[torch.Tensor]] = [None] * len(calls)
    fresh, into = [], []  # the calls divided into new tensors, and into their averages' memory
    for i, call in enumerate(calls):
        if w > 1 and _divided_in_place(call):
            out[i] = _scaled(call)
        elif w > 1 and _holds_quotient(call):
            into.append(i)
        elif w > 1:
            fresh.append(i)
        else:
            out[i] = call.x
    if into:  # the same division, one copy and one division in place for them all
        quotients = [calls[i].out.view(calls[i].x.shape) for i in into]
        torch._foreach_copy_(quotients, [calls[i].x for i in into])
        torch._foreach_div_(quotients, float(w))
        for i, q in zip(into, quotients):
            out[i] = q
    if fresh:
        for i, x in zip(fresh, torch._foreach_div([calls[i].x for i in fresh], float(w))):
            out[i] = x
    return out  # type: ignore[return-value]


def _divided_in_place(call: Call) -> bool:
    """Whether the caller wants its input overwritten with the average (``out`` is its memory),
    or lends it for the exchange alone (:class:`~gradzip.comm.base.LateOut`)."""
    if call.need_own:
        return False
    if call.out is None:
        return call.late is not None and call.x.is_contiguous()
    return _same_memory(call.out, call.x)


def _multi_round(codec) -> bool:
    """Whether the codec sums more than one round (PowerSGD: each round reads the input)."""
    return type(codec).next_round is not Codec.next_round


def _holds_quotient(call: Call) -> bool:
    """Whether the input divided by the world size can wait in the memory its average will be
    decoded into: ``out`` of its size and dtype, contiguous, sharing no storage with the input
    (which error feedback reads after the exchange). The codec reads its input only while it
    encodes (PowerSGD: in each round), before any average is decoded (:func:`_finish`, which
    keeps a copy of a payload that is the input itself for this rank's own)."""
    out, x = call.out, call.x
    return (out is not None and out.numel() == x.numel() and out.dtype == x.dtype and out.is_contiguous()
            and not overlaps(out, x))


def _finish(calls: Sequence[Call], payloads: Sequence[Payload], reduced: Sequence[List[torch.Tensor]],
            nonfinite: torch.Tensor, wire: Sequence[int], poisoned: bool = False,
            own_scale: float = 1.0, again: bool = False) -> List[Exchanged]:
    """The end of an exchange of one call or a batch: each call's last-round payload kept as its
    own (before the sum; decoded times ``own_scale`` it is this rank's share; encoded again from
    the input then where ``again``, a single call's: see :func:`_owns_again`), every input
    released before any average is written (an ``out`` may be another call's memory), and the
    sums decoded, into the ``out`` of the calls that have one in one timed section."""
    for call, payload in zip(calls, payloads):
        if again:
            call.keep_own_again(scale=float(own_scale))
            continue
        if call.need_own and call.out is not None and any(overlaps(t, call.out) for t in payload.tensors):
            # a payload that is its input (a tensor sent as it is) holding the quotient in
            # ``out`` (:func:`_holds_quotient`): this rank's own is decoded after the average
            # overwrites it, so it keeps a copy
            payload = Payload([t.clone() for t in payload.tensors], payload.ctx)
        call.keep_own(payload, scale=float(own_scale))
    for call in calls:
        call.release_input(nonfinite)
    codec = calls[0].codec
    sums = [Payload(r, p.ctx) for r, p in zip(reduced, payloads)]
    outs = [call.output() for call in calls]
    into = [i for i, out in enumerate(outs) if out is not None]
    if into:
        shared_section([calls[i].timer for i in into], "decode",
                       lambda: [codec.decode_into(sums[i], outs[i]) for i in into])
    avgs = [out if out is not None else call.decode(codec.decode, s).reshape(-1)
            for call, out, s in zip(calls, outs, sums)]
    return [Exchanged(avg, nonfinite, w, poisoned=poisoned) for avg, w in zip(avgs, wire)]


def _same_memory(out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``out`` is ``x``'s own contiguous memory (an in-place call)."""
    return (
        out.data_ptr() == x.data_ptr() and out.numel() == x.numel() and out.dtype == x.dtype
        and out.is_contiguous() and x.is_contiguous()
    )
