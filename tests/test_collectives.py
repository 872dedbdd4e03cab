"""Collectives on real gloo ranks: averages, identical replicas, flags, variable sizes."""
from __future__ import annotations

import math
from typing import List

import pytest
import torch
import torch.distributed as dist

import gradzip
from gradzip import collectives
from gradzip.codecs.base import Codec, Meta, Option, float_in

from .dist_utils import run_workers


def _gather(t: torch.Tensor, world: int) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _pairs():
    return [(name, coll) for name in gradzip.codecs.names() for coll in gradzip.codec(name).collectives]


def _run_all_pairs(rank: int, world: int) -> dict:
    """Every (codec, collective) pair on the same inputs; returns what the parent asserts on."""
    out = {}
    for name, coll in _pairs():
        codec = gradzip.codec(name)
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(37, 29, generator=g) * (1 + rank)  # odd size, different on every rank
        res = collectives.get(coll)(None).run(codec, x, "w", 0, need_own=True)
        avgs = _gather(res.avg, world)
        owns = torch.stack(_gather(res.own, world))
        out[(name, coll)] = {
            "identical": all(torch.equal(avgs[0], a) for a in avgs),
            "avg": res.avg,
            "owns": owns,
            "nonfinite": bool(res.nonfinite),
            "wire": res.wire_bytes,
        }
    return out


def _reference(name: str, owns: torch.Tensor) -> torch.Tensor:
    if name == "signsgd":  # majority vote
        return owns.sum(0).sign()
    return owns.mean(0)


def _tolerance(name: str, coll: str, owns: torch.Tensor, world: int, ref: torch.Tensor) -> float:
    scale = owns.abs().max().item()
    if coll == "sra":  # the averaged chunk is quantised a second time
        if name == "maxmin":
            return (ref.max() - ref.min()).item() / (2**4 - 1) + 1e-6
        if name == "qsgd":
            return torch.linalg.vector_norm(ref).item() / (2**3 - 1) + 1e-6
    eps = {"fp16": 2**-10, "bf16": 2**-7}.get(name, 1e-6)
    return 2 * world * eps * scale + 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_averages_decoded_payloads(world):
    results = run_workers(_run_all_pairs, world)
    for key, rec in results[0].items():
        name, coll = key
        assert all(r[key]["identical"] for r in results), f"{key}: ranks disagree"
        assert all(torch.equal(r[key]["avg"], rec["avg"]) for r in results), f"{key}: ranks disagree"
        ref = _reference(name, rec["owns"])
        tol = _tolerance(name, coll, rec["owns"], world, ref)
        err = (rec["avg"] - ref).abs().max().item()
        assert err <= tol, f"{key}: |avg - mean(decoded)| = {err} > {tol}"
        assert not rec["nonfinite"]
        codec = gradzip.codec(name)
        if coll != "sra":
            assert rec["wire"] == codec.wire_bytes(37 * 29, torch.float32, shape=(37, 29)), key


def _nonfinite(rank: int, world: int) -> dict:
    out = {}
    for name, coll in [("none", "allreduce"), ("randomk", "allreduce"), ("topk", "allgather"), ("signsgd", "allgather"), ("maxmin", "sra")]:
        comm = gradzip.Communicator(name, collective=coll, memory="residual")
        x = torch.randn(64, 40, generator=torch.Generator().manual_seed(rank))
        first = comm.allreduce(x, name="w")
        before = comm.memory.residuals["w"].clone()
        bad = x.clone()
        if rank == 1:
            bad[3, 5] = float("nan")
        second = comm.allreduce(bad, name="w")
        after = comm.memory.residuals["w"]
        third = comm.allreduce(x, name="w")
        out[name] = {
            "first_finite": bool(torch.isfinite(first).all()),
            "second_all_nan": bool(torch.isnan(second).all()),
            "memory_kept": torch.equal(before, after),
            "third_finite": bool(torch.isfinite(third).all()),
        }
        comm.close()
    return out


def test_nonfinite_input_on_one_rank_reaches_every_rank_and_spares_memory():
    for rank, res in enumerate(run_workers(_nonfinite, 3)):
        for name, rec in res.items():
            assert rec == {"first_finite": True, "second_all_nan": True, "memory_kept": True, "third_finite": True}, (rank, name, rec)


class _NonZeros(Codec):
    """Test codec (not registered) with a data-dependent size: values above a threshold + indices."""

    name = "_test_nonzeros"
    collectives = ("allgather",)
    fixed_size = False
    options = {"threshold": Option(0.5, float_in(0.0, 100.0), "a float")}

    def _encode(self, x, meta: Meta):
        idx = (x.abs() > self.threshold).nonzero().reshape(-1)
        return [x[idx], idx.to(torch.int32)]

    def _decode(self, tensors, meta: Meta):
        values, idx = tensors
        return torch.zeros(meta.numel, dtype=values.dtype).index_copy_(0, idx.long(), values)

    def _wire_bytes(self, numel, dtype):
        return numel * 8  # an upper bound


def _variable(rank: int, world: int) -> dict:
    codec = _NonZeros(threshold=0.5)
    x = torch.zeros(1000)
    x[: 10 * (rank + 1)] = torch.arange(1, 10 * (rank + 1) + 1, dtype=torch.float32)  # sizes differ per rank
    res = collectives.get("allgather")(None).run(codec, x, "v", 0, need_own=True)
    return {"avg": res.avg, "x": x, "wire": res.wire_bytes}


def test_allgather_handles_payloads_of_different_sizes():
    results = run_workers(_variable, 3)
    expected = torch.stack([r["x"] for r in results]).mean(0)
    for r in results:
        assert torch.equal(r["avg"], expected)
    assert [r["wire"] for r in results] == [10 * (k + 1) * 8 for k in range(3)]


def _ordered_async(rank: int, world: int) -> bool:
    """Many calls in flight at once, of different sizes and codecs' collectives: all correct."""
    comms = [gradzip.Communicator("none"), gradzip.Communicator("topk", ratio=1.0, memory="none")]
    futures, expected = [], []
    for i in range(30):
        n = 1 + (i * 37) % 500
        t = torch.full((n,), float(rank + i))
        comm = comms[i % 2]
        futures.append(comm.allreduce_async(t, name=f"t{i}"))
        expected.append(sum(r + i for r in range(world)) / world)
    ok = all(torch.allclose(f.wait(), torch.full_like(f.wait(), e)) for f, e in zip(futures, expected))
    for c in comms:
        c.close()
    return ok


def test_async_calls_in_flight_complete_correctly():
    assert all(run_workers(_ordered_async, 4))


def test_impossible_combinations_are_rejected_at_construction():
    with pytest.raises(ValueError, match="allgather"):
        gradzip.Communicator("topk", collective="allreduce")
    with pytest.raises(ValueError, match="valid collectives: allgather, allreduce, sra"):
        gradzip.Communicator("maxmin", collective="bogus")
    with pytest.raises(ValueError, match="sra, allgather"):
        gradzip.Communicator("maxmin", collective="allreduce")
    with pytest.raises(ValueError, match="valid memories"):
        gradzip.Communicator("maxmin", memory="bogus")
    with pytest.raises(ValueError, match="valid codecs"):
        gradzip.Communicator("bogus")
    with pytest.raises(ValueError, match="bits"):
        gradzip.Communicator("maxmin", bits=9)


def test_single_process_communicator_round_trips():
    comm = gradzip.Communicator("maxmin", bits=8, memory="none")
    x = torch.randn(300, 7)
    y = comm.allreduce(x, name="w")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().max() <= (x.max() - x.min()) / 255 * 2 + 1e-6
    assert math.isclose(comm.stats()["ratio"], 4 * x.numel() / comm.codec.wire_bytes(x.numel()) / 2, rel_tol=1e-9)
    comm.close()
