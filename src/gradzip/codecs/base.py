"""The codec protocol: what every compression method provides.

A codec turns a gradient into a :class:`Payload` — the tensors that go on the wire plus a local
context that never leaves the rank — and back. A codec also declares which collectives can carry
its payloads (``collectives``; the first is the default), whether payloads can simply be summed
(``summable``: then a plain all-reduce is enough), and how many bytes a payload takes before any
encoding happens (``wire_bytes``), so buffers and plans can be made ahead of time.

Decoding another rank's payload uses *this* rank's context: a context may only hold facts that
are the same on every rank (shape, dtype, name, step, shared random indices, shared factors).
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from ..kernels import store_into
from ..kernels.fused import saturate  # noqa: F401  (re-exported: the codecs' saturating cast)
from ..options import Configurable, Option, float_in, int_in, one_of  # noqa: F401  (re-exported)
from ..kernels.rng import keyed_generator, private_key


@dataclass
class Meta:
    """Local context of one encoded tensor; identical on every rank for the same tensor/step."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    name: str = ""
    step: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)
    # a fused input: the tensors it holds, ``(name, shape)`` each, each starting on a multiple
    # of the codec's :meth:`Codec.fused_alignment` and followed by zeros up to the next (see
    # :attr:`Codec.parts_format` and :func:`part_spans`); None: one tensor, ``name`` of ``shape``
    parts: Optional[Tuple[Tuple[str, torch.Size], ...]] = None
    # the dtype the values a codec sends as they are go in (top-k's selected values, a dense
    # form): the gradient's own where the input is a wider compensation of it (error feedback
    # in fp32 for a 16-bit gradient); None: the input's
    wire: Optional[torch.dtype] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def as_is(self) -> torch.dtype:
        """The dtype of the values a codec sends as they are: :attr:`wire` where given, else the input's."""
        return self.wire or self.dtype


@dataclass
class Payload:
    """An encoded tensor: ``tensors`` go on the wire, ``ctx`` stays on this rank."""

    tensors: List[torch.Tensor]
    ctx: Meta

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


SEED = Option(0, int_in(0), "a non-negative integer", "seed of the codec's random streams")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def raw_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of ``numel`` values of ``dtype`` as they are: no codec puts more on the wire."""
    return numel * dtype.itemsize


def _narrower(wire: Optional[torch.dtype], dtype: torch.dtype) -> Optional[torch.dtype]:
    """``wire`` where it is a floating-point dtype narrower than ``dtype`` (:attr:`Meta.wire`), else None."""
    return wire if wire is not None and wire.is_floating_point and wire.itemsize < dtype.itemsize else None


def as_wire(t: torch.Tensor, wire: Optional[torch.dtype]) -> torch.Tensor:
    """``t`` in the wire dtype (:attr:`Meta.wire`) where given: a saturating cast, so a finite
    value stays finite and NaN/±inf stay as they are (the flag reads them); error feedback keeps
    what the cast lost, as it keeps what a selection left."""
    return t if wire is None or t.dtype == wire else saturate(t, wire)


def nonfinite_poison(x: torch.Tensor) -> torch.Tensor:
    """0-dim, on ``x``'s device (of its dtype for floating ``x``): 0 where every value of ``x``
    is finite, NaN where some value is NaN or ±inf (no host sync); adding it to a result
    poisons that result.

    A min/max pass: unlike a sum, it cannot overflow on large finite values, and NaN propagates
    through it. Then ``v * 0`` is 0 for a finite ``v`` and NaN for ±inf and NaN: three scalar
    operations (a kernel launch each on a GPU) where ``torch.isfinite`` of both takes eight.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    lo, hi = torch.aminmax(x.reshape(-1))
    return lo * 0 + hi * 0


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor: does ``x`` hold NaN or Inf (no host sync).

    One reading pass, the minimum and maximum together: NaN propagates through them and ±Inf
    is one of them, while, unlike a sum, they cannot overflow on large finite values.
    """
    return nonfinite_poison(x) != 0


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``x``'s device: no NaN or ±inf in ``x`` (no host sync; see :func:`nonfinite_poison`)."""
    return nonfinite_poison(x) == 0


def _check_payload_out(out: Sequence[torch.Tensor], spec: Optional[List[Tuple[torch.dtype, int]]],
                       device: torch.device) -> None:
    """``encode(out=)`` takes tensors the kernels may write through blindly: exactly the form
    :meth:`Codec.payload_spec` gives, contiguous, on the input's device."""
    form = [(t.dtype, t.numel()) for t in out]
    if spec is None or form != spec or not all(t.is_contiguous() and t.device == device for t in out):
        raise ValueError(
            f"encode(out=...) needs contiguous tensors on {device} of the form {spec} "
            f"(Codec.payload_spec; None: this input cannot be encoded into given tensors), got {form}"
        )


def _parts_of(parts: Optional[Sequence[Tuple[str, Sequence[int]]]], numel: int, align: int = 1,
              ) -> Optional[Tuple[Tuple[str, torch.Size], ...]]:
    """``encode``'s ``parts`` as :attr:`Meta.parts`, checked to cover the ``numel`` values,
    each part padded to a multiple of ``align`` (a group's parts repeat every step: checked once)."""
    if parts is None:
        return None
    try:
        return _checked_parts(tuple(parts), numel, align)
    except TypeError:  # unhashable (shapes given as lists)
        return _checked_parts.__wrapped__(tuple((n, tuple(s)) for n, s in parts), numel, align)


@functools.lru_cache(maxsize=4096)
def _checked_parts(parts: Tuple[Tuple[str, Sequence[int]], ...], numel: int, align: int,
                   ) -> Tuple[Tuple[str, torch.Size], ...]:
    out = tuple((str(name), torch.Size(shape)) for name, shape in parts)
    covered = sum(n + (-n % align) for n in (shape.numel() for _, shape in out))
    if covered != numel:
        raise ValueError(f"parts cover {covered} values (each padded to a multiple of {align}), "
                         f"the tensor has {numel}")
    return out


PART_ALIGN = 256  # where each member of a group encoded by its statistics' blocks starts (see PartUnits)


class PartUnits:
    """A fused group cut into units that share statistics (each member whole, or each member's
    buckets of ``size`` values, a multiple of :data:`PART_ALIGN`), in blocks of
    :data:`PART_ALIGN` values, each of one unit: the unit of each block (``of_block``), each
    unit's number of blocks (``lengths``), of values (``reals``; ``numels`` at least 1, so an
    empty unit's mean is 0) and of padding zeros in its blocks (``pads``), these in fp64, on the
    group's device; made once per layout."""

    def __init__(self, parts: Tuple[Tuple[str, torch.Size], ...], size: int, device: torch.device) -> None:
        blocks, numels, reals, pads = [], [], [], []
        for _, n in part_spans(parts, PART_ALIGN):
            unit = size if 0 < size < n else max(n, 1)
            for a in range(0, max(n, 1), unit):
                real = min(unit, n - a) if n else 0
                blocks.append(-(-max(real, 1) // PART_ALIGN) if n else 0)
                numels.append(float(max(real, 1)))
                reals.append(float(real))
                pads.append(blocks[-1] * PART_ALIGN - real)
        lengths = torch.tensor(blocks, dtype=torch.long)
        self.lengths = lengths.to(device)
        # (made on the host, whose lengths say its size, and copied: no read back from a device)
        self.of_block = torch.repeat_interleave(torch.arange(len(blocks), dtype=torch.int32), lengths).to(device)
        self.numels = torch.tensor(numels, dtype=torch.float64, device=device)
        self.reals = torch.tensor(reals, dtype=torch.float64, device=device)
        self.pads = torch.tensor(pads, dtype=torch.float64, device=device)
        self._parts, self._device = parts, device

    def real(self) -> torch.Tensor:
        """``(blocks, PART_ALIGN)`` bool: where the group holds a member's values, not padding
        (a unit's buckets are whole blocks, so only a member's last block holds padding)."""
        columns = torch.arange(PART_ALIGN, dtype=torch.int32, device=self._device)
        return columns < part_fill(self._parts, self._device).unsqueeze(1)

    def sums(self, per_block: torch.Tensor) -> torch.Tensor:
        """Each unit's sum of ``per_block`` (one value a block): one segmented reduction
        (``unsafe``: the lengths, made here, are not checked again, a check that would read
        two values on the host)."""
        return torch.segment_reduce(per_block, "sum", lengths=self.lengths, unsafe=True)

    def maxima(self, per_block: torch.Tensor) -> torch.Tensor:
        """Each unit's maximum of ``per_block`` (magnitudes: an empty unit's is 0; a NaN stays)."""
        return torch.segment_reduce(per_block, "max", lengths=self.lengths, unsafe=True, initial=0.0)


_LAYOUT_RELEASES: List[Callable[[], None]] = []


def layout_cache(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` made once per fused layout (its arguments; tensors on the group's device) and kept
    while the layouts repeat, step after step (a group each: well under the 4,096 kept), until
    :func:`release_layouts`."""
    cached = functools.lru_cache(maxsize=4096)(fn)
    _LAYOUT_RELEASES.append(cached.cache_clear)
    return cached


_LAYOUT_USERS = [0]  # communicators running, which make and read the plans
_LAYOUT_LOCK = threading.Lock()


def hold_layouts() -> None:
    """A communicator starts: the plans stay until every one that started has closed."""
    with _LAYOUT_LOCK:
        _LAYOUT_USERS[0] += 1


def release_layouts() -> None:
    """A communicator closes; the last one to close lets every layout's plan go, and the
    device memory it holds (a later one makes its own again)."""
    with _LAYOUT_LOCK:
        _LAYOUT_USERS[0] = max(0, _LAYOUT_USERS[0] - 1)
        if _LAYOUT_USERS[0] == 0:
            for release in _LAYOUT_RELEASES:
                release()


@layout_cache
def part_fill(parts: Tuple[Tuple[str, torch.Size], ...], device: torch.device) -> torch.Tensor:
    """Each block of :data:`PART_ALIGN` values of a fused group whose members start on blocks:
    how many of its member's values it holds (int32; the rest of a member's last block is padding)."""
    fill: List[int] = []
    for _, n in part_spans(parts, PART_ALIGN):
        fill += [PART_ALIGN] * (n // PART_ALIGN) + ([n % PART_ALIGN] if n % PART_ALIGN else [])
    return torch.tensor(fill, dtype=torch.int32, device=device)


@layout_cache
def part_units(parts: Tuple[Tuple[str, torch.Size], ...], size: int, device: torch.device) -> PartUnits:
    return PartUnits(parts, size, device)


def stats_nonfinite(payload: Payload, stats: int) -> Optional[torch.Tensor]:
    """0-dim bool: some value of the payload's statistics (tensor ``stats``: per-bucket
    min/scale, norms, scales) is not finite; None for a payload of another form (an empty
    input's, a tiny tensor's sent as it is). For a codec whose statistics are NaN or infinite
    exactly where its input held NaN or Inf (:meth:`Codec.nonfinite`)."""
    if len(payload.tensors) <= stats:
        return None
    # v * 0 is 0 for finite v, NaN for NaN and ±inf: three operations (isfinite alone is four)
    return payload.tensors[stats].mul(0).sum() != 0


@functools.lru_cache(maxsize=4096)
def part_spans(parts: Tuple[Tuple[str, torch.Size], ...], align: int) -> Tuple[Tuple[int, int], ...]:
    """``(start, numel)`` of each of :attr:`Meta.parts` in the fused input: each starts on a
    multiple of ``align`` (the codec's :meth:`Codec.fused_alignment`), as the engine lays them out."""
    spans, at = [], 0
    for _, shape in parts:
        n = shape.numel()
        spans.append((at, n))
        at += n + (-n % align)
    return tuple(spans)


def empty_result(meta: "Meta") -> torch.Tensor:
    """The decode of a tensor without elements."""
    return torch.empty(meta.shape, dtype=meta.dtype, device=meta.device)


class Codec(Configurable):
    """Base class of every gradient codec. Subclasses implement ``_encode``/``_decode``."""

    kind: ClassVar[str] = "codec"
    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    collectives: ClassVar[Tuple[str, ...]] = ("allgather",)
    default_memory: ClassVar[str] = "none"
    summable: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True  # payload size depends only on (numel, dtype, shape)
    # an aggregator (``ps``) may decode, average and re-encode it without systematically losing
    # what the ranks sent: False for sparsifiers (the union of W selections would be cut back to
    # one selection) and for threshold quantizers (an average lies inside the threshold)
    reencodable: ClassVar[bool] = True
    # fixed-size codecs: when the format of a (numel, dtype) would take more bytes than the raw
    # tensor, send the tensor raw instead (a choice every rank makes alike, so payloads keep one
    # size); False where the codec has a dense format of its own. Codecs whose size depends on
    # the data must keep within the raw size by themselves.
    raw_fallback: ClassVar[bool] = True
    # per-tensor state kept across steps (PowerSGD's Q, Signum's momentum, ...): the key under
    # which state_dict() saves it; the codec holds it in the dict attribute ``_<key>``
    tensor_state: ClassVar[str] = ""
    # every NaN or ±inf of the input reaches the (first) payload as NaN or ±inf (a cast, a
    # product with the input): a collective may flag many tensors by one pass over their payloads
    payload_keeps_nonfinite: ClassVar[bool] = False
    # the index of a payload tensor that every decoded value is computed from (per-bucket
    # statistics, PowerSGD's factor; in a payload sent raw, the values themselves): NaN written
    # there decodes to NaN everywhere, so a collective poisons an average by filling those few
    # values rather than the whole result (a pass over it on an accelerator); None: no such tensor
    stats_tensor: ClassVar[Optional[int]] = None
    # decoded values scale with :attr:`stats_tensor`: its values divided by W decode to the
    # values divided by W (to rounding), so a collective averages W payloads by dividing their
    # statistics (a few values) and summing, with no division pass over the sum and no overflow
    # of a sum of large finite values on the way
    stats_scale: ClassVar[bool] = False
    # its payload of ``x / W`` is its payload of ``x`` divided by W, tensor by tensor and round
    # by round, to rounding (values selected from the input, products with it): the all-reduce
    # then divides the copies of the payloads it sums, a fraction of the input's size, where it
    # would divide the input into a quotient as large (a pass and a buffer), and this rank's own
    # payload decodes to its share without a multiplication
    payload_linear: ClassVar[bool] = False
    # every kernel version (C, Triton, torch) produces the same bytes; when False, ranks must
    # also agree on which kernels run (compared at registration)
    kernels_bit_exact: ClassVar[bool] = True
    # its format is per tensor (a factorisation by the tensor's shape), but one call encodes a
    # fused buffer of several given their names and shapes (``encode``'s ``parts``): one
    # payload and one exchange for a group, each tensor encoded by its shape inside it (see
    # :meth:`fused_alignment`); collectives that carry parts pass them (``Collective.carries_parts``)
    parts_format: ClassVar[bool] = False
    # a part given as 1-D goes as it is, its values summed with the factors (PowerSGD): a group
    # may then carry gradients that are not to be compressed (a DDP bucket averaged where it
    # lies), with no exchange of their own
    flat_parts_as_they_are: ClassVar[bool] = False
    # it needs each tensor's shape (PowerSGD factorises matrices): a flat share of a node's sum
    # is sent as it is, so its compressed exchange stays flat across nodes
    needs_shapes: ClassVar[bool] = False
    # the communicator's settings record ``fusion`` when on too (False: only when off, for a
    # codec fused later, whose older checkpoints hold no ``fusion``)
    records_fusion: ClassVar[bool] = True
    options: ClassVar[Dict[str, Option]] = {}

    def __init__(self, **opts: Any) -> None:
        self.set_options(opts)
        self._calls: Dict[str, int] = {}
        self._draws: Dict[str, Tuple[int, int]] = {}  # name -> (step, private draws made at that step)
        self._encoding: Optional[Meta] = None  # the tensor being encoded: it keys private draws

    # ----------------------------------------------------------------- public API
    @property
    def collective(self) -> str:
        """The collective used when none is asked for."""
        return self.collectives[0]

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({opts})"

    def payload_spec(self, numel: int, dtype: torch.dtype,
                     parts: Optional[Sequence[Tuple[str, Sequence[int]]]] = None,
                     wire: Optional[torch.dtype] = None) -> Optional[List[Tuple[torch.dtype, int]]]:
        """``(dtype, numel)`` of each tensor of the payload of ``numel`` values of ``dtype`` (a
        fused buffer of ``parts``, and ``wire``, as :meth:`encode` takes them, where given), for
        codecs that can encode straight into given tensors (:meth:`encode`'s ``out``: a
        collective's send buffer, so the payload is not copied there); None otherwise (then the
        payload's form is known only once encoded)."""
        as_is = _narrower(wire, dtype) or dtype
        if numel == 0 or self._raw(numel, as_is):
            return None
        if parts is not None and self.parts_format:
            return self._parts_payload_spec(numel, as_is, _parts_of(parts, numel, self.fused_alignment()))
        return self._payload_spec(numel, dtype)

    def encode(self, t: torch.Tensor, name: str = "", step: Optional[int] = None,
               out: Optional[Sequence[torch.Tensor]] = None,
               parts: Optional[Sequence[Tuple[str, Sequence[int]]]] = None,
               wire: Optional[torch.dtype] = None) -> Payload:
        """Encode ``t``; ``step`` keys shared randomness (defaults to a per-name call counter).
        ``out``: flat tensors as :meth:`payload_spec` gives them (only where it is not None),
        which become the payload's tensors. ``parts``: ``t`` is a fused buffer holding these
        tensors back to back, ``(name, shape)`` each (their sizes add up to ``t``'s); a codec
        whose format is per tensor (:attr:`parts_format`) encodes each by its shape. ``wire``:
        a floating-point dtype narrower than ``t``'s (the gradient's, ``t`` its fp32
        compensation), which values sent as they are take (:attr:`Meta.wire`)."""
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"codec {self.name!r} encodes floating-point tensors, got {t.dtype}")
        if step is None:
            step = self._calls.get(name, 0)
            self._calls[name] = step + 1
        meta = Meta(t.shape, t.dtype, t.device, name, step, parts=_parts_of(parts, t.numel(), self.fused_alignment()),
                    wire=_narrower(wire, t.dtype))
        self._encoding = meta
        if t.numel() == 0:
            return Payload([], meta)
        if self._raw(t.numel(), meta.as_is):  # (in the wire dtype where given: see as_wire)
            return Payload([as_wire(t.reshape(-1), meta.wire)], meta)
        if out is not None:
            _check_payload_out(out, self.payload_spec(t.numel(), t.dtype, parts, meta.wire), t.device)
            return Payload(self._encode_into(t.reshape(-1), meta, list(out)), meta)
        return Payload(self._encode(t.reshape(-1), meta), meta)

    def decode(self, payload: Payload) -> torch.Tensor:
        """Decode a payload (this rank's or another rank's) to a tensor of the original shape/dtype.

        Finite values come back finite: decoded values beyond the range of a 16-bit dtype are
        clamped to its largest finite value (see :func:`saturate`).
        """
        meta = payload.ctx
        if meta.numel == 0:
            return empty_result(meta)
        if self._raw(meta.numel, meta.as_is):
            return payload.tensors[0].reshape(meta.shape).to(meta.dtype)
        return saturate(self._decode(payload.tensors, meta).reshape(meta.shape), meta.dtype)

    def decode_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
        """Decode the first ``out.numel()`` values of a payload into the flat ``out`` (or add them).

        Collectives decode chunks straight into their result and sum ranks in place with this,
        which saves a fresh allocation and a pass over memory per payload; codecs with fused
        kernels override :meth:`_decode_into`. The values are exactly those of :meth:`decode`.
        """
        if out.numel() > payload.ctx.numel:
            raise ValueError(f"out has {out.numel()} values, the payload only {payload.ctx.numel}")
        if out.numel() == 0:
            return out
        meta = payload.ctx
        if self._raw(meta.numel, meta.as_is):
            return store_into(payload.tensors[0][: out.numel()], out, accumulate)
        if out.dtype.is_floating_point and torch.finfo(out.dtype).max < torch.finfo(torch.float32).max:
            # a 16-bit destination: decode in fp32, then saturate as decode() does
            tmp = self._decode_into(payload.tensors, meta, torch.empty(out.numel(), dtype=torch.float32, device=out.device), False)
            if accumulate:
                tmp = tmp.add_(out.reshape(-1))
            return store_into(saturate(tmp, out.dtype), out, False)
        return self._decode_into(payload.tensors, meta, out, accumulate)

    def aggregate(self, payloads: Sequence[Payload], mean: bool = True) -> torch.Tensor:
        """Combine every rank's payload (in rank order) into the averaged gradient; with
        ``mean`` False their sum (the caller scaled them already: :attr:`stats_scale`)."""
        meta = payloads[0].ctx
        if meta.numel == 0:
            return empty_result(meta)
        total = torch.empty(meta.numel, dtype=torch.float32, device=meta.device)
        for i, p in enumerate(payloads):
            self.decode_into(p, total, accumulate=i > 0)
        if mean and len(payloads) > 1:  # (one rank's: the sum is the mean, no pass for it)
            total.div_(len(payloads))
        return saturate(total.reshape(meta.shape), meta.dtype)

    def averages_by_stats(self) -> bool:
        """Whether a collective may average this codec's payloads by dividing their statistics by
        W and summing (:attr:`stats_scale`): only where the average is the base sum of decoded
        payloads, not a codec's own :meth:`aggregate` (which knows nothing of the division)."""
        return self.stats_scale and self.stats_tensor is not None and type(self).aggregate is Codec.aggregate

    def aggregate_into(self, payloads: Sequence[Payload], out: torch.Tensor, mean: bool = True) -> torch.Tensor:
        """:meth:`aggregate` written into the flat fp32 ``out`` (as many values as the payloads
        hold): the mean (or with ``mean`` False the sum) is summed there in place, no tensor of
        its size made; a codec with an aggregate of its own (a vote, a union of indices) has it
        copied in."""
        if type(self).aggregate is not Codec.aggregate:
            return out.copy_(self.aggregate(payloads).reshape(-1))
        if payloads[0].ctx.dtype != torch.float32:
            return out.copy_(self.aggregate(payloads, mean=mean).reshape(-1))
        for i, p in enumerate(payloads):
            self.decode_into(p, out, accumulate=i > 0)
        return out.div_(len(payloads)) if mean and len(payloads) > 1 else out

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """0-dim bool: whether the encoded input held NaN or Inf, read from the payload's own
        statistics (a min/max, a norm) in place of a pass over the input; None where the format
        cannot tell (then the collective reads the input once more)."""
        return None

    def next_round(self, payload: Payload, reduced: List[torch.Tensor]) -> Optional[Payload]:
        """For multi-round summable codecs: after an all-reduce round, the next payload or None."""
        return None

    def next_round_many(
        self, payloads: Sequence[Payload], reduced: Sequence[List[torch.Tensor]],
    ) -> List[Optional[Payload]]:
        """:meth:`next_round` for several tensors summed in the same round; a codec overrides it
        to treat them as one batch (PowerSGD orthonormalises all its factors at once)."""
        return [self.next_round(p, r) for p, r in zip(payloads, reduced)]

    def fused_alignment(self) -> int:
        """Where each tensor of a fused buffer starts: on a multiple of this many values
        (:meth:`fusion_block`, or 1 for a codec that encodes a fused buffer by its parts:
        :attr:`parts_format`); 0: the codec's tensors are never fused."""
        return self.fusion_block() or (1 if self.parts_format else 0)

    def memory_problem(self, memory: str) -> Optional[str]:
        """Why error feedback ``memory`` (its name) cannot go with this codec as configured, or
        None: the communicator refuses such a pair at construction."""
        return None

    def use_memory(self, memory: Any) -> None:
        """Told the error feedback whose compensated gradients it encodes, where this rank's own
        gradient is what it encodes (a flat exchange; None otherwise): a codec that keeps a copy
        of what that memory keeps may read the memory's instead."""

    def sends_as_is(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of ``dtype`` goes on the wire as it is (a cast to its own dtype): its
        all-reduce, without error feedback, is then the plain sum of DDP's own hook, value for
        value, and a front end may leave it to that sum (no payload, no copy; see
        :meth:`Communicator.sends_as_is <gradzip.sync.engine.Communicator.sends_as_is>`)."""
        return False

    def fusion_block(self) -> int:
        """Values per independent block when several tensors share one encoding; 0: never fuse.

        A codec whose output for a value depends only on the block of ``fusion_block()``
        values it sits in (elementwise casts: 1; bucketed quantizers: their bucket) encodes a
        fused buffer of many gradients exactly as it would encode each gradient alone, provided
        every gradient starts on a block boundary. The fused path pads each gradient to a whole
        number of blocks and cuts chunks on block boundaries. Codecs whose format is per tensor
        (a whole-tensor scale, a top-k budget, a low-rank factorisation) return 0 and are sent
        one tensor at a time.
        """
        return 0

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32, shape: Optional[Tuple[int, ...]] = None,
                   wire: Optional[torch.dtype] = None) -> int:
        """Bytes one rank puts on the wire for a tensor of ``numel`` elements (before encoding).

        ``shape`` matters only to codecs that factor matrices (PowerSGD). For codecs whose
        payload size depends on the data (``fixed_size`` false) it is an upper bound. No codec of
        gradzip exceeds the raw size ``numel * element_size(dtype)``: a fixed-size format that
        would is replaced by the raw tensor (``raw_fallback``), and the data-dependent ones fall
        back to a dense format of their own (their ``_wire_bytes`` is at most the raw size).
        ``wire``: as :meth:`encode` takes it (a 16-bit gradient whose fp32 compensation is
        encoded): values sent as they are count in its width, and the bound is its raw size.
        """
        if numel == 0:
            return 0
        sent = _narrower(wire, dtype) or dtype  # (what _wire_bytes takes: the values' dtype)
        return raw_bytes(numel, sent) if self._raw(numel, sent) else self._wire_bytes(numel, sent)

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue bit-exactly: call counters and per-tensor state.

        Private randomness needs no saved stream positions: it is keyed by (seed, rank, tensor
        name, step), so a resumed run draws what the uninterrupted one drew.
        """
        state: Dict[str, Any] = {"calls": dict(self._calls)}
        if self.tensor_state:
            # copies: a codec may update its state in place (Signum's fused groups' momenta)
            state[self.tensor_state] = {k: v.detach().to("cpu", copy=True)
                                        for k, v in getattr(self, f"_{self.tensor_state}").items()}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._calls = dict(state.get("calls", {}))
        if self.tensor_state:
            setattr(self, f"_{self.tensor_state}", {k: v.clone() for k, v in state.get(self.tensor_state, {}).items()})

    # ------------------------------------------------------------ for subclasses
    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        raise NotImplementedError

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        if self._decodes_to():
            return self._decode_to(tensors, meta, meta.numel, None, False)
        raise NotImplementedError

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        if self._decodes_to() and out.is_contiguous() and out.dtype == torch.float32:
            self._decode_to(tensors, meta, out.numel(), out.view(-1), accumulate)
            return out
        return store_into(self._decode(tensors, meta).reshape(-1)[: out.numel()], out, accumulate)

    def _decode_to(
        self, tensors: List[torch.Tensor], meta: Meta, numel: int, out: Optional[torch.Tensor], accumulate: bool,
    ) -> torch.Tensor:
        """For a codec whose decoder writes its fp32 values into a given output itself (or adds
        them to it): the first ``numel`` values, into the flat contiguous fp32 ``out`` when given.
        Overriding it gives :meth:`_decode` and :meth:`_decode_into` both, and a collective's
        decode then needs no temporary and no copy."""
        raise NotImplementedError

    def _decodes_to(self) -> bool:
        return type(self)._decode_to is not Codec._decode_to

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of this codec's own format (an upper bound if the size depends on the data)."""
        raise NotImplementedError

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> Optional[List[Tuple[torch.dtype, int]]]:
        """:meth:`payload_spec` of a tensor that is encoded (not empty, not raw); None by default."""
        return None

    def _parts_payload_spec(self, numel: int, dtype: torch.dtype, parts: Tuple[Tuple[str, torch.Size], ...],
                            ) -> Optional[List[Tuple[torch.dtype, int]]]:
        """:meth:`payload_spec` of a fused buffer of ``parts`` (as :attr:`Meta.parts` holds
        them), for a codec whose format is per part (:attr:`parts_format`); ``dtype`` the one
        its values sent as they are take (:attr:`Meta.as_is`). None by default."""
        return None

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: List[torch.Tensor]) -> List[torch.Tensor]:
        """:meth:`_encode` writing into ``out``; codecs with a :meth:`_payload_spec` (or a
        :meth:`_parts_payload_spec`) override it."""
        raise NotImplementedError(f"codec {self.name!r} has no payload_spec: it cannot encode into given tensors")

    def _raw(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether a tensor of ``numel`` values of ``dtype`` goes on the wire raw: a fixed-size
        codec whose format would be larger (decided by size alone, so alike on every rank)."""
        return (
            self.raw_fallback and self.fixed_size and self._wire_bytes(numel, dtype) > raw_bytes(numel, dtype)
        )

    def _key(self) -> int:
        """A 32-bit key for this rank's counter-based stochastic rounding of the tensor being encoded."""
        meta = self._encoding
        name, step = (meta.name, meta.step) if meta is not None else ("", 0)
        last_step, used = self._draws.get(name, (step, -1))
        use = used + 1 if last_step == step else 0  # a second draw at the same step gets another key
        self._draws[name] = (step, use)
        return private_key(getattr(self, "seed", 0), name, step, use)

    def _generator(self, device: torch.device) -> torch.Generator:
        """This rank's private generator on ``device`` for the tensor being encoded (a fresh one
        per draw, keyed like :meth:`_key`)."""
        return keyed_generator(self._key(), torch.device(device))
