"""FP8 with per-block scales and the OCP Microscaling formats (``fp8``, ``mxfp8``, ``mxfp4``).

Rounding is checked against an oracle written here from the format definitions (float64 grids
of representable magnitudes, round to nearest with ties to the even code), not against torch's
own float8 casts; the fused C kernels (AVX-512 and portable loops) must give the bytes of the
torch specification in ``kernels/reference.py``. The Triton kernels are checked against the
same specification in ``tests/kernels/test_gpu.py``.
"""
from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import gradzip
from gradzip.codecs.base import raw_bytes
from gradzip.kernels import fused, native
from gradzip.kernels import reference as ref

from ..dist_utils import run_workers

FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny
HAVE_CC = any(shutil.which(cc) for cc in (os.environ.get("CC") or "cc", "gcc", "clang"))
needs_native = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine: the torch versions run")

# element format: (exponent bits, mantissa bits, bias, largest finite magnitude)
FORMATS = {"e4m3": (4, 3, 7, 448.0), "e5m2": (5, 2, 15, 57344.0), "e2m1": (2, 1, 1, 6.0)}
SPECS = [("fp8", {}), ("fp8", {"format": "e5m2"}), ("fp8", {"block_size": 7}), ("mxfp8", {}), ("mxfp4", {}),
         ("mxfp4", {"block_size": 64})]
SPEC_IDS = [n + "".join(f"-{k}{v}" for k, v in o.items()) for n, o in SPECS]
SIZES = [1, 2, 15, 16, 17, 31, 32, 33, 127, 129, 1001, 4097]


# ------------------------------------------------------------------------------------- oracle
def grid(elem: str) -> torch.Tensor:
    """Every finite non-negative magnitude of ``elem`` in code order (float64), from its definition."""
    ebits, mbits, bias, top = FORMATS[elem]
    vals = [m * 2.0 ** (1 - bias - mbits) for m in range(2**mbits)]  # zero and the subnormals
    for e in range(1, 2**ebits):
        vals += [(1 + m / 2**mbits) * 2.0 ** (e - bias) for m in range(2**mbits)]
    return torch.tensor([v for v in vals if v <= top], dtype=torch.float64)


def nearest_even(a: torch.Tensor, elem: str) -> torch.Tensor:
    """The representable magnitude nearest each ``a`` (float64, ``0 <= a <= max``); a tie goes to
    the even code."""
    g = grid(elem)
    hi = torch.searchsorted(g, a).clamp(max=len(g) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - g[lo], g[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return torch.where(pick_hi, g[hi], g[lo])


def mx_oracle(x: torch.Tensor, elem: str, block: int) -> torch.Tensor:
    """OCP MX v1.0 quantize-dequantize in float64: shared exponent floor(log2 amax) - emax."""
    emax = {"e4m3": 8, "e2m1": 2}[elem]
    top = FORMATS[elem][3]
    xd = x.reshape(-1).double()
    out = torch.empty_like(xd)
    for start in range(0, xd.numel(), block):
        b = xd[start:start + block]
        amax = b.abs().max().item()
        shared = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - emax))
        if amax != 0 and amax < 2.0**-126:  # a subnormal amax counts as 2**-127
            shared = -127
        scale = 2.0**shared
        out[start:start + block] = torch.sign(b) * nearest_even((b.abs() / scale).clamp(max=top), elem) * scale
    return out


def fp8_oracle(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """The fp8 codec's decode from its definition: fp32 ``s = max(amax / M, 2**-126)`` and
    ``v = x * (1 / s)``, then ``v`` rounded on the float64 grid and multiplied by ``s`` in fp32."""
    top = FORMATS[fmt][3]
    xf = x.reshape(-1).float()
    out = torch.empty_like(xf)
    for start in range(0, xf.numel(), block):
        b = xf[start:start + block]
        s = torch.clamp(b.abs().max() / torch.tensor(top), min=FLT_MIN)
        v = (b * torch.reciprocal(s)).clamp(-top, top).double()
        q = (torch.sign(v) * nearest_even(v.abs(), fmt)).float()
        out[start:start + block] = (q * s).clamp(-FLT_MAX, FLT_MAX)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (tells -0.0 from 0.0); NaN only where the other has NaN."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _wide(n: int, seed: int) -> torch.Tensor:
    """N(0, 1) values times log-normal magnitudes: twenty decades, so blocks hold values far
    below their maximum (element subnormals, underflow to zero)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 5)


def _midpoints(elem: str) -> torch.Tensor:
    """Every tie between neighbouring magnitudes of ``elem``, with both signs (float64)."""
    g = grid(elem)
    mids = (g[1:] + g[:-1]) / 2
    return torch.cat([mids, -mids])


# ------------------------------------------------------------------------- registry and options
def test_registered_with_metadata():
    names = gradzip.codecs.names()
    for name, block in (("fp8", 128), ("mxfp8", 32), ("mxfp4", 32)):
        assert name in names
        c = gradzip.codec(name)
        assert c.family == "quantization" and c.paper and type(c).__doc__ and "Wire" in type(c).__doc__
        assert c.collectives == ("sra", "allgather") and c.collective == "sra"
        assert c.fixed_size and not c.summable and not c.stochastic and c.reencodable and c.kernels_bit_exact
        assert c.default_memory == "none"
        assert c.block_size == block and c.fusion_block() == block
    assert "Rouhani" in gradzip.codec("mxfp4").paper and "FP8-LM" in gradzip.codec("fp8").paper
    assert gradzip.codec("fp8", format="e5m2", block_size=1).config() == {"format": "e5m2", "block_size": 1}
    assert gradzip.codec("mxfp8", block_size=64).fusion_block() == 64


@pytest.mark.parametrize(
    "name,opts",
    [("fp8", {"format": "e3m4"}), ("fp8", {"block_size": 0}), ("fp8", {"block_size": 2.0}), ("fp8", {"bits": 8}),
     ("mxfp8", {"block_size": 48}), ("mxfp4", {"block_size": 16}), ("mxfp4", {"block_size": 0}),
     ("mxfp8", {"format": "e5m2"})],
)
def test_bad_options_raise(name, opts):
    with pytest.raises(ValueError):
        gradzip.codec(name, **opts)


# ----------------------------------------------------------------------------------- wire bytes
def _formula(name: str, opts: Dict, n: int) -> int:
    block = opts.get("block_size", 128 if name == "fp8" else 32)
    blocks = -(-n // block)
    if name == "fp8":
        return n + 4 * blocks
    return (n if name == "mxfp8" else (n + 1) // 2) + blocks


@pytest.mark.parametrize("name,opts", SPECS, ids=SPEC_IDS)
def test_wire_bytes_are_the_formula(name, opts):
    c = gradzip.codec(name, **opts)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in SIZES + [0, 3, 100]:
            want = 0 if n == 0 else min(_formula(name, opts, n), raw_bytes(n, dtype))
            assert c.wire_bytes(n, dtype) == want, (dtype, n)
            p = c.encode(_wide(n, n).to(dtype))
            assert p.nbytes == want, (dtype, n)
    # 1 M fp32 values: 8.25, 8.25 and 4.25 bits per value with the defaults
    bits = [gradzip.codec(n).wire_bytes(1 << 20) * 8 / (1 << 20) for n in ("fp8", "mxfp8", "mxfp4")]
    assert bits == [8.25, 8.25, 4.25]


def test_payload_layout():
    x = _wide(100, 1)
    p = gradzip.codec("fp8").encode(x)
    assert [(t.dtype, t.numel()) for t in p.tensors] == [(torch.uint8, 100), (torch.float32, 1)]
    p = gradzip.codec("mxfp8").encode(x)
    assert [(t.dtype, t.numel()) for t in p.tensors] == [(torch.uint8, 100), (torch.uint8, 4)]
    p = gradzip.codec("mxfp4").encode(x[:99])
    assert [(t.dtype, t.numel()) for t in p.tensors] == [(torch.uint8, 50), (torch.uint8, 4)]


# ------------------------------------------------------------------------- values and rounding
@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("elem,name", [("e4m3", "mxfp8"), ("e2m1", "mxfp4")])
def test_mx_matches_the_oracle(monkeypatch, kernels, elem, name):
    if kernels == "native" and not HAVE_CC:
        pytest.skip("no C compiler")
    monkeypatch.setenv("GRADZIP_KERNELS", kernels)
    for block in (32, 64):
        c = gradzip.codec(name, block_size=block)
        for n in SIZES:
            x = _wide(n, seed=n + block)
            y = c.decode(c.encode(x))
            assert torch.equal(y.double(), mx_oracle(x, elem, block)), (n, block)


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_matches_the_oracle(monkeypatch, kernels, fmt):
    if kernels == "native" and not HAVE_CC:
        pytest.skip("no C compiler")
    monkeypatch.setenv("GRADZIP_KERNELS", kernels)
    for block in (1, 2, 7, 32, 128):
        c = gradzip.codec("fp8", format=fmt, block_size=block)
        for n in SIZES:
            x = _wide(n, seed=3 * n + block)
            # more bytes than fp32 itself (a block of one value, or a single value): sent as it is
            want = x if n + 4 * -(-n // block) > 4 * n else fp8_oracle(x, fmt, block)
            assert _same_bits(c.decode(c.encode(x)), want), (n, block)


def _under_top(vals: torch.Tensor, top: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``vals`` in blocks of 32 whose first value is ``top`` (so every block's maximum is the
    format's largest value), and the mask of where ``vals`` went."""
    pieces, mask = [], []
    for start in range(0, vals.numel(), 31):
        piece = vals[start:start + 31]
        pieces += [torch.tensor([top], dtype=vals.dtype), piece]
        mask += [torch.zeros(1, dtype=torch.bool), torch.ones(piece.numel(), dtype=torch.bool)]
    return torch.cat(pieces), torch.cat(mask)


ELEMENT_CODECS = [
    ("fp8", "e4m3", {}), ("fp8", "e5m2", {"format": "e5m2"}), ("mxfp8", "e4m3", {}), ("mxfp4", "e2m1", {}),
]


@pytest.mark.parametrize("name,elem,opts", ELEMENT_CODECS)
def test_ties_round_to_the_even_code(name, elem, opts):
    """A block whose maximum is the format's largest value has scale 1 in all three codecs, so
    its values are rounded as they are: every midpoint goes to its even neighbour."""
    top = FORMATS[elem][3]
    x64, mask = _under_top(_midpoints(elem), top)
    x = x64.float()
    assert torch.equal(x.double(), x64)  # the midpoints are exact in fp32
    c = gradzip.codec(name, **opts, block_size=32)
    y = c.decode(c.encode(x)).double()
    want = torch.sign(x64) * nearest_even(x64.abs(), elem)
    assert torch.equal(y, want)
    codes = torch.searchsorted(grid(elem), y[mask].abs())
    assert bool((codes % 2 == 0).all()), "a tie went to an odd code"


@pytest.mark.parametrize("name,elem,opts", ELEMENT_CODECS)
@pytest.mark.parametrize("exponent", [-127, -30, 0, 20, 100])
def test_representable_values_round_trip_exactly(name, elem, opts, exponent):
    """Every element value (subnormals of the element format included) times a power of two, in
    blocks holding the format's largest value times the same power, comes back exactly; at
    2**-127 (MX's smallest scale; fp8's is 2**-126, so it gets 2**-120) they are fp32 subnormals."""
    top = FORMATS[elem][3]
    g = grid(elem)
    if name == "fp8":
        exponent = max(exponent, -120)
    scale = 2.0**exponent
    x64, _ = _under_top(torch.cat([g, -g]) * scale, top * scale)
    x = x64.float()
    assert torch.equal(x.double(), x64)
    c = gradzip.codec(name, **opts, block_size=32)
    assert torch.equal(c.decode(c.encode(x)), x)


def _error_bound(x: torch.Tensor, elem: str, scale: torch.Tensor) -> torch.Tensor:
    """Half an element step at ``|x| / scale``, times the scale (the rounding error of a value)."""
    _, mbits, bias, _ = FORMATS[elem]
    v = (x.double().abs() / scale).clamp(min=2.0 ** (1 - bias))  # below the smallest normal: the subnormal step
    step = 2.0 ** (torch.floor(torch.log2(v)) - mbits)
    return step / 2 * scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_error_is_half_a_step_of_the_block_scale(fmt):
    top = FORMATS[fmt][3]
    block = 128
    for n in (1, 127, 1000, 5001):
        x = _wide(n, seed=n)
        y = gradzip.codec("fp8", format=fmt).decode(gradzip.codec("fp8", format=fmt).encode(x))
        for start in range(0, n, block):
            b, yb = x[start:start + block].double(), y[start:start + block].double()
            s = torch.tensor(max(b.abs().max().item() / top, FLT_MIN), dtype=torch.float64)
            bound = _error_bound(b, fmt, s) * (1 + 2**-20) + 4 * 2**-24 * b.abs()
            assert bool(((yb - b).abs() <= bound).all()), start
            # relative to the block's maximum: 2**-4 (e4m3) or 2**-3 (e5m2) at worst
            assert (yb - b).abs().max() <= 2.0 ** -(FORMATS[fmt][1] + 1) * b.abs().max() * (1 + 1e-6)


@pytest.mark.parametrize("name,elem", [("mxfp8", "e4m3"), ("mxfp4", "e2m1")])
def test_mx_error_is_half_a_step_or_the_saturation(name, elem):
    _, mbits, _, top = FORMATS[elem]
    c = gradzip.codec(name)
    x = _wide(4096, seed=7)
    y = c.decode(c.encode(x)).double()
    xd = x.double()
    for start in range(0, 4096, 32):
        b, yb = xd[start:start + 32], y[start:start + 32]
        shared = math.frexp(b.abs().max().item())[1] - 1 - {"e4m3": 8, "e2m1": 2}[elem]
        scale = torch.tensor(2.0 ** max(shared, -127), dtype=torch.float64)
        over = (b.abs() - top * scale).clamp(min=0)  # the top of the range saturates (the spec's choice)
        assert bool(((yb - b).abs() <= torch.maximum(_error_bound(b, elem, scale), over)).all())
        assert bool((yb.abs() <= top * scale).all())


@pytest.mark.parametrize("name,opts", SPECS, ids=SPEC_IDS)
def test_saturation_and_extremes_stay_finite(name, opts):
    c = gradzip.codec(name, **opts)
    cases = [
        torch.tensor([FLT_MAX, -FLT_MAX, 1.0, 0.0] * 16),
        torch.full((64,), FLT_MAX),
        torch.tensor([3e38, -2e38, 1e-45, -1e-40] * 16),
        torch.full((100,), 1e-45),  # fp32 subnormals only
        torch.tensor([FLT_MIN, -FLT_MIN / 3, 0.0, 2e-39] * 16),
    ]
    for x in cases:
        y = c.decode(c.encode(x))
        assert torch.isfinite(y).all() and bool((y.abs() <= x.abs().max() * (1 + 2**-20) + 1e-45).all())
        assert bool((torch.sign(y) * torch.sign(x) >= 0).all()), "a value changed sign"
    for dtype in (torch.float16, torch.bfloat16):
        big = torch.finfo(dtype).max
        x = torch.tensor([big, -big, big / 3, 1.0] * 40, dtype=dtype)
        y = c.decode(c.encode(x))
        assert y.dtype == dtype and torch.isfinite(y).all()


def test_mx_saturates_the_top_of_the_range():
    # 500 lies in [448, 512): the shared exponent is 0, and 500 is sent as 448
    y = gradzip.codec("mxfp8").decode(gradzip.codec("mxfp8").encode(torch.tensor([500.0, 1.0, -480.0])))
    assert y.tolist() == [448.0, 1.0, -448.0]
    y = gradzip.codec("mxfp4").decode(gradzip.codec("mxfp4").encode(torch.tensor([7.5, -7.0, 1.0, 0.7])))
    assert y.tolist() == [6.0, -6.0, 1.0, 0.5]


@pytest.mark.parametrize("name,opts", SPECS, ids=SPEC_IDS)
def test_zero_blocks(name, opts):
    c = gradzip.codec(name, **opts)
    block = c.block_size
    x = torch.cat([torch.zeros(block), _wide(block, 1), -torch.zeros(3 * block + 5)])
    p = c.encode(x)
    y = c.decode(p)
    assert torch.isfinite(y).all()
    assert torch.equal(y[:block], torch.zeros(block)) and bool((y[2 * block:] == 0).all())
    assert torch.equal(torch.signbit(y[2 * block:]), torch.signbit(x[2 * block:]))  # -0.0 stays -0.0
    scales = p.tensors[1]
    if name == "fp8":
        assert scales[0].item() == FLT_MIN  # floored: 1 / s stays finite
    else:
        assert scales[0].item() == 0 and scales[-1].item() == 0  # E8M0 code 0: 2**-127


@pytest.mark.parametrize("name,opts", SPECS, ids=SPEC_IDS)
def test_shapes_dtypes_and_views(name, opts):
    c = gradzip.codec(name, **opts)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for shape in ((1,), (7,), (33, 17), (3, 5, 7), (0,), (0, 4)):
            x = _wide(math.prod(shape), seed=len(shape)).clamp(-1e4, 1e4).to(dtype).reshape(shape)
            y = c.decode(c.encode(x))
            assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
            if x.numel():
                want = c.decode(c.encode(x.float())).to(dtype)  # a 16-bit input is encoded from its fp32 value
                assert torch.equal(y, want) or dtype == torch.float64
    base = _wide(17 * 33, seed=3).reshape(17, 33)
    for view in (base.T, base[:, ::3], base.reshape(-1)[::2]):
        assert not view.is_contiguous()
        assert torch.equal(c.decode(c.encode(view)), c.decode(c.encode(view.contiguous())))


@pytest.mark.parametrize("name,opts", SPECS, ids=SPEC_IDS)
def test_non_finite_input_decodes_without_error(name, opts):
    c = gradzip.codec(name, **opts)
    block = c.block_size
    x = _wide(4 * block, seed=2)
    x[block + 1] = float("nan")
    x[2 * block + 2] = float("inf")
    y = c.decode(c.encode(x))
    assert y.shape == x.shape and not torch.isfinite(y).all()
    clean = torch.cat([torch.arange(block), torch.arange(3 * block, 4 * block)])  # untouched blocks
    assert torch.isfinite(y[clean]).all()
    assert torch.equal(y[clean], c.decode(c.encode(x[clean])))
    if name != "fp8":
        assert c.encode(x).tensors[1][1:3].tolist() == [255, 255]  # E8M0 NaN


@pytest.mark.parametrize("name,opts", SPECS, ids=SPEC_IDS)
def test_decode_into_prefix_accumulate_and_16_bit(name, opts):
    c = gradzip.codec(name, **opts)
    x = _wide(1001, seed=4)
    p = c.encode(x)
    full = c.decode(p)
    out = torch.full((1001,), 3.0)
    c.decode_into(p, out)
    assert torch.equal(out, full)
    acc = torch.ones(1001)
    c.decode_into(p, acc, accumulate=True)
    assert torch.equal(acc, torch.ones(1001) + full)
    prefix = torch.empty(500)
    c.decode_into(p, prefix)
    assert torch.equal(prefix, full[:500])
    half = torch.empty(1001, dtype=torch.float16)
    c.decode_into(p, half)
    assert torch.isfinite(half).all() and torch.equal(half, full.clamp(-65504, 65504).half())


def test_aggregate_averages_decodes():
    for name in ("fp8", "mxfp8", "mxfp4"):
        c = gradzip.codec(name)
        xs = [_wide(333, seed=s) for s in range(3)]
        ps = [c.encode(x, name="g", step=0) for x in xs]
        want = (c.decode(ps[0]) + c.decode(ps[1]) + c.decode(ps[2])) / 3
        assert torch.equal(c.aggregate(ps), want)


# -------------------------------------------------------------------- fused C kernels vs torch
def _hard_inputs(n: int, seed: int, elem: str) -> List[torch.Tensor]:
    """Random wide-range values, ties and subnormals of the element format at unit scale, the
    saturating top of MX's range, fp32 subnormals, zeros and signed zeros."""
    top = FORMATS[elem][3]
    g = torch.Generator().manual_seed(seed)
    mids = _midpoints(elem).float()
    grid_vals = grid(elem).float()
    pick = lambda pool: pool[torch.randint(len(pool), (n,), generator=g)]  # noqa: E731
    ties = pick(torch.cat([mids, grid_vals, -grid_vals]))
    ties[::32] = top  # every 32-block has the format's maximum: scale 1 for all three codecs
    sat = pick(torch.tensor([top, top * 1.1, -top * 1.14, top * 0.999, 1.0, -0.0, 0.0]))
    tiny = pick(torch.tensor([1e-45, -3e-45, 1e-40, -2e-39, FLT_MIN, 0.0, -0.0]))
    scaled = _wide(n, seed) * 2.0 ** torch.randint(-60, 60, (n,), generator=g).float()
    return [_wide(n, seed), ties, ties * 2.0**-100, sat, tiny, scaled, torch.zeros(n)]


@needs_native
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_native_is_bit_identical(fmt):
    for n in (1, 31, 33, 1000, 4099):
        for block in (1, 7, 32, 100, 128, 1024):
            for x in _hard_inputs(n, n + block, fmt):
                want = ref.fp8_encode(x, fmt, block)
                got = native.fp8_encode(x, fmt, block)
                assert torch.equal(got[0], want[0]) and _same_bits(got[1], want[1]), (n, block)
                dec = ref.fp8_decode(*want, fmt, block, n)
                assert _same_bits(native.fp8_decode(*want, fmt, block, n), dec)
                assert torch.isfinite(dec).all()


@needs_native
@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
def test_mx_native_is_bit_identical(elem):
    for n in (1, 31, 33, 1000, 4099):
        for block in (32, 64, 96, 4096):
            for x in _hard_inputs(n, n + block, elem):
                want = ref.mx_encode(x, elem, block)
                got = native.mx_encode(x, elem, block)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (n, block)
                assert _same_bits(native.mx_decode(*want, elem, block, n), ref.mx_decode(*want, elem, block, n))


@needs_native
def test_every_code_decodes_like_the_specification():
    """All 256 fp8 codes under several scales; all 16 e2m1 codes under every E8M0 scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4)
    for fmt in ("e4m3", "e5m2"):
        scales = torch.tensor([1.0, FLT_MIN, 3.7e-20, FLT_MAX / 448, float("nan"), float("inf")] * 171)[:1024]
        for block in (1, 256):
            s = scales[: -(-1024 // block)]
            assert _same_bits(native.fp8_decode(codes, s, fmt, block, 1024), ref.fp8_decode(codes, s, fmt, block, 1024))
    e8m0 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    nibbles = torch.arange(16, dtype=torch.uint8)
    packed4 = (nibbles[0::2] | (nibbles[1::2] << 4)).repeat(2 * 256)  # 16 codes, twice per block of 32
    n = 256 * 32
    assert _same_bits(native.mx_decode(packed4, e8m0, "e2m1", 32, n), ref.mx_decode(packed4, e8m0, "e2m1", 32, n))
    codes8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(32)  # each block: 32 codes
    assert _same_bits(native.mx_decode(codes8, e8m0, "e4m3", 32, n), ref.mx_decode(codes8, e8m0, "e4m3", 32, n))


@needs_native
@pytest.mark.parametrize("impl", [native, ref], ids=["native", "torch"])
def test_kernels_decode_into_out_accumulate_and_prefix(impl):
    x = _wide(3001, seed=9)
    for fmt, enc, dec in (("e4m3", impl.fp8_encode, impl.fp8_decode), ("e5m2", impl.fp8_encode, impl.fp8_decode),
                          ("e4m3", impl.mx_encode, impl.mx_decode), ("e2m1", impl.mx_encode, impl.mx_decode)):
        block = 64
        p = enc(x, fmt, block)
        plain = dec(*p, fmt, block, 3001)
        base = torch.randn(3001)
        acc = base.clone()
        assert dec(*p, fmt, block, 3001, acc, True).data_ptr() == acc.data_ptr()
        assert torch.equal(acc, base + plain)
        prefix = torch.empty(1501)
        dec(*p, fmt, block, 1501, prefix)
        assert torch.equal(prefix, plain[:1501])


@needs_native
def test_native_takes_other_dtypes_and_views():
    x = _wide(4096 * 2, seed=1).clamp(-6e4, 6e4).view(2, 4096).t()[:, 0]
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        y = x.to(dtype)
        assert all(torch.equal(a, b) for a, b in zip(native.mx_encode(y, "e2m1", 32), ref.mx_encode(y, "e2m1", 32)))
        got, want = native.fp8_encode(y, "e4m3", 128), ref.fp8_encode(y, "e4m3", 128)
        assert torch.equal(got[0], want[0]) and _same_bits(got[1], want[1])


@needs_native
@pytest.mark.parametrize("name,opts", SPECS, ids=SPEC_IDS)
def test_codecs_give_the_same_payload_on_either_kernel(monkeypatch, name, opts):
    x = _wide(5000, seed=3)
    payloads = {}
    for setting in ("native", "torch"):
        monkeypatch.setenv("GRADZIP_KERNELS", setting)
        assert fused.name(x, 4 if name == "mxfp4" else 8, opts.get("block_size", 32)) == setting
        c = gradzip.codec(name, **opts)
        p = c.encode(x, name="w")
        payloads[setting] = (p, c.decode(p))
    (pn, yn), (pt, yt) = payloads["native"], payloads["torch"]
    assert all(_same_bits(a.float(), b.float()) for a, b in zip(pn.tensors, pt.tensors))
    assert _same_bits(yn, yt)


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory):
    """native.c built without its AVX-512 rows (-DGZ_PORTABLE): the loops other CPUs run."""
    if not HAVE_CC:
        pytest.skip("no C compiler")
    cc = native._compiler()
    target = tmp_path_factory.mktemp("portable") / "native-portable.so"
    cmd = [cc, *native.FLAGS, "-DGZ_PORTABLE", str(native._SOURCE), "-o", str(target), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = ctypes.CDLL(str(target))
    for fname, argtypes in native._SIGNATURES.items():
        fn = getattr(lib, fname)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def _portable(lib, kind: str, x: torch.Tensor, fmt: str, block: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode with the portable library, then decode what it encoded."""
    x = x.float().contiguous()
    n = x.numel()
    if kind == "fp8":
        fid = {"e4m3": 0, "e5m2": 1}[fmt]
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // block))
        lib.gz_fp8_encode(x.data_ptr(), n, fid, block, codes.data_ptr(), scales.data_ptr())
        out = torch.empty(n)
        lib.gz_fp8_decode(codes.data_ptr(), scales.data_ptr(), n, fid, block, out.data_ptr(), 0)
    else:
        fid = {"e4m3": 0, "e2m1": 1}[fmt]
        codes = torch.empty(n if fmt == "e4m3" else (n + 1) // 2, dtype=torch.uint8)
        scales = torch.empty(-(-n // block), dtype=torch.uint8)
        lib.gz_mx_encode(x.data_ptr(), n, fid, block, codes.data_ptr(), scales.data_ptr())
        out = torch.empty(n)
        lib.gz_mx_decode(codes.data_ptr(), scales.data_ptr(), n, fid, block, out.data_ptr(), 0)
    return codes, scales, out


@pytest.mark.parametrize("kind,fmt", [("fp8", "e4m3"), ("fp8", "e5m2"), ("mx", "e4m3"), ("mx", "e2m1")])
def test_portable_c_is_bit_identical(portable_lib, kind, fmt):
    for n in (1, 33, 1000, 4099):
        for block in ((7, 128) if kind == "fp8" else (32, 96)):
            for x in _hard_inputs(n, 2 * n + block, fmt):
                codes, scales, out = _portable(portable_lib, kind, x, fmt, block)
                enc = ref.fp8_encode if kind == "fp8" else ref.mx_encode
                dec = ref.fp8_decode if kind == "fp8" else ref.mx_decode
                want = enc(x, fmt, block)
                assert torch.equal(codes, want[0]) and _same_bits(scales.float(), want[1].float()), (n, block)
                assert _same_bits(out, dec(*want, fmt, block, n))


# --------------------------------------------------------------- two gloo ranks, sra and allgather
def _through_communicator(rank: int, world: int) -> dict:
    out = {}
    for name, opts in SPECS:
        for coll in ("sra", "allgather"):
            comm = gradzip.Communicator(name, collective=coll, **opts)
            x = _wide(37 * 29, seed=100 + rank).reshape(37, 29) * (1 + rank)
            avg = comm.allreduce(x, name="w")
            avgs = [torch.empty_like(avg) for _ in range(world)]
            dist.all_gather(avgs, avg.contiguous())
            codec = gradzip.codec(name, **opts)
            own = codec.decode(codec.encode(x, name="w", step=0))
            owns = [torch.empty_like(own) for _ in range(world)]
            dist.all_gather(owns, own.contiguous())
            out[(name, str(opts), coll)] = {
                "identical": all(torch.equal(avgs[0], a) for a in avgs),
                "avg": avg,
                "owns": torch.stack(owns),
                "wire": comm.stats()["wire_bytes"],
            }
            comm.close()
    return out


def test_communicator_sra_and_allgather_on_two_ranks():
    results = run_workers(_through_communicator, 2)
    # the largest error of one encode relative to the largest |value|: half an element step at
    # the top of the range (fp8), or MX's saturation of [M, 2M') to M
    rel = {"fp8": 2**-3, "mxfp8": 2**-3, "mxfp4": 2**-2}
    for key, rec in results[0].items():
        name, _, coll = key
        assert all(r[key]["identical"] and torch.equal(r[key]["avg"], rec["avg"]) for r in results), key
        mean = rec["owns"].mean(0)
        err = (rec["avg"] - mean).abs().max().item()
        if coll == "allgather":  # the average of the decoded payloads, exactly
            assert torch.equal(rec["avg"], (rec["owns"][0] + rec["owns"][1]) / 2), key
        else:  # sra quantizes the averaged chunk once more
            assert err <= rel[name] * mean.abs().max().item() * (1 + 1e-6), (key, err)
        assert torch.isfinite(rec["avg"]).all()
        assert rec["wire"] > 0
