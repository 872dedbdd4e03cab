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
from gradzip.policy import planner
from gradzip.config import Config

from ..dist_utils import run_workers

MAXMIN4 = gradzip.codec("maxmin", bits=4)
# 4 ranks at 1 Gbit/s: a plain all-reduce moves 2(W-1)/W x 4 bytes a value at 8 ns a byte; the
# compressed exchange has two rounds of latency but an eighth of the bytes, plus codec work
GIGABIT = planner.Costs(planner.Line(5e-5, 4.8e-8), planner.Line(1.5e-4, 1.2e-8), world_size=4)


def _params(**sizes: int) -> Dict[str, torch.Tensor]:
    return {name: torch.zeros(n) for name, n in sizes.items()}


def test_fit_recovers_a_line_and_stays_non_negative():
    alpha, beta = planner.fit([(n, 2e-4 + 8e-9 * n) for n in planner.SIZES])
    assert alpha == pytest.approx(2e-4) and beta == pytest.approx(8e-9)
    # times that fall with size (noise) give no negative cost per value
    assert planner.fit([(1e3, 3e-3), (1e6, 2e-3), (1e7, 1e-3)])[1] == 0.0


def test_large_groups_compress_on_a_slow_link_and_nothing_does_where_plain_is_cheaper():
    params = _params(big=8 << 20, small=2048)
    big, small = planner.decide([["big"], ["small"]], params, MAXMIN4, GIGABIT)
    assert big.compress and big.compressed_s < big.plain_s / 3  # 32 MiB: the wire dominates
    assert not small.compress  # 8 KiB: the extra latency costs more than the bytes saved
    # loopback on a shared CPU: the plain all-reduce is cheaper per value than the codec
    free = planner.Costs(planner.Line(5e-5, 2e-9), planner.Line(1.5e-4, 1.2e-8), world_size=4)
    assert not any(d.compress for d in planner.decide([["big"], ["small"]], params, MAXMIN4, free))
    for d in (big, small):
        assert d.predicted_s == (d.compressed_s if d.compress else d.plain_s)
    # compression must save half the plain time: 45% saved is not enough, 55% is
    tie = planner.Costs(planner.Line(0.0, 1e-8), planner.Line(0.0, 0.55e-8), world_size=4)
    assert not planner.decide([["big"]], params, MAXMIN4, tie)[0].compress
    clear = planner.Costs(planner.Line(0.0, 1e-8), planner.Line(0.0, 0.45e-8), world_size=4)
    assert planner.decide([["big"]], params, MAXMIN4, clear)[0].compress



def test_one_more_size_is_timed_only_for_large_groups_near_the_bar_and_where_it_is_cheap():
    big = 22 << 20  # values: BERT-base's word embedding
    near = planner.Costs(planner.Line(1e-3, 1e-8), planner.Line(1e-3, 0.45e-8), world_size=4)  # 10 Gbit/s-like
    assert planner.extra_size_due(near, big)
    assert not planner.extra_size_due(near, 2 * planner.SIZES[-1])  # within reach of the sizes timed
    clear = planner.Costs(planner.Line(1e-3, 1e-8), planner.Line(1e-3, 0.1e-8), world_size=4)
    assert not planner.extra_size_due(clear, big)  # 0.1 of plain: clearly compressed
    far = planner.Costs(planner.Line(1e-3, 1e-8), planner.Line(1e-3, 3e-8), world_size=4)
    assert not planner.extra_size_due(far, big)  # 3x plain: clearly plain
    slow = planner.Costs(planner.Line(1e-3, 1e-7), planner.Line(1e-3, 0.45e-7), world_size=4)
    assert not planner.extra_size_due(slow, big)  # near the bar, but timing it would take too long


def _calibrated_with_extra(rank: int, world: int, due: bool) -> dict:
    sizes, timed = [], [0]
    time_size_due, median = planner.extra_size_due, planner.median_seconds
    planner.extra_size_due = lambda *args: sizes.append(args[1]) or due

    def counted(*args, **kwargs):
        timed[0] += 1
        return median(*args, **kwargs)

    planner.median_seconds = counted
    try:
        comm = gradzip.Communicator("maxmin", bits=4)
        costs = planner.calibrate(comm, repeats=1, largest=16 << 20)
        comm.close()
    finally:
        planner.extra_size_due, planner.median_seconds = time_size_due, median
    return {"asked": sizes, "timed": timed[0],
            "lines": [costs.plain.alpha, costs.plain.beta, costs.compressed.alpha, costs.compressed.beta]}


@pytest.mark.timeout(120)
def test_calibration_times_the_extra_size_alike_on_every_rank():
    """Where it is due, the extra size is timed on every rank and the lines refitted, the same
    floats everywhere (the slowest rank's)."""
    for due in (False, True):
        res = run_workers(_calibrated_with_extra, 2, due)
        assert [r["asked"] for r in res] == [[16 << 20], [16 << 20]]
        # two ways (plain, compressed) a size: three sizes, and the extra one where due
        assert [r["timed"] for r in res] == [2 * (len(planner.SIZES) + due)] * 2
        assert res[0]["lines"] == res[1]["lines"] and all(math.isfinite(v) and v >= 0 for v in res[0]["lines"])


def test_groups_are_priced_at_their_padded_size_and_16_bit_plain_at_half():
    params = _params(a=1000, b=3000)  # 1024 + 3072 values once padded to maxmin's blocks
    (d,) = planner.decide([["a", "b"]], params, MAXMIN4, GIGABIT)
    assert d.numel == 4000 and d.compressed_s == pytest.approx(GIGABIT.compressed.at(4096))
    assert planner.padded_numel(gradzip.codec("topk"), list(params.values())) == 4000  # sent one by one
    assert GIGABIT.plain_s(1000, 2) == pytest.approx(GIGABIT.plain.at(500))


def test_plain_exchanges_go_hierarchically_only_from_where_that_saves_a_tenth():
    flat = planner.Line(1e-4, 12e-9)  # 2 nodes x 2 ranks at 1 Gbit/s: the node's link carries 1.5x the values flat
    hier = planner.Line(4e-4, 8e-9)  # 1x hierarchically, after more rounds of latency
    costs = planner.Costs(flat, planner.Line(0.0, 1.0), world_size=4, plain_hierarchical=hier,
                          inter_node=planner.Line(2e-4, 7e-9), nodes=2)
    start = costs.plain_hierarchy_from
    assert start is not None and start > 0
    for n in (start - 1, start):  # the threshold is where hier < 0.9 x flat begins
        assert (hier.at(n) < (1 - planner.PLAIN_ROUTE_MARGIN) * flat.at(n)) == (n >= start)
    assert costs.plain_s(start - 1) == flat.at(start - 1) and costs.plain_s(start) == hier.at(start)
    links = costs.as_dict()["links"]  # the intra-node stages cost the difference, per value of the tensor
    assert links["intra-node"]["s_per_value"] == pytest.approx(1e-9) and links["intra-node"]["alpha_s"] == pytest.approx(2e-4)
    assert links["inter-node"]["gbit_per_s"] == pytest.approx(4 * 8 / 7e-9 / 1e9)  # 2(N-1)/N x 4 bytes a value
    # never cheaper by a tenth, or only for small tensors: always flat; flat layouts have no hierarchical line
    assert planner.Costs(flat, flat, world_size=4, plain_hierarchical=planner.Line(0.0, 11e-9)).plain_hierarchy_from is None
    assert GIGABIT.plain_hierarchy_from is None and "links" not in GIGABIT.as_dict()


def test_without_a_model_every_group_is_compressed_unpredicted():
    decisions = planner.decide([["a", "b"]], _params(a=10, b=20), MAXMIN4, None)
    assert decisions[0].compress and decisions[0].numel == 30 and math.isnan(decisions[0].plain_s)


def _calibrated_wire(rank: int, world: int) -> Dict[str, float]:
    """What the calibration's compressed exchanges put on the wire, per codec: the throwaway
    communicator's metrics, read as calibrate closes it."""
    from gradzip.sync.engine import Communicator

    seen: Dict[str, float] = {}
    close = Communicator.close

    def reading(self, *args, **kwargs):
        per = self.metrics.summary(per_tensor=True)["per_tensor"]
        compressed = [v for k, v in per.items() if ".compressed." in k]
        if compressed:
            seen[self.codec.name] = sum(v["raw_bytes"] for v in compressed) / sum(v["wire_bytes"] for v in compressed)
        return close(self, *args, **kwargs)

    Communicator.close = reading
    try:
        for codec, opts in (("powersgd", {"rank": 2}), ("maxmin", {"bits": 4})):
            comm = gradzip.Communicator(codec, memory="residual", **opts)
            planner.calibrate(comm, repeats=1)
            comm.close()
    finally:
        Communicator.close = close
    return seen


def test_calibration_exchanges_matrices_for_a_codec_that_factorises_them():
    # flat, PowerSGD sent the calibration groups as they were: its compressed line was a plain
    # all-reduce's, and plan="auto" never compressed a PowerSGD group
    assert planner.calibration_shape(gradzip.codec("powersgd"), 1 << 18) == (512, 512)
    assert planner.calibration_shape(gradzip.codec("powersgd"), 1 << 15) == (128, 256)
    assert planner.calibration_shape(gradzip.codec("maxmin"), 1 << 15) == (1 << 15,)
    for ratios in run_workers(_calibrated_wire, 2):
        assert ratios["powersgd"] > 50  # rank 2 of 128×256 to 1024×1024: 43× to 256×
        assert 6 < ratios["maxmin"] < 8  # 4 bits and the statistics


def test_auto_spells_out_its_codec_and_plan_is_validated():
    cfg = Config(codec="auto", options={"bucket_size": 512}).resolved()
    assert (cfg.codec, cfg.options, cfg.memory, cfg.plan) == ("maxmin", {"bits": 4, "bucket_size": 512}, "residual", "auto")
    assert cfg.adaptive == "bytes"  # per-layer levels under the uniform 4-bit error
    assert Config(codec="topk").resolved() == Config(codec="topk", adaptive="off", ramp=0, plan="off")
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
    routes = costs.pop("routes")  # the collective was not chosen: the planner times the others too
    assert sorted(routes) == ["ps", "ps:partitions=4", "sra"]  # (at two ranks the all-gather is the default)
    assert all(v >= 0 and math.isfinite(v) for line in routes.values() for v in line.values())
    assert all(v >= 0 and math.isfinite(v) for v in costs.values())
    assert costs["plain_s_per_value"] > 0 and costs["compressed_s_per_value"] > 0  # measured, not assumed
    rows = first["groups"]
    assert sum(r["params"] for r in rows) == 3  # the three weights (the smallest has 5120 values)
    for r in results:
        assert r["identical"] and r["finite"] and r["steps"] == 4
        assert r["settings"] == ("maxmin", 4, "residual")
        # decisions and predictions agree on every rank: they come from the same calibrated floats
        assert [(g["compress"], g["route"], g["predicted_ms"]) for g in r["plan"]["groups"]] == [
            (g["compress"], g["route"], g["predicted_ms"]) for g in rows
        ]
    assert first["predicted_total_ms"] == pytest.approx(sum(g["predicted_ms"] for g in rows), abs=0.01)
    for g in rows:
        if g["compress"]:
            assert g["predicted_compressed_ms"] < g["predicted_plain_ms"]
        assert g["predicted_ms"] == (g["predicted_compressed_ms"] if g["compress"] else g["predicted_plain_ms"])
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
        # a NaN on one rank: NaN at that value on every rank, as in DDP's sum, the rest averaged
        "nan_where_sent": bool(torch.isnan(buffer[7])) and bool(torch.isfinite(buffer[torch.arange(1000) != 7]).all()),
        "clean_err": float(max((clean[0:300] - mean[0:300]).abs().max(), (clean[400:] - mean[400:]).abs().max())),
        "untouched": bool(torch.equal(clean[300:400], torch.randn(1000, generator=torch.Generator().manual_seed(10 + rank))[300:400])),
    }
    comm.close()
    return result


def _gathered(t: torch.Tensor, world: int):
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.clone())
    return out


def test_plain_gradients_back_to_back_are_averaged_in_place_as_ddp_sums_them():
    for res in run_workers(_plain_in_place, 2):
        assert res["same_objects"] and res["nan_where_sent"] and res["untouched"]
        assert res["clean_err"] < 1e-6


def test_each_group_takes_its_cheapest_route_and_ties_keep_the_configured_collective():
    params = _params(big=8 << 20, small=4096)
    costs = planner.Costs(
        planner.Line(5e-5, 4.8e-8), planner.Line(1.5e-4, 1.2e-8), world_size=4,
        # one round and no re-encode: cheaper for small groups, dearer per value for large ones;
        # ps 20% cheaper per value than sra, not enough to leave it (ROUTE_MARGIN is 25%)
        routes={"allgather": planner.Line(5e-5, 2.0e-8), "ps": planner.Line(1.5e-4, 0.96e-8)},
    )
    big, small = planner.decide([["big"], ["small"]], params, MAXMIN4, costs)
    assert big.route is None and big.compressed_s == pytest.approx(costs.compressed.at(8 << 20))
    assert small.route == "allgather" and small.compressed_s == pytest.approx(costs.routes["allgather"].at(4096))
    costs.routes["ps"] = planner.Line(1.5e-4, 0.85e-8)  # 29% cheaper at 8 Mi values: taken
    assert planner.decide([["big"]], params, MAXMIN4, costs)[0].route == "ps"
    assert costs.as_dict()["routes"]["allgather"] == {"alpha_s": 5e-5, "s_per_value": 2.0e-8}


def test_route_labels_name_the_collective_and_its_changed_options():
    from gradzip.comm.base import parse_route, route_label

    assert route_label("ps", {"partitions": 8}) == "ps:partitions=8" and route_label("sra") == "sra"
    assert parse_route("ps:min_partition=64:partitions=None") == ("ps", {"min_partition": 64, "partitions": None})
    assert parse_route(route_label("ps", {"partitions": 8, "min_partition": 2})) == ("ps", {"partitions": 8, "min_partition": 2})


def _routed(rank: int, world: int) -> dict:
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(rank))
    routed = gradzip.Communicator("maxmin", bits=4, memory="residual")  # sra for the rest
    routed.routes = {"w": "ps:partitions=4"}
    alone = gradzip.Communicator("maxmin", bits=4, memory="residual", collective="ps", collective_options={"partitions": 4})
    a = [routed.allreduce(x, name="w") for _ in range(2)]
    b = [alone.allreduce(x, name="w") for _ in range(2)]
    other = routed.allreduce(x, name="v")  # no route: the configured collective
    coll = routed.collective_for("w")
    resumed = gradzip.Communicator("maxmin", bits=4, memory="residual")
    resumed.routes = {"w": "ps:partitions=4"}  # the planner chose the same route again
    resumed.load_state_dict(routed.state_dict())
    out = {
        "resumed_calls": resumed.collective_for("w").calls,
        "same": all(torch.equal(p, q) for p, q in zip(a, b)), "kind": (coll.name, coll.partitions),
        "default": routed.collective_for("v") is routed.collective, "finite": bool(torch.isfinite(other).all()),
        "calls": routed.state_dict()["route_collectives"], "residuals": torch.equal(
            routed.memory.residuals["w"], alone.memory.residuals["w"]),
    }
    routed.close()
    alone.close()
    resumed.close()
    return out


def test_a_routed_parameter_is_exchanged_by_its_route_exactly_as_by_that_collective_alone():
    for r in run_workers(_routed, 2):
        assert r["same"] and r["residuals"] and r["kind"] == ("ps", 4)
        assert r["default"] and r["finite"]
        assert r["calls"] == {"ps:partitions=4": {"calls": 2}}  # its call counter is saved
        assert r["resumed_calls"] == 2  # and restored where the route is planned again


# ------------------------------------------------------------------ re-planning and drift
def _watch(rank: int, world: int) -> list:
    watch = planner.DriftWatch(every=2, limit=1.5, start=1)
    out = [[watch.due(s) for s in range(6)]]
    watch.add(1.0, 50.0, step=0)  # before the start: not counted
    step = 0
    for measured in (1.0, 1.2, 4.0, 4.1):  # this rank's ratio per window; rank 1 is slower
        step += 2
        watch.add(1.0, 99.0, step=step - 2)  # completed after its window was checked: dropped
        watch.add(1.0, measured * (1.5 if rank == 1 else 1.0), step=step - 1)
        watch.add(float("nan"), 100.0, step=step)  # no prediction: not counted
        out.append((watch.check(step, None), watch.last_ratio, watch.baseline))
    watch.reset()
    out.append((watch.check(step + 2, None), watch.last_ratio, watch.baseline))  # nothing measured: no decision
    return out


def test_the_drift_watch_agrees_on_every_rank_and_fires_when_the_ratio_leaves_its_baseline():
    first, second = run_workers(_watch, 2)
    assert first == second  # the slowest rank's ratio, the same floats and decisions everywhere
    due, *checks = first
    assert due == [False, False, True, False, True, False]  # every 2 steps from step 1
    assert checks[0] == (False, 1.5, 1.5)  # the first window sets the baseline
    assert checks[1] == (False, pytest.approx(1.8), 1.5)  # 1.2x: within the limit
    assert checks[2] == (True, pytest.approx(6.0), None)  # 4x: calibrate again, new baseline next
    assert checks[3] == (False, pytest.approx(6.15), pytest.approx(6.15))
    assert checks[4] == (False, 0.0, None)


def _train(ddp, opt, rank: int, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class Linear(nn.Module):
    """``sum(p * c)`` over its parameters: each gradient is its ``c``, whatever the parameters,
    so what a run delivers can be compared with plain DDP's step by step, exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Parameter(torch.zeros(512, 64))
        self.fc2 = nn.Parameter(torch.zeros(512, 512))
        self.fc3 = nn.Parameter(torch.zeros(10, 512))

    def forward(self, cs):
        return sum((p * c).sum() for p, c in zip(self.parameters(), cs))


def _train_linear(ddp, opt, rank: int, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    for _ in range(steps):
        cs = [torch.randn(p.shape, generator=g) for p in ddp.module.parameters()]
        opt.zero_grad()
        ddp(cs).backward()
        opt.step()


def _replan_settles(rank: int, world: int) -> dict:
    model, reference = Linear(), Linear()
    ddp, ref = DDP(model, bucket_cap_mb=0.5), DDP(reference, bucket_cap_mb=0.5)
    # allgather quantises once, and error feedback keeps exactly what that lost (sra's second
    # quantisation of the aggregate is nobody's to keep)
    state = gradzip.register(ddp, "maxmin", bits=2, memory="residual", collective="allgather", min_numel=1024)
    # plain SGD at lr 1: a parameter's change is the sum of the averages it was given
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=1.0), torch.optim.SGD(ref.parameters(), lr=1.0)
    compress_all = planner.Costs(planner.Line(1.0, 0.0), planner.Line(0.0, 0.0), world_size=world)
    send_plain = planner.Costs(planner.Line(0.0, 0.0), planner.Line(1.0, 0.0), world_size=world)
    state.replan(compress_all)
    compressed = sorted(n for n, _ in state._compressed)
    _train_linear(ddp, opt, rank, 3, seed=1)
    _train_linear(ref, ref_opt, rank, 3, seed=1)
    owed = float(_flat(model).sub(_flat(reference)).abs().max())
    state.replan(send_plain)
    left = sorted(state._flush)
    _train_linear(ddp, opt, rank, 1, seed=2)
    _train_linear(ref, ref_opt, rank, 1, seed=2)
    flat = _flat(model)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    out = {
        "compressed": compressed, "left": left, "owed": owed, "settled": float(flat.sub(_flat(reference)).abs().max()),
        "memory": sorted(state.comm.memory.residuals), "flush": sorted(state._flush),
        "identical": all(torch.equal(gathered[0], t) for t in gathered),
        "groups": state.fusion_plan.groups, "plan": [g["compress"] for g in state.plan()["groups"]],
    }
    state.close()
    return out


def test_a_parameter_that_stops_being_compressed_pays_its_remainder_with_its_next_plain_sum():
    for r in run_workers(_replan_settles, 2):
        assert r["compressed"] == ["fc1", "fc2", "fc3"] == r["left"]
        assert r["owed"] > 1e-3  # 2-bit error feedback held back part of every step's gradient
        assert r["settled"] < 1e-4 * r["owed"], r  # paid in full: plain DDP's parameters, to rounding
        assert r["memory"] == [] and r["flush"] == [] and r["identical"]
        assert r["groups"] == [] and r["plan"] == [False]  # one fused group of the three, now plain


def _drifting(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.5)
    state = gradzip.register(ddp, "auto", min_numel=1024, adaptive=False)
    assert state.drift.start == 1  # the first step opens connections: not measured
    state.drift = planner.DriftWatch(every=3, start=1)  # check every 3 steps (the default is 50)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    _train(ddp, opt, rank, 4, seed=1)  # steps 1-3, the first window, set the baseline
    baseline = state.drift.baseline
    calibrated = state.costs
    # a model that no longer describes the link: it predicts everything a million times faster
    # (far beyond what a hiccup of this shared machine in the first window can hide)
    state.costs = planner.Costs(
        planner.Line(calibrated.plain.alpha / 1e6, calibrated.plain.beta / 1e6),
        planner.Line(calibrated.compressed.alpha / 1e6, calibrated.compressed.beta / 1e6),
        world_size=world, routes={r: planner.Line(v.alpha / 1e6, v.beta / 1e6) for r, v in calibrated.routes.items()},
    )
    _train(ddp, opt, rank, 3, seed=2)  # steps 4-6: measured/predicted jumps, calibrate again
    flat = _flat(model)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    plan = state.plan()
    out = {
        "baseline": baseline, "drift": plan["drift"], "recalibrated": state.costs is not calibrated and state.costs.plain.beta > 0,
        "decisions": [(g["compress"], g["route"], g["predicted_ms"]) for g in plan["groups"]],
        "identical": all(torch.equal(gathered[0], t) for t in gathered), "step": state.step,
    }
    state.close()
    return out


def test_times_that_drift_from_the_model_make_every_rank_calibrate_again_at_the_same_step():
    first, second = run_workers(_drifting, 2)
    for r in (first, second):
        assert r["baseline"] is not None and r["baseline"] > 0
        assert r["drift"]["recalibrations"] == 1 and r["drift"]["last_ratio"] > 100 * r["baseline"]
        assert r["recalibrated"] and r["identical"] and r["step"] == 7
    assert first["decisions"] == second["decisions"] and first["drift"] == second["drift"]


def _resumed_plan(rank: int, world: int) -> dict:
    compress_all = planner.Costs(planner.Line(1.0, 0.0), planner.Line(0.0, 0.0), world_size=world)
    send_plain = planner.Costs(planner.Line(0.0, 0.0), planner.Line(1.0, 0.0), world_size=world)

    def start():
        model = Linear()
        ddp = DDP(model, bucket_cap_mb=0.5)
        state = gradzip.register(ddp, "maxmin", bits=2, memory="residual", collective="allgather", min_numel=1024,
                                 plan="auto")
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=1.0)

    model, ddp, state, opt = start()
    state.replan(compress_all)
    _train_linear(ddp, opt, rank, 3, seed=1)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "gz": state.state_dict()}
    _train_linear(ddp, opt, rank, 2, seed=2)
    through = _flat(model)
    state.close()
    out = {"saved_costs": "plan_costs" in saved["gz"]}
    # resumed where this process's own calibration would send everything plain: the saved plan
    # is taken again, and the run goes on bit for bit
    model, ddp, state, opt = start()
    state.replan(send_plain)
    model.load_state_dict(saved["model"])
    state.load_state_dict(saved["gz"])
    out["plan"] = [g["compress"] for g in state.plan()["groups"]]
    _train_linear(ddp, opt, rank, 2, seed=2)
    out["resumed"] = torch.equal(_flat(model), through)
    state.close()
    # a checkpoint without the plan's costs (one saved by hand, or before they were kept): the
    # residuals of parameters this plan sends plain go with their next plain sum
    model, ddp, state, opt = start()
    state.replan(send_plain)
    model.load_state_dict(saved["model"])
    state.load_state_dict({k: v for k, v in saved["gz"].items() if k != "plan_costs"})
    out["flush"] = sorted(state._flush)
    _train_linear(ddp, opt, rank, 1, seed=2)
    out["left"] = sorted(state.comm.memory.residuals)
    state.close()
    # another codec's checkpoint: refused (strict) or loaded in part, and either way this run
    # keeps its own plan (the saved costs were calibrated for other settings)
    ddp = DDP(Linear(), bucket_cap_mb=0.5)
    state = gradzip.register(ddp, "qsgd", bits=8, memory="residual", min_numel=1024, plan="auto")
    state.replan(send_plain)
    try:
        state.load_state_dict(saved["gz"])
        out["strict"] = "loaded"
    except gradzip.CheckpointError:
        out["strict"] = "refused"
    out["plan_after_refusal"] = [g["compress"] for g in state.plan()["groups"]]
    with pytest.warns(UserWarning, match="dropped"):
        state.load_state_dict(saved["gz"], strict=False)
    out["plan_after_partial"] = [g["compress"] for g in state.plan()["groups"]]
    _train_linear(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0), rank, 1, seed=2)
    state.close()
    return out


def test_a_resumed_run_takes_its_saved_plan_and_else_pays_what_it_owed():
    """Exact resume under the planner: the checkpoint holds the calibrated costs, so the resumed
    run plans as the saved one did (not as its own calibration would) and goes on bit for bit;
    a checkpoint without them loads residuals that this plan sends plain, paid with the next
    plain sum (they were never sent before)."""
    for r in run_workers(_resumed_plan, 2):
        assert r["saved_costs"] and r["plan"] == [True] and r["resumed"], r
        assert r["flush"] == ["fc1", "fc2", "fc3"] and r["left"] == [], r
        assert r["strict"] == "refused" and r["plan_after_refusal"] == r["plan_after_partial"] == [False], r
