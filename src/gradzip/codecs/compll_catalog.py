"""Catalogue codecs re-written with the CompLL primitives (:mod:`gradzip.codecs.compll`).

Each is a few lines of ``compress``/``decompress`` and produces the same bytes and the same
decoded values as its hand-written twin (``terngrad``, ``tbq``, ``onebit``), which the tests
check bit for bit. They are registered as ``cl_terngrad``, ``cl_tbq`` and ``cl_onebit``.
"""
from __future__ import annotations

import torch

from . import compll as cl
from ..kernels import packed_bytes
from .quantize import TBQ, TernGrad
from .sign import OneBit


def _ternary(code: torch.Tensor, scale) -> torch.Tensor:
    """2-bit codes 0/1/2 → 0/+scale/−scale."""
    return ((code & 1).to(torch.int8) - (code >> 1).to(torch.int8)).float() * scale


@cl.register
class CLTernGrad(cl.CompLLCodec):
    """TernGrad (Wen et al., NeurIPS'17) in CompLL: same options and output as ``terngrad``.

    Speed on CUDA (compiled): the encode reads the input twice (the scale is a reduction) and
    its draws are a tensor of their own, where ``terngrad``'s kernel draws as it codes; an H200
    encoded at 28% and decoded at 41% of a device copy (``docs/bench/gpu-codecs-h200.json``).
    """

    name, family, paper, stochastic = "cl_terngrad", "quantization", TernGrad.paper, True
    collectives, options, by_parts = TernGrad.collectives, TernGrad.options, True
    memory_problem = TernGrad.memory_problem  # (its error reaches the scale too: no error feedback)

    def compress(self, x, ctx):
        scale = cl.reduce(x, "absmax", self.bucket_size, ctx).reshape(-1)
        s, rand = cl.spread(scale, ctx, self.bucket_size), cl.random(ctx, x.numel())
        keep_shift = cl.map(lambda v, s, r: (r < v.abs() / s).to(torch.uint8) << (v < 0).to(torch.uint8), x, s, rand)
        return [cl.pack(keep_shift, 2), scale]

    def decompress(self, wire, ctx):
        return cl.map(_ternary, cl.unpack(wire[0], 2, ctx.numel), cl.spread(wire[1], ctx, self.bucket_size))

    def fusion_block(self):
        return self.bucket_size  # buckets are encoded apart (0, a scale a tensor: a group by its parts)

    def unit_size(self):
        return self.bucket_size

    def _wire_bytes(self, numel, dtype):
        return packed_bytes(numel, 2) + 4 * -(-numel // (self.bucket_size or numel))


@cl.register
class CLTBQ(cl.CompLLCodec):
    """Threshold binary quantization (Strom'15; HiPress) in CompLL: same output as ``tbq``.

    Speed on CUDA (compiled): the decode unpacks the codes into a tensor of their own before
    the map reads them; an H200 encoded at 71% and decoded at 28% of a device copy
    (``docs/bench/gpu-codecs-h200.json``).
    """

    name, family, paper, wire_bits, block = "cl_tbq", "quantization", TBQ.paper, 2, 4  # (a code a value)
    collectives, options, default_memory = TBQ.collectives, TBQ.options, TBQ.default_memory
    reencodable = TBQ.reencodable

    def __init__(self, **opts):
        super().__init__(**opts)
        self.tau = torch.tensor(self.threshold, dtype=torch.float32).item()  # τ rounded to fp32 once

    def compress(self, x, ctx):
        t = self.tau
        return [cl.pack(cl.map(lambda v: (v > t).to(torch.uint8) | ((v < -t).to(torch.uint8) << 1), x), 2)]

    def decompress(self, wire, ctx):
        return cl.map(_ternary, cl.unpack(wire[0], 2, ctx.numel), self.tau)


@cl.register
class CLOneBit(cl.CompLLCodec):
    """1-bit SGD (Seide et al., Interspeech'14) in CompLL: same output as ``onebit``.

    Speed on CUDA (compiled): its bucket means are fp64 sums, as ``onebit``'s; an H200 encoded
    at 23% and decoded at 34% of a device copy (``docs/bench/gpu-codecs-h200.json``).
    """

    name, family, paper, by_parts = "cl_onebit", "sign", OneBit.paper, True
    collectives, options, default_memory = OneBit.collectives, OneBit.options, OneBit.default_memory

    def compress(self, x, ctx):
        size, neg = self.bucket_size, cl.map(lambda v: v < 0, x)
        # fp64 sums, as onebit: values near the fp32 maximum must not overflow them
        sums = [cl.reduce(x.clamp(max=0).double(), "sum", size, ctx), cl.reduce(x.clamp(min=0).double(), "sum", size, ctx)]
        negatives = cl.reduce(neg.long(), "sum", size, ctx)
        counts = [negatives, cl.count(ctx, size) - negatives]
        means = [(s / c.clamp_min(1)).float().reshape(-1) for s, c in zip(sums, counts)]
        return [cl.pack(cl.map(lambda v: v >= 0, x).to(torch.uint8), 1), torch.stack(means, 1).reshape(-1)]

    def decompress(self, wire, ctx):
        mn, mp = (cl.spread(wire[1].view(-1, 2)[:, i], ctx, self.bucket_size) for i in (0, 1))
        return cl.map(lambda b, mp, mn: b * mp + (1 - b) * mn, cl.unpack(wire[0], 1, ctx.numel).float(), mp, mn)

    def unit_size(self):
        return self.bucket_size

    def _wire_bytes(self, numel, dtype):
        size = self.bucket_size if 0 < self.bucket_size < numel else numel
        return packed_bytes(numel, 1) + 8 * -(-numel // size)
