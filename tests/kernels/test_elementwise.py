"""The element-wise codecs' kernels (TernGrad, TBQ, 1-bit SGD's decode, natural compression,
the 8-bit table, INCEPTIONN) against their torch specification, bit for bit, in both compiled versions: the
fused C loops (:mod:`gradzip.kernels.native`) and the Triton kernels (:mod:`gradzip.kernels.gpu`,
interpreted on CPU tensors without a GPU, compiled with one; marked ``gpu``)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.codecs.quantize import _u8_tables
from gradzip.kernels import native, reference
from gradzip.kernels.buckets import bucket_view
from gradzip.kernels.rng import counter_uniform

from . import triton_kernels

HAVE_CC = any(shutil.which(cc) for cc in (os.environ.get("CC") or "cc", "gcc", "clang"))


@pytest.fixture(scope="module", params=[
    pytest.param("native", marks=pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")),
    pytest.param("triton", marks=pytest.mark.gpu),
])
def kernels(request):
    """(the kernels' module, the device of their tensors)."""
    if request.param == "native":
        assert native.available() is None, native.available()
        return native, torch.device("cpu")
    return triton_kernels.load()


def _randn(n: int, device: torch.device, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (tells -0.0 from 0.0, compares NaNs)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("n,bucket", [(1, 1), (7, 7), (9000, 9000), (1000, 64), (4097, 1024), (100, 24)])
def test_terngrad_bit_identical(kernels, n, bucket):
    """Codes from the same values, scales and counter draws (made inside the kernel); an
    all-zero bucket, NaN and ±inf included."""
    impl, device = kernels
    x = _randn(n, device, seed=n + bucket)
    if n >= 100:
        x[: min(bucket, n // 2)] = 0.0  # an all-zero bucket (or part of the only one): 0/0 is NaN
        x[-3] = float("nan")
        x[-20] = float("inf")
        x[-40] = -float("inf")
    buckets = bucket_view(x, bucket)
    key = 0x9E000000 + n  # above 2**31: the kernel takes it as a signed int32
    rand = counter_uniform(buckets.numel(), key, device).view(buckets.shape)
    packed, scale = impl.terngrad_encode(buckets, key, n)
    ref_packed, ref_scale = reference.terngrad_encode(buckets, rand, n)
    assert torch.equal(packed, ref_packed) and _same_bits(scale, ref_scale)
    assert _same_bits(impl.ternary_decode(packed, scale, bucket, n), reference.ternary_decode(packed, scale, bucket, n))
    base = _randn(n, device, seed=n + 1)
    acc = base.clone()
    impl.ternary_decode(packed, scale, bucket, n, out=acc, accumulate=True)
    assert _same_bits(acc, base + reference.ternary_decode(packed, scale, bucket, n))
    # given scales (a fused group's: each block its member's, at least its own maximum)
    given = scale.abs().nan_to_num(nan=1.0) * 1.5 + 0.25
    packed, kept = impl.terngrad_encode(buckets, key, n, given)
    ref_packed, _ = reference.terngrad_encode(buckets, rand, n, given)
    assert torch.equal(packed, ref_packed) and kept is not None and _same_bits(kept, given)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_tbq_bit_identical(kernels, dtype):
    impl, device = kernels
    tau = 0.5
    x = _randn(5003, device, seed=9).to(dtype)
    x[:4] = torch.tensor([0.5, -0.5, float("nan"), float("inf")], dtype=dtype)  # ties with τ send nothing
    if dtype == torch.float64:  # within half an fp32 ulp of τ: compared after rounding to fp32
        x[4:6] = torch.tensor([0.5 + 2.0**-27, -(0.5 + 2.0**-27)], dtype=dtype)
    packed = impl.tbq_encode(x, tau)
    assert torch.equal(packed, reference.tbq_encode(x, tau))
    scale = torch.tensor([tau], device=device)
    assert _same_bits(impl.ternary_decode(packed, scale, x.numel(), x.numel()),
                      reference.ternary_decode(packed, scale, x.numel(), x.numel()))


@pytest.mark.parametrize("n,bucket", [(1, 1), (9, 4), (1000, 64), (4097, 1024)])
def test_onebit_decode_bit_identical(kernels, n, bucket):
    impl, device = kernels
    x = _randn(n, device, seed=n)
    packed = reference.sign_encode(x)
    nb = -(-n // bucket)
    means = _randn(2 * nb, device, seed=n + 2)
    if nb > 1:
        means[1] = float("inf")  # the other side's value becomes NaN, as in the reference
    exact = dict(rtol=0, atol=0, equal_nan=True)  # a NaN's payload bits are unspecified
    got = impl.onebit_decode(packed, means, bucket, n)
    torch.testing.assert_close(got, reference.onebit_decode(packed, means, bucket, n), **exact)
    assert torch.isnan(got).any() == (nb > 1)
    base = _randn(n, device, seed=n + 1)
    acc = base.clone()
    impl.onebit_decode(packed, means, bucket, n, out=acc, accumulate=True)
    torch.testing.assert_close(acc, base + reference.onebit_decode(packed, means, bucket, n), **exact)


@pytest.mark.parametrize("case", ["normal", "tiny", "nonfinite"])
def test_natural_codes_bit_identical(kernels, case):
    impl, device = kernels
    x = _randn(5000, device, seed=11)
    if case == "tiny":
        x[::3] *= 1e-38  # far below the header's range: coded with probability, or as 0
    if case == "nonfinite":
        x[7], x[8] = float("nan"), -float("inf")
    x[::10] = 0.0
    bits = x.float().contiguous().view(torch.int32)
    largest = (bits & 0x7FFFFFFF).clamp(max=0x7F800000).amax()
    top = ((largest + ((1 << 23) - 1)) >> 23).add_((largest >= 0x7F800000).to(torch.int32)).reshape(1)
    for key in (3, 0xF00DFACE):
        rand = reference.natural_draws(counter_uniform(5000, key, device))
        assert 0 <= int(rand.min()) and int(rand.max()) < 1 << 23
        got = impl.natural_codes(bits, key, top)
        assert torch.equal(got, reference.natural_codes(bits, rand, top))
    assert (got & 127).gt(0).any() and (got & 127).eq(0).any()


def test_natural_codes_and_decode_under_a_header_a_bucket_bit_identical(kernels):
    """Headers of 256-value buckets (a fused group's members), each bucket's from its values,
    some far apart: codes as the reference makes them with each value's header, and the decode
    as the reference's (a header of 256 for non-finite values; 2**128 of a finite header)."""
    impl, device = kernels
    n, bucket = 256 * 9 + 100, 256
    x = _randn(n, device, seed=12)
    x[:256] *= 1e-30
    x[256:512] *= 1e30
    x[600], x[900] = float("nan"), float("inf")
    x[1024:1280] = 0.0
    bits = x.float().contiguous().view(torch.int32)
    mags = (bits & 0x7FFFFFFF).clamp(max=0x7F800000)
    largest = torch.nn.functional.pad(mags, (0, -n % bucket)).view(-1, bucket).amax(dim=1)
    top = ((largest + ((1 << 23) - 1)) >> 23).add_((largest >= 0x7F800000).to(torch.int32))
    per_value = top.repeat_interleave(bucket)[:n]
    rand = reference.natural_draws(counter_uniform(n, 77, device))
    codes = impl.natural_codes(bits, 77, top, bucket)
    assert torch.equal(codes, reference.natural_codes(bits, rand, per_value))
    got = impl.natural_decode(codes, top, bucket, n)
    assert _same_bits(got, reference.natural_decode(codes, per_value, n))
    base = _randn(n, device, seed=13)
    acc = base.clone()
    impl.natural_decode(codes, top, bucket, n, out=acc, accumulate=True)
    assert _same_bits(acc, base + reference.natural_decode(codes, per_value, n))
    with pytest.raises(ValueError, match="power of two"):
        impl.natural_decode(codes, top, 100, n)


@pytest.mark.parametrize("n,bucket", [(1, 1), (5000, 512), (4097, 4097)])
def test_u8bit_codes_and_table_decode_bit_identical(kernels, n, bucket):
    impl, device = kernels
    table, mids, lut = _u8_tables(device)
    x = _randn(n, device, seed=n)
    if n > 10:
        x[: min(bucket, n // 2)] = 0.0  # a zero bucket (or part of the only one): scale 0, inv 0
        x[-1], x[-2], x[-3] = float("nan"), -0.0, 1e-42
    buckets = bucket_view(x, bucket)
    scale = buckets.abs().amax(dim=1)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)).clamp_(max=torch.finfo(torch.float32).max)
    codes = impl.u8bit_codes(buckets, inv, mids, lut, n)
    assert torch.equal(codes, reference.u8bit_codes(buckets, inv, mids, lut, n))
    # into a slice of a larger message, as the codec writes them: the same bytes, none around touched
    message = torch.full((n + 8,), 0xA5, dtype=torch.uint8, device=device)
    into = impl.u8bit_codes(buckets, inv, mids, lut, n, out=message[3 : 3 + n])
    assert into.data_ptr() == message[3:].data_ptr() and torch.equal(message[3 : 3 + n], codes)
    assert bool((message[:3] == 0xA5).all()) and bool((message[3 + n :] == 0xA5).all())
    exact = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(impl.table_decode(codes, table, scale, bucket, n),
                               reference.table_decode(codes, table, scale, bucket, n), **exact)
    base = _randn(n, device, seed=n + 1)
    acc = base.clone()
    impl.table_decode(codes, table, scale, bucket, n, out=acc, accumulate=True)
    torch.testing.assert_close(acc, base + reference.table_decode(codes, table, scale, bucket, n), **exact)
    # without a scale (natural compression's table): the table's values themselves
    plain = table[codes.long()]
    torch.testing.assert_close(reference.table_decode(codes, table, None, n, n), plain, **exact)
    torch.testing.assert_close(impl.table_decode(codes, table, None, n, n), plain, **exact)


def test_element_wise_encoders_read_strided_buckets(kernels):
    """A strided gradient view reaches the kernels as it is: they must read its values, not its memory."""
    impl, device = kernels
    base = _randn(2048, device, seed=4)
    x = base[::2]
    buckets = bucket_view(x, 256)
    assert not buckets.is_contiguous()
    scale = buckets.abs().amax(dim=1)
    rand = counter_uniform(buckets.numel(), 1, device).view(buckets.shape)
    assert all(torch.equal(a, b) for a, b in zip(impl.terngrad_encode(buckets, 1, 1024),
                                                 reference.terngrad_encode(buckets, rand, 1024)))
    _, mids, lut = _u8_tables(device)
    inv = 1.0 / scale
    assert torch.equal(impl.u8bit_codes(buckets, inv, mids, lut, 1024), reference.u8bit_codes(buckets, inv, mids, lut, 1024))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20_000), bucket=st.integers(1, 6000), key=st.integers(0, 2**32 - 1),
       seed=st.integers(0, 2**31 - 1), accumulate=st.booleans())
def test_c_loops_give_the_specifications_bits_wherever_buckets_and_spans_are_cut(n, bucket, key, seed, accumulate):
    """The C loops walk a bucket at a time inside spans of a few thousand values: any size and
    bucket, the boundaries of both anywhere, and NaN, ±inf, ±0 and subnormals among the values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-130, 60, (n,), generator=g).float())
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-42])
    picks = torch.randint(0, n, (min(n, 12),), generator=g)
    x[picks] = specials[torch.arange(picks.numel()) % specials.numel()]
    buckets = bucket_view(x, bucket)
    rand = counter_uniform(buckets.numel(), key).view(buckets.shape)
    packed, scale = native.terngrad_encode(buckets, key, n)
    want_packed, want_scale = reference.terngrad_encode(buckets, rand, n)
    assert torch.equal(packed, want_packed) and _same_bits(scale, want_scale)
    base = torch.randn(n, generator=g)

    def decoded(impl, *args):
        return impl(*args, out=base.clone(), accumulate=True) if accumulate else impl(*args)

    assert _same_bits(decoded(native.ternary_decode, packed, scale, bucket, n),
                      decoded(reference.ternary_decode, packed, scale, bucket, n))
    bits = x.view(torch.int32)
    rows = -(-n // 256)
    mags = torch.nn.functional.pad((bits & 0x7FFFFFFF).clamp(max=0x7F800000), (0, rows * 256 - n)).view(rows, 256)
    tops = ((mags.amax(dim=1) + ((1 << 23) - 1)) >> 23).to(torch.int32)
    per_value = tops.repeat_interleave(256)[:n]
    codes = native.natural_codes(bits, key, tops, 256)
    assert torch.equal(codes, reference.natural_codes(bits, reference.natural_draws(counter_uniform(n, key)), per_value))
    assert _same_bits(decoded(native.natural_decode, codes, tops, 256, n),
                      decoded(reference.natural_decode, codes, per_value, n))
    table, mids, lut = _u8_tables(torch.device("cpu"))
    finite = bucket_view(x.nan_to_num(0.0, 1e30, -1e30), bucket)
    top = finite.abs().amax(dim=1)
    inv = torch.where(top > 0, 1.0 / top, torch.zeros_like(top))
    codes = native.u8bit_codes(finite, inv, mids, lut, n)
    assert torch.equal(codes, reference.u8bit_codes(finite, inv, mids, lut, n))
    assert _same_bits(decoded(native.table_decode, codes, table, top, bucket, n),
                      decoded(reference.table_decode, codes, table, top, bucket, n))
    means = torch.randn(2 * buckets.shape[0], generator=g)
    signs = reference.sign_encode(x)
    torch.testing.assert_close(decoded(native.onebit_decode, signs, means, bucket, n),
                               decoded(reference.onebit_decode, signs, means, bucket, n), rtol=0, atol=0)


ROW_SHAPES = [(1, 1), (3, 7), (40, 256), (2, 70_001), (1, 200_003), (5000, 3)]


def _rows(rows: int, width: int, scale: float = 1.0) -> torch.Tensor:
    """A strided view (every other column) with -0.0, NaN and -inf where the rows allow."""
    x = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)).mul_(scale)[:, ::2]
    x[0, 0] = -0.0
    if rows > 2:
        x[1, width // 2], x[2, 0] = float("nan"), -float("inf")
    if width > 70_000:  # (in the last of a long row's chunks)
        x[-1, -1] = float("nan")
    return x


@pytest.mark.parametrize("rows,width", ROW_SHAPES)
def test_row_maxima_are_amax_of_the_magnitudes(kernels, rows, width):
    """NaN, ±inf and -0.0 included, a strided view read as its values, and a long row reduced
    in several chunks: exact, as a maximum is in any order."""
    impl, device = kernels
    x = _rows(rows, width)
    assert _same_bits(impl.row_maxima(x.to(device)).cpu(), x.abs().amax(dim=1))
    if impl is native:  # (the C loop reads 16-bit rows as fp32 too)
        assert _same_bits(native.row_maxima(x.to(torch.float16)), x.to(torch.float16).float().abs().amax(dim=1))


def test_row_statistics_of_no_values_and_of_rows_expanded_from_one(kernels):
    """Rows of no values give a maximum of 0 and sums and counts of 0; rows that are one row
    expanded (a row stride of 0) give that row's statistics each."""
    impl, device = kernels
    assert torch.equal(impl.row_maxima(torch.zeros(3, 0, device=device)).cpu(), torch.zeros(3))
    assert torch.equal(impl.side_sums(torch.zeros(3, 0, device=device)).cpu(), torch.zeros(3, 3, dtype=torch.float64))
    one = torch.tensor([[9.0, -1.0, 1.0, -4.0]], device=device).expand(3, 4)
    assert torch.equal(impl.row_maxima(one).cpu(), torch.full((3,), 9.0))
    assert torch.equal(impl.side_sums(one).cpu(), torch.tensor([[-5.0, 10.0, 2.0]] * 3, dtype=torch.float64))


@pytest.mark.parametrize("rows,width", ROW_SHAPES)
def test_side_sums_are_the_fp64_sums_of_each_side(kernels, rows, width):
    """1-bit SGD's statistics: each side's fp64 sum (a NaN in both, -inf in the negative one),
    another order of torch's sums, exact where the values are whole numbers; the counts exact."""
    impl, device = kernels
    for x in (_rows(rows, width, 1e3), _rows(rows, width, 1e3).round()):
        got = impl.side_sums(x.to(device)).cpu()
        want = torch.stack([x.clamp(max=0).double().sum(dim=1), x.clamp(min=0).double().sum(dim=1),
                            (x >= 0).sum(dim=1, dtype=torch.float64)], 1)
        assert got.dtype == torch.float64 and got.shape == (rows, 3)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, equal_nan=True)
        assert torch.equal(got[:, 2], want[:, 2])
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))  # (whole numbers: any order sums them exactly)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
def test_c_loops_refuse_what_they_would_read_past_or_misread():
    """The loops read through raw pointers: codes of another dtype, too few code bytes, or more
    values than the buckets hold are a ValueError before any read."""
    table, mids, lut = _u8_tables(torch.device("cpu"))
    scale = torch.ones(1)
    with pytest.raises(ValueError, match="uint8"):
        native.table_decode(torch.tensor([1, 2, 200], dtype=torch.int32), table, scale, 3, 3)
    with pytest.raises(ValueError, match="at least 4 bytes"):
        native.ternary_decode(torch.zeros(2, dtype=torch.uint8), scale, 16, 16)
    with pytest.raises(ValueError, match="at least 2 bytes"):
        native.onebit_decode(torch.zeros(1, dtype=torch.uint8), torch.ones(2), 9, 9)
    with pytest.raises(ValueError, match="at least 5 bytes"):
        native.natural_decode(torch.zeros(4, dtype=torch.uint8), torch.tensor([130]), 0, 5)
    buckets = torch.randn(2, 4)
    with pytest.raises(ValueError, match="numel: at most the 2 x 4 values"):
        native.terngrad_encode(buckets, 1, 100)
    with pytest.raises(ValueError, match="numel: at most the 2 x 4 values"):
        native.u8bit_codes(buckets, torch.ones(2), mids, lut, 9)
    # keys that would index past the sketch's cells, and memory the loops cannot read
    for key_bits, zero_key in ((18, 1 << 18), (40, 1 << 39), (0, 0)):
        with pytest.raises(ValueError, match="sketch keys"):
            native.sketch_cells(torch.tensor([3e38]), key_bits, zero_key)
        with pytest.raises(ValueError, match="sketch keys"):
            native.sketch_codes(torch.tensor([3e38]), key_bits, zero_key, torch.zeros(8, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="CPU tensors"):
        native.row_maxima(torch.zeros(2, 2, device="meta"))
    # AdaQ's second pass writes no index past the room the first pass's count gave it, should the
    # values have changed in between: it returns the larger count, which the wrapper refuses
    g = torch.arange(1.0, 65.0)  # bins of one value: every value is its bin's largest
    idx, counts = torch.full((10,), -7, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    found = native._kernels().gz_adacomp_select(g.data_ptr(), None, 64, 1, 0, counts.data_ptr(), idx.data_ptr(), 3)
    assert found == 64 and torch.equal(idx[3:], torch.full((7,), -7))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 12_000), span=st.sampled_from([1, 7, 256, 5000]), cut=st.floats(0.0, 3.0),
       most=st.one_of(st.none(), st.integers(0, 12_000)), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_c_selection_is_nonzero_of_the_comparison(n, span, cut, most, seed, dtype):
    """The sparsifiers' selection in C: the indices ``torch.nonzero`` gives, with one threshold
    or one a block among each block's first ``valid`` values (NaN reaches none, ±inf any finite
    one), or None where more than ``most`` pass."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    if n > 4:
        x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
    blocks = -(-n // span)
    thresholds = torch.rand(blocks, generator=g) * 2
    valid = torch.randint(0, span + 1, (blocks,), generator=g, dtype=torch.int32)
    for args in ((cut,), (0.0, thresholds, valid)):
        want = reference.select_magnitudes(x, *args, span=span)
        got = native.select_magnitudes(x, *args, span=span, most=most)
        if most is not None and want.numel() > most:
            assert got is None
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_inceptionn_bit_identical(kernels, dtype):
    """The tags, the byte stream and the decoded values (stored and added) of the torch
    version (``reference``, whole and a piece at a time as on the CPU), bit for bit (NaN's
    payload bits aside): values of every tag (under the bound, 7 and 15 bits, raw), every fp16
    and bf16 bit pattern (whose cast-back decode decides the tag), ±0, NaN and ±inf; sizes
    about a program's 4096 values; empty and all-zero inputs (no stream); a payload too short
    for its values refused."""
    import gradzip
    from gradzip.kernels import fused

    impl, device = kernels
    c = gradzip.codec("inceptionn", error_bound=0.01)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(10007, generator=g) * torch.logspace(-4, 3, 10007)).to(dtype).to(device)
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0.005], dtype=torch.float64).to(dtype)
    cases = [x, x[:0], torch.zeros(9, dtype=dtype, device=device), x[:4095], x[:4097]]
    if dtype in (torch.float16, torch.bfloat16):  # every bit pattern of the type, under two bounds
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).to(device)
        cases += [every, every * 3]
    for values in cases:
        # (the torch version on the CPU, as the codec takes it there)
        want = reference.inceptionn_encode(values.cpu(), c._b, c._step)
        packed, stream = impl.inceptionn_encode(values, c._b, c._step)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GRADZIP_KERNELS", "torch")  # (the CPU's torch version, a piece at a time)
            patch.setattr(fused, "TORCH_PIECE", 1000)
            pieces = fused.inceptionn_encode(values.cpu(), c._b, c._step)
        for got in ((packed.cpu(), stream.cpu()), pieces):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for accumulate in (False, True):
            base = torch.linspace(-1, 1, values.numel())
            ref = reference.inceptionn_decode(packed.cpu(), stream.cpu(), dtype, values.numel(), c._step, base.clone(), accumulate)
            got = impl.inceptionn_decode(packed, stream, dtype, values.numel(), c._step, base.clone().to(device), accumulate)
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("GRADZIP_KERNELS", "torch")
                patch.setattr(fused, "TORCH_PIECE", 1000)
                by_pieces = fused.inceptionn_decode(packed.cpu(), stream.cpu(), dtype, values.numel(), c._step,
                                                    base.clone(), accumulate)
            for other in (got.cpu(), by_pieces):
                assert torch.equal(other.nan_to_num(7.0).view(torch.int32), ref.nan_to_num(7.0).view(torch.int32))
    packed, stream = impl.inceptionn_encode(x, c._b, c._step)
    with pytest.raises(ValueError, match="INCEPTIONN payload"):
        impl.inceptionn_decode(packed, stream, dtype, x.numel() + 8, c._step)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9000), seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-4, 1e4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_c_inceptionn_gives_the_specifications_bytes_and_values(n, seed, scale, dtype):
    """Any size and mix of tags: the C loops write and read whole words where the stream holds
    them and single bytes near its end; the same tags, bytes and values as the reference."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.logspace(-4, 3, n) * scale).to(dtype)
    packed, stream = native.inceptionn_encode(x, 0.01, 0.02)
    want_packed, want_stream = reference.inceptionn_encode(x, 0.01, 0.02)
    assert torch.equal(packed, want_packed) and torch.equal(stream, want_stream)
    want = reference.inceptionn_decode(packed, stream, dtype, n, 0.02)
    got = native.inceptionn_decode(packed, stream, dtype, n, 0.02)
    assert torch.equal(got.nan_to_num(7.0).view(torch.int32), want.nan_to_num(7.0).view(torch.int32))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
def test_c_inceptionn_refuses_a_stream_shorter_than_its_tags_say_and_ef_sign_sums_fp64_as_it_is():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 100
    packed, stream = native.inceptionn_encode(x, 0.01, 0.02)
    out = torch.full((3000,), 5.0)
    with pytest.raises(ValueError, match="its tags say"):
        native.inceptionn_decode(packed, stream[:-1], torch.float32, 3000, 0.02, out)
    assert bool((out == 5.0).all())  # nothing written
    import gradzip

    wide = torch.zeros(1000, dtype=torch.float64)
    wide[0], wide[1] = 1e39, -3e38  # beyond fp32: summed in fp64, the mean is finite
    codec = gradzip.codec("efsignsgd")
    payload = codec.encode(wide, name="w")
    assert not bool(codec.nonfinite(payload)) and bool(torch.isfinite(codec.decode(payload)).all())


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 9000), nb=st.sampled_from([2, 16, 200, 256]), seed=st.integers(0, 2**31 - 1))
def test_c_sketch_gives_the_torch_sketchs_cells_and_codes(n, nb, seed):
    """SketchML's cells (counts, fp64 sums added in index order) and packed codes in C: those
    of its torch version, NaN, ±inf, ±0 and subnormals among the values."""
    from gradzip.codecs.sketch import _CELLS, _ZERO_KEY, KEY_BITS, _sortable_keys
    from gradzip.kernels import pack_bits

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 100, (n,), generator=g).float())
    if n > 6:
        x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1e-42])
    keys = _sortable_keys(x)
    hist = torch.zeros(_CELLS, dtype=torch.float64).index_add_(0, keys, torch.ones(n, dtype=torch.float64))
    sums = torch.zeros(_CELLS, dtype=torch.float64).index_add_(0, keys, x.double())
    got_hist, got_sums = native.sketch_cells(x, KEY_BITS, _ZERO_KEY)
    assert torch.equal(got_hist, hist) and torch.equal(got_sums.nan_to_num(7.0), sums.nan_to_num(7.0))
    codes = torch.randint(0, nb, (_CELLS,), generator=g).to(torch.uint8)
    bits = max(1, (nb - 1).bit_length())
    assert torch.equal(native.sketch_codes(x, KEY_BITS, _ZERO_KEY, codes, bits), pack_bits(codes[keys.long()], bits))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 4096, 9001])
def test_c_codes_decode_looks_each_code_up_in_the_table(bits, n):
    from gradzip.kernels import pack_bits

    g = torch.Generator().manual_seed(n + bits)
    nb = 1 << bits
    table = torch.randn(nb, generator=g)
    codes = torch.randint(0, nb, (n,), generator=g).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert _same_bits(native.codes_decode(packed, bits, table, n), table[codes.long()])
    base = torch.randn(n, generator=g)
    got = native.codes_decode(packed, bits, table, n, out=base.clone(), accumulate=True)
    assert _same_bits(got, base + table[codes.long()])


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the torch versions run")
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9000), size=st.sampled_from([1, 7, 50, 4096]), seed=st.integers(0, 2**31 - 1),
       with_prev=st.booleans(), self_adjust=st.booleans())
def test_c_adacomp_selection_is_the_torch_selection(n, size, seed, with_prev, self_adjust):
    """AdaQ's selection (each bin's values whose h reaches its max |g|, never a zero; none in a
    bin with a NaN) in C: the indices and counts of its torch version."""
    import gradzip

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.1] = 0.0
    if n > 10:
        x[3], x[9] = float("nan"), -float("inf")
    prev = torch.randn(n, generator=g) if with_prev else None
    codec = gradzip.codec("adaq", bin_size=size, self_adjust=self_adjust)
    got = codec._selection(x, prev, size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADZIP_KERNELS", "torch")
        want = codec._selection(x, prev, size)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("n", [1, 7, 8, 4097, 100_003])
def test_signum_step_is_torchs_update_and_its_sign_bits(kernels, n):
    """Signum's one pass: the momentum ``torch.mul(m, β).add_(g, alpha=1-β)`` bit for bit (one
    rounding for the add, as torch's), kept only on a finite step, and the sign bits of the new
    momentum (set for zeros and -0.0)."""
    impl, device = kernels
    g = _randn(n, device, seed=n)
    m0 = _randn(n, device, seed=n + 1) * 0.5
    if n > 4:
        g[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e30])
        m0[:4] = torch.tensor([0.0, 0.0, -1e-30, 1e30])
    for beta in (0.9, 0.0, 0.37):
        want = torch.mul(m0, beta).add_(g, alpha=1.0 - beta)
        for finite in (True, False):
            m = m0.clone()
            bits = impl.signum_encode(g, m, beta, torch.tensor(finite, device=device))
            assert torch.equal(bits.cpu(), reference.sign_encode(want).cpu()), (beta, finite)
            assert torch.equal(m.view(torch.int32), (want if finite else m0).view(torch.int32)), (beta, finite)
    out = torch.full((-(-n // 8),), 7, dtype=torch.uint8, device=device)
    assert impl.signum_encode(g, m0.clone(), 0.9, torch.tensor(True, device=device), out) is out
    with pytest.raises(ValueError, match="contiguous fp32 momentum"):
        impl.signum_encode(g, torch.zeros(n + 1, device=device), 0.9, torch.tensor(True, device=device))
