"""The digits task of the demo and the accuracy benchmark: scikit-learn's bundled digits (no
download) and an MLP whose width sets how much of a step is communication."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn


def load_digits_split(seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (1797 × 64), standardized with the training split's statistics, 80/20 stratified."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        from sklearn.preprocessing import StandardScaler
    except ImportError as exc:
        raise ImportError(
            "the demo's data set (digits) comes with scikit-learn: pip install gradzip[demo]", name=exc.name
        ) from exc

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def make_model(seed: int, width: int = 256) -> nn.Module:
    """64 → width → width → 10 MLP; a larger ``width`` makes training communication-bound."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
