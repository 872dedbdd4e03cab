"""Deterministic test tensors."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def randn(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """N(0, 1) values of ``shape`` from a private generator, cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def with_nonfinite(n: int, dtype, places, many: int = 500):
    """``(where, bad, x)`` for each of NaN, +inf and -inf at each of ``places``: ``x`` is
    ``n`` N(0, 1) values with ``bad`` at ``where`` (None: none; "many": the first ``many``)."""
    for where in places:
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = randn((n,), dtype, seed=7)
            if where == "many":
                x[:many] = bad
            elif where is not None:
                x[where] = bad
            yield where, bad, x


class LargestMade(TorchDispatchMode):
    """While active, :attr:`numel` is the size of the largest tensor an operator made and
    :attr:`nbytes` the bytes of all of them (views and results written into one of the
    operator's own arguments not counted; of ``dtypes`` only, where given): what a
    piece-by-piece or into-``out`` kernel promises to keep small."""

    def __init__(self, dtypes=None) -> None:
        super().__init__()
        self.numel = self.nbytes = 0
        self.dtypes = dtypes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.data_ptr() for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)}
        if (isinstance(out, torch.Tensor) and not func.is_view and out.data_ptr() not in given
                and (self.dtypes is None or out.dtype in self.dtypes)):
            self.numel = max(self.numel, out.numel())
            self.nbytes += out.untyped_storage().nbytes()
        return out
