"""gradzip.frontends.recipes with real two-process jobs: Accelerate, the Hugging Face Trainer, Ray Train.

Each job (tests/recipes_job.py) trains a small MLP on CPU with gloo, launched the way users
launch it, and every rank writes its gradzip statistics and final parameters.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import List

import pytest
import torch
from torch import nn

import gradzip.frontends.recipes
from gradzip.comm.launch import free_port
from tests.jobs import run_job

JOB = str(Path(__file__).with_name("recipes_job.py"))


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _check(ranks: List[dict], steps: int) -> None:
    """Every rank compressed every step, and the replicas ended bit-identical."""
    for r in ranks:
        s = r["stats"]
        assert r["world_size"] == 2
        assert r["steps"] == steps and s["steps"] == steps, s
        assert s["codec"] == "maxmin" and s["params_compressed"] == 2 and s["params_uncompressed"] == 2, s
        assert 0 < s["wire_bytes"] < s["raw_bytes"] / 4, s  # 4 bits per value (+ scales) for the weights
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.skipif(
    not _installed("accelerate"), reason="accelerate is not installed (pip install gradzip[accelerate])"
)
def test_accelerate_two_processes(tmp_path):
    """``accelerate launch`` (torchrun underneath), ``Accelerator(cpu=True)`` and gradient
    accumulation of 2 over 8 batches: 4 exchanges, the other backwards stay local (no_sync).
    The model from before ``prepare()`` is refused, and a compiled DDP model is found."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), JOB, "accelerate", str(tmp_path)]
    ranks = run_job(cmd, tmp_path)
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert r["found"]  # through a torch.compile wrapper
        assert "needs the model that accelerator.prepare() returned" in r["refused"]
        assert "got Sequential with 2 processes" in r["refused"]
    _check(ranks, steps=4)


@pytest.mark.skipif(not _installed("transformers"), reason="transformers is not installed (pip install gradzip[hf])")
def test_hf_trainer_callback_two_processes(tmp_path):
    """``torchrun`` and ``Trainer(use_cpu=True)``: the callback finds ``trainer.model_wrapped``;
    ``train()`` twice (5 steps each) keeps the one registration."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           JOB, "trainer", str(tmp_path)]
    ranks = run_job(cmd, tmp_path)
    for r in ranks:
        assert r["wrapped"] == "DistributedDataParallel" and r["same_state"]
    _check(ranks, steps=10)


@pytest.mark.slow
@pytest.mark.skipif(not _installed("ray"), reason="ray is not installed (pip install gradzip[ray])")
def test_ray_train_two_workers(tmp_path):
    """A local Ray cluster of 2 CPUs, ``TorchTrainer`` with 2 workers and ``prepare_model``."""
    ranks = run_job([sys.executable, JOB, "ray", str(tmp_path)], tmp_path, RAY_USAGE_STATS_ENABLED="0")
    _check(ranks, steps=5)


def test_register_prepared_is_a_no_op_in_one_process():
    assert gradzip.frontends.recipes.register_prepared(nn.Linear(4, 4)) is None
