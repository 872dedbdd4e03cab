"""gradzip.register on FSDP2 (fully_shard) models, on real gloo ranks."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gradzip

from ..dist_utils import run_workers

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not hasattr(fsdp.FSDPModule, "set_custom_reduce_scatter"):
    pytest.skip("this torch has no FSDP2 custom reduce-scatter", allow_module_level=True)

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _shard(model: nn.Module, **kw) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp.fully_shard(layer, **kw)
    return fsdp.fully_shard(model, **kw)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _compare(rank: int, world: int, codec: str, opts: dict, factor=None) -> dict:
    """Default FSDP2 and FSDP2 with gradzip, one backward on the same batch; ``factor``: a
    gradient divide factor on gradzip's side only (FSDP then asks for PREMUL_SUM, which gloo
    itself cannot do)."""
    plain, zipped = _shard(_model()), _shard(_model())
    state = gradzip.register(zipped, codec, min_numel=64, **opts)
    if factor is not None:
        for unit in zipped.modules():
            if isinstance(unit, fsdp.FSDPModule):
                unit.set_gradient_divide_factor(factor)
    x, y = _batch(rank, 0)
    for m in (plain, zipped):
        nn.functional.cross_entropy(m(x), y).backward()
    stats = state.stats()
    state.close()
    return {"plain": _grads(plain), "zipped": _grads(zipped), "stats": stats}


@pytest.mark.parametrize("factor", [None, 4.0])
def test_a_lossless_codec_gives_fsdps_own_gradients_whatever_the_divide_factor(factor):
    results = run_workers(_compare, WORLD, "none", {}, factor)
    scale = 1.0 if factor is None else WORLD / factor  # the default divides the sum by the world size
    for res in results:
        torch.testing.assert_close(res["zipped"], res["plain"] * scale)
        assert res["stats"]["compressed_calls"] >= 2 and res["stats"]["units"] == 3


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(rank: int, world: int, codec: str, opts: dict, steps: int) -> dict:
    model = _shard(_model())
    log, logger = _Lines(), logging.getLogger("gradzip")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    state = gradzip.register(model, codec, min_numel=64, **opts) if codec else None
    logger.removeHandler(log)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step % 4)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    full = _full(model)
    everyone = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(everyone, full)
    out = {"losses": losses, "identical": all(torch.equal(full, e) for e in everyone), "log": log.lines}
    if state is not None:
        out["stats"] = state.stats()
        out["state"] = state.state_dict()
        state.close()
    return out


def test_four_bit_max_min_with_error_feedback_trains_like_fsdp():
    steps = 30
    base = run_workers(_train, WORLD, None, {}, steps)
    zipped = run_workers(_train, WORLD, "maxmin", {"bits": 4, "memory": "residual"}, steps)
    for b, z in zip(base, zipped):
        assert z["identical"]
        assert z["losses"][-1] < z["losses"][0] - 0.1 and b["losses"][-1] < b["losses"][0] - 0.1
        assert abs(z["losses"][-1] - b["losses"][-1]) < 0.1 * b["losses"][-1] + 0.05
        assert z["stats"]["wire_bytes"] > 0 and z["state"]["parameter_residuals"]
    # the settings logged name the collective FSDP2 runs, as stats() does, not the engine's default
    report = next(m for m in zipped[0]["log"] if "effective settings" in m)
    rows = {line.split()[0]: line.split()[1:] for line in report.splitlines()[1:] if line.strip()}
    assert rows["collective"] == ["'reducescatter'", "front", "end"], report
    assert zipped[0]["stats"]["collective"] == "reducescatter"
    assert not any(key.startswith("collective.") for key in rows), report


def _twice():
    model = _shard(_model())
    state = gradzip.register(model, "maxmin")
    try:
        return gradzip.register(model, "maxmin")
    finally:
        state.close()
        gradzip.register(model, "maxmin").close()  # once closed, it may be registered anew


def _bad(rank: int, world: int) -> dict:
    out = {}
    for name, call in (
        ("twice", _twice),
        ("powersgd", lambda: gradzip.register(_shard(_model()), "powersgd")),
        ("plan", lambda: gradzip.register(_shard(_model()), "maxmin", plan="auto")),
        ("config", lambda: gradzip.register(_shard(_model()), config=gradzip.Config(codec="maxmin", warmup=3))),
        ("module", lambda: gradzip.register(_model(), "maxmin")),
        ("bits", lambda: gradzip.register(_shard(_model()), "maxmin", weight_bits=12)),
        ("float bits", lambda: gradzip.register(_shard(_model()), "maxmin", weight_bits=4.0)),
        ("ddp", lambda: gradzip.register(nn.parallel.DistributedDataParallel(_model()), "maxmin", weight_bits=8)),
    ):
        try:
            call().close()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_bad_input_is_named_at_register():
    for res in run_workers(_bad, WORLD):
        assert "cannot compress a sharded reduce-scatter" in res["powersgd"] and "maxmin" in res["powersgd"]
        assert "plan is not supported on an FSDP2 model" in res["plan"]
        assert "warmup is not supported on an FSDP2 model (set by config)" in res["config"]
        assert "DistributedDataParallel model or an FSDP2 module" in res["module"]
        assert "weight_bits must be an integer in 2..8" in res["bits"]
        assert "weight_bits must be an integer in 2..8, got 4.0" in res["float bits"]
        assert "a DDP model has none" in res["ddp"]
        assert "registered on this FSDP2 model already" in res["twice"]


def _weights(rank: int, world: int, bits: int) -> dict:
    ref, zipped = _shard(_model()), _shard(_model())
    state = gradzip.register(zipped, "maxmin", bits=4, weight_bits=bits, min_numel=64)
    x, _ = _batch(0, 0)  # the same input on every rank
    with torch.no_grad():
        a, b = ref(x), zipped(x)
    everyone = [torch.empty_like(b) for _ in range(world)]
    dist.all_gather(everyone, b)
    out = {"gap": float((a - b).abs().max()), "scale": float(a.abs().max()),
           "same": all(torch.equal(b, e) for e in everyone), "gathers": state.stats()["weight_gathers"]}
    state.close()
    return out


def test_quantised_weight_all_gather_gives_every_rank_the_same_weights():
    for res in run_workers(_weights, WORLD, 8):
        assert res["same"] and res["gathers"] >= 3
        assert 0 < res["gap"] < 0.05 * res["scale"], res  # quantised, and close


def test_eight_bit_weights_and_four_bit_gradients_train_like_fsdp():
    steps = 30
    base = run_workers(_train, WORLD, None, {}, steps)
    zipped = run_workers(_train, WORLD, "maxmin", {"bits": 4, "memory": "residual", "weight_bits": 8}, steps)
    for b, z in zip(base, zipped):
        assert z["identical"] and z["stats"]["weight_gathers"] > 0
        assert abs(z["losses"][-1] - b["losses"][-1]) < 0.1 * b["losses"][-1] + 0.05


def _mixed(rank: int, world: int, memory: str) -> dict:
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    plain, zipped = _shard(_model(), mp_policy=policy), _shard(_model(), mp_policy=policy)
    state = gradzip.register(zipped, "maxmin", bits=8, memory=memory, min_numel=64)
    for m in (plain, zipped):
        for step in range(2):  # accumulate two micro-batches, reduce once
            m.set_requires_gradient_sync(step == 1)
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(m(x).float(), y).backward()
    out = {"plain": _grads(plain), "zipped": _grads(zipped), "calls": state.stats()["compressed_calls"]}
    state.close()
    return out


@pytest.mark.parametrize("memory", ["none", "residual"])
def test_bf16_reduce_and_gradient_accumulation_go_through_gradzip(memory):
    for res in run_workers(_mixed, WORLD, memory):
        assert res["zipped"].dtype == res["plain"].dtype == torch.float32  # FSDP casts back
        assert res["calls"] == 3  # one reduce-scatter per unit, on the synced micro-batch only
        scale = res["plain"].abs().max()
        assert (res["zipped"] - res["plain"]).abs().max() < 0.02 * scale


def _train_on_nodes(rank: int, world: int, hierarchy: str, steps: int) -> dict:
    out = _train(rank, world, "maxmin", {"bits": 4, "memory": "residual", "hierarchy": hierarchy}, steps)
    return out


def _plan_on_nodes(rank: int, world: int) -> dict:
    model = _shard(_model())
    state = gradzip.register(model, "maxmin", bits=4, min_numel=64)
    x, y = _batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    plan = state.plan()
    state.close()
    return plan


def test_on_two_nodes_fsdp_reduce_scatters_hierarchically_and_trains_like_flat():
    def run(fn, *args):
        return run_workers(fn, 4, *args, ranks_per_node=2)

    plan = run(_plan_on_nodes)[0]
    assert plan["front_end"] == "fsdp2" and set(plan["units"].values()) == {"compressed"}
    assert [(s["stage"], s["link"], s["values"]) for s in plan["topology"]["stages"]] == [
        ("reduce-scatter", "intra-node", "plain"), ("reduce-scatter", "inter-node", "compressed"),
    ]
    steps = 30
    hier, flat = run(_train_on_nodes, "auto", steps), run(_train_on_nodes, "off", steps)
    for h, f in zip(hier, flat):
        assert h["identical"] and f["identical"]
        assert h["losses"][-1] < h["losses"][0] - 0.1
        assert abs(h["losses"][-1] - f["losses"][-1]) < 0.1 * f["losses"][-1] + 0.05
    # a rank sends (N-1)/N of an encoding of 1/L of its input, against (W-1)/W of all of it: 1/3 here
    assert hier[0]["stats"]["sent_bytes"] < 0.4 * flat[0]["stats"]["sent_bytes"]


# ----------------------------------------------------------- residuals by parameter name
def test_pack_and_unpack_follow_fsdps_own_chunk_layout():
    from gradzip.frontends.fsdp import pack, padding_of, unpack

    w = 3
    grads = [torch.randn(7, 5), torch.randn(4), torch.randn(3, 2, 2)]  # dim 0 not a multiple of w
    sizes = [tuple(g.shape) for g in grads]
    rows = [-(-s[0] // w) * int(torch.tensor(s[1:]).prod()) if len(s) > 1 else -(-s[0] // w) for s in sizes]
    flat = torch.full((w * sum(rows),), float("nan"))
    torch._chunk_cat(grads, 0, w, out=flat.view(w, -1))  # what FSDP2 hands its reduce-scatter
    layout = (w, tuple((f"p{i}", s, k) for i, (s, k) in enumerate(zip(sizes, rows))))
    back = unpack(flat, layout)
    for i, g in enumerate(grads):
        assert torch.equal(back[f"p{i}"], g)
    again = pack(back, layout, torch.device("cpu"))
    torch.testing.assert_close(again, torch.nan_to_num(flat, nan=0.0), rtol=0, atol=0)  # padding zero
    partial = pack({"p1": grads[1]}, layout, torch.device("cpu"))
    assert torch.equal(unpack(partial, layout)["p1"], grads[1]) and torch.count_nonzero(unpack(partial, layout)["p0"]) == 0
    # the padding's places: where FSDP2's layout of gradients of ones holds no one
    ones = torch.full_like(flat, float("nan"))
    torch._chunk_cat([torch.ones_like(g) for g in grads], 0, w, out=ones.view(w, -1))
    assert sorted(padding_of(layout).tolist()) == torch.nonzero(ones != 1).flatten().tolist() != []


class _Branches(nn.Module):
    """One unit whose ``b`` is used on even steps only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(h + self.b(x) if use_b else h)


def _unused(rank: int, world: int) -> dict:
    model = fsdp.fully_shard(_Branches())
    state = gradzip.register(model, "maxmin", bits=2, memory="residual", min_numel=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    saved = []
    for step in range(3):
        x, _ = _batch(rank, step)
        opt.zero_grad()
        model(x, step % 2 == 0).square().mean().backward()
        opt.step()
        saved.append(state.state_dict())
    state.close()
    return {"saved": saved, "shapes": {n: tuple(p.shape) for n, p in _Branches().named_parameters()}}


def test_an_unused_parameter_keeps_its_residual_and_checkpoints_hold_residuals_by_parameter():
    for res in run_workers(_unused, WORLD):
        s0, s1, s2 = (s["parameter_residuals"] for s in res["saved"])
        assert {k: tuple(v.shape) for k, v in s0.items()} == res["shapes"]  # every parameter, in its own shape
        assert all(not s["memory"]["residuals"] for s in res["saved"])  # none left by unit
        assert torch.equal(s1["b.weight"], s0["b.weight"]) and torch.count_nonzero(s0["b.weight"]) > 0  # b unused: kept
        assert not torch.equal(s1["a.weight"], s0["a.weight"])  # a was reduced again, with its residual
        assert not torch.equal(s2["b.weight"], s1["b.weight"])  # b back: its residual went into the exchange


def _resume(rank: int, world: int, saved: list, strict: bool) -> dict:
    model = _shard(_model())
    state = gradzip.register(model, "maxmin", bits=4, memory="residual", min_numel=64)
    out: dict = {}
    try:
        with __import__("warnings").catch_warnings(record=True) as caught:
            __import__("warnings").simplefilter("always")
            state.load_state_dict(saved[rank] if rank < len(saved) else saved[0], strict=strict)
        out["warned"] = [str(w.message) for w in caught]
        out["parked"] = sorted(state.parked)
        x, y = _batch(rank, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        out["after"] = state.state_dict()["parameter_residuals"]
    except Exception as exc:  # noqa: BLE001 - the test reads the error
        out["error"] = f"{type(exc).__name__}: {exc}"
    state.close()
    return out


def test_residuals_by_parameter_load_on_another_world_size_only_when_asked():
    saved = [r["state"] for r in run_workers(_train, WORLD, "maxmin", {"bits": 4, "memory": "residual"}, 3)]
    names = {n for n, _ in _model().named_parameters()}
    assert all(set(s["parameter_residuals"]) == names for s in saved)
    strict = run_workers(_resume, 3, saved, True)
    assert all("CheckpointError" in r["error"] and "world size 2" in r["error"] for r in strict)
    loose = run_workers(_resume, 3, saved, False)
    for rank, r in enumerate(loose):
        assert "error" not in r, r.get("error")
        if rank < WORLD:  # the ranks of an index that was saved carry its residuals over, and say so
            assert r["parked"] == sorted(names) and any("carried over" in w for w in r["warned"])
        else:
            assert r["parked"] == []
        assert set(r["after"]) == names  # every unit reduced, its residual by parameter again


def _hsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plain, zipped = _shard(_model(), mesh=mesh), _shard(_model(), mesh=mesh)
    state = gradzip.register(zipped, "maxmin", bits=8, min_numel=64)
    x, y = _batch(rank, 0)
    for m in (plain, zipped):
        nn.functional.cross_entropy(m(x), y).backward()
    out = {"plain": _grads(plain), "zipped": _grads(zipped), "stats": state.stats()}
    state.close()
    return out


def test_hybrid_sharding_compresses_the_shard_groups_reduce_scatter():
    # HSDP (2 replicas × 2 shards): gradzip's reduce-scatter runs on each 2-rank shard group,
    # FSDP2's own all-reduce across the replicas stays as it is
    for res in run_workers(_hsdp, 4):
        assert res["stats"]["world_size"] == 2 and res["stats"]["compressed_calls"] >= 2
        scale = res["plain"].abs().max()
        assert 0 < (res["zipped"] - res["plain"]).abs().max() < 0.02 * scale


def _padded_model() -> nn.Module:
    """Its last layer's 5 rows do not divide by 2 ranks: FSDP2 pads them to 6."""
    torch.manual_seed(0)
    return fsdp.fully_shard(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 5)))


def _padded_steps(model: nn.Module, rank: int, steps: range) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        x, _ = _batch(rank, step)
        nn.functional.cross_entropy(model(x), torch.arange(16) % 5).backward()
        opt.step()
        opt.zero_grad()


def _padded_resume(rank: int, world: int, codec: str, opts: dict) -> dict:
    from torch.distributed.tensor import distribute_tensor

    from gradzip.frontends.fsdp import padding_of

    straight = _padded_model()
    state = gradzip.register(straight, codec, min_numel=16, **opts)
    _padded_steps(straight, rank, range(1))
    handler = state.units["root"]
    residual = state.comm.memory.residuals["root"]
    padding = residual[padding_of(handler.layout)]
    _padded_steps(straight, rank, range(1, 8))
    state.close()
    first = _padded_model()
    state = gradzip.register(first, codec, min_numel=16, **opts)
    _padded_steps(first, rank, range(4))
    params = {n: p.full_tensor().detach().clone() for n, p in first.named_parameters()}
    saved = state.state_dict()
    state.close()
    resumed = _padded_model()
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(distribute_tensor(params[n], p.device_mesh, p.placements))
    state = gradzip.register(resumed, codec, min_numel=16, **opts)
    state.load_state_dict(saved)
    _padded_steps(resumed, rank, range(4, 8))
    state.close()
    return {"padding": padding, "residual": residual.abs().max(), "straight": _full(straight), "resumed": _full(resumed)}


@pytest.mark.parametrize("codec, opts", [("maxmin", {"bits": 2, "memory": "residual"}), ("efsignsgd", {})])
def test_a_run_resumed_with_padded_shards_goes_on_bit_for_bit(codec, opts):
    """FSDP2's padding rows hold no gradient: what the codec made of them is not kept as
    residual (it was, up to the largest residual's size, and a checkpoint, which holds residuals
    by parameter, lost it, so a resumed run drifted from the uninterrupted one by 1e-3)."""
    for r in run_workers(_padded_resume, WORLD, codec, opts):
        assert r["residual"] > 0 and torch.count_nonzero(r["padding"]) == 0
        assert torch.equal(r["straight"], r["resumed"]), float((r["straight"] - r["resumed"]).abs().max())


def _closed(rank: int, world: int, weight_bits) -> dict:
    model = _shard(_model())
    state = gradzip.register(model, "maxmin", bits=2, memory="residual", min_numel=64, weight_bits=weight_bits)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    state.close()
    groups = [g for m in model.modules() if isinstance(m, fsdp.FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
    watched = sum("post_backward" in g.__dict__ for g in groups)  # (gradzip's watcher is an attribute of the group)
    plain = _shard(_model())
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters()):
            p.copy_(q)
    x, y = _batch(rank, 5)
    for m in (plain, model):  # the closed model reduces as plain FSDP2 does
        nn.functional.cross_entropy(m(x), y).backward()
    out = {"same": torch.equal(_grads(plain), _grads(model)), "kinds": sorted({type(p).__name__ for p in model.parameters()}),
           "watched": watched, "groups": len(groups)}
    again = gradzip.register(model, "maxmin", bits=4, min_numel=64)  # and it takes another register
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    out["compressed"] = again.stats()["compressed_calls"]
    again.close()
    return out


@pytest.mark.parametrize("weight_bits", [None, 8])
def test_close_gives_every_unit_fsdps_own_reduce_scatter_back(weight_bits):
    """After ``close`` the model trains on as plain FSDP2, its gradients bit for bit (a backward
    raised "this Communicator has been closed" and left the parameters unsharded), with FSDP2's
    own weight all-gather back where gradzip's quantised one was, nothing of gradzip left on
    its param groups, and it may be registered again."""
    for r in run_workers(_closed, WORLD, weight_bits):
        assert r["same"] and r["kinds"] == ["DTensor"] and r["compressed"] > 0, r
        assert r["groups"] > 0 and r["watched"] == 0, r
