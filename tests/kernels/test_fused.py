"""The fused kernels: the C versions must give the bytes of the torch specification.

Max-min and sign are bit-identical (min/max are exact in any order); QSGD's norm is summed in a
different order (in fp64 in both), so its codes may differ where ``v + u`` lands within an ulp
of an integer — a handful at most — while decoding a given payload is bit-identical.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.kernels import counter_uniform, fused, native
from gradzip.kernels import reference as ref

from ..tensors import LargestMade

SIZES = [1, 7, 8, 1000, 1024, 4097, 20_000]
HAVE_CC = any(shutil.which(cc) for cc in (os.environ.get("CC") or "cc", "gcc", "clang"))
needs_native = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine: the torch versions run")


def _x(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_native
def test_native_kernels_build_where_a_compiler_exists():
    assert native.available() is None
    assert fused.name(torch.zeros(8), 4, 1024) == "native"


@needs_native
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("bucket", [8, 64, 1024])
@pytest.mark.parametrize("key", [None, 0, 0xDEADBEEF])
def test_maxmin_native_is_bit_identical(bits, bucket, key):
    for n in SIZES:
        x = _x(n, seed=n + bits)
        want = ref.maxmin_encode(x, bits, bucket, key)
        got = native.maxmin_encode(x, bits, bucket, key)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n
        assert torch.equal(native.maxmin_decode(*want, bits, bucket, n), ref.maxmin_decode(*want, bits, bucket, n))


@needs_native
@pytest.mark.parametrize("bits", range(2, 9))
def test_qsgd_native_matches_the_specification(bits):
    for n in SIZES:
        x = _x(n, seed=n * bits)
        want = ref.qsgd_encode(x, bits, 512, 99)
        got = native.qsgd_encode(x, bits, 512, 99)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
        assert (got[0] != want[0]).sum() <= 3
        assert torch.equal(native.qsgd_decode(*got, bits, 512, n), ref.qsgd_decode(*got, bits, 512, n))


@needs_native
@pytest.mark.parametrize("scale", [None, 0.25])
def test_sign_native_is_bit_identical(scale):
    s = None if scale is None else torch.tensor([scale])
    for n in SIZES:
        x = _x(n, seed=n)
        x[::5] = 0.0  # zero counts as non-negative
        packed = ref.sign_encode(x)
        assert torch.equal(native.sign_encode(x), packed)
        assert torch.equal(native.sign_decode(packed, n, s), ref.sign_decode(packed, n, s))


@needs_native
@pytest.mark.parametrize("impl", [native, ref], ids=["native", "torch"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_decode_into_out_and_accumulate(impl, accumulate):
    n = 3000
    x = _x(n)
    base = _x(n, seed=1)
    packed = ref.maxmin_encode(x, 4, 1024, 5)
    plain = ref.maxmin_decode(*packed, 4, 1024, n)
    out = base.clone()
    res = impl.maxmin_decode(*packed, 4, 1024, n, out, accumulate)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out, base + plain if accumulate else plain)
    # a prefix: the first 1500 values only
    prefix = torch.empty(1500)
    impl.maxmin_decode(*packed, 4, 1024, 1500, prefix)
    assert torch.equal(prefix, plain[:1500])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@settings(max_examples=60, deadline=None)
@given(bits=st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=300))
def test_saturating_cast_native_is_bit_identical(dtype, bits):
    """The fp16/bf16 codecs' encode in one C pass: any fp32 bit pattern (subnormals, the
    range's edge, beyond it, ±inf, NaN) gives torch's bits; NaN stays NaN."""
    edges = [65504.0, 65519.0, 65520.0, -7e4, 3.3895e38, 3.4e38, float("inf"), float("-inf"), float("nan"),
             5.96e-8, 2.98e-8, -2.99e-8, 1e-40, -1e-45, 0.0, -0.0]
    x = torch.cat([torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32), torch.tensor(edges)])
    got, want = native.saturate(x, dtype), ref.saturate(x, dtype)
    nan = torch.isnan(want)
    assert got.dtype == dtype and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert fused.saturate(x, dtype).dtype == dtype  # the codecs' entry point takes it on the CPU
    # into a given buffer (a collective's lent one): the same bits, the buffer returned
    into = torch.full((x.numel(),), 7.0, dtype=dtype)
    assert native.saturate(x, dtype, out=into) is into and torch.equal(into.view(torch.int16)[~nan], got.view(torch.int16)[~nan])
    into.fill_(7.0)
    assert fused.saturate(x, dtype, out=into) is into and torch.equal(into.view(torch.int16)[~nan], got.view(torch.int16)[~nan])
    with pytest.raises(ValueError, match="out must be contiguous"):
        fused.saturate(x, dtype, out=torch.empty(x.numel() + 1, dtype=dtype))


@needs_native
def test_native_takes_other_dtypes_and_views():
    x = _x(4096 * 2).view(2, 4096).t()[:, 0]  # a strided view of 4096 values
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        y = x.to(dtype)
        want = ref.maxmin_encode(y, 4, 1024, 3)
        got = native.maxmin_encode(y, 4, 1024, 3)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_counter_uniform_is_a_pure_function_of_index_and_key():
    u = counter_uniform(1 << 16, key=7)
    assert u.dtype == torch.float32 and 0.0 <= u.min() and u.max() < 1.0
    assert torch.equal(u, counter_uniform(1 << 16, key=7))
    assert torch.equal(u[:100], counter_uniform(100, key=7))
    assert not torch.equal(u, counter_uniform(1 << 16, key=8))
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.01  # roughly uniform


@needs_native
@pytest.mark.parametrize("numel,key", [(0, 1), (1, 0), (8191, 0xFFFFFFFF), (100003, 0x9E3779B1)])
def test_fused_uniform_is_counter_uniform_bit_for_bit(numel, key):
    assert torch.equal(fused.uniform(numel, key, torch.device("cpu")), counter_uniform(numel, key))


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("spec", [("maxmin", {"bits": 3}), ("maxmin", {"bits": 8, "mode": "nearest"}),
                                  ("qsgd", {"bits": 5, "bucket_size": 104}), ("fp8", {"block_size": 96}),
                                  ("fp8", {"format": "e5m2"}), ("mxfp8", {"block_size": 64}), ("mxfp4", {}),
                                  ("fp16", {}), ("bf16", {}), ("signsgd", {}), ("signum", {})])
def test_encoding_into_given_tensors_gives_the_payload_that_payload_spec_describes(monkeypatch, kernels, spec):
    if kernels == "native" and not HAVE_CC:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("GRADZIP_KERNELS", kernels)
    name, opts = spec
    for n, dtype in [(1, torch.float32), (999, torch.float16), (4096, torch.float32), (5000, torch.bfloat16)]:
        x = _x(n, seed=n).to(dtype)
        opts = dict(opts, seed=1) if name in ("maxmin", "qsgd") else opts
        a, b = gradzip.codec(name, **opts), gradzip.codec(name, **opts)
        want = a.encode(x, "w", 0)
        layout = b.payload_spec(n, dtype)
        if layout is None:  # sent raw (a tensor smaller than its format)
            assert len(want.tensors) == 1 and want.tensors[0].dtype == dtype
            continue
        assert [(t.dtype, t.numel()) for t in want.tensors] == layout
        buf = [torch.full((k,), 7, dtype=d) for d, k in layout]  # dirty: every byte must be written
        got = b.encode(x, "w", 0, out=buf)
        assert all(g is o for g, o in zip(got.tensors, buf))
        assert all(torch.equal(g, w) for g, w in zip(got.tensors, want.tensors))
    assert gradzip.codec("topk").payload_spec(1000, torch.float32) is None  # no fixed form: encoded, then copied


def test_encoding_into_tensors_of_another_form_is_refused_before_a_kernel_writes():
    """The kernels write through the tensors' memory: a strided, short, mistyped or missing
    tensor, or a codec without a fixed form, is a ValueError naming the form needed."""
    c = gradzip.codec("maxmin", bits=4, bucket_size=64)
    x = _x(1000, seed=2)
    form = c.payload_spec(1000, x.dtype)
    assert form == [(torch.uint8, 500), (torch.float32, 32)]
    bad = [
        [torch.empty(2 * n, dtype=d)[::2] for d, n in form],
        [torch.empty(n, dtype=torch.float64 if d == torch.float32 else d) for d, n in form],
        [torch.empty(n - 1, dtype=d) for d, n in form],
        [torch.empty(form[0][1], dtype=torch.uint8)],
    ]
    for out in bad:
        with pytest.raises(ValueError, match="payload_spec"):
            c.encode(x, "w", 0, out=out)
    with pytest.raises(ValueError, match="payload_spec"):
        gradzip.codec("topk").encode(x, "w", 0, out=[torch.empty(n, dtype=d) for d, n in form])


def test_kernels_setting_is_checked(monkeypatch):
    monkeypatch.setenv("GRADZIP_KERNELS", "fastest")
    with pytest.raises(ValueError, match="auto, native, triton, torch"):
        fused.setting()
    monkeypatch.setenv("GRADZIP_KERNELS", "torch")
    assert fused.name(torch.zeros(8)) == "torch"


@needs_native
@pytest.mark.parametrize("spec", [("maxmin", {"bits": 3}), ("maxmin", {"mode": "nearest"}), ("qsgd", {}),
                                  ("signsgd", {}), ("efsignsgd", {}), ("fp16", {}), ("bf16", {}),
                                  ("terngrad", {"bucket_size": 512}), ("natural", {}), ("cl_terngrad", {}),
                                  ("u8bit", {"bucket_size": 700}), ("tbq", {}), ("onebit", {"bucket_size": 300}),
                                  ("sketchml", {}), ("sketchml", {"buckets": 16}), ("inceptionn", {}),
                                  ("threshold", {"threshold": 0.5}), ("efsignsgd", {})])
def test_codecs_give_the_same_payload_on_either_kernel(monkeypatch, spec):
    name, opts = spec
    x = _x(5000, seed=3)
    payloads = {}
    for setting in ("native", "torch"):
        monkeypatch.setenv("GRADZIP_KERNELS", setting)
        codec = gradzip.codec(name, **opts)
        payloads[setting] = [codec.encode(x, name="w") for _ in range(2)]
        decoded = [codec.decode(p) for p in payloads[setting]]
        payloads[setting + "/decoded"] = decoded
    for a, b in zip(payloads["native"], payloads["torch"]):
        for ta, tb in zip(a.tensors, b.tensors):
            if name == "qsgd" and ta.dtype == torch.uint8:
                assert (ta != tb).sum() <= 3
            elif name == "qsgd":
                torch.testing.assert_close(ta, tb, rtol=1e-6, atol=0)
            else:
                assert torch.equal(ta, tb)
    if name != "qsgd":
        for a, b in zip(payloads["native/decoded"], payloads["torch/decoded"]):
            assert torch.equal(a, b)


@needs_native
def test_a_communicator_builds_the_c_kernels_before_its_first_exchange(tmp_path):
    """The build takes seconds once per machine: made in the constructor, not in the first
    step's encode, whose time the metrics report (a first run's encode time held it)."""
    script = (
        "import pathlib, sys, gradzip\n"
        "c = gradzip.Communicator('maxmin')\n"
        "print('BUILT', len(list(pathlib.Path(sys.argv[1]).glob('native-*.so'))))\n"
        "c.close()\n"
    )
    env = dict(os.environ, GRADZIP_CACHE=str(tmp_path), GRADZIP_KERNELS="auto")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "BUILT 1" in proc.stdout, proc.stdout


def test_a_failed_build_falls_back_to_torch(tmp_path):
    """With a compiler that fails, the reason is reported and codecs still work (torch kernels)."""
    script = (
        "import torch, gradzip\n"
        "from gradzip.kernels import fused, native\n"
        "print('WHY', native.available())\n"
        "print('USES', fused.name(torch.zeros(8), 4, 1024))\n"
        "c = gradzip.codec('maxmin')\n"
        "x = torch.randn(4096)\n"
        "print('ERR', float((c.decode(c.encode(x)) - x).abs().max()))\n"
    )
    env = dict(os.environ, CC="false", GRADZIP_CACHE=str(tmp_path), GRADZIP_KERNELS="auto")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "WHY building the fused CPU kernels failed" in proc.stdout
    assert "USES torch" in proc.stdout
    err = float(proc.stdout.split("ERR")[1])
    assert err < 1.0
    env["GRADZIP_KERNELS"] = "native"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "GRADZIP_KERNELS=native cannot run here" in proc.stderr


@needs_native
@pytest.mark.parametrize("n,k", [(1, 1), (7, 0), (7, 7), (1000, 10), (20_000, 200), (65_537, 6553)])
def test_native_topk_is_exact(n, k):
    x = _x(n, seed=n + k)
    values, idx = native.topk(x, k)
    _, want = torch.topk(x.abs(), k)
    assert set(idx.tolist()) == set(want.tolist())
    assert torch.equal(values, x[idx])
    assert bool((idx[1:] > idx[:-1]).all())  # ascending


@needs_native
def test_native_topk_breaks_ties_towards_low_indices_and_ranks_nan_first():
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 3.0, float("nan"), 0.5])
    values, idx = native.topk(x, 4)
    assert idx.tolist() == [1, 2, 4, 6]  # NaN first, then the three first of the four ±3
    x16 = x[:6].to(torch.float16)
    assert native.topk(x16, 2)[1].tolist() == [1, 2] and native.topk(x16, 2)[0].dtype == torch.float16


@needs_native
def test_topk_codec_selects_the_same_entries_on_either_kernel(monkeypatch):
    x = _x(10_000, seed=5)
    decoded = {}
    for setting in ("native", "torch"):
        monkeypatch.setenv("GRADZIP_KERNELS", setting)
        codec = gradzip.codec("topk", ratio=0.05)
        decoded[setting] = codec.decode(codec.encode(x))
    assert torch.equal(decoded["native"], decoded["torch"])


def _extreme(n: int, seed: int) -> torch.Tensor:
    """±fp32 maximum, huge values of both signs, zeros and subnormals: ranges and norms beyond fp32."""
    fmax = torch.finfo(torch.float32).max
    pool = torch.tensor([fmax, -fmax, 3e38, -2e38, 1e38, 0.0, 1.0, 1e-45, -3e-44, 2e19])
    return pool[torch.randint(len(pool), (n,), generator=torch.Generator().manual_seed(seed))]


@needs_native
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("key", [None, 0xDEADBEEF])
def test_maxmin_native_extremes_bit_identical(bits, key):
    for n, bucket in [(8, 8), (1000, 64), (4097, 1024)]:
        x = _extreme(n, seed=n + bits)
        want = ref.maxmin_encode(x, bits, bucket, key)
        got = native.maxmin_encode(x, bits, bucket, key)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n
        out = native.maxmin_decode(*want, bits, bucket, n)
        assert torch.equal(out, ref.maxmin_decode(*want, bits, bucket, n)) and torch.isfinite(out).all()


@needs_native
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_native_extremes_match_the_specification(bits):
    for n, bucket in [(8, 8), (1000, 64), (4097, 512)]:
        x = _extreme(n, seed=n * bits)
        want = ref.qsgd_encode(x, bits, bucket, 99)
        got = native.qsgd_encode(x, bits, bucket, 99)
        assert torch.isfinite(got[1]).all()
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
        out = native.qsgd_decode(*got, bits, bucket, n)
        assert torch.equal(out, ref.qsgd_decode(*got, bits, bucket, n)) and torch.isfinite(out).all()


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("codec", ["maxmin", "qsgd"])
def test_nan_statistics_decode_to_nan_everywhere_stored_or_added(codec, kernels):
    """What the SRA relies on to poison an average without a pass over it: a payload whose
    statistics (max-min's min and scale, QSGD's norms) are NaN decodes to NaN in every value,
    whether stored or added into ``out``, whatever the codes say."""
    if kernels == "native" and not HAVE_CC:
        pytest.skip("no C compiler on this machine")
    lib = native if kernels == "native" else ref
    n, bucket, bits = 4097, 64, 4
    x = _x(n, seed=3)
    if codec == "maxmin":
        packed, stats = ref.maxmin_encode(x, bits, bucket, None)
        decode = lib.maxmin_decode
    else:
        packed, stats = ref.qsgd_encode(x, bits, bucket, 7)
        decode = lib.qsgd_decode
    stats.fill_(float("nan"))
    assert torch.isnan(decode(packed, stats, bits, bucket, n)).all()
    out = torch.randn(n)
    assert torch.isnan(decode(packed, stats, bits, bucket, n, out, True)).all()


def test_torch_kernels_work_in_pieces_on_the_cpu_alone(monkeypatch):
    """A CPU tensor is taken :data:`fused.TORCH_PIECE` values at a time (a multiple of 8: whole
    bytes of packed bits); elsewhere (a GPU without Triton) in one pass, one launch an operation."""
    monkeypatch.setenv("GRADZIP_KERNELS", "torch")
    assert fused.piece_length(torch.empty(5 << 20)) == fused.TORCH_PIECE and fused.TORCH_PIECE % 8 == 0
    assert fused.piece_length(torch.empty(5 << 20, device="meta")) == 5 << 20
    assert fused.piece_length(torch.empty(0, device="meta")) == 1
    packed = torch.empty(5 << 19, dtype=torch.uint8, device="meta")  # (packed codes: the values they stand for)
    assert fused.piece_length(packed, 5 << 20) == 5 << 20
    assert fused.piece_length(torch.empty(1, dtype=torch.uint8), 5 << 20) == fused.TORCH_PIECE
    for bucket in (7, 1000, 5 << 20, 6 << 20):  # elsewhere whole buckets or not, one piece
        whole = fused.piece_length(torch.empty(5 << 20, device="meta"))
        assert [(a, b) for a, b, _, _ in fused._bucket_pieces(5 << 20, bucket, whole)] == [(0, 5 << 20)], bucket
    n = 3 << 20  # 1-bit SGD's decode: its packed bits hold 8 values a byte, its pieces are the values'
    packed, means = torch.empty(n // 8, dtype=torch.uint8, device="meta"), torch.empty(2, device="meta")
    calls = []
    pieces = fused._onebit_pieces
    try:
        fused._onebit_pieces = lambda *args: calls.append(args) or pieces(*args)
        fused.onebit_decode(packed, means, n, n)  # elsewhere than the CPU: one pass
        assert not calls
        fused.onebit_decode(torch.zeros(n // 8, dtype=torch.uint8), torch.zeros(2), n, n)
        assert len(calls) == 1  # on the CPU: in pieces
    finally:
        fused._onebit_pieces = pieces


@pytest.mark.parametrize("bucket", [7, 1000, 1003, 2500, 3607])
def test_onebit_decoded_piece_by_piece_gives_the_bits_of_one_pass(monkeypatch, bucket):
    """1-bit SGD's torch decode works :data:`fused.TORCH_PIECE` values at a time, whole buckets
    (a bucket not a multiple of 8 values starts inside a byte) or a long bucket's pieces: the
    values of the specification over the whole tensor, a NaN and an infinite mean included,
    into ``out`` and added to it."""
    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the fused C loops make no pieces)
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    n = 3607
    rows = -(-n // bucket)
    packed = torch.randint(0, 256, (-(-n // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(bucket))
    means = _x(2 * rows, 5)
    means[-1] = float("inf")
    means[0] = float("nan")
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731
    want = ref.onebit_decode(packed, means, bucket, n)
    assert same(fused.onebit_decode(packed, means, bucket, n), want)
    base = _x(n, 6)
    assert same(fused.onebit_decode(packed, means, bucket, n, base.clone(), True), base + want)
    assert same(fused.onebit_decode(packed, means, bucket, n - 5), want[: n - 5])

    out = torch.empty(n)
    with LargestMade() as made:
        fused.onebit_decode(packed, means, bucket, n, out)
    assert same(out, want) and made.numel <= 2 * 1000 < n, made.numel  # a piece's temporaries, not n


@pytest.mark.parametrize("bucket", [None, 7, 1000, 1003, 2500, 3607])
def test_table_decoded_piece_by_piece_gives_the_bits_of_one_pass(monkeypatch, bucket):
    """The table decode (8-bit format, natural compression) in torch works
    :data:`fused.TORCH_PIECE` values at a time on the CPU, whole buckets or a long bucket's
    pieces: the values of one pass over the whole tensor, a NaN and an infinite scale included,
    into ``out`` and added to it, with no temporary of the tensor's size."""
    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the fused C loops make no pieces)
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    n = 3607
    g = torch.Generator().manual_seed(n if bucket is None else bucket)
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    table = torch.randn(256, generator=g)
    scale = None
    if bucket is not None:
        scale = _x(-(-n // bucket), 5).abs()
        scale[-1] = float("inf")
        scale[0] = float("nan")
    size = n if bucket is None else bucket
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731
    want = ref.table_decode(codes, table, scale, size, n)
    assert same(fused.table_decode(codes, table, scale, size, n), want)
    base = _x(n, 6)
    assert same(fused.table_decode(codes, table, scale, size, n, base.clone(), True), base + want)
    assert same(fused.table_decode(codes, table, scale, size, n - 5), want[: n - 5])

    out = torch.empty(n)
    with LargestMade() as made:
        fused.table_decode(codes, table, scale, size, n, out)
    assert same(out, want) and made.numel <= 2 * 1000 < n, made.numel  # a piece's temporaries, not n


@pytest.mark.parametrize("start", [0, 1, 1000, (1 << 32) - 3])
def test_counter_uniform_from_an_offset_draws_what_the_longer_stream_draws_there(start):
    """Draws from ``start`` on are the draws of those indices in one long stream, in the torch
    specification and the fused C loop alike (indices past 2**32 wrap, as the hash's do)."""
    whole = counter_uniform(start + 300, key=11)[start:] if start < 1 << 20 else None
    got = counter_uniform(300, key=11, start=start)
    if whole is not None:
        assert torch.equal(got, whole)
    assert torch.equal(fused.uniform(300, 11, torch.device("cpu"), start), got)
    if native.available() is None:  # (the fused C loop, where a compiler built it)
        assert torch.equal(native.counter_uniform(300, 11, torch.device("cpu"), start), got)


@pytest.mark.parametrize("bucket", [0, 64, 300, 2500])
def test_terngrad_encoded_piece_by_piece_gives_the_bytes_of_one_pass(monkeypatch, bucket):
    """TernGrad's torch encode works :data:`fused.TORCH_PIECE` values at a time, each piece with
    its own draws (a bucket longer than a piece in pieces of its own): the codes and scales of
    the specification over the whole tensor, NaN, Inf and an all-zero bucket included, with no
    temporary of the tensor's size."""
    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the fused C loops make no pieces)
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    n = 3607
    x = _x(n, 8) * 2
    x[5], x[7] = float("nan"), float("inf")
    x[2000:2400] = 0.0
    size = bucket or n
    rows = -(-n // size)
    buckets = torch.cat([x, x.new_zeros(rows * size - n)]).view(rows, size)
    want = ref.terngrad_encode(buckets, fused.uniform(buckets.numel(), 77, x.device).view(buckets.shape), n)
    with LargestMade() as made:
        got = fused.terngrad_encode(buckets, 77, n)
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731
    assert torch.equal(got[0], want[0]) and same(got[1], want[1])
    assert made.numel <= 2 * 1000 < n, made.numel


@pytest.mark.parametrize("pieces", [1, 2.5])
def test_torch_encoders_worked_piece_by_piece_give_the_bytes_of_one_pass(monkeypatch, pieces):
    """Natural compression's and 8-bit's torch versions encode :data:`fused.TORCH_PIECE` values
    at a time (their temporaries a few MB, not several times the group): the same codes as the
    specification over the whole tensor, pieces and bucket rows cut anywhere."""
    from gradzip.codecs.quantize import _u8_tables

    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the fused C loops make no pieces)
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    n = int(1000 * pieces) + 7
    x = _x(n, 3) * 3
    x[5], x[7] = float("nan"), float("inf")
    top = torch.tensor([130], dtype=torch.int32)
    bits = x.view(torch.int32)
    whole = ref.natural_codes(bits, ref.natural_draws(fused.uniform(n, 99, x.device)), top)
    with LargestMade({torch.float32, torch.int32, torch.int64}) as made:  # (the codes, uint8, are the result)
        assert torch.equal(fused.natural_codes(bits, 99, top), whole)
    assert made.numel <= 1000 < n, made.numel  # each piece's draws and temporaries
    # a header a bucket of 256 values (a fused group's members), the codes and their decode
    tops = torch.randint(100, 160, (-(-n // 256),), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    tops[-1] = 256  # a bucket that held a non-finite value
    per_value = tops.repeat_interleave(256)[:n]
    whole = ref.natural_codes(bits, ref.natural_draws(fused.uniform(n, 99, x.device)), per_value)
    codes = fused.natural_codes(bits, 99, tops, 256)
    assert torch.equal(codes, whole)
    decoded, got = ref.natural_decode(codes, per_value, n), torch.empty(n)
    with LargestMade({torch.float32, torch.int32, torch.int64}) as made:
        fused.natural_decode(codes, tops, 256, n, out=got)
    assert torch.equal(got.view(torch.int32), decoded.view(torch.int32)) and made.numel <= 1000, made.numel
    base = _x(n, 4)
    acc = fused.natural_decode(codes, tops, 256, n, out=base.clone(), accumulate=True)
    assert torch.equal(acc.view(torch.int32), (base + decoded).view(torch.int32))
    _, mids, lut = _u8_tables(x.device)
    for bucket in (64, 300, n):
        rows = -(-n // bucket)
        buckets = torch.cat([x.nan_to_num(0.0, 1e3, -1e3), x.new_zeros(rows * bucket - n)]).view(rows, bucket)
        inv = 1.0 / buckets.abs().amax(dim=1)
        assert torch.equal(fused.u8bit_codes(buckets, inv, mids, lut, n), ref.u8bit_codes(buckets, inv, mids, lut, n)), bucket
