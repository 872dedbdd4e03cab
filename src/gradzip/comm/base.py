"""What every collective shares: the frame of a call, the result record, wire (de)serialisation
and the registry.

A collective takes one tensor (the error-compensated gradient of a parameter, or a fused group
of them), encodes it with a codec, moves the payloads with ``torch.distributed`` and returns the
average over ranks, identical to the bit on every rank because every rank decodes the same bytes
the same way. A collective implements only that exchange (:meth:`Collective.exchange`); the
base class frames every call with what they all share (:class:`Call`): the non-finite flag of
the input, the timer, this rank's own decoded payloads for error feedback and the result.

Every message also carries a one-byte "non-finite input" flag, so every rank learns in the same
round whether any rank's input held NaN or Inf, without a host sync. (The all-reduce sums a
one-element flag tensor issued next to the payload, an extra tiny collective in the same round.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..codecs.base import Codec, Payload, element_size, nonfinite_flag
from ..kernels import store_into
from ..kernels.transfer import ints_on
from ..options import Registry
from ..options import Configurable
from .pool import BufferPool
from .stages import Stages, drive, lockstep, staged

_ALIGN = 8

# all_gather_single supersedes all_gather_into_tensor (deprecated) in newer torch releases
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup], async_op: bool = False):
    """All-gather ``inp`` from every rank into the flat ``out`` (rank-major); a work handle if async.

    On gloo with CPU tensors the rows go by point-to-point sends and receives, straight between
    the ranks' buffers (:func:`_gather_by_sends`): gloo's own all-gather gathers into a flat
    temporary the size of ``out`` and then copies it there, a transient of W rows on top of the
    W rows the caller holds."""
    if out.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):  # (gloo, or "cpu:gloo,cuda:nccl")
        work = _gather_by_sends(out, inp, group)
        if async_op:
            return work
        work.wait()
        return None
    return _all_gather_flat(out, inp, group=group, async_op=async_op)


class _Works:
    """Several work handles waited on as one."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True


_sends_made: Dict[Any, int] = {}  # all-gathers by point-to-point messages so far, per group: their tag


def _gather_by_sends(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup]) -> _Works:
    """The all-gather of :func:`all_gather_flat` as W − 1 sends of this rank's row and W − 1
    receives into the others' rows, all issued at once: the bytes a rank sends and receives
    are those of a ring all-gather (W − 1 rows each way), with no temporary. Every rank makes
    the same all-gathers of a group in the same order (as for any collective), so a count of
    them per group tags each one's messages alike on every rank."""
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = out.view(w, -1)
    mine = rows[rank]
    if inp.data_ptr() != mine.data_ptr() or inp.numel() != mine.numel():
        mine.copy_(inp.reshape(-1))
    if not mine.numel():
        return _Works([])
    key = getattr(group or dist.group.WORLD, "group_name", id(group))  # (the same on every rank)
    tag = _sends_made[key] = (_sends_made.get(key, 0) + 1) % (1 << 30)
    works = []
    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    for k in range(1, w):  # (each rank sends to the next first: no peer is everyone's first)
        to, src = (rank + k) % w, (rank - k) % w
        works.append(dist.isend(mine, global_rank(to), group=group, tag=tag))
        works.append(dist.irecv(rows[src], global_rank(src), group=group, tag=tag))
    return _Works(works)


def all_gather_bytes(buf: torch.Tensor, world_size: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather equal-length byte buffers into a ``(world_size, len)`` tensor."""
    out = buf.new_empty(world_size, buf.numel())
    if world_size == 1:
        out[0] = buf
    else:
        all_gather_flat(out.view(-1), buf, group)
    return out


def all_gather_ints(values: Sequence[int], world_size: int, group: Optional[dist.ProcessGroup],
                    device: torch.device) -> List[List[int]]:
    """Every rank's ``values`` (as many on each), rank by rank: the lengths of payloads whose
    size depends on the data, which lay out the buffers that carry them (one all-gather of int64
    values and one host wait)."""
    mine = ints_on(values, device)
    if world_size == 1 or not mine.numel():
        return [mine.tolist() for _ in range(world_size)]
    table = mine.new_empty(world_size, mine.numel())
    all_gather_flat(table.view(-1), mine, group)
    return table.tolist()


@dataclass
class Result:
    """Outcome of one collective call on one tensor."""

    avg: torch.Tensor  # the average over ranks, flat, identical on every rank
    own: Optional[torch.Tensor]  # this rank's decoded payload at input scale (for error feedback)
    nonfinite: torch.Tensor  # 0-dim bool: some rank's input held NaN/Inf
    wire_bytes: int  # payload bytes this rank put on the wire
    encode_s: float = 0.0  # wall time
    decode_s: float = 0.0
    encode_cpu_s: float = 0.0  # CPU time of the calling thread (see Timer)
    decode_cpu_s: float = 0.0
    # one encoding of the tensor as this collective cuts it (its first round); None: ``wire_bytes``.
    # sra and ps also put this rank's re-encoded share on the wire, which ``wire_bytes`` counts.
    payload_bytes: Optional[int] = None
    poisoned: bool = False  # avg is all-NaN already where nonfinite is set (no pass over it needed)


_measure_cpu = False


def measure_cpu_time(enabled: bool) -> None:
    """Make :class:`Timer` also take thread CPU time (off by default).

    Reading a thread's CPU clock is a system call, and on some machines (sandboxed or
    virtualised kernels) a slow one: a few per tensor can cost as much as encoding it. Only the
    benchmarks turn it on, for runs that they do not time.
    """
    global _measure_cpu
    _measure_cpu = enabled


class Timer:
    """Accumulates wall time (and, when :func:`measure_cpu_time` is on, thread CPU time) of
    encode and decode sections.

    Wall time is what the caller waits; thread CPU time (``time.thread_time``) is the work the
    codec did, which stays meaningful when ranks share cores and wall time includes waiting for
    one. It counts only the calling thread: exact when the codec computes on that one thread (local
    ranks run torch with one thread), short of the truth when a thread team helps, and for CUDA
    tensors only the host side of the kernels.
    """

    def __init__(self) -> None:
        self.encode_s = 0.0
        self.decode_s = 0.0
        self.encode_cpu_s = 0.0
        self.decode_cpu_s = 0.0
        self._cpu = _measure_cpu

    def section(self, fn: Callable, args, kwargs) -> Tuple[Any, float, float]:
        """``fn(*args, **kwargs)``, its wall seconds and its thread CPU seconds (0.0 unless
        measured), counted nowhere: :meth:`encode` and :meth:`decode` add them to their sums, and
        a section timed for several calls at once is shared out with :meth:`add_encode`."""
        t0, c0 = time.perf_counter(), time.thread_time() if self._cpu else 0.0
        out = fn(*args, **kwargs)
        cpu = time.thread_time() - c0 if self._cpu else 0.0
        return out, time.perf_counter() - t0, cpu

    def encode(self, fn: Callable, *args, **kwargs):
        out, wall, cpu = self.section(fn, args, kwargs)
        self.encode_s += wall
        self.encode_cpu_s += cpu
        return out

    def add_encode(self, wall: float, cpu: float) -> None:
        """Count a share of a section timed for several calls at once as this call's encoding."""
        self.encode_s += wall
        self.encode_cpu_s += cpu

    def decode(self, fn: Callable, *args, **kwargs):
        out, wall, cpu = self.section(fn, args, kwargs)
        self.decode_s += wall
        self.decode_cpu_s += cpu
        return out

    def add_decode(self, wall: float, cpu: float) -> None:
        """:meth:`add_encode` for decoding."""
        self.decode_s += wall
        self.decode_cpu_s += cpu

    def times(self) -> Tuple[float, float, float, float]:
        """``(encode_s, decode_s, encode_cpu_s, decode_cpu_s)``, the tail of a :class:`Result`."""
        return self.encode_s, self.decode_s, self.encode_cpu_s, self.decode_cpu_s


def shared_section(timers: Sequence["Timer"], kind: str, fn: Callable, *args) -> Any:
    """``fn(*args)``, work done for several calls at once, timed once and its time shared out
    evenly among their ``timers`` as encoding or decoding (``kind``)."""
    out, wall, cpu = Timer().section(fn, args, {})
    for timer in timers:
        (timer.add_encode if kind == "encode" else timer.add_decode)(wall / len(timers), cpu / len(timers))
    return out


def world(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share storage (then writing one may change the other)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ------------------------------------------------------------------------- wire format
Spec = List[Tuple[torch.dtype, int]]


def spec_of(tensors: Sequence[torch.Tensor]) -> Spec:
    return [(t.dtype, t.numel()) for t in tensors]


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def spec_bytes(spec: Spec) -> int:
    """Length of the serialised buffer for ``spec`` plus the flag byte."""
    return sum(_padded(n * element_size(d)) for d, n in spec) + _ALIGN


def to_bytes(tensors: Sequence[torch.Tensor], flag: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Serialise payload tensors and the non-finite flag into one aligned uint8 buffer (``out`` if
    given: then nothing is allocated, each part is copied to its place, unless it lies there
    already (encoded into :func:`payload_views` of ``out``), and the gaps zeroed; the flag is
    repeated over its 8-byte slot, read at the slot's first byte)."""
    spec = spec_of(tensors)
    if out is None:
        out = torch.empty(spec_bytes(spec), dtype=torch.uint8, device=flag.device)
    offset = 0
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        dst = out[offset : offset + raw.numel()]
        if raw.data_ptr() != dst.data_ptr():
            dst.copy_(raw)
        end = offset + _padded(raw.numel())
        if end > offset + raw.numel():
            out[offset + raw.numel() : end].zero_()
        offset = end
    out[offset : offset + _ALIGN].copy_(flag.reshape(1).expand(_ALIGN))  # the flag, repeated over its slot
    return out


def payload_views(buf: torch.Tensor, spec: Spec) -> List[torch.Tensor]:
    """The payload tensors of a :func:`to_bytes` buffer, as views of it (no work on the device)."""
    out, offset = [], 0
    for dtype, numel in spec:
        nbytes = numel * element_size(dtype)
        out.append(buf[offset : offset + nbytes].view(dtype))
        offset += _padded(nbytes)
    return out


def sent_as(payload: Payload, buf: torch.Tensor, spec: Spec) -> Payload:
    """``payload`` copied into its place in the :func:`to_bytes` buffer ``buf`` (laid out by
    ``spec``, its own), as views of ``buf``: the message stands for the payload from then on,
    so the encoded tensors need not be kept while it is in flight."""
    views = payload_views(buf, spec)
    for dst, t in zip(views, payload.tensors):  # byte for byte, as to_bytes copies
        dst.view(torch.uint8).copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return Payload(views, payload.ctx)


def payload_column(rows: torch.Tensor, spec: Spec, k: int) -> torch.Tensor:
    """Payload tensor ``k`` of every row of ``rows`` (a ``(W, L)`` uint8 tensor of
    :func:`to_bytes` buffers laid out by ``spec``) as one ``(W, numel)`` view: one operation
    reaches it in all W rows."""
    offset = sum(_padded(n * element_size(d)) for d, n in spec[:k])
    dtype, numel = spec[k]
    return rows[:, offset : offset + numel * element_size(dtype)].view(dtype)


def from_bytes(buf: torch.Tensor, spec: Spec) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Inverse of :func:`to_bytes`: the payload tensors (views of ``buf``) and the flag."""
    return payload_views(buf, spec), buf[spec_bytes(spec) - _ALIGN] != 0


def any_flag(rows: torch.Tensor, spec: Spec, per_row: Optional[Sequence[Spec]] = None) -> torch.Tensor:
    """0-dim bool: the OR of the non-finite flags of ``rows``, a ``(W, L)`` uint8 tensor of
    :func:`to_bytes` buffers (one per rank) laid out by ``spec``, in one operation; with
    ``per_row``, row ``r`` laid out by ``per_row[r]`` (payloads whose size depends on the data,
    each row padded to the longest), in three whatever ``W``."""
    if per_row is None or all(s == spec for s in per_row):
        return rows[:, spec_bytes(spec) - _ALIGN].view(torch.bool).any()
    at = ints_on([spec_bytes(s) - _ALIGN for s in per_row], rows.device).view(-1, 1)
    return rows.gather(1, at).view(torch.bool).any()


# ------------------------------------------------------------------------- one call
@dataclass
class Exchanged:
    """What a collective's exchange hands back: the average and what came with it."""

    avg: torch.Tensor  # the average over ranks, flat (``Call.out`` where the exchange wrote there)
    nonfinite: torch.Tensor  # 0-dim bool: the OR of every rank's non-finite flag
    wire_bytes: int  # payload bytes this rank put on the wire
    payload_bytes: Optional[int] = None  # see Result.payload_bytes
    poisoned: bool = False  # see Result.poisoned


@dataclass
class LateOut:
    """A result buffer lent only when the average is first written, and an input buffer given
    back as soon as the exchange has read it for the last time: between the two, the call holds
    its payloads alone, and the buffer serves other calls (see :attr:`Collective.reads_input_first`).

    ``input_read()`` gives the input's buffer back; ``lend()`` is the buffer the average goes
    to: the input's own while it has not been given back (an exchange that never said it was
    done with its input writes over it, as with ``out=x``). ``remade``: the caller's
    ``on_release`` does not read this input but makes it again from what it was made of (error
    feedback's compensated gradients, which are intact until the average is written), so it
    goes back once encoded even where the call keeps its own payloads or settles on release."""

    lend: Callable[[], torch.Tensor]
    input_read: Callable[[], None]
    remade: bool = False


@dataclass
class Call:
    """One call of a collective as its exchange sees it.

    :meth:`Collective.stages` builds it around every call and does the steps every collective
    shares: the input's non-finite flag, the timer of encode and decode, decoding this rank's own
    payloads for error feedback, writing the average to ``out`` and the :class:`Result`. The
    exchange encodes through :meth:`encode` (timed, with the call's step), decodes through
    :meth:`decode`, and names the payloads that are this rank's own with :meth:`keep_own`.
    """

    codec: Codec
    x: torch.Tensor  # the input, in the caller's shape (PowerSGD reads it as a matrix)
    name: str
    step: int
    need_own: bool  # the caller wants this rank's decoded payloads (keep them intact)
    out: Optional[torch.Tensor]
    align: int
    rank: int
    world_size: int
    found: Optional[torch.Tensor]  # 0-dim bool: NaN/Inf in what encode saw so far; None: nothing yet
    timer: Timer
    flagged: bool = True  # False: the flag stays False (a plain sum spreads NaN by itself)
    own: List[Tuple[Optional[Payload], int, Optional[int], float]] = field(default_factory=list)  # see keep_own
    # called once, with the OR of every rank's non-finite flag, when the exchange has read the
    # input for the last time and is about to write the average (see release_input)
    on_release: Optional[Callable[["Call", torch.Tensor], None]] = None
    released: bool = False
    lent: List[torch.Tensor] = field(default_factory=list)  # pool buffers in use (Collective._lend)
    # set by an exchange in which this rank's share of the average is not its own payloads
    # decoded (a hierarchical one: see gradzip.comm.hierarchy): writes what this rank's input
    # lost, in the input's units, into a zeroed flat buffer as long as the input
    loss_into: Optional[Callable[[torch.Tensor], None]] = None
    # the input is a fused buffer of these tensors, ``(name, shape)`` each (see
    # :attr:`Codec.parts_format`): only a collective that ``carries_parts`` gets it
    parts: Optional[Tuple[Tuple[str, torch.Size], ...]] = None
    # the gradient's dtype where the input is a wider compensation of it: the dtype values the
    # codec sends as they are go in (:attr:`Meta.wire <gradzip.codecs.base.Meta.wire>`)
    wire: Optional[torch.dtype] = None
    # where ``out`` is None: the caller's result buffer, lent when first asked for (:meth:`output`)
    late: Optional[LateOut] = None

    @property
    def flat(self) -> torch.Tensor:
        return self.x.reshape(-1)

    @property
    def flag(self) -> torch.Tensor:
        """0-dim bool: this rank's input encoded so far holds NaN/Inf (see :meth:`encode`)."""
        if self.found is None:
            self.found = torch.zeros((), dtype=torch.bool, device=self.x.device)
        return self.found

    def encode(self, x: torch.Tensor, name: Optional[str] = None, codec: Optional[Codec] = None,
               flag: bool = True, out: Optional[Sequence[torch.Tensor]] = None,
               parts: Optional[Sequence[Tuple[str, torch.Size]]] = None, own: Optional[bool] = None) -> Payload:
        """``codec`` (default the call's) encodes ``x`` as tensor ``name`` (default the call's) at
        the call's step, timed as encoding; :attr:`flag` then covers ``x`` too, read from the
        payload's statistics where the codec can (:meth:`Codec.nonfinite`), else from ``x``.
        An exchange puts the flag on the wire after encoding what the message carries.
        ``flag=False``: ``x`` is not this rank's input (an aggregate of received payloads, whose
        own flags the exchange carries on), so it is not looked at. ``out``: where the payload's
        tensors go (see :meth:`Codec.payload_spec`), views of a send buffer for instance.
        ``parts``: ``x`` is the whole input, a fused buffer of these tensors (:attr:`parts`).
        ``own``: whether the values take :attr:`wire` (default: ``flag``): this rank's input (an
        input encoded again, or one whose flag the payload carries, is still its own), or an
        average a second round sends in its stead (the scatter-reduce's, the parameter
        server's), which is decoded under the first round's context: the gradient's width in
        every round, so both rounds have one form."""
        codec = codec or self.codec
        payload = self.timer.encode(codec.encode, x, self.name if name is None else name, self.step, out, parts,
                                    self.wire if (flag if own is None else own) else None)
        if flag:
            self._cover(codec, payload, x)
        return payload

    def _cover(self, codec: Codec, payload: Payload, x: torch.Tensor) -> None:
        """:attr:`flag` extended over ``x``, encoded as ``payload`` (see :meth:`encode`)."""
        if self.flagged:
            found = codec.nonfinite(payload)
            found = nonfinite_flag(x) if found is None else found
            self.found = found if self.found is None else self.found | found

    @staticmethod
    def encode_many(calls: Sequence["Call"], xs: Sequence[torch.Tensor], flag: bool = True,
                    outs: Optional[Sequence[Sequence[torch.Tensor]]] = None, own: Optional[bool] = None) -> List[Payload]:
        """:meth:`encode` of several calls of one codec, each of its ``x`` (into its ``outs``
        where given), timed as one section (its time shared out among the calls: two clock reads
        for a batch, not two a tensor)."""
        codec = calls[0].codec
        where = outs if outs is not None else [None] * len(calls)

        def encode_all() -> List[Payload]:
            mine = flag if own is None else own
            return [codec.encode(x, call.name, call.step, out, parts=call.parts, wire=call.wire if mine else None)
                    for call, x, out in zip(calls, xs, where)]

        payloads = shared_section([c.timer for c in calls], "encode", encode_all)
        if flag:
            for call, payload, x in zip(calls, payloads, xs):
                call._cover(codec, payload, x)
        return payloads

    def decode(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` timed as decoding (``codec.decode_into``, ``codec.aggregate``, a sum)."""
        return self.timer.decode(fn, *args)

    def release_input(self, nonfinite: torch.Tensor) -> None:
        """The exchange reads the input no more and is about to write ``out``, which may be the
        input itself (an in-place exchange of a DDP bucket): the caller's ``on_release`` runs
        now, while the input and this rank's own payloads are intact, with the agreed flag.
        An exchange that writes ``out`` calls it first; the frame calls it for one that does not."""
        if not self.released:
            self.released = True
            if self.on_release is not None:
                self.on_release(self, nonfinite)
            self.input_read()

    def input_read(self) -> None:
        """The exchange has read the input for the last time (its encode is issued) and reads
        :meth:`output` only from now on: a caller that lent the input for the exchange
        (:class:`LateOut`) takes it back, unless the input is still to be read when it is
        released (this rank's own payloads decoded from it, an ``on_release``): then
        :meth:`release_input` gives it back."""
        if self.late is not None and (self.released or (self.late.remade and not self._own_in_input())
                                      or (not self.need_own and self.on_release is None)):
            self.late.input_read()

    def _own_in_input(self) -> bool:
        """Whether a payload kept as this rank's own lies in the input (a tensor sent as it is):
        then the input is read when the residual settles, even where the caller makes it again."""
        return any(overlaps(t, self.x) for payload, *_ in self.own if payload is not None for t in payload.tensors)

    def output(self) -> Optional[torch.Tensor]:
        """``out``: where the average goes (None: a fresh tensor), lent now if the caller lends it late."""
        if self.out is None and self.late is not None:
            self.out, self.late = self.late.lend(), None
        return self.out

    def decode_own_into(self, out: torch.Tensor, x: Optional[torch.Tensor] = None) -> int:
        """Decode this rank's own payloads (:meth:`keep_own`) into their places in the flat
        ``out`` (as long as the input), each times its scale; the number of values written.
        Where the exchange set :attr:`loss_into`, the input less what it lost. ``x``: the input
        made again (:attr:`LateOut.remade`), which a payload kept by :meth:`keep_own_again` is
        encoded from anew."""
        if self.loss_into is not None:
            out.zero_()
            self.loss_into(out)
            torch.sub(self.flat, out, out=out)
            return out.numel()
        n, covered = out.numel(), 0
        for payload, start, end, scale in self.own:
            if payload is None:  # (keep_own_again) the input divided by W, encoded once more
                dst = out[start : n if end is None else end]
                src = (self.flat if x is None else x.reshape(-1))[start : start + dst.numel()]
                payload = self.encode(torch.div(src, self.world_size, out=dst), flag=False, own=True)
            else:
                dst = out[start : min(start + payload.ctx.numel, n if end is None else end)]
            self.decode(self.codec.decode_into, payload, dst)
            if scale != 1.0:
                dst.mul_(scale)
            covered += dst.numel()
        return covered

    def residual_into(self, residual: torch.Tensor, x: Optional[torch.Tensor] = None) -> None:
        """``residual`` (flat, as long as the input) = the input − this rank's share of the
        average as the exchange counted it: what error feedback carries to the next step.
        ``x``: the input made again, where the call's own went back once read (:attr:`LateOut.remade`)."""
        if self.loss_into is not None:
            residual.zero_()
            self.loss_into(residual)
            return
        self.decode_own_into(residual, x)
        torch.sub(self.flat if x is None else x.reshape(-1), residual, out=residual)

    def keep_own(self, payload: Payload, start: int = 0, end: Optional[int] = None, scale: float = 1.0) -> None:
        """``payload`` is this rank's encoding of the input's values ``start`` to ``end`` (a chunk,
        a partition, the whole; ``end`` defaults to as many values as the payload holds, a padded
        chunk's padding cut at the end of the input); decoded times ``scale`` it is this rank's
        share of the average."""
        if self.need_own:
            self.own.append((payload, start, end, scale))

    def keep_own_again(self, scale: float) -> None:
        """This rank's own payload is the whole input divided by W (``x / W``, one division) and
        encoded, and is encoded again from the input when it is decoded (its tensors summed in
        place meanwhile, with no copy kept): for a codec whose encoding is the same bytes every
        time (not :attr:`Codec.stochastic`), on an input intact, or made again with the same bits
        (:attr:`LateOut.remade`), when it is read; decoded times ``scale`` it is this rank's share."""
        if self.need_own:
            self.own.append((None, 0, None, scale))


class Collective(Configurable):
    """Moves one tensor's payloads between ranks; a subclass implements only :meth:`exchange`."""

    kind = "collective"
    name: str = ""
    # whether every call computes its input's non-finite flag for the exchange to carry; off for
    # gradzip's plain all-reduce of uncompressed gradients (see AllReduce)
    flagged = True

    def __init__(self, group: Optional[dist.ProcessGroup] = None, **opts: Any) -> None:
        self.group = group
        self.set_options(opts)  # ValueError for an unknown option or a bad value
        # byte buffers of the calls in flight (see _lend), reused from call to call: fresh ones
        # would cost a page fault per 4 KiB on every call
        self._pool = BufferPool()

    def supports(self, codec: Codec) -> bool:
        return self.name in codec.collectives

    @classmethod
    def traffic_factor(cls, world_size: int) -> float:
        """``f(W)``: the bytes a rank sends per byte of its (compressed) gradient; a reduce-scatter
        and an all-gather by default."""
        w = max(int(world_size), 1)
        return 2.0 * (w - 1) / w

    def input_buffer(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device, step: int, align: int = 1,
    ) -> Optional[torch.Tensor]:
        """Memory for the input of the next call on tensor ``name`` that this collective would
        copy it into anyway (shared with other ranks, registered with a transport), or None;
        valid for that one call. The caller may instead write the input wherever it likes."""
        return None

    def fused_length(self, numel: int, align: int, device: torch.device) -> int:
        """The length a fused group of ``numel`` values (a whole number of ``align`` blocks) on
        ``device`` is given, zeros after its last gradient, so that this collective takes it
        with no copy of its own: ``numel`` unless the collective cuts it into pieces it would
        pad (the SRA's chunks)."""
        return numel

    def sent_per_byte(self, world_size: int) -> float:
        """The bytes this instance sends per byte of one encoding of the tensor (its
        :meth:`traffic_factor`; a composed exchange answers for its parts)."""
        return self.traffic_factor(world_size)

    def state_dict(self) -> Dict[str, Any]:
        """What must survive a restart for the next call to move the same bytes (e.g. PS's call count)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def release(self) -> None:
        """Drop buffers kept from call to call, and the process group (the communicator is
        closing: see :meth:`Communicator.close <gradzip.sync.engine.Communicator.close>`)."""
        self._pool.clear()
        self.group = None

    def _lend(self, call: "Call", shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A byte buffer of ``shape`` for ``call`` alone (send, receive, gathered payloads), from
        the collective's pool; it goes back when the call ends."""
        return self._pool.lend(shape, device, call.lent)

    def _give_back_now(self, call: "Call", lent: torch.Tensor) -> None:
        """Give back before the call ends a buffer that :meth:`_lend` lent it (``lent``, the view
        it returned): its transfers have completed and nothing reads it any more."""
        for i, buf in enumerate(call.lent):
            if buf.data_ptr() == lent.data_ptr() and buf.device == lent.device:
                self._pool.give_back([call.lent.pop(i)])
                return

    def _lend_values(self, call: "Call", numel: int, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``numel`` values of ``dtype`` (default ``like``'s) on ``like``'s device, lent for the
        call (bytes of the collective's pool, see :meth:`_lend`)."""
        dtype = like.dtype if dtype is None else dtype
        return self._lend(call, (numel * dtype.itemsize,), like.device).view(dtype)

    def _evict(self, step: int) -> None:
        """The pool's step: buffers no call has used in this step or the one before (a tensor no
        longer exchanged, a DDP bucket that its rebuild replaced) are dropped."""
        self._pool.new_step(step)

    def run(
        self, codec: Codec, x: torch.Tensor, name: str, step: int, need_own: bool, out: Optional[torch.Tensor] = None,
        align: int = 1,
    ) -> Result:
        """Average ``x`` (any shape; the result is flat) over the ranks of ``self.group``.

        With ``out`` (flat, ``x.numel()`` values, ``x``'s dtype) the average is written there and
        ``Result.avg`` is ``out``: no fresh result tensor, whose first touch of every page costs
        more than decoding into it. ``out`` may be ``x`` itself: every collective has finished
        reading ``x`` before it writes ``out``.

        ``align``: a collective that cuts ``x`` into pieces encoded apart (chunks, segments,
        partitions) starts every piece at a multiple of ``align`` values, so a codec's blocks
        never straddle two tensors of a fused buffer (see :meth:`Codec.fusion_block`).
        ``Result.own`` is the caller's to keep.
        """
        res = drive(self.stages(codec, x, name, step, need_own, out, align))
        return res if res.own is None else replace(res, own=res.own.clone())

    # whether exchange() calls Call.release_input before it writes ``out`` (needed to exchange
    # in place with error feedback; the frame calls it for exchanges that return a fresh average)
    releases_input = False

    # whether exchange() calls Call.input_read once it has read its input for the last time
    # (where it can tell: the all-reduce, after a one-round codec's encode into a payload of its
    # own), may overwrite an input lent that way, and takes ``out`` only through Call.output (a
    # caller may then lend its input buffer for the encode alone and its result buffer for the
    # decode alone: see LateOut); a subclass that overrides exchange() says it anew
    reads_input_first = False

    # whether this rank's share of the average (Result.own, decoded after the exchange) is
    # computed from the input (a hierarchical exchange's: the input less what it lost), so the
    # caller keeps the input intact until then, even for a memory that makes its input again
    # (Memory.remakes_input)
    own_reads_input = False

    # whether exchange() hands a fused input's parts to the codec (Call.parts): a collective
    # that encodes the whole input in one piece; one that cuts it into chunks does not
    carries_parts = False

    def stages(
        self, codec: Codec, x: torch.Tensor, name: str, step: int, need_own: bool, out: Optional[torch.Tensor] = None,
        align: int = 1, on_release: Optional[Callable[[Call, torch.Tensor], None]] = None,
        parts: Optional[Tuple[Tuple[str, torch.Size], ...]] = None, late: Optional[LateOut] = None,
        wire: Optional[torch.dtype] = None,
    ) -> Stages:
        """:meth:`run` cut into stages: a generator that yields each time it has issued
        asynchronous collectives and would next wait for them, and returns the :class:`Result`.

        A pipeline (:class:`~gradzip.sync.pipeline.Pipeline`) advances the stages of several calls in
        turn, so one call's payloads are on the wire while another is encoded or decoded. The
        stages are those of :meth:`exchange`, framed by the steps every collective shares.
        ``parts``: ``x`` is a fused buffer of these tensors, for a codec whose format is per
        tensor (:attr:`Codec.parts_format`; only where :attr:`carries_parts`). ``late``: in place
        of ``out``, a result buffer lent when the average is written and the input's buffer
        given back once read (:class:`LateOut`; only where :attr:`reads_input_first`).
        ``wire``: the gradient's dtype where ``x`` is a wider compensation of it (:attr:`Call.wire`).
        ``Result.own`` lies in a buffer of the collective's pool: read it as the stages return,
        before the next exchange of this collective borrows the buffer.
        """
        if parts is not None and not self.carries_parts:
            raise ValueError(f"collective {self.name!r} encodes its input in pieces: it cannot carry parts")
        if late is not None and (out is not None or not self.reads_input_first):
            raise ValueError(f"collective {self.name!r} cannot lend its result late here")
        (call,) = self._calls(codec, [x], [name], step, need_own, [out], align, on_release)
        call.parts, call.late, call.wire = parts, late, wire
        try:
            got = yield from staged(self.exchange(call))
            return self._result(call, got)
        finally:
            self._pool.give_back(call.lent)  # every transfer of the call has completed (or failed)

    def stages_many(
        self, codec: Codec, xs: Sequence[torch.Tensor], names: Sequence[str], step: int, need_own: bool,
        outs: Sequence[Optional[torch.Tensor]],
        on_release: Optional[Sequence[Callable[[Call, torch.Tensor], None]]] = None,
        wires: Optional[Sequence[Optional[torch.dtype]]] = None,
    ) -> Stages:
        """:meth:`stages` of several tensors at once: one :class:`Result` each. A collective
        whose :meth:`exchange_many` batches them (the all-reduce: one sum per round for all)
        saves a collective per tensor; the others exchange them side by side. ``on_release``,
        ``wires``: each call's (see :meth:`stages`)."""
        calls = self._calls(codec, xs, names, step, need_own, outs, 1, None)
        for call, release in zip(calls, on_release or ()):
            call.on_release = release
        for call, wire in zip(calls, wires or ()):
            call.wire = wire
        try:
            gots = yield from self.exchange_many(calls)
            return self._results(calls, gots)
        finally:
            for call in calls:
                self._pool.give_back(call.lent)

    def exchange_many(self, calls: Sequence[Call]) -> Stages:
        """:meth:`exchange` of several calls: a list of :class:`Exchanged`. By default the calls'
        own exchanges, advanced in lockstep; a collective that can move them together overrides it."""
        return (yield from lockstep([staged(self.exchange(call)) for call in calls]))

    def _calls(
        self, codec: Codec, xs: Sequence[torch.Tensor], names: Sequence[str], step: int, need_own: bool,
        outs: Sequence[Optional[torch.Tensor]], align: int, on_release: Optional[Callable[[Call, torch.Tensor], None]],
    ) -> List[Call]:
        rank, w = world(self.group)
        self._evict(step)
        return [
            Call(codec, x, name, step, need_own, out, align, rank, w, None, Timer(), self.flagged, on_release=on_release)
            for x, name, out in zip(xs, names, outs)
        ]

    def _result(self, call: Call, got: Exchanged, own: Optional[torch.Tensor] = None) -> Result:
        """What every call ends with: the input released, the average in ``out``, this rank's own
        payloads decoded (unless an ``on_release`` took them already, or the caller gives them:
        ``own``)."""
        call.release_input(got.nonfinite)
        out = call.output()
        avg = got.avg if out is None else store_into(got.avg, out, accumulate=False)
        if own is None and call.need_own and call.on_release is None:
            own = self._decode_own(call)
        return Result(avg, own, got.nonfinite, got.wire_bytes, *call.timer.times(), payload_bytes=got.payload_bytes,
                      poisoned=got.poisoned)

    def _results(self, calls: Sequence[Call], gots: Sequence[Exchanged]) -> List[Result]:
        """:meth:`_result` of a batch of calls of one codec. Where each call kept one whole
        payload at one scale (the all-reduce's), their own payloads are decoded in one timed
        section and scaled by one multi-tensor multiplication (one launch, not one a tensor)."""
        mine = [call for call in calls if call.need_own and call.on_release is None]
        whole = len(mine) > 1 and all(
            call.loss_into is None and len(call.own) == 1 and call.own[0][1] == 0 and call.own[0][2] is None
            and call.own[0][0].ctx.numel == call.x.numel() and call.own[0][3] == mine[0].own[0][3] for call in mine
        )
        if not whole:
            return [self._result(call, got) for call, got in zip(calls, gots)]
        owns = {id(call): self._lend_values(call, call.x.numel(), call.x) for call in mine}
        bufs = [owns[id(call)] for call in mine]
        codec = calls[0].codec
        shared_section([call.timer for call in mine], "decode",
                       lambda: [codec.decode_into(call.own[0][0], buf) for call, buf in zip(mine, bufs)])
        scale = mine[0].own[0][3]
        if scale != 1.0:
            torch._foreach_mul_(bufs, scale)
        return [self._result(call, got, owns.get(id(call))) for call, got in zip(calls, gots)]

    def exchange(self, call: Call) -> Union[Stages, Exchanged]:
        """Encode ``call.x``, move the payloads and decode the average: a generator of stages
        (yield after issuing asynchronous collectives, before waiting for them) returning
        :class:`Exchanged`, or a plain function returning it.

        Every rank must issue the same collectives in the same order, carry ``call.flag`` in what
        it sends (the wire format of :func:`to_bytes` has a byte for it) and decode the same
        bytes the same way, so the average is identical on every rank.
        """
        raise NotImplementedError(f"collective {self.name!r} does not implement exchange()")

    def _decode_own(self, call: Call) -> torch.Tensor:
        """This rank's payloads decoded at the input's scale, in a buffer of the pool lent to
        the call: it goes back when the call ends, and the caller reads it as the stages return
        (its memory's update), before any other exchange can borrow it; on a GPU a later
        borrower's work is queued behind that read on the same stream. (Kept per tensor from
        step to step, these buffers held a whole gradient's worth.)"""
        n = call.x.numel()
        own = self._lend_values(call, n, call.x)
        covered = call.decode_own_into(own)
        if covered != n:
            raise RuntimeError(f"collective {self.name!r} kept own payloads for {covered} of {n} values")
        return own

    def _all_gather_bytes(self, buf: torch.Tensor, world_size: int) -> torch.Tensor:
        """:func:`all_gather_bytes` over this collective's group."""
        return all_gather_bytes(buf, world_size, self.group)


_COLLECTIVES: Registry[Collective] = Registry("collective", "collectives")
register_collective = _COLLECTIVES.add
names = _COLLECTIVES.names
get = _COLLECTIVES.get


def traffic_factor(collective: str, world_size: int) -> float:
    """:meth:`Collective.traffic_factor` of the collective named ``collective``."""
    return get(collective).traffic_factor(world_size)


def route_label(collective: str, options: Optional[Mapping[str, Any]] = None) -> str:
    """A route's name: the collective, then its options (``ps:partitions=8``)."""
    return collective + "".join(f":{k}={v}" for k, v in sorted((options or {}).items()))


def parse_route(label: str) -> Tuple[str, Dict[str, Any]]:
    """Inverse of :func:`route_label` (option values are integers, None, or else words such as ``bf16``)."""
    name, *pairs = label.split(":")
    options: Dict[str, Any] = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        options[key] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else _word(value)
    return name, options


def _word(value: str) -> str:
    """A route option's word value (``bf16``); a number that is not an integer is no route's."""
    try:
        float(value)
    except ValueError:
        return value
    raise ValueError(f"route option values are integers, None or words, got {value!r}")


def reencoder(codec: Codec) -> Codec:
    """The codec that re-encodes an aggregate: ``codec`` itself when its encode is a pure function,
    a fresh instance when it keeps per-tensor state (``tensor_state``: signum's momentum, adaq's
    residual), so the aggregate neither reads nor overwrites this rank's state."""
    if not codec.tensor_state:
        return codec
    return type(codec)(**codec.config())
