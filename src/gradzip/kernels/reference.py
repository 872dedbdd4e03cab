"""The hot codec kernels written in plain torch: the specification of their wire formats.

Max-min (CGX), QSGD and sign packing are where encode/decode time goes, so each has faster
versions (:mod:`.native` for CPU, :mod:`.gpu` in Triton) that must produce the same bytes. These
functions define what "the same" means and run wherever no faster version does. Inputs are flat
contiguous tensors of a floating dtype; ``key`` is a 32-bit key for :func:`~.rng.counter_uniform`
(stochastic rounding), or ``None`` for round-to-nearest.
"""
from __future__ import annotations

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
    return out.add_(values) if accumulate else out.copy_(values)


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
    scale = torch.where(big, (hi / q - lo / q).clamp_(max=FLT_MAX), span / q)
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
    vals = vals * (norms / s)[:, None]
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
