"""Shared test fixtures, and the one process setting that must precede every import."""
from __future__ import annotations

import os

import pytest
import torch

# Triton decides at import whether its language functions (tl.max, ...) are interpreted or
# compiled, and a library collected early (lightning, via torch) may import it. Without a GPU the
# kernel tests run in the interpreter, so switch it on before anything is collected; with a GPU
# the kernels are checked compiled unless TRITON_INTERPRET says otherwise.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Single-process tests use tiny tensors: one intra-op thread is fastest and immune to a busy
    machine (multi-process tests set their own threads in each rank)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
