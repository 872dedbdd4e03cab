"""The real-model benchmark: exact parameter sets of published models, and a run end to end.

The parameter counts are the published ones (torchvision's model cards; the Hugging Face
configurations' checkpoints), so a shape generator that drifts from its architecture fails here.
"""
from __future__ import annotations

import json
import os
import pathlib
from functools import partial

import pytest
import torch
import torch.distributed as dist

import gradzip
from gradzip.tools import cli
from gradzip.bench import models as M
from ..dist_utils import run_workers

# published parameter counts and tensor counts of the reference implementations
PUBLISHED = {
    "resnet50": (25_557_032, 161),  # torchvision resnet50
    "resnet18": (11_689_512, 62),  # torchvision resnet18
    "bert-base": (109_482_240, 199),  # bert-base-uncased, BertModel with pooler
    "gpt2": (124_439_808, 148),  # gpt2, lm_head tied to wte
    "vit-b16": (86_567_656, 152),  # torchvision vit_b_16, 1000-class head
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_are_the_published_ones(name):
    shapes = M.MODELS[name].shapes()
    total, tensors = PUBLISHED[name]
    assert M.numel(shapes) == total == M.MODELS[name].published
    assert len(shapes) == tensors
    assert len({n for n, _ in shapes}) == len(shapes)  # no name twice


def test_shapes_follow_the_reference_definitions():
    resnet = dict(M.resnet50_shapes())
    assert resnet["conv1.weight"] == (64, 3, 7, 7)
    assert resnet["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
    assert resnet["layer2.0.conv2.weight"] == (128, 128, 3, 3)  # stride on the 3x3 (v1.5)
    assert resnet["fc.weight"] == (1000, 2048)
    assert sum(1 for n in resnet if n.endswith("conv1.weight") or ".conv" in n or "downsample.0" in n) == 53
    bert = M.bert_shapes()
    assert bert[0] == ("embeddings.word_embeddings.weight", (30522, 768))
    assert bert[-1] == ("pooler.dense.bias", (768,))
    assert dict(bert)["encoder.layer.11.intermediate.dense.weight"] == (3072, 768)
    gpt2 = M.gpt2_shapes()
    assert gpt2[:2] == [("transformer.wte.weight", (50257, 768)), ("transformer.wpe.weight", (1024, 768))]
    assert dict(gpt2)["transformer.h.0.attn.c_attn.weight"] == (768, 2304)  # Conv1D: (in, out)
    assert not any(n.startswith("lm_head") for n, _ in gpt2)  # tied to wte: one tensor
    vit = M.vit_shapes()
    assert vit[0] == ("class_token", (1, 1, 768))  # the module's own parameter comes first
    assert dict(vit)["encoder.pos_embedding"] == (1, 197, 768)
    assert vit[-2] == ("heads.head.weight", (1000, 768))


def test_commonly_quoted_totals_differ_by_what_they_leave_out():
    # BERT-base's "110M" is with the pooler; without it 590,592 fewer
    assert M.numel(M.bert_shapes(pooler=False)) == 109_482_240 - 768 * 768 - 768
    # GPT-2 with an untied output layer would count wte twice
    assert M.numel(M.gpt2_shapes()) + 50257 * 768 == 163_037_184
    # ViT-B/16 without its classification head (as pre-trained, before fine-tuning a head)
    assert M.numel(M.vit_shapes()) - (768 * 1000 + 1000) == 85_798_656


def test_shape_model_holds_parameters_only_in_model_order_and_every_one_gets_a_gradient():
    shapes = M.bert_shapes(vocab=50, hidden=8, layers=2, intermediate=16, max_positions=4)
    model = M.ShapeModel(shapes)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == shapes
    assert list(model.buffers()) == []  # DDP would broadcast buffers at every forward
    x = torch.tensor(1.5)
    model(x).backward()
    for _, p in model.named_parameters():
        assert torch.allclose(p.grad, 1.5 * p.detach())  # d/dp x·½‖p‖² = x·p: dense, not constant


def test_resnet_builds_on_the_meta_device_and_runs_for_real():
    assert M.shapes_of(M.resnet50)[:3] == [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    net = M.resnet18(num_classes=10, width=8)
    out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)


def _rebuilt_bucket_order(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    model = M.ShapeModel([(f"layer{i}.weight", (64, 1024)) for i in range(40)])  # 256 KiB each
    ddp = DistributedDataParallel(model, init_sync=False, bucket_cap_mb=1)
    for _ in range(3):  # rebuilt at the start of the second backward, logged after it
        ddp(torch.tensor(1.0)).backward()
    return ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]


@pytest.mark.timeout(60)
def test_gradients_arrive_last_parameter_first_as_in_a_real_backward():
    order = run_workers(_rebuilt_bucket_order, 1)[0]
    flat = [int(i) for i in order.replace(",", " ").split()]
    assert flat == list(range(39, -1, -1))


def _tiny_bert() -> M.ModelSpec:
    return M.ModelSpec(
        "tiny-bert", "BERT, scaled down", "test",
        partial(M.bert_shapes, vocab=2000, hidden=64, layers=2, intermediate=256, max_positions=64),
    )


def _tiny_resnet() -> M.ModelSpec:
    return M.ModelSpec(
        "tiny-resnet", "ResNet-18, scaled down", "test", partial(M.shapes_of, partial(M.resnet18, 10, 8)),
        module=partial(M.resnet18, 10, 8), image=(2, 3, 32, 32), classes=10,
    )


def _is_png(path) -> bool:
    return os.path.getsize(path) > 8 and pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_model(model, methods, ranks, steps):
    assert model["compute_s"] > 0 and model["tensors"] > 0 and model["buckets"] >= 1
    assert model["compute_cpu_time_s"] > 0 and len(model["compute_cpu_s"]) == ranks
    rows = {r["method"]: r for r in model["rows"]}
    assert list(rows) == methods
    for r in rows.values():
        assert len(r["times_s"]) == steps and 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["steps_per_s"] == pytest.approx(1 / r["median_s"])
        assert r["wire_bytes"] > 0 and r["traffic_bytes"] > 0
        assert r["wire_limit_s"] is None  # loopback: no link rate
        assert len(r["codec_cpu_s"]) == ranks and len(r["cpu_s"]) == ranks
        assert r["cpu_time_s"] > 0  # every step does some CPU work, fp32 included
    assert rows["fp32"]["vs_fp32"] == 1.0 and rows["torch-fp16"]["vs_fp16"] == 1.0
    assert rows["fp32"]["wire_bytes"] == model["raw_bytes"] == 2 * rows["torch-fp16"]["wire_bytes"]
    assert rows["maxmin4"]["wire_bytes"] < rows["torch-fp16"]["wire_bytes"] / 3
    assert rows["fp32"]["codec_limit_s"] == 0 and rows["fp32"]["vs_limit"] is None
    for method in methods[1:]:
        r = rows[method]
        assert r["codec_limit_s"] > 0 and r["vs_limit"] == pytest.approx(r["median_s"] / r["codec_limit_s"])
    assert rows["maxmin4"]["register_s"] > 0 and "register_s" not in rows["fp32"]  # gradzip's set-up, timed
    measured = rows["maxmin4"]["measured_wire_bytes"]  # gradzip's own count, per step
    assert 0.5 * rows["maxmin4"]["wire_bytes"] < measured < 2 * rows["maxmin4"]["wire_bytes"]
    return rows


@pytest.mark.timeout(120)
def test_cli_end_to_end_on_loopback(tmp_path, monkeypatch, capsys):
    pytest.importorskip("rich")
    pytest.importorskip("matplotlib")
    monkeypatch.setitem(M.MODELS, "tiny-bert", _tiny_bert())  # a registered model, scaled down
    path = tmp_path / "out" / "models.json"
    rc = cli.main([
        "bench", "models", "--models", "tiny-bert", "--rate", "loopback", "--workers", "2", "--steps", "2",
        "--warmup", "1", "--json", str(path),
    ])
    assert rc == 0
    assert "maxmin4" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["network"] == "loopback" and report["fallback"] is None and report["workers"] == 2
    assert report["methods"] == M.BASELINES == ["fp32", "torch-fp16", "maxmin4"]
    (model,) = report["models"]
    assert model["model"] == "tiny-bert" and model["real_compute"] is False
    _check_model(model, report["methods"], ranks=2, steps=2)
    assert _is_png(tmp_path / "out" / "models.png")  # next to the JSON, same name
    assert report["round_trip_s"] > 0
    md = M.markdown(report).splitlines()
    assert len(md) == 2 + 1 + len(report["methods"]) and md[0].count("|") == md[-1].count("|")


EXTRA = "topk:ratio=0.05"
DENSE = "maxmin:bits=4:warmup=100"  # in warm-up for all its steps


@pytest.fixture(scope="module")
def tiny_resnet_report():
    """One run of the real model for the two tests below: the baselines, then both their configs."""
    return M.run_models([_tiny_resnet()], configs=[EXTRA, DENSE], workers=2, rate=None, steps=1, warmup=1)


@pytest.mark.timeout(120)
def test_real_forward_backward_with_an_extra_config(tiny_resnet_report):
    report = tiny_resnet_report
    assert report["methods"] == ["fp32", "torch-fp16", "maxmin4", EXTRA, DENSE]
    (model,) = report["models"]
    assert model["real_compute"] is True and model["input"] == [2, 3, 32, 32]
    # every method but the one that compresses nothing (the next test's, which has no codec time)
    compressing = dict(model, rows=[r for r in model["rows"] if r["method"] != DENSE])
    rows = _check_model(compressing, report["methods"][:-1], ranks=2, steps=1)
    assert rows[EXTRA]["collective"] == "allgather"


def test_the_printed_table_has_a_row_for_every_method(tiny_resnet_report):
    """Five methods and the compute-only row: the model's name and sizes go down the first
    column, and no row is dropped once they are used up."""
    (model,) = tiny_resnet_report["models"]
    cells = M._cells(tiny_resnet_report)
    assert [row[1] for row in cells] == ["compute only (no DDP)"] + tiny_resnet_report["methods"]
    assert cells[0][0] == model["model"] and all(row[0] == "" for row in cells[4:])


@pytest.mark.timeout(120)
def test_a_method_that_compresses_nothing_is_measured_too(tiny_resnet_report):
    # in warm-up every bucket goes by a plain all-reduce issued from the hook: no codec time at all
    (model,) = tiny_resnet_report["models"]
    dense = {r["method"]: r for r in model["rows"]}[DENSE]
    assert dense["codec_cpu_s"] == [0.0, 0.0]
    assert dense["measured_wire_bytes"] == pytest.approx(model["raw_bytes"])
    assert dense["wire_bytes"] == model["raw_bytes"] and dense["compressed_tensors"] == 0  # the table's too


@pytest.mark.parametrize("argv, message", [
    (["--models", "resnet50,nope"], "nope"),
    (["--configs", "torch-powersgd"], "hangs"),
    (["--configs", "maxmin:bits=99"], "bits"),
    (["--rate", "fast"], "loopback"),
    (["--steps", "0"], "positive"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "models", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_parses_models_configs_and_loopback():
    args = cli.build_parser().parse_args(
        ["bench", "models", "--models", "gpt2,resnet50,gpt2", "--rate", "loopback", "--configs", "maxmin2,maxmin:bits=8"]
    )
    assert args.models == ["gpt2", "resnet50"] and args.rate is None
    assert args.configs == ["maxmin2", "maxmin:bits=8"]
    defaults = cli.build_parser().parse_args(["bench", "models"])
    assert defaults.models == M.DEFAULT_MODELS and defaults.rate == "1gbit" and defaults.workers == 4


def test_collective_options_in_a_spec_go_to_the_collective():
    method = M.resolve("maxmin:bits=4:collective=ps:partitions=8")
    assert method["options"] == {"bits": 4, "collective": "ps", "collective_options": {"partitions": 8}}
    with pytest.raises(ValueError, match="collective 'ps': partitions must be a positive integer"):
        gradzip.Communicator("maxmin", **method["options"] | {"collective_options": {"partitions": 0}})


@pytest.mark.timeout(180)
def test_nodes_of_several_ranks_exchange_hierarchically_and_count_the_node_link(tmp_path):
    flat = "maxmin:bits=4:hierarchy=off"
    report = M.run_models([_tiny_resnet()], configs=[flat], workers=4, rate=None, steps=1, warmup=1, ranks_per_node=2)
    assert report["ranks_per_node"] == 2
    (model,) = report["models"]
    rows = {r["method"]: r for r in model["rows"]}
    # the same payload; the node's link carries one compressed copy of each group, not L
    assert rows["maxmin4"]["wire_bytes"] == rows[flat]["wire_bytes"]
    assert rows["maxmin4"]["traffic_bytes"] < rows[flat]["traffic_bytes"]
    with pytest.raises(ValueError, match="multiple of ranks_per_node"):
        M.run_models([_tiny_resnet()], workers=3, rate=None, ranks_per_node=2)


def _planned_wire(rank: int, world: int) -> dict:
    """A planned ``auto`` row's bytes with every group left plain, and with one compressed."""
    from dataclasses import replace

    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    ddp = DistributedDataParallel(module)
    state = gradzip.register(ddp, "maxmin", bits=4, min_numel=64)
    ddp(torch.randn(4, 256)).sum().backward()  # a step, past the (empty) warm-up
    method = {"kind": "gradzip"}
    everything = M._wire(method, module, state, world)
    state.apply([replace(d, compress=False) for d in state.decisions], None)  # as a planner may decide
    nothing = M._wire(method, module, state, world)
    state.close()
    return {"everything": everything, "nothing": nothing, "raw": sum(p.numel() * 4 for p in module.parameters())}


def test_a_group_the_plan_leaves_plain_counts_its_raw_bytes():
    """The table's bytes for a planned method follow the plan: a group it leaves plain goes in
    the bucket's fp32 all-reduce (the row showed the codec's bytes for every eligible tensor)."""
    for res in run_workers(_planned_wire, 2):
        assert res["nothing"][0] == res["raw"]
        assert res["everything"][0] < res["raw"] / 3
