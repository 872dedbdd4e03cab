"""The Triton kernels (:mod:`gradzip.kernels.gpu`) against their torch specification.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: ``tests/conftest.py``
switches it on before anything imports Triton (Triton fixes at import whether its language
functions are interpreted). With a GPU they run compiled on CUDA tensors, unless
``TRITON_INTERPRET=1`` asks for the interpreter. The interpreter takes milliseconds per program,
so the tensors are small and large buckets carry the odd sizes.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernels need triton (pip install triton)")

from gradzip.kernels import gpu, reference  # noqa: E402
from gradzip.kernels.bitpack import unpack_bits  # noqa: E402
from gradzip.kernels.rng import counter_uniform  # noqa: E402

from . import triton_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

INTERPRET = bool(triton.knobs.runtime.interpret)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

# (numel, bucket): odd sizes, a single partial bucket, many small buckets, a non-power-of-two
# bucket, and buckets larger than gpu.CHUNK (walked in pieces)
CASES = [(1, 8), (7, 8), (40, 8), (64, 64), (1000, 64), (1000, 1024), (4097, 1024), (100, 24), (9000, 5000)]
KEYS = [None, 0xDEADBEEF]


@pytest.fixture(scope="module", autouse=True)
def _kernels_available():
    """Load the kernels (interpreted without a GPU, compiled with one)."""
    triton_kernels.load()
    yield


def _randn(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(DEVICE)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (tells -0.0 from 0.0, compares NaNs)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# -------------------------------------------------------------------------------------- max-min
@pytest.mark.parametrize("key", KEYS, ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_maxmin_bit_identical(bits, key):
    for n, bucket in CASES:
        x = _randn(n, seed=n * 131 + bits)
        packed, stats = gpu.maxmin_encode(x, bits, bucket, key)
        ref_packed, ref_stats = reference.maxmin_encode(x, bits, bucket, key)
        assert torch.equal(packed, ref_packed), (n, bucket)
        assert _same_bits(stats, ref_stats), (n, bucket)
        out = gpu.maxmin_decode(packed, stats, bits, bucket, n)
        assert _same_bits(out, reference.maxmin_decode(packed, stats, bits, bucket, n)), (n, bucket)


@pytest.mark.parametrize("bucket", [1, 5, 12, 100])
def test_maxmin_8_bits_takes_any_bucket(bucket):
    x = _randn(203, seed=bucket)
    for key in KEYS:
        packed, stats = gpu.maxmin_encode(x, 8, bucket, key)
        ref_packed, ref_stats = reference.maxmin_encode(x, 8, bucket, key)
        assert torch.equal(packed, ref_packed) and _same_bits(stats, ref_stats)
        out = gpu.maxmin_decode(packed, stats, 8, bucket, 203)
        assert _same_bits(out, reference.maxmin_decode(packed, stats, 8, bucket, 203))


def test_maxmin_rounds_half_to_even():
    # bucket range [0, 3] at 2 bits: scale 1, so the levels are the values rounded
    x = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 0.5], device=DEVICE)
    packed, _ = gpu.maxmin_encode(x, 2, 8, None)
    assert unpack_bits(packed, 2, 8).tolist() == [0, 0, 2, 2, 3, 1, 2, 0]
    assert torch.equal(packed, reference.maxmin_encode(x, 2, 8, None)[0])


@pytest.mark.parametrize("key", KEYS, ids=["nearest", "stochastic"])
def test_maxmin_constant_buckets(key):
    x = torch.cat([torch.zeros(16), torch.full((16,), -2.5), torch.arange(16.0)]).to(DEVICE)
    packed, stats = gpu.maxmin_encode(x, 4, 16, key)
    ref_packed, ref_stats = reference.maxmin_encode(x, 4, 16, key)
    assert torch.equal(packed, ref_packed)
    assert _same_bits(stats, ref_stats)
    assert stats.tolist()[:4] == [0.0, 0.0, -2.5, 0.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_maxmin_other_dtypes_convert_like_reference(dtype):
    x = _randn(300, seed=3, dtype=dtype)
    for key in KEYS:
        packed, stats = gpu.maxmin_encode(x, 3, 64, key)
        ref_packed, ref_stats = reference.maxmin_encode(x, 3, 64, key)
        assert torch.equal(packed, ref_packed)
        assert _same_bits(stats, ref_stats)


def test_maxmin_non_contiguous_input():
    x = _randn(2 * 257, seed=4)[::2]
    assert not x.is_contiguous()
    packed, stats = gpu.maxmin_encode(x, 5, 64, 7)
    ref_packed, ref_stats = reference.maxmin_encode(x.contiguous(), 5, 64, 7)
    assert torch.equal(packed, ref_packed) and _same_bits(stats, ref_stats)


def test_encoders_write_into_given_tensors():
    """``out``: the packed codes and statistics land in the given (here dirty) tensors."""
    x = _randn(5000, seed=8)
    encoders = [(lambda o: gpu.maxmin_encode(x, 4, 64, 7, o), 2 * 79), (lambda o: gpu.qsgd_encode(x, 4, 64, 7, o), 79)]
    for encode, n_stats in encoders:
        want = encode(None)
        out = [torch.full((2500,), 7, dtype=torch.uint8, device=DEVICE), torch.full((n_stats,), 7.0, device=DEVICE)]
        got = encode(out)
        assert got[0] is out[0] and got[1] is out[1]
        assert torch.equal(got[0], want[0]) and _same_bits(got[1], want[1])
    # the codes alone (their headers and scales made apart): natural compression, TernGrad, TBQ
    top = torch.tensor([127 + 3], dtype=torch.int32, device=DEVICE)
    codes = [(lambda o: gpu.natural_codes(x.view(torch.int32), 7, top, 0, o), 5000),
             (lambda o: gpu.terngrad_encode(x.view(50, 100), 7, 5000, None, o)[0], 1250),
             (lambda o: gpu.tbq_encode(x, 0.5, o), 1250)]
    for encode, n_bytes in codes:
        want = encode(None)
        out = torch.full((n_bytes,), 7, dtype=torch.uint8, device=DEVICE)
        assert encode(out) is out and torch.equal(out, want)


def test_encoders_refuse_an_out_they_would_write_past_or_misread():
    """A kernel writes through ``out``'s pointer unchecked, so a short, strided, mistyped or
    miscounted ``out`` is refused before the launch, and nothing is written."""
    x = _randn(1000, seed=9)
    u8 = lambda n: torch.full((n,), 7, dtype=torch.uint8, device=DEVICE)  # noqa: E731
    f32 = lambda n: torch.full((n,), 7.0, device=DEVICE)  # noqa: E731
    cases = [  # (encoder, a right out, wrong ones)
        (lambda o: gpu.maxmin_encode(x, 4, 64, None, o), [u8(500), f32(32)],
         [[u8(499), f32(32)], [u8(500), f32(31)], [u8(1000)[::2], f32(32)], [u8(500), f32(32).double()], [u8(500)]]),
        (lambda o: gpu.qsgd_encode(x, 4, 64, 7, o), [u8(500), f32(16)], [[u8(500), f32(15)], [f32(125), f32(16)]]),
        (lambda o: gpu.fp8_encode(x, "e4m3", 128, o), [u8(1000), f32(8)], [[u8(999), f32(8)]]),
        (lambda o: gpu.mx_encode(x, "e2m1", 32, o), [u8(500), u8(32)], [[u8(1000), u8(32)], [u8(500), f32(32)]]),
        (lambda o: gpu.sign_encode(x, o[0]), [u8(125)], [[u8(124)], [u8(250)[::2]]]),
        (lambda o: gpu.natural_codes(x.view(torch.int32), 7, torch.tensor([130]), 0, o[0]), [u8(1000)],
         [[u8(999)], [u8(2000)[::2]], [torch.zeros(1000, dtype=torch.int8, device=DEVICE)]]),
        (lambda o: gpu.terngrad_encode(x.view(10, 100), 7, 1000, None, o[0]), [u8(250)], [[u8(249)], [u8(500)[::2]]]),
        (lambda o: gpu.tbq_encode(x, 0.5, o[0]), [u8(250)], [[u8(251)], [f32(250)]]),
        (lambda o: gpu.saturate(x, torch.float16, o[0]), [torch.zeros(1000, dtype=torch.float16, device=DEVICE)],
         [[torch.zeros(999, dtype=torch.float16, device=DEVICE)], [torch.zeros(1000, dtype=torch.bfloat16, device=DEVICE)]]),
    ]
    for encode, right, wrongs in cases:
        encode(right)  # the right form is taken
        for wrong in wrongs:
            before = [t.clone() for t in wrong]
            with pytest.raises(ValueError, match="out"):
                encode(wrong)
            assert all(torch.equal(t, b) for t, b in zip(wrong, before))


@pytest.mark.parametrize("bits", [3, 8])
def test_maxmin_decode_into_out_and_accumulate(bits):
    n, bucket = 1000, 64
    packed, stats = gpu.maxmin_encode(_randn(n, seed=5), bits, bucket, 11)
    expected = reference.maxmin_decode(packed, stats, bits, bucket, n)
    out = torch.full((n,), 7.0, device=DEVICE)
    assert gpu.maxmin_decode(packed, stats, bits, bucket, n, out=out) is out
    assert _same_bits(out, expected)
    base = _randn(n, seed=6)
    acc = base.clone()
    gpu.maxmin_decode(packed, stats, bits, bucket, n, out=acc, accumulate=True)
    assert _same_bits(acc, base + expected)


def test_empty_inputs():
    x = torch.empty(0, device=DEVICE)
    packed, stats = gpu.maxmin_encode(x, 4, 64, None)
    assert packed.numel() == 0 and stats.numel() == 0
    assert gpu.maxmin_decode(packed, stats, 4, 64, 0).numel() == 0
    assert gpu.sign_encode(x).numel() == 0
    assert gpu.sign_decode(torch.empty(0, dtype=torch.uint8, device=DEVICE), 0).numel() == 0


# ----------------------------------------------------------------------------------------- QSGD
@pytest.mark.parametrize("bits", range(2, 9))
def test_qsgd_matches_reference(bits):
    for n, bucket in CASES:
        x = _randn(n, seed=n * 17 + bits)
        key = 0x9E3779B9 + bits
        packed, norms = gpu.qsgd_encode(x, bits, bucket, key)
        ref_packed, ref_norms = reference.qsgd_encode(x, bits, bucket, key)
        # norms: a float64 sum here, torch's float32 reduction there, so the last bit may differ
        torch.testing.assert_close(norms, ref_norms, rtol=2e-6, atol=0)
        codes = unpack_bits(packed, bits, n)
        ref_codes = unpack_bits(ref_packed, bits, n)
        # where the norms agree bit for bit, so do the codes; elsewhere only a handful may differ
        same_norm = (norms.view(torch.int32) == ref_norms.view(torch.int32)).repeat_interleave(bucket)[:n]
        assert torch.equal(codes[same_norm], ref_codes[same_norm]), (n, bucket)
        assert int((codes != ref_codes).sum()) <= 4, (n, bucket)
        # decoding a given payload is exact
        out = gpu.qsgd_decode(packed, norms, bits, bucket, n)
        assert _same_bits(out, reference.qsgd_decode(packed, norms, bits, bucket, n)), (n, bucket)


def test_qsgd_decode_into_out_and_accumulate():
    n, bits, bucket = 777, 4, 64
    packed, norms = gpu.qsgd_encode(_randn(n, seed=8), bits, bucket, 123)
    expected = reference.qsgd_decode(packed, norms, bits, bucket, n)
    out = torch.empty(n, device=DEVICE)
    gpu.qsgd_decode(packed, norms, bits, bucket, n, out=out)
    assert _same_bits(out, expected)
    base = _randn(n, seed=9)
    acc = base.clone()
    gpu.qsgd_decode(packed, norms, bits, bucket, n, out=acc, accumulate=True)
    assert _same_bits(acc, base + expected)


# ----------------------------------------------------------------------------------------- sign
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 5000, 9001])
def test_sign_bit_identical(n):
    x = _randn(n, seed=n)
    x[::5] = 0.0
    x[1::7] = -0.0  # counts as >= 0
    x[2::11] = float("nan")  # counts as negative
    packed = gpu.sign_encode(x)
    assert torch.equal(packed, reference.sign_encode(x))
    scale = torch.tensor([0.37], device=DEVICE)
    for s in (None, scale):
        assert _same_bits(gpu.sign_decode(packed, n, s), reference.sign_decode(packed, n, s))
    base = _randn(n, seed=n + 1)
    acc = base.clone()
    gpu.sign_decode(packed, n, scale, out=acc, accumulate=True)
    assert _same_bits(acc, base + reference.sign_decode(packed, n, scale))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_sign_other_dtypes(dtype):
    x = _randn(100, seed=1, dtype=dtype)
    assert torch.equal(gpu.sign_encode(x), reference.sign_encode(x))


@pytest.mark.parametrize("numel,key", [(0, 1), (1, 0), (4097, 0xFFFFFFFF), (10000, 0x9E3779B1)])
def test_counter_uniform_kernel_draws_the_specification(numel, key):
    assert _same_bits(gpu.counter_uniform(numel, key, DEVICE), counter_uniform(numel, key, DEVICE))
    for start in (1, 4096, (1 << 32) - 5):  # from an offset: a piece of a longer stream
        assert _same_bits(gpu.counter_uniform(numel, key, DEVICE, start), counter_uniform(numel, key, DEVICE, start))


# -------------------------------------------------------------------------------------- TernGrad
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_select_magnitudes_is_nonzero_of_the_comparison(dtype):
    """The indices ``torch.nonzero(|x| >= t)`` gives (|x| in fp32), with one threshold or one a
    block of 256 values among each block's first ``valid`` values; NaN never reaches a
    threshold, ±inf reaches any finite one; across programs of 4096 values; empty input."""
    x = _randn(9000, seed=21).to(dtype)
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=torch.float64).to(dtype)
    mag = x.float().abs().cpu()
    for t in (0.0, 0.7, 2.5, float("inf")):
        got = gpu.select_magnitudes(x, t)
        assert torch.equal(got.cpu(), torch.nonzero(mag >= t).reshape(-1)), t
    blocks = -(-9000 // 256)
    thresholds = (torch.rand(blocks, generator=torch.Generator().manual_seed(2)) * 2).to(DEVICE)
    valid = torch.randint(0, 257, (blocks,), generator=torch.Generator().manual_seed(3), dtype=torch.int32).to(DEVICE)
    got = gpu.select_magnitudes(x, thresholds=thresholds, valid=valid, span=256)
    pos = torch.arange(9000)
    ref = torch.nonzero((mag >= thresholds.cpu()[pos // 256]) & (pos % 256 < valid.cpu()[pos // 256])).reshape(-1)
    assert torch.equal(got.cpu(), ref)
    assert gpu.select_magnitudes(x[:0], 0.5).numel() == 0
    # the torch specification, whole and a piece at a time (the CPU's way), says the same
    from gradzip.kernels import fused, reference

    for t in (0.7, float("inf")):
        assert torch.equal(reference.select_magnitudes(x.cpu(), t), torch.nonzero(mag >= t).reshape(-1))
    assert torch.equal(reference.select_magnitudes(x.cpu(), 0.0, thresholds.cpu(), valid.cpu()), ref)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADZIP_KERNELS", "torch")  # (the CPU's torch version, not its C loops)
        patch.setattr(fused, "TORCH_PIECE", 1000)  # (pieces of whole blocks: 768 values)
        assert torch.equal(fused.select_magnitudes(x.cpu(), 0.0, thresholds.cpu(), valid.cpu()), ref)
        assert torch.equal(fused.select_magnitudes(x.cpu(), 0.7), torch.nonzero(mag >= 0.7).reshape(-1))


def test_sparsifiers_select_with_the_kernel_as_with_torch(monkeypatch):
    """Threshold sparsification, and gradient dropping and DGC by a fused group's parts (each
    member's sampled threshold, never its padding), with the selection kernel (as they take it
    for CUDA tensors): the payloads of their torch versions."""
    import gradzip
    from gradzip.kernels import fused

    members = [_randn(3000, seed=31), torch.zeros(10, device=DEVICE), _randn(700, seed=32) * 1e-3, _randn(5000, seed=33)]
    members[1][3] = 1.0  # (a threshold of 0: its zeros sent, not its padding)
    starts, at = [], 0
    for m in members:
        starts.append(at)
        at += m.numel() + (-m.numel() % 256)
    flat = torch.zeros(at, device=DEVICE)
    for a, m in zip(starts, members):
        flat[a : a + m.numel()] = m
    parts = [(f"m{i}", (m.numel(),)) for i, m in enumerate(members)]
    # (samples of the whole members: CUDA's generators draw other samples than the CPU's)
    cases = [("threshold", {"threshold": 0.7}, None), ("graddrop", {"ratio": 0.05, "sample_ratio": 1.0}, parts),
             ("dgc", {"ratio": 0.01, "sample_ratio": 1.0}, parts), ("dgc", {"ratio": 0.3, "sample_ratio": 1.0}, parts)]
    torch_way = [gradzip.codec(name, **opts).encode(flat.cpu(), name="g", parts=p) for name, opts, p in cases]
    monkeypatch.setattr(fused, "triton_for", lambda x: gpu)
    for (name, opts, p), ref in zip(cases, torch_way):
        got = gradzip.codec(name, **opts).encode(flat, name="g", parts=p)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got.tensors, ref.tensors)), name


def test_inceptionn_codec_takes_the_kernels_with_the_same_payloads(monkeypatch):
    """The codec with the kernels (as it takes them for CUDA tensors) sends the payloads of its
    torch version, dense where those are dense, and decodes them alike."""
    import gradzip
    from gradzip.kernels import fused

    c = gradzip.codec("inceptionn")
    cases = [_randn(5000, seed=3) * 1e-3, _randn(300, seed=4).half() * 1e3, _randn(20, seed=5).bfloat16()]
    torch_way = [(p, c.decode(p)) for p in (c.encode(x.cpu(), name="t") for x in cases)]
    monkeypatch.setattr(fused, "triton_for", lambda x: gpu)
    for x, (ref, decoded) in zip(cases, torch_way):
        got = c.encode(x, name="t")
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got.tensors, ref.tensors))
        assert torch.equal(c.decode(got).cpu(), decoded)
    assert torch_way[1][0].tensors[0].numel() == 0  # (16-bit values beyond the tags' range: the dense form)


# ----------------------------------------------------------------------------------------- top-k
@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (5000, 50), (9000, 1), (9000, 9000)])
def test_topk_matches_torch_for_distinct_magnitudes(n, k):
    x = _randn(n, seed=n + k)
    values, indices = gpu.topk(x, k)
    assert indices.dtype == torch.int64 and values.dtype == x.dtype
    assert torch.equal(indices, torch.topk(x.abs(), k).indices.sort().values)  # output in index order
    assert torch.equal(values, x[indices])


@pytest.mark.parametrize("k", [1, 100, 700, 2000, 4999, 5000])
def test_topk_ties_give_exactly_k_lowest_indices_first(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randint(-3, 4, (5000,), generator=g).float().to(DEVICE)  # magnitudes 0..3, many ties
    values, indices = gpu.topk(x, k)
    assert indices.numel() == k and torch.all(indices[1:] > indices[:-1])
    mags = x.abs()
    threshold = torch.topk(mags, k).values[-1]
    above = (mags > threshold).nonzero().flatten()
    ties = (mags == threshold).nonzero().flatten()
    expected = torch.cat([above, ties[: k - above.numel()]]).sort().values
    assert torch.equal(indices, expected)
    assert torch.equal(values, x[indices])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_half_precision_and_signs(dtype):
    # 1..256 with alternating signs: exact in both dtypes, so the magnitudes are distinct
    x = (torch.arange(1, 257, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(128)).to(dtype).to(DEVICE)
    x = x[torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(DEVICE)]
    values, indices = gpu.topk(x, 20)
    assert torch.equal(indices, torch.topk(x.float().abs(), 20).indices.sort().values)
    assert torch.equal(values, x[indices])


def test_topk_edges():
    x = _randn(100, seed=2)
    values, indices = gpu.topk(x, 0)
    assert values.numel() == 0 and indices.numel() == 0
    x[37] = float("nan")  # NaN ranks above every number, as in torch.topk
    assert 37 in gpu.topk(x, 1)[1].tolist()
    with pytest.raises(ValueError):
        gpu.topk(x, 101)
    with pytest.raises(ValueError):
        gpu.topk(x.double(), 5)


# ------------------------------------------------------------------------------------- plumbing
def test_supports():
    x = torch.zeros(16, device=DEVICE)
    assert gpu.supports(x, 4, 64) and gpu.supports(x, 8, 12) and gpu.supports(x, 3, 24)
    assert gpu.supports(torch.zeros(16, dtype=torch.uint8, device=DEVICE), 4, 64)  # a decoder's payload
    assert not gpu.supports(x, 4, 12)  # a bucket must fill whole bytes
    assert not gpu.supports(x, 4, gpu.MAX_BUCKET * 2)
    assert not gpu.supports(x, 9, 64)
    assert gpu.supports_topk(x) and not gpu.supports_topk(x.double())
    with pytest.raises(ValueError):
        gpu.maxmin_encode(x, 4, 12, None)
    with pytest.raises(ValueError):
        gpu.maxmin_decode(torch.zeros(8, dtype=torch.uint8, device=DEVICE), torch.zeros(2, device=DEVICE),
                          4, 16, 16, accumulate=True)


def test_import_does_not_need_triton():
    """gradzip and the kernel module import without Triton, which is only loaded at first use."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import gradzip\n"
        "from gradzip.kernels import gpu\n"
        "reason = gpu.available()\n"
        "assert reason is not None and 'triton' in reason, reason\n"
        "assert gpu.supports(__import__('torch').zeros(8), 8, 8) is False\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _extreme(n: int, seed: int) -> torch.Tensor:
    """±fp32 maximum, huge values of both signs, zeros and subnormals: ranges and norms beyond fp32."""
    fmax = torch.finfo(torch.float32).max
    pool = torch.tensor([fmax, -fmax, 3e38, -2e38, 1e38, 0.0, 1.0, 1e-45, -3e-44, 2e19])
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randint(len(pool), (n,), generator=g)].to(DEVICE)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("key", KEYS)
def test_maxmin_extremes_bit_identical(bits, key):
    for n, bucket in [(64, 8), (1000, 64), (9000, 5000)]:
        x = _extreme(n, seed=n + bits)
        packed, stats = gpu.maxmin_encode(x, bits, bucket, key)
        ref_packed, ref_stats = reference.maxmin_encode(x, bits, bucket, key)
        assert torch.equal(packed, ref_packed) and _same_bits(stats, ref_stats), (n, bucket)
        out = gpu.maxmin_decode(packed, stats, bits, bucket, n)
        assert _same_bits(out, reference.maxmin_decode(packed, stats, bits, bucket, n))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("key", KEYS, ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bucket", [8, 64, 5000])
def test_nonfinite_buckets_get_nonfinite_statistics_as_in_the_reference(bucket, key):
    """A NaN makes its bucket's max-min statistics NaN (the GPU's own min/max skip NaN) and
    its levels 0; ±inf make the scale non-finite; QSGD's norm is NaN or inf. The other buckets
    are unchanged, so the statistics carry the non-finite flag on every device."""
    n = 9000
    x = _randn(n, seed=bucket)
    x[3], x[n // 2], x[n - 2] = float("nan"), float("inf"), -float("inf")
    bad = torch.zeros(-(-n // bucket), dtype=torch.bool)
    bad[[3 // bucket, (n // 2) // bucket, (n - 2) // bucket]] = True
    packed, stats = gpu.maxmin_encode(x, 4, bucket, key)
    ref_packed, ref_stats = reference.maxmin_encode(x, 4, bucket, key)
    assert torch.equal(packed, ref_packed)
    stats, ref_stats = stats.view(-1, 2).cpu(), ref_stats.view(-1, 2).cpu()
    assert torch.isnan(stats[3 // bucket]).all()
    assert torch.equal(~torch.isfinite(stats).all(1), bad) and torch.equal(~torch.isfinite(ref_stats).all(1), bad)
    assert _same_bits(stats[~bad], ref_stats[~bad])
    packed, norms = gpu.qsgd_encode(x, 4, bucket, 7)
    assert torch.equal(~torch.isfinite(norms.cpu()), bad)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_extremes_match_reference(bits):
    for n, bucket in [(64, 8), (1000, 64), (9000, 5000)]:
        x = _extreme(n, seed=n * bits)
        packed, norms = gpu.qsgd_encode(x, bits, bucket, 7)
        ref_packed, ref_norms = reference.qsgd_encode(x, bits, bucket, 7)
        assert torch.isfinite(norms).all()
        torch.testing.assert_close(norms, ref_norms, rtol=2e-6, atol=0)
        out = gpu.qsgd_decode(packed, norms, bits, bucket, n)
        assert _same_bits(out, reference.qsgd_decode(packed, norms, bits, bucket, n))
        assert torch.isfinite(out).all()


# ------------------------------------------------------------- FP8 and microscaling (MX) formats
def _wide(n: int, seed: int) -> torch.Tensor:
    """N(0, 1) times log-normal magnitudes (twenty decades), with zeros, -0.0, ties at unit scale
    and fp32 subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 5)
    x[::13] = 0.0
    x[1::17] = -0.0
    x[2::19] = 1e-40
    x[3::7] = torch.tensor([0.75, 1.25, 2.5, 5.0, 3.5, 448.0, 6.0, 57344.0, -1.75, 0.25, 240.0])[
        torch.randint(11, (x[3::7].numel(),), generator=g)]
    return x.to(DEVICE)


FP8_CASES = [(1, 1), (7, 7), (1000, 128), (1000, 100), (4097, 1024), (9000, 5000)]
MX_CASES = [(1, 32), (33, 32), (1000, 32), (1001, 96), (4097, 64), (9000, 8192)]


def test_fp8_and_mx_scales_tell_nonfinite_blocks_as_in_the_reference():
    """A block holding NaN or ±inf gets a non-finite FP8 scale (NaN for NaN) and the MX scale
    code 255, as in the specification, and no other block does: the scales are the non-finite
    flag on every device."""
    n, block = 9000, 64
    x = _randn(n, seed=5)
    x[3], x[n // 2], x[n - 2] = float("nan"), float("inf"), -float("inf")
    bad = torch.zeros(-(-n // block), dtype=torch.bool)
    bad[[3 // block, (n // 2) // block, (n - 2) // block]] = True
    for fmt in ("e4m3", "e5m2"):
        _, scales = gpu.fp8_encode(x, fmt, block)
        _, ref = reference.fp8_encode(x, fmt, block)
        assert torch.equal(~torch.isfinite(scales.cpu()), bad) and torch.isnan(scales[3 // block].cpu())
        assert _same_bits(scales, ref)
    for elem in ("e4m3", "e2m1"):
        _, scales = gpu.mx_encode(x, elem, block)
        _, ref = reference.mx_encode(x, elem, block)
        assert torch.equal(scales.cpu() == 255, bad) and torch.equal(scales, ref)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_bit_identical(fmt):
    for n, block in FP8_CASES:
        x = _wide(n, seed=n + block)
        codes, scales = gpu.fp8_encode(x, fmt, block)
        ref_codes, ref_scales = reference.fp8_encode(x, fmt, block)
        assert torch.equal(codes, ref_codes) and _same_bits(scales, ref_scales), (n, block)
        into = (torch.full_like(codes, 7), torch.full_like(scales, 7.0))  # given buffers: every byte written
        assert all(a is b for a, b in zip(gpu.fp8_encode(x, fmt, block, into), into))
        assert torch.equal(into[0], ref_codes) and _same_bits(into[1], ref_scales), (n, block)
        out = gpu.fp8_decode(codes, scales, fmt, block, n)
        assert _same_bits(out, reference.fp8_decode(codes, scales, fmt, block, n)), (n, block)


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
def test_mx_bit_identical(elem):
    for n, block in MX_CASES:
        x = _wide(n, seed=3 * n + block)
        codes, scales = gpu.mx_encode(x, elem, block)
        ref_codes, ref_scales = reference.mx_encode(x, elem, block)
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales), (n, block)
        into = (torch.full_like(codes, 7), torch.full_like(scales, 7))  # given buffers: every byte written
        assert all(a is b for a, b in zip(gpu.mx_encode(x, elem, block, into), into))
        assert torch.equal(into[0], ref_codes) and torch.equal(into[1], ref_scales), (n, block)
        out = gpu.mx_decode(codes, scales, elem, block, n)
        assert _same_bits(out, reference.mx_decode(codes, scales, elem, block, n)), (n, block)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 57344 · 7.6e35: clamped
def test_floatx_every_code_decodes_like_reference():
    """All 256 fp8 codes (NaN and inf included) and all 16 e2m1 codes under every E8M0 scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2).to(DEVICE)
    scales = torch.tensor([1.0, 2.0**-126, 3.7e-20, 7.6e35]).to(DEVICE)
    for fmt in ("e4m3", "e5m2"):
        got = gpu.fp8_decode(codes, scales, fmt, 128, 512)
        want = reference.fp8_decode(codes, scales, fmt, 128, 512)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert _same_bits(got[ok], want[ok])
    e8m0 = torch.arange(255, dtype=torch.int32).to(torch.uint8).to(DEVICE)  # 255 (NaN): every value NaN
    packed = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8).repeat(2 * 255)
    got = gpu.mx_decode(packed.to(DEVICE), e8m0, "e2m1", 32, 255 * 32)
    assert _same_bits(got, reference.mx_decode(packed.to(DEVICE), e8m0, "e2m1", 32, 255 * 32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_floatx_other_dtypes_and_views(dtype):
    x = _wide(600, seed=5).clamp(-6e4, 6e4).to(dtype)
    for elem in ("e4m3", "e2m1"):
        assert all(torch.equal(a, b) for a, b in zip(gpu.mx_encode(x, elem, 32), reference.mx_encode(x, elem, 32)))
    codes, scales = gpu.fp8_encode(x[::2], "e4m3", 64)
    ref_codes, ref_scales = reference.fp8_encode(x[::2].contiguous(), "e4m3", 64)
    assert torch.equal(codes, ref_codes) and _same_bits(scales, ref_scales)


def test_floatx_decode_into_out_and_accumulate():
    n = 1001
    x = _wide(n, seed=8)
    base = _randn(n, seed=9)
    for enc, dec, fmt in ((gpu.fp8_encode, gpu.fp8_decode, "e5m2"), (gpu.mx_encode, gpu.mx_decode, "e2m1")):
        block = 64
        payload = enc(x, fmt, block)
        expected = getattr(reference, dec.__name__)(*payload, fmt, block, n)
        out = torch.empty(n, device=DEVICE)
        assert dec(*payload, fmt, block, n, out=out) is out and _same_bits(out, expected)
        acc = base.clone()
        dec(*payload, fmt, block, n, out=acc, accumulate=True)
        assert _same_bits(acc, base + expected)
    with pytest.raises(ValueError):
        gpu.mx_encode(x, "e4m3", 48)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_saturating_cast_matches_reference(dtype):
    """The fp16/bf16 codecs' encode in one pass: rounding to nearest even, finite values beyond
    the type's range clamped to its largest value, NaN and ±inf kept, bit for bit as torch."""
    top = torch.finfo(dtype).max
    special = torch.tensor([
        0.0, -0.0, 1e-8, -3e-45, 65504.0, 65519.0, 65520.0, -7e4, 1e5, top, 3.39e38, -3.4e38,
        float("inf"), float("-inf"), float("nan"), 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8,
    ])
    for x in (special, _randn(5000, seed=3) * 3e4, _randn(4097, seed=4)):
        x = x.to(DEVICE)
        got, ref = gpu.saturate(x, dtype), reference.saturate(x, dtype)
        assert got.dtype == dtype and got.shape == x.shape
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(got), nan)  # NaN stays NaN (its payload bits are unspecified)
        assert torch.equal(got[~nan].view(torch.int16), ref[~nan].view(torch.int16)), (x[~nan][got[~nan] != ref[~nan]])
        into = torch.full(x.shape, 7.0, dtype=dtype, device=DEVICE)  # a given buffer: the same bits
        assert gpu.saturate(x, dtype, out=into) is into
        assert torch.equal(into[~nan].view(torch.int16), ref[~nan].view(torch.int16))
    view = _randn(64, seed=5).view(8, 8).t()  # non-contiguous
    assert torch.equal(gpu.saturate(view, dtype).view(torch.int16), reference.saturate(view, dtype).view(torch.int16))
    with pytest.raises(ValueError, match="fp32 to fp16 or bf16"):
        gpu.saturate(_randn(8, seed=1).double(), dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares the torch reference on a CUDA device with the CPU's")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_reference_gives_the_same_bits_on_cuda_and_cpu(bits):
    """The specification itself is device-independent: it divides by 0-dim tensors on the
    input's device, as torch's CUDA kernels otherwise turn ``a / 3.0`` into ``a * (1 / 3.0)``."""
    cuda = torch.device("cuda")
    for n, bucket in CASES:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n * 7 + bits))
        for key in KEYS:
            packed, stats = reference.maxmin_encode(x, bits, bucket, key)
            packed_c, stats_c = reference.maxmin_encode(x.to(cuda), bits, bucket, key)
            assert torch.equal(packed, packed_c.cpu()) and _same_bits(stats, stats_c.cpu()), (n, bucket, key)
            out = reference.maxmin_decode(packed, stats, bits, bucket, n)
            out_c = reference.maxmin_decode(packed.to(cuda), stats.to(cuda), bits, bucket, n)
            assert _same_bits(out, out_c.cpu())
        # QSGD's norms are sums whose order differs between devices; given the same payload
        # the decoded values are the same bits
        packed, norms = reference.qsgd_encode(x, bits, bucket, 7)
        out = reference.qsgd_decode(packed, norms, bits, bucket, n)
        assert _same_bits(out, reference.qsgd_decode(packed.to(cuda), norms.to(cuda), bits, bucket, n).cpu())
    for fmt in ("e4m3", "e5m2"):
        x = torch.randn(3000, generator=torch.Generator().manual_seed(bits)) * 100
        codes, scales = reference.fp8_encode(x, fmt, 32)
        codes_c, scales_c = reference.fp8_encode(x.to(cuda), fmt, 32)
        assert torch.equal(codes, codes_c.cpu()) and _same_bits(scales, scales_c.cpu()), fmt


@pytest.mark.parametrize("accumulate", [False, True], ids=["stored", "added"])
@pytest.mark.parametrize("codec", ["maxmin", "qsgd"])
def test_nan_statistics_decode_to_nan_everywhere(codec, accumulate):
    """The SRA poisons an average by writing NaN into the gathered statistics: every value the
    kernel decodes from them must be NaN (no saturation or clamp may turn it finite)."""
    n, bucket, bits = 1000, 64, 4
    x = _randn(n, seed=5)
    if codec == "maxmin":
        packed, stats = gpu.maxmin_encode(x, bits, bucket, None)
        decode = gpu.maxmin_decode
    else:
        packed, stats = gpu.qsgd_encode(x, bits, bucket, 7)
        decode = gpu.qsgd_decode
    stats.fill_(float("nan"))
    out = _randn(n, seed=6)
    got = decode(packed, stats, bits, bucket, n, out if accumulate else None, accumulate)
    assert torch.isnan(got).all()
