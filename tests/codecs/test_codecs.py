"""Single-process unit tests of every codec, the error-feedback memories and Config.with_env.

Generic tests are parametrised over ``gradzip.codecs.names()``, so a newly registered codec is
covered without editing this file.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import Payload
from gradzip.config import Config
from gradzip.sync.memory import EFSignMemory, Memory, ResidualMemory, memory

from ..tensors import LargestMade
from ..tensors import randn as _randn

NAMES = gradzip.codecs.names()
SHAPES = [(1,), (7,), (1001,), (33, 17), (3, 5, 7), (0,), (0, 4)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAJORITY_VOTE = {"signsgd", "signum"}  # aggregate is a vote, not the mean of the decodes
# data-dependent payloads whose bound is the raw size, their dense form (the family test files
# measure them): everything may pass the threshold, or be tagged raw
RAW_BOUND = {"threshold", "graddrop", "inceptionn"}

# every codec with its defaults, plus option settings whose wire format differs
CONFIGS: List[Tuple[str, Dict[str, Any]]] = [(n, {}) for n in NAMES]
CONFIGS += [("maxmin", {"bits": b, "bucket_size": s}) for b in range(1, 9) for s in (1, 7, 1024)]
CONFIGS += [("qsgd", {"bits": b, "bucket_size": s}) for b in range(2, 9) for s in (1, 7, 512)]
CONFIGS += [("fp8", {"format": f, "block_size": s}) for f in ("e4m3", "e5m2") for s in (1, 7, 128)]
CONFIGS += [("mxfp8", {"block_size": 64}), ("mxfp4", {"block_size": 32}), ("mxfp4", {"block_size": 96})]
CONFIGS += [("topk", {"ratio": r}) for r in (0.3, 1.0)]
CONFIGS += [("randomk", {"ratio": r, "scale": True}) for r in (0.5, 1.0)]
CONFIG_IDS = [n + "".join(f"-{k}{v}" for k, v in o.items()) for n, o in CONFIGS]


def _payload_bytes(p: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in p.tensors)


def _round_trip(c, x, name="t", step=0):
    return c.decode(c.encode(x, name=name, step=step))


# ====================================================================== generic round trip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_shape_dtype(name, shape, dtype):
    c = gradzip.codec(name)
    x = _randn(shape, dtype, seed=len(shape) * 100 + sum(shape))
    before = x.clone()
    y = _round_trip(c, x)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    assert y.device == x.device
    assert torch.isfinite(y).all()
    assert torch.equal(x, before), "encode/decode modified its input"


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_float64(name):
    x = _randn((33, 17), torch.float64)
    y = _round_trip(gradzip.codec(name), x)
    assert y.shape == x.shape and y.dtype == torch.float64


@pytest.mark.parametrize("name", NAMES)
def test_empty_payload_has_no_bytes(name):
    c = gradzip.codec(name)
    for shape in [(0,), (0, 4), (4, 0)]:
        p = c.encode(torch.empty(shape))
        assert _payload_bytes(p) == 0 == c.wire_bytes(0, torch.float32, shape=shape)
        assert c.decode(p).shape == shape


def _non_contiguous_views():
    base = _randn((17, 33), seed=11)
    flat = _randn((2003,), seed=12)
    return {
        "transposed": base.T,  # (33, 17)
        "strided-slice": flat[::2],  # (1002,)
        "column-slice": base[:, ::3],  # (17, 11)
    }


@pytest.mark.parametrize("view", ["transposed", "strided-slice", "column-slice"])
@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_input(name, view):
    x = _non_contiguous_views()[view]
    assert not x.is_contiguous()
    before = x.clone()
    # fresh instances with the same seed draw the same random streams, so every codec
    # (stochastic ones too) must give bit-identical results for the view and its copy
    y_view = _round_trip(gradzip.codec(name), x)
    y_copy = _round_trip(gradzip.codec(name), x.contiguous())
    assert y_view.shape == x.shape and y_view.dtype == x.dtype
    assert torch.equal(y_view, y_copy)
    assert torch.equal(x, before)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_codecs_repeat(name):
    c = gradzip.codec(name)
    if c.stochastic:
        pytest.skip("stochastic codec: covered by the unbiasedness tests")
    x = _randn((33, 17), seed=3)
    assert torch.equal(_round_trip(c, x, step=5), _round_trip(gradzip.codec(name), x, step=5))


@pytest.mark.parametrize("name", NAMES)
def test_aggregate_is_mean_of_decodes(name):
    if name in MAJORITY_VOTE:
        pytest.skip("majority vote: tested separately")
    c = gradzip.codec(name)
    xs = [_randn((1001,), seed=s) for s in range(3)]
    payloads = [c.encode(x, name="g", step=0) for x in xs]
    expected = sum(c.decode(p).float() for p in payloads) / 3
    out = c.aggregate(payloads)
    assert out.shape == xs[0].shape and out.dtype == xs[0].dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1001,), (33, 17)], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_summable_payloads_sum(name, shape):
    """A plain all-reduce of single-round summable payloads must decode to the sum of decodes."""
    c = gradzip.codec(name)
    if not c.summable:
        pytest.skip("not summable")
    probe = c.encode(_randn(shape), name="probe", step=0)
    if c.next_round(probe, [t.clone() for t in probe.tensors]) is not None:
        pytest.skip("multi-round codec (PowerSGD): tested separately")
    x1, x2 = _randn(shape, seed=1), _randn(shape, seed=2)
    p1 = c.encode(x1, name="g", step=4)
    p2 = gradzip.codec(name).encode(x2, name="g", step=4)
    summed = Payload([(a.float() + b.float()).to(a.dtype) for a, b in zip(p1.tensors, p2.tensors)], p1.ctx)
    expected = c.decode(p1).float() + c.decode(p2).float()
    torch.testing.assert_close(c.decode(summed).float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", NAMES)
def test_codec_metadata(name):
    c = gradzip.codec(name)
    assert c.name == name
    assert c.collective == c.collectives[0]
    assert set(c.collectives) <= set(gradzip.comm.names())
    if "allreduce" in c.collectives:
        assert c.summable
    assert name in repr(c) or type(c).__name__ in repr(c)
    assert gradzip.codec(c) is c  # an instance passes through
    assert gradzip.codec(name, **c.config()).config() == c.config()


@pytest.mark.parametrize("name", NAMES)
def test_step_counter_state_dict(name):
    c = gradzip.codec(name)
    x = _randn((1001,))
    assert [c.encode(x, name="a").ctx.step for _ in range(3)] == [0, 1, 2]
    assert c.encode(x, name="b").ctx.step == 0
    c2 = gradzip.codec(name)
    c2.load_state_dict(c.state_dict())
    assert c2.encode(x, name="a").ctx.step == 3
    assert c2.encode(x, name="b").ctx.step == 1


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_integer_tensor_raises_type_error(name, dtype):
    with pytest.raises(TypeError):
        gradzip.codec(name).encode(torch.ones(16, dtype=dtype))


# ============================================================================= wire bytes
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name,opts", CONFIGS, ids=CONFIG_IDS)
def test_wire_bytes_match_payload(name, opts, shape, dtype):
    if name == "powersgd":
        pytest.skip("two all-reduce rounds: test_powersgd_wire_bytes")
    c = gradzip.codec(name, **opts)
    x = _randn(shape, dtype, seed=7)
    p = c.encode(x, name="w")
    _check_wire_bytes(c, p, x.numel(), dtype, shape)
    assert p.nbytes == _payload_bytes(p)


def _check_wire_bytes(c, p, numel, dtype, shape):
    """Exact for fixed-size codecs; an upper bound for codecs whose payload depends on the data."""
    if c.fixed_size:
        assert _payload_bytes(p) == c.wire_bytes(numel, dtype, shape=shape)
    else:
        assert _payload_bytes(p) <= c.wire_bytes(numel, dtype, shape=shape)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    cfg=st.sampled_from(CONFIGS),
    dtype=st.sampled_from(DTYPES),
)
def test_wire_bytes_match_payload_any_size(n, cfg, dtype):
    name, opts = cfg
    c = gradzip.codec(name, **opts)
    x = _randn((n,), dtype, seed=n)
    p = c.encode(x, name="w")
    _check_wire_bytes(c, p, n, dtype, (n,))


def test_powersgd_wire_bytes():
    c = gradzip.codec("powersgd", rank=2)
    n, m, r = 33, 17, 2
    x = _randn((n, m))
    p1 = c.encode(x, name="w")
    assert _payload_bytes(p1) == n * r * 4  # P: n x r, fp32
    p2 = c.next_round(p1, [p1.tensors[0].clone()])
    assert p2 is not None and _payload_bytes(p2) == m * r * 4  # Q: m x r, fp32
    assert c.next_round(p2, [p2.tensors[0].clone()]) is None
    assert c.wire_bytes(n * m, torch.float32, shape=(n, m)) == (n + m) * r * 4
    # (3, 5, 7) is viewed as 3 x 35; in fp16 its fp32 factors would exceed the raw size
    assert c.wire_bytes(105, torch.float32, shape=(3, 5, 7)) == (3 + 35) * 2 * 4
    assert c.wire_bytes(105, torch.float16, shape=(3, 5, 7)) == 105 * 2
    assert c.wire_bytes(33 * 100, torch.float16, shape=(33, 100)) == (33 + 100) * 2 * 4
    # 1-D, no shape, and matrices too small to gain pass through uncompressed
    for shape, dtype in [((1001,), torch.float32), ((1001,), torch.bfloat16), ((3, 3), torch.float16)]:
        numel = math.prod(shape)
        x = _randn(shape, dtype)
        p = c.encode(x, name="v")
        assert _payload_bytes(p) == c.wire_bytes(numel, dtype, shape=shape) == numel * x.element_size()
    assert c.wire_bytes(1001, torch.float32) == 1001 * 4


@pytest.mark.parametrize("name", NAMES)
def test_wire_bytes_smaller_than_raw(name):
    n, shape = 1 << 20, (1024, 1024)
    c = gradzip.codec(name)
    wire32 = c.wire_bytes(n, torch.float32, shape=shape)
    wire16 = c.wire_bytes(n, torch.float16, shape=shape)
    if name == "none":
        assert wire32 == 4 * n and wire16 == 2 * n
        return
    if name in RAW_BOUND:
        assert wire32 == 4 * n and wire16 == 2 * n
        return
    assert wire32 < 4 * n
    if name in ("fp16", "bf16"):
        assert wire16 == 2 * n
    else:
        assert wire16 < 2 * n


# ================================================================================ max-min
def _per_bucket(x: torch.Tensor, bucket: int) -> torch.Tensor:
    pad = (-x.numel()) % bucket
    if pad:
        x = torch.cat([x, x[-1:].expand(pad)])
    return x.view(-1, bucket)


def _check_maxmin_bound(x: torch.Tensor, bits: int, bucket: int, mode: str) -> None:
    c = gradzip.codec("maxmin", bits=bits, bucket_size=bucket, mode=mode)
    y = _round_trip(c, x)
    xb, yb = _per_bucket(x.double(), bucket), _per_bucket(y.double(), bucket)
    lo, hi = xb.min(dim=1).values, xb.max(dim=1).values
    step = (hi - lo) / ((1 << bits) - 1)
    tol = 1e-6 * (lo.abs() + hi.abs()) + 1e-30
    err = (yb - xb).abs().max(dim=1).values
    limit = step / 2 if mode == "nearest" else step
    bad = err > limit + tol
    assert not bad.any(), f"bucket {bad.nonzero()[0].item()}: error {err[bad][0]} > {limit[bad][0]}"
    # decoded values stay inside their bucket's range
    assert (yb >= lo[:, None] - tol[:, None]).all() and (yb <= hi[:, None] + tol[:, None]).all()


@pytest.mark.parametrize("mode", ["stochastic", "nearest"])
@pytest.mark.parametrize("bucket", [1, 7, 1024])
@pytest.mark.parametrize("bits", range(1, 9))
def test_maxmin_error_bound(bits, bucket, mode):
    x = _randn((3001,), seed=bits) * 3 + 1
    x[100:200] *= 100  # buckets with very different ranges
    _check_maxmin_bound(x, bits, bucket, mode)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 2500),
    bits=st.integers(1, 8),
    bucket=st.integers(1, 600),
    mode=st.sampled_from(["stochastic", "nearest"]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 10_000),
)
def test_maxmin_error_bound_any_size(n, bits, bucket, mode, scale, seed):
    _check_maxmin_bound(_randn((n,), seed=seed) * scale, bits, bucket, mode)


@pytest.mark.parametrize("mode", ["stochastic", "nearest"])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_maxmin_constant_exact(bits, mode):
    for value in (0.0, 0.3, -7.25, 1e-20):
        for n in (1, 7, 1001):
            x = torch.full((n,), value)
            c = gradzip.codec("maxmin", bits=bits, bucket_size=64, mode=mode)
            assert torch.equal(_round_trip(c, x), x)
    # one constant bucket inside a tensor with other ranges
    x = _randn((64 * 3,))
    x[64:128] = 0.7
    y = _round_trip(gradzip.codec("maxmin", bits=bits, bucket_size=64, mode=mode), x)
    assert torch.equal(y[64:128], x[64:128])


def test_maxmin_bucket_extremes_exact_when_representable():
    """With levels 0..3 on the grid lo + k*step, nearest rounding reproduces the grid points."""
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0])
    y = _round_trip(gradzip.codec("maxmin", bits=2, bucket_size=8, mode="nearest"), x)
    assert torch.equal(y, x)


# ========================================================================== unbiasedness
def _mean_and_se(c, x: torch.Tensor, trials: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Average decode over ``trials`` encodes (the step advances, so the randomness changes)."""
    total = torch.zeros(x.shape, dtype=torch.float64)
    total_sq = torch.zeros(x.shape, dtype=torch.float64)
    for _ in range(trials):
        y = c.decode(c.encode(x, name="u")).double()
        total += y
        total_sq += y * y
    mean = total / trials
    var = (total_sq / trials - mean * mean).clamp_min(0) * trials / (trials - 1)
    return mean, (var / trials).sqrt()


def _unbiased(c, x: torch.Tensor, trials: int = 2000) -> Tuple[bool, float]:
    mean, se = _mean_and_se(c, x, trials)
    tol = 5 * se + 1e-6 * x.abs().max().double()
    excess = ((mean - x.double()).abs() - tol).max().item()
    return excess <= 0, excess


def _test_vector(n: int = 48, seed: int = 21) -> torch.Tensor:
    x = _randn((n,), seed=seed)
    x[5] = 0.0
    x[6] = -x[7]
    return x


@pytest.mark.parametrize(
    "name,opts",
    [
        ("maxmin", {"bits": 2, "bucket_size": 16}),
        ("maxmin", {"bits": 1, "bucket_size": 48}),
        ("qsgd", {"bits": 2, "bucket_size": 16}),
        ("qsgd", {"bits": 4}),
        ("randomk", {"ratio": 0.25, "scale": True}),
        ("terngrad", {}),
        ("terngrad", {"bucket_size": 16}),
        ("natural", {}),
    ],
    ids=["maxmin2", "maxmin1", "qsgd2", "qsgd4", "randomk-scaled", "terngrad", "terngrad-bucket16", "natural"],
)
def test_stochastic_codecs_unbiased(name, opts):
    c = gradzip.codec(name, seed=1, **opts)
    x = _test_vector()
    ok, excess = _unbiased(c, x)
    assert ok, f"{name} {opts}: mean decode is off by {excess:.3g} beyond 5 standard errors"
    # and the codec really is random (else this test would prove nothing)
    a, b = c.decode(c.encode(x, name="u")), c.decode(c.encode(x, name="u"))
    assert not torch.equal(a, b)


@pytest.mark.parametrize(
    "name,opts,x",
    [
        # nearest rounding sends 0.3 to level 0 every time: mean 0.0, variance 0
        ("maxmin", {"bits": 1, "bucket_size": 4, "mode": "nearest"}, torch.tensor([0.0, 0.3, 0.3, 1.0])),
        ("maxmin", {"bits": 2, "bucket_size": 16, "mode": "nearest"}, None),
        # random-k without rescaling shrinks every value towards zero
        ("randomk", {"ratio": 0.25, "scale": False}, None),
    ],
    ids=["maxmin-nearest-crafted", "maxmin-nearest-random", "randomk-unscaled"],
)
def test_biased_codecs_fail_the_unbiasedness_check(name, opts, x):
    """The statistical check is sharp enough to catch a biased codec."""
    x = _test_vector() if x is None else x
    ok, excess = _unbiased(gradzip.codec(name, seed=1, **opts), x, trials=500)
    assert not ok


def test_stochastic_rounding_streams_are_reproducible():
    x = _randn((1001,))
    a = [_round_trip(gradzip.codec("maxmin", seed=4), x) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    b = _round_trip(gradzip.codec("maxmin", seed=5), x)
    assert not torch.equal(a[0], b)


# ================================================================================== QSGD
@pytest.mark.parametrize("bits", range(2, 9))
def test_qsgd_levels_and_norm(bits):
    s = (1 << (bits - 1)) - 1
    x = _randn((1000,), seed=bits)
    c = gradzip.codec("qsgd", bits=bits, bucket_size=100)
    y = _round_trip(c, x)
    xb, yb = x.view(10, 100), y.view(10, 100)
    norms = xb.norm(dim=1, keepdim=True)
    # decoded values are norm * level / s with the right sign, and |error| < norm / s
    levels = yb.abs() / norms * s
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
    assert ((yb == 0) | (torch.sign(yb) == torch.sign(xb))).all()
    assert ((yb - xb).abs() <= norms / s * (1 + 1e-5)).all()
    assert torch.equal(_round_trip(c, torch.zeros(37)), torch.zeros(37))


def test_qsgd_tail_bucket_norm_excludes_padding():
    """The last partial bucket's norm must be that of its real values only."""
    x = torch.tensor([3.0, 4.0, 0.0, 0.0, 0.0, 12.0])  # buckets of 4: [3,4,0,0] and [0,12]
    p = gradzip.codec("qsgd", bits=8, bucket_size=4).encode(x)
    torch.testing.assert_close(p.tensors[1], torch.tensor([5.0, 12.0]))


# ================================================================================== top-k
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("n", [1, 7, 1001, 4099])
def test_topk_keeps_k_largest(n, ratio):
    g = torch.Generator().manual_seed(n)
    mags = (torch.randperm(n, generator=g) + 1).float()  # distinct magnitudes
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = mags * signs
    k = max(1, min(n, math.ceil(n * ratio)))
    c = gradzip.codec("topk", ratio=ratio)
    p = c.encode(x)
    values, idx = p.tensors
    assert idx.dtype == torch.int32
    if k * (4 + 4) <= 4 * n:
        assert values.numel() == idx.numel() == k
    else:  # values and indices would exceed the raw size: the dense form (no indices)
        assert values.numel() == n and idx.numel() == 0 and p.nbytes == 4 * n
    y = c.decode(p)
    kept = y != 0
    expected = torch.zeros(n, dtype=torch.bool)
    expected[x.abs().topk(k).indices] = True
    assert torch.equal(kept, expected)
    assert torch.equal(y[kept], x[kept])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2000), ratio=st.floats(0.0005, 1.0), seed=st.integers(0, 1000))
def test_topk_threshold_property(n, ratio, seed):
    x = _randn((n,), seed=seed)
    y = _round_trip(gradzip.codec("topk", ratio=ratio), x)
    kept = y != 0
    assert kept.sum() <= max(1, math.ceil(n * ratio))
    assert torch.equal(y[kept], x[kept])
    if kept.any() and (~kept).any():
        assert x[kept].abs().min() >= x[~kept].abs().max()


def test_topk_aggregate_overlapping_indices():
    c = gradzip.codec("topk", ratio=0.5)
    a = torch.tensor([4.0, 0.0, 3.0, 0.0])
    b = torch.tensor([2.0, 5.0, 0.0, 0.0])
    out = c.aggregate([c.encode(a), c.encode(b)])
    torch.testing.assert_close(out, torch.tensor([3.0, 2.5, 1.5, 0.0]))


# ================================================================================ random-k
def test_randomk_shared_indices():
    n = 1000
    x = torch.arange(1, n + 1, dtype=torch.float32)  # a value identifies its index
    mk = lambda seed=5: gradzip.codec("randomk", ratio=0.05, seed=seed)  # noqa: E731
    vals = lambda c, step, name="w": c.encode(x, name=name, step=step).tensors[0]  # noqa: E731
    assert torch.equal(vals(mk(), 3), vals(mk(), 3))  # two instances (two ranks) agree
    assert not torch.equal(vals(mk(), 3), vals(mk(), 4))  # new step, new indices
    assert not torch.equal(vals(mk(), 3), vals(mk(), 3, "b"))  # another tensor
    assert not torch.equal(vals(mk(5), 3), vals(mk(6), 3))  # another seed
    # the implicit per-name step counter keeps instances in lock step too
    c1, c2 = mk(), mk()
    s1 = [c1.encode(x, name="w").tensors[0] for _ in range(3)]
    s2 = [c2.encode(x, name="w").tensors[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))
    assert not torch.equal(s1[0], s1[1])
    # decoding another rank's payload with this rank's context puts values where they came from
    other = c1.encode(x * 2, name="w", step=9)
    mine = c2.encode(x, name="w", step=9)
    y = c2.decode(Payload(other.tensors, mine.ctx))
    kept = y != 0
    assert torch.equal(y[kept], 2 * x[kept])


def test_randomk_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    gradzip.codec("randomk", ratio=0.1).encode(_randn((1000,)), name="w")
    assert torch.equal(torch.rand(3), expected)


def test_randomk_unscaled_keeps_values():
    x = _randn((1000,))
    y = _round_trip(gradzip.codec("randomk", ratio=0.1), x)
    kept = y != 0
    assert 0 < kept.sum() <= 100
    assert torch.equal(y[kept], x[kept])


def test_randomk_decodes_into_out_without_a_temporary_of_the_tensors_size():
    """Into a given fp32 tensor the drawn values are written where they go: the bits of
    decode(), from fp32 and from bf16 payloads, nothing allocated as large as the tensor; adding
    to ``out`` (and the scaled variant) still gives decode()'s values."""
    for dtype in (torch.float32, torch.bfloat16):
        c = gradzip.codec("randomk", ratio=0.1)
        payload = c.encode(_randn((4000,)).to(dtype), name="w", step=3)
        want = c.decode(payload).reshape(-1).float()
        out = torch.full((4000,), 7.0)
        with LargestMade() as made:
            assert c.decode_into(payload, out) is out
        assert torch.equal(out, want) and made.numel < 4000, made.numel
        acc = torch.ones(4000)
        c.decode_into(payload, acc, accumulate=True)
        assert torch.equal(acc, 1 + want)
    scaled = gradzip.codec("randomk", ratio=0.1, scale=True)
    payload = scaled.encode(_randn((4000,)), name="w", step=3)
    out = torch.full((4000,), 7.0)
    assert torch.equal(scaled.decode_into(payload, out), scaled.decode(payload).reshape(-1))


@pytest.mark.parametrize("name, options", [("topk", {"ratio": 0.05}), ("threshold", {"threshold": 1.0}),
                                           ("dgc", {"ratio": 0.05}), ("graddrop", {"ratio": 0.05})])
def test_values_and_indices_decode_into_out_without_a_temporary_of_the_tensors_size(name, options):
    """A sparse payload's values go straight to their places in a given fp32 tensor, zeros
    elsewhere: decode()'s bits, from fp32 and bf16 payloads, nothing as large as the tensor
    made (where the payload is the dense form, its values are copied in as they are)."""
    for dtype in (torch.float32, torch.bfloat16):
        c = gradzip.codec(name, **options)
        payload = c.encode(_randn((4000,), seed=5).to(dtype), name="w", step=3)
        assert payload.tensors[1].numel() > 0  # the sparse form
        want = c.decode(payload).reshape(-1).float()
        out = torch.full((4000,), 7.0)
        with LargestMade() as made:
            assert c.decode_into(payload, out) is out
        assert torch.equal(out, want) and made.numel < 4000, made.numel


@pytest.mark.parametrize("name, options", [
    ("threshold", {"threshold": 0.05}), ("threshold", {"threshold": 1.5}),
    ("dgc", {"ratio": 0.05, "seed": 1}), ("graddrop", {"ratio": 0.05, "seed": 1}),
])
def test_sparsifiers_select_a_piece_at_a_time_on_the_cpu(monkeypatch, name, options):
    """On the CPU a tensor's magnitudes are compared a piece at a time: no magnitudes, mask or
    indices of the tensor's size are made, and where nearly every value passes (the dense form)
    no indices of them are made at all. The payload is the one of one pass over the tensor,
    which for the threshold is the specification: every value whose fp32 magnitude reaches it
    (NaN never) with its index, or the tensor with zeros elsewhere where that is smaller."""
    from gradzip.kernels import fused

    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the C loops make no pieces)

    n = 20000
    x = _randn((n,), seed=4)
    x[[3, 5000, 15000]] = torch.tensor([float("nan"), -0.0, float("-inf")])
    want = gradzip.codec(name, **options).encode(x, name="w", step=3)
    if name == "threshold":  # the specification
        idx = torch.nonzero(x.abs() >= options["threshold"]).reshape(-1)
        if idx.numel() * 8 <= n * 4:
            spec = [x[idx], idx.to(torch.int32)]
        else:
            spec = [torch.zeros_like(x).index_copy_(0, idx, x[idx]), torch.empty(0, dtype=torch.int32)]
        assert all(torch.equal(a, b) for a, b in zip(want.tensors, spec))
        assert (spec[1].numel() == 0) == (options["threshold"] < 1)  # both forms are checked
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    with LargestMade((torch.float32, torch.bool, torch.int64)) as made:
        got = gradzip.codec(name, **options).encode(x, name="w", step=3)
    assert [t.dtype for t in got.tensors] == [t.dtype for t in want.tensors]
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(got.tensors, want.tensors))
    sent = got.tensors[1].numel()  # (the dense form: the payload is the tensor's size, its only one)
    assert made.numel <= max(1000, sent if sent else 0) or (not sent and made.numel == n), made.numel
    with LargestMade((torch.bool, torch.int64)) as made:
        gradzip.codec(name, **options).encode(x, name="w", step=3)
    assert made.numel <= max(1000, sent), made.numel


# ============================================================================== sign codecs
def test_signsgd_majority_vote():
    shape = (7, 143)
    xs = [_randn(shape, seed=s) for s in range(3)]
    xs[0][0, :10] = 0.0  # zero counts as +
    c = gradzip.codec("signsgd")
    payloads = [c.encode(x, name="g", step=0) for x in xs]
    vote = sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)
    out = c.aggregate(payloads)
    assert out.shape == shape and out.dtype == torch.float32
    assert torch.equal(out, torch.sign(vote))
    assert (out.abs() == 1).all()  # three voters never tie
    # each decode is the sign itself
    assert torch.equal(c.decode(payloads[1]), torch.where(xs[1] >= 0, 1.0, -1.0))
    # two voters that disagree tie at 0
    tie = c.aggregate([c.encode(torch.tensor([1.0, -1.0, 2.0])), c.encode(torch.tensor([-1.0, -3.0, 1.0]))])
    assert torch.equal(tie, torch.tensor([0.0, -1.0, 1.0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_efsignsgd_magnitude_is_mean_abs(dtype):
    x = _randn((33, 17), dtype, seed=4)
    y = _round_trip(gradzip.codec("efsignsgd"), x)
    scale = x.float().abs().mean()
    torch.testing.assert_close(y.float().abs(), torch.full(x.shape, scale.item()), rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=0)
    assert torch.equal(y >= 0, x >= 0)
    assert torch.equal(_round_trip(gradzip.codec("efsignsgd"), torch.zeros(9)), torch.zeros(9))


# ================================================================================ PowerSGD
def _low_rank(n: int, m: int, r: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)


def _power_round(c, x: torch.Tensor, name: str) -> torch.Tensor:
    """One PowerSGD step on one rank, as the all-reduce collective drives it (sum of one)."""
    p = c.encode(x, name=name)
    reduced = [t.clone() for t in p.tensors]
    while True:
        nxt = c.next_round(p, reduced)
        if nxt is None:
            break
        p, reduced = nxt, [t.clone() for t in nxt.tensors]
    return c.decode(Payload(reduced, p.ctx))


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_rank_r_exact(rank):
    m = _low_rank(40, 30, rank, seed=rank)
    c = gradzip.codec("powersgd", rank=rank)
    for _ in range(3):  # warm-start iterations, then the local round trip
        _power_round(c, m, "w")
    y = _round_trip(c, m, name="w")
    torch.testing.assert_close(y, m, rtol=1e-4, atol=1e-4 * m.abs().max().item())
    y2 = _power_round(c, m, "w")
    torch.testing.assert_close(y2, m, rtol=1e-4, atol=1e-4 * m.abs().max().item())
    # a 3-D tensor is factored as (n, prod(rest))
    t = _low_rank(6, 35, rank, seed=9).reshape(6, 5, 7)
    torch.testing.assert_close(_round_trip(gradzip.codec("powersgd", rank=rank), t), t, rtol=1e-4, atol=1e-4)


def test_powersgd_decodes_into_out_as_decode_does():
    """The last round's product goes straight into the collective's output: the same bits as
    decode(); adding into an output, or a 16-bit one, takes the general path."""
    c = gradzip.codec("powersgd", rank=2)
    x = torch.randn(48, 3, 5, generator=torch.Generator().manual_seed(3))
    p = c.encode(x, name="w")
    nxt = c.next_round(p, [t.clone() for t in p.tensors])
    final = Payload([t.clone() for t in nxt.tensors], nxt.ctx)
    assert c.next_round(nxt, final.tensors) is None
    expected = c.decode(final).reshape(-1)
    out = torch.full((x.numel(),), float("nan"))
    assert c.decode_into(final, out) is out and torch.equal(out, expected)
    base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(4))
    assert torch.equal(c.decode_into(final, base.clone(), accumulate=True), base + expected)
    half = torch.empty(x.numel(), dtype=torch.float16)
    assert torch.equal(c.decode_into(final, half), expected.half())


def _decaying_spectrum(n: int, m: int, seed: int = 0) -> Tuple[torch.Tensor, float]:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    k = min(n, m)
    sv = torch.tensor([10.0, 8.0] + [3.0 * 0.8**i for i in range(k - 2)], dtype=torch.float64)
    mat = (u[:, :k] * sv) @ v[:, :k].T
    best_rank2_err = sv[2:].norm().item()  # Eckart-Young
    return mat.float(), best_rank2_err


def test_powersgd_warm_start_converges_to_best_rank_r():
    mat, best = _decaying_spectrum(60, 40)
    warm = gradzip.codec("powersgd", rank=2)
    errs = [(_power_round(warm, mat, "w") - mat).norm().item() for _ in range(25)]
    assert errs[-1] <= best * 1.001
    assert errs[-1] < errs[0]
    cold = gradzip.codec("powersgd", rank=2, warm_start=False)
    cold_errs = [(_power_round(cold, mat, "w") - mat).norm().item() for _ in range(3)]
    assert cold_errs[0] == cold_errs[-1]  # no memory without warm start
    # state_dict carries the warm-start Q to a new instance
    again = gradzip.codec("powersgd", rank=2)
    again.load_state_dict(warm.state_dict())
    assert (_power_round(again, mat, "w") - mat).norm().item() <= best * 1.001


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_powersgd_passes_1d_through(dtype):
    c = gradzip.codec("powersgd")
    for shape in [(1,), (1001,), (3, 3)]:  # 1-D, and a matrix too small to gain
        x = _randn(shape, dtype, seed=2)
        y = _round_trip(c, x, name="b")
        assert torch.equal(y, x) and y.dtype == dtype


def test_powersgd_shared_initial_q():
    """Two ranks (instances) start from the same Q, so their P factors are summable."""
    x = _randn((33, 17))
    p1 = gradzip.codec("powersgd", seed=3).encode(x, name="w")
    p2 = gradzip.codec("powersgd", seed=3).encode(x, name="w")
    assert torch.equal(p1.tensors[0], p2.tensors[0])
    p3 = gradzip.codec("powersgd", seed=3).encode(x, name="other")
    assert not torch.equal(p1.tensors[0], p3.tensors[0])


# ============================================================================ option errors
def test_unknown_codec_lists_names():
    with pytest.raises(ValueError) as err:
        gradzip.codec("bogus")
    for name in NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_lists_valid_ones(name):
    c = gradzip.codec(name)
    with pytest.raises(ValueError, match="bogus_option") as err:
        gradzip.codec(name, bogus_option=1)
    for opt in c.options:
        assert opt in str(err.value)


@pytest.mark.parametrize(
    "name,opts,expect",
    [
        ("maxmin", {"bits": 0}, "1..8"),
        ("maxmin", {"bits": 9}, "1..8"),
        ("maxmin", {"bits": "4"}, "1..8"),
        ("maxmin", {"bits": True}, "1..8"),
        ("maxmin", {"bits": 4.0}, "1..8"),
        ("maxmin", {"bucket_size": 0}, "positive"),
        ("maxmin", {"mode": "floor"}, "'stochastic' or 'nearest'"),
        ("maxmin", {"seed": -1}, "non-negative"),
        ("qsgd", {"bits": 1}, "2..8"),
        ("qsgd", {"bits": 9}, "2..8"),
        ("topk", {"ratio": 0}, r"\(0, 1\]"),
        ("topk", {"ratio": 1.5}, r"\(0, 1\]"),
        ("topk", {"ratio": -0.1}, r"\(0, 1\]"),
        ("topk", {"ratio": "0.1"}, r"\(0, 1\]"),
        ("randomk", {"ratio": 0.0}, r"\(0, 1\]"),
        ("randomk", {"scale": 1}, "True or False"),
        ("powersgd", {"rank": 0}, "positive"),
        ("powersgd", {"rank": 1.5}, "positive"),
    ],
)
def test_bad_option_values(name, opts, expect):
    with pytest.raises(ValueError, match=expect) as err:
        gradzip.codec(name, **opts)
    assert next(iter(opts)) in str(err.value)


def test_codec_instance_with_options_rejected():
    with pytest.raises(ValueError):
        gradzip.codec(gradzip.codec("topk"), ratio=0.5)
    with pytest.raises(ValueError):
        gradzip.codec(42)


def test_unknown_memory_lists_names():
    with pytest.raises(ValueError) as err:
        memory("bogus")
    for name in gradzip.sync.memory.names():
        assert name in str(err.value)
    with pytest.raises(ValueError, match="beta, gamma"):
        memory("residual", bogus=1)
    with pytest.raises(ValueError):
        memory("residual", beta=float("nan"))
    with pytest.raises(ValueError):
        memory("residual", gamma="1")


# ================================================================================== memory
def test_memory_factory():
    assert type(memory()) is Memory and type(memory(None)) is Memory
    assert isinstance(memory("residual", beta=0.5), ResidualMemory)
    assert isinstance(memory("efsign"), EFSignMemory)
    m = ResidualMemory()
    assert memory(m) is m
    with pytest.raises(ValueError):
        memory(m, beta=1.0)


def test_no_memory_passes_through():
    m = memory("none")
    t = _randn((5,))
    assert m.compensate(t, "a") is t
    m.update("a", t, torch.zeros(5))
    assert m.compensate(t, "a") is t and not m.stateful and m.state_dict() == {}


def test_residual_memory_math():
    beta, gamma = 0.5, 2.0
    m = memory("residual", beta=beta, gamma=gamma)
    g1, g2, g3 = _randn((4, 3), seed=1), _randn((4, 3), seed=2), _randn((4, 3), seed=3)
    keep = [g.clone() for g in (g1, g2, g3)]

    c1 = m.compensate(g1, "w")
    torch.testing.assert_close(c1, gamma * g1)  # no residual yet
    d1 = c1.round()  # a lossy "decode"
    m.update("w", c1, d1)
    r1 = c1 - d1
    torch.testing.assert_close(m.residuals["w"], r1)

    c2 = m.compensate(g2, "w")
    torch.testing.assert_close(c2, gamma * g2 + beta * r1)
    d2 = torch.zeros_like(c2)
    m.update("w", c2, d2)
    torch.testing.assert_close(m.residuals["w"], c2)

    # other names are independent
    torch.testing.assert_close(m.compensate(g3, "other"), gamma * g3)
    for g, k in zip((g1, g2, g3), keep):
        assert torch.equal(g, k), "memory modified its input in place"


def test_residual_memory_does_not_alias_input():
    m = memory("residual")  # beta = gamma = 1
    g = _randn((8,))
    keep = g.clone()
    m.update("w", g, torch.zeros_like(g))
    c = m.compensate(g, "w")
    assert c.data_ptr() != g.data_ptr()
    c.mul_(3)  # a codec or collective writing into its input must not reach the gradient
    m.update("w", c, torch.zeros_like(c))
    assert torch.equal(g, keep)
    m.residuals["w"].add_(1)
    assert torch.equal(g, keep)


def test_residuals_updated_together_share_one_buffer_and_stale_buffers_are_not_kept(monkeypatch):
    """With the flag on the device (an accelerator's way), a batch's residuals become views of
    one buffer, so one pick updates them all; a name that joins another batch leaves the
    others of its old buffer with copies of their own (no stale buffer kept alive through
    them); a non-finite step keeps every residual; a loaded checkpoint starts afresh; a name
    released or updated alone leaves the others their own memory, and nothing holds a buffer
    that no residual is a view of."""
    from gradzip.sync import memory as memory_module

    monkeypatch.setattr(memory_module, "reads_on_host", lambda flag: False)
    m = memory("residual")
    shapes = {"a": (4, 3), "b": (5,), "c": (2, 2), "d": (3,)}
    grads = {n: _randn(s, seed=i) for i, (n, s) in enumerate(shapes.items())}
    ok, bad = torch.tensor(False), torch.tensor(True)

    def step(names, skip, scale=0.5):
        comp = m.compensate_many([grads[n] for n in names], names)
        m.update_many(names, comp, [c * scale for c in comp], skip=skip)
        return comp

    for n in "abc":  # every residual there, so the batch takes the multi-tensor way
        m.update(n, grads[n], torch.zeros_like(grads[n]))
    comp = step(list("abc"), ok)
    for n, c in zip("abc", comp):
        torch.testing.assert_close(m.residuals[n], c * 0.5, rtol=0, atol=0)
    flat = m.residuals["a"]._base
    assert flat is not None and all(m.residuals[n]._base is flat for n in "abc")
    before = {n: m.residuals[n].clone() for n in "abc"}
    step(list("abc"), bad)  # a non-finite step: every residual kept
    assert all(torch.equal(m.residuals[n], before[n]) for n in "abc")
    assert m.residuals["a"]._base is flat  # the same buffer, not made again

    m.update("d", grads["d"], torch.zeros_like(grads["d"]))
    step(["b", "d"], ok)
    assert m.residuals["b"]._base is m.residuals["d"]._base is not flat
    assert all(m.residuals[n]._base is not flat for n in "ac")  # copies of their own
    assert torch.equal(m.residuals["a"], before["a"]) and torch.equal(m.residuals["c"], before["c"])
    assert len(m._flats) == 1

    saved = m.state_dict()
    m.load_state_dict(saved)
    assert not m._flats and all(torch.equal(m.residuals[n], saved["residuals"][n]) for n in "abcd")
    comp = step(list("abcd"), ok)
    for n, c in zip("abcd", comp):
        torch.testing.assert_close(m.residuals[n], c * 0.5, rtol=0, atol=0)

    # a name released (sent uncompressed from now on): the others get their own memory, and
    # once every name of a buffer has left, nothing holds the buffer
    import gc
    import weakref

    flat = weakref.ref(m.residuals["a"]._base)
    kept = {n: m.residuals[n].clone() for n in "bcd"}
    m.release("a")
    assert all(m.residuals[n]._base is None and torch.equal(m.residuals[n], kept[n]) for n in "bcd")
    gc.collect()
    assert flat() is None and not m._flats
    step(list("bc"), ok)
    flat = weakref.ref(m.residuals["b"]._base)
    for n in "bc":
        m.release(n)
    gc.collect()
    assert flat() is None and not m._flats
    # a residual replaced by a step of its own (a batch of one) leaves the others their own memory
    m.update("c", grads["c"], torch.zeros_like(grads["c"]))  # released above: a residual again
    step(list("cd"), ok)
    flat = weakref.ref(m.residuals["c"]._base)
    m.update("c", grads["c"], grads["c"] * 0.5, skip=ok)
    gc.collect()
    assert flat() is None and m.residuals["d"]._base is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_residual_memory_keeps_fp32(dtype):
    m = memory("residual")
    g = torch.full((4,), 1.0, dtype=dtype)
    c = m.compensate(g, "w")
    m.update("w", c, torch.full((4,), 1.0 - 1e-4, dtype=torch.float32))
    assert m.residuals["w"].dtype == torch.float32
    torch.testing.assert_close(m.residuals["w"], torch.full((4,), 1e-4), rtol=1e-3, atol=0)


def test_residual_memory_skip_keeps_old_residual():
    m = memory("residual")
    g = _randn((6,))
    m.update("w", g, torch.zeros(6))
    old = m.residuals["w"].clone()
    m.update("w", g * 10, torch.zeros(6), skip=torch.tensor(True))
    assert torch.equal(m.residuals["w"], old)
    m.update("w", g * 10, torch.zeros(6), skip=torch.tensor(False))
    torch.testing.assert_close(m.residuals["w"], g * 10)
    # skip with no residual yet stores zeros (a NaN gradient must not enter the memory)
    m.update("fresh", torch.full((3,), float("nan")), torch.zeros(3), skip=torch.tensor(True))
    assert torch.equal(m.residuals["fresh"], torch.zeros(3))


def test_residual_memory_shape_change_resets():
    m = memory("residual")
    m.update("w", torch.ones(4), torch.zeros(4))
    g = torch.ones(2, 2)
    torch.testing.assert_close(m.compensate(g, "w"), g)


def test_residual_memory_state_dict_round_trip():
    m = memory("residual", beta=0.9, gamma=1.0)
    for name in ("a", "b"):
        g = _randn((5,), seed=ord(name))
        m.update(name, m.compensate(g, name), torch.zeros(5))
    state = m.state_dict()
    m2 = memory("residual", beta=0.9, gamma=1.0)
    m2.load_state_dict(state)
    assert m2.residuals.keys() == m.residuals.keys() and m2.holding() == {"a", "b"}
    assert m2.release("a") is not None and m2.holding() == {"b"} and memory("none").holding() == set()
    m2.load_state_dict(state)
    g = _randn((5,), seed=99)
    for name in ("a", "b"):
        assert torch.equal(m2.compensate(g, name), m.compensate(g, name))
    # the loaded state is a copy
    m2.residuals["a"].add_(1)
    assert not torch.equal(m2.residuals["a"], m.residuals["a"])


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_with_codec_loses_nothing(name):
    """With residual memory, what a codec did not send is sent later: the sums agree."""
    c, m = gradzip.codec(name), memory("residual")
    g = _randn((20, 25), seed=8)
    sent = torch.zeros(20, 25)
    for step in range(30):
        inp = m.compensate(g, "w")
        out = c.decode(c.encode(inp, name="w", step=step))
        m.update("w", inp, out)
        sent += out
    torch.testing.assert_close(sent + m.residuals["w"], 30 * g, rtol=1e-4, atol=1e-4)


# ================================================================================== config
def test_config_with_env_parsing():
    cfg = Config().with_env(
        {
            "GRADZIP_CODEC": "qsgd",
            "GRADZIP_BITS": "3",
            "GRADZIP_MIN_NUMEL": "10",
            "GRADZIP_COMPRESS_1D": "true",
            "GRADZIP_MEMORY": "residual",
            "GRADZIP_BUCKET_SIZE": "256",
            "GRADZIP_RATIO": "0.5",
            "GRADZIP_MODE": "nearest",
            "GRADZIP_KERNELS": "torch",  # process settings, not codec options
            "GRADZIP_CACHE": "/tmp/x",
            "OTHER_VAR": "1",
        }
    )
    assert cfg.codec == "qsgd"
    assert cfg.min_numel == 10 and isinstance(cfg.min_numel, int)
    assert cfg.compress_1d is True
    assert cfg.memory == "residual"
    assert cfg.options == {"bits": 3, "bucket_size": 256, "ratio": 0.5, "mode": "nearest"}
    assert isinstance(cfg.options["bits"], int)


def test_config_with_env_switching_codec_drops_options():
    base = Config(codec="topk", options={"ratio": 0.1})
    switched = base.with_env({"GRADZIP_CODEC": "maxmin", "GRADZIP_BITS": "2"})
    assert switched.codec == "maxmin" and switched.options == {"bits": 2}
    same = Config(codec="maxmin", options={"bucket_size": 512}).with_env({"GRADZIP_CODEC": "maxmin", "GRADZIP_BITS": "2"})
    assert same.options == {"bucket_size": 512, "bits": 2}
    kept = Config(codec="maxmin", options={"bits": 4}).with_env({"GRADZIP_BITS": "8"})
    assert kept.codec == "maxmin" and kept.options == {"bits": 8}
    assert base.options == {"ratio": 0.1}  # with_env returns a new config
    assert Config(codec="topk", options={"ratio": 0.1}).with_env({}) == base


def test_config_with_env_builds_a_valid_codec():
    cfg = Config().with_env({"GRADZIP_CODEC": "maxmin", "GRADZIP_BITS": "4"})
    c = gradzip.codec(cfg.codec, **cfg.options)
    assert c.bits == 4


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "true"])
def test_config_with_env_bad_min_numel(value):
    with pytest.raises(ValueError, match="min_numel"):
        Config().with_env({"GRADZIP_MIN_NUMEL": value})
    assert Config().with_env({"GRADZIP_MIN_NUMEL": ""}).min_numel == Config().min_numel  # set empty: unset


@pytest.mark.parametrize("env,message", [
    ({"GRADZIP_TIMEOUT": "abc"}, "timeout must be None or a positive, finite number of seconds, got 'abc' "
                                 "(set in the environment: GRADZIP_TIMEOUT=abc)"),
    ({"GRADZIP_WARMUP": "-1"}, "(set in the environment: GRADZIP_WARMUP=-1)"),
    ({"GRADZIP_FUSION_MB": "inf"}, "finite number of MiB, got inf (set in the environment: GRADZIP_FUSION_MB=inf)"),
    ({"GRADZIP_TIMEOUT": "inf"}, "finite number of seconds, got inf (set in the environment: GRADZIP_TIMEOUT=inf)"),
    ({"GRADZIP_COMPRESS_1D": "maybe"}, "(set in the environment: GRADZIP_COMPRESS_1D=maybe)"),
])
def test_config_with_env_names_the_variable_of_a_bad_setting(env, message):
    with pytest.raises(ValueError) as err:
        Config().with_env(env)
    assert message in str(err.value)


def test_config_with_env_takes_off_and_auto_for_the_plan():
    assert Config().with_env({"GRADZIP_PLAN": "off"}).plan == "off"
    assert Config().with_env({"GRADZIP_PLAN": "auto"}).plan == "auto"
    with pytest.raises(ValueError, match="plan must be one of off, auto"):
        Config().with_env({"GRADZIP_PLAN": "sometimes"})


def test_what_resolved_fills_in_is_not_taken_for_a_users_config():
    """The settings log names where each value came from: a value ``resolved`` fills in (the
    codec's ramp, adaptive levels off; ``"auto"``'s planner) is not a ``Config``'s."""
    plain = Config(codec="maxmin").resolved()
    assert plain.ramp == 0 and plain.origin("ramp") == "default" and plain.origin("adaptive") == "default"
    auto = Config(codec="auto").resolved()
    assert auto.plan == "auto" and auto.origin("plan") == "codec 'auto'" and auto.origin("adaptive") == "codec 'auto'"
    mine = Config(codec="maxmin", ramp=5, adaptive="bytes").resolved()
    assert mine.origin("ramp") == "config" and mine.origin("adaptive") == "config"
    assert auto.options["bits"] == 4 and auto.origin("codec.bits") == "codec 'auto'"
    two = Config(codec="auto", options={"bits": 2}).resolved()
    assert two.options["bits"] == 2 and two.origin("codec.bits") == "config"


def test_auto_keeps_a_plan_that_was_set():
    """``"auto"`` plans unless told not to: ``plan="off"`` from the environment or an argument
    is kept (it was replaced by ``"auto"``, while the log named the variable as its origin)."""
    env = Config(codec="auto").with_env({"GRADZIP_PLAN": "off"}).resolved()
    assert env.plan == "off" and env.origin("plan") == "environment GRADZIP_PLAN=off"
    arg = Config(codec="auto", plan="off", given={"plan": "argument"}).resolved()
    assert arg.plan == "off" and arg.origin("plan") == "argument"
    mine = Config(codec="auto", plan="off").resolved()
    assert mine.plan == "off" and mine.origin("plan") == "config"
    assert Config(codec="auto").resolved().plan == "auto"
    assert Config(codec="topk").resolved().plan == "off" and Config(codec="topk").resolved().origin("plan") == "default"


def test_config_with_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("GRADZIP_CODEC", "topk")
    monkeypatch.setenv("GRADZIP_RATIO", "0.25")
    cfg = Config(codec="maxmin", options={"bits": 2}).with_env()
    assert cfg.codec == "topk" and cfg.options == {"ratio": 0.25}


def test_config_validation():
    with pytest.raises(ValueError, match="min_numel"):
        Config(min_numel=-1)
    with pytest.raises(ValueError, match="compress_1d"):
        Config(compress_1d="yes")


def test_config_with_env_bool_digits_and_codec_switch_resets_collective():
    cfg = Config(codec="maxmin", collective="sra", options={"bits": 2})
    out = cfg.with_env({"GRADZIP_CODEC": "topk", "GRADZIP_COMPRESS_1D": "1"})
    assert out.codec == "topk" and out.collective is None and out.options == {} and out.compress_1d is True
    assert cfg.with_env({"GRADZIP_COMPRESS_1D": "0"}).compress_1d is False
    assert cfg.with_env({"GRADZIP_CODEC": "topk", "GRADZIP_COLLECTIVE": "ps"}).collective == "ps"


@pytest.mark.parametrize("name, opts", [("maxmin", {"bits": 4}), ("qsgd", {}), ("signsgd", {}), ("topk", {"ratio": 0.1})])
def test_aggregate_into_a_destination_gives_the_bits_of_aggregate(name, opts):
    codec = gradzip.codec(name, **opts)
    xs = [_randn(3000, seed=s) for s in range(3)]
    payloads = [codec.encode(x, name="w", step=2) for x in xs]
    want = codec.aggregate(payloads).reshape(-1)
    out = torch.full((3000,), 7.0)
    got = codec.aggregate_into(payloads, out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("spec", [("terngrad", {"bucket_size": 8}), ("onebit", {"bucket_size": 8}),
                                  ("u8bit", {"bucket_size": 8}), ("tbq", {"threshold": 0.5})])
def test_decoding_the_first_values_of_a_payload_gives_those_of_the_whole(spec):
    """Collectives decode a chunk's prefix into their result: the buckets past it are not read."""
    name, opts = spec
    c = gradzip.codec(name, **opts)
    x = torch.randn(40, generator=torch.Generator().manual_seed(2))
    payload = c.encode(x, "w", 0)
    whole = c.decode(payload).reshape(-1)
    for n in (10, 16, 40):
        out = torch.full((n,), 7.0)
        c.decode_into(payload, out)
        assert torch.equal(out, whole[:n]), n
        acc = torch.ones(n)
        c.decode_into(payload, acc, accumulate=True)
        assert torch.equal(acc, 1 + whole[:n]), n


def test_every_codec_measured_under_30_percent_of_a_copy_on_cuda_says_why():
    """Each codec whose encode or decode stayed under 30% of a device copy in every GPU run
    stored in docs/bench (``gradzip bench codecs --device cuda``) says in its docstring what
    it reaches (a share "of a device copy") and why."""
    import json
    from pathlib import Path

    best = {}
    for path in sorted((Path(__file__).parents[2] / "docs" / "bench").glob("gpu-codecs-*.json")):
        for row in json.loads(path.read_text())["rows"]:
            name = row["codec"].split(":")[0]
            enc, dec = best.get(name, (0.0, 0.0))
            best[name] = (max(enc, row["encode_vs_copy"]), max(dec, row["decode_vs_copy"]))
    slow = sorted(name for name, (enc, dec) in best.items() if min(enc, dec) < 0.30)
    assert {"onebit", "powersgd", "cl_onebit"} <= set(slow), slow  # the runs are there
    missing = [name for name in slow if "of a device copy" not in " ".join((type(gradzip.codec(name)).__doc__ or "").split())]
    assert not missing, missing


# ------------------------------------------------------------ encoding into a collective's message
# fixed-size formats that a collective's message can be made for before encoding (every other
# codec's payload is encoded first, then copied into its row of the message)
HAS_FORM = {"none", "fp16", "bf16", "maxmin", "qsgd", "fp8", "mxfp8", "mxfp4", "u8bit", "natural", "terngrad", "tbq",
            "signsgd", "signum", "efsignsgd", "onebit", "sketchml"}
# and a fused group's too, by its parts (a header, a scale or a bucket's means a member)
PARTS_FORM = {"natural", "terngrad", "signum", "efsignsgd", "onebit", "sketchml"}


def _has_form(name: str, opts: Dict[str, Any], forms: set) -> bool:
    """Whether ``name`` with ``opts`` gives its payload's form before encoding (SketchML's
    sparse mode does not: its gaps' width depends on the data)."""
    return name in forms and not (name == "sketchml" and opts.get("ratio", 1.0) < 1.0)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) if a.is_floating_point() else torch.equal(a, b)


@pytest.mark.parametrize("name,opts", CONFIGS + [("onebit", {"bucket_size": 96}), ("terngrad", {"bucket_size": 96}),
                                               ("sketchml", {"buckets": 16}), ("sketchml", {"ratio": 0.3})],
                         ids=CONFIG_IDS + ["onebit-bucket_size96", "terngrad-bucket_size96", "sketchml-buckets16",
                                           "sketchml-ratio0.3"])
def test_a_fixed_form_is_encoded_into_given_tensors_as_it_is_encoded_alone(name, opts):
    """Where a codec gives its payload's form before encoding (``payload_spec``: a collective
    then writes the payload straight into its message), the payload written into tensors of
    that form (dirty: every byte must be written) is the one it encodes alone, bit for bit, a
    NaN included, and the tensors given are the payload's."""
    for n, dtype in [(999, torch.float16), (4096, torch.float32), (5000, torch.bfloat16)]:
        a, b = gradzip.codec(name, **opts), gradzip.codec(name, **opts)  # (a step's draws and state: a twin's)
        spec = b.payload_spec(n, dtype)
        as_is = b.family == "cast" and b.sends_as_is(dtype)  # the input itself is sent: nothing to write
        assert (spec is not None) == (_has_form(name, opts, HAS_FORM) and not b._raw(n, dtype) and not as_is), (name, n)
        if spec is None:
            continue
        x = _randn((n,), seed=n).to(dtype)
        x[n // 3] = float("nan")
        want = a.encode(x, "w", 0)
        assert [(t.dtype, t.numel()) for t in want.tensors] == spec
        out = [torch.full((k,), 7, dtype=d) for d, k in spec]
        got = b.encode(x, "w", 0, out=out)
        assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got.tensors, out))
        assert all(_same_bits(g, w) for g, w in zip(got.tensors, want.tensors)), (name, n)


@pytest.mark.parametrize("at_once", [False, True], ids=["member-by-member", "at-once"])
@pytest.mark.parametrize("name,opts", [(n, {}) for n in NAMES if gradzip.codec(n).parts_format]
                         + [("onebit", {"bucket_size": 512}), ("sketchml", {"buckets": 16}), ("sketchml", {"ratio": 0.3})],
                         ids=lambda v: v if isinstance(v, str) else "".join(f"{k}{x}" for k, x in v.items()))
def test_a_fused_group_by_its_parts_is_encoded_into_given_tensors_as_without_them(monkeypatch, name, opts, at_once):
    """A fused group (its parts, each member with its own header, scale, means or momentum) of
    a codec with a fixed form has one too: encoded into tensors of that form, its payload is
    the one encoded without them, bit for bit, a NaN member included (then its flag), the
    CPU's way (member by member) and the accelerator's (by blocks) on CPU tensors. A codec
    without such a form (a data-dependent payload, a factorisation) gives none."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    c, twin = gradzip.codec(name, **opts), gradzip.codec(name, **opts)  # (a step's draws and state: a twin's)
    block = c.fused_alignment()
    parts = [("a", (7, 9)), ("b", (0,)), ("c", (block + 5,)), ("d", (3,))]
    lengths = [63, 0, block + 5, 3]
    x = []
    for n in lengths:
        member = _randn((n,), seed=n) * (1e3 if n > 63 else 1.0)
        x += [member, torch.zeros(-(-n // block) * block - n)]
    x = torch.cat(x)
    x[block + 2] = float("nan")
    spec = c.payload_spec(x.numel(), x.dtype, parts)
    assert (spec is not None) == (_has_form(name, opts, PARTS_FORM) and not c._raw(x.numel(), x.dtype)), (name, spec)
    if spec is None:
        return
    want = twin.encode(x, name="g", step=0, parts=parts)
    assert [(t.dtype, t.numel()) for t in want.tensors] == spec
    out = [torch.full((k,), 7, dtype=d) for d, k in spec]
    got = c.encode(x, name="g", step=0, parts=parts, out=out)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got.tensors, out))
    assert all(_same_bits(g, w) for g, w in zip(got.tensors, want.tensors))
    flag = c.nonfinite(got)
    assert flag is None or bool(flag)
