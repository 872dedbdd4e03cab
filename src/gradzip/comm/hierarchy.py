"""Hierarchical exchange: plain inside a node, compressed only across nodes.

Between machines the link is slow (1–25 Gbit/s) and inside one it is fast (shared memory,
loopback, NVLink), so only what crosses the slow link is worth compressing: CGX (Markov et al.,
Middleware'22) reduces inside the node first, as Horovod's hierarchical all-reduce and ZeRO++'s
hierarchical quantized reduce-scatter (qgZ) do. For a tensor on a layout of N nodes × L ranks:

1. **intra-node reduce-scatter** (plain, exact): local rank i receives the sum over its node of
   the i-th 1/L share, divided by L: the node's average of that share;
2. **inter-node compressed exchange** of that share between the ranks with local rank i on every
   node (any collective: SRA, all-reduce, all-gather, ps, on the group across nodes), so all L
   ranks of a node use the slow link at once, each for 1/L of the bytes, and no rank idles;
3. the OR of the non-finite flags over the node (one value), then an **intra-node all-gather**
   of the averaged shares straight into the result. Every rank of a node holds the same bytes
   (copied, not recomputed), and node peers decoded the same payloads: replicas stay identical.

Information is lost only in stage 2, at local rank i, on the node's average of share i; that is
what this rank's error feedback keeps (:attr:`~gradzip.comm.base.Call.loss_into`): L × (the share
it encoded − its own payloads decoded) in its own share, zero elsewhere, since every other value
it contributed reached the sum exactly.

**A 16-bit node stage** (``node_dtype`` bf16 or fp16) halves the bytes stage 1 moves inside the
node, where that link is the slower one (GPUs on PCIe rather than NVLink): every rank divides its
fp32 input by L and rounds it to 16 bits (finite values beyond the type's range saturated, so a
large gradient is clamped rather than turned into a lost step), and the node's sum of each share
is taken in fp32 from those values: read from shared memory, or received with an all-to-all
(the bytes of a reduce-scatter; a reduce-scatter would sum, and round, in 16 bits). The rest is
as above. Each rank's error feedback then also keeps what its rounding lost, everywhere:
x − L · round16(x / L). Stage 3 stays fp32, so every rank of a node still holds the same bytes.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..codecs.base import Codec
from ..kernels import fused
from .allreduce import _same_memory
from .base import Call, Collective, Exchanged, Stages, all_gather_flat, overlaps
from .stages import staged
from .sra import chunk_length
from .shm import NodeSharedMemory
from .topology import Topology

NODE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a node stage's values


def plain_goes_hierarchical(start: Optional[int], numel: int, element_size: int = 4) -> bool:
    """Whether a plain exchange of ``numel`` values of ``element_size`` bytes takes the
    hierarchical route that pays from ``start`` fp32 values' worth of bytes on (None: never);
    what the planner predicts with and the engine routes by."""
    return start is not None and numel * element_size >= 4 * start


class Hierarchical(Collective):
    """``inner`` (a collective on the group across nodes) inside an intra-node reduce-scatter and all-gather.

    Built by the engine (:class:`~gradzip.sync.engine.Communicator`) when the topology has
    several nodes of several ranks each, not named by users: the collective they name is the
    inner one.
    """

    name = "hierarchical"
    releases_input = True
    own_reads_input = True  # this rank's share is the input less its loss (Call.loss_into)

    def __init__(
        self, inner: Collective, node_group: Optional[dist.ProcessGroup], topology: Topology,
        shared: Optional[NodeSharedMemory] = None, node_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(None)
        self.inner = inner
        self.node_group = node_group
        self.topology = topology
        self.node_dtype = node_dtype  # of stage 1's values, for fp32 inputs (see the module's notes)
        self.flagged = inner.flagged
        # How the intra-node stages move CPU tensors: through memory the node's ranks share
        # (``shared``, when usable), else, on gloo, as two all-reduces rather than a
        # reduce-scatter and an all-gather: gloo's pair moves half the bytes of its all-reduce
        # yet takes longer (2 ranks, 48 MB, loopback: all-reduce 36–43 ms, reduce-scatter 92
        # ms, all-gather 75 ms), so the node sums the whole tensor and each rank keeps its
        # share, and the shares are spread by summing them into zeros (exact: x + 0 = x, and an
        # all-reduce leaves the same bytes on every rank). NCCL gets the real pair.
        self.shared = shared if shared is not None and shared.usable else None
        self.by_all_reduce = dist.get_backend(node_group) == "gloo"

    def supports(self, codec: Codec) -> bool:
        return self.inner.supports(codec)

    def config(self) -> Dict[str, Any]:
        return self.inner.config()

    def input_buffer(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device, step: int, align: int = 1,
    ) -> Optional[torch.Tensor]:
        """This rank's slot of the node's shared memory for tensor ``name``: a caller that
        assembles the input there (the engine's fused groups) saves the exchange its copy."""
        if self.shared is None or torch.device(device).type != "cpu" or dtype != torch.float32 or self._half(dtype, device):
            return None
        local = self.topology.local_size
        slots, _ = self.shared.buffers(name, chunk_length(numel, local, align) * local, dtype, step)
        return slots[self.topology.local_rank][:numel]

    def sent_per_byte(self, world_size: int) -> float:
        """Bytes this rank sends over the slow link per byte of one encoding of the whole tensor:
        its 1/L share, exchanged among the N nodes by the inner collective."""
        nodes, local = len(self.topology.nodes), self.topology.local_size
        return self.inner.sent_per_byte(nodes) / local

    def state_dict(self) -> Dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def release(self) -> None:
        super().release()
        self.inner.release()
        self.node_group = None

    spreads = True  # stage 3: the averaged shares all-gathered inside the node

    def describe(self) -> Dict[str, Any]:
        """The stages and the link each one uses."""
        nodes, local = len(self.topology.nodes), self.topology.local_size
        half = self._half(torch.float32, "cpu")  # CUDA tensors on gloo keep fp32 (see _half)
        stages = [
            {"stage": "reduce-scatter", "link": "intra-node", "values": "plain" if half is None else f"plain {half}"},
            {"stage": self.inner.name, "link": "inter-node", "values": "compressed", "ranks": nodes},
        ]
        if self.spreads:
            stages.append({"stage": "all-gather", "link": "intra-node", "values": "plain"})
        return {"topology": f"{nodes} nodes x {local} ranks", "stages": stages}

    def _half(self, dtype: torch.dtype, device: Any) -> Optional[torch.dtype]:
        """The 16-bit dtype of stage 1 for inputs of ``dtype`` (fp32 only) on ``device``, None:
        the input's own (also for CUDA tensors on gloo, whose all-to-all takes CPU tensors only)."""
        if dtype != torch.float32 or self.node_dtype == torch.float32:
            return None
        if torch.device(device).type != "cpu" and self.by_all_reduce:
            return None
        return self.node_dtype

    def _fill_half(self, call: Call, x: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` (16-bit, the padding zeroed) = x / L rounded, finite values saturated."""
        n = x.numel()
        scaled = self._lend_values(call, n, x)
        torch.div(x, self.topology.local_size, out=scaled)
        fused.saturate(scaled, dst.dtype, out=dst[:n])  # cast where it is sent from: no 16-bit copy to move
        dst[n:].zero_()

    def _rounding_loss(self, x: torch.Tensor, sent: torch.Tensor, dst: torch.Tensor) -> None:
        """What a 16-bit stage 1 lost of ``x``, in its units, into ``dst``: x − L · ``sent``
        (the 16-bit values this rank contributed, still intact during the call)."""
        d = dst[: x.numel()]
        d.copy_(sent[: x.numel()]).mul_(self.topology.local_size)
        torch.sub(x, d, out=d)

    def _node_sum_half(self, call: Call, src: torch.Tensor, span: int, x: torch.Tensor) -> torch.Tensor:
        """Stage 1 in 16 bits through the node group: every rank's 16-bit values of this rank's
        share received (an all-to-all: a reduce-scatter's bytes) and summed in fp32."""
        local = self.topology.local_size
        got = self._lend_values(call, span * local, src)
        dist.all_to_all_single(got, src, group=self.node_group)
        return self._sum_rows(got.view(local, span), self._lend_values(call, span, x))

    @staticmethod
    def _sum_rows(rows: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
        """``share`` = the sum of the L ≥ 2 ``rows`` (every rank's values of one share), in
        ``share``'s precision: row by row, twice as fast as a sum over dim 0; 16-bit rows are
        added into fp32, not summed in 16 bits first."""
        if rows.dtype == share.dtype:
            torch.add(rows[0], rows[1], out=share)
        else:
            share.copy_(rows[0]).add_(rows[1])
        for row in rows[2:]:
            share.add_(row)
        return share

    def _copy_in(self, x: torch.Tensor, dst: torch.Tensor, exact: bool) -> None:
        """``x`` (divided by the node's size unless ``exact``) into ``dst``, its padding zeroed."""
        n = x.numel()
        if exact:
            if dst.data_ptr() != x.data_ptr():
                dst[:n].copy_(x)
        else:
            torch.div(x, self.topology.local_size, out=dst[:n])
        dst[n:].zero_()

    def _node_sum_shared(
        self, call: Call, x: torch.Tensor, span: int, fill: Callable[[torch.Tensor], None],
        slot_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stage 1 through the node's shared memory: ``fill`` writes this rank's slot (L shares of
        ``span`` values); after a barrier this rank sums its share over the slots. Returns (the
        node's sum of this rank's share, the shared output buffer).

        The barrier (every slot of the node written) is waited for at once, not yielded to the
        pipeline: the node's ranks reach it together, and the compressed stage after it is the
        first to use the slow link. Yielded, a job put its payloads on the wire only when the next
        job arrived (the pipeline advances older jobs a stage per arrival), and the last jobs of a
        step one after another."""
        i = self.topology.local_rank
        slot_dtype = x.dtype if slot_dtype is None else slot_dtype
        slots, spread = self.shared.buffers(call.name, span * self.topology.local_size, slot_dtype, call.step, x.dtype)
        fill(slots[i])
        dist.all_reduce(torch.zeros(1), group=self.node_group)
        self.shared.mapped(call.name)
        share = self._sum_rows(slots[:, i * span : (i + 1) * span], self._lend_values(call, span, x))
        return share, spread

    def _node_sum_collective(self, call: Call, src: torch.Tensor, span: int, by_all_reduce: bool) -> torch.Tensor:
        """Stage 1 through the node group: ``src`` (L shares of ``span`` values) summed over the
        node, this rank's share returned (on gloo an all-reduce of it all: see the class notes).
        Waited for at once, as :meth:`_node_sum_shared` is: both ways of stage 1 have the same
        stages (none), so every node's pipeline issues the same collectives in the same order."""
        i = self.topology.local_rank
        if by_all_reduce:
            dist.all_reduce(src, group=self.node_group)
            return src[i * span : (i + 1) * span]
        share = self._lend_values(call, span, src)
        dist.reduce_scatter_tensor(share, src, group=self.node_group)
        return share

    def _across_nodes(self, call: Call, share: torch.Tensor, out: torch.Tensor, align: int) -> Stages:
        """Stage 2: ``share`` (the node's average of it) through ``inner`` with this rank's peers
        on the other nodes, compressed, the result in ``out``; the inner call's times count as
        this call's. Returns (the inner result, ``{"share": ...}`` = L × (the share − this
        rank's own payloads of it decoded), in the input's units: what error feedback keeps,
        filled when the inner exchange releases its input; empty without error feedback)."""
        local = self.topology.local_size
        loss: Dict[str, torch.Tensor] = {}

        def keep_loss(inner: Call, nonfinite: torch.Tensor) -> None:
            decoded = self._lend_values(call, share.numel(), share)
            inner.decode_own_into(decoded)
            loss["share"] = torch.sub(share, decoded, out=decoded).mul_(local)

        # an inner exchange that writes its result before it releases its input (the parameter
        # server's) would overwrite the share before keep_loss reads it: its result goes apart
        apart = call.need_own and not self.inner.releases_input and overlaps(out, share)
        dest = self._lend_values(call, out.numel(), out) if apart else out
        res = yield from staged(self.inner.stages(
            call.codec, share, f"{call.name}@{self.topology.local_rank}/{local}", call.step, need_own=call.need_own,
            out=dest, align=align, on_release=keep_loss if call.need_own else None, wire=call.wire,
        ))
        if apart:
            out.copy_(dest)
        for key in ("encode_s", "decode_s", "encode_cpu_s", "decode_cpu_s"):
            setattr(call.timer, key, getattr(call.timer, key) + getattr(res, key))
        return res, loss

    def _exchanged(self, avg: torch.Tensor, nonfinite: torch.Tensor, res: Any) -> Exchanged:
        """The call's outcome: the inner exchange's bytes; one encoding of the whole input is L
        encodings of a share."""
        payload = res.payload_bytes if res.payload_bytes is not None else res.wire_bytes
        return Exchanged(avg, nonfinite, res.wire_bytes, payload_bytes=payload * self.topology.local_size)

    def exchange(self, call: Call) -> Stages:
        x = call.flat
        n = x.numel()
        local, i = self.topology.local_size, self.topology.local_rank
        chunk = chunk_length(n, local, call.align)
        lo, hi = min(i * chunk, n), min((i + 1) * chunk, n)

        # 1. the node's sum of every share, this rank's share kept (divided by L: the node's
        # average of it; a half-precision input, or a 16-bit stage, is divided first, as DDP
        # does, so sums stay in range)
        half = self._half(x.dtype, x.device)
        exact = x.dtype == torch.float32 and half is None
        shared = self.shared if x.device.type == "cpu" else None
        by_all_reduce = shared is None and self.by_all_reduce
        sent: Optional[torch.Tensor] = None  # this rank's 16-bit values, with a 16-bit stage 1
        if shared is not None and half is not None:
            slot_of: Dict[str, torch.Tensor] = {}

            def fill(slot: torch.Tensor) -> None:
                self._fill_half(call, x, slot)
                slot_of["sent"] = slot  # read for the rounding loss before the call ends

            share, spread = self._node_sum_shared(call, x, chunk, fill, half)
            sent = slot_of["sent"]
        elif shared is not None:  # nothing to copy where the caller wrote its slot (input_buffer)
            share, spread = self._node_sum_shared(call, x, chunk, lambda slot: self._copy_in(x, slot, exact))
        elif half is not None:
            sent = self._lend_values(call, chunk * local, x, half)
            self._fill_half(call, x, sent)
            share = self._node_sum_half(call, sent, chunk, x)
        else:
            # on gloo the input is summed in place only where the average overwrites it anyway
            # and the frame will not read it after the exchange (this rank's share of the
            # average is then computed from its loss)
            overwritten = call.out is not None and _same_memory(call.out, x) and not (
                call.need_own and call.on_release is None
            )
            if chunk * local == n and exact and (not by_all_reduce or overwritten):
                src = x
            else:
                src = self._lend_values(call, chunk * local, x)
                self._copy_in(x, src, exact)
            share = self._node_sum_collective(call, src, chunk, by_all_reduce)
        if exact:
            share.div_(local)

        # 2. the share across nodes, compressed; what this rank's encoding lost is kept for
        # error feedback when the inner exchange releases its input
        # the average of the share goes where stage 3 spreads it from: the shared output, or in place
        dest = share if shared is None else spread[i * chunk : (i + 1) * chunk]
        res, loss = yield from self._across_nodes(call, share, dest, call.align)

        if call.need_own:
            def loss_into(dst: torch.Tensor) -> None:
                if sent is not None:
                    self._rounding_loss(x, sent, dst)
                dst[lo:hi].add_(loss["share"][: hi - lo])  # in the input's units: L × the node average

            call.loss_into = loss_into

        # 3. one flag for the node, then every share to every rank of the node
        flag = res.nonfinite.to(torch.float32).reshape(1)
        if self.flagged or shared is not None:  # with shared memory it is the barrier too
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.node_group, async_op=True)
            yield
            work.wait()
        nonfinite = flag[0] > 0
        call.release_input(nonfinite)  # the input is read no more: the result may overwrite it
        avg = torch.empty(n, dtype=x.dtype, device=x.device) if call.out is None else call.out
        if shared is not None:  # every share is in the shared output: the same bytes for every rank
            avg.copy_(spread[:n])
            return self._exchanged(avg, nonfinite, res)
        if chunk * local == n:
            whole = avg
        else:  # padded: gathered apart, then cut (on gloo into the summed copy, which holds the share)
            whole = src if by_all_reduce and half is None else self._lend_values(call, chunk * local, x)
        if by_all_reduce:  # every other share zero, summed over the node
            mine = whole[i * chunk : (i + 1) * chunk]
            if mine.data_ptr() != share.data_ptr():
                mine.copy_(share)
            whole[: i * chunk].zero_()
            whole[(i + 1) * chunk :].zero_()
            work = dist.all_reduce(whole, group=self.node_group, async_op=True)
        else:
            work = all_gather_flat(whole, share, self.node_group, async_op=True)
        yield  # the intra-node spreading is on the wire
        work.wait()
        if whole is not avg:
            avg.copy_(whole[:n])
        return self._exchanged(avg, nonfinite, res)


class HierarchicalReduceScatter(Hierarchical):
    """A reduce-scatter in two stages: plain inside the node, compressed across nodes (ZeRO++'s qgZ).

    The input holds every rank's chunk in the group's rank order (``W × c`` values, W = N × L),
    the output is this rank's averaged chunk. Local rank i's *share* is the N chunks of its peers
    across nodes (:meth:`~gradzip.comm.topology.Topology.cross`), in node order:

    1. the input is gathered share by share (one reordering copy, into the node's shared memory
       on CPU) and reduced over the node: rank i gets the node's average of its share, exactly;
    2. ``inner`` (a :class:`~gradzip.comm.reducescatter.CompressedReduceScatter` on the group
       across nodes) averages that share over the nodes, compressed, and leaves chunk i of it,
       which is this rank's chunk of the whole group's average;
    3. the node ORs its non-finite flags, so every rank of the group learns the same flag.

    A rank sends (N−1)/N of one encoding of its share, 1/L of the input, over the slow link.
    As for :class:`Hierarchical`, information is lost only in stage 2: this rank's error feedback
    keeps L × (its share − its own payloads decoded), at its share's chunks of the input.
    """

    name = "hierarchical-reduce-scatter"

    def __init__(
        self, inner: Collective, node_group: Optional[dist.ProcessGroup], topology: Topology,
        shared: Optional[NodeSharedMemory] = None, chunk_of: Optional[Callable[[int], int]] = None,
    ) -> None:
        super().__init__(inner, node_group, topology, shared)
        where = chunk_of or (lambda rank: rank)  # a global rank's chunk: its rank in the group
        local = topology.local_size
        # the input's chunks in the order of the node's reduce-scatter: share by share, in each the node order
        self.order = torch.tensor([where(ranks[i]) for i in range(local) for ranks in topology.nodes])

    def input_buffer(self, name, numel, dtype, device, step, align=1) -> Optional[torch.Tensor]:
        return None  # the input is reordered on its way into shared memory

    spreads = False  # each rank keeps its own chunk: no all-gather

    def exchange(self, call: Call) -> Stages:
        x = call.flat
        n = x.numel()
        nodes, local, i = len(self.topology.nodes), self.topology.local_size, self.topology.local_rank
        if n % (nodes * local):
            raise ValueError(f"reduce-scatter: {n} values do not split into {nodes * local} equal chunks")
        c = n // (nodes * local)
        span = nodes * c  # one share
        exact = x.dtype == torch.float32
        if self.order.device != x.device:  # moved once, not copied to the device at every call
            self.order = self.order.to(x.device)
        order = self.order

        def gather_in(dst: torch.Tensor) -> None:
            torch.index_select(x.view(-1, c), 0, order, out=dst.view(-1, c))
            if not exact:  # half precision: divided before the sum, as DDP does, so sums stay in range
                dst.div_(local)

        # 1. the node's average of this rank's share
        shared = self.shared if x.device.type == "cpu" else None
        if shared is not None:
            share, _ = self._node_sum_shared(call, x, span, gather_in)
        else:
            src = self._lend_values(call, n, x)
            gather_in(src)
            share = self._node_sum_collective(call, src, span, self.by_all_reduce)
        if exact:
            share.div_(local)

        # 2. the share across nodes, compressed: this rank's chunk of the average
        out = call.out if call.out is not None else torch.empty(c, dtype=x.dtype, device=x.device)
        res, loss = yield from self._across_nodes(call, share, out, 1)  # equal chunks: no alignment
        if call.need_own:
            mine_at = order[i * nodes : (i + 1) * nodes]

            def loss_into(dst: torch.Tensor) -> None:
                dst.view(-1, c).index_copy_(0, mine_at, loss["share"].view(nodes, c))

            call.loss_into = loss_into

        # 3. one flag for the node (with shared memory, the barrier before the slots are reused)
        flag = res.nonfinite.to(torch.float32).reshape(1)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.node_group, async_op=True)
        yield
        work.wait()
        return self._exchanged(res.avg, flag[0] > 0, res)
