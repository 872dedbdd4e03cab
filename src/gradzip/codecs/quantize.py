"""Quantization codecs: casts (none, fp16, bf16), CGX max-min, QSGD, TernGrad, natural
compression, 8-bit dynamic tree (u8bit), INCEPTIONN and threshold binary quantization (TBQ)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..kernels import bucket_view, fused, packed_bytes
from ..kernels.reference import SHORT_FLOATS
from .base import (
    PART_ALIGN, SEED, Codec, Meta, Option, Payload, element_size, float_in, int_in, nonfinite_flag, one_of,
    part_units, raw_bytes, saturate, stats_nonfinite,
)
from .registry import register_codec


class _Cast(Codec):
    """Send the gradient as another floating-point type; payloads sum directly.

    Finite values beyond the wire type's range are sent as its largest finite value (of their
    sign), so finite input never comes back as ±inf; NaN and ±inf are sent as they are.
    """

    family = "cast"
    collectives = ("allreduce", "allgather")
    summable = True
    payload_keeps_nonfinite = True  # the saturating cast keeps NaN and ±inf
    wire_dtype: torch.dtype | None = None

    def _wdtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype or dtype

    def fusion_block(self) -> int:
        return 1

    def sends_as_is(self, dtype: torch.dtype) -> bool:
        return self._wdtype(dtype) == dtype

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        # (a cast to the input's own type sends a 16-bit gradient's fp32 compensation in the
        # gradient's width: Meta.wire)
        return [saturate(x, self._wdtype(meta.as_is))]

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> Optional[List[Tuple[torch.dtype, int]]]:
        # a cast to the input's own dtype sends the input itself: nothing to write
        wire = self._wdtype(dtype)
        return None if wire == dtype else [(wire, numel)]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: List[torch.Tensor]) -> List[torch.Tensor]:
        return [saturate(x, out[0].dtype, out=out[0])]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return tensors[0]

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """From the values sent: the saturating cast keeps every NaN and ±inf and makes none of
        a finite value, so its min/max pass reads 2 bytes a value where the input has 4 (on
        this 2-core CPU, 8 Mi values: 1.8 ms against 4.5 ms)."""
        return None if not payload.tensors else nonfinite_flag(payload.tensors[0])

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * element_size(self._wdtype(dtype))


@register_codec
class NoCompression(_Cast):
    """No compression: the gradient goes on the wire as it is (the baseline)."""

    name = "none"
    paper = "-"


@register_codec
class FP16(_Cast):
    """Half precision (IEEE fp16) on the wire: 2 bytes per element.

    As in GRACE (Xu et al., ICDCS'21) and PyTorch's ``fp16_compress_hook``. Finite values
    beyond ±65504 are sent as ±65504 (saturated, not ±inf); the collective averages before
    summing to keep sums in range.
    """

    name = "fp16"
    paper = "Micikevicius et al., Mixed Precision Training, ICLR'18; GRACE, ICDCS'21"
    wire_dtype = torch.float16


@register_codec
class BF16(_Cast):
    """bfloat16 on the wire: 2 bytes per element, fp32's range with 8 bits of mantissa.

    Finite values that round beyond bf16's largest value (fp32 above about 3.39e38) are sent as
    that value; an fp16 input near 65504 may round to 65536 in bf16 and decodes to 65504.
    """

    name = "bf16"
    paper = "Kalamkar et al., A Study of BFLOAT16 for Deep Learning Training, 2019"
    wire_dtype = torch.bfloat16


@register_codec
class MaxMin(Codec):
    """CGX bucketed max-min quantization (Markov et al., CGX, Middleware'22).

    The flat gradient is cut into buckets of ``bucket_size`` values; each bucket keeps its min and
    scale ``(max - min) / (2**bits - 1)`` in fp32 and each value becomes a ``bits``-bit level,
    packed densely. ``mode="stochastic"`` (default) rounds up with probability equal to the
    fractional part, so decoding is unbiased and the error is below one step
    ``(max - min) / (2**bits - 1)``; ``mode="nearest"`` halves the worst-case error but is biased.

    Options: ``bits`` (1..8, default 4), ``bucket_size`` (default 1024), ``mode``, ``seed``.
    Wire: ``bits`` per element + 8 bytes per bucket. Collectives: ``sra`` (CGX's scatter-reduce +
    all-gather, default) or ``allgather``.
    """

    name = "maxmin"
    family = "quantization"
    paper = "Markov et al., CGX: Adaptive System Support for Communication-Efficient Deep Learning, Middleware'22"
    collectives = ("sra", "allgather")
    default_memory = "none"
    stochastic = True
    stats_tensor = 1  # (min, scale) per bucket: a NaN min decodes the bucket to NaN
    stats_scale = True  # min + level * scale
    options = {
        "bits": Option(4, int_in(1, 8), "an integer in 1..8", "bits per value"),
        "bucket_size": Option(1024, int_in(1), "a positive integer", "values sharing one min/max"),
        "mode": Option("stochastic", one_of("stochastic", "nearest"), "'stochastic' or 'nearest'", "rounding"),
        "seed": SEED,
    }

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return self._encode_into(x, meta, None)

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, packed_bytes(numel, self.bits)), (torch.float32, 2 * -(-numel // self.bucket_size))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
        key = self._key() if self.mode == "stochastic" else None
        return list(fused.maxmin_encode(x, self.bits, self.bucket_size, key, out))

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return fused.maxmin_decode(*tensors, self.bits, self.bucket_size, meta.numel)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        return fused.maxmin_decode(*tensors, self.bits, self.bucket_size, out.numel(), out, accumulate)

    def fusion_block(self) -> int:
        return self.bucket_size

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        # every bucket's min is NaN where it held a NaN and its scale infinite where it held an
        # Inf (or NaN where it held +inf only), in every kernel version; the codec works in fp32,
        # so an fp64 value beyond fp32's range is an Inf to it, and flagged as such
        return stats_nonfinite(payload, self.stats_tensor)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _spec_bytes(self._payload_spec(numel, dtype))


@register_codec
class QSGD(Codec):
    """QSGD stochastic quantization (Alistarh et al., QSGD, NeurIPS'17).

    Each bucket of ``bucket_size`` values keeps its L2 norm (fp32); each value is sent as a sign
    bit and a level in ``0..s`` with ``s = 2**(bits-1) - 1``, rounded stochastically so the
    decoded value ``norm * sign * level / s`` is unbiased. Sign and level are packed together
    into ``bits`` bits.

    Options: ``bits`` (2..8, default 4), ``bucket_size`` (default 512, as in the paper), ``seed``.
    Collectives: ``allgather`` (default) or ``sra``. Default memory: ``none`` (unbiased).

    Error feedback only where ``√bucket_size < s``: a value's rounding error reaches one step,
    ``norm / s``, up to ``√bucket_size / s`` times the bucket's largest value, so above that
    ratio the residual that error feedback adds to the next gradient is not bounded. At the
    defaults (4 bits, 512 values: 3.2) it grew to 69,000 times the gradient in 200 steps of
    Gaussian gradients, at 2 bits faster still; at 8 bits (0.18) it stayed at 0.07. Other
    settings are refused with a stateful memory (:meth:`memory_problem`).
    """

    name = "qsgd"
    family = "quantization"
    kernels_bit_exact = False  # the norm's summation order differs between kernel versions
    paper = "Alistarh et al., QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding, NeurIPS'17"
    collectives = ("allgather", "sra")
    stochastic = True
    stats_tensor = 1  # a norm per bucket: a NaN norm decodes the bucket to NaN
    stats_scale = True  # level * sign * norm / s
    options = {
        "bits": Option(4, int_in(2, 8), "an integer in 2..8", "bits per value, sign included"),
        "bucket_size": Option(512, int_in(1), "a positive integer", "values sharing one norm"),
        "seed": SEED,
    }

    def memory_problem(self, memory: str) -> Optional[str]:
        s = 2 ** (self.bits - 1) - 1
        # √bucket_size < s: the residual stays bounded (a bucket of one value is sent exactly)
        if memory == "none" or self.bucket_size < s * s or self.bucket_size == 1:
            return None
        return (f"{self.name} with bits={self.bits} and bucket_size={self.bucket_size} cannot take "
                f"memory={memory!r}: a value's rounding error can reach sqrt(bucket_size)/s = "
                f"{math.sqrt(self.bucket_size) / s:.2g} times its bucket's largest value "
                f"(s = 2**(bits-1) - 1 = {s}), so error feedback's residual would not stay "
                f"bounded; use it without error feedback (memory='none', its default), or with it where "
                f"bucket_size < s**2 (bucket_size at most {max(1, s * s - 1)} at bits={self.bits}, or more bits)")

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return self._encode_into(x, meta, None)

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, packed_bytes(numel, self.bits)), (torch.float32, -(-numel // self.bucket_size))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
        return list(fused.qsgd_encode(x, self.bits, self.bucket_size, self._key(), out))

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return fused.qsgd_decode(*tensors, self.bits, self.bucket_size, meta.numel)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        return fused.qsgd_decode(*tensors, self.bits, self.bucket_size, out.numel(), out, accumulate)

    def fusion_block(self) -> int:
        return self.bucket_size

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        # a bucket's norm is NaN where it held a NaN and infinite where it held an Inf (the
        # squares are summed in fp64, so finite fp32 values give a finite norm; an fp64 value
        # beyond fp32's range is an Inf in the codec's fp32), in every kernel version
        return stats_nonfinite(payload, self.stats_tensor)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _spec_bytes(self._payload_spec(numel, dtype))


def _spec_bytes(spec: List[Tuple[torch.dtype, int]]) -> int:
    """The bytes of a payload of the form ``spec`` (:meth:`Codec.payload_spec`)."""
    return sum(raw_bytes(numel, dtype) for dtype, numel in spec)


# ============================================================================ TernGrad
def _whole_or(bucket_size: int, numel: int) -> int:
    """Bucket length: ``bucket_size``, or the whole tensor when it is 0."""
    return bucket_size if bucket_size > 0 else numel


def _num_buckets(bucket_size: int, numel: int) -> int:
    return -(-numel // _whole_or(bucket_size, numel))


@register_codec
class TernGrad(Codec):
    """TernGrad stochastic ternarization (Wen et al., TernGrad, NeurIPS'17).

    Each bucket keeps its scale ``s = max|x|`` (fp32); each value becomes ``s * sign(x) * b``
    with ``b ~ Bernoulli(|x| / s)``, so decoding is unbiased and every decoded value is 0 or
    ``±s``. (The paper's optional gradient clipping at 2.5 σ is left out: it would bias the
    result, and error feedback is the gradzip way to trade bias for variance.)

    Options: ``bucket_size`` (default 0: the whole tensor shares one scale, as in the paper's
    per-layer scaling; ``n > 0``: one scale per ``n`` values), ``seed`` (private rounding stream).
    Wire: 2 bits per element packed (``00`` zero, ``01`` +s, ``10`` −s) + one fp32 scale per
    bucket, i.e. 2.00003 bits/element for a 1 M-element tensor with the default.
    Collectives: ``allgather`` (default) or ``sra``. Default memory: ``none`` (unbiased); a
    stateful one is refused (:meth:`memory_problem`): a value's error reaches the scale, the
    bucket's largest value, so error feedback's residual is not bounded (on Gaussian gradients
    it grew to 75 times the gradient in 200 steps, and kept growing).

    With one scale a tensor, a fused group on the all-gather is one call
    (:attr:`~gradzip.codecs.base.Codec.parts_format`): its members start on blocks of
    :data:`~gradzip.codecs.base.PART_ALIGN` values, each member's scale is the maximum of its
    blocks' maxima (exactly its own), and the group is encoded and decoded in one pass each,
    every block with its member's scale; the draws are the group's. The scales are NaN or
    infinite exactly where their values held NaN or Inf: they are the non-finite flag.

    Speed on CUDA: the scale is a reduction (one Triton pass of ``fused.row_maxima``; torch's
    ``abs`` and ``amax`` in the figures below), then one Triton pass makes each value's draw from
    the counter hash of its index (``counter_uniform``, as max-min's noise and its CompLL twin
    ``cl_terngrad``'s, bit for bit) and writes the packed codes; decode is one pass. On an H200
    (``gradzip bench codecs --device cuda --numel 67108864``) encode runs at 38% of a device
    copy per call and 39% in a stream, decode at 106% and 149% (with the draws a torch
    generator's pass of their own, 26% / 28% encode; the torch version before the kernels:
    9% / 13%). The scale's reduction is a second read of the input: the encode moves about
    twice what a copy does.
    """

    name = "terngrad"
    family = "quantization"
    paper = "Wen et al., TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning, NeurIPS'17"
    collectives = ("allgather", "sra")
    default_memory = "none"
    stochastic = True
    options = {
        "bucket_size": Option(0, int_in(0), "a non-negative integer (0 = whole tensor)", "values sharing one scale"),
        "seed": SEED,
    }

    def memory_problem(self, memory: str) -> Optional[str]:
        if memory == "none" or self.bucket_size == 1:  # (a bucket of one value is sent exactly)
            return None
        return (f"{self.name} cannot take memory={memory!r}: a value's rounding error reaches its bucket's scale (its "
                f"largest value), so error feedback's residual would not stay bounded; use it without error "
                f"feedback (memory='none', its default)")

    @property
    def parts_format(self) -> bool:  # type: ignore[override]
        return self.bucket_size == 0  # one scale a tensor: a fused group by its parts, a scale a member

    def fused_alignment(self) -> int:
        return self.bucket_size or PART_ALIGN

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return self._encode_into(x, meta, None)

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, packed_bytes(numel, 2)), (torch.float32, _num_buckets(self.bucket_size, numel))]

    def _parts_payload_spec(self, numel: int, dtype: torch.dtype, parts: Sequence) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, packed_bytes(numel, 2)), (torch.float32, len(parts))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
        n = x.numel()
        codes_out, scale_out = (None, None) if out is None else out
        if meta.parts is not None and self.parts_format:
            # each member's scale, the maximum of its blocks' maxima (exact: the scale it has
            # alone), then the codes of the whole group in one pass, each block with its member's
            units = part_units(meta.parts, 0, x.device)
            blocks = x.float().view(-1, PART_ALIGN)
            scale = units.maxima(fused.row_maxima(blocks))
            scale = scale if scale_out is None else scale_out.copy_(scale)
            packed, _ = fused.terngrad_encode(blocks, self._key(), n, scale.index_select(0, units.of_block), codes_out)
            return [packed, scale]
        buckets = bucket_view(x.float(), _whole_or(self.bucket_size, n))
        # the scales are a reduction, then one pass (a Triton kernel on CUDA, which makes the
        # counter draws itself, as its CompLL twin's) turns values and draws into codes
        scale = None if scale_out is None else scale_out.copy_(fused.row_maxima(buckets))
        return list(fused.terngrad_encode(buckets, self._key(), n, scale, codes_out))

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        # a scale (a maximum of magnitudes) is NaN or infinite exactly where its values held NaN or Inf
        return stats_nonfinite(payload, 1)

    def _decode_to(
        self, tensors: List[torch.Tensor], meta: Meta, numel: int, out: Optional[torch.Tensor], accumulate: bool,
    ) -> torch.Tensor:
        packed, scale = tensors
        if meta.parts is not None and self.parts_format:  # one decode, each block with its member's scale
            per_block = scale.index_select(0, part_units(meta.parts, 0, packed.device).of_block)
            return fused.ternary_decode(packed, per_block, PART_ALIGN, numel, out, accumulate)
        return fused.ternary_decode(packed, scale, _whole_or(self.bucket_size, meta.numel), numel, out, accumulate)

    def fusion_block(self) -> int:
        return self.bucket_size  # 0 (one scale per tensor): fused by its parts instead

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return packed_bytes(numel, 2) + 4 * _num_buckets(self.bucket_size, numel)


# ================================================================= natural compression
_FLT_MAX = torch.finfo(torch.float32).max
_MAG = 0x7FFFFFFF  # fp32 bits without the sign
_INF = 0x7F800000  # fp32 bits of +inf
_MANT = 1 << 23  # one unit of the fp32 exponent field


def _header_of(largest: torch.Tensor) -> torch.Tensor:
    """Natural compression's int32 headers from max|x| (fp32, one or one a member): the biased
    exponent rounded up; 256 (one past inf's) where a value is non-finite (NaN's bits, above
    inf's, are clamped to inf's: it is sent as inf), so the decoder tells 2**128 (a finite value
    rounded up: saturates) from inf."""
    bits = (largest.view(torch.int32) & _MAG).clamp_(max=_INF)
    return ((bits + (_MANT - 1)) >> 23).add_((bits >= _INF).to(torch.int32))


@register_codec
class Natural(Codec):
    """Natural compression (Horváth et al., Natural Compression for Distributed Deep Learning,
    2019; MSML'22).

    Each ``|x|`` in ``[2**a, 2**(a+1))`` becomes ``2**a`` or ``2**(a+1)``, rounding up with
    probability ``|x| / 2**a - 1``, so decoding is unbiased; the decoded magnitude is always a
    power of two bracketing ``|x|`` (powers of two themselves are kept exactly), the relative
    error is below 1 and the variance at most ``x**2 / 8``. The rounding works on the fp32 bits:
    a uniform 23-bit integer added to the magnitude bits carries into the exponent field with
    probability exactly mantissa / 2**23. At the top of a range the rounding saturates and is
    no longer unbiased: fp16 input above 2**15 may round up to 2**16, which fp16 cannot hold,
    and fp32 input above 2**127 to 2**128: such a value decodes to the largest finite value of
    its dtype (65504, 3.4028235e38). NaN and ±inf decode to ±inf (the header is then 256).

    Wire: 1 byte per element plus a 4-byte header (8.00003 bits/element for 1 M elements). The
    header is the int32 ``T``, the biased fp32 exponent of ``max|x|`` rounded up, so every value
    rounds to at most ``2**(T-127)``. A byte is ``sign << 7 | c``: ``c = 0`` is zero and ``c`` in
    1..127 is ``2**(T - 254 + c)``. Magnitudes below the smallest code, ``2**(T - 253)``, round
    to 0 or to that power with probability ``|x| / 2**(T - 253)``, which keeps them unbiased
    too (to the 2**-23 resolution of the random numbers, like the in-range rounding).

    Options: ``seed`` (private rounding stream). Collectives: ``allgather`` (default) or ``sra``.
    Default memory: ``none`` (unbiased).

    A fused group on the all-gather is one call
    (:attr:`~gradzip.codecs.base.Codec.parts_format`): its members start on blocks of
    :data:`~gradzip.codecs.base.PART_ALIGN` values and each keeps its own header (from its
    blocks' maxima: exactly the header it has alone), the payload carrying one int32 a member;
    the codes and the decode are one pass each, every block under its member's header; the
    draws are the group's. A header is 256 exactly where its values held NaN or ±inf: the
    headers are the non-finite flag.

    Speed on CUDA: the header is one min/max pass, then one Triton pass makes each value's
    23-bit draw from the counter hash of its index (``counter_uniform``'s top bits) and turns
    the values' bits and the draws into codes; decode is one pass of the table kernel over a
    256-entry table. On an H200 (``gradzip bench codecs --device cuda --numel 67108864``)
    encode runs at 49% of a device copy per call and 63% in a stream, decode at 36% and 53%
    (with the draws an int32 tensor of a torch generator, written then read: 18% / 23% encode,
    24% / 28% decode; the torch version before the kernels: 4% / 22%).
    """

    name = "natural"
    family = "quantization"
    paper = "Horváth et al., Natural Compression for Distributed Deep Learning, MSML'22 (arXiv 2019)"
    collectives = ("allgather", "sra")
    default_memory = "none"
    stochastic = True
    options = {"seed": SEED}

    _CODES = 127  # exponent codes 1..127 below the header exponent; 0 is zero
    parts_format = True  # a fused group: one call, a header a member

    def fused_alignment(self) -> int:
        return PART_ALIGN

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return self._encode_into(x, meta, None)

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, numel), (torch.int32, 1)]

    def _parts_payload_spec(self, numel: int, dtype: torch.dtype, parts: Sequence) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, numel), (torch.int32, len(parts))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
        xf = x.float().contiguous()
        codes_out, top_out = (None, None) if out is None else out
        if meta.parts is not None:  # each member's header from its blocks' maxima (exact), one pass of codes
            units = part_units(meta.parts, 0, x.device)
            top = _header_of(units.maxima(fused.row_maxima(xf.view(-1, PART_ALIGN))))
            per_block, bucket = top.index_select(0, units.of_block), PART_ALIGN
        else:
            lo, hi = torch.aminmax(xf)  # one reading pass; a NaN comes out of both
            top = per_block = _header_of(torch.maximum(-lo, hi).reshape(1))
            bucket = 0
        top = top if top_out is None else top_out.copy_(top)
        # then one pass (a Triton kernel on CUDA, which makes the counter draws itself) from
        # bits, draws and header to the codes
        return [fused.natural_codes(xf.view(torch.int32), self._key(), per_block, bucket, codes_out), top]

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        # a header is 256 exactly where its values held NaN or ±inf
        if len(payload.tensors) != 2:
            return None
        return (payload.tensors[1] > 255).any()

    def _decode_to(
        self, tensors: List[torch.Tensor], meta: Meta, numel: int, out: Optional[torch.Tensor], accumulate: bool,
    ) -> torch.Tensor:
        codes, top = tensors
        if meta.parts is not None:  # one pass, each block under its member's header
            per_block = top.index_select(0, part_units(meta.parts, 0, codes.device).of_block)
            return fused.natural_decode(codes, per_block, PART_ALIGN, numel, out, accumulate)
        # the 256 values a byte can mean under this header, then one lookup per element
        byte = torch.arange(256, device=codes.device, dtype=torch.int32)
        code = byte & self._CODES
        field = (code + (top - self._CODES)).clamp(0, 255) << 23
        # finite input (top <= 255): 2**128 does not exist in fp32, the largest fp32 stands in
        field = torch.minimum(field, torch.where(top <= 255, _INF - 1, _INF).to(torch.int32))
        table = (torch.where(code > 0, field, 0) | ((byte >> 7) << 31)).view(torch.float32)
        return fused.table_decode(codes, table, None, numel, numel, out, accumulate)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel + 4


# ================================================================================ 8-bit
def _dynamic_tree_table() -> torch.Tensor:
    """Dettmers' signed 8-bit dynamic tree: 256 sorted values in [-1, 1] (float64).

    In the tree an 8-bit code is a sign bit, then ``z`` zeros (a decimal exponent, 0..6), an
    indicator 1 and ``6 - z`` bits of a linear fraction of [0.1, 1]: so ``10**-z`` carries
    ``2**(6-z)`` values, the midpoints of ``2**(6-z)`` equal steps of [0.1, 1]. The two codes
    left over are 0 and +1.0 (as in bitsandbytes' ``create_dynamic_map``).
    """
    values = [0.0, 1.0]
    for z in range(7):
        k = 1 << (6 - z)
        for j in range(k):
            frac = 0.1 + 0.9 * (j + 0.5) / k
            values += [frac * 10.0**-z, -frac * 10.0**-z]
    return torch.tensor(sorted(values), dtype=torch.float64)


_U8_TABLE64 = _dynamic_tree_table()
_U8_MIDS64 = (_U8_TABLE64[1:] + _U8_TABLE64[:-1]) / 2


def _u8_lookup() -> torch.Tensor:
    """First-candidate table of :func:`_u8_tables`, indexed by the top 16 bits of an fp32."""
    mids = _U8_MIDS64.float()
    keys = torch.arange(1 << 16, dtype=torch.int64)
    neg = keys >= 1 << 15
    # an interval's smallest float has low bits 0 when positive, all ones when negative
    def floats(low: torch.Tensor) -> torch.Tensor:
        bits = (keys << 16) | low
        return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)

    smallest = floats(torch.where(neg, 0xFFFF, 0)).nan_to_num(0.0)  # NaN keys: any entry will do
    largest = floats(torch.where(neg, 0, 0xFFFF)).nan_to_num(0.0)
    lut = torch.searchsorted(mids, smallest)
    if bool(((torch.searchsorted(mids, largest) - lut) > 1).any()):  # import time only
        raise AssertionError("u8bit lookup: an fp32 interval holds two table midpoints")
    return lut.to(torch.int32)


_U8_LUT = _u8_lookup()
_U8_CACHE: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _u8_tables(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, midpoints + [inf], first-candidate lookup) on ``device``.

    ``searchsorted(mids, v)`` is the nearest table entry, but a binary search is slow on CPU.
    The top 16 bits of an fp32 (sign, exponent, 7 mantissa bits) cut the line into intervals of
    relative width 2**-7 (0.8 %), narrower than any relative gap of the table (≥ 1.4 %), so each
    interval holds at most one midpoint (checked at import): the entry is
    ``lut[key] + (mids[lut[key]] < v)``, with ``lut[key]`` the number of midpoints below the
    interval's smallest float. This equals ``searchsorted(mids, v)`` for every fp32 ``v``.
    """
    device = torch.device(device)
    cached = _U8_CACHE.get(device)
    if cached is None:
        mids_inf = torch.cat([_U8_MIDS64.float(), torch.tensor([float("inf")])])
        cached = (_U8_TABLE64.float().to(device), mids_inf.to(device), _U8_LUT.to(device))
        _U8_CACHE[device] = cached
    return cached


@register_codec
class U8bit(Codec):
    """8-bit quantization with Dettmers' dynamic tree table (Dettmers, 8-Bit Approximations for
    Parallelism in Deep Learning, ICLR'16; as GRACE's ``u8bit``).

    Each bucket of ``bucket_size`` values keeps its scale ``s = max|x|`` (fp32); each ``x / s``
    in [-1, 1] becomes the index of the nearest of 256 fixed values (ties to the lower one):
    0, +1.0 and, for each decimal exponent ``10**-z`` (z = 0..6), the ``2**(6-z)`` midpoints of
    equal steps of [0.1, 1], with both signs. The error is at most half the gap between the two
    table entries around ``x / s`` times ``s``: ≤ 0.0070 s near ±1 (−s itself decodes to
    −0.99297 s), ≤ 0.07 × 10**-z × s in decade z. Deterministic and biased, but the error is
    relative to the bucket's scale, so no error feedback by default.

    Options: ``bucket_size`` (default 1024, as ``maxmin``; 0 = the whole tensor shares one
    scale, as in GRACE). Wire: 1 byte (the table index) per element + one fp32 scale per bucket
    (8.03 bits/element with the default). Collectives: ``allgather`` (default) or ``sra``.
    Default memory: ``none``.

    Speed on CUDA: the scale (a maximum: one Triton pass of ``fused.row_maxima``, torch's ``abs``
    and ``amax`` in the figures below) and its reciprocal, then one Triton pass from values to
    codes (two table lookups per value), and one for decode. On an H200
    (``gradzip bench codecs --device cuda --numel 67108864``) encode ran at 34% of a device
    copy per call and 36% in a stream, decode at 79% and 130% (the torch version before the
    kernels: 8% / 21%).
    """

    name = "u8bit"
    family = "quantization"
    paper = "Dettmers, 8-Bit Approximations for Parallelism in Deep Learning, ICLR'16"
    collectives = ("allgather", "sra")
    default_memory = "none"
    options = {
        "bucket_size": Option(1024, int_in(0), "a non-negative integer (0 = whole tensor)", "values sharing one scale"),
    }

    TABLE = _U8_TABLE64.float()  # the 256 values, index = wire code

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return self._encode_into(x, meta, None)

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, numel), (torch.float32, _num_buckets(self.bucket_size, numel))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
        n = x.numel()
        _, mids, lut = _u8_tables(x.device)
        buckets = bucket_view(x.float(), _whole_or(self.bucket_size, n))
        scale = fused.row_maxima(buckets)  # (a piece at a time on the CPU)
        if out is not None:
            scale = out[1].copy_(scale)
        # a subnormal scale has no fp32 reciprocal: the largest fp32 keeps 0 · inv at 0, not NaN
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)).clamp_(max=_FLT_MAX)
        # then one pass (a Triton kernel on CUDA): scaled value, table lookups, index
        return [fused.u8bit_codes(buckets, inv, mids, lut, n, None if out is None else out[0]), scale]

    def _decode_to(
        self, tensors: List[torch.Tensor], meta: Meta, numel: int, out: Optional[torch.Tensor], accumulate: bool,
    ) -> torch.Tensor:
        codes, scale = tensors
        table, _, _ = _u8_tables(codes.device)
        return fused.table_decode(codes, table, scale, _whole_or(self.bucket_size, meta.numel), numel, out, accumulate)

    def fusion_block(self) -> int:
        return self.bucket_size  # 0 (one scale per tensor): not fusable

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """From the scales: a bucket's largest magnitude (torch's ``amax``, which keeps NaN, on
        every device) is NaN or infinite exactly where the bucket held NaN or ±inf (the codec
        works in fp32, so an fp64 value beyond its range is an inf, and flagged, as max-min's)."""
        return stats_nonfinite(payload, 1)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel + 4 * _num_buckets(self.bucket_size, numel)


# =========================================================================== INCEPTIONN
def _fp32(v: float) -> float:
    """``v`` rounded to fp32 (as a Python float), so comparisons in fp32 and fp64 agree."""
    return torch.tensor(float(v), dtype=torch.float32).item()


@register_codec
class Inceptionn(Codec):
    """INCEPTIONN error-bounded lossy encoding (Li et al., A Network-Centric Hardware/Algorithm
    Co-Design to Accelerate Distributed Training of Deep Neural Networks, MICRO'18).

    Every value gets a 2-bit tag choosing how it is stored, so that ``|decode - x| ≤ b`` with
    ``b = error_bound`` (absolute, as in the paper):

    - tag 0: ``|x| < b`` — nothing is stored, decodes to 0;
    - tag 1: 1 byte, sign + 7-bit ``m = round(|x| / 2b)`` (``m ≤ 127``: ``|x| ≲ 255 b``),
      decodes to ``±m · 2b`` — a fixed-point value on a grid of step 2b, so the error is ≤ b;
    - tag 2: 2 bytes, sign + 15-bit ``m`` on the same grid (``|x| ≲ 65535 b``);
    - tag 3: the raw value (4 bytes, or 2 for fp16/bf16 input), exact.

    The paper's 8/16-bit tags truncate mantissas of values in (-1, 1); gradzip uses the same
    four-tag layout with a fixed-point grid tied to the bound, and picks for each value the
    smallest tag whose decode (cast back to the input dtype) is within ``b`` — the encoder
    checks the decode itself, so the bound holds exactly for fp32, fp16 and bf16 input and
    non-finite values travel raw. float64 input is handled as fp32.

    Wire (data-dependent size, ``fixed_size = False``): the packed tags (2 bits/element), then
    one uint8 stream holding each element's 0/1/2/raw-width bytes in element order (the low
    bytes of an int32 word in native byte order, little-endian on every supported platform).
    Where that would exceed the raw values (mostly raw tags, or 16-bit input whose 2-bit tags
    cost more than the bytes they save), the payload is the dense form instead: an empty tag
    tensor and the stream holding every raw value (exact; in a 16-bit gradient's width where its
    fp32 compensation is encoded, :attr:`~gradzip.codecs.base.Meta.wire`), which the decoder
    recognises by the empty tags. ``wire_bytes`` is the upper bound ``4n`` (``2n`` for 16-bit input); on 1 M
    ``randn`` values (80 % in tag 2) a payload is about 16.4 bits/element, on gradient-sized
    values (``|x| ≲ b``) a few bits. Sizing the stream is the encoder's one implicit device →
    host wait (``nonzero``), inherent to a data-dependent size; decoding has none.

    Options: ``error_bound`` (default ``2**-10``, the tightest bound the paper evaluates without
    accuracy loss; a float in [1e-30, 1e30], used rounded to fp32). Collectives: ``allgather``
    only (SRA needs fixed-size payloads). Default memory: ``residual`` — values under the bound
    are dropped every step, so without error feedback a weight whose gradient stays below
    ``b`` would never move; with it, they accumulate until they are sent.

    Speed on CUDA: Triton kernels (``gradzip/kernels/gpu.py``), the torch version's bytes: the
    encode is one pass for the tags and each block's byte count, a prefix sum and one pass
    writing every value's bytes at its place (the stream's length read on the host between
    them), the decode one pass counting each block's bytes from the tags, a prefix sum and one
    decoding pass. Not yet measured on a GPU; the chain of element-wise torch operations they
    replace reached 2% (encode) and 3% (decode) of a device copy on an H200 (``gradzip bench
    codecs --device cuda --numel 67108864``, each call's host work included).
    """

    name = "inceptionn"
    family = "quantization"
    paper = (
        "Li et al., A Network-Centric Hardware/Algorithm Co-Design to Accelerate Distributed Training "
        "of Deep Neural Networks (INCEPTIONN), MICRO'18"
    )
    collectives = ("allgather",)
    default_memory = "residual"
    fixed_size = False
    raw_fallback = False  # a dense form of its own (see the docstring)
    options = {
        "error_bound": Option(2.0**-10, float_in(1e-30, 1e30), "a float in [1e-30, 1e30]", "absolute error bound"),
    }

    records_fusion = False  # fused later: its older checkpoints hold no ``fusion``

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._b = _fp32(self.error_bound)
        self._step = _fp32(2 * self._b)  # the fixed-point grid of tags 1 and 2

    @staticmethod
    def _raw_bytes(dtype: torch.dtype) -> int:
        return 2 if dtype in SHORT_FLOATS else 4

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        # (on CUDA the Triton kernels; on the CPU the torch version a piece at a time: the same bytes)
        x = x.reshape(-1)
        n, width = x.numel(), self._raw_bytes(meta.as_is)
        packed, stream = fused.inceptionn_encode(x, self._b, self._step)
        if packed.numel() + stream.numel() > n * width:
            # the dense form: no tags, every raw value (exact; recognised by the empty tags), in
            # the gradient's width where the input is its wider compensation (Meta.wire)
            dense = saturate(x, meta.wire) if meta.wire is not None else x if x.dtype in SHORT_FLOATS else x.float()
            return [packed.new_empty(0), dense.contiguous().view(torch.uint8)]
        return [packed, stream]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return self._decode_pieces(tensors, meta, torch.empty(meta.numel, dtype=torch.float32,
                                                              device=tensors[1].device), False)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor,
                     accumulate: bool) -> torch.Tensor:
        # straight into ``out``: no temporary of the tensor's size
        if out.is_contiguous() and out.dtype == torch.float32 and out.numel() == meta.numel:
            self._decode_pieces(tensors, meta, out.view(-1), accumulate)
            return out
        return super()._decode_into(tensors, meta, out, accumulate)

    def _decode_pieces(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor,
                       accumulate: bool) -> torch.Tensor:
        """Decode into the flat fp32 ``out`` (added to it where ``accumulate``): each value from
        its tag and its bytes (:func:`fused.inceptionn_decode <gradzip.kernels.fused.inceptionn_decode>`)."""
        packed, stream = tensors
        if packed.numel() == 0:  # the dense form
            values = stream.view(meta.as_is if meta.as_is in SHORT_FLOATS else torch.float32).float()
            return out.add_(values) if accumulate else out.copy_(values)
        return fused.inceptionn_decode(packed, stream, meta.dtype, meta.numel, self._step, out, accumulate)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * self._raw_bytes(dtype)  # the dense form whenever the tagged one is larger

    def fusion_block(self) -> int:
        """A value's tag and bytes depend on the value alone (the bound is every rank's option): a
        gradient that starts on a whole byte of tags (4 values) is sent as alone, so a group is
        one encode, one all-gather and one decode. One payload for the group takes the dense
        form or not as a whole: a member that alone would have gone dense (exact) may be
        tagged in its group (within the bound), and the other way round."""
        return 4


# ================================================================================== TBQ
@register_codec
class TBQ(Codec):
    """Threshold binary quantization, TBQ (Strom, Scalable Distributed DNN Training Using
    Commodity GPU Cloud Computing, Interspeech'15; as in HiPress, Bai et al., SOSP'21).

    With threshold ``τ``, each value becomes ``+τ`` if ``x > τ``, ``−τ`` if ``x < −τ`` and 0
    otherwise; what is not sent stays in the error-feedback residual (default memory
    ``residual``, as in Strom's scheme: without it TBQ is heavily biased).

    The encode is one elementwise map and a pack, deterministic and bit-exact, so a generated
    (CompLL) kernel can be checked against it: ``τ`` is rounded to fp32 once, the comparisons are
    made in fp32 (16-bit input is first widened exactly), ``code = (x > τ) | (x < −τ) << 1``,
    and the codes are packed four to a byte, element ``i`` in bits ``2(i mod 4)`` of byte
    ``i // 4`` (``pack_bits``). Decode maps codes 0/1/2 to 0/+τ/−τ.

    Options: ``threshold`` (default 0.01, a float in [1e-30, 1e30]). ``τ`` is the most an element
    can move per step; the residual keeps the rest, so ``τ`` should sit at or above the typical
    per-element gradient (about 1e-4 to 1e-2 in common networks): below that the residual
    keeps growing, far above it elements are sent only every many steps. (MXNet's 2-bit
    gradient compression, the same scheme, defaults to 0.5.) Tune it per model.
    Wire: exactly 2 bits per element (no header; ``τ`` is an option every rank shares).
    Collectives: ``allgather`` only: in SRA the averaged chunk, whose values lie in [−τ, τ],
    would be quantized again against the same ``τ`` and come back as all zeros.

    Speed on CUDA: one Triton pass each way (the kernels TernGrad's codes use). On an H200
    (``gradzip bench codecs --device cuda --numel 67108864``) encode ran at 101% of a device
    copy per call and 173% in a stream (it writes 2 bits a value), decode at 94% and 145% (the
    torch version before the kernels: 17% / 14%; its CompLL twin ``cl_tbq``: 71% / 28%).
    """

    name = "tbq"
    reencodable = False  # an average of ±τ/0 values lies in [−τ, τ]: re-encoded it is all zeros
    family = "quantization"
    paper = (
        "Strom, Scalable Distributed DNN Training Using Commodity GPU Cloud Computing, Interspeech'15; "
        "Bai et al., Gradient Compression Supercharged High-Performance Data Parallel DNN Training (HiPress), SOSP'21"
    )
    collectives = ("allgather",)
    default_memory = "residual"
    records_fusion = False  # fused later: its older checkpoints hold no ``fusion``
    options = {
        "threshold": Option(0.01, float_in(1e-30, 1e30), "a float in [1e-30, 1e30]", "the threshold τ"),
    }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._tau = _fp32(self.threshold)
        self._taus: Dict[torch.device, torch.Tensor] = {}

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return self._encode_into(x, meta, None)

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, packed_bytes(numel, 2))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
        return [fused.tbq_encode(x.reshape(-1), self._tau, None if out is None else out[0])]

    def _decode_to(
        self, tensors: List[torch.Tensor], meta: Meta, numel: int, out: Optional[torch.Tensor], accumulate: bool,
    ) -> torch.Tensor:
        return fused.ternary_decode(tensors[0], self._tau_tensor(tensors[0].device), meta.numel, numel, out, accumulate)

    def _tau_tensor(self, device: torch.device) -> torch.Tensor:
        """``τ`` as a one-element fp32 tensor on ``device`` (made once per device)."""
        t = self._taus.get(device)
        if t is None:
            t = self._taus[device] = torch.tensor([self._tau], dtype=torch.float32, device=device)
        return t

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return packed_bytes(numel, 2)

    def fusion_block(self) -> int:
        """A value's code depends on the value alone (``τ`` is every rank's option): a gradient
        that starts on a whole byte of codes (4 values) is sent exactly as alone, so a group is
        one encode, one all-gather and one decode, and a DDP bucket may be averaged in place."""
        return 4
