"""``gradzip bench memory``: peak resident memory per method, beside fp32 DDP, in real processes."""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from gradzip.bench import memory as MEM
from gradzip.bench import models as M
from gradzip.tools import cli

needs_proc = pytest.mark.skipif(MEM.available() is not None, reason=f"{MEM.available()}")


def _wide_shapes(layers: int) -> list:
    return [(f"layer{i}.weight", (1024, 2048)) for i in range(layers)]


def _wide() -> M.ModelSpec:
    # few large matrices: the buffers of a method stand out from the interpreter's own noise
    return M.ModelSpec("wide", "four 1024x2048 matrices", "test", partial(_wide_shapes, 4))


def _check_report(report: dict, configs: list, workers: int) -> None:
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == configs and report["gradient_bytes"] == 4 * 1024 * 2048 * 4
    fp32 = rows["fp32"]
    assert fp32["over_fp32_x"] == 0 and len(fp32["added_bytes"]) == workers
    # DDP holds the gradients and its buckets: at least one gradient size, far below ten
    assert 1.0 <= fp32["added_x"] < 10
    plain, ef = rows["maxmin:bits=4"], rows["maxmin:bits=4:memory=residual"]
    # the residual is one fp32 copy of the compressed gradients, kept from step to step
    assert ef["over_fp32_x"] - plain["over_fp32_x"] > 0.8
    # the warm-up steps' own peak: from before the first step too, the residual already in it
    assert fp32["first_steps_over_fp32_x"] == 0 and len(fp32["first_steps_bytes"]) == workers
    assert 1.0 <= fp32["first_steps_x"] < 10
    assert ef["first_steps_over_fp32_x"] - plain["first_steps_over_fp32_x"] > 0.8
    assert "wide" in str(MEM.table(report).title)


@needs_proc
@pytest.mark.timeout(180)
def test_error_feedback_adds_its_residual_and_fp32_is_the_reference(tmp_path):
    path = tmp_path / "memory.json"
    configs = ["fp32", "maxmin:bits=4", "maxmin:bits=4:memory=residual"]
    report = MEM.run_memory(_wide(), configs, workers=2, steps=2, json_path=str(path))
    assert report["device"] == "cpu" and report["measure"] == "peak resident"
    assert json.loads(path.read_text()) == report
    _check_report(report, configs, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [1, 2], ids=["nccl", "gloo-sharing"])
def test_on_a_gpu_the_memory_is_what_the_allocator_hands_out(workers):
    """The same measurement on the GPU (one rank over NCCL, two sharing the GPU over gloo): the
    caching allocator's peak of allocated bytes; error feedback adds its residual there too."""
    configs = ["fp32", "maxmin:bits=4", "maxmin:bits=4:memory=residual"]
    report = MEM.run_memory(_wide(), configs, workers=workers, steps=2, device="cuda")
    assert report["device"] == "cuda:0" and report["measure"] == "peak allocated on the GPU"
    _check_report(report, configs, workers)


def test_cli_checks_its_arguments_before_starting_anything(capsys):
    for argv, message in [(["--model", "nope"], "nope"), (["--configs", "maxmin:in_place=1"], "in_place"),
                          (["--workers", "0"], "positive")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "memory", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "memory"])
    assert args.model == "resnet50" and args.workers == 2 and args.configs[0] == "fp32" and args.device == "cpu"
    bad = [("tpu", "cpu or cuda")] + ([] if torch.cuda.is_available() else [("cuda", "no CUDA device")])
    for device, message in bad:  # a device this machine cannot measure on: said before anything starts
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "memory", "--device", device])
        assert message in str(exc.value.code)
        with pytest.raises(ValueError, match=message):
            MEM.run_memory(_wide(), ["fp32"], device=device)
