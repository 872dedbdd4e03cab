"""The hot codec kernels, each run by the fastest version that takes its input.

Three versions produce the same bytes: :mod:`.native` (fused C, CPU), :mod:`.gpu` (Triton,
CUDA) and :mod:`.reference` (plain torch: the specification, and the fallback for everything
else — other devices, odd bucket sizes, no compiler, no Triton). ``GRADZIP_KERNELS`` picks one
by hand: ``auto`` (default), ``native``, ``triton`` or ``torch``; asking for a version that
cannot run raises an error that says why, rather than silently measuring another.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Optional, Tuple

import torch

from . import native, reference

CHOICES = ("auto", "native", "triton", "torch")
_TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # exact in fp32 bit patterns


def setting() -> str:
    """The ``GRADZIP_KERNELS`` choice (checked: an unknown value raises ``ValueError``)."""
    value = os.environ.get("GRADZIP_KERNELS", "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"GRADZIP_KERNELS={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def _gpu() -> Optional[ModuleType]:
    try:
        from . import gpu
    except ImportError:
        return None
    return gpu


def backend(x: torch.Tensor, bits: int = 8, bucket: int = 8) -> ModuleType:
    """The module whose kernels will run on ``x`` (``bits``/``bucket`` as the codec uses them)."""
    choice = setting()
    if choice == "torch":
        return reference
    if x.device.type == "cpu" and choice in ("auto", "native"):
        if native.supports(x, bits, bucket):
            return native
        if choice == "native":
            why = native.available() or f"bits={bits}, bucket={bucket} (buckets must pack into whole bytes, ≤ {native.MAX_BUCKET})"
            raise RuntimeError(f"GRADZIP_KERNELS=native cannot run here: {why}")
    if x.device.type == "cuda" and choice in ("auto", "triton"):
        gpu = _gpu()
        if gpu is not None and gpu.available() is None and gpu.supports(x, bits, bucket):
            return gpu
        if choice == "triton":
            raise RuntimeError(f"GRADZIP_KERNELS=triton cannot run here: {gpu.available() if gpu else 'no Triton kernels'}")
    if choice != "auto" and x.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"GRADZIP_KERNELS={choice} has no kernels for {x.device.type} tensors")
    return reference


def name(x: torch.Tensor, bits: int = 8, bucket: int = 8) -> str:
    """``"native"``, ``"triton"`` or ``"torch"``: which version :func:`backend` picks."""
    mod = backend(x, bits, bucket)
    return {native: "native", reference: "torch"}.get(mod, "triton")


def _decode_via(impl, out: Optional[torch.Tensor], accumulate: bool, call):
    """Decode straight into ``out`` when the kernel can take it, else through a temporary."""
    if out is None or (out.dtype == torch.float32 and out.is_contiguous()):
        return call(out, accumulate)
    return reference.store(call(None, False), out, accumulate)


def maxmin_encode(x: torch.Tensor, bits: int, bucket: int, key: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    return backend(x, bits, bucket).maxmin_encode(x, bits, bucket, key)


def maxmin_decode(packed, stats, bits: int, bucket: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(packed, bits, bucket)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.maxmin_decode(packed, stats, bits, bucket, numel, o, a))


def qsgd_encode(x: torch.Tensor, bits: int, bucket: int, key: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return backend(x, bits, bucket).qsgd_encode(x, bits, bucket, key)


def qsgd_decode(packed, norms, bits: int, bucket: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(packed, bits, bucket)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.qsgd_decode(packed, norms, bits, bucket, numel, o, a))


def sign_encode(x: torch.Tensor) -> torch.Tensor:
    return backend(x).sign_encode(x)


def sign_decode(packed, numel: int, scale=None, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(packed)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.sign_decode(packed, numel, scale, o, a))


def topk(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of the flat ``x`` largest in magnitude: ``(values, int64 indices)``.

    A radix select on the bits of ``|x|``, in C on CPU or in Triton on CUDA (indices ascending,
    ties to the lowest indices); elsewhere ``torch.topk`` of ``|x|`` (order unspecified). Ranks
    all run the same version, so they agree on ties.
    """
    choice = setting()
    if x.device.type == "cpu" and choice in ("auto", "native") and native.supports(x) and x.dtype in _TOPK_DTYPES:
        return native.topk(x, k)
    if x.device.type == "cuda" and choice in ("auto", "triton"):
        gpu = _gpu()
        if gpu is not None and gpu.available() is None and gpu.supports_topk(x):
            return gpu.topk(x, k)
    _, idx = torch.topk(x.abs(), k, sorted=False)
    return x[idx], idx
