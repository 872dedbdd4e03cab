"""Adaptive per-layer levels: the knapsack against brute force, the schedule, and DDP on real ranks."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.policy import adaptive

from ..dist_utils import run_workers


def _brute(weights, costs, capacity):
    best = None
    for pick in itertools.product(range(weights.shape[1]), repeat=weights.shape[0]):
        w = sum(float(weights[i, k]) for i, k in enumerate(pick))
        c = sum(float(costs[i, k]) for i, k in enumerate(pick))
        if w <= capacity and (best is None or c < best):
            best = c
    return best


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 4), options=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
    share=st.floats(0.05, 1.5),
)
def test_knapsack_is_feasible_and_as_good_as_brute_force(layers, options, seed, share):
    g = torch.Generator().manual_seed(seed)
    weights = torch.randint(0, 20, (layers, options), generator=g)
    costs = torch.randint(1, 50, (layers, options), generator=g).double()
    capacity = max(1, round(share * float(weights.sum()) / options))
    picked = adaptive.knapsack(weights, costs, capacity)
    best = _brute(weights, costs, capacity)
    if best is None:
        assert picked is None
        return
    assert picked is not None
    assert sum(float(weights[i, k]) for i, k in enumerate(picked)) <= capacity
    assert sum(float(costs[i, k]) for i, k in enumerate(picked)) == best


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), objective=st.sampled_from(["bytes", "error"]))
def test_choose_never_exceeds_the_uniform_budget_nor_costs_more(layers, seed, objective):
    g = torch.Generator().manual_seed(seed)
    # levels as for bits 2..8: bytes grow, errors shrink by about 4x a bit, each layer its own scale
    bits = torch.arange(2, 9, dtype=torch.float64)
    numel = torch.randint(100, 10_000, (layers, 1), generator=g).double()
    scale = torch.rand(layers, 1, generator=g, dtype=torch.float64) * 100
    nbytes = numel * bits / 8
    errors = numel * scale * 4.0 ** -bits * (0.5 + torch.rand(layers, 7, generator=g, dtype=torch.float64))
    default = 2  # 4 bits
    picked = adaptive.choose(errors, nbytes, default, objective)
    rows = torch.arange(layers)
    chosen = torch.tensor(picked)
    uniform = torch.full((layers,), default)
    budget, cost = (errors, nbytes) if objective == "bytes" else (nbytes, errors)
    assert float(budget[rows, chosen].sum()) <= float(budget[rows, uniform].sum()) * (1 + 1e-12)
    assert float(cost[rows, chosen].sum()) <= float(cost[rows, uniform].sum())


def test_choose_moves_bits_from_quiet_layers_to_loud_ones():
    bits = torch.arange(2, 9, dtype=torch.float64)
    nbytes = torch.stack([1000 * bits / 8] * 2)
    errors = torch.stack([1000 * 1e-6 * 4.0 ** -bits, 1000 * 1.0 * 4.0 ** -bits])  # one quiet, one loud layer
    picked = adaptive.choose(errors, nbytes, 2, "bytes")
    assert picked[0] == 0 and picked[1] >= 2  # the quiet layer drops to 2 bits
    assert float(nbytes[[0, 1], picked].sum()) < float(nbytes[:, 2].sum())


def test_a_layer_never_measured_keeps_the_uniform_level():
    bits = torch.arange(2, 9, dtype=torch.float64)
    nbytes = torch.stack([1000 * bits / 8] * 3)
    errors = torch.stack([1000 * 4.0 ** -bits, 1000 * 4.0 ** -bits, torch.zeros(7, dtype=torch.float64)])
    free = adaptive.choose(errors, nbytes, 2, "bytes")
    assert free[2] == 0  # no error at any level: the cheapest
    kept = adaptive.choose(errors, nbytes, 2, "bytes", fixed=torch.tensor([False, False, True]))
    assert kept[2] == 2  # no gradient while sampling: not evidence of a quiet layer


def test_uniform_stays_where_nothing_is_better():
    nbytes = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    errors = torch.zeros(2, 2)  # no error anywhere: no budget to plan against
    assert adaptive.choose(errors, nbytes, 1, "bytes") == [1, 1]


def test_schedule_counts_from_the_end_of_warmup():
    codec = gradzip.codec("maxmin", bits=4)
    levels = adaptive.AdaptiveLevels(adaptive.LevelCodecs(codec), "bytes", 10, ["a"], [(64, 64)], warmup=3)
    assert [s for s in range(30) if levels.sample_at(s)] == [3, 4, 13, 14, 23, 24]
    assert [s for s in range(30) if levels.plan_after(s)] == [4, 14, 24]
    assert levels.levels == [2, 3, 4, 5, 6, 8] and levels.level("a") == 4 and levels.level("other") == 4


def test_levels_are_priced_in_the_gradients_width():
    """A level a gradient goes raw at (max-min on 3 values, PowerSGD's vector) is priced at what
    it sends: 16-bit values for a 16-bit gradient, also with error feedback, where its fp32
    compensation goes in the gradient's width; no level of a 16-bit matrix costs more than its
    raw bytes."""
    for name, shape in (("maxmin", (3,)), ("powersgd", (300,))):
        codecs = adaptive.LevelCodecs(gradzip.codec(name))
        levels = adaptive.AdaptiveLevels(codecs, "bytes", 10, ["v", "h", "w", "x"], [shape, shape, (64, 64), (64, 64)],
                                         dtypes=[torch.float32, torch.float16, torch.float32, torch.bfloat16])
        numel = math.prod(shape)
        assert levels.nbytes[1].tolist() == [2.0 * numel] * len(levels.levels), name
        assert bool((levels.nbytes[0] > levels.nbytes[1]).all()) and bool((levels.nbytes[0] <= 4 * numel).all()), name
        # (a matrix: no level sends more than its 16-bit raw bytes; PowerSGD's rank 16 goes raw in 16 bits alone)
        assert bool((levels.nbytes[3] <= levels.nbytes[2]).all()), name
        if name == "powersgd":  # a vector goes as it is: an fp64 one in fp64
            wide = adaptive.AdaptiveLevels(codecs, "bytes", 10, ["d"], [shape], dtypes=[torch.float64])
            assert wide.nbytes[0].tolist() == [8.0 * numel] * len(levels.levels)
        assert bool((levels.nbytes[3] <= 64 * 64 * 2).all()), name


def test_levels_that_cannot_take_the_error_feedback_are_not_offered():
    """QSGD with a residual at 8 bits: its residual is bounded only from 6 bits on 512-value
    buckets, so the levels below are not candidates (a plan could not choose them); without
    error feedback every level is."""
    codec = gradzip.codec("qsgd", bits=8)
    from gradzip.sync.memory import memory

    residual = adaptive.LevelCodecs(codec, memory("residual"))
    with_residual = adaptive.AdaptiveLevels(residual, "bytes", 10, ["a"], [(64, 64)])
    assert with_residual.levels == [6, 8]
    alone = adaptive.AdaptiveLevels(adaptive.LevelCodecs(codec), "bytes", 10, ["a"], [(64, 64)])
    assert alone.levels == [2, 3, 4, 5, 6, 8]


def test_options_are_validated_at_construction():
    with pytest.raises(ValueError, match="adaptive must be one of off, bytes, error"):
        gradzip.Config(adaptive="sometimes")
    with pytest.raises(ValueError, match="adaptive_every must be an integer of at least 2"):
        gradzip.Config(adaptive_every=1)
    with pytest.raises(ValueError, match="chooses levels of dgc, maxmin, powersgd, qsgd, randomk, topk; codec 'signsgd' has none"):
        adaptive.check("signsgd", "bytes")
    assert gradzip.Config(adaptive=True).adaptive == "bytes" and gradzip.Config(adaptive=False).adaptive == "off"
    env = gradzip.Config().with_env({"GRADZIP_ADAPTIVE": "error", "GRADZIP_ADAPTIVE_EVERY": "50"})
    assert (env.adaptive, env.adaptive_every) == ("error", 50)
    assert gradzip.Config().with_env({"GRADZIP_ADAPTIVE": "off"}).adaptive == "off"
    assert gradzip.Config(codec="auto").resolved().adaptive == "bytes"
    assert gradzip.Config(codec="auto", adaptive="off").resolved().adaptive == "off"
    assert gradzip.Config(codec="topk").resolved().adaptive == "off"


class Loud(nn.Module):
    """Layers whose gradients differ in scale by orders of magnitude (as a real network's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.d = nn.Linear(64, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h) * 0.01)
        h = torch.tanh(self.c(h) * 30)
        return self.d(h)


def _loud_training(rank: int, world: int, codec: str, options: dict, objective: str) -> dict:
    torch.manual_seed(0)
    model = Loud()
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradzip.register(
        ddp, codec, memory="residual", adaptive=objective, adaptive_every=3, min_numel=256, **options,
    )
    g = torch.Generator().manual_seed(10 + rank)
    plans = []
    for step in range(8):
        x = torch.randn(32, 64, generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        plans.append(state.plan()["levels"]["per_parameter"])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    levels = state.plan()["levels"]
    saved = state.state_dict()
    groups = [list(gr) for gr in state.fusion_plan.groups]
    state.close()
    # a fresh registration that loads the state: the same levels and groups
    torch.manual_seed(0)
    model2 = Loud()
    state2 = gradzip.register(
        DDP(model2, bucket_cap_mb=0.02), codec, memory="residual", adaptive=objective, adaptive_every=3,
        min_numel=256, **options,
    )
    state2.load_state_dict(saved)
    resumed = (state2.plan()["levels"]["per_parameter"], [list(gr) for gr in state2.fusion_plan.groups])
    state2.close()
    return {
        "identical": all(torch.equal(gathered[0], t) for t in gathered), "plans": plans, "levels": levels,
        "groups": groups, "resumed": resumed, "wire": state.stats()["wire_bytes"],
    }


@pytest.mark.parametrize(
    "codec,options,objective",
    [("maxmin", {"bits": 4}, "bytes"), ("maxmin", {"bits": 4}, "error"), ("topk", {"ratio": 0.01}, "bytes"),
     ("powersgd", {"rank": 4}, "error")],
)
def test_ranks_agree_on_levels_and_stay_identical(codec, options, objective):
    results = run_workers(_loud_training, 2, codec, options, objective)
    first = results[0]
    for res in results:
        assert res["identical"]
        assert res["plans"] == first["plans"] and res["groups"] == first["groups"]  # one decision on every rank
        assert res["resumed"] == (first["levels"]["per_parameter"], first["groups"])
    lv = first["levels"]
    option = {"maxmin": "bits", "topk": "ratio", "powersgd": "rank"}[codec]
    assert lv["option"] == option and lv["plans"] == 3  # after steps 1, 4 and 7
    uniform = lv["uniform"]
    assert all(p == {n: uniform for n in p} for p in first["plans"][:1])  # the uniform level before the first plan
    if objective == "bytes":
        assert lv["bytes"] < lv["uniform_bytes"], lv  # the loud and quiet layers are worth planning
        assert lv["error"] <= lv["uniform_error"] * (1 + 1e-9), lv
    else:
        assert lv["error"] < lv["uniform_error"], lv
        assert lv["bytes"] <= lv["uniform_bytes"], lv
    assert len(set(lv["per_parameter"].values())) > 1, lv  # not one level for all
    for group in first["groups"]:  # a fused group holds one level
        assert len({lv["per_parameter"][n] for n in group}) == 1


def test_ramp_levels_follow_dgc_and_the_schedule_is_even():
    assert adaptive.ramp_levels("dgc", 0.001) == [0.25, 0.0625, 0.015625, 0.00390625]  # DGC's 75 % ... 99.6 %
    assert adaptive.ramp_levels("topk", 0.01) == [0.25, 0.0625, 0.015625]
    assert adaptive.ramp_levels("topk", 0.5) == []  # already denser than the first stage
    assert adaptive.ramp_levels("powersgd", 4) == [16, 8] and adaptive.ramp_levels("maxmin", 4) == [8, 6]
    ramp = adaptive.Ramp(gradzip.codec("topk", ratio=0.01), 6, start=2)
    assert [ramp.level_at(s) for s in range(10)] == [None, None, 0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, None, None]
    assert ramp.end == 8
    assert adaptive.Ramp(gradzip.codec("topk", ratio=0.5), 6).end == 0  # nothing to ramp through
    with pytest.raises(ValueError, match="ramp must be a non-negative number of steps"):
        gradzip.Config(ramp=-1)
    with pytest.raises(ValueError, match="a ramp passes through levels of .*codec 'signsgd' has none"):
        adaptive.check("signsgd", "off", ramp=10)
    assert gradzip.Config(codec="dgc").resolved().ramp == 100  # on by default where the method has one
    assert gradzip.Config(codec="topk").resolved().ramp == 0
    assert gradzip.Config().with_env({"GRADZIP_RAMP": "30"}).ramp == 30


def _ramp_training(rank: int, world: int, codec: str, options: dict) -> dict:
    torch.manual_seed(0)
    model = Loud()
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kw = dict(memory="residual", warmup=1, ramp=4, min_numel=256, **options)
    state = gradzip.register(ddp, codec, **kw)
    g = torch.Generator().manual_seed(10 + rank)
    wire, saved_at_3 = [], None
    for step in range(8):
        if step == 3:
            saved_at_3 = (state.state_dict(), [p.detach().clone() for p in model.parameters()], opt.state_dict())
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
        wire.append(state.stats()["wire_bytes"])
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(final) for _ in range(world)]
    dist.all_gather(gathered, final)
    state.close()
    # resume from step 3, in the middle of the ramp: the same parameters at the end
    torch.manual_seed(0)
    model2 = Loud()
    with torch.no_grad():
        for p, q in zip(model2.parameters(), saved_at_3[1]):
            p.copy_(q)
    ddp2 = DDP(model2, bucket_cap_mb=0.02)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    opt2.load_state_dict(saved_at_3[2])
    state2 = gradzip.register(ddp2, codec, **kw)
    state2.load_state_dict(saved_at_3[0])
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(8):
        x = torch.randn(32, 64, generator=g)
        if step < 3:
            continue
        opt2.zero_grad()
        ddp2(x).pow(2).mean().backward()
        opt2.step()
    resumed = torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
    state2.close()
    steps = [wire[0]] + [b - a for a, b in zip(wire, wire[1:])]
    return {"steps": steps, "identical": all(torch.equal(gathered[0], t) for t in gathered),
            "resumed_equal": torch.equal(final, resumed)}


@pytest.mark.parametrize("codec,options", [("topk", {"ratio": 0.01}), ("powersgd", {"rank": 2})])
def test_ramp_sends_fewer_bytes_stage_by_stage_and_resumes_bit_exactly(codec, options):
    for res in run_workers(_ramp_training, 2, codec, options):
        s = res["steps"]  # bytes of each step: step 0 dense, 1-4 the ramp's stages, 5-7 the level
        if codec == "topk":  # 4 steps over 25 %, 6.25 % and 1.56 %, then 1 %
            assert s[0] > s[1] == s[2] > s[3] > s[4] > s[5] == s[6] == s[7] > 0, s
        else:  # ranks 8 and 4, then 2
            assert s[0] > s[1] == s[2] > s[3] == s[4] > s[5] == s[6] == s[7] > 0, s
        assert res["identical"] and res["resumed_equal"]
