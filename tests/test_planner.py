"""The planner: its cost model and decisions, and ``plan="auto"`` under DDP on real gloo ranks."""
from __future__ import annotations

import math
from typing import Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip import planner
from gradzip.config import Config

from .dist_utils import run_workers

MAXMIN4 = gradzip.codec("maxmin", bits=4)
# 4 ranks, 1 Gbit/s (β = 8 ns per byte), 50 µs of latency, a codec near 1 ns per value
GIGABIT = planner.Costs(alpha=5e-5, beta=8e-9, encode=1.5e-9, decode=1e-9, copy=3e-10, world_size=4)


def _params(**sizes: int) -> Dict[str, torch.Tensor]:
    return {name: torch.zeros(n) for name, n in sizes.items()}


def test_fit_recovers_a_line_and_stays_non_negative():
    alpha, beta = planner.fit([(b, 2e-4 + 8e-9 * b) for b in planner.SIZES])
    assert alpha == pytest.approx(2e-4) and beta == pytest.approx(8e-9)
    # times that fall with size (noise) give no negative cost per byte
    assert planner.fit([(1e3, 3e-3), (1e6, 2e-3), (1e7, 1e-3)])[1] == 0.0


def test_large_groups_compress_on_a_slow_link_and_nothing_does_on_a_free_one():
    params = _params(big=8 << 20, small=2048)
    decisions = planner.decide([["big"], ["small"]], params, MAXMIN4, "sra", GIGABIT, True)
    big, small = decisions
    assert big.compress and big.compressed_s < big.plain_s / 3  # 32 MiB: the wire dominates
    assert not small.compress  # 8 KiB: two rounds of latency cost more than the bytes saved
    free = planner.Costs(alpha=5e-5, beta=1e-12, encode=1.5e-9, decode=1e-9, copy=3e-10, world_size=4)
    assert not any(d.compress for d in planner.decide([["big"], ["small"]], params, MAXMIN4, "sra", free, True))
    for d in decisions:
        assert d.predicted_s == min(d.plain_s, d.compressed_s)


def test_the_model_charges_each_collective_its_own_traffic_and_work():
    n, payload = 1 << 22, MAXMIN4.wire_bytes(1 << 22)
    sra = GIGABIT.compressed(n, payload, "sra", memory=True)
    gather = GIGABIT.compressed(n, payload, "allgather", memory=True)
    assert gather > sra  # W/2 times the traffic and W decodes instead of 2
    assert GIGABIT.compressed(n, payload, "sra", memory=False) < sra  # no own decode, fewer copies
    one_rank = planner.Costs(5e-5, 8e-9, 1.5e-9, 1e-9, 3e-10, world_size=1)
    assert one_rank.compressed(n, payload, "sra", True) == pytest.approx(n * (1.5e-9 * 2 + 1e-9 * 3 + 3e-10 * 3))


def test_payload_of_a_fused_group_counts_the_padding_to_blocks():
    params = [torch.zeros(1000), torch.zeros(3000)]  # 1024 + 3072 values once padded
    assert planner.payload_bytes(MAXMIN4, params) == MAXMIN4.wire_bytes(4096)
    powersgd = gradzip.codec("powersgd", rank=2)  # per matrix: its shape decides the size
    mats = [torch.zeros(64, 32), torch.zeros(16, 16)]
    assert planner.payload_bytes(powersgd, mats) == sum(powersgd.wire_bytes(m.numel(), m.dtype, tuple(m.shape)) for m in mats)


def test_without_a_model_every_group_is_compressed_unpredicted():
    decisions = planner.decide([["a", "b"]], _params(a=10, b=20), MAXMIN4, "sra", None, True)
    assert decisions[0].compress and decisions[0].numel == 30 and math.isnan(decisions[0].plain_s)


def test_auto_spells_out_its_codec_and_plan_is_validated():
    cfg = Config(codec="auto", options={"bucket_size": 512}).resolved()
    assert (cfg.codec, cfg.options, cfg.memory, cfg.plan) == ("maxmin", {"bits": 4, "bucket_size": 512}, "residual", "auto")
    assert Config(codec="topk").resolved() == Config(codec="topk")
    assert Config().with_env({"GRADZIP_PLAN": "auto"}).plan == "auto"
    with pytest.raises(ValueError, match="plan must be one of off, auto"):
        Config(plan="sometimes")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _auto(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.5)
    state = gradzip.register(ddp, "auto", min_numel=1024)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    plan = state.plan()
    out = {
        "identical": all(torch.equal(gathered[0], t) for t in gathered), "plan": plan,
        "settings": (state.comm.codec.name, state.comm.codec.config().get("bits"), state.comm.memory.name),
        "steps": state.stats()["steps"], "finite": bool(torch.isfinite(flat).all()),
    }
    state.close()
    return out


def test_auto_plans_the_same_on_every_rank_and_keeps_replicas_identical():
    results = run_workers(_auto, 2)
    first = results[0]["plan"]
    costs = first["costs"]
    assert costs is not None and costs["world_size"] == 2
    assert all(v >= 0 and math.isfinite(v) for v in costs.values())
    rows = first["groups"]
    assert sum(r["params"] for r in rows) == 3  # the three weights (the smallest has 5120 values)
    for r in results:
        assert r["identical"] and r["finite"] and r["steps"] == 4
        assert r["settings"] == ("maxmin", 4, "residual")
        # decisions and predictions agree on every rank: they come from the same calibrated floats
        assert [(g["compress"], g["predicted_ms"]) for g in r["plan"]["groups"]] == [
            (g["compress"], g["predicted_ms"]) for g in rows
        ]
    for g in rows:
        assert g["compress"] == (g["predicted_compressed_ms"] < g["predicted_plain_ms"])
        assert g["predicted_ms"] == min(g["predicted_compressed_ms"], g["predicted_plain_ms"])
        # a compressed group has measured exchanges; a plain one went with its bucket's all-reduce
        assert (g["measured_ms"] is not None) == g["compress"]


def _plain_in_place(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("maxmin", bits=4)
    buffer = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        buffer[7] = float("nan")
    views = [buffer[0:300].view(30, 10), buffer[300:1000]]
    expected = [torch.empty(1000) for _ in range(world)]
    dist.all_gather(expected, buffer.clone())
    out = comm.reduce_many_now(views, ["a", "b"], [False, False], inplace=True)
    clean = torch.randn(1000, generator=torch.Generator().manual_seed(10 + rank))
    mean = torch.stack([c for c in _gathered(clean, world)]).mean(0)
    scattered = [clean[0:300], clean[400:1000]]  # not back to back: concatenated instead
    comm.reduce_many_now(scattered, ["c", "d"], [False, False], inplace=True)
    result = {
        "same_objects": all(o is v for o, v in zip(out, views)),
        "all_nan": bool(torch.isnan(buffer).all()),  # a NaN on one rank: all-NaN everywhere
        "clean_err": float(max((clean[0:300] - mean[0:300]).abs().max(), (clean[400:] - mean[400:]).abs().max())),
        "untouched": bool(torch.equal(clean[300:400], torch.randn(1000, generator=torch.Generator().manual_seed(10 + rank))[300:400])),
    }
    comm.close()
    return result


def _gathered(t: torch.Tensor, world: int):
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.clone())
    return out


def test_plain_gradients_back_to_back_are_averaged_in_place_with_the_nonfinite_policy():
    for res in run_workers(_plain_in_place, 2):
        assert res["same_objects"] and res["all_nan"] and res["untouched"]
        assert res["clean_err"] < 1e-6
