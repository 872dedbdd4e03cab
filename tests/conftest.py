"""Shared test fixtures."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Single-process tests use tiny tensors: one intra-op thread is fastest and immune to a busy
    machine (multi-process tests set their own threads in each rank)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
