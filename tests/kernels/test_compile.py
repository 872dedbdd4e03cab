"""The Triton kernels compile for a CUDA GPU (sm_90), checked on any machine with Triton's CUDA
back end: ``scripts/compile_kernels.py --quick`` compiles every kernel in a sample of the
configurations gradzip launches, in a process of its own (Triton's interpreter, which the other
kernel tests use without a GPU, accepts programs that compiled Triton rejects)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton", reason="the Triton kernels need triton (pip install triton)")

pytestmark = pytest.mark.gpu

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "compile_kernels.py")


def _cuda_backend() -> str | None:
    """Why Triton cannot compile for CUDA here, or None."""
    try:
        from triton.backends import backends
    except ImportError as exc:
        return f"this Triton has no back-end registry ({exc})"
    if "nvidia" not in backends:
        return "this Triton has no CUDA back end"
    return None


def test_every_kernel_compiles_for_a_cuda_gpu():
    reason = _cuda_backend()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, SCRIPT, "--quick"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "; 0 failed; not launched: none" in done.stdout, done.stdout[-2000:]
