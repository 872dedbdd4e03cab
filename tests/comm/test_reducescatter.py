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
