"""``gradzip doctor`` and what it reports about the kernels: ``kernels.active()`` and the
once-per-process warning when the C kernels cannot run and torch's run instead."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from gradzip import kernels
from gradzip.kernels import fused, native


def _run(code_or_args, **env: str) -> subprocess.CompletedProcess:
    args = code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args]
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRADZIP_")}
    full.update(env)
    return subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True, timeout=120)


def test_active_names_the_version_that_runs_on_cpu():
    act = kernels.active()
    assert set(act) == {"setting", "cpu", "cpu_why", "cuda", "cuda_why"}
    assert act["cpu"] == fused.name(torch.zeros(8), 4, 1024)
    assert act["cpu_why"] == native.available()
    if not torch.cuda.is_available():
        assert act["cuda"] == "torch" and act["cuda_why"]


def test_doctor_reports_the_key_facts_and_exits_0():
    proc = _run(["-m", "gradzip", "doctor"], COLUMNS="200")  # one table row a line
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in (torch.__version__, "gloo", "nccl", "CPU tensors", "CUDA tensors", "C compiler", "native build",
                   "kernel cache", "triton", "emulated cluster", "root"):
        assert needle in out, (needle, out)
    line = next(ln for ln in out.splitlines() if "native build" in ln)
    assert ("works" in line) == (native.available() is None), line


def test_doctor_without_rich_and_without_a_compiler_says_why(tmp_path):
    """Plain text when rich is missing; a failed build shows as the reason, and torch runs."""
    code = "import sys; sys.modules['rich'] = None\nfrom gradzip.tools.cli import main\nsys.exit(main(['doctor']))"
    proc = _run(code, CC="false", GRADZIP_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "┌" not in proc.stdout  # no rich table
    cpu = next(ln for ln in proc.stdout.splitlines() if "CPU tensors" in ln)
    assert "✗" in cpu and "torch (not native: building the fused CPU kernels failed" in cpu, cpu
    build = next(ln for ln in proc.stdout.splitlines() if "native build" in ln)
    assert "✗" in build and "false failed" in build, build


def test_falling_back_to_torch_kernels_warns_once_with_the_reason(tmp_path):
    code = (
        "import torch, gradzip\n"
        "from gradzip import kernels\n"
        "codecs = [('maxmin', {'bits': 4}), ('qsgd', {'bits': 4}), ('signsgd', {}), ('topk', {'ratio': 0.1})]\n"
        "for name, opts in codecs:\n"
        "    c = gradzip.codec(name, **opts)\n"
        "    for _ in range(3):\n"
        "        c.decode(c.encode(torch.randn(4096), name='w'))\n"
        "print('ACTIVE', kernels.active())\n"
    )
    proc = _run(code, CC="false", GRADZIP_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("KernelFallbackWarning") == 1, proc.stderr
    assert "fused C kernels cannot run here (building the fused CPU kernels failed" in proc.stderr
    assert "'cpu': 'torch'" in proc.stdout
    # chosen by hand: no warning, and active() says why
    proc = _run(code, CC="false", GRADZIP_CACHE=str(tmp_path), GRADZIP_KERNELS="torch")
    assert proc.returncode == 0, proc.stderr
    assert "KernelFallbackWarning" not in proc.stderr
    assert "'cpu_why': 'GRADZIP_KERNELS=torch'" in proc.stdout
