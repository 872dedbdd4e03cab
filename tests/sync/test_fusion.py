"""Fused buffers: several gradients through one encoding and one exchange, on real gloo ranks."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

import gradzip
from gradzip.comm.ps import partition_bounds
from gradzip.comm.sra import _chunks, chunk_length
from gradzip.sync.groups import FusionPlan, GroupCollector, padding

from ..dist_utils import run_workers

SHAPES = {"a.weight": (37, 29), "b.weight": (3000,), "c.weight": (5, 7, 61), "d.weight": (1, 2049)}


def _grads(rank: int, scales: Dict[str, float] = {}, dtype=torch.float32) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(shape, generator=g) * scales.get(n, 1.0)).to(dtype) for n, shape in SHAPES.items()]


def _gather(t: torch.Tensor) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _reduce(comm: gradzip.Communicator, grads: List[torch.Tensor], names: List[str]) -> List[torch.Tensor]:
    return comm.reduce_many_now([g.clone() for g in grads], names, [True] * len(grads))


def _fused_equals_one_by_one(rank: int, world: int, dtype) -> Dict[str, bool]:
    """maxmin with deterministic rounding on the all-gather: blocks start at each tensor either
    way, so fusing must not change a single bit."""
    names = list(SHAPES)
    grads = _grads(rank, dtype=dtype)
    out = {}
    for collective in ("allgather", "sra"):
        fused = gradzip.Communicator("maxmin", bits=3, bucket_size=64, mode="nearest", collective=collective, fusion=True)
        alone = gradzip.Communicator("maxmin", bits=3, bucket_size=64, mode="nearest", collective=collective, fusion=False)
        a, b = _reduce(fused, grads, names), _reduce(alone, grads, names)
        if collective == "allgather":
            out["bitwise"] = all(torch.equal(x, y) for x, y in zip(a, b))
        out[f"{collective}:dtype"] = all(x.dtype == dtype and x.shape == g.shape for x, g in zip(a, grads))
        out[f"{collective}:identical"] = all(all(torch.equal(x, y) for y in _gather(x)) for x in a)
        fused.close()
        alone.close()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fusing_changes_no_bit_where_blocks_line_up(dtype):
    for res in run_workers(_fused_equals_one_by_one, 2, dtype):
        assert res["bitwise"]
        assert all(v for k, v in res.items() if k != "bitwise")


def _elementwise_fused_and_alone(rank: int, world: int, name: str, opts: dict) -> Dict[str, bool]:
    names = list(SHAPES)
    grads = _grads(rank)
    grads[1][::7] = 0.0  # zeros vote +, as alone
    fused = gradzip.Communicator(name, fusion=True, **opts)
    alone = gradzip.Communicator(name, fusion=False, **opts)
    calls = []
    for comm in (fused, alone):  # encodes counted
        encode, count = comm.codec.encode, [0]
        comm.codec.encode = lambda *args, _e=encode, _c=count, **kw: (_c.__setitem__(0, _c[0] + 1), _e(*args, **kw))[1]
        calls.append(count)
    a, b = _reduce(fused, grads, names), _reduce(alone, grads, names)
    calls = tuple(c[0] for c in calls)
    fused.close()
    alone.close()
    return {"bitwise": all(torch.equal(x, y) for x, y in zip(a, b)), "calls": calls,
            "identical": all(all(torch.equal(x, y) for y in _gather(x)) for x in a)}


@pytest.mark.parametrize("world,name,opts", [(2, "signsgd", {}), (3, "signsgd", {}), (2, "tbq", {"threshold": 0.5}),
                                             (3, "tbq", {"threshold": 0.5, "memory": "none"}),
                                             (2, "threshold", {"threshold": 1.0}),
                                             (3, "threshold", {"threshold": 2.0, "memory": "none"}),
                                             (2, "inceptionn", {}), (3, "inceptionn", {"error_bound": 0.01}),
                                             (2, "cl_tbq", {"threshold": 0.5})])  # (a CompLL codec's ``block``)
def test_elementwise_codecs_send_a_fused_group_exactly_as_its_gradients_alone(world, name, opts):
    """signSGD (a bit and a vote a value), TBQ (a code a value, τ shared), threshold
    sparsification (a value sent by its own magnitude) and INCEPTIONN (a tag and bytes a
    value): one encode a group, the same bits as one tensor at a time."""
    for res in run_workers(_elementwise_fused_and_alone, world, name, opts):
        assert res["bitwise"] and res["identical"]
        assert res["calls"] == (1, len(SHAPES)), res["calls"]


def _by_parts_fused_and_alone(rank: int, world: int, in_turn: bool, name: str, opts: dict) -> Dict[str, object]:
    """Three steps of a codec encoded by parts with its error feedback, fused and one tensor at
    a time; the third with a NaN in one member on the last rank."""
    from gradzip.kernels import fused

    # the CPU's way (members in turn), or the accelerator's on CPU tensors (a group at once): the
    # sign codecs' statistics, top-k's selections, random-k's draws, DGC's memory
    fused.groups_at_once = lambda device: not in_turn
    names = list(SHAPES)
    out: Dict[str, object] = {}
    comms = {"fused": gradzip.Communicator(name, fusion=True, **opts),
             "alone": gradzip.Communicator(name, fusion=False, **opts)}
    calls = {}
    for key, comm in comms.items():
        encode, count = comm.codec.encode, [0]
        comm.codec.encode = lambda *args, _e=encode, _c=count, **kw: (_c.__setitem__(0, _c[0] + 1), _e(*args, **kw))[1]
        calls[key] = count
    for step in range(3):
        grads = _grads(rank + 10 * step, {"b.weight": 1e-3, "c.weight": 1e3})
        if step == 2 and rank == world - 1:
            grads[2][0, 0, 5] = float("nan")
        got = {key: _reduce(comm, grads, names) for key, comm in comms.items()}
        if step < 2:  # (the second with what the first left: residuals, momenta, kept state)
            out["same"] = out.get("same", True) and all(torch.equal(x, y) for x, y in zip(got["fused"], got["alone"]))
            out["identical"] = all(all(torch.equal(x, y) for y in _gather(x)) for x in got["fused"])
            # (the residuals, or DGC's momenta and velocities: every state the memory keeps by name)
            res = {key: comm.memory.state_dict() for key, comm in comms.items()}
            # (scaled random-k goes without error feedback: nothing kept, fused or alone)
            out["residuals"] = (bool(res["fused"]) or not comms["fused"].memory.stateful) and all(
                torch.equal(state[n], res["alone"][kind][n]) for kind, state in res["fused"].items() for n in names)
            key = comms["fused"].codec.tensor_state  # (state the codec keeps by name: AdaComp's own residuals)
            mine = {k: comm.codec.state_dict().get(key, {}) for k, comm in comms.items()}
            out["codec_state"] = sorted(mine["fused"]) == sorted(mine["alone"]) and all(
                torch.equal(t.reshape(-1), mine["alone"][n].reshape(-1)) for n, t in mine["fused"].items())
            out["codec_kept"] = len(mine["fused"])
        else:  # one flag covers the group: every member poisoned, every residual kept
            out["nan"] = all(bool(torch.isnan(x).all()) for x in got["fused"])
            kept = comms["fused"].memory.state_dict()
            out["kept"] = all(torch.equal(state[n], res["fused"][kind][n]) for kind, state in kept.items() for n in names)
    out["calls"] = (calls["fused"][0], calls["alone"][0])
    for comm in comms.values():
        comm.close()
    return out


@pytest.mark.parametrize("world,in_turn,name,opts", [
    (2, True, "efsignsgd", {}), (3, True, "efsignsgd", {}), (2, False, "efsignsgd", {}),
    (2, True, "onebit", {}), (3, False, "onebit", {}), (2, False, "onebit", {"bucket_size": 512}),
    (2, False, "onebit", {"bucket_size": 100}),  # (buckets that are not whole blocks: member by member)
    (2, True, "topk", {"ratio": 0.05}), (3, True, "topk", {"ratio": 0.05}),  # (each member's own selection)
    (2, False, "topk", {"ratio": 0.05}),  # (selected at once: one sort of the group's candidates)
    # (random-k: each member's own draws; at 3 ranks gloo's all-reduce orders a value's sum by its
    # place in the buffer, so bit for bit at 2)
    (2, True, "randomk", {"ratio": 0.05}), (2, True, "randomk", {"ratio": 0.05, "scale": True}),
    (2, True, "randomk", {"ratio": 0.05, "collective": "allgather"}),
    # (the sampled thresholds drawn from the whole of each member: each member's exact quantile)
    (2, True, "graddrop", {"ratio": 0.05, "sample_ratio": 1.0}), (3, True, "graddrop", {"ratio": 0.05, "sample_ratio": 1.0}),
    (2, True, "dgc", {"ratio": 0.05, "sample_ratio": 1.0}),  # (DGC's memory: momenta and velocities by name)
    (2, False, "dgc", {"ratio": 0.05, "sample_ratio": 1.0}), (3, False, "topk", {"ratio": 0.05, "memory": "dgc"}),
    (3, True, "dgc", {"ratio": 0.02, "sample_ratio": 1.0, "memory": "residual"}),
    (2, True, "adaq", {}), (3, True, "adaq", {"bin_size": 300}),  # (each member's scale; its bins as alone)
    (2, True, "adaq", {"bin_size": 7, "memory": "residual", "memory_options": {"beta": 0.5}}),  # (the codec's own residuals)
    # (SketchML: each member's codes and quantile table as alone, from its histogram or one sort of the group)
    (2, True, "sketchml", {"memory": "residual"}), (3, False, "sketchml", {"memory": "residual"}),
    (2, False, "sketchml", {"memory": "residual", "buckets": 16}),
    (2, True, "sketchml", {"ratio": 0.05}), (3, False, "sketchml", {"ratio": 0.05, "buckets": 16}),  # (sparse: its selections too)
    (2, True, "cl_onebit", {}), (3, True, "cl_onebit", {"bucket_size": 512}),  # (CompLL: each member's bucket means)
])
def test_codecs_by_parts_send_a_group_as_one_payload_with_each_members_own_statistics(world, in_turn, name, opts):
    """EF-signSGD, 1-bit SGD and top-k: a fused group is one encode and one all-gather, each
    member's scale, bucket means or selection its own; the averages and the residuals are those
    of the members one at a time (on the CPU's way bit for bit by construction; on the
    accelerator's, block sums added per member, the same here; top-k's selections are exact),
    and a NaN in one member poisons the group and keeps every residual."""
    for res in run_workers(_by_parts_fused_and_alone, world, in_turn, name, opts):
        assert res["same"] and res["residuals"] and res["identical"] and res["codec_state"], res
        assert res["codec_kept"] == (len(SHAPES) if "beta" in opts.get("memory_options", {}) else 0)
        assert res["nan"] and res["kept"], res
        assert res["calls"] == (3, 3 * len(SHAPES)), res["calls"]


def _terngrad_by_parts(rank: int, world: int) -> Dict[str, object]:
    names = list(SHAPES)
    grads = _grads(rank, {"b.weight": 1e-3, "c.weight": 1e3})
    comm = gradzip.Communicator("terngrad", fusion=True)
    encode, count = comm.codec.encode, [0]
    comm.codec.encode = lambda *args, **kw: (count.__setitem__(0, count[0] + 1), encode(*args, **kw))[1]
    avg = _reduce(comm, grads, names)
    # every value is the mean over ranks of 0 or ±(that rank's max |x| of the member)
    scales = [torch.stack(_gather(g.abs().amax().reshape(1))).reshape(-1) for g in grads]
    ok = []
    for a, s in zip(avg, scales):
        k = (a.reshape(-1, 1) * world - torch.tensor([[0.0]])).reshape(-1)  # the sum over ranks
        combos = torch.tensor([sum(c * v for c, v in zip(combo, s.tolist()))
                               for combo in __import__("itertools").product((-1, 0, 1), repeat=world)])
        ok.append(bool((k[:, None] - combos[None, :]).abs().min(dim=1).values.le(1e-6 * (1 + s.max())).all()))
    # through the SRA, which cuts its input into chunks and carries no parts: one tensor at a time
    sra = gradzip.Communicator("terngrad", collective="sra")
    encode_sra, count_sra = sra.codec.encode, [0]
    sra.codec.encode = lambda *args, **kw: (count_sra.__setitem__(0, count_sra[0] + 1), encode_sra(*args, **kw))[1]
    by_sra = _reduce(sra, grads, names)
    sra.close()
    grads[2][0, 0, 5] = float("nan") if rank == world - 1 else grads[2][0, 0, 5]
    poisoned = _reduce(comm, grads, names)
    comm.close()
    return {"values": ok, "calls": count[0], "identical": all(all(torch.equal(x, y) for y in _gather(x)) for x in avg),
            "nan": all(bool(torch.isnan(x).all()) for x in poisoned),
            "sra": (count_sra[0] >= len(names), all(bool(torch.isfinite(x).all()) for x in by_sra))}


def test_terngrad_sends_a_group_as_one_payload_with_each_members_own_scale():
    """TernGrad's default (one scale a tensor) takes a group by its parts: one encode, each
    member's scale its own ``max |x|`` (so each average is a mean of 0 and ±those), replicas
    identical, a NaN in one member poisoning the group (the scales are the flag)."""
    for res in run_workers(_terngrad_by_parts, 2):
        assert all(res["values"]) and res["identical"] and res["nan"], res
        assert res["calls"] == 2 and res["sra"] == (True, True), res


def _natural_by_parts(rank: int, world: int) -> Dict[str, object]:
    names = list(SHAPES)
    grads = _grads(rank, {"b.weight": 1e-30, "c.weight": 1e30})  # headers far apart
    comm = gradzip.Communicator("natural")
    encode, count = comm.codec.encode, [0]
    comm.codec.encode = lambda *args, **kw: (count.__setitem__(0, count[0] + 1), encode(*args, **kw))[1]
    avg = _reduce(comm, grads, names)
    # each rank's value decodes to 0 or a power of two bracketing it: the mean is within 2x of the largest
    bound = [torch.stack(_gather(g.abs())).amax(0) * 2 for g in grads]
    grads[3][0, 7] = float("nan") if rank == world - 1 else grads[3][0, 7]
    poisoned = _reduce(comm, grads, names)
    comm.close()
    return {"calls": count[0], "within": all(bool((a.abs() <= b).all()) for a, b in zip(avg, bound)),
            "nonzero": all(bool(a.ne(0).any()) for a in avg),
            "identical": all(all(torch.equal(x, y) for y in _gather(x)) for x in avg),
            "nan": all(bool(torch.isnan(x).all()) for x in poisoned)}


def test_natural_compression_sends_a_group_as_one_payload_with_each_members_own_header():
    """Natural compression takes a group by its parts: one encode, each member under its own
    header (here 1e-30 and 1e30 apart: one header for the group would round the small member
    to zero), replicas identical, a NaN in one member poisoning the group (the headers are the
    flag)."""
    for res in run_workers(_natural_by_parts, 2):
        assert res["within"] and res["nonzero"] and res["identical"] and res["nan"], res
        assert res["calls"] == 2, res["calls"]


def _signum_fused_and_alone(rank: int, world: int) -> Dict[str, object]:
    names = list(SHAPES)
    comms = {"fused": gradzip.Communicator("signum", fusion=True), "alone": gradzip.Communicator("signum", fusion=False)}
    calls = {}
    for key, comm in comms.items():
        encode, count = comm.codec.encode, [0]
        comm.codec.encode = lambda *args, _e=encode, _c=count, **kw: (_c.__setitem__(0, _c[0] + 1), _e(*args, **kw))[1]
        calls[key] = count
    same = []
    for step in range(3):
        grads = _grads(rank + 10 * step)
        got = {key: _reduce(comm, grads, names) for key, comm in comms.items()}
        same.append(all(torch.equal(a, b) for a, b in zip(got["fused"], got["alone"])))
        if step == 1:  # a checkpoint taken and loaded mid-run (the group's buffer is made again from it)
            state = comms["fused"].codec.state_dict()
            comms["fused"].codec.load_state_dict(state)
    momenta = {key: comm.codec.state_dict()["momentum"] for key, comm in comms.items()}
    # a non-finite value in one member on the last rank: one flag covers the group there, so
    # every member keeps its momentum (alone, only that member would)
    grads = _grads(rank + 30)
    if rank == world - 1:
        grads[1][5] = float("nan")
    _reduce(comms["fused"], grads, names)
    after = comms["fused"].codec.state_dict()["momentum"]
    for comm in comms.values():
        comm.close()
    return {"same": same, "calls": (calls["fused"][0], calls["alone"][0]),
            "momenta": sorted(momenta["fused"]) == sorted(names)
            and all(torch.equal(momenta["fused"][n], momenta["alone"][n]) for n in names),
            "kept": all(torch.equal(after[n], momenta["fused"][n]) for n in names) == (rank == world - 1)}


@pytest.mark.parametrize("world", [2, 3])
def test_signum_sends_a_group_as_one_payload_with_each_members_own_momentum(world):
    """Signum by its parts: the group's momenta in one buffer, each member's a view kept under
    its name; votes and momenta are those of the members one at a time, through a checkpoint
    loaded mid-run, and a group is one encode a step; a non-finite value in one member keeps
    the group's momenta on its rank (one flag a group, as for every fused group)."""
    for res in run_workers(_signum_fused_and_alone, world):
        assert all(res["same"]) and res["momenta"] and res["kept"], res
        assert res["calls"] == (4, 3 * len(SHAPES)), res["calls"]


def _blocks_stay_within_tensors(rank: int, world: int, collective: str) -> Dict[str, float]:
    # a tiny gradient next to huge ones: a block shared with a huge neighbour would lose it
    scales = {"a.weight": 1e4, "b.weight": 1e-4, "c.weight": 1e4, "d.weight": 1e-4}
    names = list(SHAPES)
    grads = _grads(rank, scales)
    comm = gradzip.Communicator("maxmin", bits=4, bucket_size=128, collective=collective)
    avg = _reduce(comm, grads, names)
    exact = [torch.stack(_gather(g)).mean(0) for g in grads]
    comm.close()
    return {n: float((a - e).abs().max()) for n, a, e in zip(names, avg, exact)}


@pytest.mark.parametrize("collective", ["sra", "allgather", "ps"])
def test_a_block_never_mixes_two_gradients(collective):
    for err in run_workers(_blocks_stay_within_tensors, 3, collective):
        # within a tensor of scale 1e-4 the error is a few steps of 4-bit rounding of ~1e-4
        assert err["b.weight"] < 1e-4 and err["d.weight"] < 1e-4, err
        assert err["a.weight"] < 1e4 and err["c.weight"] < 1e4, err


def _order_and_memory(rank: int, world: int) -> Dict[str, object]:
    names = list(SHAPES)
    grads = _grads(rank)
    one = gradzip.Communicator("maxmin", bits=2, memory="residual")
    two = gradzip.Communicator("maxmin", bits=2, memory="residual")
    a = _reduce(one, grads, names)
    b = _reduce(two, grads[::-1], names[::-1])[::-1]  # DDP may list a bucket in another order
    first = one.step
    _reduce(one, grads, names)  # the same names again: the next step
    residuals = one.memory.state_dict()["residuals"]
    stats = one.stats(per_tensor=True)
    one.close()
    two.close()
    return {
        "same": all(torch.equal(x, y) for x, y in zip(a, b)),
        "keys": sorted(residuals),
        "shapes": all(tuple(residuals[n].shape) == SHAPES[n] for n in names),
        # residual = compensated input - what was sent; nonzero for a 2-bit codec
        "nonzero": all(float(residuals[n].abs().max()) > 0 for n in names),
        "per_tensor": sorted(stats["per_tensor"]),
        "wire": sum(row["wire_bytes"] for row in stats["per_tensor"].values()),
        "total_wire": stats["wire_bytes"],
        "steps": (first, one.step),
    }


def test_fused_layout_and_randomness_do_not_depend_on_bucket_order_and_residuals_stay_per_name():
    for res in run_workers(_order_and_memory, 2):
        assert res["same"]
        assert res["keys"] == sorted(SHAPES)
        assert res["shapes"] and res["nonzero"]
        assert res["steps"] == (0, 1)
        assert res["per_tensor"] == sorted(SHAPES)  # metrics per parameter, shares of the group
        assert res["wire"] == res["total_wire"] > 0


def test_chunks_and_partitions_start_on_block_boundaries():
    for n, w, align in [(10_000, 4, 64), (1, 4, 64), (4096, 3, 1024), (1000, 4, 1), (5 * 1024, 4, 1024)]:
        chunk = chunk_length(n, w, align)
        assert chunk % align == 0 and chunk * w >= n
        pieces = _chunks(torch.arange(n), w, align)
        assert sum(p.numel() for p in pieces) == n
        assert all(int(p[0]) % align == 0 for p in pieces if p.numel())
        bounds = partition_bounds(n, w, align)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a % align == 0 and a <= b for a, b in bounds)
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:]))
    assert chunk_length(1000, 4) == 250  # without alignment, as before


def test_codecs_that_are_per_tensor_say_so():
    assert gradzip.codec("maxmin", bucket_size=512).fusion_block() == 512
    assert gradzip.codec("fp16").fusion_block() == 1
    assert gradzip.codec("terngrad").fusion_block() == 0  # one scale per tensor (fused by its parts)
    assert gradzip.codec("terngrad").parts_format and not gradzip.codec("terngrad", bucket_size=64).parts_format
    assert gradzip.codec("signsgd").fusion_block() == 8  # a bit a value, a vote a value
    assert gradzip.codec("tbq").fusion_block() == 4  # a code a value, τ shared: whole bytes of codes
    for name in ("topk", "powersgd", "natural", "signum", "efsignsgd", "onebit"):  # (all but top-k and Signum: by parts)
        assert gradzip.codec(name).fusion_block() == 0
    # PowerSGD factorises each tensor by its shape, but encodes a fused buffer given its parts
    assert gradzip.codec("powersgd").fused_alignment() == 1 and gradzip.codec("powersgd").parts_format
    assert gradzip.codec("maxmin", bucket_size=512).fused_alignment() == 512
    assert gradzip.codec("threshold").fusion_block() == 1 and not gradzip.codec("threshold").parts_format
    assert gradzip.codec("inceptionn").fusion_block() == 4  # whole bytes of 2-bit tags
    for name in ("dgc", "graddrop"):  # a sampled threshold (DGC: and a cap) a member, by blocks of members
        assert gradzip.codec(name).fused_alignment() == 256 and gradzip.codec(name).parts_format
    assert gradzip.codec("adaq", bin_size=7).fused_alignment() == 7 and gradzip.codec("adaq").parts_format  # on bins
    # a quantile table a member, its codes on whole bytes; sparse: a selection a tensor
    assert gradzip.codec("sketchml").parts_format and gradzip.codec("sketchml").fused_alignment() == 1
    assert gradzip.codec("sketchml", buckets=16).fused_alignment() == 8
    # (sparse: a selection, a table and gaps a member, the codes back to back)
    assert gradzip.codec("sketchml", ratio=0.1).parts_format and gradzip.codec("sketchml", ratio=0.1).fused_alignment() == 1
    # CompLL codecs fuse where their bodies say their blocks are encoded apart
    assert gradzip.codec("cl_tbq").fusion_block() == 4 and gradzip.codec("cl_terngrad", bucket_size=64).fusion_block() == 64
    # (and by their parts where their bodies reduce through ``ctx``: a scale or means a member)
    assert all(gradzip.codec(n).parts_format and gradzip.codec(n).fused_alignment() == 256
               for n in ("cl_terngrad", "cl_onebit"))
    assert not gradzip.codec("cl_onebit", bucket_size=100).fused_alignment()
    assert gradzip.codec("randomk").parts_format and gradzip.codec("randomk").fused_alignment() == 1
    assert gradzip.codec("topk").parts_format and gradzip.codec("topk").fused_alignment() == 1
    assert gradzip.codec("signum").parts_format and gradzip.codec("signum").fused_alignment() == 8
    for name in ("efsignsgd", "onebit", "terngrad", "natural"):  # a scale or means a member, by blocks of members
        assert gradzip.codec(name).fused_alignment() == 256 and gradzip.codec(name).parts_format


def _params(sizes):
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_plan_groups_in_reverse_order_up_to_the_group_size():
    # 4-byte values, groups of 16 KiB = 4096 values; every size a whole number of 1024-blocks
    plan = FusionPlan.build(_params([1024, 2048, 2048, 1024, 4096]), lambda p: True, 1024, 16 * 1024)
    assert plan.groups == [["p4"], ["p3", "p2"], ["p1", "p0"]]
    assert plan.group_of == {"p4": 0, "p3": 1, "p2": 1, "p1": 2, "p0": 2}


def test_plan_keeps_gradients_alone_where_padding_to_blocks_would_cost_too_much():
    # 256 values padded to 1024 would quadruple; 9000 -> 9216 adds 2.4% (kept); 1100 -> 2048 adds 86%
    plan = FusionPlan.build(_params([4096, 256, 9000, 1100, 8192, 8192]), lambda p: True, 1024, 1 << 30)
    # p2 could join a group, but its neighbours must stay alone
    assert plan.groups == [["p5", "p4"], ["p3"], ["p2"], ["p1"], ["p0"]]
    assert padding(9000, 1024) == 216 and padding(8192, 1024) == 0


def test_plan_without_a_block_or_filtered_parameters():
    params = _params([4096, 4096, 4096])
    assert FusionPlan.build(params, lambda p: True, 0, 1 << 30).groups == [["p2"], ["p1"], ["p0"]]
    frozen = params[1][1].requires_grad_(False)
    assert FusionPlan.build(params, lambda p: p is not params[2][1], 1, 1 << 30).groups == [["p0"]]
    frozen.requires_grad_(True)


def test_collector_holds_plain_gradients_up_to_its_bound_and_for_one_step_only():
    plan = FusionPlan([["w1", "w0"]])
    vec = [torch.zeros(16), torch.zeros(8)]  # 64 + 32 bytes
    collector = GroupCollector(plan, hold_bytes=128)
    first = collector.hold(["b1", "g1"], vec, step=3)
    assert first is not None and not first.done()
    assert collector.hold(["b0"], [torch.zeros(9)], step=3) is None  # 96 + 36 > 128: sum them now
    second = collector.hold(["b0"], [torch.zeros(8)], step=3)  # 96 + 32 = 128 fits
    assert second is not None
    names, grads, futures = collector.take_held(3)
    assert names == ["b1", "g1", "b0"] and [g.numel() for g in grads] == [16, 8, 8]
    assert futures == [first, second]
    assert collector.take_held(3) == ([], [], [])  # taken: forgotten
    # a backward pass that did not end leaves gradients of its own step: never summed in another
    collector.hold(["b1"], [torch.zeros(4)], step=4)
    assert collector.take_held(5) == ([], [], [])
    collector.hold(["b1"], [torch.zeros(4)], step=6)
    later = collector.hold(["b0"], [torch.zeros(4)], step=7)
    assert later is not None and collector.take_held(7)[0] == ["b0"]
    assert GroupCollector(plan).hold(["b"], [torch.zeros(1)], step=0) is None  # bound 0: never held


def _group_sizes(rank: int, world: int) -> Dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, kwargs in (("default", {}), ("given", {"fusion_mb": 2.0})):
        ddp = DDP(torch.nn.Linear(64, 64))
        state = gradzip.register(ddp, "maxmin", bits=4, **kwargs)
        out[f"{name} cpu"] = state.group_mb()
        state.device = torch.device("meta")  # where the gradients would lie on an accelerator
        out[f"{name} accelerator"] = state.group_mb()
        out[f"{name} reported"] = state.plan()["group_mb"]  # the size in use, not only as configured
        state.close()
    return out


def test_groups_are_larger_on_an_accelerator_unless_the_size_is_given():
    from gradzip.config import Config
    from gradzip.frontends.ddp import ACCELERATOR_FUSION_MB

    sizes = run_workers(_group_sizes, 1)[0]
    assert sizes["default cpu"] == Config().fusion_mb < ACCELERATOR_FUSION_MB == sizes["default accelerator"]
    assert sizes["given cpu"] == sizes["given accelerator"] == 2.0
    assert sizes["default reported"] == ACCELERATOR_FUSION_MB and sizes["given reported"] == 2.0


def _batched_in_place(rank: int, world: int) -> Dict[str, Dict[str, float]]:
    """PowerSGD's tensors in one batch, averaged in their own memory (as DDP's bucket views
    are), with and without error feedback: what each put on the wire."""
    from gradzip.sync.pipeline import drive

    out = {}
    for memory in ("none", "residual"):
        comm = gradzip.Communicator("powersgd", rank=2, memory=memory)
        g = torch.Generator().manual_seed(rank)
        tensors = [torch.randn(256, 256, generator=g), torch.randn(128, 64, 3, 3, generator=g)]
        drive(comm.reduce_many_stages(tensors, ["a", "b"], [True, True], inplace=True, groups=[[0], [1]]))
        per = comm.metrics.summary(per_tensor=True)["per_tensor"]
        out[memory] = {name: per[name]["ratio"] for name in ("a", "b")}
        out[memory]["identical"] = all(all(torch.equal(x, y) for y in _gather(x)) for x in tensors)
        comm.close()
    return out


def test_a_batch_averaged_in_place_is_factorised_without_error_feedback_too():
    # divided by the world size in place, the inputs once reached the codec flat: sent as they were
    for res in run_workers(_batched_in_place, 2):
        for memory, rec in res.items():
            assert rec["a"] == 64.0 and rec["b"] > 50, (memory, rec)
            assert rec["identical"]


def _own_of_a_raw_payload(rank: int, world: int) -> Dict[str, float]:
    """Error feedback where the payload is the input itself (``none``; PowerSGD's tensors too
    small to factorise) and the average goes into the input's own memory, where the input
    divided by the world size waits: the residual stays what was lost, nothing."""
    out = {}
    for codec, shape, opts in (("none", (64,), {}), ("powersgd", (2, 64), {"rank": 2})):
        comm = gradzip.Communicator(codec, memory="residual", **opts)
        for step in range(3):
            t = torch.randn(*shape, generator=torch.Generator().manual_seed(100 * step + rank))
            expected = sum(_gather(t)) / world
            comm.reduce_now(t, "w", out=t, step=step)
            out[f"{codec} average"] = max(out.get(f"{codec} average", 0.0), float((t - expected).abs().max()))
        out[f"{codec} residual"] = float(comm.memory.residuals["w"].abs().max())
        comm.close()
    return out


def test_a_payload_that_is_its_input_keeps_this_ranks_own_for_error_feedback():
    # its own payload was once decoded after the average had overwritten it: residual x - W·avg
    for res in run_workers(_own_of_a_raw_payload, 2):
        assert all(v < 1e-6 for v in res.values()), res


def _batched_flag(rank: int, world: int) -> Dict[str, object]:
    """PowerSGD's matrices in one batch, flagged by one pass over their packed factors: a NaN or
    ±inf on one rank, even where the warm-start Q has a zero row (a column that was zero the
    step before), reaches every rank and every tensor of the batch; the memory is spared."""
    names = list(SHAPES)
    grads = _grads(rank)
    grads[0][:, 4] = 0.0  # Q's row 4 of a.weight becomes zero at the first step
    out: Dict[str, object] = {}
    for value in (float("nan"), float("inf"), float("-inf")):
        comm = gradzip.Communicator("powersgd", rank=2, memory="residual")
        first = _reduce(comm, grads, names)
        zero_row = bool((comm.codec_for("a.weight")._q["a.weight"][4] == 0).all())
        before = {n: comm.memory.residuals[n].clone() for n in names}
        bad = [g.clone() for g in grads]
        if rank == 1:
            bad[0][7, 4] = value
        second = _reduce(comm, bad, names)
        kept = all(torch.equal(before[n], comm.memory.residuals[n]) for n in names)
        third = _reduce(comm, grads, names)
        out[str(value)] = {
            "zero_row": zero_row,
            "first_finite": all(bool(torch.isfinite(t).all()) for t in first),
            "second_all_nan": all(bool(torch.isnan(t).all()) for t in second),
            "memory_kept": kept,
            "third_finite": all(bool(torch.isfinite(t).all()) for t in third),
            "identical": all(all(torch.equal(x, y) for y in _gather(x)) for x in third),
        }
        comm.close()
    return out


def test_a_batch_of_powersgd_matrices_is_flagged_from_its_factors():
    for res in run_workers(_batched_flag, 2):
        for value, rec in res.items():
            assert all(rec.values()), (value, rec)


def _padded_chunks(rank: int, world: int) -> dict:
    from gradzip.comm import sra

    names = list(SHAPES)
    grads = _grads(rank)
    padded = []  # the chunks the SRA copied to pad them, by length
    scatter = sra.ScatterReduceAllGather._scatter

    def spy(self, call, x, start, name):
        chunk = sra.chunk_length(x.numel(), call.world_size, call.align)
        padded.extend(chunk for j in range(call.world_size) if x[j * chunk : (j + 1) * chunk].numel() != chunk)
        return scatter(self, call, x, start, name)

    sra.ScatterReduceAllGather._scatter = spy
    try:
        out = {}
        for segment in (None, 3000):  # one segment; several
            comm = gradzip.Communicator("maxmin", bits=4, bucket_size=64, mode="nearest", collective="sra",
                                        collective_options={"segment": segment})
            padded.clear()
            fused = _reduce(comm, grads, names)
            coll = comm.collective_for(names[0])
            total = sum(g.numel() + padding(g.numel(), 64) for g in grads)
            out[segment] = {
                "fused": fused, "padded": list(padded), "length": coll.fused_length(total, 64, torch.device("cpu")),
                "total": total,
            }
            comm.close()
        alone = gradzip.Communicator("maxmin", bits=4, bucket_size=64, collective="sra", fusion=False)
        padded.clear()
        out["alone"] = {"avgs": _reduce(alone, grads, names), "padded": list(padded)}
        alone.close()
        return out
    finally:
        sra.ScatterReduceAllGather._scatter = scatter


def test_a_fused_group_through_the_sra_ends_in_zeros_so_no_chunk_is_copied_to_be_padded():
    """At three ranks, where W does not divide a segment, the SRA would copy its last chunk to
    pad it with zeros: segments are cut as W whole chunks, and a fused group is made a whole
    number of them long (the zeros after its last gradient), in one segment or in several, with
    the same averages either way; a gradient exchanged where it lies is still padded by a copy."""
    for res in run_workers(_padded_chunks, 3):
        for case in (res[None], res[3000]):
            assert case["length"] % (3 * 64) == 0 and 0 < case["length"] - case["total"] < 3 * 64
            assert case["padded"] == []
        assert res["alone"]["padded"]
        for a, b in zip(res[None]["fused"], res[3000]["fused"]):
            assert torch.equal(a, b)  # rounding to nearest: each block's bytes whatever the cut


def _layout_at_a_class_boundary(rank: int, world: int) -> dict:
    names = [f"l{i}.weight" for i in range(4)]
    grads = [torch.randn(128, 128, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(4)]
    comm = gradzip.Communicator("maxmin", bits=4, bucket_size=64, collective="sra")
    _reduce(comm, grads, names)
    totals = [layout.total for layout in comm._fused_layouts.values()]
    comm.close()
    return {"totals": totals}


def test_a_group_whose_whole_chunks_would_take_a_larger_buffer_keeps_its_length():
    """2^16 values at three ranks would grow by 64 to whole chunks, and so take a buffer of the
    pools' next size class (19% larger) for as long as the pools hold it: the group keeps its
    length and the SRA pads its last chunk by a copy instead."""
    for res in run_workers(_layout_at_a_class_boundary, 3):
        assert res["totals"] == [4 * 128 * 128]


def test_codecs_fused_later_record_fusion_only_when_off():
    """Checkpoints saved before signSGD, TBQ and the codecs taken by their parts were fused hold
    no ``fusion`` setting: those record it only when it is off (ranks that disagree are still
    told apart), while max-min records it either way, as it always did."""
    for name, fusion, recorded in [("signsgd", True, None), ("tbq", True, None), ("efsignsgd", True, None),
                                   ("signsgd", False, False), ("efsignsgd", False, False),
                                   ("maxmin", True, True), ("maxmin", False, False)]:
        comm = gradzip.Communicator(name, fusion=fusion)
        assert comm.settings().get("fusion") == recorded, (name, fusion)
        comm.close()


def test_a_checkpoint_saved_before_its_codec_was_fused_loads_with_fusion_off():
    """A checkpoint of a codec fused later holds no ``fusion`` (then it never fused): it loads
    strictly with ``fusion=False`` as with the default; max-min, which always recorded it, still
    tells a missing setting apart, and any other setting still differs."""
    from gradzip.comm import consistency

    def older(comm):  # as saved before: no ``fusion`` in its settings
        state = comm.state_dict()
        state["settings"].pop("fusion", None)
        state["fingerprint"] = consistency.fingerprint(state["settings"])
        return state

    for name in ("sketchml", "dgc", "cl_onebit"):
        saved = gradzip.Communicator(name, fusion=False)
        state = older(saved)
        saved.close()
        for fusion in (False, True):
            comm = gradzip.Communicator(name, fusion=fusion)
            comm.load_state_dict(state)  # strict: no error
            comm.close()
    other = gradzip.Communicator("sketchml", fusion=False, buckets=16)
    with pytest.raises(gradzip.errors.CheckpointError, match="buckets"):
        other.load_state_dict(older(gradzip.Communicator("sketchml", fusion=False)))
    other.close()
    maxmin = gradzip.Communicator("maxmin", fusion=False)
    with pytest.raises(gradzip.errors.CheckpointError, match="fusion"):
        maxmin.load_state_dict(older(gradzip.Communicator("maxmin", fusion=False)))
    maxmin.close()


def test_closing_a_communicator_lets_its_layout_plans_go(monkeypatch):
    """The plans made once per fused layout (its members' units, samples, draws and stacks, on
    the group's device) are let go when the last communicator closes, so their memory does not
    outlive it; while one still runs, another closing leaves them."""
    from gradzip.codecs import base, lowrank, sparse
    from gradzip.codecs.base import part_units
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: True)  # (top-k's plan: the accelerator's way)
    monkeypatch.setattr(base, "_LAYOUT_USERS", [0])  # (this test's communicators alone, whatever others left open)
    grads, names = _grads(0), list(SHAPES)
    for name, plan in (("terngrad", part_units), ("topk", sparse._topk_plan), ("powersgd", lowrank._slots)):
        comm = gradzip.Communicator(name, fusion=True)
        _reduce(comm, grads, names)
        assert plan.cache_info().currsize > 0, name
        comm.close()
        assert plan.cache_info().currsize == 0, name
    used = gradzip.Communicator("terngrad", fusion=True)
    _reduce(used, grads, names)
    made = part_units.cache_info().currsize
    gradzip.Communicator("maxmin").close()  # (another closing: the running one's plans stay)
    assert part_units.cache_info().currsize == made > 0
    used.close()
    used.close()  # (closing twice counts once)
    assert part_units.cache_info().currsize == 0


def _plain_in_groups(rank: int, world: int) -> dict:
    from gradzip.comm.stages import drive

    comm = gradzip.Communicator("topk", ratio=0.1, memory="none")
    encode, count = comm.codec.encode, [0]
    comm.codec.encode = lambda *args, **kw: (count.__setitem__(0, count[0] + 1), encode(*args, **kw))[1]
    buf = torch.randn(4 * 4096, generator=torch.Generator().manual_seed(rank))
    want = torch.stack(_gather(buf.clone())).sum(0) / world  # the plain sum, as DDP makes it
    parts = [buf[i * 4096 : (i + 1) * 4096] for i in range(4)]
    # every tensor plain, each also named in a group (as the planner's calibration names them)
    drive(comm.reduce_many_stages(parts, list("abcd"), [False] * 4, inplace=True, groups=[[i] for i in range(4)]))
    out = {"encodes": count[0], "plain": torch.equal(buf, want)}
    comm.close()
    return out


def test_a_plain_tensor_named_in_a_group_is_summed_plain_alone():
    """``groups`` names the tensors that share one encoding, and only compressed ones go in it:
    a plain tensor named there was also exchanged compressed, in the same memory while its
    plain sum was on the wire (the planner's calibration did so: its plain line held
    compressed work, and top-k read a buffer gloo was writing)."""
    for res in run_workers(_plain_in_groups, 2):
        assert res == {"encodes": 0, "plain": True}, res
