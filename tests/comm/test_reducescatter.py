"""The engine's compressed reduce-scatter, on real gloo ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradzip

from ..dist_utils import run_workers

WORLD = 3


def _inputs(rank: int, chunk: int, step: int = 0) -> torch.Tensor:
    return torch.randn(WORLD * chunk, generator=torch.Generator().manual_seed(100 * step + rank))


def _exact(chunk: int, step: int = 0) -> torch.Tensor:
    return torch.stack([_inputs(r, chunk, step) for r in range(WORLD)]).mean(0)


def _scatter(rank: int, world: int, codec: str, chunk: int, opts: dict) -> dict:
    comm = gradzip.Communicator(codec, **opts)
    out = torch.empty(chunk)
    comm.reduce_scatter(_inputs(rank, chunk), out, "unit")
    stats = comm.stats()
    shards = [torch.empty(chunk) for _ in range(world)]
    dist.all_gather(shards, out)
    comm.close()
    return {"out": out, "whole": torch.cat(shards), "wire": stats["wire_bytes"]}


def test_a_lossless_codec_gives_the_exact_average_of_this_ranks_chunk():
    chunk = 1000
    results = run_workers(_scatter, WORLD, "none", chunk, {})
    exact = _exact(chunk)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["out"], exact[rank * chunk : (rank + 1) * chunk])


def test_four_bit_max_min_is_close_and_every_rank_owns_its_chunk():
    chunk = 4096
    results = run_workers(_scatter, WORLD, "maxmin", chunk, {"bits": 4})
    exact = _exact(chunk)
    whole = results[0]["whole"]
    assert all(torch.equal(r["whole"], whole) for r in results)
    err = (whole - exact).abs().max()
    spread = exact.max() - exact.min()
    assert 0 < err < spread / 15 * 2, float(err)  # about one 4-bit step of the inputs' range
    raw = WORLD * chunk * 4
    assert results[0]["wire"] < raw / 6  # one encoding of the rank's input: 4 bits + bucket statistics


def _error_feedback(rank: int, world: int, steps: int) -> torch.Tensor:
    comm = gradzip.Communicator("maxmin", bits=2, memory="residual")
    chunk = 512
    total = torch.zeros(chunk)
    out = torch.empty(chunk)
    for step in range(steps):
        comm.reduce_scatter(_inputs(rank, chunk, step % 2), out, "unit")
        total += out
    comm.close()
    return total


def test_error_feedback_carries_what_a_step_lost_into_the_next():
    steps, chunk = 20, 512
    exact = sum(_exact(chunk, s % 2) for s in range(steps))
    with_ef = run_workers(_error_feedback, WORLD, steps)
    for rank, total in enumerate(with_ef):
        mine = exact[rank * chunk : (rank + 1) * chunk]
        # the accumulated error stays about one step's worth instead of growing with the steps
        assert (total - mine).abs().max() < 2 * (mine.abs().max() / steps + 1), rank


def _bad(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("maxmin", bits=4, memory="residual")
    x = _inputs(rank, 64)
    if rank == 1:
        x[3] = float("nan")
    out = torch.empty(64)
    comm.reduce_scatter(x, out, "unit")
    errors = {}
    try:
        comm.reduce_scatter(torch.zeros(10), torch.empty(4), "odd")
    except ValueError as exc:
        errors["size"] = str(exc)
    residual = comm.memory.state_dict()["residuals"]["unit"]
    comm.close()
    return {"nan": bool(out.isnan().all()), "errors": errors, "residual_finite": bool(residual.isfinite().all()),
            "residual_zero": bool((residual == 0).all())}


def test_a_non_finite_input_anywhere_gives_nan_everywhere_and_keeps_the_residual():
    for res in run_workers(_bad, WORLD):
        assert res["nan"] and res["residual_finite"] and res["residual_zero"], res
        assert "needs 3 x 4" in res["errors"]["size"]


@pytest.mark.parametrize("codec,opts", [
    ("fp16", {}), ("bf16", {}), ("qsgd", {"bits": 4}), ("topk", {"ratio": 0.1}), ("signsgd", {}), ("randomk", {"ratio": 0.1}),
])
def test_every_codec_that_can_shard_gives_every_rank_its_chunk(codec, opts):
    chunk = 2048
    results = run_workers(_scatter, WORLD, codec, chunk, opts)
    exact = _exact(chunk)
    whole = results[0]["whole"]
    assert whole.isfinite().all() and all(torch.equal(r["whole"], whole) for r in results)
    if codec in ("fp16", "bf16"):
        torch.testing.assert_close(whole, exact, atol=0.02, rtol=0.02)
    else:  # lossy, but it points the same way as the exact average
        assert torch.dot(whole, exact) > 0


# ------------------------------------------------------------- on two nodes of two ranks (qgZ)
def _hier_inputs(rank: int, chunk: int, step: int) -> torch.Tensor:
    return torch.randn(4 * chunk, generator=torch.Generator().manual_seed(100 * step + rank))


def _hier(rank: int, world: int, chunk: int, steps: int, nan_at: int, intra: str) -> dict:
    from gradzip.comm.hierarchy import HierarchicalReduceScatter

    comm = gradzip.Communicator("maxmin", bits=4, memory="residual")
    rs = comm._make_reduce_scatter()
    if intra != "shared":  # gloo's all-reduce in place of the node's shared memory
        rs.shared = None
    comm._reduce_scatter = rs
    outs, residuals, inputs = [], [], []
    for step in range(steps):
        x = _hier_inputs(rank, chunk, step)
        if step == nan_at and rank == 2:
            x[7] = float("nan")
        before = comm.memory.residuals.get("unit")
        inputs.append(x + (before.reshape(-1) if before is not None else 0))  # what the exchange compressed
        out = torch.empty(chunk)
        comm.reduce_scatter(x, out, "unit")
        outs.append(out)
        residuals.append(comm.memory.residuals["unit"].reshape(-1).clone())
    res = {
        "hier": isinstance(rs, HierarchicalReduceScatter), "outs": outs, "residuals": residuals, "inputs": inputs,
        "topology": comm.describe_topology(reduce_scatter=True), "local": int(__import__("os").environ["LOCAL_RANK"]),
    }
    comm.close()
    return res


@pytest.mark.parametrize("intra", ["shared", "all-reduce"])
def test_on_two_nodes_the_reduce_scatter_is_plain_inside_the_node_and_compressed_across(intra):

    chunk, steps, nan_at = 3000, 3, 1
    res = run_workers(_hier, 4, chunk, steps, nan_at, intra, ranks_per_node=2)
    assert all(r["hier"] for r in res)
    topo = res[0]["topology"]
    assert topo["topology"] == "2 nodes x 2 ranks"
    assert [(s["stage"], s["link"]) for s in topo["stages"]] == [
        ("reduce-scatter", "intra-node"), ("reduce-scatter", "inter-node"),
    ]
    for step in range(steps):
        if step == nan_at:  # a NaN on one rank: every rank's shard all NaN, no residual changed
            assert all(torch.isnan(r["outs"][step]).all() for r in res)
            assert all(torch.equal(r["residuals"][step], r["residuals"][step - 1]) for r in res)
            continue
        exact = torch.stack([_hier_inputs(r, chunk, step) for r in range(4)]).mean(0)
        sent = torch.stack([r["inputs"][step] - r["residuals"][step] for r in res]).mean(0)
        for rank, r in enumerate(res):
            mine = slice(rank * chunk, (rank + 1) * chunk)
            # this rank's chunk of the average: near the exact one, and exactly what the ranks'
            # inputs less their residuals average to (error feedback loses nothing)
            spread = float(exact.max() - exact.min())
            assert 0 < (r["outs"][step] - exact[mine]).abs().max() < 3 * spread / 15
            torch.testing.assert_close(r["outs"][step], sent[mine], rtol=0, atol=1e-5)
            # the residual lives only at the chunks of this rank's share (its peers' across nodes)
            share = {r["local"], r["local"] + 2}  # ranks with this local rank on nodes 0 and 1
            for j in range(4):
                part = r["residuals"][step][j * chunk : (j + 1) * chunk]
                assert (torch.count_nonzero(part) > 0) == (j in share), (rank, j)


def _in_place(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("maxmin", bits=2, mode="nearest", memory="residual")
    chunk, same, grew = 700, [], []
    for step in range(3):
        outs = []
        for name, in_place in (("copy", False), ("here", True)):
            x = _inputs(rank, chunk, step)
            before = x.clone()
            owed = comm.memory.residuals.get(name)
            owed = None if owed is None else owed.clone()  # updated in place by the call
            out = torch.empty(chunk)
            comm.reduce_scatter(x, out, name, in_place=in_place)
            outs.append(out)
            expect = before + owed.reshape(-1) if in_place and owed is not None else before
            grew.append(torch.equal(x, expect))  # in place: the input now holds input + residual
        same.append(torch.equal(outs[0], outs[1]))
    comm.close()
    return {"same": same, "grew": grew}


def test_in_place_adds_the_residual_to_the_callers_input_and_changes_nothing_else():
    for res in run_workers(_in_place, WORLD):
        assert all(res["same"]) and all(res["grew"])
