"""The hot codec kernels, each run by the fastest version that takes its input.

Three versions produce the same bytes: :mod:`.native` (fused C, CPU), :mod:`.gpu` (Triton,
CUDA) and :mod:`.reference` (plain torch: the specification, and the fallback for everything
else — other devices, odd bucket sizes, no compiler, no Triton). ``GRADZIP_KERNELS`` picks one
by hand: ``auto`` (default), ``native``, ``triton`` or ``torch``; asking for a version that
cannot run raises an error that says why, rather than silently measuring another. Under ``auto``
a fallback to torch because a faster version cannot run here warns once per process, and
:func:`active` says which version runs where.
"""
from __future__ import annotations

import os
import threading
import warnings
from types import ModuleType
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from . import native, reference
from .bitpack import pack_bits, packed_bytes, unpack_bits

CHOICES = ("auto", "native", "triton", "torch")
_TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # exact in fp32 bit patterns
_warned: set = set()
_warn_lock = threading.Lock()


class KernelFallbackWarning(RuntimeWarning):
    """A faster kernel version cannot run here, so the torch version runs (several times slower)."""


def _fallback(device: str, why: Optional[str]) -> None:
    """Warn once per process and device type that the torch kernels replace a faster version."""
    if device in _warned:
        return
    with _warn_lock:
        if device in _warned:
            return
        _warned.add(device)
    version = "fused C" if device == "cpu" else "Triton"
    warnings.warn(
        f"gradzip: the {version} kernels cannot run here ({why}); {device.upper()} tensors use the slower "
        "torch kernels (GRADZIP_KERNELS=torch chooses them without this warning)",
        KernelFallbackWarning, stacklevel=3,
    )


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
        if native.available() is not None:
            _fallback("cpu", native.available())
    if x.device.type == "cuda" and choice in ("auto", "triton"):
        gpu = _gpu()
        if gpu is not None and gpu.available() is None and gpu.supports(x, bits, bucket):
            return gpu
        if choice == "triton":
            raise RuntimeError(f"GRADZIP_KERNELS=triton cannot run here: {gpu.available() if gpu else 'no Triton kernels'}")
        if gpu is None or gpu.available() is not None:
            _fallback("cuda", gpu.available() if gpu else "no Triton kernels")
    if choice != "auto" and x.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"GRADZIP_KERNELS={choice} has no kernels for {x.device.type} tensors")
    return reference


def active() -> Dict[str, Optional[str]]:
    """Which version runs for CPU and for CUDA tensors, and why not the faster one.

    ``{"setting": "auto", "cpu": "native", "cpu_why": None, "cuda": "torch", "cuda_why": "..."}``:
    ``*_why`` is None when the fastest version for that device runs. A version forced by
    ``GRADZIP_KERNELS`` that cannot run shows as ``"unavailable"`` (using it raises).
    Odd inputs (bucket sizes that do not pack into whole bytes) use torch on any device.
    """
    choice = setting()
    out: Dict[str, Optional[str]] = {"setting": choice}
    if choice in ("auto", "native"):
        why = native.available()
        out["cpu"] = "native" if why is None else ("torch" if choice == "auto" else "unavailable")
        out["cpu_why"] = why
    else:
        out["cpu"], out["cpu_why"] = "torch", f"GRADZIP_KERNELS={choice}"
    if choice in ("auto", "triton"):
        gpu = _gpu()
        why = gpu.available() if gpu is not None else "no Triton kernels"
        if why is None and not torch.cuda.is_available():  # (the interpreter runs them on CPU tensors only)
            why = "no CUDA device"
        out["cuda"] = "triton" if why is None else ("torch" if choice == "auto" else "unavailable")
        out["cuda_why"] = why
    else:
        out["cuda"], out["cuda_why"] = "torch", f"GRADZIP_KERNELS={choice}"
    return out


def name(x: torch.Tensor, bits: int = 8, bucket: int = 8) -> str:
    """``"native"``, ``"triton"`` or ``"torch"``: which version :func:`backend` picks."""
    mod = backend(x, bits, bucket)
    return {native: "native", reference: "torch"}.get(mod, "triton")


def _decode_via(impl, out: Optional[torch.Tensor], accumulate: bool, call):
    """Decode straight into ``out`` when the kernel can take it, else through a temporary."""
    if out is None or (out.dtype == torch.float32 and out.is_contiguous()):
        return call(out, accumulate)
    return reference.store(call(None, False), out, accumulate)


def _into(out: Optional[Sequence[torch.Tensor]], tensors: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
    """``tensors``, or copied into ``out`` where it is given (the torch versions allocate)."""
    if out is None:
        return tensors
    for dst, src in zip(out, tensors):
        dst.copy_(src)
    return tuple(out)


def maxmin_encode(
    x: torch.Tensor, bits: int, bucket: int, key: Optional[int], out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed levels and per-bucket ``[min, scale]``, into ``out`` (packed bytes, stats) if given."""
    impl = backend(x, bits, bucket)
    if impl is reference:
        return _into(out, reference.maxmin_encode(x, bits, bucket, key))
    return impl.maxmin_encode(x, bits, bucket, key, out)


def maxmin_decode(packed, stats, bits: int, bucket: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(packed, bits, bucket)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.maxmin_decode(packed, stats, bits, bucket, numel, o, a))


def qsgd_encode(
    x: torch.Tensor, bits: int, bucket: int, key: int, out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and per-bucket norms, into ``out`` (packed bytes, norms) if given."""
    impl = backend(x, bits, bucket)
    if impl is reference:
        return _into(out, reference.qsgd_encode(x, bits, bucket, key))
    return impl.qsgd_encode(x, bits, bucket, key, out)


def qsgd_decode(packed, norms, bits: int, bucket: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(packed, bits, bucket)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.qsgd_decode(packed, norms, bits, bucket, numel, o, a))


def triton_for(x: torch.Tensor) -> Optional[ModuleType]:
    """The Triton kernels where :func:`backend` picks them for the CUDA tensor ``x``, else None
    (a codec whose only other version is its own torch code then runs that)."""
    impl = backend(x) if x.device.type == "cuda" else reference
    return None if impl is reference else impl


def uniform(numel: int, key: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """``rng.counter_uniform(numel, key, start=start)`` on ``device``: one pass of a fused C loop
    on the CPU or of a Triton kernel on CUDA (as :func:`backend` picks them), else torch's ten
    operations."""
    # (backend raises where GRADZIP_KERNELS forces a version that cannot run here)
    return backend(torch.empty(0, device=device)).counter_uniform(numel, key, torch.device(device), start)


def terngrad_encode(buckets: torch.Tensor, key: int, numel: int, scale: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """TernGrad's codes and scales (each bucket's ``max |x|``, or the given ``scale``), value
    ``i`` kept with draw ``counter_uniform(i, key)``; the codes into ``out`` (contiguous bytes)
    if given."""
    impl = backend(buckets)
    if impl is not reference:
        return impl.terngrad_encode(buckets, key, numel, scale, out)
    if buckets.device.type == "cpu" and numel > TORCH_PIECE:
        return _terngrad_pieces(buckets, key, numel, scale, out)
    packed, scale = reference.terngrad_encode(
        buckets, uniform(buckets.numel(), key, buckets.device).view(buckets.shape), numel, scale)
    return _into(None if out is None else (out,), (packed,))[0], scale


def _terngrad_pieces(buckets: torch.Tensor, key: int, numel: int, scale: Optional[torch.Tensor] = None,
                     packed: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``reference.terngrad_encode`` a piece at a time (:data:`TORCH_PIECE` values, a multiple of
    8: whole bytes of 2-bit codes), each piece with its own draws: its temporaries (about six of
    a piece's size) stay a few MB where they were several times the tensor (one bucket of the
    whole tensor by default). The same operations on each value: the same bytes. The scales
    first, each bucket's maximum of the maxima of its pieces (a maximum is exact)."""
    rows, bucket = buckets.shape
    flat = buckets.reshape(-1)
    step = TORCH_PIECE
    if scale is None:
        scale = row_maxima(buckets)
    if packed is None:
        packed = torch.empty(packed_bytes(numel, 2), dtype=torch.uint8, device=buckets.device)
    for a in range(0, numel, step):
        b = min(a + step, numel)
        x = flat[a:b]
        index = torch.arange(a, b, device=x.device) // bucket
        keep = uniform(b - a, key, x.device, a) < x.abs() / scale[index]
        neg = x < 0
        codes = (keep & ~neg).to(torch.uint8) | ((keep & neg).to(torch.uint8) << 1)
        packed[a // 4 : packed_bytes(b, 2)] = pack_bits(codes, 2)  # (pieces start on whole groups of 8 values)
    return packed, scale


def tbq_encode(x: torch.Tensor, tau: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TBQ's packed codes (``reference.tbq_encode``), into ``out`` (contiguous bytes) if given."""
    impl = backend(x)
    if impl is not reference:
        return impl.tbq_encode(x, tau, out)
    return _into(None if out is None else (out,), (reference.tbq_encode(x, tau),))[0]


def ternary_decode(packed, scale, bucket: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    """TernGrad's and TBQ's decode (``reference.ternary_decode``); the torch version piece by
    piece on the CPU (:data:`TORCH_PIECE` values), whose temporaries (codes, signs, values:
    about ten bytes a value) are then a few MB, not two and a half times a fused group."""
    impl = backend(packed)
    if impl is reference and packed.device.type == "cpu" and numel > TORCH_PIECE:
        return _decode_via(impl, out, accumulate, lambda o, a: _ternary_pieces(packed, scale, bucket, numel, o, a))
    return _decode_via(impl, out, accumulate, lambda o, a: impl.ternary_decode(packed, scale, bucket, numel, o, a))


def _ternary_pieces(packed: torch.Tensor, scale: torch.Tensor, bucket: int, numel: int,
                    out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    """``reference.ternary_decode`` a piece at a time: each value's sign times its bucket's
    scale, the same product, so the same bits."""
    if out is None:
        out, accumulate = torch.empty(numel, dtype=torch.float32, device=packed.device), False
    flat, codes_of = out.view(-1), packed.reshape(-1)
    for a in range(0, numel, TORCH_PIECE):  # (a multiple of 4: pieces start on whole bytes of codes)
        b = min(a + TORCH_PIECE, numel)
        codes = unpack_bits(codes_of[a // 4 : -(-b // 4)], 2, b - a)
        signs = ((codes & 1).to(torch.int8) - (codes >> 1).to(torch.int8)).float()
        if bucket >= numel:  # one scale
            values = signs * scale[:1]
        elif TORCH_PIECE % bucket == 0:  # whole buckets from a // bucket on (the last one may be short)
            rows = -(-(b - a) // bucket)
            pad = rows * bucket - (b - a)
            rowed = (torch.nn.functional.pad(signs, (0, pad)) if pad else signs).view(rows, bucket)
            values = (rowed * scale[a // bucket : a // bucket + rows, None]).reshape(-1)[: b - a]
        else:  # each value's bucket looked up
            values = signs * scale[torch.arange(a, b, device=packed.device) // bucket]
        reference.store(values, flat[a:b], accumulate)
    return out


# values a torch version of an element-wise encoder works on at once: its temporaries (about ten
# int32 or fp32 tensors) are then about a MB each, not several times the gradient group's size,
# and stay in a CPU's cache (8 Mi values, one thread: natural 54-58 ms a piece of 256 Ki where
# pieces of 1 Mi took 189-202 ms; 8-bit 32 against 100-104 ms)
TORCH_PIECE = 1 << 18


def select_magnitudes(
    x: torch.Tensor, threshold: float = 0.0, thresholds: Optional[torch.Tensor] = None,
    valid: Optional[torch.Tensor] = None, span: int = 256, most: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """:func:`reference.select_magnitudes`: on CUDA two Triton passes, on the CPU two C passes
    (or torch a piece of :data:`TORCH_PIECE` values, whole blocks, at a time, so the magnitudes
    and the mask are a piece long, not a fused group's). One device wait (the size is the data's). None where more
    than ``most`` values are selected (a caller that then sends them densely): on the CPU the
    pieces stop there, so no indices of nearly every value are made."""
    kernels = triton_for(x)
    if kernels is not None:
        return _at_most(kernels.select_magnitudes(x, threshold, thresholds, valid, span), most)
    if x.numel() and (thresholds is None or thresholds.dtype == torch.float32) and backend(x) is native:
        return native.select_magnitudes(x, threshold, thresholds, valid, span, most)
    x = x.reshape(-1)
    n, step = x.numel(), piece_length(x)
    if step >= n:
        return _at_most(reference.select_magnitudes(x, threshold, thresholds, valid, span), most)
    if thresholds is not None:
        step = max(span, step - step % span)
    found, count = [], 0
    for a in range(0, n, step):
        b = min(a + step, n)
        blocks = slice(a // span, -(-b // span))
        per_block = (thresholds[blocks], valid[blocks]) if thresholds is not None else (None, None)
        found.append(reference.select_magnitudes(x[a:b], threshold, *per_block, span=span).add_(a))
        count += found[-1].numel()
        if most is not None and count > most:
            return None
    return torch.cat(found)


def _at_most(idx: torch.Tensor, most: Optional[int]) -> Optional[torch.Tensor]:
    return None if most is not None and idx.numel() > most else idx


def _inceptionn_piece(numel: int, device: torch.device) -> int:
    """Values of INCEPTIONN's torch version at once: on the CPU :data:`TORCH_PIECE` rounded to a
    multiple of 8 (:func:`pack_bits` pads a call's tags to 8 values, so pieces of whole groups of
    8 pack to the whole's bytes), whose temporaries (about ten of its size) stay small."""
    return max(8, TORCH_PIECE - TORCH_PIECE % 8) if torch.device(device).type == "cpu" else max(numel, 1)


def inceptionn_encode(x: torch.Tensor, bound: float, step: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.inceptionn_encode`: on CUDA two Triton passes (the same bytes), on the
    CPU two C passes (or torch a piece at a time, each piece's tags and bytes those of the
    whole, in order)."""
    kernels = triton_for(x)
    if kernels is not None:
        return kernels.inceptionn_encode(x, bound, step)
    if backend(x) is native:
        return native.inceptionn_encode(x, bound, step)
    x = x.reshape(-1)
    n, piece = x.numel(), _inceptionn_piece(x.numel(), x.device)
    if piece >= n:
        return reference.inceptionn_encode(x, bound, step)
    pieces = [reference.inceptionn_encode(x[a : a + piece], bound, step) for a in range(0, n, piece)]
    return torch.cat([tags for tags, _ in pieces]), torch.cat([stream for _, stream in pieces])


def inceptionn_decode(packed: torch.Tensor, stream: torch.Tensor, dtype: torch.dtype, numel: int, step: float,
                      out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """:func:`reference.inceptionn_decode`: on CUDA two Triton passes (the same values), on the
    CPU one C pass (or torch a piece at a time, each piece's bytes found from its tags)."""
    kernels = triton_for(packed)
    if kernels is not None:
        return kernels.inceptionn_decode(packed, stream, dtype, numel, step, out, accumulate)
    if backend(packed) is native:
        return _decode_via(native, out, accumulate,
                           lambda o, a: native.inceptionn_decode(packed, stream, dtype, numel, step, o, a))
    piece = _inceptionn_piece(numel, packed.device)
    if piece >= numel:
        return reference.inceptionn_decode(packed, stream, dtype, numel, step, out, accumulate)
    if out is None:
        out, accumulate = torch.empty(numel, dtype=torch.float32, device=packed.device), False
    windows = reference.inceptionn_windows(stream, dtype)  # (the stream padded once; its place carried)
    offset = 0
    for a in range(0, numel, piece):
        b = min(a + piece, numel)
        values, offset = reference.inceptionn_values(unpack_bits(packed[a // 4 : -(-b // 4)], 2, b - a), windows,
                                                     offset, dtype, step)
        reference.store(values, out[a:b], accumulate)
    return out


def sketch_cells(xf: torch.Tensor, key_bits: int, zero_key: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """SketchML's sketch of the flat fp32 ``xf``: each cell's count and fp64 sum of its values
    (``2**key_bits`` cells, keys ``reference.sketch_keys``). On the CPU one C pass, or torch a
    piece at a time into the same tables, so the keys and the fp64 copy are a piece long; both
    add in index order (the same sums)."""
    if backend(xf) is native:
        return native.sketch_cells(xf, key_bits, zero_key)
    hist = torch.zeros(1 << key_bits, dtype=torch.float64, device=xf.device)
    sums = torch.zeros_like(hist)
    step = piece_length(xf)
    for a in range(0, xf.numel(), step):
        reference.sketch_cells(xf[a : a + step], key_bits, zero_key, hist, sums)
    return hist, sums


def sketch_codes(xf: torch.Tensor, key_bits: int, zero_key: int, codes: torch.Tensor, bits: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each value's bucket ``codes[key]``, packed in ``bits`` bits (into ``out`` where given):
    on the CPU one C pass, else torch a piece of whole bytes at a time."""
    if backend(xf) is native:
        return native.sketch_codes(xf, key_bits, zero_key, codes, bits, out)
    n, step = xf.numel(), piece_length(xf)
    if n <= step:
        return _into(None if out is None else (out,), (reference.sketch_codes(xf, key_bits, zero_key, codes, bits),))[0]
    packed = torch.empty(packed_bytes(n, bits), dtype=torch.uint8, device=xf.device) if out is None else out
    for a in range(0, n, step):  # (pieces of whole groups of 8 values: whole bytes)
        b = min(a + step, n)
        packed[packed_bytes(a, bits) : packed_bytes(b, bits)] = reference.sketch_codes(xf[a:b], key_bits, zero_key,
                                                                                       codes, bits)
    return packed


def adacomp_select(g: torch.Tensor, prev: Optional[torch.Tensor], size: int, doubled: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """AdaQ's selection (``reference.adacomp_select``) of the flat fp32 ``g``: on the CPU two C
    passes, else torch a piece of whole bins at a time (every bin at once off the CPU: one
    selection, one wait), so the magnitudes, ``h`` and the mask are a piece long."""
    if g.dtype == torch.float32 and (prev is None or prev.dtype == torch.float32) and backend(g) is native:
        return native.adacomp_select(g, prev, size, doubled)
    n = g.numel()
    step = size * -(-piece_length(g) // size)
    found, counts = [], []
    for a in range(0, n, step):
        b = min(a + step, n)
        idx, count = reference.adacomp_select(g[a:b], None if prev is None else prev[a:b], size, doubled)
        found.append(idx.add_(a))
        counts.append(count)
    if len(found) == 1:
        return found[0], counts[0]
    if not found:
        return torch.zeros(0, dtype=torch.int64, device=g.device), torch.zeros(0, dtype=torch.int64, device=g.device)
    return torch.cat(found), torch.cat(counts)


def groups_at_once(device: torch.device) -> bool:
    """Whether a fused group's members (their statistics, selections, draws, error feedback)
    are taken at once, in a fixed number of operations (an accelerator, which pays a launch an
    operation), rather than one after the other (the CPU, where a call costs next to nothing,
    the passes stay in cache and each member gets the bits it has alone)."""
    return torch.device(device).type != "cpu"


def piece_length(x: torch.Tensor, numel: Optional[int] = None) -> int:
    """Values a torch version of an element-wise kernel works on at once: on the CPU
    :data:`TORCH_PIECE` (a multiple of 8: whole bytes of packed bits), elsewhere all of them (a
    GPU pays a launch an operation, not the temporaries' cache misses): ``x``'s, or ``numel``
    where ``x`` holds them packed."""
    return TORCH_PIECE if x.device.type == "cpu" else max(x.numel() if numel is None else numel, 1)


def rows_reduced(xb: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor],
                 combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add) -> torch.Tensor:
    """``reduce`` (each row's value of a 2-D piece: a sum, a count, a maximum) of the rows of
    ``xb``. On the CPU a piece of about :data:`TORCH_PIECE` values at a time (whole rows, or a
    long row's pieces combined by ``combine``, from zeros), so the temporaries (a clamped copy,
    its fp64 conversion, a mask widened for its sum, magnitudes) are a few MB, not several times
    the tensor; elsewhere in one operation."""
    rows, width = xb.shape
    piece = piece_length(xb)
    if rows * width <= piece:
        return reduce(xb)
    if width <= piece:  # whole rows: each row's value is the same operation as in one go
        step = piece // width
        return torch.cat([reduce(xb[r : r + step]) for r in range(0, rows, step)])
    step = max(1, piece // rows)
    total = None
    for a in range(0, width, step):
        part = reduce(xb[:, a : a + step])
        total = combine(torch.zeros_like(part) if total is None else total, part)
    return total


def _row_kernels(xb: torch.Tensor) -> Optional[ModuleType]:
    """The compiled version (C on the CPU, Triton on CUDA) of the row statistics for ``xb``, or
    None for torch's: they take fp32 rows only (others keep torch's dtype semantics)."""
    if not xb.shape[1] or xb.dtype != torch.float32:
        return None
    impl = backend(xb)
    return None if impl is reference else impl


def row_maxima(xb: torch.Tensor) -> torch.Tensor:
    """Each row's ``max |x|`` (a NaN stays): TernGrad's and the 8-bit format's scales, a fused
    group's block maxima. On the CPU one C pass, on CUDA one Triton pass, or torch a piece at a
    time (a maximum is exact in any order)."""
    impl = _row_kernels(xb)
    if impl is not None:
        return impl.row_maxima(xb)
    return rows_reduced(xb, lambda piece: piece.abs().amax(dim=1), torch.maximum)


def side_sums(xb: torch.Tensor) -> torch.Tensor:
    """Each row's ``[sum of its values < 0, sum of those >= 0, count of those >= 0]`` in fp64,
    ``(rows, 3)``: 1-bit SGD's statistics. Each side is clamped at 0 in fp32 (exact, and far
    faster than a boolean select) and summed in fp64, where values near the fp32 maximum cannot
    overflow; a NaN stays. On the CPU one C pass and on CUDA one Triton pass (their sums in
    another order than torch's, so their last fp64 bits may differ: a rank's means are its own,
    sent in its payload, so no replica sees it), else torch a piece at a time."""
    impl = _row_kernels(xb)
    if impl is not None:
        return impl.side_sums(xb)
    return torch.stack([rows_reduced(xb, lambda piece: piece.clamp(max=0).double().sum(dim=1)),
                        rows_reduced(xb, lambda piece: piece.clamp(min=0).double().sum(dim=1)),
                        rows_reduced(xb, lambda piece: (piece >= 0).sum(dim=1, dtype=torch.float64))], 1)


def natural_codes(bits: torch.Tensor, key: int, top: torch.Tensor, bucket: int = 0,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Natural compression's codes, value ``i`` rounded with the 23-bit draw of
    ``counter_uniform(i, key)`` (``reference.natural_draws``) under header ``top``: one, or one
    for each ``bucket`` values, into ``out`` (contiguous bytes) if given; the torch version
    piece by piece (:data:`TORCH_PIECE` values)."""
    impl = backend(bits)
    if impl is not reference:
        return impl.natural_codes(bits, key, top, bucket, out)
    n = bits.numel()
    out = torch.empty(n, dtype=torch.uint8, device=bits.device) if out is None else out
    step = piece_length(bits)
    for a in range(0, n, step):  # (each piece's draws on their own: no tensor of every draw)
        b = min(a + step, n)
        draws = reference.natural_draws(uniform(b - a, key, bits.device, a))
        out[a:b] = reference.natural_codes(bits[a:b], draws, _per_value(top, bucket, a, b))
    return out


def natural_decode(codes: torch.Tensor, top: torch.Tensor, bucket: int, numel: int, out=None,
                   accumulate: bool = False) -> torch.Tensor:
    """Natural compression's values under header ``top`` (one, or one for each ``bucket``
    values; ``reference.natural_decode``); the torch version piece by piece on the CPU."""
    impl = backend(codes)
    if impl is not reference:
        return _decode_via(impl, out, accumulate, lambda o, a: impl.natural_decode(codes, top, bucket, numel, o, a))
    if out is None:
        out, accumulate = torch.empty(numel, dtype=torch.float32, device=codes.device), False
    flat, step = out.view(-1), piece_length(codes)
    for a in range(0, numel, step):
        b = min(a + step, numel)
        reference.natural_decode(codes.reshape(-1)[a:b], _per_value(top, bucket, a, b), b - a, flat[a:b], accumulate)
    return out


def _per_value(top: torch.Tensor, bucket: int, a: int, b: int) -> torch.Tensor:
    """The headers of values ``a`` to ``b``: the one header, or each value's bucket's."""
    top = top.reshape(-1)
    if top.numel() == 1 or bucket <= 0:
        return top[:1]
    return top[torch.arange(a, b, device=top.device) // bucket]


def u8bit_codes(
    buckets: torch.Tensor, inv: torch.Tensor, mids: torch.Tensor, lut: torch.Tensor, numel: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """8-bit codes of the first ``numel`` values of ``buckets`` (rows scaled by ``inv``), into
    ``out`` (contiguous bytes) if given; the torch version a piece of about
    :data:`TORCH_PIECE` values at a time (whole rows, or a long row's pieces)."""
    impl = backend(buckets)
    if impl is not reference:
        return impl.u8bit_codes(buckets, inv, mids, lut, numel, out)
    width = buckets.shape[1]
    out = torch.empty(numel, dtype=torch.uint8, device=buckets.device) if out is None else out.view(-1)
    flat = buckets.reshape(-1)
    for a, b, k, rows in _bucket_pieces(numel, max(width, 1), piece_length(buckets)):
        if rows is None:  # a piece of row k
            out[a:b] = reference.u8bit_codes(flat[a:b].view(1, -1), inv[k : k + 1], mids, lut, b - a)
        else:
            out[a:b] = reference.u8bit_codes(buckets[k : k + rows], inv[k : k + rows], mids, lut, b - a)
    return out


def table_decode(codes, table, scale, bucket: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    """``table[code]`` times its bucket's ``scale`` if given (``reference.table_decode``); the
    torch version a piece at a time on the CPU, so its int32 codes and values are a few MB,
    not the size of the group."""
    impl = backend(codes)
    if impl is reference and codes.device.type == "cpu" and numel > TORCH_PIECE:
        return _decode_via(impl, out, accumulate, lambda o, a: _table_pieces(codes, table, scale, bucket, numel, o, a))
    return _decode_via(impl, out, accumulate, lambda o, a: impl.table_decode(codes, table, scale, bucket, numel, o, a))


def codes_decode(packed: torch.Tensor, bits: int, table: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None,
                 accumulate: bool = False) -> torch.Tensor:
    """The first ``numel`` codes of ``bits`` bits looked up in ``table`` (SketchML's bucket
    means), into the flat ``out`` (added to it with ``accumulate``) if given: on the CPU one C
    pass, else torch a piece of :data:`TORCH_PIECE` values at a time (whole bytes of codes), so
    the codes widened for the lookup and the values are a few MB, not the tensor's size."""
    if table.dtype == torch.float32 and backend(packed) is native:
        return _decode_via(native, out, accumulate,
                           lambda o, a: native.codes_decode(packed, bits, table, numel, o, a))
    step = piece_length(packed, numel)  # (on the CPU a multiple of 8 values: whole bytes of codes)
    if out is None:
        if numel <= step:
            return table.index_select(0, unpack_bits(packed, bits, numel).to(torch.int32))
        out, accumulate = torch.empty(numel, dtype=table.dtype, device=table.device), False
    packed = packed.reshape(-1)
    for a in range(0, numel, step):
        b = min(a + step, numel)
        start = packed_bytes(a, bits)  # (a: whole groups of 8 values)
        codes = unpack_bits(packed[start : start + packed_bytes(b - a, bits)], bits, b - a)
        reference.store(table.index_select(0, codes.to(torch.int32)), out[a:b], accumulate)
    return out


def _table_pieces(codes: torch.Tensor, table: torch.Tensor, scale: Optional[torch.Tensor], bucket: int, numel: int,
                  out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    """``reference.table_decode`` a piece at a time: the same lookup and product for each
    value, so the same bits."""
    if out is None:
        out, accumulate = torch.empty(numel, dtype=torch.float32, device=codes.device), False
    flat, flat_codes = out.view(-1), codes.reshape(-1)
    for a, b, k, rows in _bucket_pieces(numel, bucket, piece_length(codes)):
        values = torch.index_select(table, 0, flat_codes[a:b].to(torch.int32))
        if scale is not None and rows is None:  # inside bucket k
            values = values * scale[k]
        elif scale is not None:  # whole buckets from k on
            values = _by_rows(values, rows, bucket, lambda v: v * scale[k : k + rows, None])
        reference.store(values, flat[a:b], accumulate)
    return out


def onebit_decode(packed, means, bucket: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    """1-bit SGD's decode (``reference.onebit_decode``); the torch version piece by piece
    (:data:`TORCH_PIECE` values: whole buckets, or a long bucket's pieces), whose temporaries
    (about five of a piece's size) are then a few MB, not several times the tensor."""
    impl = backend(packed)
    if impl is reference and packed.device.type == "cpu" and numel > TORCH_PIECE:  # (``packed``: 8 values a byte)
        return _decode_via(impl, out, accumulate, lambda o, a: _onebit_pieces(packed, means, bucket, numel, o, a))
    return _decode_via(impl, out, accumulate, lambda o, a: impl.onebit_decode(packed, means, bucket, numel, o, a))


def _onebit_pieces(packed: torch.Tensor, means: torch.Tensor, bucket: int, numel: int,
                   out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    """``reference.onebit_decode`` a piece at a time: the same operations on each value, so the
    same bits."""
    if out is None:
        out, accumulate = torch.empty(numel, dtype=torch.float32, device=packed.device), False
    flat, m = out.view(-1), means.view(-1, 2)
    for a, b, k, rows in _bucket_pieces(numel, bucket, piece_length(packed, numel)):
        lo, skip = divmod(a, 8)
        bit = unpack_bits(packed.reshape(-1)[lo : -(-b // 8)], 1, skip + b - a)[skip:].float()
        if rows is None:  # inside bucket k
            values = bit * m[k, 1] + (1 - bit) * m[k, 0]
        else:  # whole buckets from k on
            mm = m[k : k + rows]
            values = _by_rows(bit, rows, bucket, lambda v: v * mm[:, 1:2] + (1 - v) * mm[:, 0:1])
        reference.store(values, flat[a:b], accumulate)
    return out


def _bucket_pieces(numel: int, bucket: int, piece: int) -> Iterator[Tuple[int, int, int, Optional[int]]]:
    """``(a, b, k, rows)``: values ``a`` to ``b`` in pieces of about ``piece`` values
    (:func:`piece_length`), each either ``rows`` whole buckets from bucket ``k`` on (the last one
    may be short) or, where a bucket is longer than a piece, a part of bucket ``k`` (``rows``
    None)."""
    long_buckets = bucket > piece
    # (whole buckets of at most a piece; all of them where a piece holds the values: one step)
    step = piece if long_buckets else bucket * (piece // bucket if piece < numel else -(-numel // bucket))
    a = 0
    while a < numel:
        k = a // bucket
        b = min(a + step, numel, (k + 1) * bucket) if long_buckets else min(a + step, numel)
        yield a, b, k, None if long_buckets else -(-(b - a) // bucket)
        a = b


def _by_rows(values: torch.Tensor, rows: int, bucket: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` of ``values`` laid out as ``rows`` buckets (the last one padded with zeros), flat
    again without the padding."""
    n = values.numel()
    pad = rows * bucket - n
    return fn((torch.nn.functional.pad(values, (0, pad)) if pad else values).view(rows, bucket)).reshape(-1)[:n]


def sign_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One bit per value, set where ``x >= 0``; into ``out`` (contiguous bytes) if given."""
    impl = backend(x)
    if impl is reference:
        return _into(None if out is None else (out,), (reference.sign_encode(x),))[0]
    return impl.sign_encode(x, out)


def signum_encode(g: torch.Tensor, m: torch.Tensor, beta: float, finite: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Signum's step: the momentum ``m ← β·m + (1−β)·g`` (torch's ``mul``, then its ``add`` with
    alpha), kept only where the 0-dim ``finite`` says the step is, and the sign bits of the new
    momentum (``sign_encode``), into ``out`` if given. One pass over ``g`` and ``m`` with the
    fused kernels (fp32 momentum, contiguous: C on the CPU, which reads the flag on the host,
    where it is free; Triton on CUDA, which reads it on the device), the same bits and momenta;
    else torch: in place where the flag is read on the host, else a temporary the flag picks."""
    impl = backend(g)
    if impl is not reference and m.dtype == torch.float32 and m.is_contiguous() and m.device == g.device:
        return impl.signum_encode(g, m, beta, finite, out)
    if not groups_at_once(g.device) and bool(finite):
        v = m.mul_(beta).add_(g, alpha=1.0 - beta)
    else:
        v = torch.mul(m, beta).add_(g, alpha=1.0 - beta)
        torch.where(finite, v, m, out=m)
    return sign_encode(v, out)


def sign_decode(packed, numel: int, scale=None, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(packed)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.sign_decode(packed, numel, scale, o, a))


def saturate(y: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y`` cast to ``dtype`` with finite values beyond its range clamped (see
    ``reference.saturate``): one pass for fp32 to fp16/bf16 (the fp16 and bf16 codecs' encode, a
    copy's worth of memory traffic) with the fused kernels of the device, torch's four elsewhere.
    ``out``: a contiguous tensor of ``dtype`` and ``y``'s size that receives the result (a
    collective's lent buffer), which is returned."""
    if out is not None and (out.dtype != dtype or out.numel() != y.numel() or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous, {dtype} and of {y.numel()} values")
    if y.dtype == torch.float32 and dtype in (torch.float16, torch.bfloat16) and y.device.type in ("cpu", "cuda"):
        impl = backend(y)  # raises where GRADZIP_KERNELS forces a version that cannot run here
        if impl is not reference:
            return impl.saturate(y, dtype, out)
    cast = reference.saturate(y, dtype)
    return cast if out is None else out.copy_(cast.reshape(out.shape))


def topk(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of the flat ``x`` largest in magnitude: ``(values, int64 indices)``.

    A radix select on the bits of ``|x|``, in C on CPU or in Triton on CUDA (indices ascending,
    ties to the lowest indices); elsewhere ``torch.topk`` of ``|x|`` (order unspecified). Ranks
    all run the same version, so they agree on ties.
    """
    choice = setting()
    if x.device.type == "cpu" and choice in ("auto", "native") and native.supports(x) and x.dtype in _TOPK_DTYPES:
        return native.topk(x, k)
    if x.device.type == "cpu" and choice == "auto" and native.available() is not None:
        _fallback("cpu", native.available())
    if x.device.type == "cuda" and choice in ("auto", "triton"):
        gpu = _gpu()
        if gpu is not None and gpu.available() is None and gpu.supports_topk(x):
            return gpu.topk(x, k)
        if choice == "auto" and (gpu is None or gpu.available() is not None):
            _fallback("cuda", gpu.available() if gpu else "no Triton kernels")
    _, idx = torch.topk(x.abs(), k, sorted=False)
    return x[idx], idx


# ------------------------------------------------------- FP8 and microscaling (MX) formats
MX_MAX_BLOCK = native.MAX_BUCKET  # the largest MX block the codecs accept


def fp8_encode(
    x: torch.Tensor, fmt: str, block: int, out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes and per-block fp32 scales (see :func:`.reference.fp8_encode`), into ``out``
    (codes, scales) if given."""
    impl = backend(x, 8, block)
    if impl is reference:
        return _into(out, reference.fp8_encode(x, fmt, block))
    return impl.fp8_encode(x, fmt, block, out)


def fp8_decode(codes, scales, fmt: str, block: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(codes, 8, block)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.fp8_decode(codes, scales, fmt, block, numel, o, a))


def _mx_bits(elem: str) -> int:
    return 4 if elem == "e2m1" else 8


def mx_encode(
    x: torch.Tensor, elem: str, block: int, out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX element codes and E8M0 scale codes (see :func:`.reference.mx_encode`), into ``out``
    (codes, scales) if given."""
    impl = backend(x, _mx_bits(elem), block)
    if impl is reference:
        return _into(out, reference.mx_encode(x, elem, block))
    return impl.mx_encode(x, elem, block, out)


def mx_decode(codes, scales, elem: str, block: int, numel: int, out=None, accumulate: bool = False) -> torch.Tensor:
    impl = backend(codes, _mx_bits(elem), block)
    return _decode_via(impl, out, accumulate, lambda o, a: impl.mx_decode(codes, scales, elem, block, numel, o, a))
