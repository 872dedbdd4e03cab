"""CompLL-style codec authoring: declare a codec in a few lines from shared primitives.

HiPress's CompLL (Bai et al., SOSP'21) lets an algorithm author write encode/decode from a small
set of data-parallel primitives and generates the kernels. Here the primitives are vectorised
torch functions, and the ``compress``/``decompress`` bodies of a :class:`CompLLCodec` can go to
``torch.compile``, which fuses their element-wise passes into fewer loops. ``compile="auto"``
(the default) compiles for CUDA tensors; on CPU it stays eager, because the first call then
costs seconds of compilation per codec and shape family (which tests and short jobs never win
back). ``compile=True`` compiles on CPU too: on 1 M fp32 values, one thread, encode+decode of
``cl_onebit`` went from 4.6–5.4 ms eager to 2.4 ms compiled and ``cl_terngrad`` from 3.4–4.5
to 3.0–3.1 ms; ``cl_tbq`` (one map each way) from 2.1–2.2 to 2.4–2.5 ms. Where compiling fails (no C++ compiler, an unsupported
platform, an error at first call) the same bodies run eagerly, with one warning.

A codec in a few lines::

    from gradzip import compll as cl

    @cl.register
    class Ternary(cl.CompLLCodec):
        name = "my_ternary"
        options = {"threshold": cl.Option(0.01, cl.float_in(0, 1e9), "a non-negative float")}
        default_memory = "residual"

        def compress(self, x, ctx):
            t = self.threshold
            code = cl.map(lambda v: (v > t).to(torch.uint8) | ((v < -t).to(torch.uint8) << 1), x)
            return [cl.pack(code, 2)]

        def decompress(self, wire, ctx):
            code = cl.unpack(wire[0], 2, ctx.numel).float()
            return cl.map(lambda c: self.threshold * ((c == 1).float() - (c == 2).float()), code)

Primitives: :func:`map`, :func:`reduce`, :func:`spread` and :func:`count` (per-bucket or
per-member statistics back to values, and how many values each covers), :func:`select` (filter by mask → values + indices),
:func:`topk`, :func:`scatter`, :func:`random` (keyed by (seed, step, name): shared by all ranks, or private
per rank), :func:`pack`/:func:`unpack` (k-bit values), :func:`concat`/:func:`extract` (a small
header and a payload in one byte buffer).
"""
from __future__ import annotations

import logging
import math
import shutil
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from .base import PART_ALIGN, SEED, Codec, Meta, Option, PartUnits, float_in, int_in, one_of, part_units  # noqa: F401  (re-exported)
from .registry import register_codec as register
from ..kernels import fused, pack_bits, packed_bytes, unpack_bits
from ..kernels.rng import shared_key

log = logging.getLogger(__name__)

__all__ = [
    "CompLLCodec",
    "Option",
    "SEED",
    "concat",
    "count",
    "extract",
    "float_in",
    "int_in",
    "map",
    "one_of",
    "pack",
    "random",
    "reduce",
    "register",
    "scatter",
    "select",
    "spread",
    "topk",
    "unpack",
]


# ----------------------------------------------------------------------------- primitives
def map(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:  # noqa: A001
    """Apply an element-wise function (what the compiler fuses into one pass)."""
    return fn(*tensors)


_REDUCTIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda v: v.sum(dim=-1),
    "mean": lambda v: v.mean(dim=-1),
    "max": lambda v: v.amax(dim=-1),
    "min": lambda v: v.amin(dim=-1),
    "absmax": lambda v: v.abs().amax(dim=-1),
    "l1": lambda v: v.abs().sum(dim=-1),
    "l2": lambda v: torch.linalg.vector_norm(v, dim=-1),
}


def reduce(x: torch.Tensor, op: str, bucket_size: int = 0, ctx: "Context | None" = None) -> torch.Tensor:
    """Reduce ``x`` with ``op`` (sum, mean, max, min, absmax, l1, l2), whole or per bucket.

    With ``bucket_size`` > 0 the result has one value per bucket; the tail bucket only counts
    real elements (it is padded with the op's neutral element). Given the body's ``ctx``, a
    fused group (:attr:`CompLLCodec.by_parts`) gets one value per member, or per bucket of each
    member, from its own values only (``bucket_size`` then 0 or a multiple of
    :data:`~gradzip.codecs.base.PART_ALIGN`); alone, the same as without it.
    """
    if op not in _REDUCTIONS:
        raise ValueError(f"unknown reduction {op!r}; valid: {', '.join(sorted(_REDUCTIONS))}")
    if ctx is not None and ctx.grouped:
        return _reduce_units(x, op, ctx.units(bucket_size))
    if bucket_size <= 0:
        return _REDUCTIONS[op](x.reshape(1, -1))[0]
    bucket_size = min(bucket_size, max(x.numel(), 1))  # (one bucket of them all: no padding)
    pad = (-x.numel()) % bucket_size
    if pad:
        if op in ("max", "min"):  # repeat a real element: neutral for both
            x = torch.cat([x, x[-1:].expand(pad)])
        elif op == "mean":
            raise ValueError("per-bucket mean needs numel divisible by bucket_size")
        else:
            x = torch.cat([x, x.new_zeros(pad)])
    return _REDUCTIONS[op](x.view(-1, bucket_size))


_UNIT_REDUCTIONS = {"sum": "sum", "mean": "sum", "l1": "sum", "l2": "sum", "absmax": "max", "max": "max", "min": "min"}


def _reduce_units(x: torch.Tensor, op: str, units: PartUnits) -> torch.Tensor:
    """``op`` over each unit of a fused group: the blocks' reductions (padding set to the op's
    neutral value), then one reduction over each unit's blocks. Floating-point values of 16 bits
    are reduced in fp32 and rounded once (as torch reduces them alone); integer sums are exact;
    the result has the dtype the reduction of one unit alone has."""
    floating = x.is_floating_point()
    if not floating and op in ("mean", "l2"):
        raise ValueError(f"reduction {op!r} needs floating-point values, got {x.dtype}")
    rows = x.reshape(-1, PART_ALIGN)
    if floating and x.element_size() < 4:
        rows = rows.float()
    elif x.dtype == torch.bool:
        rows = rows.to(torch.uint8 if op in ("max", "min", "absmax") else torch.int64)
    if op in ("max", "min"):
        info = torch.finfo(rows.dtype) if floating else torch.iinfo(rows.dtype)
        neutral = (-math.inf if op == "max" else math.inf) if floating else (info.min if op == "max" else info.max)
    else:
        neutral = 0
    rows = rows.masked_fill(~_real(units), neutral)
    if op in ("l1", "absmax"):
        rows = rows.abs()
    elif op == "l2":
        rows = rows.square()
    per_block = rows.amax(1) if op in ("absmax", "max") else rows.amin(1) if op == "min" else rows.sum(1)
    if floating:
        out = torch.segment_reduce(per_block, _UNIT_REDUCTIONS[op], lengths=units.lengths, unsafe=True,
                                   **({"initial": 0.0} if op == "absmax" else {}))
        if op == "mean":
            out = (out.double() / units.numels).to(out.dtype)
        elif op == "l2":
            out = out.sqrt()
        return out.to(x.dtype)
    of_block = units.of_block.long()
    out = torch.zeros(units.lengths.numel(), dtype=per_block.dtype, device=x.device)
    if op in ("sum", "l1"):  # (exact: integers added as integers)
        return out.index_add_(0, of_block, per_block)
    out = out.index_reduce_(0, of_block, per_block, "amax" if op != "min" else "amin", include_self=False)
    return out.to(x.dtype)


def _bucket(numel: int, bucket_size: int) -> int:
    """Values each statistic of one tensor covers: ``bucket_size``, or all of them (0, or a
    bucket as large)."""
    return bucket_size if 0 < bucket_size < numel else max(numel, 1)


def spread(stats: torch.Tensor, ctx: "Context", bucket_size: int = 0) -> torch.Tensor:
    """Each value's statistic: ``stats`` (one a bucket of ``bucket_size`` values, or one for
    the whole tensor with 0; in a fused group one a member or a member's bucket, as
    :func:`reduce` given ``ctx`` makes them) repeated over the ``ctx.numel`` values it covers."""
    stats = stats.reshape(-1)
    if ctx.grouped:
        per_block = stats.index_select(0, ctx.units(bucket_size).of_block)
        return per_block.unsqueeze(1).expand(-1, PART_ALIGN).reshape(-1)
    n = ctx.numel
    return stats.repeat_interleave(_bucket(n, bucket_size))[:n]


def count(ctx: "Context", bucket_size: int = 0) -> torch.Tensor:
    """How many values each statistic covers (int64, one a bucket, member or member's bucket as
    :func:`reduce` makes them): a fused group's padding is not counted."""
    if ctx.grouped:
        return ctx.units(bucket_size).reals.long()
    n = ctx.numel
    size = _bucket(n, bucket_size)
    counts = torch.full((-(-n // size),), size, dtype=torch.int64, device=ctx.device)
    if n % size:
        counts[-1] = n % size
    return counts


def select(x: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Filter: the values where ``mask`` holds and their int32 indices (a data-dependent size)."""
    idx = mask.reshape(-1).nonzero().reshape(-1)
    return x.reshape(-1)[idx], idx.to(torch.int32)


def topk(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` values of largest magnitude and their int32 indices."""
    _, idx = torch.topk(x.reshape(-1).abs(), k, sorted=False)
    return x.reshape(-1)[idx], idx.to(torch.int32)


def scatter(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """A dense tensor of ``numel`` zeros with ``values`` written at ``indices``."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_copy_(0, indices.long(), values)


def random(ctx: "Context", shape: Sequence[int] | int, shared: bool = False) -> torch.Tensor:
    """Uniform [0, 1) numbers: ``shared`` streams are equal on every rank for (seed, step,
    name); private streams differ per rank. Never touches the global RNG. Number ``i`` (in
    row-major order) is ``counter_uniform(i, key)``, the very draws of the hand-written codecs'
    fused kernels (``terngrad``'s), with the key the codec's own for this tensor and step."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    key = ctx.shared_key() if shared else ctx.private_key()
    return fused.uniform(math.prod(shape), key, ctx.device).view(shape)


def pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit values (1..8) densely into bytes."""
    return pack_bits(levels, bits)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` ``bits``-bit values of ``packed`` as uint8."""
    return unpack_bits(packed, bits, numel)


def concat(header: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """One uint8 buffer: a small float32 header (scales, norms, thresholds) then the payload."""
    head = header.reshape(-1).to(torch.float32).contiguous().view(torch.uint8)
    return torch.cat([head, payload.reshape(-1).contiguous().view(torch.uint8)])


def extract(buf: torch.Tensor, header_len: int, dtype: torch.dtype = torch.uint8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`concat`: (float32 header of ``header_len`` values, payload as ``dtype``)."""
    split = header_len * 4
    return buf[:split].view(torch.float32), buf[split:].view(dtype)


# ------------------------------------------------------------------------------ the codec
# a group's units (made once per layout) and where its values lie: once a body is compiled,
# versions torch.compile does not trace (nor recompile for each layout), set there so that
# importing gradzip does not load the compiler
_units: Callable[..., PartUnits] = part_units
_real: Callable[[PartUnits], torch.Tensor] = PartUnits.real


class Context:
    """What an encode/decode body may know about the tensor: size, shape, step, randomness."""

    def __init__(self, codec: "CompLLCodec", meta: Meta) -> None:
        self._codec = codec
        self.meta = meta
        self.numel = meta.numel
        self.shape = meta.shape
        self.device = meta.device
        self.name = meta.name
        self.step = meta.step
        # a fused group (a codec that takes groups by their parts): its members, ``meta.parts``
        # (name and shape each, each on a block of PART_ALIGN values, zeros after it), are read
        # through :meth:`units` only, so a compiled body does not depend on them
        self.grouped = meta.parts is not None

    def units(self, bucket_size: int = 0) -> PartUnits:
        """A fused group's units: each member whole, or each member's buckets of ``bucket_size``."""
        if bucket_size % PART_ALIGN:
            raise ValueError(f"a fused group is reduced by members or by buckets of a multiple of {PART_ALIGN} "
                             f"values, got bucket_size={bucket_size}")
        return _units(self.meta.parts, bucket_size, self.device)

    def private_key(self) -> int:
        """A 32-bit key for this rank's draws on this tensor and step (a fresh one per call)."""
        return self._codec._key()

    def shared_key(self) -> int:
        """A 32-bit key every rank derives alike for (seed, step, name)."""
        return shared_key(getattr(self._codec, "seed", 0), self.step, self.name)


def _compiler_available() -> bool:
    try:
        import torch._dynamo  # noqa: F401
    except Exception:
        return False
    return shutil.which("cc") is not None or shutil.which("gcc") is not None or torch.cuda.is_available()


class CompLLCodec(Codec):
    """Base class of codecs written with the primitives: define ``compress`` and ``decompress``.

    ``compress(self, x, ctx) -> list of tensors`` gets the flat input in fp32 and returns what
    goes on the wire; ``decompress(self, wire, ctx) -> tensor`` returns the flat fp32 result.
    (The public ``encode``/``decode`` of every codec wrap these.) Declare ``name``, ``options``,
    ``collectives``, ``default_memory`` (and ``fixed_size``/``summable``) as on any codec, and
    set ``wire_bits``/``header_bytes`` or override ``_wire_bytes``. Every CompLL codec takes
    the extra option ``compile`` ("auto", True or False).
    """

    wire_bits: int = 0  # bits per element on the wire: 1..8 packed, or 16/32 (default _wire_bytes)
    header_bytes: int = 0  # bytes of header per tensor
    # values the bodies encode apart from the rest of the tensor (an element-wise map packed to
    # k bits: 8 // k, whole bytes; a reduce by buckets: the bucket), so that several gradients
    # may go through them as one fused group, each starting on a multiple of it, and decode as
    # alone; 0: the bodies read the whole tensor (its size, its shape, one reduce)
    block: int = 0
    # the bodies reduce, spread and count their statistics through ``ctx`` (:func:`reduce`,
    # :func:`spread`, :func:`count`) by units of :meth:`unit_size` values: a fused group then
    # goes through one call, its members on blocks of PART_ALIGN values, each member's
    # statistics its own (where ``block`` is 0 and the unit a multiple of PART_ALIGN)
    by_parts: bool = False
    records_fusion = False  # (fused only where ``block`` says so: checkpoints without ``fusion`` load)

    def unit_size(self) -> int:
        """Values each statistic of the bodies covers: the bucket size they reduce by (0: the
        whole tensor); it decides whether a :attr:`by_parts` codec takes groups by their parts."""
        return 0

    @property
    def parts_format(self) -> bool:  # type: ignore[override]
        return self.by_parts and not self.fusion_block() and self.unit_size() % PART_ALIGN == 0

    def fused_alignment(self) -> int:
        return self.fusion_block() or (PART_ALIGN if self.parts_format else 0)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "compile" not in cls.options:
            cls.options = {
                **cls.options,
                "compile": Option(
                    "auto", one_of("auto", True, False), "'auto', True or False",
                    "fuse with torch.compile: 'auto' does so for CUDA tensors only",
                ),
            }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._bodies: Dict[Tuple[str, str], Callable] = {}

    def _body(self, which: str, device: torch.device) -> Callable:
        """The compress/decompress body for ``device``: compiled or eager, decided once."""
        key = (which, device.type)
        fn = self._bodies.get(key)
        if fn is None:
            eager = getattr(self, which)
            use = self.compile if self.compile != "auto" else device.type == "cuda" and _compiler_available()
            fn = self._bodies[key] = self._compiled(eager) if use else eager
        return fn

    def compress(self, x: torch.Tensor, ctx: Context) -> List[torch.Tensor]:
        raise NotImplementedError

    def decompress(self, wire: List[torch.Tensor], ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        wire = self._body("compress", x.device)(x.float(), Context(self, meta))
        if not isinstance(wire, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in wire):
            hint = " (put it in a list: [t])" if isinstance(wire, torch.Tensor) else ""
            raise TypeError(f"CompLL codec {self.name!r}: compress must return a list of tensors, got "
                            f"{type(wire).__name__}{hint}")
        return list(wire)

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        out = self._body("decompress", meta.device)(list(tensors), Context(self, meta))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"CompLL codec {self.name!r}: decompress must return a tensor, got {type(out).__name__}")
        return out

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        bits = self.wire_bits
        return (packed_bytes(numel, bits) if bits <= 8 else numel * bits // 8) + self.header_bytes

    def fusion_block(self) -> int:
        return self.block

    def _compiled(self, fn: Callable) -> Callable:
        """``fn`` through torch.compile, falling back to eager (once, with a warning) on failure."""
        global _units, _real
        try:
            compiled = torch.compile(fn, dynamic=True)
            if _units is part_units:
                _units, _real = torch.compiler.disable(part_units), torch.compiler.disable(PartUnits.real)
        except Exception as exc:  # compiler missing or platform unsupported
            log.warning("gradzip.codecs.compll: torch.compile unavailable for %s (%s); running eagerly", self.name, exc)
            return fn
        state = {"fn": compiled}

        def call(*args: Any) -> Any:
            try:
                return state["fn"](*args)
            except Exception as exc:
                if state["fn"] is fn:
                    raise
                log.warning("gradzip.codecs.compll: compiled %s failed (%s); running eagerly", self.name, exc)
                state["fn"] = fn
                return fn(*args)

        return call
