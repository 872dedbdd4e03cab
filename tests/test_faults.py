"""Faults as users meet them, on real gloo ranks: a stalled rank, a dead rank, ranks configured
differently, another rank's checkpoint, and a job killed and restarted by ``torchrun``."""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.comm.launch import spawn_local

from .dist_utils import run_workers

WORLD = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 10))


def _step(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _failure(exc: BaseException, start: float) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------- stalled / dead rank
STALL_S = 12.0  # well past the 3 s timeout and its slack (see the assertion below)


def _stall(marks: str, healthy: int) -> None:
    """Stall for ``STALL_S``, or until the ``healthy`` ranks have all raised (each leaves a mark in
    ``marks``): they must raise while this rank stalls, and need not wait for the rest of it."""
    end = time.monotonic() + STALL_S
    while time.monotonic() < end and len(os.listdir(marks)) < healthy:
        time.sleep(0.05)


def _raised(marks: str, rank: int) -> None:
    open(os.path.join(marks, f"rank{rank}"), "w").close()


def _stalled_rank(rank: int, world: int, fault: str, dense: bool = False, marks: str = "") -> dict:
    ddp = DDP(_model(), bucket_cap_mb=0.01)  # several buckets in flight
    # dense: warm-up steps, sent by DDP's own kind of all-reduce, not through the worker
    state = gradzip.register(ddp, "maxmin", bits=4, min_numel=64, warmup=10 if dense else 0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for step in range(6):
            if step == 2 and rank == 1:
                if fault == "dead":
                    os._exit(0)  # gone without a word: its sockets close
                _stall(marks, world - 1)
            start = time.monotonic()
            _step(ddp, opt, rank, step)
        return {"type": None}
    except Exception as exc:
        failure = _failure(exc, start)
        _raised(marks, rank)
        try:  # a loop that catches it and goes on to the next batch
            _step(ddp, opt, rank, 6)
            failure["next"] = None
        except Exception as again:
            failure["next"] = {"type": type(again).__name__, "message": str(again)}
        return failure
    finally:
        if fault == "stall" and rank != 1:
            time.sleep(0.5)  # let the stalled rank find its peers gone rather than waiting its own timeout


@pytest.mark.parametrize("fault,dense", [("stall", False), ("dead", False), ("stall", True)])
def test_a_stalled_or_dead_rank_makes_every_other_rank_raise_within_the_timeout(fault, dense, tmp_path):
    """Every healthy rank raises :class:`CommunicationError` naming the step and bucket within
    the timeout; a loop that catches it and tries the next batch gets it again at once."""
    timeout = 3.0
    results = spawn_local(
        _stalled_rank, WORLD, fault, dense, str(tmp_path), all_ranks=True, timeout_s=timeout, missing_ok=True, deadline_s=90,
    )
    healthy = [r for i, r in enumerate(results) if i != 1]
    for res in healthy:
        assert res["type"] == "CommunicationError", res
        assert "step 2" in res["message"] and "bucket" in res["message"], res["message"]
        # raised within the process group's timeout (plus scheduling slack on a busy machine),
        # not after the stalled rank woke up
        assert res["seconds"] < timeout + 6 < STALL_S, res
        if fault == "stall":
            assert "timeout of 3 s" in res["message"], res["message"]
        # the next step raises at its forward, naming the failure (not DDP's internal assertion
        # about a backward that never ended)
        again = res["next"]
        assert again is not None and again["type"] == "CommunicationError", again
        assert "earlier exchange failed (step 2, bucket" in again["message"], again["message"]
        assert "restart it from a checkpoint" in again["message"], again["message"]
    if fault == "dead":
        assert results[1] is None


# --------------------------------------------------------------------------- mismatched settings
MISMATCHES = [
    # (what rank 1 does differently, the field the error must name)
    ({"codec": "fp16"}, {"codec": "bf16"}, "codec"),
    ({"codec": "maxmin", "collective": "sra"}, {"codec": "qsgd", "collective": "sra"}, "codec"),
    ({"codec": "maxmin", "bits": 4}, {"codec": "maxmin", "env": {"GRADZIP_BITS": "2"}}, "codec.bits"),
    ({"codec": "maxmin", "bucket_size": 512}, {"codec": "maxmin", "bucket_size": 1024}, "codec.bucket_size"),
    ({"codec": "topk", "ratio": 0.01}, {"codec": "topk", "ratio": 0.02}, "codec.ratio"),
    ({"codec": "maxmin", "min_numel": 64}, {"codec": "maxmin", "min_numel": 128}, "min_numel"),
    ({"codec": "powersgd", "rank": 2}, {"codec": "powersgd", "rank": 4}, "codec.rank"),
    ({"codec": "topk"}, {"codec": "maxmin"}, "codec"),
    ({"codec": "maxmin", "collective": "sra"}, {"codec": "maxmin", "collective": "allgather"}, "collective"),
    ({"codec": "topk", "memory": "residual"}, {"codec": "topk", "memory": "none"}, "memory"),
]


def _mismatched(rank: int, world: int) -> list:
    out = []
    for common, odd, _ in MISMATCHES:
        opts = dict(odd if rank == 1 else common)
        env = opts.pop("env", {})
        os.environ.update(env)
        try:
            ddp = DDP(_model())
            state = gradzip.register(ddp, **opts)
            state.close()
            out.append({"type": None})
        except Exception as exc:
            out.append({"type": type(exc).__name__, "message": str(exc), "value_error": isinstance(exc, ValueError)})
        finally:
            for key in env:
                os.environ.pop(key)
    return out


def test_ranks_with_different_settings_all_raise_naming_field_values_ranks_and_variable():
    results = run_workers(_mismatched, WORLD)
    for i, (_, odd, field) in enumerate(MISMATCHES):
        for rank in range(WORLD):
            res = results[rank][i]
            assert res["type"] == "SettingsMismatchError" and res["value_error"], (i, rank, res)
            lines = [line.strip() for line in res["message"].splitlines()]
            line = next((x for x in lines if x.startswith(f"{field}: ")), None)
            assert line is not None, (field, res["message"])
            assert "on ranks 0, 2" in line and "on rank 1" in line, line
        if "env" in odd:
            assert "from GRADZIP_BITS=2" in results[0][i]["message"]


def _one_rank_invalid(rank: int, world: int) -> dict:
    if rank == 1:
        os.environ["GRADZIP_RATIO"] = "0.01"  # left over from a top-k run, on one host only
    start = time.monotonic()
    try:
        gradzip.register(DDP(_model()), "maxmin", bits=4)
        return {"type": None}
    except Exception as exc:
        return _failure(exc, start)


def test_an_invalid_option_on_one_rank_is_reported_on_every_rank_at_once():
    results = run_workers(_one_rank_invalid, WORLD)  # a process group timeout of 120 s
    assert results[1]["type"] == "ValueError" and "GRADZIP_RATIO=0.01" in results[1]["message"], results[1]
    for rank in (0, 2):
        res = results[rank]
        assert res["type"] == "SettingsMismatchError", res
        assert "unknown option(s) ratio" in res["message"] and "on rank 1" in res["message"], res["message"]
        # the cause first, not buried among the settings the failed rank could not send
        assert res["message"].startswith("gradzip: rank 1 could not build its communicator"), res["message"]
        assert res["seconds"] < 30, res  # told at once, not after the 120 s timeout


def _registered_on_one_rank(rank: int, world: int, late_s: Optional[float], shared: bool = False) -> dict:
    """Rank 1 registers ``late_s`` seconds after rank 0 (None: never, as under ``if rank == 0:``);
    ``shared``: rank 0 builds a Communicator on the default group instead, so it waits in the
    settings check, where gloo raises its own RuntimeError, not in making a group."""
    from gradzip.comm import consistency

    consistency.WAIT_WARNING_S = 0.5
    said = io.StringIO()
    logging.getLogger("gradzip").addHandler(logging.StreamHandler(said))
    ddp = DDP(_model())
    if rank == 1:
        time.sleep(6.0 if late_s is None else late_s)
        if late_s is None:
            return {"type": None}
    start = time.monotonic()
    try:
        if shared:
            gradzip.Communicator("maxmin", bits=4, dedicated_group=False).close()
        else:
            gradzip.register(ddp, "maxmin", bits=4).close()
        return {"type": None, "said": said.getvalue()}
    except Exception as exc:
        return dict(_failure(exc, start), said=said.getvalue())


@pytest.mark.parametrize("late_s,shared", [(None, False), (1.5, False), (None, True)],
                         ids=["never", "late", "never-shared-group"])
def test_a_rank_that_registers_alone_is_told_why_it_waits(late_s, shared):
    """A rank whose peers do not register (``gradzip.register`` under ``if rank == 0:``) says,
    after a while, what it waits for and the likely cause, and fails at the process group's
    timeout with a CommunicationError saying the same (not the store's own timeout error, 30
    minutes on by default); a peer that is only late is waited for, with the same word."""
    results = spawn_local(_registered_on_one_rank, 2, late_s, shared, all_ranks=True, timeout_s=3.0, deadline_s=60)
    first = results[0]
    assert "rank 0 has waited 0.5 s for the other ranks" in first["said"] and "if rank == 0:" in first["said"], first
    if late_s is None:
        assert first["type"] == "CommunicationError", first
        assert "process group's timeout (3 s)" in first["message"] and "if rank == 0:" in first["message"], first
        assert first["seconds"] < 3 + 6, first
    else:
        assert first["type"] is None and results[1]["type"] is None, results


def test_same_settings_register_without_complaint():
    assert run_workers(_same_settings, 2) == [True, True]


def _same_settings(rank: int, world: int) -> bool:
    state = gradzip.register(DDP(_model()), "maxmin", bits=4)
    state.close()
    return True


# --------------------------------------------------------------------------- checkpoints
def _checkpoints(rank: int, world: int) -> dict:
    ddp = DDP(_model(), bucket_cap_mb=0.01)
    state = gradzip.register(ddp, "topk", ratio=0.05, min_numel=64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        _step(ddp, opt, rank, step)
    own = state.state_dict()
    everyone = [None] * world
    dist.all_gather_object(everyone, own)
    out = {"own": own, "residuals": sorted(own["memory"]["residuals"])}
    try:  # the mistake: rank 0's state loaded on every rank
        state.load_state_dict(everyone[0])
        out["rank0_state"] = None
    except Exception as exc:
        out["rank0_state"] = (type(exc).__name__, str(exc))
    state.load_state_dict(own)  # its own: fine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.load_state_dict(everyone[0], strict=False)
    out["warned"] = [str(w.message) for w in caught]
    out["after_lenient"] = {k: len(v) for k, v in state.comm.memory.state_dict().items()}
    other = gradzip.register(DDP(_model()), "topk", ratio=0.02, min_numel=64)
    try:
        other.load_state_dict(own)
        out["other_config"] = None
    except Exception as exc:
        out["other_config"] = (type(exc).__name__, str(exc))
    state.close()
    other.close()
    return out


def test_checkpoints_know_whose_they_are():
    results = run_workers(_checkpoints, 2)
    for rank, res in enumerate(results):
        assert res["own"]["rank"] == rank and res["own"]["world_size"] == 2
        assert res["residuals"], "top-k with error feedback keeps residuals"
        if rank == 0:
            assert res["rank0_state"] is None and res["warned"] == []
            assert res["after_lenient"]["residuals"] > 0  # its own rank: kept
        else:
            kind, message = res["rank0_state"]
            assert kind == "CheckpointError" and "rank 0's state, this is rank 1" in message, message
            assert res["after_lenient"]["residuals"] == 0  # another rank's residuals: dropped
            assert any("dropped: " in w and "error-feedback memory" in w for w in res["warned"]), res["warned"]
        kind, message = res["other_config"]
        assert kind == "CheckpointError" and "codec.ratio" in message and "0.05" in message, message
    # the same state in a job of another world size (here: a single process)
    comm = gradzip.Communicator("topk", ratio=0.05, memory="residual")
    comm._extra = {"min_numel": 64, "compress_1d": False}
    with pytest.raises(gradzip.CheckpointError, match="world size 2, this job has 1"):
        comm.load_state_dict(results[0]["own"])
    with pytest.raises(gradzip.CheckpointError, match="no owner information"):
        comm.load_state_dict({"codec": {}, "memory": {}, "steps": {}})


# --------------------------------------------------------------------------- kill and resume
RESUME_JOB = Path(__file__).with_name("resume_job.py")


def _torchrun(outdir: Path, kill_at: int, steps: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.2", str(RESUME_JOB), str(outdir), str(kill_at), str(steps),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADZIP_")}
    # torchrun shares its rendezvous store with the job by default, and a restarted gloo job may
    # then read the dead attempt's addresses (pytorch/pytorch#135712): give the job its own store
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_killed_and_restarted_job_ends_where_the_uninterrupted_one_does(tmp_path):
    from .resume_job import train

    steps, kill_at = 8, 4
    # the killed job under torchrun --max-restarts 1; the uninterrupted one, the same job on two
    # gloo ranks that never fail, runs meanwhile
    proc = _torchrun(tmp_path / "killed", kill_at, steps)
    try:
        straight = run_workers(train, 2, tmp_path / "straight", -1, steps)[0]
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    killed = torch.load(tmp_path / "killed" / "final.pt")
    assert killed["restarts"] == 1 and straight["restarts"] == 0
    assert killed["resumed_from"] == kill_at - 1
    for name in ("ddp", "maxmin", "topk", "qsgd", "maxmin-ps"):
        moved = (straight[name] - straight["start"]).abs().max()
        assert moved > 0, name
    ddp_gap = (straight["ddp"] - killed["ddp"]).abs().max()
    for name in ("maxmin", "topk", "qsgd", "maxmin-ps"):  # stochastic + residuals; residuals; stochastic
        gap = (straight[name] - killed[name]).abs().max()
        assert gap <= ddp_gap, (name, float(gap), float(ddp_gap))


# --------------------------------------------------------------------------- several nodes
# One torchrun per emulated node (network namespaces, a shaped link between them), as on real
# machines; gradzip finds the two nodes by itself and exchanges hierarchically.
def _cluster(prefix: str):
    from gradzip.bench import cluster

    reason = cluster.available()
    if reason is not None:
        pytest.skip(f"no emulated cluster here: {reason}")
    return cluster.EmulatedCluster(2, "1gbit", prefix=prefix, ranks_per_node=2)


def _node_dies(rank: int, world: int, fault: str, marks: str) -> dict:
    ddp = DDP(_model(), bucket_cap_mb=0.01)
    state = gradzip.register(ddp, "maxmin", bits=4, min_numel=64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    start = time.monotonic()
    node = int(os.environ["GROUP_RANK"])
    try:
        for step in range(6):
            if step == 2 and node == 1:  # the whole second node
                if fault == "dead":
                    os._exit(0)
                _stall(marks, 2)  # until both ranks of node 0 have raised
            start = time.monotonic()
            _step(ddp, opt, rank, step)
        return {"type": None, "hierarchical": state.plan()["topology"]["hierarchical"]}
    except Exception as exc:
        failure = _failure(exc, start) | {"node": node}
        if node == 0:
            _raised(marks, rank)
        return failure
    finally:
        if fault == "stall" and node != 1:
            time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["dead", "stall"])
def test_a_node_that_dies_or_stalls_ends_the_step_on_every_other_node_within_the_timeout(fault, tmp_path):
    timeout = 3.0
    with _cluster(f"gzfault{fault}") as c:
        results = spawn_local(
            _node_dies, 4, fault, str(tmp_path), cluster=c, all_ranks=True, timeout_s=timeout, missing_ok=True, deadline_s=120,
        )
    healthy = [r for r in results if r is not None and r.get("node") == 0]
    assert len(healthy) == 2, results
    for res in healthy:
        assert res["type"] == "CommunicationError", res
        assert "step 2" in res["message"], res["message"]
        assert res["seconds"] < timeout + 6 < STALL_S, res


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_two_nodes_a_killed_rank_restarts_every_node_and_the_job_ends_where_it_would_have(tmp_path):
    from .resume_job import train

    steps, kill_at = 6, 3
    with _cluster("gzresume") as c:
        straight = spawn_local(train, 4, tmp_path / "straight", -1, steps, 3, cluster=c, max_restarts=1)
        killed = spawn_local(train, 4, tmp_path / "killed", kill_at, steps, 3, cluster=c, max_restarts=1)
    assert straight["restarts"] == 0 and killed["restarts"] == 1  # torchrun restarted node 0 too
    assert killed["resumed_from"] == kill_at - 1
    assert all(t["hierarchical"] for t in killed["plans"].values()), killed["plans"]
    ddp_gap = (straight["ddp"] - killed["ddp"]).abs().max()
    for name in ("maxmin", "topk", "qsgd"):
        assert (straight[name] - straight["start"]).abs().max() > 0, name
        gap = (straight[name] - killed[name]).abs().max()
        assert gap <= ddp_gap, (name, float(gap), float(ddp_gap))
