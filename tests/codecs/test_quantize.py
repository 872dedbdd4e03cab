"""Codec-specific tests of terngrad, natural, u8bit, inceptionn and tbq (single process).

The generic tests of tests/codecs/test_codecs.py (round trips, wire bytes, aggregate, state) cover these
codecs too; here are each codec's own error bound, unbiasedness, wire size and option checks.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import Payload
from gradzip.codecs.quantize import _u8_tables

from .test_codecs import _randn, _round_trip, _unbiased

N = 1 << 20  # "1M elements" of the wire figures
NEW = ["terngrad", "natural", "u8bit", "inceptionn", "tbq"]


def _mixed(n: int = 4000, seed: int = 0) -> torch.Tensor:
    """Values over many magnitudes, with zeros, ties and a sign pair."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (n,), generator=g).float()
    x[:4] = torch.tensor([0.0, -0.0, 1.0, -1.0])
    return x


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


# ================================================================================ TernGrad
@pytest.mark.parametrize("bucket", [0, 1, 7, 512])
def test_terngrad_values_are_zero_or_scale(bucket):
    x = _mixed(3001, seed=bucket)
    c = gradzip.codec("terngrad", bucket_size=bucket)
    p = c.encode(x)
    y = c.decode(p)
    if bucket == 1:  # 2 bits and an fp32 scale per value exceed the raw 4 bytes: sent raw
        assert len(p.tensors) == 1 and p.nbytes == 4 * x.numel() == c.wire_bytes(x.numel())
        assert torch.equal(y, x)
        return
    size = bucket or x.numel()
    pad = (-x.numel()) % size
    xb = torch.cat([x, x[-1:].expand(pad)]).view(-1, size)
    yb = torch.cat([y, y[-1:].expand(pad)]).view(-1, size)
    s = xb.abs().amax(dim=1, keepdim=True)
    assert torch.equal(p.tensors[1], s.view(-1))  # the scale sent is max|x| of the bucket
    assert ((yb == 0) | (yb.abs() == s)).all()
    assert ((yb == 0) | (torch.sign(yb) == torch.sign(xb))).all()
    assert (yb[(xb.abs() == s) & (s > 0)] != 0).all()  # probability 1 at the maximum
    assert torch.equal(_round_trip(c, torch.zeros(37)), torch.zeros(37))


def test_terngrad_payload_layout():
    x = torch.tensor([0.0, 2.0, -2.0, 0.0, 2.0])  # |x| is 0 or the scale: no randomness
    p = gradzip.codec("terngrad").encode(x)
    # codes 0, 1 (+s), 2 (-s), 0, 1, packed four to a byte from the low bits
    assert torch.equal(p.tensors[0], torch.tensor([0b00_10_01_00, 0b01], dtype=torch.uint8))
    assert torch.equal(p.tensors[1], torch.tensor([2.0]))


# ================================================================================= natural
def _is_power_of_two(v: torch.Tensor) -> torch.Tensor:
    mant, _ = torch.frexp(v)
    return mant == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_natural_powers_of_two_bracket(dtype):
    x = _mixed(5000, seed=3)
    if dtype != torch.float32:
        x = x.clamp(-1e3, 1e3)
    x = x.to(dtype)
    y = _round_trip(gradzip.codec("natural"), x).float()
    xf = x.float()
    nz = xf != 0
    assert torch.equal(y[~nz], torch.zeros_like(y[~nz]))
    assert (y[nz] != 0).all()  # nothing here is far enough below the maximum to underflow
    assert _is_power_of_two(y[nz].abs()).all()
    lo = torch.ldexp(torch.ones_like(xf), torch.frexp(xf.abs()).exponent - 1)  # 2**floor(log2|x|)
    assert ((y.abs() == lo) | (y.abs() == 2 * lo))[nz].all()
    assert (torch.sign(y) == torch.sign(xf)).all()
    powers = torch.tensor([1.0, -0.5, 2.0**-20, 64.0]).to(dtype)
    assert torch.equal(_round_trip(gradzip.codec("natural"), powers), powers)


def test_natural_one_byte_format():
    x = torch.tensor([4.0, -1.0, 0.0, 0.5])
    p = gradzip.codec("natural").encode(x)
    codes, top = p.tensors
    assert codes.dtype == torch.uint8 and top.dtype == torch.int32 and top.numel() == 1
    assert top.item() == 127 + 2  # max 4 = 2**2: biased exponent 129
    # code c means 2**(T - 254 + c): 4 → 127, 1 → 125 (negative: + 128), 0 → 0, 0.5 → 124
    assert codes.tolist() == [127, 128 + 125, 0, 124]


@pytest.mark.parametrize("values", [
    [4.0, -1.0, 0.0], [-8.0, 1.0], [-0.0, 0.0], [0.0], [1e-45, -3e-44], [3.4e38, -1.0], [-3.4028235e38],
    [float("nan"), 1.0], [1.0, float("inf")], [-float("inf"), 2.0], [2.0**-126 * 1.5, -7.0],
])
def test_natural_header_is_the_exponent_of_the_largest_magnitude(values):
    """The header, read from one min/max pass: the biased exponent of max|x| rounded up, 256 when
    a value is NaN or ±inf (as when it was the maximum of the magnitudes' bits)."""
    x = torch.tensor(values * 4)  # long enough not to go raw
    mag = (x.view(torch.int32) & 0x7FFFFFFF).clamp(max=0x7F800000).amax()
    expected = ((mag + (1 << 23) - 1) >> 23) + int(mag >= 0x7F800000)
    assert gradzip.codec("natural").encode(x).tensors[1].tolist() == [int(expected)]


def test_natural_far_below_the_max_rounds_to_zero_or_smallest_code():
    """Below the smallest code 2**(T-253) a value becomes 0 or that power, unbiased."""
    n = 20000
    v = _f32(0.3 * 2.0**-26)
    x = torch.full((n + 1,), v)
    x[0] = 2.0**100  # T = 227: the smallest code is 2**-26
    y = _round_trip(gradzip.codec("natural", seed=2), x)
    assert y[0] == 2.0**100
    assert set(y[1:].unique().tolist()) <= {0.0, 2.0**-26}
    frac = (y[1:] != 0).double().mean().item()  # ≈ 0.3
    assert abs(frac - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)
    # subnormals with a max of 1: the smallest code is 2**-126, the bottom of the normal range
    sub = torch.full((n + 1,), _f32(1e-39))
    sub[0] = 1.0
    ys = _round_trip(gradzip.codec("natural", seed=3), sub)
    assert set(ys[1:].unique().tolist()) <= {0.0, 2.0**-126}
    p = _f32(1e-39) / 2.0**-126
    assert abs((ys[1:] != 0).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_natural_non_finite_stays_non_finite():
    """(The collective flags such a step anyway; the finite values then underflow under inf.)"""
    y = _round_trip(gradzip.codec("natural"), torch.tensor([1.0, float("inf"), -float("inf"), float("nan")]))
    assert y[1] == float("inf") and y[2] == -float("inf") and not torch.isfinite(y[3])


# =================================================================================== u8bit
def test_u8bit_table():
    table = gradzip.codecs.get("u8bit").TABLE
    assert table.numel() == 256 and table.dtype == torch.float32
    assert (table[1:] > table[:-1]).all()  # sorted, distinct
    assert table[-1] == 1.0 and 0.0 in table.tolist() and table[0] > -1.0
    gaps = table[1:] - table[:-1]
    assert math.isclose(gaps.max().item(), 0.9 / 64, rel_tol=1e-5)  # the top decade's step
    # per decimal exponent 10**-z, 2**(6-z) values of each sign
    pos = table[table > 0][:-1]  # without the +1.0
    for z in range(7):
        inside = ((pos >= 0.1 * 10.0**-z * 0.999) & (pos < 10.0**-z)).sum().item()
        assert inside == 2 ** (6 - z), z


def test_u8bit_lookup_equals_binary_search():
    """The bit-indexed lookup picks exactly what searchsorted over the midpoints picks."""
    table, mids_inf, _ = _u8_tables(torch.device("cpu"))
    mids = mids_inf[:-1]
    up, down = torch.tensor(2.0), torch.tensor(-2.0)
    v = torch.cat(
        [
            torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1,
            _randn((100_000,), seed=1) * 1e-5,
            table, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
            torch.nextafter(table, up), torch.nextafter(table, down),
            torch.tensor([-1.0, 1.0, 0.0, -0.0, 1e-45, -1e-45]),
        ]
    )
    v = v[v.abs() <= 1]
    c = gradzip.codec("u8bit", bucket_size=0)
    x = torch.cat([v, torch.tensor([1.0])])  # the scale is exactly 1: codes index v itself
    codes = c.encode(x).tensors[0][:-1].long()
    assert torch.equal(codes, torch.searchsorted(mids, v))


@pytest.mark.parametrize("bucket", [0, 1, 7, 1024])
def test_u8bit_error_is_half_the_local_gap(bucket):
    x = _mixed(5000, seed=bucket)
    c = gradzip.codec("u8bit", bucket_size=bucket)
    y = _round_trip(c, x).double()
    size = bucket or x.numel()
    pad = (-x.numel()) % size
    xb = torch.cat([x, x[-1:].expand(pad)]).view(-1, size).double()
    s = xb.abs().amax(dim=1, keepdim=True)
    v = (xb / s).nan_to_num(0.0).reshape(-1)[: x.numel()]
    table = c.TABLE.double()
    hi = torch.searchsorted(table, v).clamp(1, 255)
    gap = table[hi] - table[hi - 1]  # the entries around v (the end gap beyond ±1)
    scale = s.expand_as(xb).reshape(-1)[: x.numel()]
    slack = 2.0**-20 * scale  # fp32 rounding of the table entries and of entry * scale
    bound = gap / 2 * scale + slack
    err = (y - x.double()).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert (err <= 0.9 / 128 * scale + slack).all()  # the widest gap
    # the positive maximum of each bucket is exact (+1.0 is in the table), zeros stay zero
    assert torch.equal(y[x == scale.float()], x[x == scale.float()].double())
    assert (y[x == 0] == 0).all()


def test_u8bit_deterministic_and_constant_buckets():
    x = torch.full((2048,), 0.37)
    y = _round_trip(gradzip.codec("u8bit"), x)
    assert torch.equal(y, x)  # max|x| is the scale, and 1.0 is in the table
    # -max|x| maps to the most negative entry, -0.99297 (the table has +1.0 but not -1.0)
    lowest = gradzip.codecs.get("u8bit").TABLE[0]
    assert torch.equal(_round_trip(gradzip.codec("u8bit"), -x), x * lowest)


@pytest.mark.parametrize("bucket", [0, 80, 1000, 2500])
def test_u8bit_encodes_into_the_given_buffers_a_piece_at_a_time(monkeypatch, bucket):
    """Given a collective's buffers (``payload_spec``), the codes and scales are written there:
    the payload of ``encode`` alone, bit for bit, a NaN's bucket included; on the CPU no
    magnitudes or codes of the tensor's size are made on the way (for a whole number of
    buckets, as a fused group has: a tail bucket is padded first)."""
    from gradzip.kernels import fused

    from ..tensors import LargestMade

    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the C loops make no pieces)

    n = 20000
    x = _randn((n,), seed=8) ** 3
    x[11] = float("nan")
    c = gradzip.codec("u8bit", bucket_size=bucket)
    want = c.encode(x)
    spec = c.payload_spec(n, torch.float32)
    assert spec == [(t.dtype, t.numel()) for t in want.tensors]
    out = [torch.empty(k, dtype=d) for d, k in spec]
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    with LargestMade() as made:
        got = c.encode(x, out=out)
    assert all(g is o or g.data_ptr() == o.data_ptr() for g, o in zip(got.tensors, out))
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(got.tensors, want.tensors))
    assert made.numel <= 1000 < n, made.numel


# ============================================================================== INCEPTIONN
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bound", [2.0**-10, 2.0**-6, 1e-3, 0.3, 1e-6])
def test_inceptionn_error_bound(bound, dtype):
    x = _mixed(20000, seed=5)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    c = gradzip.codec("inceptionn", error_bound=bound)
    y = _round_trip(c, x)
    assert y.dtype == dtype
    err = (y.double() - x.double()).abs().max().item()
    assert err <= _f32(bound), err


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    scale=st.sampled_from([1e-5, 1e-3, 1.0, 1e3]),
    bound=st.sampled_from([2.0**-10, 1e-4, 0.05]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 10_000),
)
def test_inceptionn_error_bound_any_size(n, scale, bound, dtype, seed):
    x = (_randn((n,), seed=seed) * scale).to(dtype)
    c = gradzip.codec("inceptionn", error_bound=bound)
    p = c.encode(x)
    assert p.nbytes <= c.wire_bytes(n, dtype)
    assert (c.decode(p).double() - x.double()).abs().max().item() <= _f32(bound)


def test_inceptionn_tags_and_sizes():
    b = 2.0**-10
    # |x| < b: tag 0 (nothing) | m ≤ 127: 1 byte | m ≤ 32767: 2 bytes | beyond: raw 4 bytes
    x = torch.tensor([0.0, b / 2, -3 * b, 300 * b, -1000 * b, 1e6, float("inf"), float("nan")])
    c = gradzip.codec("inceptionn")
    p = c.encode(x)
    tags, stream = p.tensors
    assert tags.tolist() == [0b10_01_00_00, 0b11_11_11_10]  # codes 0,0,1,2 | 2,3,3,3, low bits first
    assert stream.numel() == 0 + 0 + 1 + 2 + 2 + 4 + 4 + 4
    y = c.decode(p)
    assert y[:6].tolist() == [0.0, 0.0, -4 * b, 300 * b, -1000 * b, 1e6]  # 3b: m = 1.5 rounds up, error b
    assert y[6] == float("inf") and torch.isnan(y[7])
    # 16-bit input: the raw tag takes two bytes
    p16 = c.encode(x.half())
    assert p16.tensors[1].numel() == 0 + 0 + 1 + 2 + 2 + 2 + 2 + 2
    assert torch.equal(c.decode(p16)[5:7], x.half()[5:7])


def test_inceptionn_decodes_payloads_of_other_sizes():
    """Another rank's payload (another size) decodes with this rank's context."""
    c = gradzip.codec("inceptionn")
    small, big = _randn((1001,), seed=1) * 1e-3, _randn((1001,), seed=2) * 10
    mine, other = c.encode(small, name="w", step=0), c.encode(big, name="w", step=0)
    assert mine.nbytes < other.nbytes
    torch.testing.assert_close(c.decode(Payload(other.tensors, mine.ctx)), c.decode(other), rtol=0, atol=0)


@pytest.mark.parametrize("piece", [1000, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_inceptionn_works_piece_by_piece_with_the_bytes_of_one_pass(dtype, piece, monkeypatch):
    """On the CPU INCEPTIONN encodes and decodes :data:`fused.TORCH_PIECE` values at a time (its
    temporaries a piece's size, not several times the tensor's; a piece of whole groups of 8
    values, 12 taken as 8): the payload's bytes and the decoded bits of one pass over the
    whole, NaN, ±inf and -0.0 included, into ``out`` and added to it, and another rank's
    payload of another length decoded alike."""
    from gradzip.kernels import fused

    from ..tensors import LargestMade

    n = 4001
    x = (_randn((n,), seed=5) * torch.logspace(-5, 2, n)).to(dtype)
    x[3], x[7], x[8] = float("nan"), float("-inf"), -0.0
    c = gradzip.codec("inceptionn")
    whole = c.encode(x, name="w", step=0)
    want = c.decode(whole)
    monkeypatch.setattr(fused, "TORCH_PIECE", piece)
    with LargestMade() as made:
        pieces = c.encode(x, name="w", step=0)
    assert all(torch.equal(a, b) for a, b in zip(pieces.tensors, whole.tensors))
    # a piece's temporaries (its words' kept bytes), or the payload itself; one pass made 4n
    assert made.numel <= max(4 * 1000, sum(t.numel() for t in whole.tensors)) < 4 * n, made.numel
    out = torch.empty(n)
    with LargestMade((torch.float32, torch.int32)) as made:  # (the stream is copied once, padded)
        c.decode_into(pieces, out)
    same = lambda a, b: torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))  # noqa: E731
    assert same(out, want.float()) and made.numel <= 1000 < n, made.numel
    acc = torch.ones(n)
    c.decode_into(pieces, acc, accumulate=True)
    assert torch.equal(acc.nan_to_num(5.0), (1 + want.float()).nan_to_num(5.0))
    other = Payload(c.encode(x * 3, name="w", step=0).tensors, whole.ctx)  # another rank's, another length
    by_pieces = c.decode(other)
    monkeypatch.setattr(fused, "TORCH_PIECE", 1 << 30)
    assert same(by_pieces, c.decode(other))


def test_inceptionn_wire_per_element():
    c = gradzip.codec("inceptionn")
    assert c.wire_bytes(N, torch.float32) == 4 * N  # bound: the dense form, raw values
    assert c.wire_bytes(N, torch.float16) == 2 * N
    bits = c.encode(_randn((N,), seed=0)).nbytes * 8 / N
    assert 16.0 < bits < 17.0  # randn: ~20 % in 1 byte (|x| < 0.249), ~80 % in 2, plus 2-bit tags: ~16.4
    grad = c.encode(_randn((N,), seed=0) * 1e-3).nbytes * 8 / N
    assert grad < 5.0  # gradient-sized values: most are under the bound


# ===================================================================================== TBQ
def _tbq_reference(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Bytes of the TBQ payload by the documented rule, element by element (reference only)."""
    t = _f32(tau)
    codes = [(1 if v > t else 0) | ((1 if v < -t else 0) << 1) for v in x.float().tolist()]
    codes += [0] * (-len(codes) % 8)  # pack_bits pads to whole groups of eight values
    packed = [sum(codes[i + j] << (2 * j) for j in range(4)) for i in range(0, len(codes), 4)]
    return torch.tensor(packed, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tau", [0.01, 0.5, 1e-3, 1.0 / 3])
def test_tbq_exact_ternary(tau, dtype):
    x = (_randn((1001,), seed=9) * 0.6).to(dtype)
    x[:4] = torch.tensor([tau, -tau, 0.0, _f32(tau)]).to(dtype)  # at ±τ (fp32): zero
    c = gradzip.codec("tbq", threshold=tau)
    p = c.encode(x)
    assert torch.equal(p.tensors[0], _tbq_reference(x, tau))  # bit for bit
    y = c.decode(p)
    t, xf = _f32(tau), x.float()
    expected = torch.where(xf > t, t, torch.where(xf < -t, -t, 0.0)).to(dtype)
    assert torch.equal(y, expected)
    tq = torch.tensor(t).to(dtype).item()
    assert set(y.float().unique().tolist()) <= {-tq, 0.0, tq}


def test_tbq_reencoding_an_average_sends_nothing():
    """Why TBQ offers no SRA: an average of ±τ/0 values lies in [−τ, τ] and re-encodes to 0."""
    c = gradzip.codec("tbq", threshold=0.1)
    xs = [_randn((999,), seed=s) for s in range(4)]
    avg = c.aggregate([c.encode(x) for x in xs])
    assert avg.abs().max() == _f32(0.1)  # unanimous elements reach ±τ...
    assert torch.equal(_round_trip(c, avg), torch.zeros_like(avg))  # ...and still are not > τ
    assert c.collectives == ("allgather",)


# =============================================================================== all five
# (unbiasedness of terngrad and natural: tests/codecs/test_codecs.py::test_stochastic_codecs_unbiased)


def test_natural_unbiased_across_magnitudes():
    x = _mixed(48, seed=4)
    x[10] = 2.0**-3  # a power of two: no randomness
    ok, excess = _unbiased(gradzip.codec("natural", seed=2), x * 1e3)  # the tolerance floor is relative to max|x|
    assert ok, excess


@pytest.mark.parametrize(
    "name,opts,bits",
    [
        ("terngrad", {}, 2 + 32 / N),  # 2-bit codes + one fp32 scale
        ("terngrad", {"bucket_size": 1024}, 2 + 32 / 1024),
        ("natural", {}, 8 + 32 / N),  # 1 byte + int32 exponent header
        ("u8bit", {}, 8 + 32 / 1024),  # 1 byte + an fp32 scale per 1024 values
        ("u8bit", {"bucket_size": 0}, 8 + 32 / N),
        ("tbq", {}, 2.0),  # 2-bit codes, no header
        ("inceptionn", {}, 32),  # upper bound: the dense form, raw fp32
    ],
    ids=["terngrad", "terngrad-1024", "natural", "u8bit", "u8bit-whole", "tbq", "inceptionn"],
)
def test_wire_bits_per_element_1m(name, opts, bits):
    c = gradzip.codec(name, **opts)
    assert c.wire_bytes(N, torch.float32, shape=(1024, 1024)) * 8 / N == bits
    if c.fixed_size:
        assert c.encode(_randn((N,), seed=1)).nbytes * 8 / N == bits


@pytest.mark.parametrize("name", NEW)
def test_decode_uses_only_rank_independent_context(name):
    """A payload decodes the same with the context of another rank's (different) input."""
    c1, c2 = gradzip.codec(name), gradzip.codec(name)
    x1, x2 = _mixed(1001, seed=1), _mixed(1001, seed=2) * 7
    p1, p2 = c1.encode(x1, name="w", step=3), c2.encode(x2, name="w", step=3)
    assert torch.equal(c2.decode(Payload(p1.tensors, p2.ctx)), c1.decode(p1))


@pytest.mark.parametrize("name", ["terngrad", "natural"])
def test_private_randomness_leaves_global_rng_alone(name):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _round_trip(gradzip.codec(name), _randn((1000,)))
    assert torch.equal(torch.rand(3), expected)


def test_metadata():
    expect = {
        "terngrad": (("allgather", "sra"), "none", True, True),
        "natural": (("allgather", "sra"), "none", True, True),
        "u8bit": (("allgather", "sra"), "none", False, True),
        "inceptionn": (("allgather",), "residual", False, False),
        "tbq": (("allgather",), "residual", False, True),
    }
    for name, (colls, mem, stochastic, fixed) in expect.items():
        c = gradzip.codec(name)
        assert (c.collectives, c.default_memory, c.stochastic, c.fixed_size) == (colls, mem, stochastic, fixed), name
        assert c.family == "quantization" and c.paper and not c.summable
        doc = type(c).__doc__ or ""
        assert all(word in doc for word in ("Options", "Wire", "Collectives", "memory")), name


# ============================================================================ option errors
@pytest.mark.parametrize(
    "name,opts,expect",
    [
        ("terngrad", {"bucket_size": -1}, "non-negative"),
        ("terngrad", {"bucket_size": 2.5}, "non-negative"),
        ("terngrad", {"bucket_size": True}, "non-negative"),
        ("terngrad", {"seed": -3}, "non-negative"),
        ("natural", {"seed": "1"}, "non-negative"),
        ("u8bit", {"bucket_size": -8}, "non-negative"),
        ("u8bit", {"bucket_size": "1024"}, "non-negative"),
        ("inceptionn", {"error_bound": 0.0}, r"\[1e-30, 1e30\]"),
        ("inceptionn", {"error_bound": -0.1}, r"\[1e-30, 1e30\]"),
        ("inceptionn", {"error_bound": float("nan")}, r"\[1e-30, 1e30\]"),
        ("inceptionn", {"error_bound": float("inf")}, r"\[1e-30, 1e30\]"),
        ("inceptionn", {"error_bound": "0.001"}, r"\[1e-30, 1e30\]"),
        ("tbq", {"threshold": 0}, r"\[1e-30, 1e30\]"),
        ("tbq", {"threshold": -0.01}, r"\[1e-30, 1e30\]"),
        ("tbq", {"threshold": float("nan")}, r"\[1e-30, 1e30\]"),
        ("tbq", {"threshold": True}, r"\[1e-30, 1e30\]"),
    ],
)
def test_bad_option_values(name, opts, expect):
    with pytest.raises(ValueError, match=expect) as err:
        gradzip.codec(name, **opts)
    assert next(iter(opts)) in str(err.value)


@pytest.mark.parametrize(
    "name,opt", [("u8bit", "seed"), ("tbq", "bits"), ("inceptionn", "seed"), ("natural", "bucket_size")]
)
def test_options_a_codec_does_not_have(name, opt):
    with pytest.raises(ValueError, match=opt):
        gradzip.codec(name, **{opt: 1})


def test_good_options_are_kept():
    assert gradzip.codec("terngrad", bucket_size=256, seed=4).config() == {"bucket_size": 256, "seed": 4}
    assert gradzip.codec("tbq", threshold=1).config() == {"threshold": 1}  # ints are fine (GRADZIP_THRESHOLD=1)
    assert gradzip.codec("inceptionn", error_bound=2**-8).config() == {"error_bound": 2**-8}


def _residual_growth(codec, steps: int) -> float:
    """Error feedback by hand over Gaussian gradients: the residual's norm after ``steps`` steps
    over the gradient's."""
    e = torch.zeros(1 << 14)
    for t in range(steps):
        g = torch.randn(1 << 14, generator=torch.Generator().manual_seed(t))
        x = g + e
        e = x - codec.decode(codec.encode(x, "w", t))
    return float(e.norm() / g.norm())


@pytest.mark.parametrize("name, opts, allowed", [
    ("qsgd", {}, False),  # 4 bits, 512 values: √512 / 7 = 3.2
    ("qsgd", {"bits": 2, "bucket_size": 4}, False),  # √4 / 1 = 2
    ("qsgd", {"bits": 2, "bucket_size": 1}, True),  # a bucket of one value is sent exactly
    ("qsgd", {"bits": 5}, False),  # √512 / 15 = 1.5
    ("qsgd", {"bits": 6}, True),  # √512 / 31 = 0.73
    ("qsgd", {"bits": 4, "bucket_size": 48}, True),  # √48 / 7 = 0.99
    ("qsgd", {"bits": 8}, True),
    ("terngrad", {}, False), ("terngrad", {"bucket_size": 64}, False), ("cl_terngrad", {}, False),
    ("terngrad", {"bucket_size": 1}, True),
])
def test_unbiased_quantisers_take_error_feedback_only_where_its_residual_stays_bounded(name, opts, allowed):
    """A value's error reaches ``√bucket_size / s`` times its bucket's largest value for QSGD
    and the scale itself for TernGrad: where that is not below 1, error feedback's residual is
    not bounded (QSGD's default grew to 1e4 times the gradient in 150 steps here), so a stateful
    memory is refused at construction with the way out in the message; without error
    feedback, the default, every setting is taken."""
    from gradzip.sync.engine import check_settings

    c = gradzip.codec(name, **opts)
    assert c.default_memory == "none" and c.memory_problem("none") is None
    for memory in ("residual", "efsign", "dgc"):
        assert (c.memory_problem(memory) is None) == allowed, memory
    if allowed:
        check_settings(name, opts, memory="residual")
        assert _residual_growth(c, 60) < 1.0
    else:
        with pytest.raises(ValueError, match=rf"{name}.*cannot take memory='residual'.*memory='none'"):
            check_settings(name, opts, memory="residual")
        with pytest.raises(ValueError, match="not stay bounded"):
            gradzip.Communicator(name, memory="residual", **opts)
    if (name, opts) == ("qsgd", {}):
        assert _residual_growth(c, 150) > 1e3  # what the refusal spares
        # a memory of the user's own: refused where it keeps state, whatever its name
        from gradzip.sync.memory import Memory, ResidualMemory

        class Quiet(Memory):
            name = "quiet"

        class Mine(ResidualMemory):
            name = "mine"

        gradzip.Communicator(name, memory=Quiet(), **opts).close()
        with pytest.raises(ValueError, match="cannot take memory='mine'"):
            gradzip.Communicator(name, memory=Mine(), **opts)
