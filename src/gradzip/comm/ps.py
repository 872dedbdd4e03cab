"""HiPress CaSync-PS: partitions aggregated by round-robin aggregator ranks (a sharded parameter server)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..codecs.base import Codec, Payload
from ..kernels.rng import stable_hash
from ..kernels.transfer import ints_on
from ..options import Option, int_in, optional
from .allreduce import saturate_16_bit_sums
from .base import (
    Call,
    Collective,
    Exchanged,
    Spec,
    Stages,
    all_gather_flat,
    all_gather_ints,
    from_bytes,
    payload_views,
    reencoder,
    register_collective,
    spec_bytes,
    spec_of,
    to_bytes,
    world,
)


def aggregator(key: int, partition: int, world_size: int) -> int:
    """The rank that aggregates ``partition`` of the tensor and step of ``key``
    (:func:`rotation`): ``(key + partition) mod W``."""
    return (key + partition) % world_size


def rotation(name: str, step: int) -> int:
    """The aggregators' key of tensor ``name`` at ``step``: a hash of the name, plus the step, so
    each tensor's aggregators move on by one rank a step and different tensors start at different
    ranks. It depends on nothing but the tensor and the step, not on the order of the calls: DDP
    hands its buckets over in another order in the first step after a restart, and a stochastic
    codec's aggregate is re-encoded with the aggregator's own randomness."""
    return stable_hash("ps", name) + step


def num_partitions(numel: int, partitions: Optional[int], world_size: int, min_partition: int) -> int:
    """Partitions of a tensor: ``partitions`` (default the world size), but none below ``min_partition``
    elements, so tiny tensors go whole to one aggregator. Depends only on sizes: equal on every rank."""
    wanted = partitions if partitions is not None else world_size
    return max(1, min(wanted, numel // min_partition))


def partition_bounds(numel: int, parts: int, align: int = 1) -> List[Tuple[int, int]]:
    """``(start, end)`` of each partition: contiguous, sizes differing by at most one block of
    ``align`` values, every start a multiple of ``align`` (the last partitions may be empty)."""
    blocks = -(-numel // align)
    return [(min(p * blocks // parts * align, numel), min((p + 1) * blocks // parts * align, numel)) for p in range(parts)]


@register_collective
class ParameterServer(Collective):
    """HiPress CaSync-PS (Bai et al., Gradient Compression Supercharged High-Performance Data
    Parallel DNN Training, SOSP'21): every rank is the aggregator (server) of some partitions.

    Each tensor is cut into ``K`` contiguous partitions (``partitions``, default the world size W;
    never below ``min_partition`` elements, so a tiny tensor is one partition). Partition p of
    tensor ``name`` at step s is aggregated by rank ``(hash(name) + s + p) mod W``
    (:func:`rotation`): the same on every rank, the aggregation load spread over tensors and
    partitions and rotating from step to step.

    1. Every rank encodes each partition (as the tensor ``name#p``) and sends it to the partition's
       aggregator, all partitions in one ``all_to_all_single``. Payloads whose size depends on the
       data first all-gather their tensor lengths.
    2. An aggregator decodes the W payloads of its partition in rank order, merges them with
       ``codec.aggregate`` and encodes the merged partition once more (same name and step, so
       shared randomness such as random-k's indices is the same); summable codecs instead sum the
       payloads (as ``allreduce`` does, the input is divided by W first) and are not re-encoded.
    3. The aggregated payloads are all-gathered (padded to the longest), and every rank, the
       aggregators included, decodes those same bytes in partition order: replicas are identical.

    Both transfers are asynchronous stages, so in a pipeline another group is encoded or
    decoded while one group's partitions are on the wire.

    The non-finite flag rides in every message: an aggregator ORs the flags it received into the
    message it sends back. Each rank sends about ``(W-1)/W · wire_bytes`` to aggregators and its
    merged partitions (about ``wire_bytes / W``) to W-1 ranks: about ``2 · wire_bytes`` in all,
    whatever W, as in ``sra``. Values of non-summable codecs are quantised twice (signSGD's tied
    votes come back as +1: the re-encoded sign of zero). ``Result.wire_bytes`` counts this rank's
    partition payloads plus its merged ones, once each.

    Any codec may use it except multi-round ones (PowerSGD's ``next_round`` needs all-reduce
    rounds): :meth:`supports` decides this, not the codec's ``collectives`` tuple. A codec with
    state of its own (per-name momentum or residuals inside the codec) re-encodes the aggregate
    with a fresh instance, so its state only ever sees this rank's own partitions.

    Options: ``partitions`` (default None: the world size), ``min_partition`` (elements, default
    4096); pass them as ``Communicator(..., collective_options={...})`` or ``GRADZIP_PARTITIONS``.
    """

    name = "ps"

    options = {
        "partitions": Option(
            None, optional(int_in(1)), "a positive integer or None", "partitions (None: one per rank, see above)",
        ),
        "min_partition": Option(4096, int_in(1), "a positive integer", "fewest values a partition holds"),
    }

    def __init__(self, group: Optional[dist.ProcessGroup] = None, **opts: Any) -> None:
        super().__init__(group, **opts)
        self.calls = 0  # calls so far (counted in its state; the aggregators follow rotation())
        self.aggregated: List[int] = []  # partitions this rank aggregated in the last call

    def state_dict(self) -> Dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))

    def supports(self, codec: Codec) -> bool:
        single_round = type(codec).next_round is Codec.next_round
        return single_round and (codec.summable or codec.reencodable)

    def exchange(self, call: Call) -> Stages:
        codec, rank, w = call.codec, call.rank, call.world_size
        x = call.flat
        n = x.numel()
        parts = num_partitions(n, self.partitions, w, self.min_partition)
        self.calls += 1
        key = rotation(call.name, call.step)
        owner = [aggregator(key, p, w) for p in range(parts)]
        mine = [p for p in range(parts) if owner[p] == rank]
        self.aggregated = mine
        summable = codec.summable
        src = x / w if summable and w > 1 else x  # summed payloads then decode to the mean

        # phase 1: encode every partition, send it to its aggregator
        bounds = partition_bounds(n, parts, call.align)
        encoded = [call.encode(src[a:b], f"{call.name}#{p}") for p, (a, b) in enumerate(bounds)]
        for (a, b), e in zip(bounds, encoded):
            call.keep_own(e, a, b, scale=float(w) if summable else 1.0)
        bufs = [to_bytes(e.tensors, call.flag) for e in encoded]
        own_specs = [spec_of(e.tensors) for e in encoded]
        if codec.fixed_size:
            specs = [own_specs] * w
        else:
            specs = self._exchange_specs(own_specs, [[t.numel() for t in e.tensors] for e in encoded], w, x.device)
        sizes = [[spec_bytes(s) for s in row] for row in specs]  # sizes[r][p]: rank r's message for p
        send = [bufs[p] for d in range(w) for p in range(parts) if owner[p] == d]
        send_splits = [sum(sizes[rank][p] for p in range(parts) if owner[p] == d) for d in range(w)]
        recv_splits = [sum(sizes[r][p] for p in mine) for r in range(w)]
        send_buf = torch.cat(send) if send else x.new_empty(0, dtype=torch.uint8)
        if w > 1:
            recv_buf = send_buf.new_empty(sum(recv_splits))
            work = dist.all_to_all_single(recv_buf, send_buf, recv_splits, send_splits, group=self.group, async_op=True)
            yield  # the partitions are on their way to their aggregators
            work.wait()
        else:
            recv_buf = send_buf

        # phase 2: aggregate my partitions, encode each once
        merged_tensors = {}
        merged_bufs = {}
        offset = 0
        received = {p: [] for p in mine}
        for r in range(w):  # rank r's messages for my partitions, in partition order
            for p in mine:
                received[p].append(from_bytes(recv_buf[offset : offset + sizes[r][p]], specs[r][p]))
                offset += sizes[r][p]
        # a rank's flag covers all its partitions (written once all were encoded): one OR of
        # the ranks' flags serves every partition aggregated here
        flags = torch.stack([f for _, f in received[mine[0]]]).any() if mine else None
        for p in mine:
            if summable:
                merged = call.decode(_sum_payloads, [t for t, _ in received[p]])
                saturate_16_bit_sums(self.flagged, merged if w > 1 else [])
            else:
                payloads = [Payload(t, encoded[p].ctx) for t, _ in received[p]]
                if w > 1 and codec.averages_by_stats() and len(payloads[0].tensors) > codec.stats_tensor:
                    # each payload's statistics divided by W first (views of the received bytes,
                    # this rank's own copy), then summed: a sum of large finite values stays finite
                    # (a partition sent as it is, raw, has no statistics: summed, then divided)
                    for payload in payloads:
                        payload.tensors[codec.stats_tensor].div_(w)
                    mean = call.decode(lambda ps: codec.aggregate(ps, mean=False), payloads).reshape(-1)
                else:
                    mean = call.decode(codec.aggregate, payloads).reshape(-1)
                # the received flags, not the mean's values, say whether some input was not finite
                merged = call.encode(mean, f"{call.name}#{p}", codec=reencoder(codec), flag=False, own=True).tensors
            merged_tensors[p] = merged
            merged_bufs[p] = to_bytes(merged, flags)

        # phase 3: every rank gets every aggregated partition and decodes the same bytes
        if codec.fixed_size:
            specs2 = own_specs  # the merged partition has the shape and dtype of the first round
        else:
            specs2 = self._merged_specs(own_specs, merged_tensors, x.device)
        sizes2 = [spec_bytes(s) for s in specs2]
        lengths = [sum(sizes2[p] for p in range(parts) if owner[p] == d) for d in range(w)]
        longest = max(lengths)
        contribution = [merged_bufs[p] for p in mine]
        pad = longest - lengths[rank]
        if pad:
            contribution.append(send_buf.new_zeros(pad))
        mine_buf = torch.cat(contribution)
        gathered = mine_buf.new_empty(w, mine_buf.numel())
        if w > 1:
            work = all_gather_flat(gathered.view(-1), mine_buf, self.group, async_op=True)
            yield  # the aggregated partitions are on the wire
            work.wait()
        else:
            gathered[0] = mine_buf
        # each partition decodes straight into its place in the result (x is read no more)
        avg = torch.empty(n, dtype=x.dtype, device=x.device) if call.out is None else call.out
        nonfinite = None  # every aggregated partition carries the OR of all ranks' flags: read one
        offsets = [0] * w
        for p, (a, b) in enumerate(bounds):
            d = owner[p]
            message = gathered[d, offsets[d] : offsets[d] + sizes2[p]]
            offsets[d] += sizes2[p]
            if nonfinite is None:
                tensors, nonfinite = from_bytes(message, specs2[p])
            else:
                tensors = payload_views(message, specs2[p])
            call.decode(codec.decode_into, Payload(tensors, encoded[p].ctx), avg[a:b])
        first_round = sum(e.nbytes for e in encoded)
        wire = first_round + sum(t.numel() * t.element_size() for p in mine for t in merged_tensors[p])
        return Exchanged(avg, call.flag if nonfinite is None else nonfinite, wire, payload_bytes=first_round)

    # ------------------------------------------------------------ variable-size payloads
    def _exchange_specs(self, own_specs: List[Spec], numels: List[List[int]], w: int, device) -> List[List[Spec]]:
        """Every rank's spec of every partition: tensor lengths all-gathered (one host sync)."""
        rows = all_gather_ints([v for row in numels for v in row], w, self.group, device)
        out = []
        for row in rows:
            specs, i = [], 0
            for spec in own_specs:
                specs.append([(dtype, row[i + j]) for j, (dtype, _) in enumerate(spec)])
                i += len(spec)
            out.append(specs)
        return out

    def _merged_specs(self, own_specs: List[Spec], merged: dict, device) -> List[Spec]:
        """Specs of the aggregated partitions: each aggregator's lengths, summed over ranks (one host sync)."""
        starts, total = [], 0
        for spec in own_specs:
            starts.append(total)
            total += len(spec)
        counts = [0] * total
        for p, tensors in merged.items():
            counts[starts[p] : starts[p] + len(tensors)] = [t.numel() for t in tensors]
        flat = ints_on(counts, device)
        if dist.is_available() and dist.is_initialized() and world(self.group)[1] > 1 and total:
            dist.all_reduce(flat, group=self.group)  # one aggregator per partition: the sum is its row
        row = flat.tolist()
        return [[(dtype, row[starts[p] + j]) for j, (dtype, _) in enumerate(spec)] for p, spec in enumerate(own_specs)]


def _sum_payloads(payloads: Sequence[List[torch.Tensor]]) -> List[torch.Tensor]:
    """Element-wise sum of summable payloads in rank order (in their own dtypes, as an all-reduce)."""
    out = [t.clone() for t in payloads[0]]
    for tensors in payloads[1:]:
        for acc, t in zip(out, tensors):
            acc += t
    return out
