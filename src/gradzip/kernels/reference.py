"""The hot codec kernels written in plain torch: the specification of their wire formats.

Max-min (CGX), QSGD, sign packing, the FP8 / microscaling (MX) casts and the element-wise
steps of TernGrad, TBQ, 1-bit SGD, natural compression and 8-bit quantization are where
encode/decode time goes, so each has faster versions (:mod:`.native` for CPU, :mod:`.gpu` in
Triton) that must produce the same bytes. These functions define what "the same" means and
run wherever no faster version does. Inputs are flat contiguous tensors of a floating dtype;
``key`` is a 32-bit key for :func:`~.rng.counter_uniform` (stochastic rounding), or ``None``
for round-to-nearest.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .bitpack import pack_bits, unpack_bits
from .buckets import bucket_view
from .rng import counter_uniform

FLT_MAX = torch.finfo(torch.float32).max


def store(values: torch.Tensor, out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    """The decoders' ``out``/``accumulate`` contract: ``values``, or ``out`` holding them (added
    to what it held when ``accumulate``); ``out`` may have another dtype or shape of the same size."""
    if out is None:
        return values
    values = values.reshape(out.shape)
    if not accumulate and values.data_ptr() == out.data_ptr() and values.dtype == out.dtype and values.stride() == out.stride():
        return out  # decoded in place already (an identity codec's payload is the destination)
    return out.add_(values) if accumulate else out.copy_(values)


def divide(a: torch.Tensor, b: float) -> torch.Tensor:
    """``a / b`` rounded once (IEEE division) on every device. On CUDA, torch divides by a
    Python number as ``a * (1 / b)`` (two roundings, so the last bit may differ from the CPU's
    and the Triton kernels' ``div_rn``); dividing by a 0-dim tensor on ``a``'s device is a true
    division everywhere."""
    return a / torch.full((), b, dtype=a.dtype, device=a.device)


def saturate(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` cast to ``dtype``, finite values beyond its range clamped to its largest finite value.

    A decoded value may land just beyond the range of a 16-bit input dtype (QSGD's levels, natural
    compression's power of two above 2**15, bf16 rounding of a value near 65504): cast as it is,
    finite input would come back as ±inf. NaN and ±inf stay as they are.
    """
    if y.dtype == dtype:
        return y
    if not (dtype.is_floating_point and y.dtype.is_floating_point) or torch.finfo(y.dtype).max <= torch.finfo(dtype).max:
        return y.to(dtype)
    if y.dtype not in (torch.float32, torch.float64):
        y = y.float()  # the bound itself must be exact: 65504 is not a bf16 value
    big = torch.finfo(dtype).max
    return torch.where(torch.isinf(y), y, y.clamp(-big, big)).to(dtype)


def _round(v: torch.Tensor, key: Optional[int], numel: int) -> torch.Tensor:
    """Round the bucketed ``v`` to integers: up with probability frac(v) when keyed, else nearest.

    The noise of value ``i`` is ``counter_uniform(i, key)``; bucket padding gets none.
    """
    if key is None:
        return v.round()
    noise = counter_uniform(numel, key, v.device)
    flat = v.reshape(-1)
    flat[:numel] += noise
    return flat.floor_().view_as(v)


def maxmin_encode(x: torch.Tensor, bits: int, bucket: int, key: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed ``bits``-bit levels and per-bucket ``[min, scale]`` (fp32) of the flat ``x``.

    ``scale = (max - min) / (2**bits - 1)``; level ``floor((x - min) / scale + u)`` (``u`` from
    the key) or ``round((x - min) / scale)``, clamped to ``0 .. 2**bits - 1``.

    A finite bucket whose range ``max - min`` exceeds fp32 (values near ±3.4e38 of both signs)
    works on halves, which cannot overflow: ``scale = max / q - min / q`` (at most the largest
    fp32, which with ``bits=1`` is below the range: the top level then decodes low) and
    ``v = (x / 2 - min / 2) · (2 / scale)``.
    """
    buckets = bucket_view(x.float(), bucket)
    lo, hi = torch.aminmax(buckets, dim=1)
    q = (1 << bits) - 1
    span = hi - lo
    big = torch.isinf(span) & torch.isfinite(lo) & torch.isfinite(hi)
    scale = torch.where(big, (divide(hi, q) - divide(lo, q)).clamp_(max=FLT_MAX), divide(span, q))
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    v = torch.where(
        big[:, None],
        (buckets * 0.5 - (lo * 0.5)[:, None]) * (inv * 2)[:, None],
        (buckets - lo[:, None]) * inv[:, None],
    )
    levels = _round(v, key, x.numel()).clamp_(0, q).to(torch.uint8).reshape(-1)[: x.numel()]
    return pack_bits(levels, bits), torch.stack([lo, scale], dim=1).reshape(-1)


def maxmin_decode(
    packed: torch.Tensor, stats: torch.Tensor, bits: int, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``min + level * scale`` for the first ``numel`` values, into ``out`` if given.

    Where that overflows with finite ``min`` and ``scale`` (a range beyond fp32), the value is
    ``2 · (min / 2 + level · (scale / 2))`` clamped to the fp32 range instead.
    """
    levels = bucket_view(unpack_bits(packed, bits, numel).float(), bucket)
    stats = stats.view(-1, 2)[: levels.shape[0]]
    lo, scale = stats[:, :1], stats[:, 1:]
    val = lo + levels * scale
    halves = (2 * (lo * 0.5 + levels * (scale * 0.5))).clamp_(-FLT_MAX, FLT_MAX)
    val = torch.where(torch.isinf(val) & torch.isfinite(lo) & torch.isfinite(scale), halves, val)
    return store(val.reshape(-1)[:numel], out, accumulate)


def qsgd_encode(x: torch.Tensor, bits: int, bucket: int, key: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed codes ``level | negative << (bits-1)`` and per-bucket L2 norms (fp32).

    ``level = floor(|x| · s / norm + u)`` clamped to ``0 .. s``, ``s = 2**(bits-1) - 1``.
    The norm is summed in fp64 (squares of fp32 values neither overflow nor underflow there) and
    rounded once; a finite norm beyond fp32 is stored as the largest fp32 (its bucket's values
    are then clamped to it), and ``s / norm`` is capped at the largest fp32 (subnormal norms).
    """
    s = (1 << (bits - 1)) - 1
    buckets = bucket_view(x.float(), bucket)
    if buckets.numel() != x.numel():  # the pad (a fresh copy) repeats a value: zero it for the norm
        buckets.view(-1)[x.numel():] = 0
    norms64 = torch.linalg.vector_norm(buckets, dim=1, dtype=torch.float64)
    norms = torch.where(torch.isinf(norms64), norms64, norms64.clamp(max=FLT_MAX)).float()
    inv = torch.where(norms > 0, s / norms, torch.zeros_like(norms)).clamp_(max=FLT_MAX)
    v = buckets.abs() * inv[:, None]
    levels = _round(v, key, x.numel()).clamp_(0, s).to(torch.uint8)
    signs = (buckets < 0).to(torch.uint8) << (bits - 1)
    return pack_bits((levels | signs).reshape(-1)[: x.numel()], bits), norms


def qsgd_decode(
    packed: torch.Tensor, norms: torch.Tensor, bits: int, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``±level · (norm / s)`` for the first ``numel`` values, into ``out`` if given;
    clamped to the fp32 range where the norm is finite (``s · (norm / s)`` may round above it)."""
    s = (1 << (bits - 1)) - 1
    codes = unpack_bits(packed, bits, numel)
    levels = (codes & s).float()
    signs = 1.0 - 2.0 * (codes >> (bits - 1)).float()
    vals = bucket_view(levels * signs, bucket)
    norms = norms[: vals.shape[0]]
    vals = vals * divide(norms, s)[:, None]
    vals = torch.where(torch.isfinite(norms)[:, None], vals.clamp(-FLT_MAX, FLT_MAX), vals)
    return store(vals.reshape(-1)[:numel], out, accumulate)


def sign_encode(x: torch.Tensor) -> torch.Tensor:
    """One bit per value, set where ``x >= 0`` (NaN counts as negative)."""
    return pack_bits((x >= 0).to(torch.uint8), 1)


def sign_decode(
    packed: torch.Tensor, numel: int, scale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``±1`` per bit (times the one-element ``scale`` when given), into ``out`` if given."""
    signs = unpack_bits(packed, 1, numel).float().mul_(2).sub_(1)
    return store(signs if scale is None else signs.mul_(scale), out, accumulate)


def terngrad_encode(buckets: torch.Tensor, rand: torch.Tensor, numel: int, scale: Optional[torch.Tensor] = None,
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """TernGrad's 2-bit codes of the first ``numel`` values of ``buckets`` (fp32, ``(B, bucket)``)
    and the per-bucket scales ``max |x|`` (or the given ``scale``, one a bucket, at least its
    ``max |x|``): ``+1`` (code 1) or ``−1`` (code 2) where ``rand < |x| / scale`` of the value's
    bucket, else 0; ``|x| / scale`` is NaN in an all-zero bucket, so no value there is kept."""
    mags = buckets.abs()
    if scale is None:
        scale = mags.amax(dim=1)
    keep = rand < mags / scale[:, None]
    neg = buckets < 0
    codes = (keep & ~neg).to(torch.uint8) | ((keep & neg).to(torch.uint8) << 1)
    return pack_bits(codes.reshape(-1)[:numel], 2), scale


def tbq_encode(x: torch.Tensor, tau: float) -> torch.Tensor:
    """TBQ's 2-bit codes: ``(x > tau) | (x < −tau) << 1``, compared in fp32 (``tau`` an fp32 value)."""
    xf = x.float()
    return pack_bits((xf > tau).to(torch.uint8) | ((xf < -tau).to(torch.uint8) << 1), 2)


def ternary_decode(
    packed: torch.Tensor, scale: torch.Tensor, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``{0, +1, −1}`` per 2-bit code (0, 1, 2; 3 is 0) times its bucket's ``scale``, into
    ``out`` if given: TernGrad's and TBQ's decode."""
    codes = unpack_bits(packed, 2, numel)
    vals = bucket_view(((codes & 1).to(torch.int8) - (codes >> 1).to(torch.int8)).float(), bucket)
    return store((vals * scale[: vals.shape[0], None]).reshape(-1)[:numel], out, accumulate)


def natural_draws(uniform: torch.Tensor) -> torch.Tensor:
    """Natural compression's int32 draws in ``[0, 2**23)`` from ``counter_uniform`` draws: their
    top 23 bits (``u · 2**23`` is exact, its floor an integer)."""
    return uniform.mul(1 << 23).to(torch.int32)


def natural_codes(bits: torch.Tensor, rand: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Natural compression's byte per value (``Natural._encode``): ``bits`` the fp32 values' bits
    (int32), ``rand`` draws in [0, 2**23), ``top`` the header exponent (one, or one a value).
    Code ``c`` in 1..127 means exponent field ``top − 127 + c``; the sign in bit 7. A NaN is
    coded as an infinity."""
    mag = (bits & 0x7FFFFFFF).clamp(max=0x7F800000)  # the magnitude's bits, NaN as inf
    first = top - 126  # biased exponent of code 1
    rounded = (mag + rand) >> 23  # exponent field after stochastic rounding, 0 (zero) .. 255
    code_in = torch.where(rounded > 0, rounded - (first - 1), 0)
    # below 2**(first-127): that power with probability |x| / 2**(first-127), else 0
    scale = ((254 - first).clamp(1, 254) << 23).view(torch.float32)  # 2**(127-first)
    prob = mag.view(torch.float32) * scale
    code_under = (rand.float() * (1.0 / (1 << 23)) < prob).to(torch.int32)
    code = torch.where((mag >> 23) >= first, code_in, code_under)
    sign = ((bits < 0) & (code > 0)).to(torch.int32) << 7
    return (code | sign).to(torch.uint8)


def natural_decode(
    codes: torch.Tensor, top: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 values of natural compression's bytes under the header exponent ``top`` (int32, one
    or one a value), into ``out`` if given: ``±2**(top − 254 + c)`` for code ``c`` in 1..127 (the
    exponent field clamped to 0..255; a finite header's 2**128 is the largest fp32, as
    ``Natural._decode_to``'s table has it), 0 for code 0."""
    c = codes.reshape(-1)[:numel].to(torch.int32)
    code = c & 127
    field = (code + (top - 127)).clamp(0, 255) << 23
    field = torch.minimum(field, torch.where(top <= 255, 0x7F7FFFFF, 0x7F800000).to(torch.int32))
    bits = torch.where(code > 0, field, 0) | ((c >> 7) << 31)
    return store(bits.view(torch.float32), out, accumulate)


def u8bit_codes(
    buckets: torch.Tensor, inv: torch.Tensor, mids: torch.Tensor, lut: torch.Tensor, numel: int,
) -> torch.Tensor:
    """8-bit codes (``U8bit._encode``): ``v = x · inv`` of the value's bucket, then the nearest
    table entry ``lut[key] + (mids[lut[key]] < v)``, ``key`` the top 16 bits of ``v``'s fp32."""
    v = (buckets * inv[:, None]).reshape(-1)[:numel].contiguous()
    key = (v.view(torch.int32) >> 16) & 0xFFFF
    first = torch.index_select(lut, 0, key)
    return (first + (torch.index_select(mids, 0, first) < v).to(torch.int32)).to(torch.uint8)


def table_decode(
    codes: torch.Tensor, table: torch.Tensor, scale: Optional[torch.Tensor], bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """``table[code] × scale`` of the value's bucket (fp32), into ``out`` if given; without a
    ``scale`` (natural compression's power-of-two table), ``table[code]``."""
    vals = torch.index_select(table, 0, codes.reshape(-1)[:numel].to(torch.int32))
    if scale is not None:
        vals = bucket_view(vals, bucket)
        vals = (vals * scale[: vals.shape[0], None]).reshape(-1)[:numel]
    return store(vals, out, accumulate)


def onebit_decode(
    packed: torch.Tensor, means: torch.Tensor, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """1-bit SGD's decode: per value ``bit · mean_pos + (1 − bit) · mean_neg`` of its bucket
    (``means``: fp32 ``[mean_neg, mean_pos]`` per bucket), into ``out`` if given."""
    bit = unpack_bits(packed, 1, numel).float()
    pad = -numel % bucket
    bit = (torch.nn.functional.pad(bit, (0, pad)) if pad else bit).view(-1, bucket)
    means = means.view(-1, 2)[: bit.shape[0]]  # the buckets of the first ``numel`` values
    # with bit in {0, 1} exactly one of the two means (NaN where the other one is not finite)
    values = bit * means[:, 1:2] + (1 - bit) * means[:, 0:1]
    return store(values.reshape(-1)[:numel], out, accumulate)


# ============================================================== FP8 and microscaling (MX)
# Element formats: (torch dtype or None, largest finite magnitude, exponent bias, mantissa bits).
# e4m3 is the "fn" variant (no infinities, NaN at 0x7F/0xFF); e5m2 is IEEE-like (inf at 0x7C);
# e2m1 (FP4) has the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and no special values.
FLOAT_ELEMENTS = {
    "e4m3": (torch.float8_e4m3fn, 448.0, 7, 3),
    "e5m2": (torch.float8_e5m2, 57344.0, 15, 2),
    "e2m1": (None, 6.0, 1, 1),
}
MX_EMAX = {"e4m3": 8, "e2m1": 2}  # exponent of the element format's largest power of two
FLT_MIN = torch.finfo(torch.float32).tiny  # 2**-126: the fp8 codec's smallest block scale
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign in bit 3) of ``v`` with ``|v| <= 6``, rounded to nearest, ties to even.

    The codes 0..7 are the magnitudes in increasing order, and an even code has an even mantissa
    bit, so a tie goes to the even code: 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2,
    3.5 → 4, 5 → 4. (NaN gives an unspecified code.)
    """
    a = v.abs()
    code = (a > 0.25).to(torch.uint8)
    for bound, strict in ((0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True)):
        code += (a > bound) if strict else (a >= bound)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def element_codes(v: torch.Tensor, elem: str) -> torch.Tensor:
    """Codes (uint8) of the fp32 ``v``, already within ``±max`` of ``elem``: round to nearest even."""
    dtype = FLOAT_ELEMENTS[elem][0]
    if dtype is None:
        return _e2m1_codes(v)
    return v.to(dtype).view(torch.uint8)


def element_values(elem: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 value of every code of ``elem`` (256 for fp8, 16 for e2m1), NaN and ±inf included."""
    dtype = FLOAT_ELEMENTS[elem][0]
    if dtype is None:
        mags = torch.tensor(_E2M1_VALUES, dtype=torch.float32)
        return torch.cat([mags, -mags]).to(device)
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().to(device)


def element_decode(codes: torch.Tensor, elem: str) -> torch.Tensor:
    """fp32 values of the uint8 ``codes`` (one code per byte): :func:`element_values` per code."""
    dtype = FLOAT_ELEMENTS[elem][0]
    if dtype is not None:
        return codes.view(dtype).float()
    return torch.index_select(element_values(elem, codes.device), 0, codes.to(torch.int32))


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, value ``i`` in the low nibble when ``i`` is even: ``ceil(n / 2)`` bytes."""
    return pack_bits(codes, 4)[: (codes.numel() + 1) // 2]


def fp8_encode(x: torch.Tensor, fmt: str, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes (one byte per value) and per-block fp32 scales of the flat ``x``.

    A block's scale is ``s = max(amax / M, 2**-126)`` (``amax`` its largest ``|x|``, ``M`` the
    format's largest finite value: 448 for e4m3, 57344 for e5m2), so its largest value maps to
    ``M``; the floor keeps ``1 / s`` finite (an all-zero block gets ``2**-126``, and every code 0).
    A value's code is ``x · (1 / s)`` clamped to ``±M`` and cast to the format, rounding to
    nearest even (fp32 arithmetic, ``1 / s`` rounded once).
    """
    _, fmax, _, _ = FLOAT_ELEMENTS[fmt]
    n = x.numel()
    buckets = bucket_view(x.float(), block)
    amax = buckets.abs().amax(dim=1)
    scale = divide(amax, fmax).clamp_(min=FLT_MIN)
    inv = torch.reciprocal(scale)
    v = (buckets * inv[:, None]).clamp_(-fmax, fmax)
    return element_codes(v, fmt).reshape(-1)[:n], scale


def fp8_decode(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``value(code) · s`` for the first ``numel`` values (into ``out`` if given); clamped to
    the fp32 range where ``s`` is finite (``M · s`` may round just above a block's ``amax``)."""
    vals = bucket_view(element_decode(codes.reshape(-1)[:numel], fmt), block)
    s = scales[: vals.shape[0], None]
    vals = vals * s
    vals = torch.where(torch.isfinite(s), vals.clamp(-FLT_MAX, FLT_MAX), vals)
    return store(vals.reshape(-1)[:numel], out, accumulate)


def mx_scale_codes(amax: torch.Tensor, elem: str) -> torch.Tensor:
    """E8M0 shared-scale codes (int32) of blocks whose largest ``|x|`` is ``amax`` (OCP MX v1.0).

    The shared exponent is ``floor(log2(amax)) - emax`` (emax 8 for e4m3, 2 for e2m1), stored with
    bias 127 and clamped to 0..254; ``floor(log2(amax))`` is read off the fp32 exponent field, so a
    zero or subnormal ``amax`` counts as 2**-127 (code 0). A NaN or infinite ``amax`` gives 255,
    E8M0's NaN.
    """
    field = (amax.view(torch.int32) >> 23) & 0xFF
    code = (field - MX_EMAX[elem]).clamp_(0, 254)
    return torch.where(field == 255, 255, code)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**e`` for integer ``e`` in -127..127 (``2**-127`` is subnormal), built from bits."""
    normal = ((exponent + 127).clamp(min=1) << 23).to(torch.int32).view(torch.float32)
    return torch.where(exponent < -126, torch.full_like(normal, 2.0**-127), normal)


def mx_scales(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 codes: ``2**(code - 127)``; 255 is NaN."""
    c = codes.to(torch.int32)
    return torch.where(c == 255, torch.full(c.shape, float("nan"), device=c.device), _pow2(c - 127))


def mx_encode(x: torch.Tensor, elem: str, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX element codes and E8M0 scale codes (uint8) of the flat ``x`` (OCP MX v1.0).

    Elements are ``x / 2**shared`` (an exact power-of-two scaling) clamped to the element
    format's largest magnitude (448 or 6) and rounded to nearest even: e4m3 one per byte, e2m1
    two per byte (value ``i`` in the low nibble when ``i`` is even), ``ceil(n / 2)`` bytes.
    """
    _, emax_val, _, _ = FLOAT_ELEMENTS[elem]
    n = x.numel()
    buckets = bucket_view(x.float(), block)
    scode = mx_scale_codes(buckets.abs().amax(dim=1), elem)
    mult = torch.where(scode == 255, torch.ones((), device=x.device), _pow2(127 - scode.clamp(max=254)))
    v = (buckets * mult[:, None]).clamp_(-emax_val, emax_val)
    codes = element_codes(v, elem).reshape(-1)[:n]
    if elem == "e2m1":
        codes = _pack_nibbles(codes)
    return codes, scode.to(torch.uint8)


def mx_decode(
    codes: torch.Tensor, scales: torch.Tensor, elem: str, block: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``value(element) · 2**(scale - 127)`` for the first ``numel`` values, into ``out`` if
    given. Every product is exact: the elements are multiples of 2**-9 with at most 4 significant
    bits, so even a subnormal result loses nothing."""
    if elem == "e2m1":
        codes = unpack_bits(codes, 4, numel)
    vals = bucket_view(element_decode(codes.reshape(-1)[:numel], elem), block)
    vals = vals * mx_scales(scales[: vals.shape[0]])[:, None]
    return store(vals.reshape(-1)[:numel], out, accumulate)


def select_magnitudes(
    x: torch.Tensor, threshold: float = 0.0, thresholds: Optional[torch.Tensor] = None,
    valid: Optional[torch.Tensor] = None, span: int = 256,
) -> torch.Tensor:
    """The ascending int64 indices of the values of ``x`` whose magnitude in fp32 reaches
    ``threshold`` (an fp32 value), or with ``thresholds`` (fp32, one a block of ``span``
    values) their block's, among each block's first ``valid`` (int32, one a block) values: the
    sparsifiers' selection (NaN reaches no threshold), ``torch.nonzero`` of the comparison."""
    mag = x.reshape(-1).float().abs()
    if thresholds is None:
        return torch.nonzero(mag >= threshold).reshape(-1)
    n = mag.numel()
    pad = -n % span
    rows = (torch.cat([mag, mag.new_zeros(pad)]) if pad else mag).view(-1, span)
    columns = torch.arange(span, dtype=torch.int32, device=x.device)
    blocks = rows.shape[0]
    keep = (rows >= thresholds[:blocks].unsqueeze(1)) & (columns < valid[:blocks].unsqueeze(1))
    return torch.nonzero(keep.view(-1)[:n]).reshape(-1)


def sketch_keys(xf: torch.Tensor, key_bits: int, zero_key: int) -> torch.Tensor:
    """SketchML's keys of the fp32 ``xf``: int32 in ``[0, 2**key_bits)``, non-decreasing in the
    value (−0.0 just below +0.0, +0.0 at ``zero_key``); every NaN the last key, whatever its sign
    and payload bits (which a conversion to fp32 need not keep alike for a tensor and a piece)."""
    bits = xf.view(torch.int32)
    s = bits >> 31  # all ones for negative values
    s &= 0x7FFFFFFF
    s ^= bits  # negative values: magnitude bits flipped, so signed-int order is float order
    s >>= 32 - key_bits
    s += zero_key
    return s.masked_fill_(xf.isnan(), (1 << key_bits) - 1)


def sketch_cells(xf: torch.Tensor, key_bits: int, zero_key: int, hist: torch.Tensor, sums: torch.Tensor,
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """SketchML's sketch of the fp32 ``xf`` added into ``hist`` and ``sums`` (fp64, a cell each):
    each value's count and value at its key (``index_add_``, which on the CPU adds in index order)."""
    keys = sketch_keys(xf, key_bits, zero_key)
    hist.index_add_(0, keys, torch.ones(1, dtype=torch.float64, device=xf.device).expand(xf.numel()))
    sums.index_add_(0, keys, xf.double())
    return hist, sums


def sketch_codes(xf: torch.Tensor, key_bits: int, zero_key: int, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Each fp32 value's bucket ``codes[key]`` (uint8, one a cell), packed in ``bits`` bits."""
    return pack_bits(codes.index_select(0, sketch_keys(xf, key_bits, zero_key)), bits)


def adacomp_select(g: torch.Tensor, prev: Optional[torch.Tensor], size: int, doubled: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """AdaQ's selection (Chen et al.'s AdaComp) of the flat fp32 ``g`` in bins of ``size``
    values: the ascending int64 indices of the values whose ``h`` reaches their bin's ``max
    |g|`` (none in a bin that holds a NaN), never a zero, and each bin's count of them; ``h =
    |2g − prev|`` with the residual kept last step, else ``2|g|`` (``doubled``) or ``|g|``."""
    n = g.numel()
    bins = -(-n // size)
    pad = bins * size - n
    mag = torch.nn.functional.pad(g.abs(), (0, pad)).view(bins, size)  # zero padding is never sent
    if prev is not None:  # |G + dW| with dW = G - residual
        h = torch.nn.functional.pad((2 * g - prev).abs(), (0, pad)).view(bins, size)
    else:
        h = 2 * mag if doubled else mag  # no residual yet: dW = G
    sel = (h >= mag.amax(dim=1, keepdim=True)) & (mag > 0)  # the padding is never selected
    return torch.nonzero(sel.view(-1)).reshape(-1), sel.sum(dim=1)


SHORT_FLOATS = (torch.float16, torch.bfloat16)  # INCEPTIONN: inputs whose raw values take 2 bytes


@functools.lru_cache(maxsize=64)
def _inceptionn_tables(width: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INCEPTIONN lookups on ``device``: bytes per tag 0..3; int32 masks keeping the low 0..4
    bytes (by byte count); which of an int32's 4 bytes each tag keeps (4 x 4 bools)."""
    lengths = torch.tensor([0, 1, 2, width], dtype=torch.int32)
    masks = torch.tensor([0, 0xFF, 0xFFFF, 0, -1], dtype=torch.int32)
    keep = torch.arange(4) < lengths[:, None]
    return lengths.to(device), masks.to(device), keep.to(device)


def inceptionn_encode(x: torch.Tensor, bound: float, step: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """INCEPTIONN's packed 2-bit tags and byte stream (Li et al., MICRO'18; the wire format in
    :class:`~gradzip.codecs.quantize.Inceptionn`): each value's tag is the smallest whose decode
    (cast back to a 16-bit input's dtype) lies within ``bound`` of it (0: under the bound, nothing
    stored; 1 and 2: sign and 7 or 15 bits of ``m = floor(|x| / step + 0.5)``; 3: the raw value,
    as NaN and ±inf always are), and its 0/1/2/raw-width bytes follow in value order. ``bound``
    and ``step`` (2 · bound) are fp32 values; fp64 is handled as fp32."""
    x = x.reshape(-1)
    short = x.dtype in SHORT_FLOATS
    xf = x.float()
    mag = xf.abs()
    m = torch.floor(divide(mag, step) + 0.5)  # (an IEEE division on every device, as the kernels')
    approx = m * step
    if short:  # the decode is cast back: check what the caller will get
        approx = approx.to(x.dtype).float()
    ok = (approx - mag).abs() <= bound  # false for NaN/inf: they go raw
    # tag 3, minus one if 15 bits do, minus one more if 7 do; 0 under the bound
    tag = 3 - (ok & (m <= 32767)).to(torch.uint8) - (ok & (m <= 127)).to(torch.uint8)
    tag = tag * (~(mag < bound)).to(torch.uint8)  # (NaN is not below the bound: raw)
    sign_at = (tag.to(torch.int32) << 3) - 1  # tag 1 → bit 7, tag 2 → bit 15
    fixed = m.clamp(0, 32767).to(torch.int32) | ((xf < 0).to(torch.int32) << sign_at.clamp(min=0))
    raw = x.contiguous().view(torch.int16).to(torch.int32) if short else xf.contiguous().view(torch.int32)
    word = torch.where(tag == 3, raw, fixed)  # little-endian: its first 0/1/2/width bytes are sent
    keep = torch.index_select(_inceptionn_tables(2 if short else 4, x.device)[2], 0, tag.to(torch.int32))
    kept = keep.view(-1).nonzero().view(-1)  # the stream's length depends on the data
    return pack_bits(tag, 2), torch.index_select(word.view(torch.uint8), 0, kept)


def inceptionn_decode(
    packed: torch.Tensor, stream: torch.Tensor, dtype: torch.dtype, numel: int, step: float,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`inceptionn_encode`: the ``numel`` values in fp32 (into the flat fp32
    ``out``, added where ``accumulate``), each from its tag and its bytes of the stream."""
    values, _ = inceptionn_values(unpack_bits(packed, 2, numel), inceptionn_windows(stream, dtype), 0, dtype, step)
    return store(values, out, accumulate)


def inceptionn_windows(stream: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The raw width's bytes from every place of an INCEPTIONN stream (a view of it padded once
    with zeros, so reads past its end land in them): the windows :func:`inceptionn_values` reads."""
    width = 2 if dtype in SHORT_FLOATS else 4
    return torch.cat([stream.reshape(-1), stream.new_zeros(width)]).unfold(0, width, 1)


def inceptionn_values(
    tag: torch.Tensor, windows: torch.Tensor, offset, dtype: torch.dtype, step: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fp32 values of the tags ``tag`` (uint8), whose bytes start at ``offset`` (an int or a
    0-dim int32 tensor) of the stream ``windows`` were made of, and where the next value's bytes
    start (0-dim int32): a piece of a decode, the stream's place carried to the next."""
    width = windows.shape[1]
    lengths, masks, _ = _inceptionn_tables(width, tag.device)
    length = torch.index_select(lengths, 0, tag.to(torch.int32))
    ends = torch.cumsum(length, 0, dtype=torch.int32)
    start = ends - length + offset
    grabbed = torch.index_select(windows, 0, start)  # then the bytes beyond the value's length masked off
    n = tag.numel()
    if width == 2:
        word = grabbed.view(torch.int16).reshape(n).to(torch.int32) & 0xFFFF
        raw = grabbed.view(dtype).reshape(n).float()
    else:
        word = grabbed.view(torch.int32).reshape(n)
        raw = word.view(torch.float32)
    word = word & torch.index_select(masks, 0, length)
    sign_at = ((tag.to(torch.int32) << 3) - 1).clamp_(0, 15)
    val = (word & ((1 << sign_at) - 1)).float() * step  # tag 0: word 0 → 0
    val = torch.where(((word >> sign_at) & 1) == 1, -val, val)
    after = (ends[-1] + offset) if n else torch.zeros((), dtype=torch.int32, device=tag.device) + offset
    return torch.where(tag == 3, raw, val), after
