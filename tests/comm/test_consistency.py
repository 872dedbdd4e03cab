"""Settings every rank must share: their comparison, where they came from, their fingerprint, and
what a state dict of another rank or configuration may bring along."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.config import Config
from gradzip.comm.consistency import differences, fingerprint

from ..dist_utils import run_workers
from ..tensors import randn


def test_differences_name_field_values_ranks_and_source():
    settings = [{"codec": "maxmin", "codec.bits": 4}, {"codec": "maxmin", "codec.bits": 2}, {"codec": "maxmin", "codec.bits": 4}]
    sources = [{}, {"codec.bits": "GRADZIP_BITS=2"}, {}]
    assert differences(settings, sources) == ["codec.bits: 4 on ranks 0, 2; 2 on rank 1 (from GRADZIP_BITS=2)"]
    assert differences(settings[:1] * 3, [{}] * 3) == []
    # a setting only one rank has (another codec's option) counts as a difference too
    assert differences([{"codec.ratio": 0.1}, {}], [{}, {}]) == ["codec.ratio: 0.1 on rank 0; unset on rank 1"]
    # a setting left out where it holds its default is named by that default
    assert differences([{}, {}, {"hierarchy": "off"}], [{}, {}, {"hierarchy": "environment GRADZIP_HIERARCHY=off"}],
                       defaults={"hierarchy": "auto"}) == [
        "hierarchy: 'auto' (the default) on ranks 0, 1; 'off' on rank 2 (from environment GRADZIP_HIERARCHY=off)"]


def test_fingerprint_is_stable_and_sees_every_setting():
    a = gradzip.Communicator("maxmin", bits=4).settings()
    assert fingerprint(a) == fingerprint(dict(reversed(list(a.items()))))
    for key, value in (("codec.bits", 2), ("memory", "residual"), ("collective", "ps"), ("gradzip", "0.0")):
        assert fingerprint({**a, key: value}) != fingerprint(a), key


def test_settings_name_the_kernels_only_where_they_change_the_bytes():
    assert "kernels" not in gradzip.Communicator("maxmin").settings()  # C and torch agree to the bit
    assert gradzip.Communicator("qsgd").settings()["kernels"].split(":")[0] == "auto"


def test_config_records_where_settings_came_from_and_warns_when_a_codec_switch_drops_options():
    cfg = Config(codec="maxmin", options={"bits": 4})
    with pytest.warns(UserWarning, match=r"GRADZIP_CODEC=topk replaces codec 'maxmin': its options \(bits=4\) are dropped"):
        out = cfg.with_env({"GRADZIP_CODEC": "topk", "GRADZIP_RATIO": "0.1", "GRADZIP_PARTITIONS": "4", "GRADZIP_TIMEOUT": "30"})
    assert out.options == {"ratio": 0.1} and out.timeout == 30
    assert out.sources == {
        "codec": "GRADZIP_CODEC=topk",
        "codec.ratio": "GRADZIP_RATIO=0.1",
        "collective.partitions": "GRADZIP_PARTITIONS=4",
        "timeout": "GRADZIP_TIMEOUT=30",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped, nothing said
        assert Config(codec="maxmin").with_env({"GRADZIP_BITS": "2"}).options == {"bits": 2}
    with pytest.raises(ValueError, match="timeout"):
        Config(timeout=-1)
    from gradzip.sync.engine import _as_timedelta  # (a Communicator's own timeout)

    for bad in (float("inf"), float("nan"), 0, -1.0, True):
        with pytest.raises(ValueError, match="finite number of seconds"):
            _as_timedelta(bad)
    assert _as_timedelta(2.5).total_seconds() == 2.5


def _stale_variable(rank: int, world: int) -> str:
    os.environ["GRADZIP_RATIO"] = "0.01"  # left over from a top-k run
    try:
        gradzip.register(DDP(nn.Linear(4, 4)), "maxmin", bits=4)
    except ValueError as exc:
        return str(exc)
    finally:
        del os.environ["GRADZIP_RATIO"]
    return ""


def test_an_option_from_the_environment_that_does_not_fit_names_the_variable():
    (message,) = run_workers(_stale_variable, 1)
    assert "unknown option(s) ratio" in message and "GRADZIP_RATIO=0.01" in message, message


def _trained(ratio: float, steps: int = 2) -> gradzip.Communicator:
    comm = gradzip.Communicator("topk", ratio=ratio, memory="residual")
    for step in range(steps):
        comm.allreduce(randn((64, 16), seed=step), name="w")
    return comm


def test_lenient_load_keeps_what_applies_and_names_what_it_drops():
    saved = _trained(0.05).state_dict()
    assert saved["rank"] == 0 and saved["world_size"] == 1 and saved["memory"]["residuals"]
    same = _trained(0.05, steps=0)
    same.load_state_dict(saved)  # the same configuration: everything back
    assert torch.equal(same.memory.residuals["w"], saved["memory"]["residuals"]["w"])

    other = _trained(0.02, steps=1)
    with pytest.raises(gradzip.CheckpointError, match=r"codec\.ratio: 0\.05 on the checkpoint; 0\.02 on this run"):
        other.load_state_dict(saved)
    with pytest.warns(UserWarning, match=r"does not match \(its settings differ: codec\.ratio.*\); dropped: codec state$"):
        other.load_state_dict(saved, strict=False)
    # the residual is this rank's unsent gradient: it carries over to another compression level
    assert torch.equal(other.memory.residuals["w"], saved["memory"]["residuals"]["w"])
    assert other.step == saved["step"] == 2  # the step keys shared randomness: it carries over
    # a difference that drops nothing is still said (a strict load refused it)
    alike = _trained(0.05, steps=0)
    alike.load_state_dict(saved)
    renamed = dict(saved, settings={**saved["settings"], "min_numel": 1}, fingerprint="other")
    with pytest.warns(UserWarning, match=r"does not match \(its settings differ: .*\); dropped: nothing"):
        alike.load_state_dict(renamed, strict=False)

    other_memory = gradzip.Communicator("topk", ratio=0.05, memory="residual", memory_options={"beta": 0.5})
    other_memory.allreduce(randn((64, 16)), name="w")
    with pytest.warns(UserWarning, match="dropped: error-feedback memory"):
        other_memory.load_state_dict(saved, strict=False)
    assert other_memory.memory.residuals == {}  # not its own residual from before the load either


def test_a_state_dict_of_the_earlier_format_resumes_at_its_step():
    comm = gradzip.Communicator("maxmin", bits=4, memory="residual")
    saved = comm.state_dict()
    assert saved["format"] == 2 and saved["step"] == 0
    old = {k: v for k, v in saved.items() if k not in ("step", "format")}
    comm.load_state_dict({**old, "format": 1, "steps": {"w": 7, "v": 6}, "hook_step": 9})
    assert comm.step == 9  # the DDP hook's count
    comm.load_state_dict({**old, "format": 1, "steps": {"w": 7, "v": 6}})
    assert comm.step == 7  # standalone: the furthest name
    comm.close()
