"""CGX's compressed scatter-reduce + all-gather (SRA)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..codecs.base import Codec, Payload
from .base import (
    Collective,
    Result,
    Timer,
    from_bytes,
    nonfinite_flag,
    own_payload,
    reencoder,
    register_collective,
    spec_of,
    to_bytes,
    world,
)


@register_collective
class ScatterReduceAllGather(Collective):
    """Compressed reduce-scatter then all-gather (Markov et al., CGX, Middleware'22).

    The tensor is cut into one chunk per rank. Each rank encodes every chunk and sends chunk j
    to rank j (all-to-all); rank j decodes the W payloads of its chunk, averages them, encodes
    that average once more and all-gathers it. Each value is thus quantised twice, every rank
    decodes the same bytes (the owner of a chunk included), and traffic per rank is about
    ``2 · wire_bytes`` whatever the world size.
    """

    name = "sra"

    def supports(self, codec: Codec) -> bool:
        return codec.fixed_size and super().supports(codec)  # chunk payloads must line up

    def run(self, codec: Codec, x: torch.Tensor, name: str, step: int, need_own: bool) -> Result:
        rank, w = world(self.group)
        timer = Timer()
        x = x.reshape(-1)
        n = x.numel()
        chunk = -(-n // w)
        flag = nonfinite_flag(x)
        padded = x if chunk * w == n else torch.cat([x, x.new_zeros(chunk * w - n)])
        chunks = padded.view(w, chunk)

        # phase 1: encode every chunk, send chunk j to rank j
        encoded = [timer.encode(codec.encode, chunks[j], f"{name}#{j}", step) for j in range(w)]
        spec = spec_of(encoded[0].tensors)
        send = torch.stack([to_bytes(p.tensors, flag) for p in encoded])
        recv = torch.empty_like(send)
        if w > 1:
            dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group)
        else:
            recv.copy_(send)
        mine = encoded[rank].ctx
        parts, flags = [], []
        for r in range(w):
            tensors, f = from_bytes(recv[r], spec)
            parts.append(Payload(tensors, mine))
            flags.append(f)
        reduced = timer.decode(codec.aggregate, parts).reshape(-1)
        flag1 = torch.stack(flags).any()

        # phase 2: re-encode the averaged chunk once (under the chunk's own name, with a codec
        # whose state it cannot touch), all-gather, everyone decodes the same bytes with the
        # chunk's context, which is the same on every rank
        second = timer.encode(reencoder(codec).encode, reduced, f"{name}#{rank}", step)
        gathered = self._all_gather_bytes(to_bytes(second.tensors, flag1), w)
        spec2 = spec_of(second.tensors)
        outs, flags2 = [], []
        for r in range(w):
            tensors, f = from_bytes(gathered[r], spec2)
            outs.append(timer.decode(codec.decode, Payload(tensors, encoded[r].ctx)).reshape(-1))
            flags2.append(f)
        avg = torch.cat(outs)[:n]
        own = None
        if need_own:
            own = torch.cat([own_payload(codec, p, timer) for p in encoded])[:n]
        wire = sum(p.nbytes for p in encoded) + second.nbytes
        return Result(avg, own, torch.stack(flags2).any(), wire, timer.encode_s, timer.decode_s)
