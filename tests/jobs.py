"""Run a framework's training job as users launch it, in a subprocess, with a clean environment."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

# a rank's variables left in the environment would make a launcher think torchrun started it
LAUNCHER_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
)


def run_job(cmd: List[str], outdir: Path, timeout: float = 240, **env_vars: str) -> List[dict]:
    """Run ``cmd`` (no ``GRADZIP_*`` variables but ``env_vars``) and load each of 2 ranks' ``rankN.pt``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADZIP_") and k not in LAUNCHER_VARS}
    env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), HF_HOME=str(outdir / "hf"), **env_vars)
    # a session of its own, so that a job past its time goes with every process it started
    proc = subprocess.Popen(cmd, env=env, cwd=outdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} took more than {timeout} s:\n{out[-3000:]}{err[-6000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    return [torch.load(outdir / f"rank{r}.pt") for r in range(2)]
