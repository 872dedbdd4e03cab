"""Fused CPU kernels (``native.c``), built at first use with the system C compiler.

The torch versions in :mod:`.reference` make one full pass over memory per operation (min, max,
subtract, scale, add noise, floor, clamp, cast, shift, or, ...), which leaves a 4-bit max-min
encode at a few percent of memory-copy speed. ``native.c`` does the same arithmetic bucket by
bucket while the bucket sits in L1, and the compiler vectorises it. The library is compiled once
per source, compiler and CPU into ``$GRADZIP_CACHE`` (default ``~/.cache/gradzip``) and loaded
with :mod:`ctypes`; ctypes releases the GIL during the call, so encoding overlaps with the
training thread. The kernels use one thread: they run on the communication thread while the
backward pass keeps torch's own threads busy. Where no compiler is found or the build fails,
:func:`available` says why and the torch versions run instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

from . import forms
from .bitpack import packed_bytes

MAX_BUCKET = 65536  # the kernels keep one bucket of levels on the stack
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
_SOURCE = Path(__file__).with_name("native.c")
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None
_loaded = False

_u8p, _f32p, _i64, _int, _u32 = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
_SIGNATURES = {
    "gz_maxmin_encode": [_f32p, _i64, _int, _i64, _int, _u32, _u8p, _f32p],
    "gz_maxmin_decode": [_u8p, _f32p, _i64, _int, _i64, _f32p, _int],
    "gz_qsgd_encode": [_f32p, _i64, _int, _i64, _u32, _u8p, _f32p],
    "gz_qsgd_decode": [_u8p, _f32p, _i64, _int, _i64, _f32p, _int],
    "gz_sign_encode": [_f32p, _i64, _u8p],
    "gz_sign_decode": [_u8p, _i64, _f32p, _f32p, _int],
    "gz_signum_encode": [_f32p, _f32p, _i64, ctypes.c_float, ctypes.c_float, _int, _u8p],
    "gz_topk": [_f32p, _i64, _i64, ctypes.c_void_p, ctypes.c_void_p],
    "gz_fp8_encode": [_f32p, _i64, _int, _i64, _u8p, _f32p],
    "gz_fp8_decode": [_u8p, _f32p, _i64, _int, _i64, _f32p, _int],
    "gz_mx_encode": [_f32p, _i64, _int, _i64, _u8p, _u8p],
    "gz_mx_decode": [_u8p, _u8p, _i64, _int, _i64, _f32p, _int],
    "gz_saturate": [_f32p, _i64, _int, ctypes.c_void_p],
    "gz_uniform": [_i64, _i64, _u32, _f32p],
    "gz_row_absmax": [_f32p, _i64, _i64, _f32p],
    "gz_side_sums": [_f32p, _i64, _i64, ctypes.c_void_p],
    "gz_inceptionn_encode": [ctypes.c_void_p, _i64, _int, ctypes.c_float, ctypes.c_float, _u8p, ctypes.c_void_p, _i64],
    "gz_inceptionn_decode": [_u8p, _u8p, _i64, _i64, _int, ctypes.c_float, _f32p, _int],
    "gz_inceptionn_size": [_u8p, _i64, _int],
    "gz_sketch_cells": [_f32p, _i64, _int, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p],
    "gz_sketch_codes": [_f32p, _i64, _int, ctypes.c_int32, ctypes.c_int32, _u8p, _int, _u8p],
    "gz_codes_decode": [_u8p, _int, _f32p, _i64, _f32p, _int],
    "gz_adacomp_select": [_f32p, _f32p, _i64, _i64, _int, ctypes.c_void_p, ctypes.c_void_p, _i64],
    "gz_select": [_f32p, _i64, ctypes.c_float, _f32p, ctypes.c_void_p, _i64, _i64, ctypes.c_void_p],
    "gz_terngrad_encode": [_f32p, _i64, _i64, _i64, _u32, _int, _f32p, _u8p],
    "gz_tbq_encode": [_f32p, _i64, ctypes.c_float, _u8p],
    "gz_ternary_decode": [_u8p, _f32p, _i64, _i64, _f32p, _int],
    "gz_natural_codes": [ctypes.c_void_p, _i64, _u32, ctypes.c_void_p, _int, _u8p],
    "gz_natural_decode": [_u8p, ctypes.c_void_p, _int, _i64, _f32p, _int],
    "gz_u8bit_codes": [_f32p, _i64, _i64, _f32p, _f32p, ctypes.c_void_p, _u8p],
    "gz_table_decode": [_u8p, _f32p, _f32p, _i64, _i64, _f32p, _int],
    "gz_onebit_decode": [_u8p, _f32p, _i64, _i64, _f32p, _int],
}


_RETURNS = {  # (the others return nothing)
    "gz_select": ctypes.c_int64, "gz_inceptionn_encode": ctypes.c_int64, "gz_inceptionn_size": ctypes.c_int64,
    "gz_adacomp_select": ctypes.c_int64,
}


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> Optional[str]:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str) -> Path:
    """Compile ``native.c`` into the cache (once per source, compiler, flags and CPU)."""
    source = _SOURCE.read_bytes()
    flags = FLAGS + ["-fopenmp-simd"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_id().encode()]))
    cache = Path(os.environ.get("GRADZIP_CACHE") or Path.home() / ".cache" / "gradzip")  # (set empty: unset)
    target = cache / f"native-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # several ranks may build at once: each builds a private file, then renames it atomically
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        for attempt in (flags, FLAGS):  # the simd pragmas are hints: drop them if need be
            proc = subprocess.run([cc, *attempt, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp, target)
                return target
        raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _error, _loaded
    if _loaded:  # every kernel call comes through here: no lock once settled
        return _lib
    with _lock:
        if not _loaded:
            _lib, _error = _open()
            _loaded = True  # only now: a reader without the lock must see _lib and _error set
        return _lib


def _open() -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    """Build and load the library: ``(library, None)`` or ``(None, why not)``."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc or clang)"
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"building the fused CPU kernels failed: {exc}"
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _RETURNS.get(name)
    return lib, None


def _kernels() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"gradzip's fused CPU kernels are unavailable: {_error}")
    return lib


def available() -> Optional[str]:
    """None when the fused CPU kernels are ready; otherwise why they are not."""
    _load()
    return _error


def supports(x: torch.Tensor, bits: int = 8, bucket: int = 8) -> bool:
    """Whether the kernels take this input: a CPU tensor, buckets whole bytes once packed."""
    return (
        x.device.type == "cpu"
        and 0 < bucket <= MAX_BUCKET
        and (bits == 8 or bucket % 8 == 0)
        and _load() is not None
    )


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous in host memory, which the loops read through its pointer unchecked (a
    tensor elsewhere is refused, not read)."""
    if t.device.type != "cpu":
        raise ValueError(f"the C kernels take CPU tensors, got one on {t.device}")
    return t.contiguous()


def _f32(x: torch.Tensor) -> torch.Tensor:
    return _host(x.reshape(-1).to(torch.float32))


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _out(out: Optional[torch.Tensor], numel: int) -> torch.Tensor:
    """The decoders' destination: ``out`` (flat, contiguous fp32 of ``numel`` values) or a new one."""
    if out is None:
        return torch.empty(numel, dtype=torch.float32)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != numel or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous CPU float32 tensor of {numel} values")
    return out


def counter_uniform(numel: int, key: int, device: torch.device = torch.device("cpu"), start: int = 0) -> torch.Tensor:
    """``rng.counter_uniform(numel, key, start=start)`` in one fused loop (the torch version
    takes ten passes); ``device`` is the CPU (the signature is the other versions')."""
    out = torch.empty(numel, dtype=torch.float32)
    if numel:
        _kernels().gz_uniform(start, numel, key & 0xFFFFFFFF, out.data_ptr())
    return out


def maxmin_encode(
    x: torch.Tensor, bits: int, bucket: int, key: Optional[int], out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    x = _f32(x)
    n = x.numel()
    packed, stats = out if out is not None else (
        torch.empty(packed_bytes(n, bits), dtype=torch.uint8), torch.empty(2 * (-(-n // bucket)), dtype=torch.float32))
    _kernels().gz_maxmin_encode(
        x.data_ptr(), n, bits, bucket, int(key is not None), (key or 0) & 0xFFFFFFFF,
        packed.data_ptr(), stats.data_ptr(),
    )
    return packed, stats


def maxmin_decode(
    packed: torch.Tensor, stats: torch.Tensor, bits: int, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    packed, stats, out = _host(packed), _host(stats), _out(out, numel)
    _kernels().gz_maxmin_decode(packed.data_ptr(), stats.data_ptr(), numel, bits, bucket, out.data_ptr(), int(accumulate))
    return out


def qsgd_encode(
    x: torch.Tensor, bits: int, bucket: int, key: int, out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    x = _f32(x)
    n = x.numel()
    packed, norms = out if out is not None else (
        torch.empty(packed_bytes(n, bits), dtype=torch.uint8), torch.empty(-(-n // bucket), dtype=torch.float32))
    _kernels().gz_qsgd_encode(x.data_ptr(), n, bits, bucket, key & 0xFFFFFFFF, packed.data_ptr(), norms.data_ptr())
    return packed, norms


def qsgd_decode(
    packed: torch.Tensor, norms: torch.Tensor, bits: int, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    packed, norms, out = _host(packed), _host(norms), _out(out, numel)
    _kernels().gz_qsgd_decode(packed.data_ptr(), norms.data_ptr(), numel, bits, bucket, out.data_ptr(), int(accumulate))
    return out


def saturate(y: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``y`` as fp16 or bf16 in one pass, finite values beyond the type's range clamped to
    its largest value (``reference.saturate``, bit for bit; a NaN stays NaN, the quiet one of
    its sign, where torch's CPU cast may drop the sign); into ``out`` (contiguous) if given."""
    if y.dtype != torch.float32 or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"saturate takes fp32 to fp16 or bf16, got {y.dtype} to {dtype}")
    x = _host(y.reshape(-1))
    out = torch.empty(y.shape, dtype=dtype) if out is None else out
    _kernels().gz_saturate(x.data_ptr(), x.numel(), int(dtype == torch.bfloat16), out.data_ptr())
    return out


def sign_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    x = _f32(x)
    packed = torch.empty(packed_bytes(x.numel(), 1), dtype=torch.uint8) if out is None else out
    _kernels().gz_sign_encode(x.data_ptr(), x.numel(), packed.data_ptr())
    return packed


def signum_encode(g: torch.Tensor, m: torch.Tensor, beta: float, finite: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Signum's step in one pass (``fused.signum_encode``): the fp32 momentum ``m`` (contiguous,
    as many values as ``g``) updated in place unless ``finite`` (0-dim) is false, and the sign
    bits of the new momentum, into ``out`` if given."""
    x = _f32(g)
    if m.dtype != torch.float32 or not m.is_contiguous() or m.numel() != x.numel() or m.device != _CPU:
        raise ValueError(f"signum_encode: a contiguous fp32 momentum of {x.numel()} values on the CPU")
    (packed,) = forms.outputs(None if out is None else (out,), _CPU, (packed_bytes(x.numel(), 1), torch.uint8))
    if x.numel():
        alpha = 1.0 - beta  # (a double, as torch takes it, then fp32 in the loop)
        _kernels().gz_signum_encode(x.data_ptr(), m.data_ptr(), x.numel(), beta, alpha, int(bool(finite)),
                                    packed.data_ptr())
    return packed


def sign_decode(
    packed: torch.Tensor, numel: int, scale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    packed, out = _host(packed), _out(out, numel)
    scale = None if scale is None else _host(scale.reshape(-1).to(torch.float32))
    _kernels().gz_sign_decode(packed.data_ptr(), numel, _ptr(scale), out.data_ptr(), int(accumulate))
    return out


def topk(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of ``|x|`` by radix select: ``(x[idx], idx)`` with ``idx`` ascending.

    Ties at the threshold go to the lowest indices, as in the Triton version.
    """
    flat = x.reshape(-1)
    xf = _f32(flat)
    k = max(0, min(k, xf.numel()))
    idx = torch.empty(k, dtype=torch.int64)
    hist = torch.empty(65536, dtype=torch.int64)
    _kernels().gz_topk(xf.data_ptr(), xf.numel(), k, idx.data_ptr(), hist.data_ptr())
    return flat[idx], idx


# ------------------------------------------------------- FP8 and microscaling (MX) formats
_FP8 = {"e4m3": 0, "e5m2": 1}
_MX = {"e4m3": 0, "e2m1": 1}


def fp8_encode(
    x: torch.Tensor, fmt: str, block: int, out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    x = _f32(x)
    n = x.numel()
    codes, scales = out if out is not None else (
        torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // block), dtype=torch.float32))
    _kernels().gz_fp8_encode(x.data_ptr(), n, _FP8[fmt], block, codes.data_ptr(), scales.data_ptr())
    return codes, scales


def fp8_decode(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    codes, scales, out = _host(codes), _host(scales.to(torch.float32)), _out(out, numel)
    _kernels().gz_fp8_decode(
        codes.data_ptr(), scales.data_ptr(), numel, _FP8[fmt], block, out.data_ptr(), int(accumulate)
    )
    return out


def mx_encode(
    x: torch.Tensor, elem: str, block: int, out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    if block % 32:
        raise ValueError(f"MX blocks are multiples of 32 values, got {block}")
    x = _f32(x)
    n = x.numel()
    codes, scales = out if out is not None else (
        torch.empty(n if elem == "e4m3" else (n + 1) // 2, dtype=torch.uint8),
        torch.empty(-(-n // block), dtype=torch.uint8))
    _kernels().gz_mx_encode(x.data_ptr(), n, _MX[elem], block, codes.data_ptr(), scales.data_ptr())
    return codes, scales


def mx_decode(
    codes: torch.Tensor, scales: torch.Tensor, elem: str, block: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    if block % 32:
        raise ValueError(f"MX blocks are multiples of 32 values, got {block}")
    codes, scales, out = _host(codes), _host(scales), _out(out, numel)
    _kernels().gz_mx_decode(
        codes.data_ptr(), scales.data_ptr(), numel, _MX[elem], block, out.data_ptr(), int(accumulate)
    )
    return out


# ------------------------------------------- element-wise codecs (TernGrad, TBQ, natural, 8-bit, 1-bit)
# The signatures of the Triton versions in gpu.py; outputs given are checked (forms), since the
# kernels write through their pointers unchecked.
_CPU = torch.device("cpu")


def _bytes(codes: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Codes as the decoders read them: contiguous bytes holding ``numel`` codes of ``bits``
    bits (checked: the loops read that many bytes, unchecked)."""
    if codes.dtype != torch.uint8 or codes.numel() < packed_bytes(numel, bits):
        raise ValueError(f"codes: at least {packed_bytes(numel, bits)} bytes (uint8) for {numel} codes of {bits} bits, "
                         f"got {codes.numel()} values of {codes.dtype}")
    return _host(codes.reshape(-1))


def _within(numel: int, rows: int, bucket: int) -> None:
    """An encoder reads the first ``numel`` values of its ``rows`` buckets: no more than they hold."""
    if not 0 <= numel <= rows * bucket:
        raise ValueError(f"numel: at most the {rows} x {bucket} values of the buckets, got {numel}")


def _f32_rows(side: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """Per-bucket fp32 statistics the kernels read ``rows`` of, unchecked: checked here."""
    side = _host(side.reshape(-1).to(torch.float32))
    if side.numel() < rows:
        raise ValueError(f"{what}: at least {rows} values (one a bucket), got {side.numel()}")
    return side


def row_maxima(xb: torch.Tensor) -> torch.Tensor:
    """Each row's ``max |x|`` of the 2-D ``xb`` in one pass (a NaN stays, as in ``amax``)."""
    rows, width = xb.shape
    x, out = _f32(xb), (torch.empty if width else torch.zeros)(rows, dtype=torch.float32)
    if rows and width:
        _kernels().gz_row_absmax(x.data_ptr(), rows, width, out.data_ptr())
    return out


def side_sums(xb: torch.Tensor) -> torch.Tensor:
    """Each row's ``[sum of x < 0, sum of x >= 0, count of x >= 0]`` in fp64, ``(rows, 3)``, one
    pass (``fused.side_sums``; the sums in another order than torch's)."""
    rows, width = xb.shape
    x, out = _f32(xb), torch.zeros(rows, 3, dtype=torch.float64)
    if rows and width:
        _kernels().gz_side_sums(x.data_ptr(), rows, width, out.data_ptr())
    return out


def terngrad_encode(
    buckets: torch.Tensor, key: int, numel: int, scale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """TernGrad's packed 2-bit codes and per-bucket scales (``reference.terngrad_encode``) in one
    pass, the draws ``counter_uniform(·, key)`` made in the loop; ``buckets`` ``(B, bucket)``, the
    scales each row's ``max |x|`` unless given (fp32, one a bucket)."""
    rows, bucket = buckets.shape
    _within(numel, rows, bucket)
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != rows or scale.device != _CPU):
        raise ValueError(f"scale: {rows} fp32 values on the CPU, one a bucket")
    x = _f32(buckets)
    (packed,) = forms.outputs(None if out is None else (out,), _CPU, (packed_bytes(numel, 2), torch.uint8))
    given = scale is not None
    scale = _host(scale) if given else torch.empty(rows, dtype=torch.float32)
    if rows:
        _kernels().gz_terngrad_encode(x.data_ptr(), numel, rows, bucket, key & 0xFFFFFFFF, int(given),
                                      scale.data_ptr(), packed.data_ptr())
    return packed, scale


def tbq_encode(x: torch.Tensor, tau: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TBQ's packed 2-bit codes in one pass (``reference.tbq_encode``; ``tau`` an fp32 value)."""
    x = _f32(x)
    (packed,) = forms.outputs(None if out is None else (out,), _CPU, (packed_bytes(x.numel(), 2), torch.uint8))
    _kernels().gz_tbq_encode(x.data_ptr(), x.numel(), tau, packed.data_ptr())
    return packed


def _bucket_decode(name: str, codes: torch.Tensor, bits: int, side: Optional[torch.Tensor], per_bucket: int,
                   bucket: int, numel: int, out: Optional[torch.Tensor], accumulate: bool,
                   *tables: torch.Tensor) -> torch.Tensor:
    """Run decoder ``name(codes, *tables, side, numel, bucket, out, accumulate)`` on codes of
    ``bits`` bits: ``side`` the fp32 statistics, ``per_bucket`` of them a bucket (None: none)."""
    codes = _bytes(codes, numel, bits)
    bucket = max(bucket, 1)
    out = forms.decoded(out, numel, _CPU, accumulate)
    if side is not None:
        side = _f32_rows(side, per_bucket * -(-numel // bucket), "the per-bucket statistics")
    if numel:
        getattr(_kernels(), name)(codes.data_ptr(), *(t.data_ptr() for t in tables), _ptr(side), numel, bucket,
                                  out.data_ptr(), int(accumulate))
    return out


def ternary_decode(
    packed: torch.Tensor, scale: torch.Tensor, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """fp32 ``{0, +1, −1} × scale`` per value in one pass (``reference.ternary_decode``)."""
    return _bucket_decode("gz_ternary_decode", packed, 2, scale, 1, bucket, numel, out, accumulate)


def natural_codes(bits: torch.Tensor, key: int, top: torch.Tensor, bucket: int = 0,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Natural compression's codes in one pass (``reference.natural_codes``, the draws
    ``reference.natural_draws`` made in the loop), under header ``top``: one, or one for each
    ``bucket`` values."""
    bits = _host(bits.reshape(-1))
    if bits.dtype != torch.int32:
        raise ValueError(f"bits: the int32 bits of fp32 values, got {bits.dtype}")
    numel = bits.numel()
    top = forms.headers(top, bucket, numel, _CPU)
    (out,) = forms.outputs(None if out is None else (out,), _CPU, (numel, torch.uint8))
    if numel:
        _kernels().gz_natural_codes(bits.data_ptr(), numel, key & 0xFFFFFFFF, top.data_ptr(),
                                    forms.header_shift(top, bucket), out.data_ptr())
    return out


def natural_decode(
    codes: torch.Tensor, top: torch.Tensor, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """Natural compression's fp32 values in one pass (``reference.natural_decode``), under header
    ``top``: one, or one for each ``bucket`` values."""
    codes = _bytes(codes, numel, 8)
    top = forms.headers(top, bucket, numel, _CPU)
    out = forms.decoded(out, numel, _CPU, accumulate)
    if numel:
        _kernels().gz_natural_decode(codes.data_ptr(), top.data_ptr(), forms.header_shift(top, bucket), numel,
                                     out.data_ptr(), int(accumulate))
    return out


def u8bit_codes(
    buckets: torch.Tensor, inv: torch.Tensor, mids: torch.Tensor, lut: torch.Tensor, numel: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """8-bit codes in one pass (``reference.u8bit_codes``); ``mids`` the 256 midpoints (the last
    +inf), ``lut`` the 65536 first candidates."""
    rows, bucket = buckets.shape
    _within(numel, rows, bucket)
    x = _f32(buckets)
    inv = _f32_rows(inv, -(-numel // max(bucket, 1)), "inv")
    mids, lut = _host(mids.to(torch.float32)), _host(lut.to(torch.int32))
    if mids.numel() != 256 or lut.numel() != 1 << 16:
        raise ValueError(f"mids and lut: 256 and 65536 entries, got {mids.numel()} and {lut.numel()}")
    (out,) = forms.outputs(None if out is None else (out,), _CPU, (numel, torch.uint8))
    if numel:
        _kernels().gz_u8bit_codes(x.data_ptr(), numel, bucket, inv.data_ptr(), mids.data_ptr(), lut.data_ptr(),
                                  out.data_ptr())
    return out


def table_decode(
    codes: torch.Tensor, table: torch.Tensor, scale: Optional[torch.Tensor], bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """``table[code] × scale`` of the value's bucket in one pass (``reference.table_decode``);
    without a ``scale``, ``table[code]``."""
    table = _host(table.to(torch.float32))
    if table.numel() != 256:
        raise ValueError(f"table: 256 values, one a code, got {table.numel()}")
    return _bucket_decode("gz_table_decode", codes, 8, scale, 1, bucket if scale is not None else numel, numel, out,
                          accumulate, table)


def onebit_decode(
    packed: torch.Tensor, means: torch.Tensor, bucket: int, numel: int,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """1-bit SGD's decode in one pass (``reference.onebit_decode``; ``means`` ``[neg, pos]`` a bucket)."""
    return _bucket_decode("gz_onebit_decode", packed, 1, means, 2, bucket, numel, out, accumulate)


def select_magnitudes(
    x: torch.Tensor, threshold: float = 0.0, thresholds: Optional[torch.Tensor] = None,
    valid: Optional[torch.Tensor] = None, span: int = 256, most: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """``reference.select_magnitudes`` in two passes (the count, then the indices into a tensor of
    that size); None where more than ``most`` are selected, found in the first pass."""
    x = _f32(x)
    n = x.numel()
    if thresholds is not None:
        blocks = -(-n // span)
        thresholds = _f32_rows(thresholds, blocks, "thresholds")
        valid = _host(valid.reshape(-1).to(torch.int32))
        if valid.numel() < blocks:
            raise ValueError(f"valid: at least {blocks} values (one a block), got {valid.numel()}")
    lib, most_ = _kernels(), -1 if most is None else most
    count = lib.gz_select(x.data_ptr(), n, threshold, _ptr(thresholds), _ptr(valid), span, most_, None)
    if count < 0:
        return None
    idx = torch.empty(count, dtype=torch.int64)
    if count:
        lib.gz_select(x.data_ptr(), n, threshold, _ptr(thresholds), _ptr(valid), span, -1, idx.data_ptr())
    return idx


_INCEPTIONN_FORMATS = {torch.float16: 1, torch.bfloat16: 2}  # (anything else: as fp32, 0)


def inceptionn_encode(x: torch.Tensor, bound: float, step: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """INCEPTIONN's packed 2-bit tags and byte stream (``reference.inceptionn_encode``, bit for
    bit) in two passes: the tags and the stream's length, then its bytes into a stream of that
    length. A 16-bit input is read as it is (its raw values take 2 bytes); fp64 as fp32."""
    x = x.reshape(-1)
    fmt = _INCEPTIONN_FORMATS.get(x.dtype, 0)
    src = _host(x).view(torch.int16) if fmt else _f32(x)
    n = src.numel()
    packed = torch.empty(packed_bytes(n, 2), dtype=torch.uint8)
    stream = torch.empty(0, dtype=torch.uint8)
    if n:
        lib = _kernels()
        size = lib.gz_inceptionn_encode(src.data_ptr(), n, fmt, bound, step, packed.data_ptr(), None, 0)
        stream = torch.empty(size, dtype=torch.uint8)
        if size:
            lib.gz_inceptionn_encode(src.data_ptr(), n, fmt, bound, step, packed.data_ptr(), stream.data_ptr(), size)
    return packed, stream


def inceptionn_decode(
    packed: torch.Tensor, stream: torch.Tensor, dtype: torch.dtype, numel: int, step: float,
    out: Optional[torch.Tensor] = None, accumulate: bool = False,
) -> torch.Tensor:
    """INCEPTIONN's fp32 values from their tags and bytes in one pass (``reference.inceptionn_decode``),
    stored or added into ``out``; a stream too short for its tags (none the encoder makes) is a
    ``ValueError`` before anything is written."""
    if packed.dtype != torch.uint8 or stream.dtype != torch.uint8 or packed.numel() < packed_bytes(numel, 2):
        # (the loop reads the tags through a pointer, unchecked; the stream only within its size)
        raise ValueError(f"an INCEPTIONN payload of {numel} values: uint8 tags (at least {packed_bytes(numel, 2)} "
                         f"bytes) and a uint8 stream, got {packed.numel()} of {packed.dtype} and {stream.dtype}")
    packed, stream = _host(packed.reshape(-1)), _host(stream.reshape(-1))
    out = forms.decoded(out, numel, _CPU, accumulate)
    if numel:
        fmt, lib = _INCEPTIONN_FORMATS.get(dtype, 0), _kernels()
        size = lib.gz_inceptionn_size(packed.data_ptr(), numel, fmt)
        if stream.numel() < size:
            raise ValueError(f"an INCEPTIONN payload of {numel} values: its tags say {size} bytes of stream, "
                             f"it holds {stream.numel()}")
        lib.gz_inceptionn_decode(packed.data_ptr(), stream.data_ptr(), stream.numel(), numel, fmt, step,
                                 out.data_ptr(), int(accumulate))
    return out


def _sketch_keys(key_bits: int, zero_key: int) -> None:
    """The loops index cells by key unchecked: only keys of 1..31 bits around their middle (the
    key of +0.0) stay inside the ``2**key_bits`` cells."""
    if not 1 <= key_bits <= 31 or zero_key != 1 << (key_bits - 1):
        raise ValueError(f"sketch keys: 1..31 bits, +0.0 at their middle (1 << (key_bits - 1)), got {key_bits} "
                         f"bits, +0.0 at {zero_key}")


def sketch_cells(xf: torch.Tensor, key_bits: int, zero_key: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """SketchML's cells of the fp32 ``xf`` (keys of ``key_bits`` bits): each cell's count and fp64
    sum, in one pass, added in index order (``codecs.sketch``'s torch sketch: the same sums)."""
    _sketch_keys(key_bits, zero_key)
    if xf.dtype != torch.float32:
        raise ValueError(f"sketch_cells: fp32 values, got {xf.dtype}")
    x, cells = _host(xf.reshape(-1)), 1 << key_bits
    hist, sums = torch.zeros(cells, dtype=torch.float64), torch.zeros(cells, dtype=torch.float64)
    if x.numel():
        _kernels().gz_sketch_cells(x.data_ptr(), x.numel(), 32 - key_bits, zero_key, cells, hist.data_ptr(),
                                   sums.data_ptr())
    return hist, sums


def sketch_codes(xf: torch.Tensor, key_bits: int, zero_key: int, codes: torch.Tensor, bits: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each fp32 value's bucket ``codes[key]`` (uint8, one a cell), packed in ``bits`` bits
    (into ``out``, contiguous uint8 bytes of that size, where given)."""
    _sketch_keys(key_bits, zero_key)
    x, cells = _host(xf.reshape(-1)), 1 << key_bits
    if xf.dtype != torch.float32 or codes.dtype != torch.uint8 or codes.numel() != cells or not 1 <= bits <= 8:
        raise ValueError(f"sketch_codes: fp32 values, {cells} uint8 codes and 1..8 bits, got {xf.dtype}, "
                         f"{codes.numel()} of {codes.dtype} and {bits}")
    codes = _host(codes)
    packed = forms.outputs(None if out is None else (out,), _CPU, (packed_bytes(x.numel(), bits), torch.uint8))[0]
    if x.numel():
        _kernels().gz_sketch_codes(x.data_ptr(), x.numel(), 32 - key_bits, zero_key, cells, codes.data_ptr(), bits,
                                   packed.data_ptr())
    return packed


def codes_decode(packed: torch.Tensor, bits: int, table: torch.Tensor, numel: int,
                 out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """Codes of ``bits`` bits (1..8) looked up in ``table`` (fp32, at most 256 values: SketchML's
    bucket means), stored or added into ``out``, in one pass. A code past the table reads 0."""
    if not 1 <= bits <= 8 or table.numel() > 256:
        raise ValueError(f"codes_decode: 1..8 bits and at most 256 table values, got {bits} and {table.numel()}")
    packed = _bytes(packed, numel, bits)
    padded = torch.zeros(256, dtype=torch.float32)
    padded[: table.numel()] = table.reshape(-1)
    out = forms.decoded(out, numel, _CPU, accumulate)
    if numel:
        _kernels().gz_codes_decode(packed.data_ptr(), bits, padded.data_ptr(), numel, out.data_ptr(), int(accumulate))
    return out


def adacomp_select(g: torch.Tensor, prev: Optional[torch.Tensor], size: int, doubled: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """AdaQ's selection of the flat fp32 ``g`` in bins of ``size`` values (``prev``: the residual
    kept last step, fp32, or None), in two passes: ``(ascending int64 indices, each bin's count)``,
    as ``codecs.sparse.AdaQ._selection`` makes them in torch."""
    if g.dtype != torch.float32 or (prev is not None and (prev.dtype != torch.float32 or prev.numel() != g.numel())):
        raise ValueError("adacomp_select: fp32 values and an fp32 residual of as many")
    x = _host(g.reshape(-1))
    p = None if prev is None else _host(prev.reshape(-1))
    n = x.numel()
    counts = torch.zeros(-(-n // size), dtype=torch.int64)
    lib = _kernels()
    total = lib.gz_adacomp_select(x.data_ptr(), _ptr(p), n, size, int(doubled), counts.data_ptr(), None, 0) if n else 0
    idx = torch.empty(total + 1, dtype=torch.int64)  # (one more: the loop writes each index before it counts it)
    if total and lib.gz_adacomp_select(x.data_ptr(), _ptr(p), n, size, int(doubled), counts.data_ptr(),
                                       idx.data_ptr(), total + 1) != total:
        raise RuntimeError("adacomp_select: the values changed between its two passes (another thread wrote them)")
    return idx[:total], counts
