"""The forms the compiled kernels (C and Triton) write into and read, checked before a launch.

A kernel writes and reads through raw pointers, unchecked: a short, strided or mistyped tensor
would be written past or misread. These checks turn that into a ``ValueError`` naming the
expected form, and make an encoder's or decoder's outputs where none are given.
"""
from __future__ import annotations

from typing import Sequence

import torch


def outputs(out: Sequence[torch.Tensor] | None, device: torch.device,
            *forms: tuple[int, torch.dtype]) -> tuple[torch.Tensor, ...]:
    """An encoder's outputs: ``out`` checked against ``forms`` (numel, dtype) where given, since
    a kernel writes through its pointers unchecked (a short or strided tensor would be written
    past), else new tensors of those forms."""
    if out is None:
        return tuple(torch.empty(n, dtype=dt, device=device) for n, dt in forms)
    out = tuple(out)
    if len(out) != len(forms):
        raise ValueError(f"out must hold {len(forms)} tensors, got {len(out)}")
    for t, (n, dt) in zip(out, forms):
        if t.dtype != dt or t.numel() != n or not t.is_contiguous() or t.device != torch.device(device):
            raise ValueError(f"out: each tensor contiguous on {device} with the encoded form "
                             f"{[(n, str(d)) for n, d in forms]}, got {t.numel()} values of {t.dtype} on {t.device}")
    return out


def decoded(out: torch.Tensor | None, numel: int, device: torch.device, accumulate: bool) -> torch.Tensor:
    """A decoder's fp32 output: ``out`` checked (as an encoder's, :func:`outputs`) where given."""
    if out is None and accumulate:
        raise ValueError("accumulate=True needs an output tensor to add into")
    return outputs(None if out is None else (out,), device, (numel, torch.float32))[0]


def headers(top: torch.Tensor, bucket: int, numel: int, device: torch.device) -> torch.Tensor:
    """Natural compression's headers as the kernels read them: int32, contiguous, on ``device``,
    one, or one a bucket of ``bucket`` values, a power of two."""
    top = top.reshape(-1).to(device=device, dtype=torch.int32).contiguous()
    if top.numel() != 1 and (bucket <= 0 or bucket & (bucket - 1) or top.numel() < -(-numel // bucket)):
        raise ValueError(f"top: one header, or one for each of the {numel} values' buckets of {bucket} "
                         "(a power of two)")
    return top


def header_shift(top: torch.Tensor, bucket: int) -> int:
    """Where the kernels find value ``i``'s header: -1 for the one header, else ``top[i >> shift]``
    (``shift`` log2 of the bucket)."""
    return -1 if top.numel() == 1 else bucket.bit_length() - 1
