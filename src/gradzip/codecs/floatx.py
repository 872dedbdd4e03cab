"""Low-precision floating-point codecs: FP8 with per-block scales, and the OCP Microscaling (MX)
formats MXFP8 and MXFP4.

Unlike max-min's uniform levels, a float format spends its bits on a logarithmic grid, so small
values of a block keep their relative precision next to large ones. The element casts round to
nearest, ties to even, and saturate: a finite value beyond the format's range becomes its
largest finite value, never ±inf or NaN. All three are deterministic and their payload size
depends only on the number of values; the kernels (fused C on CPU, Triton on CUDA, torch
elsewhere) produce the same bytes.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from ..kernels import fused
from .base import Codec, Meta, Option, Payload, int_in, one_of, stats_nonfinite
from .registry import register_codec


def _multiple_of_32(v: Any) -> bool:
    return int_in(32, fused.MX_MAX_BLOCK)(v) and v % 32 == 0


class _BlockFloat(Codec):
    """What the three codecs share: blocks of values, one scale each, fixed-size payloads."""

    family = "quantization"
    collectives = ("sra", "allgather")
    default_memory = "none"
    summable = False
    stochastic = False
    fixed_size = True

    def fusion_block(self) -> int:
        return self.block_size

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)


@register_codec
class FP8(_BlockFloat):
    """FP8 with one fp32 scale per block (Peng et al., FP8-LM, 2023; formats of Micikevicius et
    al., FP8 Formats for Deep Learning, 2022).

    The flat gradient is cut into blocks of ``block_size`` values. A block's scale is
    ``s = max(amax / M, 2**-126)`` (fp32; ``amax`` its largest ``|x|``; ``M`` = 448 for ``e4m3``,
    57344 for ``e5m2``), so its largest value maps to the format's largest finite value; each
    value is sent as the 8-bit float nearest ``x / s`` (fp32 ``x · (1 / s)``, ties to even,
    clamped to ``±M``) and decodes to ``code · s`` (clamped to the fp32 range). The floor keeps
    ``1 / s`` finite: an all-zero block decodes to zeros, and a block of fp32 subnormals keeps
    fp8's relative precision down to ``2**-132``. Up to fp32 rounding of ``1 / s``, the error of
    a value is at most half an fp8 step at its magnitude: ``2**-4 |x|`` (e4m3) or ``2**-3 |x|``
    (e5m2) in the normal range, and ``2**-10 s`` (e4m3) or ``2**-17 s`` (e5m2) below it.

    Options: ``format`` (``"e4m3"``, default: more precision; ``"e5m2"``: more range),
    ``block_size`` (default 128, any positive integer; blocks above 65536 values run the torch
    kernels). Wire: 1 byte per value + one fp32 scale per block (8.25 bits per value by default);
    where that exceeds the raw tensor (blocks of 1 value, or under 4 for 16-bit input) the tensor
    goes as it is. Collectives: ``sra`` (default) or ``allgather``.
    """

    name = "fp8"
    paper = (
        "Peng et al., FP8-LM: Training FP8 Large Language Models, 2023; "
        "Micikevicius et al., FP8 Formats for Deep Learning, 2022"
    )
    options = {
        "format": Option("e4m3", one_of("e4m3", "e5m2"), "'e4m3' or 'e5m2'", "the 8-bit float format"),
        "block_size": Option(128, int_in(1), "a positive integer", "values sharing one fp32 scale"),
    }

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return list(fused.fp8_encode(x, self.format, self.block_size))

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, numel), (torch.float32, self._blocks(numel))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: List[torch.Tensor]) -> List[torch.Tensor]:
        return list(fused.fp8_encode(x, self.format, self.block_size, out))

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return fused.fp8_decode(*tensors, self.format, self.block_size, meta.numel)

    def _decode_into(
        self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool
    ) -> torch.Tensor:
        return fused.fp8_decode(*tensors, self.format, self.block_size, out.numel(), out, accumulate)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel + 4 * self._blocks(numel)

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """From the scales: a block's ``amax`` (the largest of its magnitudes' bits, NaN's the
        largest, in every kernel) makes its scale NaN or infinite exactly where it held NaN or
        ±inf (in fp32, so an fp64 value beyond its range is an inf, and flagged, as max-min's)."""
        return stats_nonfinite(payload, 1)


class _MX(_BlockFloat):
    """OCP Microscaling: blocks share one E8M0 (power-of-two) scale; see the subclasses."""

    paper = (
        "Rouhani et al., Microscaling Data Formats for Deep Learning, 2023; "
        "OCP Microscaling Formats (MX) Specification v1.0, 2023"
    )
    element = ""
    bits = 8
    options = {
        "block_size": Option(
            32, _multiple_of_32, f"a multiple of 32 in 32..{fused.MX_MAX_BLOCK}",
            "values sharing one scale (the specification's 32, or a multiple of it)",
        ),
    }

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return list(fused.mx_encode(x, self.element, self.block_size))

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> List[Tuple[torch.dtype, int]]:
        return [(torch.uint8, numel if self.bits == 8 else (numel + 1) // 2), (torch.uint8, self._blocks(numel))]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: List[torch.Tensor]) -> List[torch.Tensor]:
        return list(fused.mx_encode(x, self.element, self.block_size, out))

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return fused.mx_decode(*tensors, self.element, self.block_size, meta.numel)

    def _decode_into(
        self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool
    ) -> torch.Tensor:
        return fused.mx_decode(*tensors, self.element, self.block_size, out.numel(), out, accumulate)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return (numel if self.bits == 8 else (numel + 1) // 2) + self._blocks(numel)

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """From the scales: a block holding NaN or ±inf gets the E8M0 code 255 (NaN), which no
        finite block's scale takes (at most 254); an fp64 value beyond fp32's range is an inf."""
        t = payload.tensors
        return (t[1] == 255).any() if len(t) > 1 else None


@register_codec
class MXFP8(_MX):
    """MXFP8: OCP Microscaling with FP8 e4m3 elements (Rouhani et al., Microscaling Data Formats
    for Deep Learning, 2023; OCP MX Specification v1.0).

    Each block of ``block_size`` values (32 in the specification) shares one 8-bit power-of-two
    scale (E8M0, bias 127): the shared exponent is ``floor(log2(amax)) - 8``, 8 being the
    exponent of e4m3's largest power of two, clamped to E8M0's range (-127..127). Elements are
    ``x / 2**shared`` cast to e4m3 (round to nearest even, saturating at ±448: as in the
    specification, a block's values in ``[448, 512) · 2**shared`` are clamped, a relative error
    of up to 12.5 % on them), and decode to ``element · 2**shared``, exactly. An all-zero block
    gets scale code 0 and decodes to zeros; a block with NaN or ±inf gets E8M0's NaN (255).

    Options: ``block_size`` (default 32; a multiple of 32). Wire: 1 byte per value + 1 byte per
    block (8.25 bits per value). Collectives: ``sra`` (default) or ``allgather``.
    """

    name = "mxfp8"
    element = "e4m3"
    bits = 8


@register_codec
class MXFP4(_MX):
    """MXFP4: OCP Microscaling with FP4 e2m1 elements, two per byte (Rouhani et al., Microscaling
    Data Formats for Deep Learning, 2023; OCP MX Specification v1.0).

    Each block of ``block_size`` values (32 in the specification) shares one E8M0 scale with
    shared exponent ``floor(log2(amax)) - 2``; elements are ``x / 2**shared`` rounded to the
    nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to the even code, saturating at ±6, which
    clamps a block's values in ``[6, 8) · 2**shared``), and decode to ``element · 2**shared``.
    An all-zero block gets scale code 0 and decodes to zeros; a block with NaN or ±inf gets 255.

    Options: ``block_size`` (default 32; a multiple of 32). Wire: 4 bits per value packed two per
    byte (value ``i`` in the low nibble when ``i`` is even; ``ceil(n / 2)`` bytes) + 1 byte per
    block (4.25 bits per value). Collectives: ``sra`` (default) or ``allgather``; with a
    ``residual`` memory it keeps more of the gradient over steps.
    """

    name = "mxfp4"
    element = "e2m1"
    bits = 4

