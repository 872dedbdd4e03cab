"""A compressed reduce-scatter: the first half of SRA, on its own (for sharded training).

FSDP2 reduces each unit's gradients with a reduce-scatter: the input is every rank's chunk in
rank order (``W × c`` values), the output this rank's averaged chunk (``c`` values). Here each
rank encodes its W chunks, sends chunk j to rank j (one all-to-all, the same as
:class:`~gradzip.comm.sra.ScatterReduceAllGather`'s first phase), and decodes and averages the
W payloads of its own chunk straight into the output. Values are quantised once (SRA's
all-gather, which would quantise the average again, is not needed); traffic per rank is
``(W−1)/W`` of one encoding. Every payload carries its sender's non-finite flag for its whole
input, so every rank learns the same flag. ZeRO++'s qgZ and QSDP reduce-scatter quantised
gradients the same way (Wang et al., 2023; Markov et al., ICML'23).

It is not one of the all-reduce collectives a DDP hook may name (its result is a shard): the
engine runs it through :meth:`gradzip.sync.engine.Communicator.reduce_scatter`.
"""
from __future__ import annotations

from typing import List

import torch

from .base import Call, Exchanged, Stages
from .sra import ScatterReduceAllGather


class CompressedReduceScatter(ScatterReduceAllGather):
    """Compressed reduce-scatter of a ``W × c`` flat input into a ``c``-value output."""

    name = "reduce-scatter"
    reads_input_first = False  # its exchange is its own: it writes ``out`` (a shard) directly

    def supports(self, codec) -> bool:
        # every rank decodes and sums the others' payloads of its chunk, which must have a size
        # known up front (one all-to-all): what an all-gather or SRA of the codec needs too
        return codec.fixed_size and bool({"allgather", "sra"} & set(codec.collectives))

    def fused_length(self, numel: int, align: int, device: torch.device) -> int:
        return numel  # (its output is a shard of the input as given: no zeros added)

    def exchange(self, call: Call) -> Stages:
        x = call.flat
        w = call.world_size
        if x.numel() % w:
            raise ValueError(f"reduce-scatter: {x.numel()} values do not split into {w} equal chunks")
        chunk = x.numel() // w
        p1 = self._scatter(call, x, 0, call.name)  # chunk j encoded and sent to rank j
        yield  # the all-to-all is on the wire
        parts, nonfinite = self._received(call, p1)
        call.release_input(nonfinite)
        out = call.out if call.out is not None else torch.empty(chunk, dtype=x.dtype, device=x.device)
        call.decode(call.codec.aggregate_into, parts, out)
        sent = sum(p.nbytes for j, p in enumerate(p1["encoded"]) if j != call.rank)
        return Exchanged(out, nonfinite, sent, payload_bytes=sum(p.nbytes for p in p1["encoded"]))

    @classmethod
    def traffic_factor(cls, world_size: int) -> float:
        w = max(int(world_size), 1)
        return (w - 1) / w


def sharded_codecs() -> List[str]:
    """The codecs the compressed reduce-scatter takes (FSDP2's gradients), by name."""
    from ..codecs import codec, names

    return [n for n in names() if CompressedReduceScatter(None).supports(codec(n))]
