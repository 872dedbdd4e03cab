"""The Triton kernels as the tests run them: in Triton's interpreter on CPU tensors without a
GPU (``tests/conftest.py`` switches it on before anything imports Triton), compiled on CUDA
tensors with one unless ``TRITON_INTERPRET=1`` asks for the interpreter."""
from __future__ import annotations

from types import ModuleType
from typing import Tuple

import pytest
import torch


def load() -> Tuple[ModuleType, torch.device]:
    """``(gradzip.kernels.gpu, the device its tensors live on)``; skips where Triton is missing or
    cannot interpret the kernels, fails where it should run them and cannot."""
    triton = pytest.importorskip("triton", reason="the Triton kernels need triton (pip install triton)")
    from gradzip.kernels import gpu

    interpret = bool(triton.knobs.runtime.interpret)
    if not interpret and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is off and there is no GPU")
    if interpret and not isinstance(triton.language.standard.max, triton.runtime.interpreter.InterpretedFunction):
        pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set, so its language functions "
                    "are compiled ones the interpreter cannot call; set it before pytest starts")
    reason = gpu.available()
    if reason is not None and gpu.interpreter_fault() is not None:
        pytest.skip(f"the installed Triton cannot interpret the kernels: {reason}")
    if reason is not None:
        pytest.fail(f"Triton is installed but its kernels cannot run: {reason}")
    return gpu, torch.device("cpu" if interpret else "cuda")
