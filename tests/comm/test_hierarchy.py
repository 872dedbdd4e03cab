"""Hierarchical exchange: nodes found from torchrun's variables, plain inside a node, compressed across.

Real gloo ranks told their node as torchrun tells them (``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``); on this one machine every link is loopback, which is enough to check
what each rank computes.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import gradzip
from gradzip.comm.hierarchy import Hierarchical
from gradzip.comm.topology import Topology, layout, node_key
from gradzip.kernels import reference
from gradzip.policy import planner

from ..dist_utils import run_workers


def _run(fn, world: int, per_node: int, *args):
    return run_workers(fn, world, *args, ranks_per_node=per_node)


# --------------------------------------------------------------------- layouts (no processes)
def test_layout_groups_ranks_by_node_key_in_local_rank_order():
    keys = [("GROUP_RANK=1", 1), ("GROUP_RANK=0", 0), ("GROUP_RANK=1", 0), ("GROUP_RANK=0", 1)]
    assert layout(keys, [0, 1, 2, 3]) == ((2, 0), (1, 3))  # nodes by their lowest rank
    topo = Topology(layout(keys, [0, 1, 2, 3]), rank=0)
    assert (topo.node, topo.local_rank, topo.local_size) == (0, 1, 2)
    assert topo.cross() == (0, 3) and topo.cross(0) == (2, 1) and topo.hierarchical


@pytest.mark.parametrize(
    "nodes, reason",
    [(((0, 1, 2, 3),), "one node"), (((0,), (1,)), "one rank per node"), (((0, 1, 2), (3,)), "different numbers")],
)
def test_layouts_that_stay_flat_say_why(nodes, reason):
    topo = Topology(nodes, rank=0)
    assert not topo.hierarchical and reason in topo.reason
    assert topo.describe()["flat_because"] == topo.reason


def test_node_key_prefers_the_launchers_node_index_over_the_host_name():
    assert node_key({"GROUP_RANK": "3"}) == ("GROUP_RANK=3", "GROUP_RANK")
    assert node_key({"SLURM_NODEID": "1"})[1] == "SLURM_NODEID"
    assert node_key({})[1] == "host name"


def test_an_unknown_hierarchy_setting_is_rejected_naming_the_choices():
    with pytest.raises(ValueError, match="auto, on, off"):
        gradzip.Communicator("maxmin", hierarchy="always")
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        gradzip.Communicator("maxmin", node_dtype="int8")
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        gradzip.Config(node_dtype="half")
    from gradzip.comm.hierarchy import NODE_DTYPES
    from gradzip.config import NODE_DTYPES as NAMES

    assert tuple(NODE_DTYPES) == NAMES  # the names a user gives, and the dtypes they stand for


# --------------------------------------------------------------------- real ranks
def _values(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g)


def _exchange(rank: int, world: int, codec: str, options: dict, memory: str, sizes, steps: int, intra="shared") -> dict:
    comm = gradzip.Communicator(codec, memory=memory, **options)
    if intra != "shared":  # gloo's all-reduces, or the reduce-scatter and all-gather NCCL gets
        comm.collective.shared = None
        comm.collective.by_all_reduce = intra == "all-reduce"
    shared = comm.collective.shared if isinstance(comm.collective, Hierarchical) else None
    out = {"topology": comm.describe_topology(), "hier": isinstance(comm.collective, Hierarchical), "avgs": [],
           "shared": shared is not None}
    for step in range(steps):
        xs = [_values(rank, n, 10 * step + k) for k, n in enumerate(sizes)]
        avgs = comm.reduce_many_now(xs, [f"p{k}" for k in range(len(sizes))], [True] * len(sizes))
        out["avgs"].append([a.clone() for a in avgs])
    out["residuals"] = {k: v.clone() for k, v in comm.memory.residuals.items()} if memory == "residual" else {}
    out["stats"] = comm.stats()
    comm.close()
    return out


@pytest.mark.parametrize(
    "collective, intra",
    [("sra", "shared"), ("allgather", "shared"), (None, "shared"), ("sra", "all-reduce"), ("sra", "reduce-scatter")],
)
def test_two_nodes_of_two_ranks_average_hierarchically_and_stay_identical(collective, intra):
    """None: the communicator chooses, for the group across the two nodes: the all-gather."""
    sizes = [5000, 3001]  # one not a whole number of blocks
    named = {} if collective is None else {"collective": collective}
    res = _run(_exchange, 4, 2, "maxmin", {"bits": 8, **named}, "none", sizes, 3, intra)
    assert all(r["hier"] for r in res)
    assert res[0]["topology"]["stages"][1]["stage"] == (collective or "allgather")
    assert all(r["shared"] == (intra == "shared") for r in res)  # the ranks of a node do share /dev/shm here
    topo = res[0]["topology"]
    assert topo["hierarchical"] and topo["topology"] == "2 nodes x 2 ranks" and topo["found_from"] == "GROUP_RANK"
    assert [s["link"] for s in topo["stages"]] == ["intra-node", "inter-node", "intra-node"]
    for step in range(3):
        for k, n in enumerate(sizes):
            exact = torch.stack([_values(r, n, 10 * step + k) for r in range(4)]).mean(0)
            got = [r["avgs"][step][k] for r in res]
            for other in got[1:]:
                assert torch.equal(other, got[0])  # bit-identical on every rank
            span = exact.abs().max().item()
            assert (got[0] - exact).abs().max().item() < 4 * span / 255  # 8 bits, quantised once or twice


def _adacomp_on_nodes(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("adaq", bin_size=7)  # the residual memory by default
    avgs = []
    for step in range(3):
        xs = [_values(rank, n, 10 * step + k) for k, n in enumerate((700, 333))]
        avgs += [a.clone() for a in comm.reduce_many_now(xs, ["p0", "p1"], [True, True], step=step)]
    out = {"hier": isinstance(comm.collective, Hierarchical), "avgs": avgs,
           "kept": len(comm.codec.state_dict().get("residuals", {}))}
    comm.close()
    return out


def test_adacomp_across_nodes_keeps_its_own_residuals_of_the_node_sums_it_encodes():
    """Across nodes AdaComp encodes the node's sums, which the residual memory does not hold:
    it keeps its own residuals there (flat, it reads the memory's)."""
    res = _run(_adacomp_on_nodes, 4, 2)
    assert all(r["hier"] for r in res)
    leaders = [r["kept"] for r in res]
    assert max(leaders) == 2, leaders  # (the ranks that encode across nodes)
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["avgs"], res[0]["avgs"]))


def _sent_as_is_on_nodes(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    ddp = DDP(model, bucket_cap_mb=0.015)
    state = gradzip.register(ddp, "none", min_numel=64)
    for step in range(2):
        ddp.zero_grad()
        ddp(_values(rank, 512, step).view(8, 64)).square().mean().backward()
    out = {"compressed": state.stats()["tensors_compressed"], "hier": isinstance(state.comm.collective, Hierarchical)}
    state.close()
    return out


def test_gradients_sent_as_they_are_still_go_through_the_nodes():
    """On one node the hook leaves what ``none`` sends as it is to DDP's own sum; across nodes
    DDP's sum would be flat, so they keep the exchange through the nodes."""
    for res in _run(_sent_as_is_on_nodes, 4, 2):
        assert res["hier"] and res["compressed"] == 2, res  # the two weight matrices


def test_one_rank_per_node_stays_flat():
    res = _run(_exchange, 2, 1, "maxmin", {"bits": 4}, "none", [1000], 1)
    assert not res[0]["hier"] and res[0]["topology"]["flat_because"] == "one rank per node"


def _residual_check(rank: int, world: int) -> dict:
    """One exchange with residual error feedback (deterministic rounding, so a test can redo it)."""
    comm = gradzip.Communicator("maxmin", bits=2, mode="nearest", memory="residual", collective="sra")
    x = _values(rank, 4096, 7)
    avg = comm.reduce_many_now([x], ["w"], [True])[0]
    residual = comm.memory.residuals["w"].reshape(-1).clone()
    local = int(os.environ["LOCAL_RANK"])
    comm.close()
    return {"avg": avg, "residual": residual, "local": local}


def _sixteen_bit_node(rank: int, world: int, node_dtype: str, intra: str) -> dict:
    """One exchange with a 16-bit intra-node stage and residual error feedback; the average of
    the all-gather collective is exactly the mean of the nodes' decoded payloads."""
    comm = gradzip.Communicator("maxmin", bits=8, memory="residual", node_dtype=node_dtype, collective="allgather")
    if intra != "shared":
        comm.collective.shared = None
        comm.collective.by_all_reduce = intra == "all-reduce"
    x = _sixteen_bit_input(rank)
    avg = comm.reduce_many_now([x], ["w"], [True])[0]
    out = {"avg": avg, "residual": comm.memory.residuals["w"].reshape(-1).clone(), "local": int(os.environ["LOCAL_RANK"]),
           "stage": comm.describe_topology()["stages"][0]["values"], "slot": comm.collective.input_buffer("w", 4001, torch.float32, "cpu", 0)}
    comm.close()
    return out


def _server_across_nodes(rank: int, world: int, intra: str) -> dict:
    """The parameter server as the exchange across nodes, with error feedback, on DDP's path
    (the average written over the gradient)."""
    comm = gradzip.Communicator("randomk", ratio=0.1, memory="residual", collective="ps")
    if intra != "shared":
        comm.collective.shared = None
        comm.collective.by_all_reduce = intra == "all-reduce"
    x = _values(rank, 4096, 11)
    avg = comm.reduce_many_now([x.clone()], ["w"], [True], inplace=True)[0].clone()
    out = {"avg": avg, "residual": comm.memory.residuals["w"].reshape(-1).clone()}
    comm.close()
    return out


@pytest.mark.parametrize("intra", ["all-reduce", "reduce-scatter"])
def test_a_server_across_nodes_keeps_error_feedback_where_the_average_overwrites_the_share(intra):
    """The parameter server writes its average before it releases its input; where the node's
    share is also where that average goes (no shared memory), what error feedback keeps is
    taken before it is overwritten: the residuals equal those of the shared-memory layout, and
    what the ranks kept and what reached the average add up to their inputs."""
    apart, shared = _run(_server_across_nodes, 4, 2, intra), _run(_server_across_nodes, 4, 2, "shared")
    xs = [_values(r, 4096, 11) for r in range(4)]
    kept = sum(x.double() - r["residual"].double() for x, r in zip(xs, apart))
    torch.testing.assert_close(kept, 4 * apart[0]["avg"].double(), rtol=1e-6, atol=1e-4)
    for a, b in zip(apart, shared):
        assert torch.equal(a["avg"], b["avg"]) and torch.equal(a["residual"], b["residual"])


def _sixteen_bit_input(rank: int) -> torch.Tensor:
    x = _values(rank, 4001, 5)  # not a whole number of blocks or shares
    if rank == 1:
        x[3] = 3e5  # beyond fp16's range once divided by L: saturated, the rest kept by error feedback
    return x


@pytest.mark.parametrize(
    "node_dtype, intra",
    [("bf16", "shared"), ("fp16", "shared"), ("bf16", "all-reduce"), ("fp16", "reduce-scatter")],
)
def test_a_16_bit_node_stage_keeps_its_rounding_in_error_feedback_and_replicas_identical(node_dtype, intra):
    res = _run(_sixteen_bit_node, 4, 2, node_dtype, intra)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[node_dtype]
    n, per_node, world = 4001, 2, 4
    xs = [_sixteen_bit_input(r) for r in range(world)]
    # what every rank kept and what reached the average add up to the inputs: W x avg = sum(x - residual)
    kept = sum(x.double() - r["residual"].double() for x, r in zip(xs, res))
    torch.testing.assert_close(kept, world * res[0]["avg"].double(), rtol=1e-6, atol=1e-3)  # fp32 sums
    assert torch.isfinite(res[0]["avg"]).all()  # a finite gradient beyond fp16's range is no lost step
    for rank, r in enumerate(res):
        assert torch.equal(r["avg"], res[0]["avg"])  # every rank holds the same bytes
        assert r["stage"] == f"plain {half}" and r["slot"] is None  # the caller cannot write fp32 into a 16-bit slot
        sent = reference.saturate(xs[rank] / per_node, half).float()
        rounded = xs[rank] - per_node * sent  # what the 16-bit stage lost of this rank's input
        assert torch.count_nonzero(rounded) > 0
        share = -(-n // per_node)  # one tensor on its own: shares need no alignment
        lo, hi = r["local"] * share, min(n, (r["local"] + 1) * share)
        outside = torch.cat([torch.arange(0, lo), torch.arange(hi, n)])
        torch.testing.assert_close(r["residual"][outside], rounded[outside], rtol=0, atol=0)
        assert not torch.equal(r["residual"][lo:hi], rounded[lo:hi])  # plus what the compressed stage lost
    if node_dtype == "fp16":
        assert res[1]["residual"][3] > 1e5  # the saturated part of 3e5


def test_error_feedback_keeps_what_the_compressed_stage_lost_in_this_ranks_share():
    res = _run(_residual_check, 4, 2)
    n, per_node = 4096, 2
    share = n // per_node
    codec = gradzip.codec("maxmin", bits=2, mode="nearest")
    for rank, r in enumerate(res):
        node, lo = rank // per_node, r["local"] * share
        outside = torch.cat([r["residual"][:lo], r["residual"][lo + share :]])
        assert torch.count_nonzero(outside) == 0  # values of other shares reached the node's sum exactly
        # its own share: L × (the node's average of it − that average encoded and decoded)
        node_avg = torch.stack([_values(node * per_node + k, n, 7) for k in range(per_node)]).sum(0)[lo : lo + share] / per_node
        lost = per_node * (node_avg - codec.decode(codec.encode(node_avg, "w", 0)))
        assert torch.count_nonzero(lost) > 0
        torch.testing.assert_close(r["residual"][lo : lo + share], lost, rtol=0, atol=1e-5)


def _nonfinite(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("maxmin", bits=4, memory="residual")
    x = _values(rank, 2048, 3)
    if rank == 3:  # local rank 1 of node 1: its NaN lies in local rank 0's share
        x[5] = float("nan")
    avg = comm.reduce_many_now([x], ["w"], [True])[0]
    residual = comm.memory.residuals["w"].clone()
    comm.close()
    return {"avg": avg, "residual": residual}


def test_a_nan_on_one_rank_makes_every_rank_nan_and_spares_every_residual():
    res = _run(_nonfinite, 4, 2)
    for r in res:
        assert torch.isnan(r["avg"]).all()
        assert torch.count_nonzero(r["residual"]) == 0  # a non-finite step changes no memory


def _hierarchy_on_flat(rank: int, world: int) -> str:
    try:
        gradzip.Communicator("maxmin", hierarchy="on")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_hierarchy_on_where_the_layout_is_flat_says_why():
    msgs = run_workers(_hierarchy_on_flat, 2)
    assert all("one node" in m and "hierarchy='auto'" in m for m in msgs)


def _ddp(rank: int, world: int, node_dtype: str = "fp32") -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    state = gradzip.register(ddp, "maxmin", bits=4, memory="residual", min_numel=64, node_dtype=node_dtype)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randn(16, 64, generator=g)
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    plan = state.plan()
    from gradzip.frontends.ddp import settings_report

    return {"params": [p.detach().clone() for p in model.parameters()], "topology": plan["topology"],
            "residuals": sorted(state.comm.memory.residuals), "group_mb": plan["group_mb"],
            "report": settings_report(state.comm, state.config, group_mb=state.group_mb())}


@pytest.mark.parametrize("node_dtype", ["fp32", "bf16"])
def test_ddp_register_becomes_hierarchical_with_no_argument_and_replicas_stay_identical(node_dtype):
    res = _run(_ddp, 4, 2, node_dtype)
    assert res[0]["topology"]["hierarchical"] and res[0]["topology"]["topology"] == "2 nodes x 2 ranks"
    assert res[0]["topology"]["stages"][0]["values"] == ("plain" if node_dtype == "fp32" else "plain torch.bfloat16")
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], res[0]["params"]))
    assert res[0]["residuals"]  # error feedback is keyed by parameter name, as on a flat layout
    # the settings logged at registration give the group size in use beside the one configured
    fusion = next(line for line in res[0]["report"].splitlines() if line.split()[0] == "fusion_mb")
    assert res[0]["group_mb"] != 8.0 and f"8.0; {res[0]['group_mb']:g} in use" in fusion, fusion


def _powersgd_on_nodes(rank: int, world: int) -> dict:
    """PowerSGD under DDP on two nodes, with the hierarchy left on ("auto") and off: the
    weights' gradients alike to the bit (one flat exchange of factors either way)."""
    out = {}
    for hierarchy in ("auto", "off"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
        state = gradzip.register(ddp, "powersgd", rank=2, memory="residual", hierarchy=hierarchy)
        g = torch.Generator().manual_seed(rank)
        grads = []
        for _ in range(3):
            ddp.zero_grad()
            ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        per = state.stats(per_tensor=True)["per_tensor"]
        from gradzip.frontends.ddp import settings_report

        out[hierarchy] = {"grads": grads, "ratio": min(per[n]["ratio"] for n in ("0.weight", "2.weight")),
                          "topology": state.comm.describe_topology(),
                          "report": settings_report(state.comm, state.config)}
        state.close()
    return out


def test_powersgd_stays_flat_across_nodes_and_compresses():
    # the node stage's flat shares cannot be factorised: PowerSGD once sent them as they were
    res = _run(_powersgd_on_nodes, 4, 2)
    for r in res:
        auto, off = r["auto"], r["off"]
        assert auto["ratio"] > 10 and off["ratio"] > 10
        assert not auto["topology"]["hierarchical"] and "factorises" in auto["topology"]["flat_because"]
        # the settings logged at registration say that the job's nodes exchange flat, and why
        row = next(line for line in auto["report"].splitlines() if line.split()[0] == "exchange")
        assert "flat across 2 nodes" in row and "factorises" in row, row
        for step_auto, step_off in zip(auto["grads"], off["grads"]):
            assert torch.equal(step_auto[0], step_off[0]) and torch.equal(step_auto[2], step_off[2])  # the weights
        assert all(torch.equal(a, b) for a, b in zip(r["auto"]["grads"][-1], res[0]["auto"]["grads"][-1]))


def _powersgd_hierarchy_on(rank: int, world: int) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = gradzip.Communicator("powersgd", rank=2, hierarchy="on")
        flat = not comm.describe_topology()["hierarchical"]
        comm.close()
    return [flat, [str(w.message) for w in caught]]


def test_powersgd_with_hierarchy_on_says_its_factors_stay_flat():
    for flat, messages in _run(_powersgd_hierarchy_on, 4, 2):
        assert flat and any("hierarchy='on'" in m and "stays flat" in m for m in messages), messages


def _trained(rank: int, outputs: int, steps: int, **settings):
    """A two-layer model under DDP and gradzip (``settings``), trained ``steps`` steps on this rank's data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, outputs))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = gradzip.register(ddp, "maxmin", bits=4, memory="residual", **settings)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(16, 128, generator=g)).square().mean().backward()
        opt.step()
    return model, state


def _planned(rank: int, world: int) -> dict:
    model, state = _trained(rank, 8, 3, plan="auto")
    plan = state.plan()
    exact = gradzip.Communicator("maxmin", bits=4, memory="none")  # nothing would keep a 16-bit stage's rounding
    without_memory = planner.candidate_routes(exact)
    exact.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "routes": sorted(plan["costs"]["routes"]),
            "costs": plan["costs"], "from": state.comm.plain_hierarchy_from, "without_memory": without_memory}


def test_the_planner_times_the_flat_exchange_beside_the_hierarchical_one():
    res = _run(_planned, 4, 2)
    # measured on this layout, chosen where cheaper: across two nodes the all-gather is the
    # default, flat over the four ranks the SRA
    assert {"sra:hierarchy=0", "allgather:node=bf16"} <= set(res[0]["routes"])
    assert "sra:hierarchy=0" in res[0]["without_memory"] and "allgather:node=bf16" not in res[0]["without_memory"]
    costs = res[0]["costs"]  # both link classes calibrated on the real groups, and the plain exchange both ways
    assert set(costs["links"]) == {"intra-node", "inter-node"}
    assert costs["links"]["inter-node"]["s_per_value"] > 0 and costs["plain_hierarchical_s_per_value"] > 0
    assert res[0]["from"] == costs["plain_hierarchy_from"]  # what the engine applies
    for r in res[1:]:
        assert r["routes"] == res[0]["routes"] and r["costs"] == costs and r["from"] == res[0]["from"]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], res[0]["params"]))


def _adaptive(rank: int, world: int) -> dict:
    """Adaptive levels on two nodes: the level of the slow (compressed) stage, per layer, from measured errors."""
    model, state = _trained(rank, 256, 6, adaptive="bytes", adaptive_every=2, min_numel=1000)
    plan = state.plan()
    return {"params": [p.detach().clone() for p in model.parameters()], "levels": plan.get("levels"),
            "topology": plan["topology"], "routes": {n: state.comm.collective_for(n).name for n in ("0.weight", "2.weight")}}


def test_adaptive_levels_choose_the_slow_stages_level_per_layer_on_two_nodes():
    res = _run(_adaptive, 4, 2)
    levels = res[0]["levels"]
    assert levels is not None and levels["plans"] >= 1 and levels["option"] == "bits"  # planned from measured errors
    assert set(levels["per_parameter"]) == {"0.weight", "2.weight"}
    assert res[0]["topology"]["hierarchical"] and set(res[0]["routes"].values()) == {"hierarchical"}
    for r in res[1:]:
        assert r["levels"]["per_parameter"] == levels["per_parameter"] and r["routes"] == res[0]["routes"]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], res[0]["params"]))


def _wholly_plain(rank: int, world: int, planned: bool) -> dict:
    """DDP steps that compress nothing: plain exchanges through the nodes where the planner's lines
    say so (``planned``), else all flat."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1200))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)  # buckets: [2.*] (1.2 MB), [0.*]
    state = gradzip.register(ddp, "maxmin", bits=4, min_numel=10**9)  # nothing large enough to compress
    if planned:  # lines by which the hierarchy pays from 100,000 values: the small bucket stays DDP's flat sum
        costs = planner.Costs(planner.Line(0.0, 1e-8), planner.Line(0.0, 1e-8), world_size=world,
                              plain_hierarchical=planner.Line(4e-4, 0.5e-8))
        state.apply(state.decisions, costs)
        start = costs.plain_hierarchy_from
        assert state.comm.plain_hierarchy_from == start and 99_000 < start < 101_000
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        if step == 1:  # DDP's buckets as rebuilt after the first step
            state.comm.metrics.reset()
        opt.zero_grad()
        ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
    stats = state.stats(per_tensor=True)["per_tensor"]
    return {"params": [p.detach().clone() for p in model.parameters()], "sent": {k: v["sent_bytes"] for k, v in stats.items()}}


def test_steps_that_compress_nothing_take_the_hierarchical_plain_exchange_and_stay_identical():
    res = _run(_wholly_plain, 4, 2, True)
    flat = _run(_wholly_plain, 4, 2, False)
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], res[0]["params"]))
    for a, b in zip(res[0]["params"], flat[0]["params"]):  # exact sums both ways, in another order
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    sent = res[0]["sent"]  # bytes over the slow link per byte: 1/2 hierarchically, 2(W-1)/W = 1.5 flat
    assert sent["2.weight"] == pytest.approx(0.5 * 256 * 1200 * 4 * 2) and sent["0.weight"] == pytest.approx(1.5 * 64 * 256 * 4 * 2)
    assert flat[0]["sent"]["2.weight"] == pytest.approx(1.5 * 256 * 1200 * 4 * 2)


def _plain_exchanges(rank: int, world: int) -> dict:
    """Plain (uncompressed) exchanges flat and hierarchically, and one with a NaN on rank 3."""
    comm = gradzip.Communicator("maxmin", bits=4)
    out = {}
    for label, start in (("flat", None), ("hier", 0)):
        comm.plain_hierarchy_from = start
        comm.metrics.reset()
        xs = [_values(rank, 3001, 1), _values(rank, 5000, 2)]  # one plain, one compressed, side by side
        avgs = comm.reduce_many_now(xs, ["plain", "packed"], [False, True])
        out[label] = {"avg": avgs[0].clone(), "sent": comm.stats(per_tensor=True)["per_tensor"]["plain"]["sent_bytes"],
                      "coll": type(comm.plain_collective(xs[0])).__name__}
    x = _values(rank, 777, 3)
    if rank == 3:
        x[7] = float("inf")
    out["inf"] = comm.reduce_many_now([x], ["odd"], [False])[0]
    comm.close()
    return out


def test_plain_exchanges_go_through_the_nodes_exactly_when_planned():
    res = _run(_plain_exchanges, 4, 2)
    exact = torch.stack([_values(r, 3001, 1).double() for r in range(4)]).mean(0)
    for r in res:
        assert (r["flat"]["coll"], r["hier"]["coll"]) == ("AllReduce", "Hierarchical")
        assert torch.equal(r["hier"]["avg"], res[0]["hier"]["avg"])  # the same bytes on every rank
        torch.testing.assert_close(r["hier"]["avg"].double(), exact, rtol=0, atol=1e-6)  # summed exactly
        # a rank sends 1/L of the values across nodes, once reduced and once gathered: half of flat's 2(W-1)/W
        assert r["hier"]["sent"] < 0.7 * r["flat"]["sent"]
        assert torch.isinf(r["inf"][7]) and torch.isfinite(r["inf"][:7]).all()  # sums carry Inf, as DDP's do


def _in_flight(rank: int, world: int) -> dict:
    """Three groups in flight at once (lockstep stages): each must get buffers every rank of the node maps."""
    from gradzip.sync.pipeline import drive

    comm = gradzip.Communicator("maxmin", bits=8)
    assert comm.collective.shared is not None
    out = []
    for step in range(3):
        xs = [_values(rank, n, 10 * step + k) for k, n in enumerate([3000, 5000, 7000])]
        avgs = drive(comm.reduce_many_stages(xs, ["a", "b", "c"], [True] * 3, groups=[[0], [1], [2]], step=step))
        out.append([a.clone() for a in avgs])
    tag = comm._node_memory.tag
    comm.close()
    return {"avgs": out, "tag": tag}


def test_groups_in_flight_together_share_their_nodes_memory_and_leave_no_file():
    res = _run(_in_flight, 4, 2)
    for step in range(3):
        for k, n in enumerate([3000, 5000, 7000]):
            exact = torch.stack([_values(r, n, 10 * step + k) for r in range(4)]).mean(0)
            got = [r["avgs"][step][k] for r in res]
            assert all(torch.equal(g, got[0]) for g in got)
            assert (got[0] - exact).abs().max().item() < 4 * exact.abs().max().item() / 255
    leftovers = [f for f in os.listdir("/dev/shm") for r in res if r["tag"] in f]
    assert leftovers == []
