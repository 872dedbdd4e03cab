"""The accuracy benchmark: a run end to end on 2 ranks, and its pieces on synthetic data.

The end-to-end run is small (the two default tasks, fp32 and maxmin4, one seed, 16 steps) but its
assertions can fail: the held-out loss must fall from its initial value, the replicas must stay
bit-identical, and the bytes must add up. The helpers that decide time-to-target and flag
replicas that drifted apart are checked on curves and tensors made up for the purpose.
"""
from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from gradzip.tools import cli
from gradzip.bench import accuracy as A
from ..dist_utils import run_workers

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


ADAPTIVE = "maxmin:bits=4:memory=residual:adaptive=bytes:adaptive_every=4"


def _is_png(path: pathlib.Path) -> bool:
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(150)
def test_both_tasks_end_to_end_on_two_ranks(tmp_path, capsys):
    path = tmp_path / "acc.json"
    rc = cli.main([
        "bench", "accuracy", "--workers", "2", "--steps", "16", "--eval-every", "8", "--seeds", "1",
        "--configs", f"fp32,maxmin4,{ADAPTIVE}", "--rate", "loopback", "--json", str(path),
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "identical" in printed and "charlm" in printed and "digits" in printed
    assert _is_png(tmp_path / "acc.png")  # the plot goes next to the JSON
    report = json.loads(path.read_text())
    assert report["tasks"] == ["digits", "charlm"] and report["configs"] == ["fp32", "maxmin4", ADAPTIVE]
    assert report["steps"] == {"digits": 16, "charlm": 16} and report["seeds"] == [0]
    assert report["emulated"] is False and report["network"] == "loopback"
    assert len(report["runs"]) == 6
    for task in ("digits", "charlm"):
        res = report["results"][task]
        assert res["baseline"] == "fp32"
        rows = {r["config"]: r for r in res["rows"]}
        assert list(rows) == ["fp32", "maxmin4", ADAPTIVE]
        for r in rows.values():
            # training helped: the held-out loss fell well below where it started
            assert r["final_loss"]["mean"] < 0.8 * r["initial_loss"]["mean"]
            assert r["identical"] is True and r["max_replica_diff"] == 0.0
            assert r["curve"]["step"] == [0, 8, 16]
            sent = r["curve"]["sent_bytes_mean"]
            assert sent[0] == 0 and 0 < sent[1] < sent[2]
            times = r["curve"]["time_s_mean"]
            assert times[0] == 0 and 0 < times[1] < times[2] == pytest.approx(r["train_s"]["mean"])
            b = r["bytes_per_step"]
            assert 0 < b["wire_per_step_compressed"] <= b["wire_per_step"] <= b["raw_per_step"]
            # two ranks: every collective sends 2(W−1)/W = 1 payload per rank
            assert b["sent_per_step"] == pytest.approx(b["wire_per_step"], rel=1e-6)
            assert sent[2] == pytest.approx(16 * b["sent_per_step"], rel=1e-6)
        fp32, mm = rows["fp32"], rows["maxmin4"]
        assert fp32["bytes_per_step"]["wire_per_step"] == fp32["bytes_per_step"]["raw_per_step"]
        assert mm["bytes_per_step"]["raw_per_step"] == fp32["bytes_per_step"]["raw_per_step"]
        # 4-bit: the compressed tensors shrink about 7-8×, all tensors still well over 4×
        assert mm["bytes_per_step"]["wire_per_step_compressed"] < fp32["bytes_per_step"]["wire_per_step_compressed"] / 6
        assert mm["bytes_per_step"]["wire_per_step"] < fp32["bytes_per_step"]["wire_per_step"] / 4
        assert mm["bytes_per_step"]["memory"] == "residual" and mm["bytes_per_step"]["params_compressed"] >= 3
        # the baseline reaches its own final loss at the latest at its last evaluation
        assert fp32["reached"] == 1 and fp32["time_to_target_s"]["mean"] <= fp32["train_s"]["mean"] + 1e-9
        assert mm["delta_vs_baseline"]["mean"] == pytest.approx(mm["final_loss"]["mean"] - fp32["final_loss"]["mean"])
        assert abs(mm["delta_vs_baseline"]["mean"]) < 0.1 * fp32["final_loss"]["mean"]
        # adaptive levels: planned 4 times in 16 steps, the same plan on both ranks (else the replicas
        # differ, checked above), fewer bytes than uniform 4-bit and no loss of accuracy beyond noise
        ad = rows[ADAPTIVE]
        levels = [run["levels"] for run in report["runs"] if run["task"] == task and run["config"] == ADAPTIVE]
        assert levels[0]["option"] == "bits" and levels[0]["uniform"] == 4 and levels[0]["plans"] == 4
        assert sum(levels[0]["count"].values()) == ad["bytes_per_step"]["params_compressed"]
        assert levels[0]["bytes"] <= levels[0]["uniform_bytes"], levels
        assert levels[0]["error"] <= levels[0]["uniform_error"] * (1 + 1e-9), levels
        assert ad["bytes_per_step"]["wire_per_step_compressed"] <= mm["bytes_per_step"]["wire_per_step_compressed"]
        assert abs(ad["final_loss"]["mean"] - mm["final_loss"]["mean"]) < 0.05 * fp32["final_loss"]["mean"]
    digits = {r["config"]: r for r in report["results"]["digits"]["rows"]}
    assert digits["fp32"]["final_accuracy"]["mean"] > 50.0  # 10 classes: chance is 10%
    lm = {r["config"]: r for r in report["results"]["charlm"]["rows"]}
    assert lm["fp32"]["final_bits_per_char"]["mean"] == pytest.approx(lm["fp32"]["final_loss"]["mean"] / math.log(2))
    assert report["about"]["charlm"]["vocab"] > 90 and report["about"]["charlm"]["params"] > 200_000


def test_time_to_target_on_a_synthetic_curve():
    curve = [
        {"step": 0, "time_s": 0.0, "loss": 3.0},
        {"step": 10, "time_s": 1.5, "loss": 2.0},
        {"step": 20, "time_s": 3.0, "loss": float("nan")},
        {"step": 30, "time_s": 4.5, "loss": 1.2},
        {"step": 40, "time_s": 6.0, "loss": 1.0},
        {"step": 50, "time_s": 7.5, "loss": 1.1},
    ]
    assert A.time_to_target(curve, 2.5) == (1.5, 10)  # the first point at or below the target
    assert A.time_to_target(curve, 2.0) == (1.5, 10)  # reaching it exactly counts
    assert A.time_to_target(curve, 1.1) == (6.0, 40)  # the NaN point never counts
    assert A.time_to_target(curve, 0.9) == (None, None)
    assert A.time_to_target(curve, None) == (None, None)  # the baseline itself diverged
    assert A.time_to_target(curve, float("nan")) == (None, None)


def _run(task, config, seed, losses, identical=True, every=10, per_step=100.0):
    curve = [{"step": i * every, "time_s": i * 1.0, "loss": loss, "sent_bytes": i * every * per_step}
             for i, loss in enumerate(losses)]
    return {
        "task": task, "config": config, "label": config, "seed": seed, "steps": every * (len(losses) - 1),
        "train_s": curve[-1]["time_s"], "curve": curve, "final_loss": losses[-1], "initial_loss": losses[0],
        "final_accuracy": None, "final_bits_per_char": losses[-1] / math.log(2),
        "bytes": {"raw_per_step": 400.0, "wire_per_step": per_step, "sent_per_step": per_step,
                  "raw_per_step_compressed": 300.0, "wire_per_step_compressed": 0.75 * per_step,
                  "ratio": 400.0 / per_step, "collective": "allreduce", "memory": "none",
                  "params_compressed": 1, "params_uncompressed": 1},
        "replicas": {"identical": identical, "differing_ranks": [] if identical else [1],
                     "max_abs_diff": 0.0 if identical else 0.5},
        "identical": identical,
    }


def test_summary_over_seeds_pairs_each_seed_with_its_baseline_and_flags_drifted_replicas(capsys):
    runs = [
        _run("charlm", "fp32", 0, [4.0, 3.0, 2.0]),
        _run("charlm", "fp32", 1, [4.0, 3.2, 2.2]),
        _run("charlm", "codec", 0, [4.0, 1.95, 1.9], per_step=20.0),  # beats seed 0's target 2.0 at step 10
        _run("charlm", "codec", 1, [4.0, 3.5, 2.3], per_step=20.0, identical=False),  # misses 2.2
    ]
    res = A.summarize(runs, ["charlm"], ["fp32", "codec"])["charlm"]
    assert res["baseline"] == "fp32" and res["targets"] == {0: 2.0, 1: 2.2}
    fp32, codec = res["rows"]
    assert fp32["final_loss"]["mean"] == pytest.approx(2.1) and fp32["final_loss"]["min"] == 2.0
    assert fp32["final_loss"]["max"] == 2.2 and fp32["final_loss"]["std"] == pytest.approx(math.sqrt(0.02))
    assert fp32["delta_vs_baseline"] is None and fp32["reached"] == 2
    assert codec["delta_vs_baseline"]["mean"] == pytest.approx(0.0)  # -0.1 and +0.1, seed by seed
    assert codec["reached"] == 1 and codec["time_to_target_s"]["mean"] == 1.0
    assert codec["identical"] is False and codec["max_replica_diff"] == 0.5
    assert codec["bytes_per_step"]["wire_per_step"] == 20.0
    assert codec["curve"]["loss_min"] == [4.0, 1.95, 1.9] and codec["curve"]["loss_max"] == [4.0, 3.5, 2.3]
    assert runs[3]["time_to_target_s"] is None and runs[2]["steps_to_target"] == 10
    # with 10% of slack the second seed reaches 2.42 at step 20
    slack = A.summarize(runs, ["charlm"], ["fp32", "codec"], tolerance=0.1)["charlm"]["rows"][1]
    assert slack["reached"] == 2

    report = {
        "results": {"charlm": res}, "seeds": [0, 1], "workers": 2, "steps": {"charlm": 20},
        "eval_every": {"charlm": 10}, "network": "loopback", "cores": 2, "loadavg": [0.5, 0.7], "tolerance": 0.0,
    }
    assert A.all_identical(report) is False
    text = "\n".join(str(line) for line in A.markdown(report).splitlines())
    assert "| charlm | `codec` |" in text and "NO (max diff 0.5)" in text and "1.0 (1/2)" in text
    assert "yes" in text.splitlines()[2]  # the fp32 row


def test_replica_check_flags_a_rank_that_drifted():
    a = torch.linspace(-1, 1, 1000)
    assert A.replica_check([a, a.clone(), a.clone()]) == {"identical": True, "differing_ranks": [], "max_abs_diff": 0.0}
    b = a.clone()
    b[123] = torch.nextafter(b[123], torch.tensor(2.0))  # one bit of one value
    out = A.replica_check([a, a.clone(), b])
    assert out["identical"] is False and out["differing_ranks"] == [2] and 0 < out["max_abs_diff"] < 1e-6
    nan = torch.full((4,), float("nan"))
    assert A.replica_check([nan, nan.clone()])["identical"] is True  # diverged together: still identical bits
    half = nan.clone()
    half[0] = 0.0
    out = A.replica_check([nan, half])
    assert out["identical"] is False and out["max_abs_diff"] == math.inf
    assert A.replica_check([a, a[:10]])["identical"] is False


def _drift_worker(rank: int, world: int):
    model = torch.nn.Linear(8, 4)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
        if rank == 1:
            model.bias[2] += 1e-3  # this replica no longer matches
    return A.replicas(model)


@pytest.mark.timeout(60)
def test_replicas_across_ranks_reports_the_drifted_rank():
    out = run_workers(_drift_worker, 2)
    assert out[0] == out[1]  # every rank reaches the same verdict
    assert out[0]["identical"] is False and out[0]["differing_ranks"] == [1]
    assert out[0]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)


def test_a_run_with_drifted_replicas_fails_the_command(monkeypatch, capsys):
    runs = [_run("digits", "fp32", 0, [2.0, 1.0]), _run("digits", "maxmin4", 0, [2.0, 1.1], identical=False)]
    report = {
        "results": A.summarize(runs, ["digits"], ["fp32", "maxmin4"]), "seeds": [0], "workers": 2,
        "steps": {"digits": 10}, "eval_every": {"digits": 10}, "network": "loopback", "cores": 2,
        "loadavg": [None, None], "tolerance": 0.0, "fallback": None, "wall_s": 1.0,
    }
    monkeypatch.setattr(A, "run_accuracy", lambda *a, **k: report)
    assert cli.main(["bench", "accuracy", "--rate", "loopback"]) == 1
    out = capsys.readouterr().out
    assert "replicas differ" in out and "digits maxmin4" in out and "NO (max diff 0.5)" in out


def test_configs_route_spec_keys_to_register_codec_and_optimizer():
    r = A.resolve("maxmin:bits=2:memory=residual:min_numel=64:opt.lr=0.01:opt.momentum=0")
    assert r["kind"] == "gradzip" and r["codec"] == "maxmin"
    assert r["register"] == {"bits": 2, "memory": "residual", "min_numel": 64}
    assert r["optimizer"] == {"lr": 0.01, "momentum": 0.0}
    assert A.resolve("fp32")["kind"] == "fp32"
    assert A.resolve("maxmin4")["register"] == {"bits": 4, "memory": "residual"}
    assert A.resolve("signsgd")["optimizer"]["lr"] == 0.002  # the demo's setting for sign methods
    assert A.resolve("torch-fp16")["hook"] == "fp16_compress_hook"
    for bad in ("nosuchcodec", "maxmin:bitz=2", "maxmin:bits", "torch-powersgd"):
        with pytest.raises(ValueError):
            A.resolve(bad)
    with pytest.raises(SystemExit):
        cli.main(["bench", "accuracy", "--tasks", "digits,imagenet"])


def test_tasks_hold_out_fixed_data_and_models_carry_no_buffers():
    lm = A.CharLM()
    data = lm.load()
    held = data["heldout"].shape[0] * lm.context
    assert 0.04 < held / data["chars"] < 0.06  # every 20th block of 2,048 characters
    assert data["train"].numel() + held <= data["chars"]
    assert data["heldout"].shape[1] == lm.context + 1
    again = lm.load()
    assert torch.equal(again["heldout"], data["heldout"])  # fixed, whatever the seed
    model = lm.model(0, data)
    assert list(model.buffers()) == []  # DDP would broadcast buffers at every forward
    big = [n for n, p in model.named_parameters() if p.dim() > 1 and p.numel() >= 1024]
    assert len(big) >= 8 and 200_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    x, y = lm.batch_of(data, step=3, seed=1, rank=1, world=4)
    assert x.shape == y.shape == (lm.batch // 4, lm.context) and torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = lm.batch_of(data, step=3, seed=1, rank=1, world=4)
    assert torch.equal(x, x2)  # the same batches for every config
    assert not torch.equal(x, lm.batch_of(data, step=3, seed=2, rank=1, world=4)[0])
    assert torch.equal(lm.model(0, data).head.weight, model.head.weight)  # same init for a seed


def test_the_wide_digits_task_is_communication_bound_by_size_alone():
    wide, narrow = A.TASKS["digits-wide"](), A.TASKS["digits"]()
    assert wide.name == "digits-wide" and wide.steps == narrow.steps and wide.batch == narrow.batch
    n_wide = sum(p.numel() for p in wide.model(0, {}).parameters())
    n_narrow = sum(p.numel() for p in narrow.model(0, {}).parameters())
    assert n_wide > 4_000_000 and n_wide > 10 * n_narrow  # 17 MB of fp32 gradients a step
    assert "64-2048-2048-10" in wide.about({"x_tr": torch.zeros(3, 64), "x_te": torch.zeros(2, 64)})["model"]
    with pytest.raises(ValueError, match="choose from: digits, charlm, digits-wide"):
        A.run_accuracy(tasks=["digits-huge"])


@pytest.mark.timeout(150)
def test_fsdp_front_end_trains_sharded_with_its_own_rows(tmp_path):
    path = tmp_path / "acc.json"
    configs = "fp32,bf16-reduce,maxmin4,maxmin:bits=4:memory=residual:weight_bits=8"
    rc = cli.main([
        "bench", "accuracy", "--frontend", "fsdp", "--tasks", "digits", "--workers", "2", "--steps", "16",
        "--eval-every", "8", "--seeds", "1", "--configs", configs, "--rate", "loopback", "--json", str(path),
    ])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["frontend"] == "fsdp"
    rows = {r["config"]: r for r in report["results"]["digits"]["rows"]}
    assert list(rows) == configs.split(",")
    raw = rows["fp32"]["bytes_per_step"]["raw_per_step"]
    for r in rows.values():
        assert r["final_loss"]["mean"] < 0.8 * r["initial_loss"]["mean"] and r["identical"] is True
        assert abs(r["final_loss"]["mean"] - rows["fp32"]["final_loss"]["mean"]) < 0.1 * rows["fp32"]["final_loss"]["mean"]
        assert r["bytes_per_step"]["raw_per_step"] == raw
        # a reduce-scatter on two ranks sends half of one encoding
        assert r["bytes_per_step"]["sent_per_step"] == pytest.approx(r["bytes_per_step"]["wire_per_step"] / 2, rel=1e-6)
    assert rows["bf16-reduce"]["bytes_per_step"]["wire_per_step"] == raw / 2
    assert rows["maxmin4"]["bytes_per_step"]["wire_per_step"] < raw / 6


@pytest.mark.parametrize("config, frontend, message", [
    ("bf16-reduce", "ddp", "fsdp front end"),
    ("torch-fp16", "fsdp", "DDP communication hook"),
    ("powersgd", "fsdp", "cannot compress FSDP2's reduce-scatter"),
    ("maxmin:bits=4:fusion=off", "fsdp", "only apply to DDP"),
    ("maxmin:bits=4:weight_bits=8", "ddp", "weight all-gather"),
    ("maxmin4", "zero", "ddp, fsdp"),
])
def test_a_config_the_front_end_cannot_run_is_refused_before_any_rank_starts(config, frontend, message):
    with pytest.raises(ValueError, match=message):
        A.resolve(config, frontend)
