"""Sign codecs: signSGD with majority vote and EF-signSGD. One bit per element on the wire."""
from __future__ import annotations

from typing import List, Sequence

import torch

from ..kernels import pack_bits, packed_bytes, unpack_bits
from .base import Codec, Meta, Payload
from .registry import register_codec


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    return pack_bits((x >= 0).to(torch.uint8), 1)


def _signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """±1.0 from packed sign bits."""
    return unpack_bits(packed, 1, numel).float().mul_(2).sub_(1)


@register_codec
class SignSGD(Codec):
    """signSGD with majority vote (Bernstein et al., ICML'18 and ICLR'19).

    Each rank sends one bit per element (the sign; zero counts as +). The aggregate is the
    majority vote ``sign(sum of signs)`` — entries where the vote ties become 0 — so the update
    has unit magnitude and the learning rate sets the step size. Collective: ``allgather``.
    """

    name = "signsgd"
    family = "sign"
    paper = "Bernstein et al., signSGD: Compressed Optimisation for Non-Convex Problems, ICML'18"
    collectives = ("allgather",)

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return [_sign_bits(x)]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        return _signs(tensors[0], meta.numel)

    def aggregate(self, payloads: Sequence[Payload]) -> torch.Tensor:
        meta = payloads[0].ctx
        votes = torch.zeros(meta.numel, dtype=torch.float32, device=meta.device)
        for p in payloads:
            votes += _signs(p.tensors[0], meta.numel)
        return votes.sign_().reshape(meta.shape).to(meta.dtype)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return packed_bytes(numel, 1)


@register_codec
class EFSignSGD(Codec):
    """EF-signSGD (Karimireddy et al., Error Feedback Fixes SignSGD, ICML'19).

    Sends the sign bits plus one fp32 scale ``||x||_1 / numel`` so the decoded value
    ``scale * sign(x)`` keeps the gradient's magnitude; the error-feedback memory (default
    ``efsign``) carries the difference into the next step. Decoded payloads are averaged.
    Collective: ``allgather``.
    """

    name = "efsignsgd"
    family = "sign"
    paper = "Karimireddy et al., Error Feedback Fixes SignSGD and other Gradient Compression Schemes, ICML'19"
    collectives = ("allgather",)
    default_memory = "efsign"

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        scale = x.float().abs().mean().reshape(1)
        return [_sign_bits(x), scale]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        packed, scale = tensors
        return _signs(packed, meta.numel).mul_(scale)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return packed_bytes(numel, 1) + 4
