"""Fused GPU kernels (Triton) for the hot codecs: one pass over memory per encode and per decode.

On a GPU the torch versions in :mod:`.reference` launch a dozen element-wise kernels per call
(min, max, subtract, scale, noise, floor, clamp, cast, shift, or, ...), each a full round trip
through device memory, so encoding a gradient costs more than sending it on a fast link. Here one
Triton program handles whole buckets: it reads them once, reduces their statistics in registers,
quantises with the counter-based noise of :func:`~.rng.counter_uniform` (the hash is recomputed
per element, there is no generator state) and writes the packed bytes, the layout of
:func:`~.bitpack.pack_bits`. Decoding reads the packed bytes and writes (or adds into) the fp32
output in the same single pass. (Buckets above ``CHUNK`` values are read twice, the second time
mostly from cache: statistics first, then quantisation.) Max-min quantisation with per-bucket ``[min, scale]`` follows CGX
(Markov et al., "CGX: Adaptive System Support for Communication-Efficient Deep Learning",
Middleware'22); QSGD follows Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding", NeurIPS'17.

The public functions have the signatures of :mod:`.native` (the fused CPU kernels), plus
``out``/``accumulate`` on the decoders, so the codecs can pick a backend per tensor with
:func:`supports`. Triton is imported at first use, not when this module is imported: gradzip has
to import on machines without Triton, and Triton reads ``TRITON_INTERPRET`` when the kernels are
decorated, which therefore happens at first use too. With ``TRITON_INTERPRET=1`` the kernels run
in Triton's interpreter (numpy) on CPU tensors, which is how they are tested without a GPU.

Exactness. The encoders produce the bytes of the reference for max-min (both rounding modes)
and sign. Every division is an IEEE division (``div_rn``), round-half-to-even is done with the
exact ``(v + 2**23) - 2**23`` trick (``0 <= v < 2**23``), and the kernels are launched with
``enable_fp_fusion=False`` so the compiler never contracts ``a * b + c`` into an FMA (with the
default it does, in encode and decode alike). On GPU the results are then expected to match the
reference bit for bit as well: the PTX for sm_90 has only ``add/sub/mul.rn.f32``, ``div.rn.f32``,
``sqrt.rn.f64`` and ``cvt.rmi`` (floor; its flush-to-zero cannot matter as ``v + u >= 0``), each
a single correctly rounded IEEE operation. In the interpreter they are numpy's float32 operations.
The reference divides by 0-dim tensors on the input's device (:func:`.reference.divide`): PyTorch's
CUDA kernels turn a division by a Python number into a multiplication by its reciprocal, which
made the reference itself differ from the kernels (and from its own CPU results) in the last bit
of max-min scales, QSGD decode factors and fp8 scales.
QSGD norms are summed in float64 and rounded once, as in the reference and the C kernels (the
order of the sum differs, so the last bit may now and then); the levels use the reference's ``(1 / norm) * s`` (two
roundings, what torch's ``s / tensor`` computes), so given equal norms the codes are equal too.
The decoders compute exactly the reference's expressions (``lo + level * scale``,
``(level * sign) * (norm / s)``, ``±1 * scale``) and are bit-identical given the same payload.
Non-finite inputs (NaN, ±inf) give unspecified codes, as they do in the reference, and a bucket
whose minimum is a zero may store it as +0.0 where torch stores -0.0 (or the reverse). Finite
extremes follow the reference (``3.4028234663852886e38`` below is the largest fp32): a max-min
range beyond fp32 is handled in halves, a QSGD norm beyond it is stored as that maximum, and
decoded values of finite stats are clamped to the fp32 range.

Element-wise codecs (TernGrad, TBQ, 1-bit SGD, natural compression, 8-bit) keep in torch what
a kernel cannot reproduce bit for bit or must share with their CompLL twins (per-bucket sums
and maxima) and take the rest in one pass each way: codes from values and per-bucket scales
(TernGrad's and natural compression's draws made in the kernel from the counter hash, as
max-min's), values from codes and scales. Formats whose size is the data's (INCEPTIONN's byte
stream, the sparsifiers' selected indices) take two passes: each program's count, then, once
their prefix sums place every program's output (the total read on the host, as ``nonzero``
reads it), the bytes or indices written in order.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import threading
from typing import Any, Sequence

import torch

from .bitpack import packed_bytes
from .forms import decoded as _output
from .forms import header_shift as _shift_of
from .forms import headers as _headers
from .forms import outputs as _into

MAX_BUCKET = 65536  # larger buckets leave too few programs to keep a GPU busy: the torch version runs
CHUNK = 4096  # the most values of one bucket that a program holds at once (no register spills)
TILE = 1024  # values per program when buckets are small: several buckets share a program
TOPK_BLOCK = 4096  # values per program in the top-k passes
_SIGN_BLOCK = 4096  # values per program of the sign kernels
_WARPS = 8  # for the element-wise kernels' 4096-value blocks: 16 values per thread
_ROW_CHUNK = 1 << 16  # the most values of a row that one program of the row statistics reduces
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TOPK_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# bound at first use by _load(); the kernels below refer to them as globals, as Triton expects
triton: Any = None
tl: Any = None

_lock = threading.Lock()
_loaded = False
_interpreted = False  # whether the kernels were decorated for Triton's interpreter
_error: str | None = None
_interpreter_fault: str | None = None  # why Triton's interpreter cannot run the kernels here


# ------------------------------------------------------------------------------ device functions
# Plain functions here; _load() replaces each by its triton.jit version (same name) at first use.
#
# A program works on a tile of ROWS buckets by BLOCK values (BLOCK: the bucket rounded up to a
# power of two, at most CHUNK). Small buckets share a program, so a program always has about a
# thousand values to work on; a bucket larger than CHUNK has a program to itself, which walks it
# in CHUNK-sized pieces (statistics first, then quantisation: the second read of the bucket then
# comes from cache). Bucket starts are multiples of 8 values when bits < 8, so packing bucket by
# bucket gives the very bytes of packing the whole tensor at once: value i sits at bit i * bits.


def _uniform(idx, key):
    """``counter_uniform`` for the int64 indices ``idx``: MurmurHash3 fmix32 in uint32 arithmetic.

    The products wrap modulo 2**32 on purpose, so they are written without Triton's overflow
    check (which debug mode would otherwise turn into a failing assertion).
    """
    h = tl.add(tl.mul(idx.to(tl.uint32), 0x9E3779B1, sanitize_overflow=False), key, sanitize_overflow=False)
    h ^= h >> 16
    h = tl.mul(h, 0x85EBCA6B, sanitize_overflow=False)
    h ^= h >> 13
    h = tl.mul(h, 0xC2B2AE35, sanitize_overflow=False)
    h ^= h >> 16
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


def _tile(row, c, bucket, num_buckets, numel, BLOCK: tl.constexpr):
    """Offsets (int64) and validity of the ``[rows, BLOCK]`` tile at value ``c`` of each bucket."""
    local = c + tl.arange(0, BLOCK)
    offs = (row * bucket)[:, None] + local[None, :]
    valid = (row < num_buckets)[:, None] & (local < bucket)[None, :] & (offs < numel)
    return offs, valid


def _pack_store(
    packed_ptr, levels, row, c, bucket, num_buckets, numel,
    BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Store the levels (int32, zero where invalid) of the tile ``_tile(row, c, ...)`` as ``pack_bits`` does.

    Each group of 8 levels becomes a ``8 * BITS``-bit word whose first ``BITS`` bytes are written
    at byte ``first // 8 * BITS`` (``first``, the group's first value, is a multiple of 8 when
    ``BITS < 8``); widths 1, 2 and 4 have the same layout as the general case. A group is written
    when its first value is valid: the tail of the last group holds the zero levels of the padding.
    """
    if BITS == 8:
        offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
        tl.store(packed_ptr + offs, levels.to(tl.uint8), mask=valid)
    else:
        G: tl.constexpr = BLOCK // 8
        j = tl.arange(0, 8)
        groups = tl.reshape(levels.to(tl.int64), (ROWS, G, 8))
        word = tl.sum(groups << (j * BITS).to(tl.int64)[None, None, :], axis=2)
        data = (word[:, :, None] >> (j * 8).to(tl.int64)[None, None, :]) & 0xFF
        g8 = tl.arange(0, G) * 8
        first = (row * bucket + c)[:, None] + g8[None, :]
        group_valid = (row < num_buckets)[:, None] & (g8 < bucket - c)[None, :] & (first < numel)
        addr = (first // 8 * BITS)[:, :, None] + j[None, None, :]
        mask = group_valid[:, :, None] & (j < BITS)[None, None, :]
        tl.store(packed_ptr + addr, data.to(tl.uint8), mask=mask)


def _unpack_load(packed_ptr, offs, valid, BITS: tl.constexpr):
    """The ``BITS``-bit values at ``offs`` (int32): value ``i`` at bit ``i * BITS``, in two bytes at most."""
    if BITS == 8:
        return tl.load(packed_ptr + offs, mask=valid, other=0).to(tl.int32)
    bit = offs * BITS
    byte = bit >> 3
    shift = (bit & 7).to(tl.int32)
    b0 = tl.load(packed_ptr + byte, mask=valid, other=0).to(tl.int32)
    b1 = tl.load(packed_ptr + byte + 1, mask=valid & (shift + BITS > 8), other=0).to(tl.int32)
    return ((b0 | (b1 << 8)) >> shift) & ((1 << BITS) - 1)


def _maxmin_levels(x, lo, inv, big, offs, valid, key, BITS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Levels of a tile: ``floor(v + u)`` or ``rint(v)`` with ``v = (x - lo) * inv``, clamped;
    ``v = (x * 0.5 - lo * 0.5) * (inv * 2)`` in ``big`` rows (a range beyond fp32)."""
    Q: tl.constexpr = (1 << BITS) - 1
    v = tl.where(
        big[:, None],
        (x * 0.5 - (lo * 0.5)[:, None]) * (inv * 2.0)[:, None],
        (x - lo[:, None]) * inv[:, None],
    )
    if STOCHASTIC:
        f = tl.floor(v + _uniform(offs, key))
    else:
        # v >= 0: adding 2**23 leaves no fraction bits, so the IEEE addition rounds half to even
        f = (v + 8388608.0) - 8388608.0
    # a NaN (a bucket with NaN statistics) becomes level 0 on every device
    f = tl.minimum(tl.maximum(tl.where(f == f, f, 0.0), 0.0), Q * 1.0)
    return tl.where(valid, f.to(tl.int32), 0)


def _qsgd_codes(x, inv, offs, valid, key, BITS: tl.constexpr):
    """Codes of a tile: ``floor(|x| * inv + u)`` clamped to ``s``, sign in bit ``BITS - 1``."""
    S: tl.constexpr = (1 << (BITS - 1)) - 1
    f = tl.floor(tl.abs(x) * inv[:, None] + _uniform(offs, key))
    f = tl.minimum(tl.maximum(f, 0.0), S * 1.0)
    codes = f.to(tl.int32) | ((x < 0).to(tl.int32) << (BITS - 1))
    return tl.where(valid, codes, 0)


# ------------------------------------------------------------------------------------- kernels


def _maxmin_encode_kernel(
    x_ptr, packed_ptr, stats_ptr, numel, bucket, num_buckets, key,
    BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKED: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    """ROWS buckets: min/max, ``scale = (max - min) / q``, levels, packed bytes and stats.

    A bucket holding a NaN gets NaN statistics, as torch's min/max give (the GPU's own min/max
    skip NaN), and levels 0: the statistics then tell of every NaN and ±inf of the input, so
    the non-finite flag needs no pass of its own (``MaxMin.nonfinite``)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ukey = tl.cast(key, tl.uint32, bitcast=True)
    Q: tl.constexpr = (1 << BITS) - 1
    if CHUNKED:
        lo = tl.full((ROWS,), float("inf"), tl.float32)
        hi = tl.full((ROWS,), float("-inf"), tl.float32)
        nan = tl.zeros((ROWS,), tl.int32)
        for c in tl.range(0, bucket, BLOCK):
            offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
            x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, tl.min(tl.where(valid, x, float("inf")), axis=1))
            hi = tl.maximum(hi, tl.max(tl.where(valid, x, float("-inf")), axis=1))
            nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
    else:
        offs, valid = _tile(row, 0, bucket, num_buckets, numel, BLOCK)
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        lo = tl.min(tl.where(valid, x, float("inf")), axis=1)
        hi = tl.max(tl.where(valid, x, float("-inf")), axis=1)
        nan = tl.max((x != x).to(tl.int32), axis=1)
    # rows past the last bucket saw no value (min = inf): zero them so the padding stays finite
    row_ok = row < num_buckets
    lo = tl.where(row_ok, tl.where(nan > 0, float("nan"), lo), 0.0)
    hi = tl.where(row_ok, tl.where(nan > 0, float("nan"), hi), 0.0)
    span = hi - lo
    # a finite range beyond fp32 (both signs near the maximum): halves, as the reference
    big = (tl.abs(span) == float("inf")) & (tl.abs(lo) < float("inf")) & (tl.abs(hi) < float("inf"))
    halves = tl.minimum(tl.div_rn(hi, Q * 1.0) - tl.div_rn(lo, Q * 1.0), 3.4028234663852886e38)
    scale = tl.where(big, halves, tl.div_rn(span, Q * 1.0))
    inv = tl.where(scale > 0, tl.div_rn(1.0, tl.where(scale > 0, scale, 1.0)), 0.0)
    if CHUNKED:
        for c in tl.range(0, bucket, BLOCK):
            offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
            x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            levels = _maxmin_levels(x, lo, inv, big, offs, valid, ukey, BITS, STOCHASTIC)
            _pack_store(packed_ptr, levels, row, c, bucket, num_buckets, numel, BITS, ROWS, BLOCK)
    else:
        levels = _maxmin_levels(x, lo, inv, big, offs, valid, ukey, BITS, STOCHASTIC)
        _pack_store(packed_ptr, levels, row, 0, bucket, num_buckets, numel, BITS, ROWS, BLOCK)
    tl.store(stats_ptr + 2 * row, lo, mask=row_ok)
    tl.store(stats_ptr + 2 * row + 1, scale, mask=row_ok)


def _maxmin_decode_kernel(
    packed_ptr, stats_ptr, out_ptr, numel, bucket, num_buckets,
    BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """ROWS buckets: ``lo + level * scale`` (no FMA), stored or added into ``out``; where that
    overflows with finite stats, ``2 * (lo * 0.5 + level * (scale * 0.5))`` saturated."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < num_buckets
    lo = tl.load(stats_ptr + 2 * row, mask=row_ok, other=0.0)
    scale = tl.load(stats_ptr + 2 * row + 1, mask=row_ok, other=0.0)
    finite = (tl.abs(lo) < float("inf")) & (tl.abs(scale) < float("inf"))
    fmax = 3.4028234663852886e38
    for c in tl.range(0, bucket, BLOCK):
        offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
        level = _unpack_load(packed_ptr, offs, valid, BITS).to(tl.float32)
        val = lo[:, None] + level * scale[:, None]
        halves = 2.0 * ((lo * 0.5)[:, None] + level * (scale * 0.5)[:, None])
        halves = tl.where(halves > fmax, fmax, tl.where(halves < -fmax, -fmax, halves))
        val = tl.where((tl.abs(val) == float("inf")) & finite[:, None], halves, val)
        _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _qsgd_encode_kernel(
    x_ptr, packed_ptr, norms_ptr, numel, bucket, num_buckets, key,
    BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKED: tl.constexpr,
):
    """ROWS buckets: L2 norm (float64 sum), codes ``floor(|x| * s / norm + u) | sign << (BITS-1)``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ukey = tl.cast(key, tl.uint32, bitcast=True)
    S: tl.constexpr = (1 << (BITS - 1)) - 1
    if CHUNKED:
        total = tl.zeros((ROWS,), tl.float64)
        for c in tl.range(0, bucket, BLOCK):
            offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
            x64 = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32).to(tl.float64)
            total += tl.sum(x64 * x64, axis=1)
    else:
        offs, valid = _tile(row, 0, bucket, num_buckets, numel, BLOCK)
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        x64 = x.to(tl.float64)
        total = tl.sum(x64 * x64, axis=1)
    norm64 = tl.sqrt(total)
    # a finite norm beyond fp32 is stored as its maximum; s / norm is capped at it too
    norm64 = tl.where((norm64 > 3.4028234663852886e38) & (norm64 < float("inf")), 3.4028234663852886e38, norm64)
    norm = norm64.to(tl.float32)
    # torch's `s / norms` is `norms.reciprocal() * s`: two roundings, reproduced as such
    inv = tl.where(norm > 0, tl.div_rn(1.0, tl.where(norm > 0, norm, 1.0)) * (S * 1.0), 0.0)
    inv = tl.minimum(inv, 3.4028234663852886e38)
    if CHUNKED:
        for c in tl.range(0, bucket, BLOCK):
            offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
            x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            codes = _qsgd_codes(x, inv, offs, valid, ukey, BITS)
            _pack_store(packed_ptr, codes, row, c, bucket, num_buckets, numel, BITS, ROWS, BLOCK)
    else:
        codes = _qsgd_codes(x, inv, offs, valid, ukey, BITS)
        _pack_store(packed_ptr, codes, row, 0, bucket, num_buckets, numel, BITS, ROWS, BLOCK)
    tl.store(norms_ptr + row, norm, mask=row < num_buckets)


def _qsgd_decode_kernel(
    packed_ptr, norms_ptr, out_ptr, numel, bucket, num_buckets,
    BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """ROWS buckets: ``(level * sign) * (norm / s)``, stored or added into ``out``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    S: tl.constexpr = (1 << (BITS - 1)) - 1
    norm = tl.load(norms_ptr + row, mask=row < num_buckets, other=0.0)
    step = tl.div_rn(norm, S * 1.0)
    # s * (norm / s) may round above the largest fp32: clamp where the norm is finite
    top = tl.where(tl.abs(norm) < float("inf"), 3.4028234663852886e38, float("inf"))[:, None]
    for c in tl.range(0, bucket, BLOCK):
        offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
        codes = _unpack_load(packed_ptr, offs, valid, BITS)
        sign = 1.0 - 2.0 * (codes >> (BITS - 1)).to(tl.float32)
        val = ((codes & S).to(tl.float32) * sign) * step[:, None]
        val = tl.where(val > top, top, tl.where(val < -top, -top, val))
        _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _block_values(x_ptr, numel, BLOCK: tl.constexpr, TO_F32: tl.constexpr):
    """This program's ``BLOCK`` values: ``(program, offsets, valid, values)``, 16-bit ones
    converted (exactly) to fp32 when ``TO_F32``."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    if TO_F32:
        x = x.to(tl.float32)
    return pid, offs, valid, x


def _store_decoded(out_ptr, offs, val, valid, ACCUMULATE: tl.constexpr):
    """Every decoder's last step: ``val`` stored at ``offs`` of ``out``, or added to what is
    there (``out + val``, the reference's order)."""
    if ACCUMULATE:
        val = tl.load(out_ptr + offs, mask=valid, other=0.0) + val
    tl.store(out_ptr + offs, val, mask=valid)


def _sign_encode_kernel(x_ptr, packed_ptr, numel, BLOCK: tl.constexpr, TO_F32: tl.constexpr):
    """``BLOCK`` values to ``BLOCK / 8`` bytes, bit ``j`` of a byte set where value ``j >= 0``.

    Half-precision values are compared after an (exact) conversion to fp32, float64 ones as they
    are: narrowing them could turn a tiny negative into -0.0.
    """
    pid, offs, valid, x = _block_values(x_ptr, numel, BLOCK, TO_F32)
    _store_signs(packed_ptr, pid, x, valid, numel, BLOCK)


def _store_signs(packed_ptr, pid, x, valid, numel, BLOCK: tl.constexpr):
    """Program ``pid``'s ``BLOCK`` sign bits: bit ``j`` of a byte set where value ``j >= 0``."""
    bits = ((x >= 0) & valid).to(tl.int32)
    G: tl.constexpr = BLOCK // 8
    j = tl.arange(0, 8)
    data = tl.sum(tl.reshape(bits, (G, 8)) << j[None, :], axis=1)
    at = pid * G + tl.arange(0, G)
    tl.store(packed_ptr + at, data.to(tl.uint8), mask=at * 8 < numel)


def _signum_encode_kernel(g_ptr, m_ptr, finite_ptr, packed_ptr, numel, beta, alpha, BLOCK: tl.constexpr):
    """Signum's step: each momentum ``m <- fma(alpha, g, m * beta)`` (torch's mul, then its add
    with alpha, which rounds once), stored where the 0-dim flag says the step is finite (read
    on the device), and one bit a value set where the new momentum ``>= 0``, packed as the sign
    kernel packs them."""
    pid, offs, valid, g = _block_values(g_ptr, numel, BLOCK, False)
    m = tl.load(m_ptr + offs, mask=valid, other=0.0)
    v = tl.fma(alpha, g, m * beta)
    keep = tl.load(finite_ptr).to(tl.int32) != 0
    tl.store(m_ptr + offs, tl.where(keep, v, m), mask=valid)
    _store_signs(packed_ptr, pid, v, valid, numel, BLOCK)


def _uniform_kernel(out_ptr, start, numel, key, BLOCK: tl.constexpr):
    """``counter_uniform``: the draw of every index (from ``start`` on) in one pass."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _uniform(offs + start, tl.cast(key, tl.uint32, bitcast=True)), mask=offs < numel)


def _ternary_encode_kernel(
    x_ptr, scale_ptr, packed_ptr, numel, bucket, tau, key,
    BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr, TO_F32: tl.constexpr,
):
    """``BLOCK`` values to ``BLOCK / 4`` bytes of 2-bit codes, 1 for +, 2 for −, 0 for nothing.
    STOCHASTIC (TernGrad): kept where ``u < |x| / scale`` of the value's bucket (IEEE division,
    as the reference), ``u`` the counter draw of the value's index; else (TBQ): + where
    ``x > tau``, − where ``x < −tau``."""
    pid, offs, valid, x = _block_values(x_ptr, numel, BLOCK, TO_F32)
    if STOCHASTIC:
        s = tl.load(scale_ptr + offs // bucket, mask=valid, other=1.0)
        r = _uniform(offs, tl.cast(key, tl.uint32, bitcast=True))
        keep = (r < tl.div_rn(tl.abs(x), s)) & valid
        codes = tl.where(keep, tl.where(x < 0, 2, 1), 0)
    else:
        codes = tl.where(valid & (x > tau), 1, tl.where(valid & (x < -tau), 2, 0))
    _store_2bit(packed_ptr, pid, codes, numel, BLOCK)


def _store_2bit(packed_ptr, pid, codes, numel, BLOCK: tl.constexpr):
    """A program's ``BLOCK`` 2-bit codes (int32, 0 where invalid) packed four to a byte as
    ``pack_bits`` packs them: every byte up to the next multiple of eight values, the padding's
    codes 0; byte g is needed where its group of eight, g // 2, starts below numel (int64: no
    overflow)."""
    G: tl.constexpr = BLOCK // 4
    j = tl.arange(0, 4)
    data = tl.sum(tl.reshape(codes, (G, 4)) << (2 * j)[None, :], axis=1)
    g = pid * G + tl.arange(0, G)
    tl.store(packed_ptr + g, data.to(tl.uint8), mask=(g // 2) * 8 < numel)


def _ternary_decode_kernel(
    packed_ptr, scale_ptr, out_ptr, numel, bucket, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """``{0, +1, −1}`` per 2-bit code, times its bucket's scale, stored or added into ``out``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    byte = tl.load(packed_ptr + (offs >> 2), mask=valid, other=0).to(tl.int32)
    code = (byte >> (2 * (offs & 3)).to(tl.int32)) & 3
    val = ((code & 1) - (code >> 1)).to(tl.float32) * tl.load(scale_ptr + offs // bucket, mask=valid, other=0.0)
    _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _select_kernel(
    x_ptr, thr_ptr, valid_ptr, starts_ptr, counts_ptr, idx_ptr, numel, thr,
    BLOCK: tl.constexpr, PER_BLOCK: tl.constexpr, SPAN: tl.constexpr, WRITE: tl.constexpr,
):
    """The values whose magnitude (in fp32) reaches the threshold: ``thr``, or with PER_BLOCK
    each block of ``SPAN`` values' own (``thr_ptr``), its first ``valid_ptr`` values only (the
    rest: a fused group's padding). Counted a program at a time (``counts``), or, with WRITE,
    their indices stored in ascending order from where the program's start (``starts``)."""
    pid, offs, valid, x = _block_values(x_ptr, numel, BLOCK, True)
    mag = tl.abs(x)
    if PER_BLOCK:
        block = offs // SPAN
        keep = valid & (mag >= tl.load(thr_ptr + block, mask=valid, other=0.0))
        keep = keep & ((offs % SPAN) < tl.load(valid_ptr + block, mask=valid, other=0))
    else:
        keep = valid & (mag >= thr)
    k = keep.to(tl.int32)
    if WRITE:
        tl.store(idx_ptr + _places(starts_ptr, pid, k), offs, mask=keep)
    else:
        tl.store(counts_ptr + pid, tl.sum(k, axis=0))


def _places(starts_ptr, pid, counts):
    """Where each of a program's values puts its ``counts`` (int32) outputs in order: from the
    program's start (``starts``: the exclusive prefix sums of the programs' totals) plus what
    the values before it put."""
    return tl.load(starts_ptr + pid) + (tl.cumsum(counts, axis=0) - counts).to(tl.int64)


def _bf16_bits(u):
    """The bf16 nearest (ties to even) to the fp32 whose bits are ``u`` (uint32), as its 16
    bits: rounded on the bits, exactly (Triton's interpreter truncates a cast to bf16)."""
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def _inceptionn_tags(x_ptr, numel, b, step, BLOCK: tl.constexpr, SHORT: tl.constexpr, BF16: tl.constexpr):
    """INCEPTIONN's tag, word and byte count of this program's values (the torch version,
    ``reference.inceptionn_encode``): the fixed-point level ``m = floor(|x| / 2b + 0.5)`` (an
    IEEE division), tag 1 or 2 where ``m · 2b`` (cast back to a 16-bit input's dtype) is within
    ``b`` of ``|x|`` and ``m`` fits 7 or 15 bits, 0 under ``b``, else 3 (the raw value)."""
    pid, offs, valid, x = _block_values(x_ptr, numel, BLOCK, False)
    xf = x.to(tl.float32)
    mag = tl.abs(xf)
    m = tl.floor(tl.div_rn(mag, step) + 0.5)
    approx = m * step
    if SHORT:  # the decode as the caller gets it: cast back, rounded to nearest even
        if BF16:
            approx = (_bf16_bits(approx.to(tl.uint32, bitcast=True)) << 16).to(tl.float32, bitcast=True)
        else:
            approx = approx.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    ok = tl.abs(approx - mag) <= b
    tag = 3 - (ok & (m <= 32767.0)).to(tl.int32) - (ok & (m <= 127.0)).to(tl.int32)
    tag = tl.where(mag < b, 0, tag)
    sign_at = tl.maximum(tag * 8 - 1, 0)
    fixed = tl.minimum(tl.maximum(m, 0.0), 32767.0).to(tl.int32) | ((xf < 0).to(tl.int32) << sign_at)
    if SHORT:
        raw = x.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        raw = xf.to(tl.int32, bitcast=True)
    word = tl.where(tag == 3, raw, fixed)
    length = tl.where(tag == 3, 2 if SHORT else 4, tag)
    return pid, offs, valid, tl.where(valid, tag, 0), word, tl.where(valid, length, 0)


def _inceptionn_tags_kernel(
    x_ptr, packed_ptr, counts_ptr, numel, b, step,
    BLOCK: tl.constexpr, SHORT: tl.constexpr, BF16: tl.constexpr,
):
    """INCEPTIONN's 2-bit tags of ``BLOCK`` values (packed as ``pack_bits``) and the bytes this
    program's values put in the stream (``counts``, one a program: their prefix sums place it)."""
    pid, offs, valid, tag, word, length = _inceptionn_tags(x_ptr, numel, b, step, BLOCK, SHORT, BF16)
    _store_2bit(packed_ptr, pid, tag, numel, BLOCK)
    tl.store(counts_ptr + pid, tl.sum(length, axis=0))


def _inceptionn_stream_kernel(
    x_ptr, starts_ptr, stream_ptr, numel, b, step,
    BLOCK: tl.constexpr, SHORT: tl.constexpr, BF16: tl.constexpr,
):
    """Each value's 0, 1, 2 or raw-width low bytes of its word, in value order, from where this
    program's bytes start (``starts``: the exclusive prefix sums of the tags kernel's counts)."""
    pid, offs, valid, tag, word, length = _inceptionn_tags(x_ptr, numel, b, step, BLOCK, SHORT, BF16)
    at = _places(starts_ptr, pid, length)
    for j in tl.static_range(4):
        tl.store(stream_ptr + at + j, ((word >> (8 * j)) & 0xFF).to(tl.uint8), mask=valid & (length > j))


def _inceptionn_lengths(packed_ptr, numel, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """This program's tags (from the packed 2-bit tags) and their values' byte counts."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    tag = _unpack_load(packed_ptr, offs, valid, 2)
    return pid, offs, valid, tag, tl.where(tag == 3, WIDTH, tag)


def _inceptionn_counts_kernel(packed_ptr, counts_ptr, numel, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """The stream bytes of each program's values, read from their tags (the decoder's offsets)."""
    pid, offs, valid, tag, length = _inceptionn_lengths(packed_ptr, numel, BLOCK, WIDTH)
    tl.store(counts_ptr + pid, tl.sum(length, axis=0))


def _inceptionn_decode_kernel(
    packed_ptr, stream_ptr, starts_ptr, out_ptr, numel, step,
    BLOCK: tl.constexpr, WIDTH: tl.constexpr, BF16: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Each value from its tag and its bytes: ``±m · 2b`` (tags 1, 2: the sign above the 7 or
    15 bits of ``m``), 0 (tag 0) or the raw value (tag 3), stored or added into ``out``."""
    pid, offs, valid, tag, length = _inceptionn_lengths(packed_ptr, numel, BLOCK, WIDTH)
    at = _places(starts_ptr, pid, length)
    word = tl.zeros((BLOCK,), tl.int32)
    for j in tl.static_range(4):
        byte = tl.load(stream_ptr + at + j, mask=valid & (length > j), other=0).to(tl.int32)
        word = word | (byte << (8 * j))
    sign_at = tl.minimum(tl.maximum(tag * 8 - 1, 0), 15)
    val = (word & ((1 << sign_at) - 1)).to(tl.float32) * step
    val = tl.where(((word >> sign_at) & 1) == 1, -val, val)
    if WIDTH == 2:
        if BF16:  # (a bf16's bits are an fp32's upper half)
            raw = ((word & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            raw = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        raw = word.to(tl.float32, bitcast=True)
    _store_decoded(out_ptr, offs, tl.where(tag == 3, raw, val), valid, ACCUMULATE)


def _header(top_ptr, offs, valid, SHIFT: tl.constexpr):
    """Natural compression's header of each value: the one at ``top_ptr`` (``SHIFT`` < 0), else
    that of its bucket of ``2**SHIFT`` values. (One load of one type either way: compiled Triton
    types both branches' returns, which a scalar and a vector would not share.)"""
    if SHIFT < 0:
        at = offs * 0
    else:
        at = offs >> SHIFT
    return tl.load(top_ptr + at, mask=valid, other=0)


def _natural_codes_kernel(bits_ptr, top_ptr, out_ptr, numel, key, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """Natural compression's byte per value, integer for integer the reference's, under its
    header (:func:`_header`); the 23-bit draw of value ``i`` is ``counter_uniform``'s times
    2**23 (exact: its top 23 bits)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    bits = tl.load(bits_ptr + offs, mask=valid, other=0)
    mag = tl.minimum(bits & 0x7FFFFFFF, 0x7F800000)
    rand = (_uniform(offs, tl.cast(key, tl.uint32, bitcast=True)) * 8388608.0).to(tl.int32)
    first = _header(top_ptr, offs, valid, SHIFT) - 126
    rounded = (mag + rand) >> 23
    code_in = tl.where(rounded > 0, rounded - (first - 1), 0)
    scale = (tl.minimum(tl.maximum(254 - first, 1), 254) << 23).to(tl.float32, bitcast=True)
    prob = mag.to(tl.float32, bitcast=True) * scale
    code_under = (rand.to(tl.float32) * (1.0 / 8388608.0) < prob).to(tl.int32)
    code = tl.where((mag >> 23) >= first, code_in, code_under)
    sign = ((bits < 0) & (code > 0)).to(tl.int32) << 7
    tl.store(out_ptr + offs, (code | sign).to(tl.uint8), mask=valid)


def _natural_decode_kernel(
    codes_ptr, top_ptr, out_ptr, numel, BLOCK: tl.constexpr, SHIFT: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """``±2**(top − 254 + c)`` of each byte under its header (:func:`_header`;
    ``reference.natural_decode``, integer for integer), stored or added into ``out``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    c = tl.load(codes_ptr + offs, mask=valid, other=0).to(tl.int32)
    top = _header(top_ptr, offs, valid, SHIFT)
    code = c & 127
    field = tl.minimum(tl.maximum(code + (top - 127), 0), 255) << 23
    field = tl.minimum(field, tl.where(top <= 255, 0x7F7FFFFF, 0x7F800000))
    bits = tl.where(code > 0, field, 0) | ((c >> 7) << 31)
    _store_decoded(out_ptr, offs, bits.to(tl.float32, bitcast=True), valid, ACCUMULATE)


def _u8bit_codes_kernel(x_ptr, inv_ptr, mids_ptr, lut_ptr, out_ptr, numel, bucket, BLOCK: tl.constexpr):
    """8-bit codes: ``v = x · inv`` of the bucket, ``first = lut[top 16 bits of v]``, then
    ``first + (mids[first] < v)`` (the reference's table search)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    v = tl.load(x_ptr + offs, mask=valid, other=0.0) * tl.load(inv_ptr + offs // bucket, mask=valid, other=0.0)
    key = (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    first = tl.load(lut_ptr + key, mask=valid, other=0).to(tl.int32)
    idx = first + (tl.load(mids_ptr + first, mask=valid, other=0.0) < v).to(tl.int32)
    tl.store(out_ptr + offs, idx.to(tl.uint8), mask=valid)


def _table_decode_kernel(
    codes_ptr, table_ptr, scale_ptr, out_ptr, numel, bucket, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """``table[code] × scale`` of each value's bucket, stored or added into ``out``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    code = tl.load(codes_ptr + offs, mask=valid, other=0).to(tl.int32)
    val = tl.load(table_ptr + code, mask=valid, other=0.0) * tl.load(scale_ptr + offs // bucket, mask=valid, other=0.0)
    _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _onebit_decode_kernel(
    packed_ptr, means_ptr, out_ptr, numel, bucket, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """``bit · mean_pos + (1 − bit) · mean_neg`` of each value's bucket, in the reference's order
    (no FMA), stored or added into ``out``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    byte = tl.load(packed_ptr + (offs >> 3), mask=valid, other=0).to(tl.int32)
    bit = ((byte >> (offs & 7).to(tl.int32)) & 1).to(tl.float32)
    b = offs // bucket
    neg = tl.load(means_ptr + 2 * b, mask=valid, other=0.0)
    pos = tl.load(means_ptr + 2 * b + 1, mask=valid, other=0.0)
    val = bit * pos + (1.0 - bit) * neg
    _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _row_stats_kernel(x_ptr, out_ptr, rows, width, stride, chunk, parts, SIDES: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """One chunk of ``chunk`` columns of ROWS rows of fp32 values: each row's ``max |x|`` there
    (fp32; a NaN stays, where the GPU's own maximum would skip it) or, with SIDES, ``[sum of
    x < 0, sum of x >= 0, count of x >= 0]`` there in fp64 (a NaN in both sums), at
    ``out[row, chunk]``; the caller reduces the chunks of a long row."""
    pid = tl.program_id(0).to(tl.int64)  # (tiles and chunks on one axis: the others hold 65535 programs)
    part = pid % parts
    row = (pid // parts) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    if SIDES:
        neg = tl.zeros((ROWS,), tl.float64)
        pos = tl.zeros((ROWS,), tl.float64)
        count = tl.zeros((ROWS,), tl.float64)
    else:
        top = tl.zeros((ROWS,), tl.float32)
        nan = tl.zeros((ROWS,), tl.int32)
    for c in tl.range(0, chunk, BLOCK):
        col = part * chunk + c + tl.arange(0, BLOCK)
        valid = row_ok[:, None] & (col < width)[None, :]
        x = tl.load(x_ptr + row[:, None] * stride + col[None, :], mask=valid, other=0.0)
        if SIDES:
            odd = x != x
            neg += tl.sum(tl.where((x < 0) | odd, x, 0.0).to(tl.float64), axis=1)
            pos += tl.sum(tl.where((x >= 0) | odd, x, 0.0).to(tl.float64), axis=1)
            count += tl.sum(((x >= 0) & valid).to(tl.float64), axis=1)
        else:
            top = tl.maximum(top, tl.max(tl.abs(x), axis=1))
            nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
    at = row * parts + part
    if SIDES:
        tl.store(out_ptr + 3 * at, neg, mask=row_ok)
        tl.store(out_ptr + 3 * at + 1, pos, mask=row_ok)
        tl.store(out_ptr + 3 * at + 2, count, mask=row_ok)
    else:
        tl.store(out_ptr + at, tl.where(nan > 0, float("nan"), top), mask=row_ok)


def _saturate_kernel(x_ptr, out_ptr, numel, TOP: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 to fp16 (or to bf16's bits, ``out_ptr`` then int16), rounded to nearest even; finite
    values beyond ``±TOP`` (the type's largest value) become ``±TOP``, NaN and ±inf stay NaN
    and ±inf. bf16 is rounded on the bits (``u + 0x7FFF + lsb``, exact): Triton's interpreter
    truncates instead."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    beyond = (tl.abs(x) > TOP) & (tl.abs(x) < float("inf"))
    x = tl.where(beyond, tl.where(x > 0, TOP, -TOP), x)
    if BF16:
        r = _bf16_bits(x.to(tl.uint32, bitcast=True))
        r = tl.where(x != x, 0x7FC0, r)  # NaN: the quiet one (a payload could round to inf)
        tl.store(out_ptr + offs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)
    else:
        tl.store(out_ptr + offs, x.to(tl.float16, fp_downcast_rounding="rtne"), mask=valid)


def _sign_decode_kernel(
    packed_ptr, scale_ptr, out_ptr, numel,
    BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """``bit * 2 - 1`` per value, times ``*scale_ptr`` when given, stored or added into ``out``."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    byte = tl.load(packed_ptr + (offs >> 3), mask=valid, other=0).to(tl.int32)
    val = ((byte >> (offs & 7).to(tl.int32)) & 1).to(tl.float32) * 2.0 - 1.0
    if HAS_SCALE:
        val = val * tl.load(scale_ptr)
    _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _magnitude_key(x_ptr, offs, valid):
    """``|x|`` as fp32 bits in an int32: non-negative, and ordered as the magnitudes are (every
    NaN the one key above +inf, as in the C kernel)."""
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    return tl.minimum(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7F800001)  # (the sign bit cleared, a NaN's too)


def _radix_hist_kernel(x_ptr, numel, state_ptr, hist_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of key digit ``(key >> SHIFT) & 255`` over the keys whose higher digits match."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    key = _magnitude_key(x_ptr, offs, valid)
    if SHIFT < 24:
        prefix = tl.load(state_ptr)
        valid = valid & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
    hist = tl.histogram((key >> SHIFT) & 0xFF, 256, mask=valid)
    tl.atomic_add(hist_ptr + tl.arange(0, 256), hist, mask=hist > 0)


def _radix_select_kernel(state_ptr, hist_ptr, SHIFT: tl.constexpr):
    """Pick the digit holding the ``need``-th largest key; ``state = [prefix, need]`` is updated."""
    prefix = tl.load(state_ptr)
    need = tl.load(state_ptr + 1)
    d = tl.arange(0, 256)
    hist = tl.load(hist_ptr + d)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= d
    chosen = tl.max(tl.where(at_least >= need, d, -1), axis=0)
    above = tl.sum(tl.where(d > chosen, hist, 0), axis=0)
    tl.store(state_ptr, prefix | (chosen << SHIFT))
    tl.store(state_ptr + 1, need - above)


def _topk_count_kernel(x_ptr, numel, state_ptr, counts_ptr, BLOCK: tl.constexpr):
    """Per block: how many keys exceed the threshold and how many equal it."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    key = _magnitude_key(x_ptr, offs, valid)
    threshold = tl.load(state_ptr)
    tl.store(counts_ptr + 2 * pid, tl.sum((valid & (key > threshold)).to(tl.int32), axis=0))
    tl.store(counts_ptr + 2 * pid + 1, tl.sum((valid & (key == threshold)).to(tl.int32), axis=0))


def _topk_offsets_kernel(counts_ptr, offsets_ptr, state_ptr, num_blocks, SCAN: tl.constexpr):
    """Exclusive scans over the blocks (one program): output offset and ties before each block.

    A block keeps all its keys above the threshold and as many of its ties as are still needed
    after the ties of the blocks before it, so the ties kept are those with the lowest indices.
    """
    need = tl.load(state_ptr + 1)
    ties_before = need * 0
    kept_before = need * 0
    for c in tl.range(0, num_blocks, SCAN):
        i = c + tl.arange(0, SCAN)
        m = i < num_blocks
        above = tl.load(counts_ptr + 2 * i, mask=m, other=0)
        ties = tl.load(counts_ptr + 2 * i + 1, mask=m, other=0)
        ties_excl = ties_before + tl.cumsum(ties, axis=0) - ties
        taken = tl.minimum(tl.maximum(need - ties_excl, 0), ties)
        kept = above + taken
        tl.store(offsets_ptr + 2 * i, kept_before + tl.cumsum(kept, axis=0) - kept, mask=m)
        tl.store(offsets_ptr + 2 * i + 1, ties_excl, mask=m)
        ties_before += tl.sum(ties, axis=0)
        kept_before += tl.sum(kept, axis=0)


def _topk_write_kernel(x_ptr, numel, state_ptr, offsets_ptr, values_ptr, indices_ptr, BLOCK: tl.constexpr):
    """Compact the kept values and their indices, in index order, to the block's offset."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    key = _magnitude_key(x_ptr, offs, valid)
    threshold = tl.load(state_ptr)
    need = tl.load(state_ptr + 1)
    tie = (valid & (key == threshold)).to(tl.int32)
    tie_rank = tl.load(offsets_ptr + 2 * pid + 1) + tl.cumsum(tie, axis=0) - tie
    keep = (valid & (key > threshold)) | ((tie != 0) & (tie_rank < need))
    k32 = keep.to(tl.int32)
    pos = tl.load(offsets_ptr + 2 * pid) + tl.cumsum(k32, axis=0) - k32
    tl.store(indices_ptr + pos, offs, mask=keep)
    tl.store(values_ptr + pos, tl.load(x_ptr + offs, mask=keep), mask=keep)

# ------------------------------------------------------- FP8 and microscaling (MX) formats
# A format is (MBITS mantissa bits, exponent bias EBIAS, sign at bit SIGN_AT, largest finite
# value TOP): e4m3 (3, 7, 7, 448), e5m2 (2, 15, 7, 57344), e2m1 (1, 1, 3, 6). The conversions are
# the integer arithmetic of native.c on the fp32 bits (round to nearest even, as torch's float8
# casts); block maxima are maxima of the magnitude bits.


def _to_mini(v, MBITS: tl.constexpr, EBIAS: tl.constexpr, SIGN_AT: tl.constexpr):
    """Codes (int32) of the fp32 ``v`` (``|v| <= TOP``): below the smallest normal, adding
    ``2**(SHIFT + 1 - EBIAS)`` (whose ulp is the subnormal step) rounds in the FPU; above it the
    bits are rebiased and rounded with half an ulp minus one plus the lowest kept bit."""
    SHIFT: tl.constexpr = 23 - MBITS
    DENORM: tl.constexpr = (127 - EBIAS + SHIFT + 1) << 23
    DENORM_F: tl.constexpr = 2.0 ** (SHIFT + 1 - EBIAS)
    BIAS: tl.constexpr = ((1 << (SHIFT - 1)) - 1) - ((127 - EBIAS) << 23)
    u = v.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    sub = (a.to(tl.float32, bitcast=True) + DENORM_F).to(tl.int32, bitcast=True) - DENORM
    nor = (a + BIAS + ((a >> SHIFT) & 1)) >> SHIFT
    mag = tl.where(a < ((128 - EBIAS) << 23), sub, nor) & ((1 << SIGN_AT) - 1)
    return mag | (((u >> 31) & 1) << SIGN_AT)


def _from_mini(c, MBITS: tl.constexpr, EBIAS: tl.constexpr, SIGN_AT: tl.constexpr, SPECIAL: tl.constexpr):
    """fp32 values of the int32 codes ``c``, exactly: a normal code's bits rebiased, a subnormal
    code's mantissa times ``2**(1 - EBIAS - MBITS)``. SPECIAL: 1 e4m3fn (0x7F NaN), 2 e5m2
    (0x7C inf, above NaN), 0 none."""
    STEP: tl.constexpr = 2.0 ** (1 - EBIAS - MBITS)
    mag = c & ((1 << SIGN_AT) - 1)
    normal = (mag << (23 - MBITS)) + ((127 - EBIAS) << 23)
    sub = ((mag & ((1 << MBITS) - 1)).to(tl.float32) * STEP).to(tl.int32, bitcast=True)
    bits = tl.where((mag >> MBITS) != 0, normal, sub)
    if SPECIAL == 1:
        bits = tl.where(mag == 0x7F, 0x7FC00000, bits)
    if SPECIAL == 2:
        bits = tl.where(mag == 0x7C, 0x7F800000, tl.where(mag > 0x7C, 0x7FC00000, bits))
    return (bits | (((c >> SIGN_AT) & 1) << 31)).to(tl.float32, bitcast=True)


def _clamp_to(v, top):
    """``v`` clamped to ``±top`` (NaN stays NaN), as native.c's clamp_to."""
    return tl.where(v < -top, -top, tl.where(v > top, top, v))


def _block_max_bits(
    x_ptr, row, bucket, num_buckets, numel, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKED: tl.constexpr,
):
    """Largest magnitude bits (int32) of each of the ROWS blocks (0 for rows past the last)."""
    if CHUNKED:
        m = tl.zeros((ROWS,), tl.int32)
        for c in tl.range(0, bucket, BLOCK):
            offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
            x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            m = tl.maximum(m, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
    else:
        offs, valid = _tile(row, 0, bucket, num_buckets, numel, BLOCK)
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        m = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    return m


def _store_codes(
    codes_ptr, codes, row, c, bucket, num_buckets, numel,
    PACK4: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Store a tile's codes: one per byte, or two per byte (value i in the low nibble when i is
    even; blocks start on even values), ``ceil(numel / 2)`` bytes in all."""
    offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
    if PACK4:
        H: tl.constexpr = BLOCK // 2
        pairs = tl.reshape(tl.where(valid, codes, 0), (ROWS, H, 2))
        byte = tl.sum(pairs << (tl.arange(0, 2) * 4)[None, None, :], axis=2)
        j2 = tl.arange(0, H) * 2
        first = (row * bucket + c)[:, None] + j2[None, :]
        ok = (row < num_buckets)[:, None] & (j2 < bucket - c)[None, :] & (first < numel)
        tl.store(codes_ptr + first // 2, byte.to(tl.uint8), mask=ok)
    else:
        tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=valid)


def _fp8_encode_kernel(
    x_ptr, codes_ptr, scales_ptr, numel, bucket, num_buckets,
    MBITS: tl.constexpr, EBIAS: tl.constexpr, TOP: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKED: tl.constexpr,
):
    """ROWS blocks: ``s = max(amax / TOP, 2**-126)``, codes of ``x * (1 / s)`` clamped to ``±TOP``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m = _block_max_bits(x_ptr, row, bucket, num_buckets, numel, ROWS, BLOCK, CHUNKED)
    s = tl.div_rn(m.to(tl.float32, bitcast=True), TOP)
    s = tl.where(s < 1.1754943508222875e-38, 1.1754943508222875e-38, s)  # NaN stays NaN
    inv = tl.div_rn(tl.full((ROWS,), 1.0, tl.float32), s)
    for c in tl.range(0, bucket, BLOCK):
        offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        codes = _to_mini(_clamp_to(x * inv[:, None], TOP), MBITS, EBIAS, 7)
        _store_codes(codes_ptr, codes, row, c, bucket, num_buckets, numel, False, ROWS, BLOCK)
    tl.store(scales_ptr + row, s, mask=row < num_buckets)


def _fp8_decode_kernel(
    codes_ptr, scales_ptr, out_ptr, numel, bucket, num_buckets,
    MBITS: tl.constexpr, EBIAS: tl.constexpr, SPECIAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """ROWS blocks: ``value(code) * s``, clamped to the fp32 range where ``s`` is finite."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    s = tl.load(scales_ptr + row, mask=row < num_buckets, other=0.0)
    top = tl.where(tl.abs(s) < float("inf"), 3.4028234663852886e38, float("inf"))[:, None]
    for c in tl.range(0, bucket, BLOCK):
        offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
        code = tl.load(codes_ptr + offs, mask=valid, other=0).to(tl.int32)
        val = _clamp_to(_from_mini(code, MBITS, EBIAS, 7, SPECIAL) * s[:, None], top)
        _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _mx_encode_kernel(
    x_ptr, codes_ptr, scales_ptr, numel, bucket, num_buckets,
    MBITS: tl.constexpr, EBIAS: tl.constexpr, SIGN_AT: tl.constexpr, EMAX: tl.constexpr, TOP: tl.constexpr,
    PACK4: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKED: tl.constexpr,
):
    """ROWS blocks: E8M0 code ``clamp(field(amax) - EMAX, 0, 254)`` (255 for NaN/inf), codes of
    ``x * 2**(127 - code)`` (exact) clamped to ``±TOP``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    field = (_block_max_bits(x_ptr, row, bucket, num_buckets, numel, ROWS, BLOCK, CHUNKED) >> 23) & 0xFF
    code = tl.where(field == 255, 255, tl.minimum(tl.maximum(field - EMAX, 0), 254))
    # 2**(127 - code), built from bits (2**-127 is subnormal); 1 for a NaN block
    mult = tl.where(code == 254, 0x00400000, (254 - code) << 23).to(tl.float32, bitcast=True)
    mult = tl.where(code == 255, 1.0, mult)
    for c in tl.range(0, bucket, BLOCK):
        offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        codes = _to_mini(_clamp_to(x * mult[:, None], TOP), MBITS, EBIAS, SIGN_AT)
        _store_codes(codes_ptr, codes, row, c, bucket, num_buckets, numel, PACK4, ROWS, BLOCK)
    tl.store(scales_ptr + row, code.to(tl.uint8), mask=row < num_buckets)


def _mx_decode_kernel(
    codes_ptr, scales_ptr, out_ptr, numel, bucket, num_buckets,
    MBITS: tl.constexpr, EBIAS: tl.constexpr, SIGN_AT: tl.constexpr, SPECIAL: tl.constexpr, PACK4: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """ROWS blocks: ``value(element) * 2**(code - 127)`` (exact; 255 is NaN)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    code = tl.load(scales_ptr + row, mask=row < num_buckets, other=0).to(tl.int32)
    scale = tl.where(code == 0, 0x00400000, code << 23)
    scale = tl.where(code == 255, 0x7FC00000, scale).to(tl.float32, bitcast=True)
    for c in tl.range(0, bucket, BLOCK):
        offs, valid = _tile(row, c, bucket, num_buckets, numel, BLOCK)
        if PACK4:
            elem = _unpack_load(codes_ptr, offs, valid, 4)
        else:
            elem = tl.load(codes_ptr + offs, mask=valid, other=0).to(tl.int32)
        val = _from_mini(elem, MBITS, EBIAS, SIGN_AT, SPECIAL) * scale[:, None]
        _store_decoded(out_ptr, offs, val, valid, ACCUMULATE)


def _interpreter_probe_kernel(out_ptr, n, BLOCK: tl.constexpr):
    """Counts, per lane, the steps of a loop with a run-time bound (as the decoders walk a bucket):
    the construct that Triton 3.6's interpreter cannot run under NumPy 2.4 or later."""
    lanes = tl.arange(0, BLOCK)
    count = tl.zeros((BLOCK,), tl.float32)
    for c in tl.range(0, n, BLOCK):
        count += tl.where(c + lanes < n, 1.0, 0.0)
    tl.store(out_ptr + lanes, count)


_JIT = (
    "_interpreter_probe_kernel", "_uniform", "_tile", "_pack_store", "_unpack_load", "_maxmin_levels", "_qsgd_codes", "_magnitude_key",
    "_maxmin_encode_kernel", "_maxmin_decode_kernel", "_qsgd_encode_kernel", "_qsgd_decode_kernel",
    "_block_values", "_store_decoded", "_store_signs", "_sign_encode_kernel", "_sign_decode_kernel", "_saturate_kernel",
    "_uniform_kernel", "_signum_encode_kernel", "_ternary_encode_kernel", "_ternary_decode_kernel", "_onebit_decode_kernel",
    "_header", "_natural_codes_kernel", "_natural_decode_kernel",
    "_store_2bit", "_places", "_bf16_bits", "_select_kernel", "_inceptionn_tags", "_inceptionn_tags_kernel", "_inceptionn_stream_kernel", "_inceptionn_lengths",
    "_inceptionn_counts_kernel", "_inceptionn_decode_kernel",
    "_u8bit_codes_kernel", "_table_decode_kernel", "_row_stats_kernel",
    "_radix_hist_kernel", "_radix_select_kernel", "_topk_count_kernel", "_topk_offsets_kernel", "_topk_write_kernel",
    "_to_mini", "_from_mini", "_clamp_to", "_block_max_bits", "_store_codes",
    "_fp8_encode_kernel", "_fp8_decode_kernel", "_mx_encode_kernel", "_mx_decode_kernel",
)

# Integer arguments that change from call to call (a rounding key, a counter's start). Triton
# specialises a kernel on whether an integer argument is 1 or divisible by 16 and compiles it
# again for each class it meets: for these that would be at a random step, on one rank, while
# the others wait for it in a collective.
_VARYING_ARGS = ("key", "start")


# -------------------------------------------------------------------------------------- loading


def _interpreting(module: Any) -> bool:
    knobs = getattr(module, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _missing_features(tl_module: Any) -> str | None:
    """The first language feature the kernels need that this Triton lacks, or None."""
    needs = (
        (tl_module.mul, "sanitize_overflow", "tl.mul(..., sanitize_overflow=)"),
        (tl_module.histogram, "mask", "tl.histogram(..., mask=)"),
    )
    for fn, param, what in needs:
        try:
            if param not in inspect.signature(fn).parameters:
                return what
        except (TypeError, ValueError):
            return what
    return None


def _load() -> bool:
    """Import Triton and decorate the kernels, once; False (and ``_error`` set) when impossible."""
    global triton, tl, _loaded, _interpreted, _error, _interpreter_fault
    with _lock:
        if _loaded:
            return _error is None
        _loaded = True
        try:
            import triton as triton_module
            import triton.language as tl_module
        except ImportError as exc:
            _error = f"triton is not installed ({exc}); pip install triton"
            return False
        missing = _missing_features(tl_module)
        if missing:
            version = getattr(triton_module, "__version__", "?")
            _error = f"triton {version} lacks {missing}, which these kernels use (triton 3.9 has it)"
            return False
        _interpreted = _interpreting(triton_module)
        if not _interpreted and not torch.cuda.is_available():
            _error = "no CUDA/ROCm device for Triton (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
            return False
        triton, tl = triton_module, tl_module
        scope = globals()
        for name in _JIT:
            varying = [a for a in _VARYING_ARGS if a in inspect.signature(scope[name]).parameters]
            options = {"do_not_specialize": varying} if varying and name.endswith("_kernel") else {}
            scope[name] = triton_module.jit(scope[name], **options)
        if _interpreted:
            _interpreter_fault = _probe_interpreter(triton_module)
            _error = _interpreter_fault
        return _error is None


def _probe_interpreter(triton_module: Any) -> str | None:
    """None when the interpreter runs a loop with a run-time bound correctly; otherwise why not.

    Triton 3.6's interpreter converts one-element arrays to Python integers with ``int()``,
    which NumPy 2.4 refuses, so every kernel that loops over a bucket fails there. Finding that
    once, at load time, turns a failure inside each kernel into one clear reason.
    """
    out = torch.zeros(8)
    try:
        _interpreter_probe_kernel[(1,)](out, 10, BLOCK=8)
    except Exception as exc:  # noqa: BLE001 - any failure means the interpreter cannot be used
        import numpy

        return (
            f"Triton {getattr(triton_module, '__version__', '?')}'s interpreter fails with NumPy "
            f"{numpy.__version__} ({type(exc).__name__}: {str(exc)[:160]}); upgrade Triton (3.9 works), "
            "use numpy<2.4, or run the kernels compiled on a GPU (TRITON_INTERPRET=0)"
        )
    expected = torch.tensor([2.0, 2.0] + [1.0] * 6)
    if not torch.equal(out, expected):
        return f"Triton {getattr(triton_module, '__version__', '?')}'s interpreter ran a loop wrongly ({out.tolist()})"
    return None


def interpreter_fault() -> str | None:
    """Why Triton's interpreter cannot run the kernels on this machine, or None (also when the
    kernels run compiled). Tests skip on it: the fault is the installed Triton's, not gradzip's."""
    _load()
    return _interpreter_fault


def available() -> str | None:
    """None when the Triton kernels can run here; otherwise why they cannot."""
    _load()
    return _error


def _device_ok(x: torch.Tensor) -> bool:
    # the interpreter copies any tensor to the host and back; compiled kernels need a GPU tensor
    return x.device.type == "cuda" or (x.device.type == "cpu" and _interpreted)


def supports(x: torch.Tensor, bits: int = 8, bucket: int = 8) -> bool:
    """Whether the kernels take this input (an encoder's values or a decoder's packed bytes): a
    GPU tensor (any tensor in the interpreter), ``1 <= bits <= 8``, and buckets of at most
    ``MAX_BUCKET`` values that are whole bytes once packed (a multiple of 8 unless ``bits == 8``).
    Encoders load fp16/bf16/fp32/fp64 as they are and convert other dtypes like ``x.float()``."""
    return (
        _load()
        and _device_ok(x)
        and 1 <= bits <= 8
        and 0 < bucket <= MAX_BUCKET
        and (bits == 8 or bucket % 8 == 0)
    )


def supports_topk(x: torch.Tensor) -> bool:
    """Whether :func:`topk` takes this input: a GPU tensor of fp16/bf16/fp32 below 2**31 values.

    Magnitudes are ranked on their fp32 bit patterns, which is exact for these dtypes only.
    """
    return _load() and _device_ok(x) and x.dtype in _TOPK_FLOATS and x.numel() < 2**31


# ----------------------------------------------------------------------------------- launching


def _require() -> None:
    if not _load():
        raise RuntimeError(f"gradzip's Triton kernels are unavailable: {_error}")


def _check(bits: int, bucket: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if not 0 < bucket <= MAX_BUCKET or (bits < 8 and bucket % 8):
        raise ValueError(f"bucket must be in 1..{MAX_BUCKET} and a multiple of 8 when bits < 8, got {bucket}")


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Flat and contiguous; the kernels convert floating dtypes to fp32 as they load."""
    x = x.reshape(-1)
    if x.dtype not in _FLOATS:
        x = x.float()
    return x.contiguous()


def _geometry(bucket: int) -> tuple[int, int, bool, int]:
    """``(ROWS, BLOCK, CHUNKED, num_warps)`` of the bucketed kernels for this bucket size."""
    block = min(CHUNK, max(8, 1 << (bucket - 1).bit_length()))
    rows = max(1, TILE // block)
    return rows, block, bucket > block, max(4, rows * block // 256)


def _launch(kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any, **meta: Any) -> None:
    """Launch on ``device``'s GPU with FMA contraction off (bit-identity with the reference)."""
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        kernel[grid](*args, enable_fp_fusion=False, **meta)


def _key32(key: int | None) -> int:
    """The 32-bit key as a signed int32, so the kernel argument has one type for every key."""
    k = (key or 0) & 0xFFFFFFFF
    return k - (1 << 32) if k >= (1 << 31) else k


# ------------------------------------------------------------------------------------ public API


def maxmin_encode(
    x: torch.Tensor, bits: int, bucket: int, key: int | None, out: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed levels and per-bucket ``[min, scale]`` of the flat ``x`` (see ``reference.maxmin_encode``),
    into ``out`` (contiguous, of those sizes) if given.

    ``key`` None rounds to nearest (half to even), else ``floor(v + u)`` with counter noise.
    """
    _require()
    _check(bits, bucket)
    x = _flat(x)
    n = x.numel()
    num_buckets = -(-n // bucket)
    packed, stats = _into(out, x.device, (packed_bytes(n, bits), torch.uint8), (2 * num_buckets, torch.float32))
    if n:
        rows, block, chunked, warps = _geometry(bucket)
        _launch(
            _maxmin_encode_kernel, (-(-num_buckets // rows),), x.device,
            x, packed, stats, n, bucket, num_buckets, _key32(key),
            BITS=bits, ROWS=rows, BLOCK=block, CHUNKED=chunked, STOCHASTIC=key is not None, num_warps=warps,
        )
    return packed, stats


def maxmin_decode(
    packed: torch.Tensor, stats: torch.Tensor, bits: int, bucket: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``min + level * scale`` per value, into ``out`` when given (added when ``accumulate``)."""
    _require()
    _check(bits, bucket)
    packed, stats = packed.reshape(-1).contiguous(), stats.reshape(-1).to(torch.float32).contiguous()
    out = _output(out, numel, packed.device, accumulate)
    if numel:
        rows, block, _, warps = _geometry(bucket)
        num_buckets = -(-numel // bucket)
        _launch(
            _maxmin_decode_kernel, (-(-num_buckets // rows),), packed.device,
            packed, stats, out, numel, bucket, num_buckets,
            BITS=bits, ROWS=rows, BLOCK=block, ACCUMULATE=accumulate, num_warps=warps,
        )
    return out


def qsgd_encode(
    x: torch.Tensor, bits: int, bucket: int, key: int, out: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes ``level | negative << (bits-1)`` and per-bucket L2 norms (see the reference),
    into ``out`` if given."""
    _require()
    _check(bits, bucket)
    x = _flat(x)
    n = x.numel()
    num_buckets = -(-n // bucket)
    packed, norms = _into(out, x.device, (packed_bytes(n, bits), torch.uint8), (num_buckets, torch.float32))
    if n:
        rows, block, chunked, warps = _geometry(bucket)
        _launch(
            _qsgd_encode_kernel, (-(-num_buckets // rows),), x.device,
            x, packed, norms, n, bucket, num_buckets, _key32(key),
            BITS=bits, ROWS=rows, BLOCK=block, CHUNKED=chunked, num_warps=warps,
        )
    return packed, norms


def qsgd_decode(
    packed: torch.Tensor, norms: torch.Tensor, bits: int, bucket: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``±level · (norm / s)`` per value, into ``out`` when given (added when ``accumulate``)."""
    _require()
    _check(bits, bucket)
    packed, norms = packed.reshape(-1).contiguous(), norms.reshape(-1).to(torch.float32).contiguous()
    out = _output(out, numel, packed.device, accumulate)
    if numel:
        rows, block, _, warps = _geometry(bucket)
        num_buckets = -(-numel // bucket)
        _launch(
            _qsgd_decode_kernel, (-(-num_buckets // rows),), packed.device,
            packed, norms, out, numel, bucket, num_buckets,
            BITS=bits, ROWS=rows, BLOCK=block, ACCUMULATE=accumulate, num_warps=warps,
        )
    return out


def sign_encode(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One bit per value, set where ``x >= 0`` in ``x``'s own dtype (NaN counts as negative);
    into ``out`` (contiguous, of that size) if given."""
    _require()
    x = _flat(x)
    n = x.numel()
    (packed,) = _into(None if out is None else (out,), x.device, (packed_bytes(n, 1), torch.uint8))
    if n:
        _launch(
            _sign_encode_kernel, (-(-n // _SIGN_BLOCK),), x.device, x, packed, n,
            BLOCK=_SIGN_BLOCK, TO_F32=x.dtype != torch.float64, num_warps=_WARPS,
        )
    return packed


def signum_encode(g: torch.Tensor, m: torch.Tensor, beta: float, finite: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Signum's step in one pass (``fused.signum_encode``): the fp32 momentum ``m`` (contiguous,
    as many values as ``g``) updated in place where the 0-dim ``finite`` (on the device: no host
    read) is true, and the sign bits of the new momentum, into ``out`` if given."""
    _require()
    g = g.reshape(-1).to(torch.float32).contiguous()
    n = g.numel()
    if m.dtype != torch.float32 or not m.is_contiguous() or m.numel() != n or m.device != g.device:
        raise ValueError(f"signum_encode: a contiguous fp32 momentum of {n} values on {g.device}")
    (packed,) = _into(None if out is None else (out,), g.device, (packed_bytes(n, 1), torch.uint8))
    if n:
        flag = finite.reshape(1).to(device=g.device)
        _launch(_signum_encode_kernel, (-(-n // _SIGN_BLOCK),), g.device, g, m, flag, packed, n, float(beta),
                1.0 - beta, BLOCK=_SIGN_BLOCK, num_warps=_WARPS)
    return packed


def saturate(y: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``y`` as fp16 or bf16 in one pass, finite values beyond the type's range clamped to
    its largest value (``reference.saturate``, bit for bit: both round to nearest even; a NaN
    stays NaN, its payload bits unspecified); into ``out`` (contiguous) if given."""
    _require()
    if y.dtype != torch.float32 or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"saturate takes fp32 to fp16 or bf16, got {y.dtype} to {dtype}")
    flat = y.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    out = torch.empty(y.shape, dtype=dtype, device=y.device) if out is None else _into((out,), y.device, (n, dtype))[0]
    if n:
        bf16 = dtype == torch.bfloat16
        _launch(
            _saturate_kernel, (-(-n // _SIGN_BLOCK),), y.device, flat, out.view(torch.int16) if bf16 else out, n,
            TOP=torch.finfo(dtype).max, BF16=bf16, BLOCK=_SIGN_BLOCK, num_warps=_WARPS,
        )
    return out


def sign_decode(
    packed: torch.Tensor, numel: int, scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``±1`` per bit (times the one-element ``scale``, read on the device: no host sync)."""
    _require()
    packed = packed.reshape(-1).contiguous()
    out = _output(out, numel, packed.device, accumulate)
    has_scale = scale is not None
    scale_t = scale.reshape(-1)[:1].to(device=packed.device, dtype=torch.float32) if has_scale else out
    if numel:
        _launch(
            _sign_decode_kernel, (-(-numel // _SIGN_BLOCK),), packed.device, packed, scale_t, out, numel,
            BLOCK=_SIGN_BLOCK, HAS_SCALE=has_scale, ACCUMULATE=accumulate, num_warps=_WARPS,
        )
    return out


def counter_uniform(numel: int, key: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """``rng.counter_uniform(numel, key, start=start)`` on ``device`` in one pass (torch's takes
    about ten)."""
    _require()
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel:
        _launch(_uniform_kernel, (-(-numel // _SIGN_BLOCK),), out.device, out, start, numel, _key32(key),
                BLOCK=_SIGN_BLOCK, num_warps=_WARPS)
    return out


def terngrad_encode(
    buckets: torch.Tensor, key: int, numel: int, scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TernGrad's packed 2-bit codes and per-bucket scales (see ``reference.terngrad_encode``):
    ``buckets`` fp32 ``(B, bucket)``, the draws ``counter_uniform(·, key)`` made in the kernel.
    The scales are torch's maxima (a reduction) unless given (fp32, one a bucket), the codes one
    pass, into ``out`` (contiguous bytes) if given."""
    _require()
    bucket = buckets.shape[1]
    if scale is None:
        scale = buckets.abs().amax(dim=1)
    elif scale.dtype != torch.float32 or scale.numel() != buckets.shape[0] or scale.device != buckets.device:
        raise ValueError(f"scale: {buckets.shape[0]} fp32 values on {buckets.device}, one a bucket")
    scale = scale.contiguous()
    x = buckets.reshape(-1).contiguous()
    (packed,) = _into(None if out is None else (out,), x.device, (packed_bytes(numel, 2), torch.uint8))
    if numel:
        _launch(
            _ternary_encode_kernel, (-(-numel // _SIGN_BLOCK),), x.device, x, scale, packed, numel, bucket, 0.0,
            _key32(key), BLOCK=_SIGN_BLOCK, STOCHASTIC=True, TO_F32=False, num_warps=_WARPS,
        )
    return packed, scale


def tbq_encode(x: torch.Tensor, tau: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """TBQ's packed 2-bit codes in one pass (see ``reference.tbq_encode``), into ``out``
    (contiguous bytes) if given; ``tau`` an fp32 value."""
    _require()
    x = x.reshape(-1).contiguous()
    numel = x.numel()
    (packed,) = _into(None if out is None else (out,), x.device, (packed_bytes(numel, 2), torch.uint8))
    if numel:
        _launch(
            _ternary_encode_kernel, (-(-numel // _SIGN_BLOCK),), x.device, x, x, packed, numel, 1, tau, 0,
            BLOCK=_SIGN_BLOCK, STOCHASTIC=False, TO_F32=x.dtype != torch.float32, num_warps=_WARPS,
        )
    return packed


def ternary_decode(
    packed: torch.Tensor, scale: torch.Tensor, bucket: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``{0, +1, −1} × scale`` per value in one pass (see ``reference.ternary_decode``)."""
    return _bucket_decode(_ternary_decode_kernel, packed, (), scale, bucket, numel, out, accumulate)


def _bucket_decode(
    kernel: Any, codes: torch.Tensor, tables: tuple, side: torch.Tensor, bucket: int, numel: int,
    out: torch.Tensor | None, accumulate: bool,
) -> torch.Tensor:
    """Launch an element-wise decoder ``kernel(codes, *tables, side, out, numel, bucket)``:
    ``side`` holds fp32 values per bucket (scales, means), the output is fp32."""
    _require()
    codes, side = codes.reshape(-1).contiguous(), side.reshape(-1).to(torch.float32).contiguous()
    out = _output(out, numel, codes.device, accumulate)
    if numel:
        _launch(
            kernel, (-(-numel // _SIGN_BLOCK),), codes.device, codes, *tables, side, out, numel, bucket,
            BLOCK=_SIGN_BLOCK, ACCUMULATE=accumulate, num_warps=_WARPS,
        )
    return out


def natural_codes(bits: torch.Tensor, key: int, top: torch.Tensor, bucket: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Natural compression's codes in one pass, the draws made in the kernel (see
    ``reference.natural_codes`` and ``reference.natural_draws``), under header ``top``: one, or
    one for each ``bucket`` values, into ``out`` (contiguous bytes) if given."""
    _require()
    bits = bits.reshape(-1).contiguous()
    numel = bits.numel()
    top = _headers(top, bucket, numel, bits.device)
    (out,) = _into(None if out is None else (out,), bits.device, (numel, torch.uint8))
    if numel:
        _launch(
            _natural_codes_kernel, (-(-numel // _SIGN_BLOCK),), bits.device, bits, top, out, numel, _key32(key),
            BLOCK=_SIGN_BLOCK, SHIFT=_shift_of(top, bucket), num_warps=_WARPS,
        )
    return out


def natural_decode(
    codes: torch.Tensor, top: torch.Tensor, bucket: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """Natural compression's fp32 values in one pass (see ``reference.natural_decode``), under
    header ``top``: one, or one for each ``bucket`` values."""
    _require()
    codes = codes.reshape(-1).contiguous()
    top = _headers(top, bucket, numel, codes.device)
    out = _output(out, numel, codes.device, accumulate)
    if numel:
        _launch(
            _natural_decode_kernel, (-(-numel // _SIGN_BLOCK),), codes.device, codes, top, out, numel,
            BLOCK=_SIGN_BLOCK, SHIFT=_shift_of(top, bucket), ACCUMULATE=accumulate, num_warps=_WARPS,
        )
    return out


def u8bit_codes(
    buckets: torch.Tensor, inv: torch.Tensor, mids: torch.Tensor, lut: torch.Tensor, numel: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """8-bit codes in one pass (see ``reference.u8bit_codes``), into ``out`` (contiguous
    bytes) if given."""
    _require()
    bucket = buckets.shape[1]
    x = buckets.reshape(-1).contiguous()
    (out,) = _into(None if out is None else (out,), x.device, (numel, torch.uint8))
    if numel:
        _launch(
            _u8bit_codes_kernel, (-(-numel // _SIGN_BLOCK),), x.device, x, inv.contiguous(), mids.contiguous(),
            lut.contiguous(), out, numel, bucket, BLOCK=_SIGN_BLOCK, num_warps=_WARPS,
        )
    return out


def table_decode(
    codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None, bucket: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """``table[code] × scale`` per value in one pass (see ``reference.table_decode``); without a
    ``scale``, ``table[code]`` (times 1: exact)."""
    tables = (table.to(torch.float32).contiguous(),)
    if scale is None:
        scale, bucket = table.new_ones(1, dtype=torch.float32), max(numel, 1)
    return _bucket_decode(_table_decode_kernel, codes, tables, scale, bucket, numel, out, accumulate)


def onebit_decode(
    packed: torch.Tensor, means: torch.Tensor, bucket: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """1-bit SGD's decode in one pass (see ``reference.onebit_decode``)."""
    return _bucket_decode(_onebit_decode_kernel, packed, (), means, bucket, numel, out, accumulate)


def _row_stats(xb: torch.Tensor, sides: bool) -> torch.Tensor:
    """:func:`row_maxima` or :func:`side_sums`: each program a tile of rows by one chunk of their
    columns (a long row in several chunks, so one row still fills the GPU), the chunks then
    reduced by torch (a few values a row)."""
    _require()
    if xb.dtype != torch.float32 or xb.dim() != 2:
        raise ValueError(f"row statistics: a 2-D fp32 tensor, got {xb.dim()}-D {xb.dtype}")
    if xb.stride(1) != 1:
        xb = xb.contiguous()
    rows, width = xb.shape
    if not rows or not width:  # (no values: a maximum of 0, sums and counts of 0, as the C loops give)
        return torch.zeros((rows, 3) if sides else (rows,), dtype=torch.float64 if sides else torch.float32,
                           device=xb.device)
    block = min(_SIGN_BLOCK, triton.next_power_of_2(width))
    tile = max(1, min(_SIGN_BLOCK // block, triton.next_power_of_2(rows)))
    chunk = block * -(-min(width, _ROW_CHUNK) // block)
    parts = -(-width // chunk)
    out = torch.empty((rows, parts, 3) if sides else (rows, parts), dtype=torch.float64 if sides else torch.float32,
                      device=xb.device)
    # (a row stride of 0, rows expanded from one, reads that one row each time)
    _launch(_row_stats_kernel, (-(-rows // tile) * parts,), xb.device, xb, out, rows, width, xb.stride(0),
            chunk, parts, SIDES=sides, ROWS=tile, BLOCK=block, num_warps=_WARPS)
    if parts == 1:
        return out.view(rows, 3) if sides else out.view(rows)
    return out.sum(dim=1) if sides else out.amax(dim=1)


def row_maxima(xb: torch.Tensor) -> torch.Tensor:
    """Each row's ``max |x|`` of the 2-D fp32 ``xb`` in one pass (``fused.row_maxima``; a NaN
    stays, as in ``amax``): exact, whatever the order."""
    return _row_stats(xb, False)


def side_sums(xb: torch.Tensor) -> torch.Tensor:
    """Each row's ``[sum of x < 0, sum of x >= 0, count of x >= 0]`` of the 2-D fp32 ``xb`` in
    fp64, ``(rows, 3)``, in one pass (``fused.side_sums``; the sums in another order than
    torch's, so their last fp64 bits may differ)."""
    return _row_stats(xb, True)


def select_magnitudes(
    x: torch.Tensor, threshold: float = 0.0, thresholds: torch.Tensor | None = None,
    valid: torch.Tensor | None = None, span: int = 256,
) -> torch.Tensor:
    """The ascending int64 indices of the values of ``x`` whose magnitude in fp32 reaches
    ``threshold`` (an fp32 value), or with ``thresholds`` (fp32, one a block of ``span``
    values) their block's, among each block's first ``valid`` (int32, one a block) values:
    ``torch.nonzero(|x| >= t)`` in two passes (counts, their prefix sums, the indices), the
    count read on the host in between (the size is the data's, as ``nonzero``'s)."""
    _require()
    x = x.reshape(-1).contiguous()
    numel, device = x.numel(), x.device
    if not numel:
        return torch.empty(0, dtype=torch.int64, device=device)
    programs = -(-numel // _SIGN_BLOCK)
    counts = torch.zeros(programs, dtype=torch.int32, device=device)
    per_block = thresholds is not None
    side = (thresholds, valid) if per_block else (x, x)
    meta = dict(BLOCK=_SIGN_BLOCK, PER_BLOCK=per_block, SPAN=span, num_warps=_WARPS)
    _launch(_select_kernel, (programs,), device, x, *side, counts, counts, counts, numel, threshold, WRITE=False, **meta)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    idx = torch.empty(int(ends[-1]), dtype=torch.int64, device=device)  # (the host read)
    _launch(_select_kernel, (programs,), device, x, *side, ends - counts, counts, idx, numel, threshold, WRITE=True, **meta)
    return idx


def inceptionn_encode(x: torch.Tensor, bound: float, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """INCEPTIONN's packed 2-bit tags and its byte stream (``reference.inceptionn_encode``, bit for
    bit): one pass for the tags and each program's byte count, their prefix sums, one pass
    writing the bytes. The stream's length depends on the data: read on the host (one device
    wait, as the torch version's ``nonzero``). ``bound`` and ``step`` (2 · bound) are fp32 values."""
    _require()
    x = x.reshape(-1).contiguous()
    numel, device = x.numel(), x.device
    short = x.dtype in (torch.float16, torch.bfloat16)
    if x.dtype == torch.float64:  # (handled as fp32, as the torch version does)
        x = x.float()
    packed = torch.empty(packed_bytes(numel, 2), dtype=torch.uint8, device=device)
    programs = -(-numel // _SIGN_BLOCK)
    if not numel:
        return packed, torch.empty(0, dtype=torch.uint8, device=device)
    counts = torch.zeros(programs, dtype=torch.int32, device=device)
    meta = dict(BLOCK=_SIGN_BLOCK, SHORT=short, BF16=x.dtype == torch.bfloat16, num_warps=_WARPS)
    _launch(_inceptionn_tags_kernel, (programs,), device, x, packed, counts, numel, bound, step, **meta)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    stream = torch.empty(int(ends[-1]), dtype=torch.uint8, device=device)  # (the host read)
    _launch(_inceptionn_stream_kernel, (programs,), device, x, ends - counts, stream, numel, bound, step, **meta)
    return packed, stream


def inceptionn_decode(
    packed: torch.Tensor, stream: torch.Tensor, dtype: torch.dtype, numel: int, step: float,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """INCEPTIONN's fp32 values from their tags and bytes (``reference.inceptionn_decode``, bit for
    bit), stored or added into ``out``: one pass counting each program's bytes, their prefix
    sums, one pass decoding (no host read)."""
    _require()
    packed, stream = packed.reshape(-1).contiguous(), stream.reshape(-1).contiguous()
    device = packed.device
    if packed.dtype != torch.uint8 or stream.dtype != torch.uint8 or stream.device != device or (
            packed.numel() < packed_bytes(numel, 2)):
        # (the kernels read through the pointers unchecked: a short or mistyped payload would be read past)
        raise ValueError(f"an INCEPTIONN payload of {numel} values: uint8 tags (at least "
                         f"{packed_bytes(numel, 2)} bytes) and a uint8 stream on one device, got "
                         f"{packed.numel()} {packed.dtype} on {device} and {stream.dtype} on {stream.device}")
    out = _output(out, numel, device, accumulate)
    if numel:
        programs = -(-numel // _SIGN_BLOCK)
        width = 2 if dtype in (torch.float16, torch.bfloat16) else 4
        counts = torch.empty(programs, dtype=torch.int32, device=device)
        _launch(_inceptionn_counts_kernel, (programs,), device, packed, counts, numel,
                BLOCK=_SIGN_BLOCK, WIDTH=width, num_warps=_WARPS)
        starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
        _launch(_inceptionn_decode_kernel, (programs,), device, packed, stream, starts, out, numel, step,
                BLOCK=_SIGN_BLOCK, WIDTH=width, BF16=dtype == torch.bfloat16, ACCUMULATE=accumulate,
                num_warps=_WARPS)
    return out


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of the flat ``x`` largest in magnitude: ``(values, indices)``, exactly.

    Output order: ascending index (not by magnitude, unlike ``torch.topk``), which is also what a
    sparse payload wants. Ties at the k-th magnitude are broken towards the lowest indices; NaN
    ranks above every number, as in ``torch.topk``. ``values`` are the signed entries of ``x`` in
    its dtype, ``indices`` int64.

    Sparsifiers keep about 1 % of a layer, so k runs into the hundreds of thousands; the work
    here does not grow with k. A radix select, four histogram passes over the 8-bit digits of
    the fp32 bits of ``|x|`` (ordered like the magnitudes), finds the k-th largest key ``t`` and
    how many ties at ``t`` are needed; one pass counts, per block, the keys above and at ``t``,
    one small program scans those counts, and a last pass writes the kept entries to their
    scanned offsets. Seven streaming passes over ``x``, no sort, no host synchronisation.
    """
    _require()
    x = x.reshape(-1).contiguous()
    n = x.numel()
    if x.dtype not in _TOPK_FLOATS:
        raise ValueError(f"topk takes fp16, bf16 or fp32 tensors, got {x.dtype}")
    if n >= 2**31:
        raise ValueError("topk counts in int32: at most 2**31 - 1 values")
    if not 0 <= k <= n:
        raise ValueError(f"k must be in 0..{n}, got {k}")
    device = x.device
    values = torch.empty(k, dtype=x.dtype, device=device)
    indices = torch.empty(k, dtype=torch.int64, device=device)
    if k == 0:
        return values, indices
    blocks = -(-n // TOPK_BLOCK)
    state = torch.zeros(2, dtype=torch.int32, device=device)
    state[1] = k
    hist = torch.zeros(4, 256, dtype=torch.int32, device=device)
    for p, shift in enumerate((24, 16, 8, 0)):
        _launch(_radix_hist_kernel, (blocks,), device, x, n, state, hist[p], SHIFT=shift, BLOCK=TOPK_BLOCK, num_warps=_WARPS)
        _launch(_radix_select_kernel, (1,), device, state, hist[p], SHIFT=shift)
    counts = torch.empty(2 * blocks, dtype=torch.int32, device=device)
    offsets = torch.empty(2 * blocks, dtype=torch.int32, device=device)
    _launch(_topk_count_kernel, (blocks,), device, x, n, state, counts, BLOCK=TOPK_BLOCK, num_warps=_WARPS)
    _launch(_topk_offsets_kernel, (1,), device, counts, offsets, state, blocks, SCAN=1024)
    _launch(_topk_write_kernel, (blocks,), device, x, n, state, offsets, values, indices, BLOCK=TOPK_BLOCK, num_warps=_WARPS)
    return values, indices


# ------------------------------------------------------- FP8 and microscaling (MX) formats
# (mantissa bits, exponent bias, sign bit, largest finite value, special codes)
_FORMATS = {
    "e4m3": (3, 7, 7, 448.0, 1),
    "e5m2": (2, 15, 7, 57344.0, 2),
    "e2m1": (1, 1, 3, 6.0, 0),
}
_MX_EMAX = {"e4m3": 8, "e2m1": 2}


def fp8_encode(
    x: torch.Tensor, fmt: str, block: int, out: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes (one byte per value) and per-block fp32 scales (see ``reference.fp8_encode``),
    into ``out`` (contiguous, of those sizes) if given."""
    _require()
    _check(8, block)
    mbits, ebias, _, top, _ = _FORMATS[fmt]
    x = _flat(x)
    n = x.numel()
    num_buckets = -(-n // block)
    codes, scales = _into(out, x.device, (n, torch.uint8), (num_buckets, torch.float32))
    if n:
        rows, width, chunked, warps = _geometry(block)
        _launch(
            _fp8_encode_kernel, (-(-num_buckets // rows),), x.device, x, codes, scales, n, block, num_buckets,
            MBITS=mbits, EBIAS=ebias, TOP=top, ROWS=rows, BLOCK=width, CHUNKED=chunked, num_warps=warps,
        )
    return codes, scales


def fp8_decode(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``value(code) * s`` per value, into ``out`` when given (added when ``accumulate``)."""
    _require()
    _check(8, block)
    mbits, ebias, _, _, special = _FORMATS[fmt]
    codes, scales = codes.reshape(-1).contiguous(), scales.reshape(-1).to(torch.float32).contiguous()
    out = _output(out, numel, codes.device, accumulate)
    if numel:
        rows, width, _, warps = _geometry(block)
        num_buckets = -(-numel // block)
        _launch(
            _fp8_decode_kernel, (-(-num_buckets // rows),), codes.device, codes, scales, out, numel, block, num_buckets,
            MBITS=mbits, EBIAS=ebias, SPECIAL=special, ROWS=rows, BLOCK=width, ACCUMULATE=accumulate, num_warps=warps,
        )
    return out


def _check_mx(block: int) -> None:
    if block % 32 or not 0 < block <= MAX_BUCKET:
        raise ValueError(f"MX blocks are multiples of 32 values up to {MAX_BUCKET}, got {block}")


def mx_encode(
    x: torch.Tensor, elem: str, block: int, out: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX element codes (e4m3 one per byte, e2m1 two per byte) and E8M0 scale codes, into
    ``out`` (contiguous, of those sizes) if given."""
    _require()
    _check_mx(block)
    mbits, ebias, sign_at, top, _ = _FORMATS[elem]
    x = _flat(x)
    n = x.numel()
    num_buckets = -(-n // block)
    pack4 = elem == "e2m1"
    codes, scales = _into(out, x.device, ((n + 1) // 2 if pack4 else n, torch.uint8), (num_buckets, torch.uint8))
    if n:
        rows, width, chunked, warps = _geometry(block)
        _launch(
            _mx_encode_kernel, (-(-num_buckets // rows),), x.device, x, codes, scales, n, block, num_buckets,
            MBITS=mbits, EBIAS=ebias, SIGN_AT=sign_at, EMAX=_MX_EMAX[elem], TOP=top, PACK4=pack4,
            ROWS=rows, BLOCK=width, CHUNKED=chunked, num_warps=warps,
        )
    return codes, scales


def mx_decode(
    codes: torch.Tensor, scales: torch.Tensor, elem: str, block: int, numel: int,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``value(element) * 2**(scale - 127)`` per value, into ``out`` when given."""
    _require()
    _check_mx(block)
    mbits, ebias, sign_at, _, special = _FORMATS[elem]
    codes, scales = codes.reshape(-1).contiguous(), scales.reshape(-1).contiguous()
    out = _output(out, numel, codes.device, accumulate)
    if numel:
        rows, width, _, warps = _geometry(block)
        num_buckets = -(-numel // block)
        _launch(
            _mx_decode_kernel, (-(-num_buckets // rows),), codes.device, codes, scales, out, numel, block, num_buckets,
            MBITS=mbits, EBIAS=ebias, SIGN_AT=sign_at, SPECIAL=special, PACK4=elem == "e2m1",
            ROWS=rows, BLOCK=width, ACCUMULATE=accumulate, num_warps=warps,
        )
    return out
