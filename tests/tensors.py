"""Deterministic test tensors."""
from __future__ import annotations

import torch


def randn(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """N(0, 1) values of ``shape`` from a private generator, cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)
