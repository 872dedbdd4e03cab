"""The Communicator's plain path: uncompressed gradients summed as DDP sums them."""
from __future__ import annotations

import torch

import gradzip

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
