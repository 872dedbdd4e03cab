"""Splitting a flat tensor into fixed-size buckets for per-bucket statistics (min/max, norms)."""
from __future__ import annotations

import torch


def pad_to_multiple(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad a 1-D tensor to a multiple of ``multiple`` by repeating its last value.

    Repeating a real value (rather than zeros) leaves a bucket's min and max unchanged.
    """
    n = x.numel()
    pad = (-n) % multiple
    if pad == 0 or n == 0:
        return x
    return torch.cat([x, x[-1:].expand(pad)])


def bucket_view(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """View a 1-D tensor as ``(num_buckets, bucket_size)``, padding the tail bucket."""
    return pad_to_multiple(x, bucket_size).view(-1, bucket_size)
