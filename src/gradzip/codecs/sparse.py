"""Sparsification codecs: top-k and random-k."""
from __future__ import annotations

import math
from typing import List, Sequence

import torch

from ..kernels import shared_generator
from .base import SEED, Codec, Meta, Option, Payload, element_size, float_in
from .registry import register_codec

RATIO = Option(0.01, float_in(0.0, 1.0, lo_open=True), "a float in (0, 1]", "fraction of values sent")


def _k(numel: int, ratio: float) -> int:
    return max(1, min(numel, math.ceil(numel * ratio)))


@register_codec
class TopK(Codec):
    """Top-k sparsification (Aji & Heafield, EMNLP'17; Stich et al., NeurIPS'18).

    Sends the ``k = ceil(ratio * numel)`` values of largest magnitude (in the gradient's dtype)
    and their int32 indices. Biased: use it with error feedback (``memory="residual"``, the
    default), which keeps what was not sent for later steps. Payloads have different indices on
    every rank, so they are all-gathered and scattered into one dense sum.

    Options: ``ratio`` (default 0.01). Wire: ``k * (value bytes + 4)``.
    """

    name = "topk"
    family = "sparsification"
    paper = "Aji & Heafield, Sparse Communication for Distributed Gradient Descent, EMNLP'17"
    collectives = ("allgather",)
    default_memory = "residual"
    options = {"ratio": RATIO}

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        k = _k(x.numel(), self.ratio)
        _, idx = torch.topk(x.abs(), k, sorted=False)
        return [x[idx], idx.to(torch.int32)]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        values, idx = tensors
        out = torch.zeros(meta.numel, dtype=values.dtype, device=values.device)
        return out.index_copy_(0, idx.long(), values)

    def aggregate(self, payloads: Sequence[Payload]) -> torch.Tensor:
        meta = payloads[0].ctx
        out = torch.zeros(meta.numel, dtype=torch.float32, device=meta.device)
        for p in payloads:  # rank order: the same float sums on every rank
            values, idx = p.tensors
            out.index_add_(0, idx.long(), values.float())
        return (out / len(payloads)).reshape(meta.shape).to(meta.dtype)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _k(numel, self.ratio) * (element_size(dtype) + 4)


@register_codec
class RandomK(Codec):
    """Random-k sparsification (Stich et al., Sparsified SGD with Memory, NeurIPS'18).

    Sends ``k = ceil(ratio * numel)`` values at indices drawn (uniformly, with replacement) from a
    generator seeded by (seed, step, tensor name). Every rank draws the same indices, so only the
    values travel and they are summed by a plain all-reduce. Biased unless ``scale=True``
    (each drawn value counts ``numel / k`` times, which makes the estimate exactly unbiased);
    the default error feedback keeps what was not sent.

    Options: ``ratio`` (default 0.01), ``seed``, ``scale`` (default False).
    """

    name = "randomk"
    family = "sparsification"
    paper = "Stich et al., Sparsified SGD with Memory, NeurIPS'18"
    collectives = ("allreduce", "allgather")
    default_memory = "residual"
    summable = True
    options = {
        "ratio": RATIO,
        "seed": SEED,
        "scale": Option(False, lambda v: isinstance(v, bool), "True or False", "rescale by numel/k"),
    }

    def _indices(self, meta: Meta) -> torch.Tensor:
        idx = meta.extra.get("indices")
        if idx is None:
            gen = shared_generator(self.seed, meta.step, meta.name, meta.device)
            k = _k(meta.numel, self.ratio)
            idx = torch.randint(0, meta.numel, (k,), generator=gen, device=meta.device)
            meta.extra["indices"] = idx
        return idx

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return [x[self._indices(meta)]]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        values = tensors[0]
        out = torch.zeros(meta.numel, dtype=values.dtype, device=values.device)
        if self.scale:  # each draw adds x_j * n/k: exactly unbiased, duplicates included
            return out.index_add_(0, self._indices(meta), values, alpha=meta.numel / values.numel())
        return out.index_copy_(0, self._indices(meta), values)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _k(numel, self.ratio) * element_size(dtype)
