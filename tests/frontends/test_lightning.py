"""GradzipDDPStrategy in a real two-process Lightning fit on CPU, where Lightning's own
``ddp_comm_hook`` is never registered."""
from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from gradzip.comm.launch import free_port
from tests.jobs import run_job

lightning = pytest.importorskip("lightning", reason="lightning is not installed (pip install gradzip[lightning])")

JOB = Path(__file__).with_name("lightning_job.py")


def test_import_gradzip_does_not_import_lightning():
    code = (
        "import sys, gradzip, gradzip.frontends.lightning, gradzip.frontends.recipes\n"
        "loaded = {m.split('.')[0] for m in sys.modules}\n"
        "assert not loaded & {'lightning', 'pytorch_lightning', 'accelerate', 'transformers', 'ray'}, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_options_split_between_gradzip_and_ddp():
    from gradzip.frontends.lightning import GradzipDDPStrategy

    s = GradzipDDPStrategy("topk", ratio=0.01, memory="residual", min_numel=64, find_unused_parameters=True,
                           static_graph=False, start_method="spawn", timeout=timedelta(seconds=77),
                           gradzip_options={"timeout": 30})
    assert isinstance(s, lightning.pytorch.strategies.DDPStrategy)
    assert s._gradzip_codec == "topk"
    assert s._gradzip_options == {"ratio": 0.01, "memory": "residual", "min_numel": 64, "timeout": 30}
    assert s._ddp_kwargs == {"find_unused_parameters": True, "static_graph": False}
    assert s._start_method == "spawn" and s._timeout == timedelta(seconds=77)  # the process group's
    assert s.gradzip is None
    try:
        import pytorch_lightning
    except ImportError:
        pass
    else:  # the same strategy for pytorch_lightning's Trainer, which accepts only its own classes
        from gradzip.frontends.lightning import GradzipPLDDPStrategy

        pl_strategy = GradzipPLDDPStrategy("maxmin", bits=2)
        assert isinstance(pl_strategy, pytorch_lightning.strategies.DDPStrategy)
        assert pl_strategy._gradzip_options == {"bits": 2}
    with pytest.raises(ValueError, match="pass no ddp_comm_hook"):
        GradzipDDPStrategy("maxmin", ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="pass no ddp_comm_state"):
        GradzipDDPStrategy("maxmin", ddp_comm_state=object())


def test_two_process_cpu_fit_compresses_and_keeps_replicas_identical(tmp_path):
    """``python lightning_job.py``: Lightning's default launcher re-executes the script for rank 1.
    The script asks for 4 bits and ``GRADZIP_BITS=2`` overrides it, as with plain register().
    Gradients accumulate over 2 batches: one exchange per optimizer step (no_sync in between)."""
    steps = 5
    ranks = run_job([sys.executable, str(JOB), str(tmp_path), str(steps)], tmp_path,
                    GRADZIP_BITS="2", MASTER_PORT=str(free_port()))
    for r in ranks:
        s = r["stats"]
        assert r["world_size"] == 2
        assert r["steps"] == steps and s["steps"] == steps  # every optimizer step went through the hook
        assert s["codec"] == "maxmin" and s["memory"] == "residual"
        assert s["params_compressed"] == 2 and s["params_uncompressed"] == 2  # two weights; two biases
        assert 0 < s["wire_bytes"] < s["raw_bytes"] / 8, s  # 2 bits per value (+ scales) on the wire
        assert r["options"]["bits"] == 2 and r["sources"]["codec.bits"] == "GRADZIP_BITS=2"
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
