"""``gradzip bench fsdp``: FSDP2 over a model's blocks, fp32, bf16 reduce and gradzip."""
from __future__ import annotations

import pytest

from gradzip.bench import sharded
from gradzip.bench.models import MODELS
from gradzip.tools import cli

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp.FSDPModule, "set_custom_reduce_scatter"):
    pytest.skip("this torch has no FSDP2 custom reduce-scatter", allow_module_level=True)


def test_blocks_follow_the_models_structure():
    model = sharded.BlockModel(MODELS["resnet50"].shapes())
    # the stem (conv1, bn1), 16 bottlenecks, the head
    assert len(model.blocks) == 1 + 1 + 16 + 1
    assert sum(p.numel() for p in model.parameters()) == MODELS["resnet50"].published


@pytest.mark.timeout(300)
def test_every_method_runs_and_gradzip_sends_fewer_bytes(tmp_path):
    report = sharded.run_fsdp(
        "resnet18", ["fp32", "bf16-reduce", "maxmin:bits=4"], workers=2, rate=None, steps=1, warmup=1,
        json_path=str(tmp_path / "fsdp.json"),
    )
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["fp32"]["vs_fp32"] == 1.0 and rows["maxmin:bits=4"]["units"] >= 10
    assert rows["bf16-reduce"]["reduce_scatter_bytes"] == rows["fp32"]["reduce_scatter_bytes"] / 2
    assert rows["maxmin:bits=4"]["reduce_scatter_bytes"] < rows["fp32"]["reduce_scatter_bytes"] / 6
    assert (tmp_path / "fsdp.json").exists()


def test_unknown_methods_are_refused_with_the_choices():
    with pytest.raises(SystemExit):
        cli.main(["bench", "fsdp", "--configs", "fp64"])
