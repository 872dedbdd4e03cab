"""Quantization codecs: casts (none, fp16, bf16), CGX max-min and QSGD."""
from __future__ import annotations

from typing import List

import torch

from ..kernels import bucket_view, pack_bits, packed_bytes, unpack_bits
from .base import SEED, Codec, Meta, Option, element_size, int_in, one_of
from .registry import register_codec


class _Cast(Codec):
    """Send the gradient as another floating-point type; payloads sum directly."""

    family = "cast"
    collectives = ("allreduce", "allgather")
    summable = True
    wire_dtype: torch.dtype | None = None

    def _wdtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype or dtype

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return [x.to(self._wdtype(x.dtype))]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return tensors[0]

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

    As in GRACE (Xu et al., ICDCS'21) and PyTorch's ``fp16_compress_hook``. Values beyond
    ±65504 overflow to ±inf; the collective averages before summing to keep sums in range.
    """

    name = "fp16"
    paper = "Micikevicius et al., Mixed Precision Training, ICLR'18; GRACE, ICDCS'21"
    wire_dtype = torch.float16


@register_codec
class BF16(_Cast):
    """bfloat16 on the wire: 2 bytes per element, fp32's range with 8 bits of mantissa."""

    name = "bf16"
    paper = "Kalamkar et al., A Study of BFLOAT16 for Deep Learning Training, 2019"
    wire_dtype = torch.bfloat16


def _round(v: torch.Tensor, stochastic: bool, gen: torch.Generator) -> torch.Tensor:
    """Round ``v`` to integers, stochastically (unbiased) or to the nearest."""
    if stochastic:
        noise = torch.rand(v.shape, generator=gen, device=v.device, dtype=v.dtype)
        return (v + noise).floor_()
    return v.round()


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
    options = {
        "bits": Option(4, int_in(1, 8), "an integer in 1..8", "bits per value"),
        "bucket_size": Option(1024, int_in(1), "a positive integer", "values sharing one min/max"),
        "mode": Option("stochastic", one_of("stochastic", "nearest"), "'stochastic' or 'nearest'", "rounding"),
        "seed": SEED,
    }

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        buckets = bucket_view(x.float(), self.bucket_size)
        lo, hi = torch.aminmax(buckets, dim=1)
        scale = (hi - lo) / ((1 << self.bits) - 1)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        v = (buckets - lo[:, None]) * inv[:, None]
        levels = _round(v, self.mode == "stochastic", self._generator(x.device))
        levels = levels.clamp_(0, (1 << self.bits) - 1).to(torch.uint8).reshape(-1)[: x.numel()]
        return [pack_bits(levels, self.bits), torch.stack([lo, scale], dim=1).reshape(-1)]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        packed, stats = tensors
        n = meta.numel
        levels = unpack_bits(packed, self.bits, n).float()
        stats = stats.view(-1, 2)
        levels = bucket_view(levels, self.bucket_size)
        out = torch.addcmul(stats[:, :1], levels, stats[:, 1:])
        return out.reshape(-1)[:n]

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        buckets = -(-numel // self.bucket_size)
        return packed_bytes(numel, self.bits) + buckets * 2 * 4


@register_codec
class QSGD(Codec):
    """QSGD stochastic quantization (Alistarh et al., QSGD, NeurIPS'17).

    Each bucket of ``bucket_size`` values keeps its L2 norm (fp32); each value is sent as a sign
    bit and a level in ``0..s`` with ``s = 2**(bits-1) - 1``, rounded stochastically so the
    decoded value ``norm * sign * level / s`` is unbiased. Sign and level are packed together
    into ``bits`` bits.

    Options: ``bits`` (2..8, default 4), ``bucket_size`` (default 512, as in the paper), ``seed``.
    Collectives: ``allgather`` (default) or ``sra``.
    """

    name = "qsgd"
    family = "quantization"
    paper = "Alistarh et al., QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding, NeurIPS'17"
    collectives = ("allgather", "sra")
    stochastic = True
    options = {
        "bits": Option(4, int_in(2, 8), "an integer in 2..8", "bits per value, sign included"),
        "bucket_size": Option(512, int_in(1), "a positive integer", "values sharing one norm"),
        "seed": SEED,
    }

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        s = (1 << (self.bits - 1)) - 1
        buckets = bucket_view(x.float(), self.bucket_size)
        pad = buckets.numel() - x.numel()
        if pad:  # the pad (a fresh copy) repeats a value, which would inflate the tail's norm
            buckets.view(-1)[x.numel():] = 0
        norms = torch.linalg.vector_norm(buckets, dim=1)
        inv = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        v = buckets.abs() * inv[:, None]
        levels = _round(v, True, self._generator(x.device)).clamp_(0, s).to(torch.uint8)
        signs = (buckets < 0).to(torch.uint8) << (self.bits - 1)
        codes = (levels | signs).reshape(-1)[: x.numel()]
        return [pack_bits(codes, self.bits), norms]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        packed, norms = tensors
        n = meta.numel
        s = (1 << (self.bits - 1)) - 1
        codes = unpack_bits(packed, self.bits, n)
        levels = (codes & s).float()
        signs = 1.0 - 2.0 * (codes >> (self.bits - 1)).float()
        vals = bucket_view(levels * signs, self.bucket_size)
        return (vals * (norms / s)[:, None]).reshape(-1)[:n]

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        buckets = -(-numel // self.bucket_size)
        return packed_bytes(numel, self.bits) + buckets * 4
