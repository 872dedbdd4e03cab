"""The Communicator: uncompressed gradients summed as DDP sums them; a bucket averaged in place."""
from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from typing import List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gradzip
from gradzip.sync.pipeline import drive

from ..dist_utils import run_workers


def _plain_with_nan(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("maxmin", bits=4, memory="residual")
    x = torch.arange(8, dtype=torch.float32) + rank
    if rank == 1:
        x[3] = float("nan")
        x[5] = float("inf")
    plain = comm.reduce_many_now([x.clone()], ["b"], [False])[0]
    y = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        y[7] = float("nan")
    compressed = comm.reduce_many_now([y], ["w"], [True])[0]
    comm.close()
    return {"plain": plain, "compressed_all_nan": bool(torch.isnan(compressed).all())}


def test_uncompressed_sums_carry_nan_and_inf_elementwise_like_ddp_and_compressed_ones_are_poisoned():
    results = run_workers(_plain_with_nan, 2)
    plain = [r["plain"] for r in results]
    assert torch.equal(plain[0].nan_to_num(0.0, 1.0, -1.0), plain[1].nan_to_num(0.0, 1.0, -1.0))  # the same on both
    p = plain[0]
    assert torch.isnan(p[3]) and torch.isinf(p[5]) and p[5] > 0
    finite = [i for i in range(8) if i not in (3, 5)]
    assert torch.equal(p[finite], (torch.arange(8, dtype=torch.float32)[finite] * 2 + 1) / 2)
    # a compressed gradient's average is all-NaN on every rank, and its memory is spared
    assert all(r["compressed_all_nan"] for r in results)


class _Ops(TorchDispatchMode):
    """Counts the operators that do work (views excluded) and the allocations among them."""

    def __init__(self) -> None:
        super().__init__()
        self.work: Counter = Counter()
        self.views = 0
        self.filled = []  # the sizes of the tensors masked_fill_ wrote
        self.picks = 0  # where(..., out=...): a pick written over one of its inputs (a residual)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.work[func.overloadpacket.__name__] += 1
            if func.overloadpacket.__name__ in ("masked_fill_", "fill_"):
                self.filled.append(args[0].numel())
            self.picks += func.overloadpacket.__name__ == "where" and "out" in (kwargs or {})
        return func(*args, **(kwargs or {}))


def _bucket(count: int, total: int = 1 << 14):
    """A DDP-like bucket of ``count`` gradients of ``total`` values in all: compressed ones and
    8-value uncompressed ones taking turns, the same total for every ``count``."""
    plain_n = 8
    comp_n = (total - count // 2 * plain_n) // (count // 2)
    buffer = torch.randn(total, generator=torch.Generator().manual_seed(count))
    tensors, compress, offset = [], [], 0
    for i in range(count):
        n = comp_n if i % 2 == 0 else plain_n
        tensors.append(buffer[offset : offset + n].view(n // 8, 8))
        compress.append(i % 2 == 0)
        offset += n
    return buffer, tensors, [f"layer{i}.weight" for i in range(count)], compress


def _bucket_ops(rank: int, world: int, memory: str, device_flag: bool, in_place: bool = True) -> dict:
    from gradzip.sync import device

    reads, multi = device.reads_flag_on_host, device.multi_tensor
    device.multi_tensor = lambda where: True  # the accelerator's way of filling a group, on the CPU
    if device_flag:  # the accelerator's way on the CPU: the flag stays a tensor, the residual is picked by it
        device.reads_flag_on_host = lambda where: False
    try:
        out = {}
        for collective, count in [(c, n) for c in ("sra", "allgather") for n in (8, 64)]:
            comm = gradzip.Communicator("maxmin", bits=4, memory=memory, collective=collective)
            buffer, tensors, names, compress = _bucket(count)
            assert comm.in_place(buffer, tensors, names, compress)
            if in_place:
                stages = lambda step: comm.bucket_stages(buffer, tensors, names, compress, step)  # noqa: E731
            else:  # the default path: the plain ones in one all-reduce, the compressed ones in one fused group
                stages = lambda step: comm.reduce_many_stages(tensors, names, compress, inplace=True, step=step)  # noqa: E731
            counts, filled = [], []
            for step in range(3):  # the first step makes the residual, the pool's buffers, the index
                buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(step * 7 + rank)))
                with _Ops() as ops:
                    drive(stages(step))
                counts.append(ops.work)
                filled += ops.filled
            # a NaN on the last rank: every compressed gradient all-NaN on every rank, the plain
            # ones summed as DDP sums them (the NaN sits in a compressed one)
            buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(99 + rank)))
            if rank == world - 1:
                tensors[0].view(-1)[5] = float("nan")
            with _Ops() as ops:
                drive(stages(3))
            filled += ops.filled
            out[collective, count] = {
                "ops": counts[1:], "residuals": sorted(getattr(comm.memory, "residuals", {})), "filled": filled,
                "poisoned": all(bool(t.isnan().all()) for t, c in zip(tensors, compress) if c),
                "plain_finite": all(bool(t.isfinite().all()) for t, c in zip(tensors, compress) if not c),
                "numel": buffer.numel(),
            }
            comm.close()
        return out
    finally:
        device.reads_flag_on_host, device.multi_tensor = reads, multi


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "fused"])
@pytest.mark.parametrize("memory,device_flag", [("none", False), ("residual", False), ("residual", True)])
def test_a_bucket_costs_the_same_operations_for_8_or_64_gradients(memory, device_flag, in_place):
    """A bucket is averaged as a whole: eight times the gradients (half of them uncompressed)
    cost not one operation more. In place, the uncompressed ones are gathered and scattered back
    through one index; on the default path (a fused group beside one plain all-reduce) they and
    the compressed ones move with multi-tensor copies. With the flag left on the device (as on
    a GPU), error feedback reads nothing back to the host. Through the SRA and the all-gather
    (the default at two ranks) alike."""
    for res, collective in [(r, c) for r in run_workers(_bucket_ops, 2, memory, device_flag, in_place)
                            for c in ("sra", "allgather")]:
        few, many = res[collective, 8], res[collective, 64]
        assert few["ops"] == many["ops"], (few["ops"], many["ops"])
        ops = few["ops"][0]
        assert ops == few["ops"][1]  # every step alike
        if in_place:
            assert ops["index_select"] == 1 and ops["index_copy_"] == 1, ops
        else:
            # into the group and out of it, into the plain sum's buffer and out of it; with error
            # feedback once more into the group, whose input is made again when the residual settles
            assert ops["_foreach_copy_"] == (5 if memory == "residual" else 4) and ops["cat"] == 0, ops
        if device_flag:
            assert ops["_local_scalar_dense"] == 0, ops  # no host read of a device value
            assert ops["where"] == 1, ops  # the flag picks the residual on the device
        if memory == "residual":
            assert len(many["residuals"]) == 32  # the compressed gradients' residuals, by name
        for r in (few, many):
            assert r["poisoned"] and r["plain_finite"], r
            # the average is poisoned through the gathered statistics, not by a pass over it
            assert max(r["filled"], default=0) <= r["numel"] // 64, r["filled"]


def _parts_ops(rank: int, world: int, name: str, opts: dict = {}) -> dict:
    from gradzip.kernels import fused
    from gradzip.sync import device, memory

    device.multi_tensor = lambda where: True  # the accelerator's choices, on the CPU
    device.reads_flag_on_host = lambda where: False
    fused.groups_at_once = lambda device: True
    memory.reads_on_host = lambda flag: False
    os.environ["GRADZIP_KERNELS"] = "torch"  # (operations counted as torch's: an accelerator runs no C loop)
    out = {}
    for count in (8, 64):
        comm = gradzip.Communicator(name, **opts)
        buffer, tensors, names, compress = _bucket(count)
        counts = []
        for step in range(4):  # (state made at the first step, put in one buffer at the second: DGC's memory)
            buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(step * 7 + rank)))
            with _Ops() as ops:
                drive(comm.reduce_many_stages(tensors, names, compress, inplace=True, step=step))
            if ops.work["zero_"] == 1 or not comm.codec.fixed_size:
                # the message's padding to a whole word: the group's byte count (from step to
                # step where it depends on the data), not its members
                del ops.work["zero_"]
            if not comm.codec.fixed_size:  # (one each or none, by the count selected: bits padded to whole bytes, ...)
                for op in ("cat", "new_zeros", "gather"):
                    ops.work.pop(op, None)
            counts.append(ops.work)
        out[count] = counts[2:]
        comm.close()
    return out


@pytest.mark.parametrize("name,opts", [("efsignsgd", {}), ("onebit", {}), ("terngrad", {}), ("natural", {}), ("signum", {}),
                                       ("graddrop", {}), ("dgc", {"sample_ratio": 1.0}),
                                       ("adaq", {}), ("topk", {}), ("randomk", {}),
                                       ("sketchml", {}), ("sketchml", {"buckets": 16}), ("sketchml", {"ratio": 0.05}),
                                       ("cl_onebit", {}), ("cl_terngrad", {})])
def test_a_group_encoded_by_its_parts_costs_the_same_operations_for_4_or_32_members(name, opts):
    """The codecs that take a group by its parts, on the accelerator's path: a group's
    statistics by blocks and one segmented reduction (Signum: its momenta in one buffer), one
    decode, so 32 members cost what 4 cost (SketchML: each member's quantiles from one sort of
    the group), and no value is read back to the host (but for
    the data-dependent sizes of the sampled-threshold codecs: one selection, and for DGC
    whether a member is over its cap; DGC's memory takes the group's momenta and velocities
    as one buffer each)."""
    for res in run_workers(_parts_ops, 2, name, opts):
        few, many = res[8], res[64]
        assert few == many and few[0] == few[1], (few, many)
        ops = few[0]
        if name in ("graddrop", "dgc"):  # a sort of the group's samples, one nonzero (DGC sampling whole: never over its cap)
            assert ops["sort"] == 1 and ops["nonzero"] == 1, ops
            assert ops["_local_scalar_dense"] == (name == "dgc"), ops
        elif name == "adaq":  # its selection's size: one nonzero; each member's scale by one sum of the sent values
            assert ops["nonzero"] == 1 and ops["_local_scalar_dense"] == 0, ops
        elif name == "topk":  # a sort of the samples and one of the candidates, one nonzero, one bool read
            assert ops["sort"] == 2 and ops["nonzero"] == 1 and ops["_local_scalar_dense"] == 1, ops
        elif name == "randomk":  # one draw a group
            assert ops["rand"] == 1 and ops["randint"] == 0 and ops["_local_scalar_dense"] == 0, ops
        elif name == "sketchml" and opts.get("ratio"):  # top-k's selection (sorted), the sketch's sorts, the gaps' widths read
            assert ops["sort"] == 5 and ops["nonzero"] == 1 and ops["_local_scalar_dense"] == 1, ops
        elif name == "sketchml":  # a sort of the group's keys, one of its members' splits, one search
            assert ops["sort"] == 2 and ops["searchsorted"] == 1 and ops["_local_scalar_dense"] == 0, ops
        else:
            assert ops["_local_scalar_dense"] == 0, ops
        # (Signum's momentum needs no statistics; AdaComp's are sums over what it sends; the
        # selections' a sort, their counts by a search of the selected indices; random-k's draws none)
        assert ops["segment_reduce"] >= 1 or name in ("signum", "adaq", "topk", "randomk", "graddrop", "dgc", "sketchml"), ops


def _every_fused_codec_ops(rank: int, world: int) -> dict:
    return {name: _parts_ops(rank, world, name) for name in gradzip.codecs.names() if gradzip.codec(name).fused_alignment()}


def test_every_fused_codec_costs_the_same_operations_for_4_or_32_members():
    """Every codec that takes fused groups, by blocks or by parts, with its defaults and on the
    accelerator's path: eight times the members cost not one operation more, every step alike;
    but PowerSGD's products, one a matrix and round (as PyTorch's PowerSGD hook's)."""
    (res, _) = run_workers(_every_fused_codec_ops, 2)
    assert {"maxmin", "sketchml", "cl_onebit", "powersgd"} <= set(res), sorted(res)
    for name, counts in res.items():
        few, many = counts[8], counts[64]
        assert few[0] == few[1] and many[0] == many[1], name
        if name == "powersgd":  # (4 and 32 matrices: four products a matrix a step)
            assert many[0]["mm"] - few[0]["mm"] == 4 * (32 - 4), (few, many)
            for step in few + many:
                del step["mm"]
        assert few == many, (name, few, many)


def _fused_views(rank: int, world: int, memory: str) -> dict:
    from gradzip.sync import device

    multi, reads = device.multi_tensor, device.reads_flag_on_host
    device.multi_tensor = lambda where: True  # the accelerator's ways: one fill of a group,
    device.reads_flag_on_host = lambda where: False  # the residual picked on the device (a scratch buffer)
    try:
        out = {}
        for count in (8, 64):
            comm = gradzip.Communicator("maxmin", bits=4, memory=memory)
            _, tensors, names, _ = _bucket(count)
            views = []
            for step in range(3):
                with _Ops() as ops:
                    drive(comm.reduce_many_stages(tensors, names, [True] * count, inplace=True, step=step))
                views.append(ops.views)
            out[count] = views
            comm.close()
        return out
    finally:
        device.multi_tensor, device.reads_flag_on_host = multi, reads


@pytest.mark.parametrize("memory", ["none", "residual"])
def test_a_fused_group_makes_its_views_of_the_gradients_once(memory):
    """The places of a group's gradients in its buffers are views made at the first step and
    kept (the pool lends the group the same buffers, its residual's scratch beside them): later
    steps cost the same views for 8 or 64 gradients, as each view is host time in the comm
    thread on a GPU."""
    for res in run_workers(_fused_views, 2, memory):
        few, many = res[8], res[64]
        assert few[1] == few[2] == many[1] == many[2], (few, many)
        assert many[0] > many[1] + 2 * 64  # the first step made them: at least two a gradient


class _Made(TorchDispatchMode):
    """The bytes of every tensor an operator made (storage not among its inputs'), by operator."""

    def __init__(self) -> None:
        super().__init__()
        self.made: List[Tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.made.append((func.overloadpacket.__name__, t.untyped_storage().nbytes()))
        return out


# codecs whose exchanges through the SRA and the all-gather take every buffer of a bucket's
# size from the pools (fixed-size payloads written where they are sent from); signSGD encodes
# gradients one by one, with error feedback each compensated into a new tensor. (The all-reduce
# makes its quotient and payload per call, as PyTorch's fp16 hook does: kept in a pool per size
# class, every bucket's would stay resident between steps.) QSGD at 8 bits: it takes error
# feedback there, not at 4 (QSGD.memory_problem).
LEAN_CODECS = {"maxmin": {"bits": 4}, "qsgd": {"bits": 8}, "fp8": {}, "mxfp4": {}, "fp16": {}, "bf16": {}, "none": {},
               "signsgd": {}}


def _made_per_step(rank: int, world: int, memory: str, in_place: bool) -> dict:
    from gradzip.sync import device

    multi, reads = device.multi_tensor, device.reads_flag_on_host
    device.multi_tensor = lambda where: True  # the accelerator's ways, on the CPU
    device.reads_flag_on_host = lambda where: False
    try:
        out = {}
        for name, options in LEAN_CODECS.items():
            if name == "signsgd" and memory != "none" and not in_place:
                continue
            for collective in ("sra", "allgather"):
                if collective not in gradzip.codec(name, **options).collectives:
                    continue
                comm = gradzip.Communicator(name, memory=memory, collective=collective, **options)
                # (at three ranks a size the padding to whole chunks leaves in its size class of
                # the pools: 2^16 values would not be padded, see Communicator._fused_layout)
                buffer, tensors, names, compress = _bucket(16, 1 << 16 if world == 2 else 49984)
                made = []
                # the first steps make the residuals and the pools' buffers; the pools plan their
                # buffers at the third from the two before (a class served by a larger one's)
                for step in range(5):
                    buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(step * 7 + rank)))
                    with _Made() as m:
                        if in_place:
                            drive(comm.bucket_stages(buffer, tensors, names, compress, step))
                        else:
                            drive(comm.reduce_many_stages(tensors, names, compress, inplace=True, step=step))
                    made.append(m.made)
                out[f"{name}/{collective}"] = {"made": made[3:], "bucket_bytes": buffer.numel() * buffer.element_size()}
                comm.close()
        return out
    finally:
        device.multi_tensor, device.reads_flag_on_host = multi, reads


@pytest.mark.parametrize("in_place, world", [(True, 2), (False, 2), (False, 3)], ids=["in-place", "fused", "fused-3"])
@pytest.mark.parametrize("memory", ["none", "residual"])
def test_a_step_makes_no_tensor_of_the_gradients_size_once_the_pools_hold_the_buffers(memory, in_place, world):
    """With the accelerator's choices, from the fourth step on a bucket's exchange takes its
    buffers (the group's input, the average, payloads, a chunk's average that cannot go into
    the result yet) from the pools: what operators still make are flags and statistics, each
    under 1/64 of the bucket; on a GPU, nothing for the caching allocator to find a step, and
    the same addresses every step. Through the SRA and the all-gather, for each codec of
    :data:`LEAN_CODECS` they take; at three ranks too, where a fused group ends in zeros so
    that no chunk of the SRA's is padded by a copy. (A bucket averaged in place at three ranks
    pads its last chunk so: a transient copy, which on the CPU would stay resident in a pool.)"""
    for res in run_workers(_made_per_step, world, memory, in_place):
        skipped = {"signsgd"} if memory != "none" and not in_place else set()
        assert {case.split("/")[0] for case in res} == set(LEAN_CODECS) - skipped and len(res) >= 10, sorted(res)
        for case, r in res.items():
            for made in r["made"]:
                largest = max(made, key=lambda m: m[1], default=("", 0))
                assert largest[1] <= r["bucket_bytes"] // 64, (case, largest, r["bucket_bytes"])


@contextmanager
def _device_choices(device_flag: bool):
    """The engine's accelerator choices (multi-tensor operations, the flag left on the device)
    where ``device_flag``, else the CPU's, on CPU tensors."""
    from gradzip.sync import device

    multi, reads = device.multi_tensor, device.reads_flag_on_host
    device.multi_tensor = lambda where: device_flag
    device.reads_flag_on_host = lambda where: not device_flag
    try:
        yield
    finally:
        device.multi_tensor, device.reads_flag_on_host = multi, reads


def _alone_in_its_memory(rank: int, world: int, device_flag: bool) -> dict:

    with _device_choices(device_flag):
        g = torch.Generator().manual_seed(rank)
        # 34 blocks of 1024 values: at three ranks not a whole number of the SRA's chunks, and 36 in
        # the same size class of the pools
        steps = [[torch.randn(64, 544, generator=g), torch.randn(300, generator=g)] for _ in range(3)]
        steps[1][0][5, 7] = float("nan") if rank == 1 else steps[1][0][5, 7]
        names, compress = ["w.weight", "b.bias"], [True, False]
        out = {}
        for inplace in (True, False):
            comm = gradzip.Communicator("maxmin", bits=4, memory="residual")
            avgs, ptrs = [], []
            for step, ts in enumerate(steps):
                ts = [t.clone() for t in ts]
                res = drive(comm.reduce_many_stages(ts, names, compress, inplace=inplace, groups=[[0]], step=step))
                avgs.append([t.clone() for t in res])
                ptrs.append(res[0].data_ptr() == ts[0].data_ptr())
            out[inplace] = {"avgs": avgs, "pooled": sum(p.nbytes for p in comm._flat_pools.values()),
                            "in_its_memory": ptrs, "residual": comm.memory.residuals["w.weight"].clone()}
            comm.close()
        return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("device_flag", [False, True], ids=["cpu", "accelerator"])
def test_a_gradient_alone_with_error_feedback_is_averaged_in_its_own_memory(device_flag, world):
    """A gradient alone in its group is fused only for its error feedback; averaged in place, its
    own memory is the group's buffer (compensated there, the average written over it): the same
    values and residuals as through a buffer of the pool, a NaN step included, and one buffer of
    its size fewer held by the pool. Through the SRA at three ranks too, where a group of several
    would end in zeros to whole chunks (Collective.fused_length): one alone keeps its length."""
    for res in run_workers(_alone_in_its_memory, world, device_flag):
        lean, pooled = res[True], res[False]
        # (on an accelerator both keep the residual's scratch buffer)
        assert all(lean["in_its_memory"]) and lean["pooled"] <= pooled["pooled"] - 64 * 544 * 4
        for a, b in zip(lean["avgs"], pooled["avgs"]):
            assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))
        assert bool(lean["avgs"][1][0].isnan().all()) and torch.equal(lean["residual"], pooled["residual"])


def _groups_of_a_job(rank: int, world: int, codec: str, collective: str, late: bool, remakes: bool = True) -> dict:
    g = torch.Generator().manual_seed(rank)
    names = [f"layer{i}.weight" for i in range(6)]
    steps = [[torch.randn(64, 96, generator=g) for _ in names] for _ in range(3)]
    if rank == 1:
        steps[1][4][3, 5] = float("inf")
    comm = gradzip.Communicator(codec, collective=collective)
    if not late:  # the collective as if it could not say when it has read its input
        comm.collective.reads_input_first = False
    if not remakes:  # the memory as if its update read the input
        comm.memory.remakes_input = False
    avgs = []
    for step, grads in enumerate(steps):
        grads = [t.clone() for t in grads]
        res = drive(comm.reduce_many_stages(grads, names, [True] * 6, inplace=True,
                                            groups=[[0, 1], [2, 3], [4, 5]], step=step))
        avgs.append([t.clone() for t in res])
    out = {"avgs": avgs, "pooled": comm._flat_pools[torch.float32].nbytes,
           "states": [{k: v.clone() for k, v in store.items()} for store in vars(comm.memory).values()
                      if isinstance(store, dict) and all(isinstance(v, torch.Tensor) for v in store.values())]}
    comm.close()
    return out


@pytest.mark.parametrize("codec,collective,world", [
    ("maxmin", "allgather", 2), ("maxmin", "sra", 2), ("maxmin", "sra", 3), ("fp16", "allreduce", 2), ("fp16", "allreduce", 3),
])
def test_without_error_feedback_the_groups_of_a_job_share_one_input_buffer(codec, collective, world):
    """Without error feedback nothing reads a group's input once it is encoded: its buffer goes
    back to the pool then and the average gets one when it is decoded, so three groups in flight
    in one job hold one buffer of their size where they held three; the same averages, a step
    with Inf included."""
    group_bytes = 2 * 64 * 96 * 4
    for late, early in zip(run_workers(_groups_of_a_job, world, codec, collective, True),
                           run_workers(_groups_of_a_job, world, codec, collective, False)):
        assert early["pooled"] >= 3 * group_bytes and late["pooled"] < 2 * group_bytes, (late["pooled"], early["pooled"])
        for a, b in zip(late["avgs"], early["avgs"]):
            assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))
        assert all(bool(t.isnan().all()) for t in late["avgs"][1][4:])


@pytest.mark.parametrize("world", [2, 3])
def test_dgc_groups_hold_one_buffer_of_their_size_as_its_memory_makes_the_input_again(world):
    """DGC's memory sums ``v + u`` again when it updates (``remakes_input``), so a fused group's
    input buffer goes back to the pool once encoded and takes the average: one buffer of a
    group's size where, with the input kept for the update, the average took a second; the
    same averages, momenta and velocities, bit for bit, a step with Inf included."""
    group_bytes = 2 * 64 * 96 * 4
    for lean, kept in zip(run_workers(_groups_of_a_job, world, "dgc", "allgather", True, True),
                          run_workers(_groups_of_a_job, world, "dgc", "allgather", True, False)):
        assert lean["pooled"] < 1.25 * group_bytes, lean["pooled"]
        assert kept["pooled"] >= 2 * group_bytes, kept["pooled"]
        for a, b in zip(lean["avgs"], kept["avgs"]):
            assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))
        assert all(bool(t.isnan().all()) for t in lean["avgs"][1][4:])
        assert len(lean["states"]) == 3  # momenta, velocities, the pending momenta (none once settled)
        for a, b in zip(lean["states"], kept["states"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _dgc_across_nodes(rank: int, world: int, remakes: bool) -> dict:
    """DGC's memory on two nodes of two ranks, three steps, an Inf at one rank in the second,
    the averages written over the gradients: top-k on each gradient alone, threshold
    sparsification on a fused group (a codec the hierarchical exchange takes whole). With
    ``remakes`` False the memory is taken to read its input, so the engine keeps the input
    intact everywhere (the reference). The averages, momenta and velocities; the fused calls."""
    g = torch.Generator().manual_seed(rank)
    out = {}
    for path, codec, opts in (("alone", "topk", {"ratio": 0.1}), ("fused", "threshold", {"threshold": 0.8})):
        comm = gradzip.Communicator(codec, memory="dgc", collective="allgather", **opts)
        assert comm.collective.own_reads_input  # hierarchical: its own share is the input less its loss
        comm.memory.remakes_input = remakes
        fused, calls = comm._reduce_fused, []

        def counted(*args, **kwargs):
            calls.append(1)
            return (yield from fused(*args, **kwargs))

        comm._reduce_fused = counted
        names = ["w0", "w1", "b"]
        avgs = []
        for step in range(3):
            grads = [torch.randn(*shape, generator=g) for shape in ((64, 96), (32, 48), (10,))]
            if step == 1 and rank == 3:
                grads[1][2, 3] = float("inf")
            if path == "fused":
                res = comm.reduce_many_now(grads, names, [True] * 3, inplace=True, step=step)
            else:
                res = [comm.reduce_now(t, n, out=t, step=step) for t, n in zip(grads, names)]
            avgs.append([t.clone() for t in res])
        states = {f"{kind}:{k}": v.clone() for kind, store in (("u", comm.memory.momentums), ("v", comm.memory.velocities))
                  for k, v in store.items()}
        out[path] = {"avgs": avgs, "states": states, "fused_calls": len(calls)}
        comm.close()
    return out


def test_dgc_on_several_nodes_keeps_the_input_its_own_share_is_read_from():
    """A hierarchical exchange gives this rank's share of the average as its input less what its
    encoding lost (:attr:`Collective.own_reads_input`), read after the exchange. DGC's memory
    masks what was sent by that share, so the average must not overwrite the input first, even
    though the memory makes its input again: a gradient alone and a fused group, their averages
    written over the gradients, give the same averages, momenta and velocities, bit for bit, on
    every rank, as with the input kept intact throughout."""
    for lean, kept in zip(run_workers(_dgc_across_nodes, 4, True, ranks_per_node=2),
                          run_workers(_dgc_across_nodes, 4, False, ranks_per_node=2)):
        assert lean["fused"]["fused_calls"] == 3 and lean["alone"]["fused_calls"] == 0
        for path in ("alone", "fused"):
            a, b = lean[path], kept[path]
            for x, y in zip(a["avgs"], b["avgs"]):
                assert all(torch.equal(s.nan_to_num(7.0), t.nan_to_num(7.0)) for s, t in zip(x, y)), path
            assert bool(a["avgs"][1][1].isnan().all()), path  # the Inf's: all-NaN (the agreed outcome)
            assert a["states"].keys() == b["states"].keys() and len(a["states"]) == 6, path
            assert all(torch.equal(a["states"][k], b["states"][k]) for k in a["states"]), (path, [
                k for k in a["states"] if not torch.equal(a["states"][k], b["states"][k])])


def _averages_of_jobs(jobs: list, pipelined: bool = True) -> List[torch.Tensor]:
    """Jobs (a bucket's stages each) through one pipeline as DDP's hook hands them over, the
    last draining it, or each driven alone; every job's averages in order, cloned."""
    from gradzip.sync.pipeline import Pipeline

    pipeline = Pipeline(lambda what, exc, seconds: exc)
    futures = [torch.futures.Future() for _ in jobs]
    for j, (stages, fut) in enumerate(zip(jobs, futures)):
        if pipelined:
            pipeline.arrive(stages, fut, f"job {j}", flush=j == len(jobs) - 1)
        else:
            fut.set_result(drive(stages))
    return [t.clone() for fut in futures for t in fut.value()]


def _jobs_in_the_pipeline(rank: int, world: int, collective: str, late: bool, device_flag: bool) -> dict:
    with _device_choices(device_flag):
        g = torch.Generator().manual_seed(rank)
        names = [[f"job{j}.w{i}" for i in range(4)] for j in range(3)]
        comm = gradzip.Communicator("maxmin", bits=4, memory="residual", collective=collective)
        if not late:
            comm.collective.reads_input_first = False
        avgs = []
        for step in range(3):
            grads = [[torch.randn(64, 96, generator=g) for _ in job] for job in names]
            if step == 1 and rank == world - 1:
                grads[1][0][3, 5] = float("nan")
            avgs.append(_averages_of_jobs([
                comm.reduce_many_stages(grads[j], job, [True] * 4, inplace=True, groups=[[0, 1], [2, 3]], step=step)
                for j, job in enumerate(names)
            ]))
        out = {"avgs": avgs, "pooled": comm._flat_pools[torch.float32].nbytes,
               "residuals": {k: v.clone() for k, v in comm.memory.residuals.items()}}
        comm.close()
        return out


@pytest.mark.parametrize("device_flag", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("collective,world", [("allgather", 2), ("sra", 3)])
def test_with_error_feedback_a_group_in_flight_holds_no_input_buffer(collective, world, device_flag):
    """With error feedback a group's input goes back to the pool once encoded, as without it:
    when the agreed flag settles the residual, the input is made again from the gradients and
    the old residual (the same operations, the same bits) in a buffer lent for that moment.
    Three jobs of two groups each in the pipeline hold one buffer of a group's size (on an
    accelerator two: the input made again, and the new residual before the flag picks it)
    where they held one per group in flight (a job's two, as the pipeline's jobs take turns
    group by group); the same averages and residuals, a NaN step at one rank included (every
    rank keeps its residual)."""
    group_bytes = 2 * 64 * 96 * 4
    for late, early in zip(run_workers(_jobs_in_the_pipeline, world, collective, True, device_flag),
                           run_workers(_jobs_in_the_pipeline, world, collective, False, device_flag)):
        held = 2 if device_flag else 1
        assert late["pooled"] < 1.25 * held * group_bytes <= early["pooled"] / 1.5, (late["pooled"], early["pooled"])
        for a, b in zip(late["avgs"], early["avgs"]):
            assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))
        assert all(bool(t.isnan().all()) for t in late["avgs"][1][4:6])
        assert late["residuals"].keys() == early["residuals"].keys()
        assert all(torch.equal(late["residuals"][k], early["residuals"][k]) for k in late["residuals"])


def _payloads_in_flight(rank: int, world: int, codec: str, collective: str, memory: str, pipelined: bool) -> dict:
    """Three jobs of four groups each, in the pipeline or each driven alone; what the
    collective's pool holds after three steps (as many payload buffers as were lent at once)."""
    g = torch.Generator().manual_seed(rank)
    comm = gradzip.Communicator(codec, collective=collective, memory=memory)
    jobs = [[f"job{j}.w{i}" for i in range(8)] for j in range(3)]
    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    avgs = []
    for step in range(3):
        grads = [[torch.randn(64, 96, generator=g) for _ in names] for names in jobs]
        if step == 1 and rank == 0:
            grads[1][2][3, 4] = float("inf")
        avgs.append(_averages_of_jobs([
            comm.reduce_many_stages(grads[j], names, [True] * 8, inplace=True, groups=groups, step=step)
            for j, names in enumerate(jobs)
        ], pipelined))
    out = {"avgs": avgs, "pooled": comm.collective._pool.nbytes}
    comm.close()
    return out


@pytest.mark.parametrize("codec,collective,world,memory,bound", [
    ("maxmin", "allgather", 2, "none", 1.0),
    ("fp8", "allgather", 2, "residual", 1.0),
    ("maxmin", "sra", 3, "residual", 1.5),
])
def test_the_pipeline_holds_the_payloads_of_about_one_job_at_a_time(codec, collective, world, memory, bound):
    """Jobs in the pipeline take turns group by group (an older job's group decoded, then the
    new job's encoded), so the all-gather's payload buffers are no more than one job's alone
    (the SRA's, whose three stages keep three jobs in flight, half as much again), where running
    one job's stage to its end before the next one's held twice a job's; the same averages, bit
    for bit, an infinite gradient on one rank included."""
    for piped, alone in zip(run_workers(_payloads_in_flight, world, codec, collective, memory, True),
                            run_workers(_payloads_in_flight, world, codec, collective, memory, False)):
        assert 0 < piped["pooled"] <= bound * alone["pooled"], (piped["pooled"], alone["pooled"])
        for a, b in zip(piped["avgs"], alone["avgs"]):
            assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))
        assert all(bool(t.isnan().all()) for t in piped["avgs"][1][10:12])


def _raw_own_payloads(rank: int, world: int, codec: str, collective: str, options: dict, late: bool) -> dict:
    """Three jobs in the pipeline: a compressed group whose payloads are sent as they are, a
    plain sum of the same size (it borrows the same pool buffers across its wait), another group."""
    g = torch.Generator().manual_seed(rank)
    comm = gradzip.Communicator(codec, collective=collective, memory="residual", **options)
    if not late:
        comm.collective.reads_input_first = False
    jobs = [(["a.w0", "a.w1"], [True, True]), (["p.w0", "p.w1"], [False, False]), (["c.w0", "c.w1"], [True, True])]
    avgs = []
    for step in range(3):
        grads = [[torch.randn(64, 96, generator=g) for _ in names] for names, _ in jobs]
        avgs.append(_averages_of_jobs([
            comm.reduce_many_stages(grads[j], names, compress, inplace=True, step=step)
            for j, (names, compress) in enumerate(jobs)
        ]))
    out = {"avgs": avgs, "residuals": {k: v.clone() for k, v in comm.memory.residuals.items()}}
    comm.close()
    return out


@pytest.mark.parametrize("codec,collective,world,options", [
    ("none", "allgather", 2, {}),
    ("maxmin", "sra", 3, {"bits": 8, "bucket_size": 1}),  # a format larger than raw: sent raw
], ids=["none-allgather", "raw-sra"])
def test_a_payload_sent_as_it_is_is_read_where_it_was_sent_from_when_the_residual_settles(codec, collective, world, options):
    """Where this rank's own payload is its input, or was, the residual settles from bytes no
    other exchange has written over meanwhile: the same averages and residuals as an exchange
    that keeps its input to the end."""
    for late, early in zip(run_workers(_raw_own_payloads, world, codec, collective, options, True),
                           run_workers(_raw_own_payloads, world, codec, collective, options, False)):
        for a, b in zip(late["avgs"], early["avgs"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert late["residuals"].keys() == early["residuals"].keys()
        assert all(torch.equal(late["residuals"][k], early["residuals"][k]) for k in late["residuals"])


def _batch_in_its_memory(rank: int, world: int, codec: str, options: dict, device_flag: bool) -> dict:
    options = dict(options)
    memory = options.pop("memory", "residual")

    with _device_choices(device_flag):
        g = torch.Generator().manual_seed(rank)
        shapes = [(64, 48), (96, 32), (300,), (40, 40)]
        names, compress = [f"layer{i}.weight" for i in range(4)], [True, True, False, True]
        steps = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
        if rank == 1:
            steps[1][1][5, 7] = float("nan")
        out = {}
        for inplace in (True, False):
            comm = gradzip.Communicator(codec, memory=memory, **options)
            avgs, kept = [], []
            result, owned = comm.collective._result, []

            def counted(call, got, own=None):  # whether this rank's payloads were decoded into a buffer
                res = result(call, got, own)
                owned.append(res.own is not None)
                return res

            comm.collective._result = counted
            for step, grads in enumerate(steps):
                grads = [t.clone() for t in grads]
                res = drive(comm.reduce_many_stages(grads, names, compress, inplace=inplace, groups=[[0], [1], [3]], step=step))
                avgs.append([t.clone() for t in res])
                kept.append(sum(owned))
                owned.clear()
            out[inplace] = {"avgs": avgs, "kept": kept, "residuals": {n: r.clone() for n, r in comm.memory.residuals.items()}}
            comm.close()
        return out


@pytest.mark.parametrize("device_flag", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("codec,options", [("powersgd", {"rank": 2}), ("topk", {"ratio": 0.05}),
                                           ("powersgd", {"rank": 1, "memory": "powersgd"}), ("efsignsgd", {"memory": "efsign"})])
def test_gradients_that_cannot_share_an_encoding_are_compensated_and_averaged_in_their_own_memory(codec, options, device_flag):
    """On DDP's path, gradients exchanged one by one (PowerSGD's matrices alone in their job,
    summed in one all-reduce; top-k's and EF-signSGD's, gathered side by side) are compensated
    where they lie and their residuals settled as the collective releases them: the same
    averages and residuals as through compensated copies, a NaN step included, and no buffer of
    this rank's decoded payloads (each is decoded into its residual). (The memories that are a
    plain residual: ``residual``, and PowerSGD's and EF-signSGD's own.)"""
    for res in run_workers(_batch_in_its_memory, 2, codec, options, device_flag):
        lean, copied = res[True], res[False]
        assert lean["kept"] == [0, 0, 0] and copied["kept"][-1] == 3, (lean["kept"], copied["kept"])
        for a, b in zip(lean["avgs"], copied["avgs"]):
            assert all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))
        assert bool(lean["avgs"][1][1].isnan().all())
        assert lean["residuals"].keys() == copied["residuals"].keys()
        assert all(torch.equal(lean["residuals"][n], copied["residuals"][n]) for n in lean["residuals"])


def _lone_edge_cases(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    shapes = [(64, 48), (96, 32), (40, 40)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    if rank == 1:
        grads[1][5, 7] = float("nan")
    names = [f"layer{i}.weight" for i in range(3)]
    out = {}
    for inplace in (True, False):
        # without fusion each lone gradient keeps its own non-finite flag
        comm = gradzip.Communicator("powersgd", rank=2, memory="residual", fusion=False)
        avgs = drive(comm.reduce_many_stages([t.clone() for t in grads], names, [True] * 3, inplace=inplace,
                                             groups=[[0], [1], [2]], step=0))
        out[("no fusion", inplace)] = [bool(a.isnan().any()) for a in avgs]
        comm.close()
        # a residual of another dtype (a checkpoint's) still counts, as fp32
        comm = gradzip.Communicator("powersgd", rank=2, memory="residual")
        comm.memory.residuals["layer0.weight"] = torch.full(shapes[0], 0.5, dtype=torch.float16)
        clean = [t.nan_to_num(0.0) for t in grads]
        avgs = drive(comm.reduce_many_stages([t.clone() for t in clean], names, [True] * 3, inplace=inplace,
                                             groups=[[0], [1], [2]], step=0))
        out[("fp16 residual", inplace)] = ([a.clone() for a in avgs], comm.memory.residuals["layer0.weight"].clone())
        comm.close()
    return out


def test_lone_gradients_in_their_own_memory_keep_their_flags_without_fusion_and_a_residual_of_another_dtype():
    """On DDP's path: with ``fusion=False`` a NaN in one lone gradient makes only its own
    average NaN (no batch under one flag), and a stored fp16 residual is added as the copied
    path adds it (in fp32), not dropped."""
    for res in run_workers(_lone_edge_cases, 2):
        assert res[("no fusion", True)] == res[("no fusion", False)] == [False, True, False]
        (lean, r_lean), (copied, r_copied) = res[("fp16 residual", True)], res[("fp16 residual", False)]
        assert all(torch.equal(a, b) for a, b in zip(lean, copied))
        assert r_lean.dtype == torch.float32 and torch.equal(r_lean, r_copied)


def _batched(rank: int, world: int, codec: str, options: dict) -> dict:
    g = torch.Generator().manual_seed(10 + rank)
    shapes = [(64, 32), (16, 3, 3, 3), (128, 64), (32, 32), (10, 64), (50, 7)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    names = [f"layer{i}.weight" for i in range(len(shapes))]
    out = {}
    for fusion in (True, False):
        comm = gradzip.Communicator(codec, fusion=fusion, **options)
        groups = [[i] for i in range(len(grads))]  # what the plan makes of a codec that cannot fuse
        avgs = []
        with _Ops() as ops:
            for step in range(3):
                avgs.append(drive(comm.reduce_many_stages([t.clone() for t in grads], names, [True] * len(grads),
                                                          groups=groups, step=step)))
        # a non-finite gradient on one rank: every gradient of the batch comes back NaN
        bad = [t.clone() for t in grads]
        if rank == 1:
            bad[2][0, 0] = float("nan")
        with _Ops() as nan_ops:
            nan = drive(comm.reduce_many_stages(bad, names, [True] * len(grads), groups=groups, step=3))
        out[fusion] = {"avgs": avgs, "allreduce": ops.work["allreduce_"], "all_nan": [bool(t.isnan().all()) for t in nan],
                       "filled": nan_ops.filled}
        comm.close()
    return out


@pytest.mark.parametrize("codec,options", [("powersgd", {"rank": 2}), ("randomk", {"ratio": 0.1})])
def test_gradients_that_cannot_fuse_share_one_all_reduce_per_round(codec, options):
    """PowerSGD's matrices (two rounds) and random-k's values are encoded one by one but summed
    together: one all-reduce per round (and one for the flag) for them all, where one per
    gradient and round was made before, with the same averages on 2 ranks."""
    results = run_workers(_batched, 2, codec, options)
    for res in results:
        batched, alone = res[True], res[False]
        for a, b in zip(batched["avgs"], alone["avgs"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        rounds = 2 if codec == "powersgd" else 1
        assert batched["allreduce"] == 3 * (rounds + 1)  # 3 steps: the rounds and the flag
        assert alone["allreduce"] > 3 * 6  # at least one per gradient and step
        assert all(batched["all_nan"])  # one flag covers the batch
        assert alone["all_nan"] == [i == 2 for i in range(6)]  # alone, only the gradient that held it
        if codec == "powersgd":  # poisoned through the summed factors, not by a fill of each average
            assert len(batched["filled"]) <= 2 and sum(batched["filled"]) < 128 * 64, batched["filled"]
    assert all(torch.equal(x, y) for x, y in zip(results[0][True]["avgs"][-1], results[1][True]["avgs"][-1]))


def _fused_powersgd(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(30 + rank)
    shapes = [(64, 32), (64,), (16, 3, 3, 3), (3, 3), (128, 64), (10, 64)]
    names = [f"layer{i}" for i in range(len(shapes))]
    steps = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    steps[2][1][5] = float("nan") if rank == 1 else 0.0  # on one rank, in a tensor sent as it is
    out = {}
    for fusion in (True, False):
        comm = gradzip.Communicator("powersgd", rank=2, fusion=fusion)
        encodes, encode = [], comm.codec.encode
        comm.codec.encode = lambda *a, **k: encodes.append(k.get("parts", a[4] if len(a) > 4 else None)) or encode(*a, **k)
        avgs, residuals, sums, calls = [], [], [], []
        for step, grads in enumerate(steps):
            with _Ops() as ops:
                avgs.append(comm.reduce_many_now([t.clone() for t in grads], names, [True] * len(grads), step=step))
            residuals.append({n: r.clone() for n, r in comm.memory.residuals.items()})
            sums.append(ops.work["allreduce_"])
            calls.append(ops.work["mm"])
        out[fusion] = {"avgs": avgs, "residuals": residuals, "allreduce": sums, "mm": calls, "encodes": encodes}
        comm.close()
    return out


def test_a_group_of_powersgd_gradients_is_one_call_with_the_values_of_each_alone():
    """PowerSGD's gradients of a group (the plan's; here a whole call) go through the codec as
    one fused buffer: one all-reduce a round for them all and one for the flag, four products a
    matrix (two factors, this rank's own decode for error feedback, the average), with the
    averages and residuals of each gradient exchanged alone (to the rounding of its products'
    layout), on both ranks the same bits; a NaN on one rank in a 1-D gradient, sent as it is in
    the last round, makes every average of the group NaN and keeps every residual."""
    results = run_workers(_fused_powersgd, 2)
    for res in results:
        fused, alone = res[True], res[False]
        for step in (0, 1):
            for x, y in zip(fused["avgs"][step], alone["avgs"][step]):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
            for n, r in alone["residuals"][step].items():
                torch.testing.assert_close(fused["residuals"][step][n], r, rtol=1e-5, atol=1e-5)
        # one encode a step, of the group's buffer with its parts (in name order); one a gradient alone
        assert [len(p) for p in fused["encodes"]] == [6] * 4 and alone["encodes"] == [None] * 6 * 4
        assert [name for name, _ in fused["encodes"][0]] == sorted(f"layer{i}" for i in range(6))
        assert fused["allreduce"] == [3] * 4, fused["allreduce"]  # P, the flag beside it, Q with the rest
        assert alone["allreduce"][1] > 3
        assert fused["mm"][1] == 4 * 4, fused["mm"]  # four matrices: (64,), (3, 3) go as they are
        assert all(t.isnan().all() for t in fused["avgs"][2])
        assert [bool(t.isnan().all()) for t in alone["avgs"][2]] == [i == 1 for i in range(6)]
        assert all(torch.equal(fused["residuals"][2][n], r) for n, r in fused["residuals"][1].items())
        assert all(t.isfinite().all() for t in fused["avgs"][3])
    for step in range(4):
        for x, y in zip(results[0][True]["avgs"][step], results[1][True]["avgs"][step]):
            assert torch.equal(x.nan_to_num(1.5), y.nan_to_num(1.5))


def _empty_group(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("powersgd", rank=2)
    out = comm.reduce_many_now([torch.zeros(0, 5), torch.zeros(0)], ["e1", "e2"], [True, True])
    shapes = [tuple(t.shape) for t in out]
    settings = (comm.settings(), gradzip.Communicator("powersgd", fusion=False).settings())
    comm.close()
    return {"shapes": shapes, "settings": settings}


def test_a_powersgd_group_of_empty_gradients_comes_back_empty_and_fusion_is_a_setting_only_when_off():
    """Nothing to encode: the empty gradients are exchanged one by one. PowerSGD's settings
    name ``fusion`` only where it is off, so state saved before its groups were fused still
    loads, while ranks that differ on it are told."""
    for res in run_workers(_empty_group, 2):
        assert res["shapes"] == [(0, 5), (0,)]
        fused, unfused = res["settings"]
        assert "fusion" not in fused and unfused["fusion"] is False


def _batch_shapes():
    return [(64, 32), (16, 3, 3, 3), (128, 64), (32, 32), (10, 64)]


def _batched_memory(rank: int, world: int) -> dict:
    from gradzip.sync import device, memory

    g = torch.Generator().manual_seed(20 + rank)
    shapes = _batch_shapes()
    steps = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    steps[2][1].view(-1)[7] = float("nan") if rank == 1 else 0.0  # a non-finite step: residuals kept
    names = [f"layer{i}.weight" for i in range(len(shapes))]
    out = {}
    reads, host = device.reads_flag_on_host, memory.reads_on_host
    try:
        for device_flag in (False, True):
            if device_flag:  # an accelerator's way, on the CPU: the flag is used on the device, not read
                device.reads_flag_on_host = lambda where: False
                memory.reads_on_host = lambda flag: False
            for fusion in (True, False):
                comm = gradzip.Communicator("powersgd", rank=2, fusion=fusion)
                avgs, residuals, ops_of_step = [], [], []
                for step, grads in enumerate(steps):
                    with _Ops() as ops:
                        avgs.append(drive(comm.reduce_many_stages([t.clone() for t in grads], names, [True] * len(grads),
                                                                  groups=[[i] for i in range(len(grads))], step=step)))
                    residuals.append({n: r.clone() for n, r in comm.memory.residuals.items()})
                    ops_of_step.append(ops.work + Counter(picks=ops.picks))
                out[(device_flag, fusion)] = {"avgs": avgs, "residuals": residuals, "ops": ops_of_step}
                comm.close()
    finally:
        device.reads_flag_on_host, memory.reads_on_host = reads, host
    return out


def _cast_batch_made(rank: int, world: int) -> dict:
    out = {}
    for name in ("fp16", "bf16"):
        comm = gradzip.Communicator(name, memory="none", collective="allreduce")
        shapes = [(256, 64), (3000,), (128, 33)]
        tensors = [torch.randn(s, generator=torch.Generator().manual_seed(50 + rank)) for s in shapes]
        names = [f"t{i}" for i in range(len(shapes))]
        want = [t.clone() for t in tensors]
        for step in range(2):
            for t, w in zip(tensors, want):
                t.copy_(w)
            with _Made() as m:
                avgs = drive(comm.reduce_many_stages(tensors, names, [True] * 3, inplace=True,
                                                     groups=[[0], [1], [2]], step=step))
        out[name] = {"made": m.made, "avgs": [a.clone() for a in avgs], "numel": sum(t.numel() for t in tensors)}
        comm.close()
    return out


def test_a_batch_of_casts_is_encoded_into_the_buffer_it_is_summed_in():
    """Without error feedback nothing reads a cast's payload after its sum, so the payloads of
    gradients exchanged side by side (each alone in its group) are encoded straight into the
    one buffer the all-reduce sums: 2 bytes a value made, not a payload and a packed copy of
    it; both ranks get the same averages, each within a 16-bit rounding of the exact mean."""
    results = run_workers(_cast_batch_made, 2)
    for name in ("fp16", "bf16"):
        r0, r1 = results[0][name], results[1][name]
        made = sum(nbytes for _, nbytes in r0["made"])
        assert made <= 2 * r0["numel"] + 1024 and "cat" not in {op for op, _ in r0["made"]}, (name, r0["made"])
        assert all(torch.equal(a, b) for a, b in zip(r0["avgs"], r1["avgs"]))
        gen = lambda rank, s: torch.randn(s, generator=torch.Generator().manual_seed(50 + rank))  # noqa: E731
        for a, s in zip(r0["avgs"], [(256, 64), (3000,), (128, 33)]):
            exact = (gen(0, s) + gen(1, s)) / 2
            assert torch.allclose(a, exact, rtol=1e-2, atol=1e-2), name


def _casts_with_feedback(rank: int, world: int, device_flag: bool) -> dict:
    out = {}
    with _device_choices(device_flag):
        for groups in ([[0, 1, 2]], [[0], [1], [2]]):  # one fused group; each alone (a batch in place)
            comm = gradzip.Communicator("fp16", memory="residual", collective="allreduce")
            shapes = [(256, 64), (3000,), (128, 33)]
            names = [f"t{i}.weight" for i in range(len(shapes))]
            made, residuals = [], []
            for step in range(3):
                g = torch.Generator().manual_seed(60 + 10 * step + rank)
                tensors = [torch.randn(s, generator=g) * 100 for s in shapes]
                if step == 2 and rank == 1:
                    tensors[1][5] = float("nan")
                before = {n: r.clone() for n, r in comm.memory.residuals.items()}
                inputs = [t + before[n] if n in before else t.clone() for t, n in zip(tensors, names)]
                with _Made() as m:
                    drive(comm.reduce_many_stages(tensors, names, [True] * 3, inplace=True, groups=groups, step=step))
                made.append(m.made)
                residuals.append(({n: r.clone() for n, r in comm.memory.residuals.items()}, inputs, before))
            out[len(groups)] = {"made": made, "residuals": residuals, "names": names}
            comm.close()
    return out


@pytest.mark.parametrize("device_flag", [False, True], ids=["cpu", "accelerator"])
def test_a_cast_with_error_feedback_encodes_its_own_payload_again_instead_of_keeping_a_copy(device_flag):
    """The all-reduce sums a cast's payload in place; with error feedback this rank's own
    payload is encoded once more from the input when the residual settles (the same bytes: a
    cast is deterministic) rather than copied before the sum: no copy of a payload is made,
    in a fused group or a batch of gradients alone, and the residual is the input less its own
    share, fp16(x / W) · W, to the bit; a non-finite step keeps it (the group's, or the one
    gradient's where each is exchanged alone)."""
    for res in run_workers(_casts_with_feedback, 2, device_flag):
        for groups, case in res.items():
            for made in case["made"][1:]:
                assert not [m for m in made if m[0] == "clone" and m[1] >= 1024], made
            for step, (after, inputs, before) in enumerate(case["residuals"]):
                for name, x in zip(case["names"], inputs):
                    if step == 2 and (groups == 1 or name == "t1.weight"):  # a NaN on rank 1: kept
                        assert torch.equal(after[name], before[name]), name
                        continue
                    share = (x / 2).to(torch.float16).float() * 2
                    assert torch.equal(after[name].view(-1), (x - share).view(-1)), (step, name)


def _linear_payloads(rank: int, world: int) -> dict:
    out = {}
    for fusion, inplace in ((False, False), (True, True)):
        comm = gradzip.Communicator("randomk", ratio=0.05, memory="residual", collective="allreduce", fusion=fusion)
        xs = [torch.randn(s, generator=torch.Generator().manual_seed(40 + rank)) for s in ((64, 32), (300,))]
        names = ["a.weight", "b.weight"]
        tensors = [x.clone() for x in xs]
        avgs = comm.reduce_many_now(tensors, names, [True, True], inplace=inplace, step=0)
        out[(fusion, inplace)] = {"x": xs, "avg": [a.clone() for a in avgs],
                                  "res": [comm.memory.residuals[n].clone().view(-1) for n in names]}
        comm.close()
    return out


def test_a_payload_linear_in_its_input_is_divided_after_encoding_so_its_own_share_is_exact():
    """Random-k's values are summed as copies divided by W (not drawn from the input's
    quotient), so this rank's own share is the drawn values themselves: at 3 ranks, where
    ``x / 3 * 3`` is not always ``x``, the residual is exactly 0 where a value was sent and the
    input elsewhere, one by one and batched in place; every rank gets the same average."""
    results = run_workers(_linear_payloads, 3)
    for case in results[0]:
        for res in results:
            for x, r in zip(res[case]["x"], res[case]["res"]):
                sent = r == 0
                assert 0 < int(sent.sum()) < x.numel() // 10, case
                assert torch.equal(r[~sent], x.view(-1)[~sent]), case
        for a, b in zip(results[0][case]["avg"], results[2][case]["avg"]):
            assert torch.equal(a, b)


def test_error_feedback_of_a_batch_takes_multi_tensor_operations_with_the_same_values():
    """PowerSGD's matrices of a bucket are compensated by one multi-tensor add and, with the
    flag on the device, their residuals computed by one multi-tensor subtraction and picked by
    the flag in one operation (the residuals are views of one buffer); the packed factors, not
    the inputs, are divided by W, one division a round, and this rank's own payloads need no
    scaling: the averages and residuals are those of the matrices one by one,
    a non-finite step keeps every residual, and both ranks agree."""
    results = run_workers(_batched_memory, 2)
    same = lambda a, b: torch.equal(a.nan_to_num(1.5), b.nan_to_num(1.5))  # noqa: E731
    for res in results:
        for device_flag in (False, True):
            batched, alone = res[(device_flag, True)], res[(device_flag, False)]
            for step in (0, 1):  # before the non-finite step (alone, only the matrix holding it is flagged)
                assert all(torch.equal(x, y) for x, y in zip(batched["avgs"][step], alone["avgs"][step]))
                a, b = batched["residuals"][step], alone["residuals"][step]
                assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
            assert all(t.isnan().all() for t in batched["avgs"][2])
            assert all(torch.equal(batched["residuals"][2][n], batched["residuals"][1][n]) for n in batched["residuals"][1])
            steady = batched["ops"][3]  # a step after the first: every residual exists
            assert steady["_foreach_add"] == 1, steady  # compensated
            # the packed sums' copies divided by W in place: no quotient of the inputs
            assert steady["_foreach_div"] == 0, steady
            # with the flag on the device: the residuals written by one multi-tensor copy and
            # subtraction into one buffer, then picked against the old ones in one operation
            assert steady["_foreach_sub_"] == steady["_foreach_copy_"] == steady["picks"] == device_flag, steady
            assert alone["ops"][3]["_foreach_add"] == 0
            # this rank's own payloads, decoded for the residuals, are its share as they are
            assert steady["_foreach_mul_"] == steady["mul_"] == 0, steady
            assert alone["ops"][3]["mul_"] == 0, alone["ops"][3]
        # the flag used on the device gives what the flag read on the host gives, every step
        for step in range(4):
            on_device, on_host = res[(True, True)], res[(False, True)]
            assert all(same(x, y) for x, y in zip(on_device["avgs"][step], on_host["avgs"][step]))
            assert all(torch.equal(on_device["residuals"][step][n], on_host["residuals"][step][n]) for n in on_host["residuals"][step])
    assert all(torch.equal(x, y) for x, y in zip(results[0][(True, True)]["avgs"][3], results[1][(True, True)]["avgs"][3]))


def _plain_mixed(rank: int, world: int) -> list:
    comm = gradzip.Communicator("maxmin", bits=4)
    tensors = [torch.arange(8, dtype=torch.float32) + rank, torch.arange(5).to(torch.float16) * (rank + 1),
               torch.arange(3).to(torch.bfloat16) - rank, torch.full((2, 2), 3.0 * rank)[:, :1]]
    out = comm.reduce_many_now(tensors, ["a", "b", "c", "d"], [False] * 4, inplace=True)
    comm.close()
    assert all(o is t for o, t in zip(out, tensors))
    return tensors


def test_uncompressed_gradients_of_several_dtypes_are_averaged_in_place_each_in_its_own():
    """fp32, fp16, bf16 and a non-contiguous view in one plain sum: each gets the average back
    in its own dtype and place (the copy back is one multi-tensor copy only where dtypes agree)."""
    for res in run_workers(_plain_mixed, 2):
        a, b, c, d = res
        assert torch.equal(a, torch.arange(8, dtype=torch.float32) + 0.5)
        assert b.dtype == torch.float16 and torch.equal(b, (torch.arange(5) * 1.5).half())
        assert c.dtype == torch.bfloat16 and torch.equal(c, (torch.arange(3) - 0.5).bfloat16())
        assert torch.equal(d, torch.full((2, 1), 1.5))


def _held_back(rank: int, world: int, pipeline: bool) -> dict:
    comm = gradzip.Communicator("maxmin", bits=4, pipeline=pipeline)
    cpu = torch.device("cpu")

    def job(value: int):
        yield  # would wait for a collective here
        return value

    first = comm.submit_staged(lambda: job(1), cpu, flush=False)
    comm.submit(lambda: None, cpu).wait()  # the worker's queue is in order: the first job has arrived
    held = not first.done()
    second = comm.submit_staged(lambda: job(2), cpu, flush=True)
    out = {"held": held, "values": (first.wait(), second.wait()), "pipelines": comm.pipelines(cpu),
           "queues_on_stream": comm.queues_on_stream(cpu)}
    comm.close()
    return out


@pytest.mark.parametrize("pipeline", [True, False])
def test_over_gloo_a_job_waits_in_the_pipeline_for_the_next_one_unless_pipelining_is_off(pipeline):
    (res,) = run_workers(_held_back, 1, pipeline)
    assert res == {"held": pipeline, "values": (1, 2), "pipelines": pipeline, "queues_on_stream": False}


def _layouts_kept(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("maxmin", bits=4)
    buffer, tensors, names, compress = _bucket(8)
    kept = []
    for step in range(4):  # a group of 8 at step 0, of its first 6 from step 1 on (a new plan)
        n = 8 if step == 0 else 6
        drive(comm.reduce_many_stages(tensors[:n], names[:n], [True] * n, inplace=True, step=step))
        kept.append(sorted(len(layout.order) for layout in comm._fused_layouts.values()))
    in_place = []
    for step in range(4, 7):  # the bucket averaged in its own memory from now on: no fused group
        drive(comm.bucket_stages(buffer, tensors, names, compress, step))
        in_place.append(len(comm._fused_layouts))
    drive(comm.reduce_many_stages(tensors, names, [True] * 8, inplace=True, step=7))
    comm.close()
    return {"plan": kept, "in_place": in_place, "closed": len(comm._fused_layouts)}


def test_the_layout_of_a_group_no_longer_exchanged_is_dropped_with_its_views():
    """A layout keeps views of its group's buffers: it goes when the pool lets them go (a group
    the plan no longer makes, buckets now averaged in place) and when the communicator closes."""
    for res in run_workers(_layouts_kept, 2):
        assert res["plan"] == [[8], [6, 8], [6], [6]], res  # kept through the next step, as the pool keeps buffers
        assert res["in_place"] == [1, 0, 0], res
        assert res["closed"] == 0, res


def _groups_after_close(rank: int, world: int) -> dict:
    import weakref

    out = {}
    for name, options in (("maxmin", {"bits": 4, "memory": "residual"}), ("topk", {"ratio": 0.1}),
                          ("fp16", {"collective": "allreduce"})):
        comm = gradzip.Communicator(name, **options)
        buffer, tensors, names, compress = _bucket(8)
        for step in range(2):
            drive(comm.reduce_many_stages(tensors, names, compress, inplace=True, step=step))
        dedicated = weakref.ref(comm.group)
        comm.close()
        out[name] = dedicated() is None
    return out


def test_closing_frees_the_dedicated_process_group_at_once():
    """The communicator's own process group is freed when it closes, not when the interpreter
    finalises (a gloo thread still dropping its last collective's tensors then needs the GIL,
    and ending it aborts the process): nothing it made keeps a reference to the group."""
    for res in run_workers(_groups_after_close, 2):
        assert all(res.values()), res


def _beyond_fp16(rank: int, world: int) -> dict:
    out = {}
    for codec, opts in (("randomk", {"ratio": 1.0}), ("topk", {"ratio": 1.0}), ("adaq", {})):
        comm = gradzip.Communicator(codec, memory="residual", **opts)
        comm.memory.residuals["s"] = torch.full((8,), 40000.0)  # what earlier steps left unsent
        out[codec] = comm.reduce_now(torch.full((8,), 40000.0, dtype=torch.float16), "s")
        comm.close()
    return out


def test_an_fp32_compensation_beyond_an_fp16_gradients_range_is_delivered_as_its_largest_value():
    """fp16 gradients with error feedback: the codec's input is their fp32 compensation, which
    can pass fp16's range (40000 + 40000); the average goes back into the fp16 gradient by a
    saturating cast (65504), not as inf, whichever the codec (top-k sends fp16 values, random-k
    and AdaComp fp32 ones)."""
    for res in run_workers(_beyond_fp16, 2):
        for codec, avg in res.items():
            assert avg.dtype == torch.float16 and bool(avg.isfinite().all()), (codec, avg)
            assert float(avg.max()) == 65504.0, (codec, avg)


def test_a_closed_communicator_refuses_a_reduce_scatter():
    """Closed, its collectives hold no process group (None would mean the default one): FSDP2's
    reduce-scatter, which runs on the caller's thread, is refused rather than sent there."""
    comm = gradzip.Communicator("maxmin", bits=4, dedicated_group=False)
    comm.close()
    with pytest.raises(RuntimeError, match="has been closed"):
        comm.reduce_scatter(torch.zeros(8), torch.zeros(8), "w")


def test_a_communicator_left_open_is_closed_before_the_interpreter_finalises(tmp_path):
    """A script that never calls ``close()``: gradzip's exit handler closes the communicator
    (its dedicated process group freed then, not during finalisation) before handlers that the
    script registered earlier run."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "left_open.py"
    script.write_text(textwrap.dedent(f"""
        import atexit
        state = {{}}
        atexit.register(lambda: print("closed at exit:", state["comm"]._closed, state["comm"].group is None))
        import torch
        import torch.distributed as dist
        import gradzip
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rendezvous", rank=0, world_size=1)
        state["comm"] = gradzip.Communicator("maxmin", bits=4, memory="residual")
        state["comm"].allreduce(torch.randn(4096), name="w")
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "closed at exit: True True" in run.stdout, (run.stdout, run.stderr[-2000:])


def _adacomp_residuals(rank: int, world: int) -> dict:
    out = {}
    for reads_memory in (True, False):
        comm = gradzip.Communicator("adaq", bin_size=7)  # its default memory: residual
        if not reads_memory:
            comm.codec.use_memory(None)  # as on a hierarchical layout: a copy of its own
        gen = torch.Generator().manual_seed(70 + rank)
        shapes, names = ((40, 30), (333,)), ["a.weight", "b.weight"]
        avgs = []
        for step in range(4):
            tensors = [torch.randn(s, generator=gen) for s in shapes]
            avgs += [a.clone() for a in comm.reduce_many_now(tensors, names, [True, True], inplace=True, step=step)]
        out[reads_memory] = {"avg": avgs, "kept": len(comm.codec.state_dict().get("residuals", {}))}
        comm.close()
    return out


def test_adacomp_under_the_residual_memory_selects_with_the_memorys_residual_not_a_copy():
    """AdaComp's self-adjusting selection needs last step's residual: under the plain residual
    memory it reads the memory's (no second copy of every gradient) and selects what it selects
    with a copy of its own, step after step."""
    for res in run_workers(_adacomp_residuals, 2):
        assert res[True]["kept"] == 0 and res[False]["kept"] == 2
        assert all(torch.equal(a, b) for a, b in zip(res[True]["avg"], res[False]["avg"]))


# summed codecs that take a group by its parts laid back to back, as DDP lays out a bucket
BY_PARTS = {"powersgd": {"rank": 2}, "randomk": {"ratio": 0.05}}
# gathered ones by parts, whose default path holds no copy of a group through its exchange
GATHERED_BY_PARTS = {"topk": {"ratio": 0.05}, "sketchml": {}, "sketchml-sparse": {"ratio": 0.05}}


def _bucket_of(dtype: torch.dtype, count: int = 8):
    """:func:`_bucket` in ``dtype``."""
    buffer, tensors, names, compress = _bucket(count)
    if dtype == torch.float32:
        return buffer, tensors, names, compress
    cast, views, at = buffer.to(dtype), [], 0
    for t in tensors:
        views.append(cast[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return cast, views, names, compress


def _by_parts_in_place(rank: int, world: int, memory: str, dtype: torch.dtype) -> dict:
    out = {}
    # "decay": a residual scaled by gamma before the new gradient is added
    kind = {"memory": "residual", "memory_options": {"gamma": 0.5}} if memory == "decay" else {"memory": memory}
    for label, options in GATHERED_BY_PARTS.items():
        buffer, tensors, names, compress = _bucket(8)
        comm = gradzip.Communicator(label.split("-")[0], **kind, **options)
        out[label] = comm.in_place(buffer, tensors, names, compress)
        comm.close()
    for label, options in BY_PARTS.items():
        name = label.split("-")[0]
        for path in ("in place", "fused"):
            comm = gradzip.Communicator(name, **kind, **options)
            buffer, tensors, names, compress = _bucket_of(dtype)
            assert comm.in_place(buffer, tensors, names, compress), label
            avgs = []
            for step in range(3):
                buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(step * 7 + rank)).to(dtype))
                if path == "in place":
                    drive(comm.bucket_stages(buffer, tensors, names, compress, step))
                else:
                    drive(comm.reduce_many_stages(tensors, names, compress, inplace=True, step=step))
                avgs.append(buffer.clone())
            stats = comm.stats()
            # then a NaN in an uncompressed gradient on the last rank
            buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(50 + rank)).to(dtype))
            if rank == world - 1:
                tensors[1].view(-1)[3] = float("nan")
            kept = {k: v.clone() for k, v in getattr(comm.memory, "residuals", {}).items()}
            if path == "in place":
                drive(comm.bucket_stages(buffer, tensors, names, compress, 3))
            else:
                drive(comm.reduce_many_stages(tensors, names, compress, inplace=True, step=3))
            out[label, path] = {"avgs": avgs, "ratio": stats["ratio"], "layouts": len(comm._fused_layouts),
                                "residuals": sorted(getattr(comm.memory, "residuals", {})),
                                "counted": (stats["params_compressed"], stats["params_uncompressed"]),
                                "nan": [int(t.isnan().sum()) for t in tensors],
                                "kept": all(torch.equal(v, comm.memory.residuals[k]) for k, v in kept.items())}
            comm.close()
    return out


@pytest.mark.parametrize("memory, dtype", [("none", torch.float32), ("residual", torch.float32), ("decay", torch.float32),
                                           ("none", torch.float16), ("none", torch.bfloat16)])
def test_codecs_by_parts_average_a_bucket_where_it_lies(memory, dtype):
    """PowerSGD and random-k take a DDP bucket as it lies, by its members in DDP's order (no
    flat copy of the group): the same averages as the default path's fused group, sorted by
    name, to the last bits a product takes from where it lies; the uncompressed gradients
    exactly (PowerSGD carries them with its factors), every rank alike, and the measured wire
    in the ratio, the uncompressed ones counted as such. With a residual that decays
    (``gamma``) PowerSGD copies them out instead: the decay is not theirs. Top-k and SketchML
    stay on the default path. (16-bit buckets are averaged in place without error feedback
    only: the residual is fp32.)"""
    results = run_workers(_by_parts_in_place, 2, memory, dtype)
    assert not any(results[0][label] for label in GATHERED_BY_PARTS)
    _, tensors, names, compress = _bucket(8)
    plain = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.bool)
    at = 0
    for t, c in zip(tensors, compress):
        plain[at : at + t.numel()] = not c
        at += t.numel()
    for label in BY_PARTS:
        here, fused = results[0][label, "in place"], results[0][label, "fused"]
        assert here["layouts"] == 0 and fused["layouts"] >= 1, label  # no group buffer laid out in place
        for a, b in zip(here["avgs"], results[1][label, "in place"]["avgs"]):
            assert torch.equal(a, b), label  # every rank alike
        for step, (a, b) in enumerate(zip(here["avgs"], fused["avgs"])):
            assert torch.equal(a[plain], b[plain]), (label, step)
            assert not torch.equal(a[~plain], b[plain].new_zeros(int((~plain).sum()))), label  # compressed, not dropped
            tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}  # (16-bit: one rounding of the same)
            torch.testing.assert_close(a[~plain], b[~plain], **tol, msg=f"{label} step {step}")
        assert 1.5 < here["ratio"] and abs(here["ratio"] / fused["ratio"] - 1) < 0.05, (label, here["ratio"], fused["ratio"])
        assert here["counted"] == fused["counted"] == (compress.count(True), compress.count(False)), label
        # a NaN in an uncompressed gradient: carried with PowerSGD's factors, it makes the whole
        # bucket NaN (residuals kept); summed apart, it stays in its own value
        numels = [t.numel() for t in tensors]
        alone = [1 if i == 1 else 0 for i in range(len(tensors))]
        carried = label == "powersgd" and memory != "decay"
        assert here["nan"] == (numels if carried else alone) and fused["nan"] == alone, (label, here["nan"])
        assert here["kept"] == carried and not fused["kept"] or memory == "none", label
        if memory != "none":
            assert here["residuals"] == sorted(n for n, c in zip(names, compress) if c), label


def test_dgc_compensates_a_gradient_alone_into_its_own_memory_when_the_average_goes_there():
    """A gradient exchanged alone whose average overwrites it (DDP's path, ``out`` = the
    gradient) is compensated where it lies under DGC's memory, which sums ``v + u`` again when
    it updates (``remakes_input``): over four steps, one of them with a NaN, the averages and
    both states are those of the same steps with the average in a tensor of its own, bit for
    bit, and each step makes one tensor of the gradient's size fewer (the compensated copy)."""
    from ..tensors import LargestMade

    n = 50_000
    comms = [gradzip.Communicator("dgc", ratio=0.01) for _ in range(2)]
    made_in_place, made_apart = [], []
    for step in range(4):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step))
        if step == 2:
            g[3] = float("nan")
        own = g.clone()
        with LargestMade((torch.float32,)) as made:
            comms[0].reduce_now(own, "w", out=own)  # into the gradient
        made_in_place.append(made.nbytes)
        with LargestMade((torch.float32,)) as made:
            apart = comms[1].reduce_now(g.clone(), "w")  # into a tensor of its own
        made_apart.append(made.nbytes)
        assert torch.equal(own.nan_to_num(7.0), apart.nan_to_num(7.0)), step
        assert torch.isnan(own).all() == (step == 2)
        for store in ("momentums", "velocities"):
            state_into, state_apart = (getattr(c.memory, store)["w"] for c in comms)
            assert torch.equal(state_into, state_apart), (step, store)
    # (apart: the compensated copy and the average's tensor beyond what both make)
    # into the gradient: no tensor of its size but this step's u and its own payload decoded
    # (the sent values' mask) once u exists, where the average apart makes four (five where the
    # selection's magnitudes are a tensor: torch's version, not the C loops')
    assert all(b < 2.1 * 4 * n for b in made_in_place[1:]), made_in_place
    assert all(a > 3.9 * 4 * n for a in made_apart), made_apart
    for c in comms:
        c.close()


def test_allreduce_without_a_name_warns_once_where_state_is_kept_by_name():
    """A residual, a momentum or factors are kept by the tensor's name: tensors sent without
    one share them (and would mix theirs), so the first such call says so, once; a stateless
    codec and memory, or a name, say nothing."""
    import warnings

    for codec, opts, warns in (("topk", {"memory": "residual"}, True), ("signum", {}, True), ("maxmin", {}, False)):
        comm = gradzip.Communicator(codec, **opts)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in ("", "", "w"):
                comm.allreduce(torch.randn(100), name=name)
        said = [str(w.message) for w in caught if "without a name" in str(w.message)]
        assert len(said) == (1 if warns else 0), (codec, said)
        assert not warns or "pass name=" in said[0]
        comm.close()


def test_a_batch_is_checked_where_it_is_made():
    """A name and a compress flag for each tensor, floating-point tensors: checked when the
    Batch is made, before the worker takes it (a batch failing there fails the communicator)."""
    from gradzip.sync.engine import Batch

    a, b = torch.zeros(3), torch.zeros(2)
    with pytest.raises(ValueError, match="a name and a compress flag for each of the 2 tensors"):
        Batch([a, b], ["a"], [True, True])
    with pytest.raises(ValueError, match="1 names and 2 flags"):
        Batch([a], ["a"], [True, False])
    with pytest.raises(TypeError, match="floating-point tensors, got torch.int32"):
        Batch([torch.zeros(3, dtype=torch.int32)], ["a"], [True])
    assert Batch([a, b], ["a", "b"], [True, False]).names == ["a", "b"]
