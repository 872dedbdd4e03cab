"""SketchML: quantile buckets (error bound, sign, sum), index widths, delta-encoded sparse keys.

The generic properties (shapes, dtypes, wire bytes, aggregate) are in tests/codecs/test_codecs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradzip
from gradzip.codecs import Payload
from gradzip.codecs.sketch import _sortable_keys
from gradzip.kernels import packed_bytes, unpack_bits

from ..tensors import randn as _randn
from ..tensors import with_nonfinite


def _codes(p: Payload, count: int) -> torch.Tensor:
    means = p.tensors[1]
    return unpack_bits(p.tensors[0], max(1, (means.numel() - 1).bit_length()), count).long()


def _bucket_ranges(x: torch.Tensor, codes: torch.Tensor, nb: int):
    lo = torch.full((nb,), math.inf, dtype=torch.float64).scatter_reduce(0, codes, x.double(), "amin")
    hi = torch.full((nb,), -math.inf, dtype=torch.float64).scatter_reduce(0, codes, x.double(), "amax")
    return lo, hi


def _check_buckets(x: torch.Tensor, buckets: int = 256) -> None:
    """Every value decodes to its bucket's mean, inside the bucket's range: error <= its width."""
    c = gradzip.codec("sketchml", buckets=buckets)
    x = x.reshape(-1)
    p = c.encode(x)
    y = c.decode(p)
    if c._raw(x.numel(), x.dtype):  # codes and table would outweigh the values: sent raw, exact
        assert len(p.tensors) == 1 and p.nbytes == x.numel() * x.element_size() and torch.equal(y, x)
        # the format itself still buckets them (sparse mode uses it for few kept values)
        p = Payload(c._encode(x, p.ctx), p.ctx)
        y = c._decode(p.tensors, p.ctx).to(x.dtype)
    nb = p.tensors[1].numel()
    assert nb == max(2, min(buckets, x.numel()))
    codes = _codes(p, x.numel())
    assert codes.max() < nb
    lo, hi = _bucket_ranges(x.float(), codes, nb)
    assert torch.equal(y, p.tensors[1][codes].to(y.dtype))  # the bucket's mean
    yd = y.double()
    assert (yd >= lo[codes]).all() and (yd <= hi[codes]).all()  # fp64 sums: never outside
    assert ((yd - x.double()).abs() <= (hi - lo)[codes]).all()
    # buckets are contiguous value ranges (-0.0 just below +0.0): sorting by value sorts the codes
    order = torch.argsort((~torch.signbit(x)).int(), stable=True)
    order = order[torch.argsort(x[order].float(), stable=True)]
    assert (codes[order].diff() >= 0).all()
    # no bucket mixes signs, so no value changes sign
    nz = x != 0
    assert torch.equal(torch.sign(y[nz]), torch.sign(x[nz]))
    # the means keep each bucket's sum, so the whole sum (up to the output dtype's rounding)
    eps = {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(x.dtype, 1e-5)
    torch.testing.assert_close(y.double().sum(), x.double().sum(), rtol=0, atol=eps * x.double().abs().sum().item())


@pytest.mark.parametrize("buckets", [2, 3, 16, 17, 255, 256])
@pytest.mark.parametrize("n", [1, 2, 7, 300, 10_000])
def test_sketchml_value_decodes_to_bucket_mean(n, buckets):
    x = _randn((n,), seed=n + buckets) * 3
    x[: n // 10] *= 100  # a heavy tail
    _check_buckets(x, buckets)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_sketchml_other_dtypes(dtype):
    _check_buckets(_randn((5000,), dtype, seed=3))


def test_sketchml_special_values():
    for x in (
        torch.zeros(100),
        torch.full((1000,), -0.3),
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, 1.0]),
        torch.tensor([1.0, 1.0, 1.0, 2.0]),
        torch.cat([torch.zeros(500), _randn((500,))]),
    ):
        _check_buckets(x)
    # a constant tensor is one bucket and comes back exactly
    for v in (0.3, -7.25, 1e-20):
        x = torch.full((999,), v)
        assert torch.equal(gradzip.codec("sketchml").decode(gradzip.codec("sketchml").encode(x)), x)


@pytest.mark.parametrize("buckets", [16, 100, 256])
def test_sketchml_quantised_piece_by_piece_gives_the_bytes_of_one_pass(monkeypatch, buckets):
    """On the CPU the sketch is summed and the codes packed :data:`fused.TORCH_PIECE` values at
    a time: the bytes of one pass over the tensor, and no temporary as long as the tensor
    (the sketch's tables, 2**18 cells, are the longest)."""
    from gradzip.codecs.sketch import _CELLS
    from gradzip.kernels import fused

    from ..tensors import LargestMade

    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the C loops make no pieces)

    x = _randn((600_003,), seed=buckets) * torch.rand(600_003, generator=torch.Generator().manual_seed(1)) * 10
    x[3], x[6] = 0.0, -0.0
    codec = gradzip.codec("sketchml", buckets=buckets)
    monkeypatch.setattr(fused, "TORCH_PIECE", 1 << 30)  # one piece
    whole = codec.encode(x, "w", 0).tensors
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    with LargestMade({torch.float32, torch.float64, torch.int32, torch.int64}) as made:
        pieces = codec.encode(x, "w", 0).tensors
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))
    assert made.numel <= _CELLS < x.numel(), made.numel


@pytest.mark.parametrize("buckets", [8, 32, 100, 256])
def test_sketchml_decoded_piece_by_piece_into_out_gives_the_values_of_one_pass(monkeypatch, buckets):
    """On the CPU the codes are looked up :data:`fused.TORCH_PIECE` values at a time (3, 5, 7
    and 8 bits a code), straight into ``out`` or added to it: decode()'s values, with no
    codes widened for the lookup or values of the tensor's size made; a fused group's members
    likewise, each into its place."""
    from gradzip.kernels import fused

    from ..tensors import LargestMade

    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the C loops make no pieces)

    n = 20003
    x = _randn((n,), seed=buckets) * 10
    x[5] = float("nan")
    codec = gradzip.codec("sketchml", buckets=buckets)
    shapes = [(4000,), (3, 2001), (10000,)]
    align = codec.fused_alignment()  # (members on whole bytes of codes)
    group = _randn((sum(-(-math.prod(s) // align) * align for s in shapes),), seed=3)
    parts = [(f"p{i}", s) for i, s in enumerate(shapes)]
    for t, kw in ((x, {}), (group, {"parts": parts})):
        payload = codec.encode(t, "w", 0, **kw)
        want = codec.decode(payload).reshape(-1).float()
        monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
        out = torch.full((t.numel(),), 7.0)
        with LargestMade({torch.float32, torch.int32}) as made:
            assert codec.decode_into(payload, out) is out
        assert torch.equal(out.nan_to_num(9.0), want.nan_to_num(9.0)) and made.numel <= 1000, made.numel
        base = _randn((t.numel(),), seed=4)
        got = codec.decode_into(payload, base.clone(), accumulate=True)
        assert torch.equal(got.nan_to_num(9.0), (base + want).nan_to_num(9.0))
        part = torch.empty(t.numel() - 5)  # the first values only
        assert torch.equal(codec.decode_into(payload, part).nan_to_num(9.0), want[:-5].nan_to_num(9.0))
        monkeypatch.undo()


def test_sketchml_buckets_hold_equal_counts():
    """The quantile sketch gives buckets of about n / (buckets - 1) values (plus the zero split)."""
    n = 200_000
    for x in (_randn((n,)), _randn((n,)).exp(), _randn((n,)) * 1e3):
        p = gradzip.codec("sketchml").encode(x)
        counts = torch.bincount(_codes(p, n), minlength=256)
        assert counts.max() <= 1.25 * n / 255, counts.max()
        assert (counts > 0).sum() >= 250
    # values packed far from zero relative to their spread: quantiles are exact up to one sketch
    # cell (2**-9 relative), so a bucket holds at most n / 255 values plus one cell's
    x = _randn((n,)) * 1e-4 + 1e-3
    counts = torch.bincount(_codes(gradzip.codec("sketchml").encode(x), n), minlength=256)
    heaviest_cell = torch.bincount(_sortable_keys(x.clone())).max()
    assert counts.max() <= math.ceil(n / 255) + heaviest_cell


def test_sketchml_wire_format_and_bytes():
    n = 1 << 20
    x = _randn((n,))
    c = gradzip.codec("sketchml")
    p = c.encode(x)
    assert [t.dtype for t in p.tensors] == [torch.uint8, torch.float32]
    assert p.nbytes == n + 256 * 4 == c.wire_bytes(n, torch.float32)
    assert 8 * c.wire_bytes(n) / n == pytest.approx(8.0078125)
    assert c.wire_bytes(n, torch.float16) == c.wire_bytes(n, torch.float32)  # codes + an fp32 table
    for buckets, bits in [(2, 1), (3, 2), (4, 2), (16, 4), (17, 5), (128, 7), (129, 8)]:
        cb = gradzip.codec("sketchml", buckets=buckets)
        for m in (1, 7, 1001):
            nb = max(2, min(buckets, m))
            bits_m = max(1, (nb - 1).bit_length())
            pm = cb.encode(_randn((m,)))
            own = packed_bytes(m, bits_m) + 4 * nb
            if own > 4 * m:  # codes and table would outweigh the values: sent raw
                assert len(pm.tensors) == 1 and pm.nbytes == 4 * m == cb.wire_bytes(m)
                continue
            assert pm.tensors[0].numel() == packed_bytes(m, bits_m)
            assert pm.nbytes == own == cb.wire_bytes(m)
        assert cb.encode(x).tensors[0].numel() == packed_bytes(n, bits)


def _sparse_from_positions(positions, n: int) -> torch.Tensor:
    x = torch.zeros(n)
    pos = torch.tensor(positions)
    x[pos] = torch.linspace(1, 2, len(positions)) * torch.where(pos % 2 == 0, 1.0, -1.0)
    return x


@pytest.mark.parametrize(
    "positions,width",
    [
        ([0, 1, 2, 256, 512], 1),  # gap - 1 = 255 fits a byte
        ([3, 260, 261], 2),  # gap - 1 = 256 does not
        ([5, 5 + 0x8001, 5 + 0x8001 + 0x10000], 2),  # gaps - 1 = 0x8000 and 0xFFFF: int16 bit patterns
        ([0, 0x10001 + 1], 4),  # gap - 1 = 0x10001: 4 bytes
        ([7, 199_999], 4),
        ([123], None),  # one key: the first index alone
    ],
)
def test_sketchml_sparse_keys_reconstruct(positions, width):
    n = 200_000
    x = _sparse_from_positions(positions, n)
    k = len(positions)
    c = gradzip.codec("sketchml", ratio=k / n)
    p = c.encode(x)
    _, _, first, gaps = p.tensors
    assert first.dtype == torch.int32 and first.item() == positions[0]
    assert gaps.dtype == torch.uint8 and gaps.numel() == (k - 1) * (width or 0)
    y = c.decode(p)
    assert torch.equal((y != 0).nonzero().reshape(-1), torch.tensor(positions))
    assert torch.equal(torch.sign(y[positions]), torch.sign(x[positions]))
    assert p.nbytes <= c.wire_bytes(n)
    # the same bytes after the wire (views of one buffer) decode the same
    from gradzip.comm.base import from_bytes, spec_of, to_bytes

    tensors, flag = from_bytes(to_bytes(p.tensors, torch.tensor(False)), spec_of(p.tensors))
    assert torch.equal(c.decode(Payload(tensors, p.ctx)), y) and not flag


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 0.9])
def test_sketchml_sparse_keeps_top_k(ratio):
    n = 50_000
    x = _randn((n,), seed=5)
    c = gradzip.codec("sketchml", ratio=ratio)
    p = c.encode(x)
    k = math.ceil(n * ratio)
    y = c.decode(p)
    kept = y != 0
    expected = torch.zeros(n, dtype=torch.bool)
    expected[x.abs().topk(k).indices] = True
    assert torch.equal(kept, expected)
    # kept values decode to their bucket's mean, as in dense mode
    nb = p.tensors[1].numel()
    codes = _codes(p, k)
    lo, hi = _bucket_ranges(x[kept], codes, nb)
    assert ((y[kept].double() - x[kept].double()).abs() <= (hi - lo)[codes]).all()
    bound = c.wire_bytes(n)
    # 4-byte gaps at worst, but never above the raw size (the dense form)
    assert bound == min(packed_bytes(k, (nb - 1).bit_length()) + nb * 4 + 4 + 4 * (k - 1), 4 * n)
    assert p.nbytes <= bound


def test_sketchml_sparse_one_million_byte_count():
    """1 % of 1 M randn values: gaps average 100, so 2-byte gaps: 3 bytes per kept value."""
    n = 1 << 20
    c = gradzip.codec("sketchml", ratio=0.01)
    p = c.encode(_randn((n,), seed=1))
    k = math.ceil(n * 0.01)
    assert p.tensors[3].numel() == 2 * (k - 1)
    assert p.nbytes == k + 256 * 4 + 4 + 2 * (k - 1)
    topk_bytes = gradzip.codec("topk", ratio=0.01).wire_bytes(n)
    assert p.nbytes < 0.7 * topk_bytes


def test_sketchml_mode_metadata_and_options():
    dense, sparse = gradzip.codec("sketchml"), gradzip.codec("sketchml", ratio=0.1)
    assert dense.fixed_size and dense.default_memory == "none" and dense.collectives == ("allgather", "sra")
    assert not sparse.fixed_size and sparse.default_memory == "residual" and sparse.collectives == ("allgather",)
    assert type(sparse).fixed_size  # the class keeps its own defaults
    assert gradzip.Communicator("sketchml", ratio=0.1).memory.stateful
    with pytest.raises(ValueError, match="sra"):
        gradzip.Communicator("sketchml", ratio=0.1, collective="sra")
    gradzip.Communicator("sketchml", collective="sra").close()
    for opts, expect in [
        ({"buckets": 1}, "2..256"),
        ({"buckets": 257}, "2..256"),
        ({"buckets": 16.0}, "2..256"),
        ({"buckets": True}, "2..256"),
        ({"ratio": 0}, r"\(0, 1\]"),
        ({"ratio": 1.5}, r"\(0, 1\]"),
        ({"seed": 1}, "buckets, ratio"),
    ]:
        with pytest.raises(ValueError, match=expect):
            gradzip.codec("sketchml", **opts)


def test_sketchml_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    x = _randn((100_000,))
    a = gradzip.codec("sketchml").encode(x).tensors
    b = gradzip.codec("sketchml").encode(x).tensors
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(torch.rand(3), expected)


def test_sketchml_nonfinite_input_keeps_shape():
    x = _randn((1000,))
    x[10], x[20] = float("nan"), float("inf")
    y = gradzip.codec("sketchml").decode(gradzip.codec("sketchml").encode(x))
    assert y.shape == x.shape
    assert torch.isfinite(y[x.abs() < 0.5]).all()  # finite values in other buckets are untouched


def _fused(sizes, dtype, scales):
    """A fused group of members of ``sizes`` values (scales apart, a run of zeros, a NaN, ±inf, -0.0)."""
    xs = [(_randn((n,), seed=i) * scales[i % len(scales)]).to(dtype) for i, n in enumerate(sizes)]
    xs[0][:30] = 0.0
    xs[0][30:40] = -0.0
    return xs


def _check_decode_into(codec, p: Payload, y: torch.Tensor) -> None:
    """A group's payload decodes into a given fp32 output (what was there before overwritten)
    as ``decode`` gives ``y``, added to it, and cut short."""
    full = torch.full((y.numel(),), 3.0)
    codec.decode_into(p, full)
    assert torch.equal(full.to(y.dtype).nan_to_num(), y.nan_to_num())
    added = torch.ones(y.numel())
    codec.decode_into(p, added, accumulate=True)
    assert torch.equal(added.nan_to_num(), (full + 1).nan_to_num())
    cut = torch.full((y.numel() - 5,), 7.0)
    codec.decode_into(p, cut)
    assert torch.equal(cut.nan_to_num(), full[:-5].nan_to_num())


@pytest.mark.parametrize("buckets", [256, 16, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
def test_sketchml_group_is_its_members_alone_back_to_back(monkeypatch, at_once, dtype, buckets):
    """A fused group (dense) is one payload ``[codes, means, raw values]``: each member coded
    with the codes and the quantile table it has alone, those alone sent as they are (and, in
    a group, those of fewer values than buckets) exactly; on the CPU's way member by member,
    on the accelerator's by one sort of the group; padding decodes to 0, and a group decodes
    into a given output, added or cut short, as alone."""
    from gradzip.codecs.base import part_spans
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    codec = gradzip.codec("sketchml", buckets=buckets)
    sizes = (1000, 50, 3000, 7, 0, 20_000, 333, 345, 1 << 12)
    xs = _fused(sizes, dtype, (1e-3, 1.0, 1e3))
    if dtype in (torch.float32, torch.float64):
        xs[2][5], xs[2][6], xs[2][7] = float("nan"), float("inf"), -float("inf")
    parts = tuple((f"m{i}.weight", torch.Size((n,))) for i, n in enumerate(sizes))
    align = codec.fused_alignment()
    spans = part_spans(parts, align)
    flat = torch.zeros(sum(n + (-n % align) for n in sizes), dtype=dtype)
    for (a, n), x in zip(spans, xs):
        flat[a : a + n] = x
    p = codec.encode(flat, "g", parts=parts)
    coded = [i for i, n in enumerate(sizes) if n >= buckets and not codec._raw(n, dtype)]
    alone = {i: codec.encode(xs[i], parts[i][0]).tensors for i in coded}
    assert len(p.tensors) == 3 and p.tensors[2].dtype == dtype
    assert torch.equal(p.tensors[0], torch.cat([alone[i][0] for i in coded]))
    torch.testing.assert_close(p.tensors[1], torch.cat([alone[i][1] for i in coded]), rtol=0, atol=0, equal_nan=True)
    sent = [x for i, x in enumerate(xs) if i not in coded and x.numel()]
    assert torch.equal(p.tensors[2], torch.cat(sent) if sent else flat[:0])
    y = codec.decode(p)
    for i, ((a, n), x) in enumerate(zip(spans, xs)):
        own = codec.decode(codec.encode(x, parts[i][0]))
        if i in coded or codec._raw(n, dtype):
            assert torch.equal(y[a : a + n].nan_to_num(), own.nan_to_num()), i
        else:  # (fp64 alone codes what a group sends exactly)
            assert torch.equal(y[a : a + n], x)
        assert not y[a + n : a + n + (-n % align)].any()
    _check_decode_into(codec, p, y)


@pytest.mark.parametrize("wire", [None, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
def test_sketchml_group_is_encoded_into_its_message_as_without_it(monkeypatch, at_once, wire):
    """Dense mode's form is known from the sizes (``payload_spec``), so a collective's message
    takes the payload where it is sent from: written into dirty tensors of that form, a group's
    payload (its raw members in the wire dtype of an fp32 compensation of 16-bit gradients) is
    the one encoded without them, bit for bit, ±inf included. Sparse mode has no such form."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    for buckets in (256, 16, 3):
        codec, twin = gradzip.codec("sketchml", buckets=buckets), gradzip.codec("sketchml", buckets=buckets)
        align = codec.fused_alignment()
        sizes = (5000, 100, 300, 7, 2000)
        parts = [(f"p{i}", (n,)) for i, n in enumerate(sizes)]
        flat = torch.cat([t for n in sizes for t in (_randn((n,), seed=n) * 7e4, torch.zeros(-n % align))])
        flat[17] = float("inf")
        spec = codec.payload_spec(flat.numel(), flat.dtype, parts, wire)
        want = twin.encode(flat, "g", 0, parts=parts, wire=wire)
        assert [(t.dtype, t.numel()) for t in want.tensors] == spec
        out = [torch.full((k,), 7, dtype=d) for d, k in spec]
        got = codec.encode(flat, "g", 0, parts=parts, wire=wire, out=out)
        assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got.tensors, out))
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got.tensors, want.tensors))
    sparse = gradzip.codec("sketchml", ratio=0.5)  # (its members start anywhere: no padding)
    assert sparse.fused_alignment() == 1 and sparse.payload_spec(sum(sizes), flat.dtype, parts) is None


def test_sketchml_group_at_once_makes_the_bytes_of_one_member_at_a_time(monkeypatch):
    """The accelerator's way (one sort of a group) and the CPU's (each member's histogram) make
    the same payload, for special groups too: none coded, constants, zeros, two buckets."""
    from gradzip.kernels import fused

    groups = [
        (torch.zeros(3000), ((1000,), (2000,))),
        (torch.full((3000,), -0.25), ((1000,), (2000,))),
        (_randn((600,)), ((200,), (200,), (200,))),  # every member sent as it is
        (_randn((5000,)).exp(), ((5000,),)),
    ]
    for flat, shapes in groups:
        parts = [(f"p{i}", s) for i, s in enumerate(shapes)]
        for opts in ({}, {"buckets": 2}, {"buckets": 3}):
            got = []
            for at_once in (False, True):
                monkeypatch.setattr(fused, "groups_at_once", lambda device, at_once=at_once: at_once)
                codec = gradzip.codec("sketchml", **opts)
                p = codec.encode(flat, "g", parts=parts)
                got.append(p.tensors + [codec.decode(p)])
            for a, b in zip(*got):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sketchml_flags_a_nonfinite_input_from_its_tables(dtype):
    """The tables (and a group's values sent as they are) carry every NaN and ±inf of the input,
    so the collective needs no pass over it; fp64, raw and sparse payloads leave it to that pass."""
    codec = gradzip.codec("sketchml")
    parts = [("a", (1000,)), ("b", (100,)), ("c", (2000,))]  # b: sent as it is
    for where in (None, 5, 1003, 2000):
        for bad in (float("nan"), float("inf"), -float("inf")):
            flat = _randn((3100,), dtype, seed=7)
            if where is not None:
                flat[where] = bad
            for p, first in ((codec.encode(flat, "g", parts=parts), 0), (codec.encode(flat[1100:], "c"), 1100)):
                assert bool(codec.nonfinite(p)) == (where is not None and where >= first), (where, bad)
    assert codec.nonfinite(codec.encode(_randn((1000,), torch.float64))) is None
    assert codec.nonfinite(codec.encode(_randn((10,)))) is None  # sent raw
    sparse = gradzip.codec("sketchml", ratio=0.1)
    assert sparse.nonfinite(sparse.encode(_randn((10_000,), torch.float64))) is None
    dense_form = gradzip.codec("sketchml", ratio=0.9).encode(_randn((1000,), torch.float16))
    assert not dense_form.tensors[2].numel() and sparse.nonfinite(dense_form) is None


@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sparse_sketchml_flags_a_nonfinite_input_from_its_tables(monkeypatch, dtype, at_once):
    """A NaN or ±inf is among a member's largest magnitudes, so its selection and table hold it
    (or hold nothing finite): the tables and the values sent as they are tell, alone and in a
    group, coded or sent as it is, with more non-finite values than a member sends too."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    codec = gradzip.codec("sketchml", ratio=0.01)
    parts = [("a", (10_000,)), ("b", (100,)), ("r", (1,)), ("c", (19_999,))]  # b: k = 1; r: sent as it is
    for where, bad, flat in with_nonfinite(30_100, dtype, (None, 5, 10_050, 10_100, 25_000, "many")):  # (many: over a's k)
        p = codec.encode(flat, "g", parts=parts)
        assert len(p.tensors) == 5 and p.tensors[2].numel(), p.tensors
        assert bool(codec.nonfinite(p)) == (where is not None), (where, bad)
        alone = codec.encode(flat[10_101:], "c")
        assert bool(codec.nonfinite(alone)) == (where == 25_000), (where, bad)
    whole = codec.encode(torch.full((3000,), float("nan"), dtype=dtype), "g", parts=[("a", (3,)), ("b", (2997,))])
    assert bool(codec.nonfinite(whole))


def test_sketchml_group_keeps_fp64_members_sent_as_they_are_and_puts_every_nan_in_one_bucket(monkeypatch):
    """An fp64 member a group sends as it is decodes exactly (not through fp32: 0.1 stays 0.1,
    1e300 finite); a NaN of any sign and payload takes the last key, so a member's codes do not
    depend on how its values were converted to fp32 (the whole group at once or the member)."""
    from gradzip.codecs.sketch import _CELLS
    from gradzip.kernels import fused

    codec = gradzip.codec("sketchml")
    x = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for at_once in (False, True):
        monkeypatch.setattr(fused, "groups_at_once", lambda device, at_once=at_once: at_once)
        for v in (0.1, 1e300, -3.3e-310):
            one = torch.tensor([v], dtype=torch.float64)
            y = codec.decode(codec.encode(torch.cat([x, one]), "g", parts=[("a", (1000,)), ("b", (1,))]))
            assert y.dtype == torch.float64 and y[1000].item() == v
    bits = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -1], dtype=torch.int32)  # NaNs: ±, quiet, signalling
    assert _sortable_keys(bits.view(torch.float32)).tolist() == [_CELLS - 1] * 4
    b = torch.randn(18, generator=torch.Generator().manual_seed(3)).half()
    b[16] = -float("nan")
    flat = torch.cat([torch.randn(1024, generator=torch.Generator().manual_seed(4)).half(), b, torch.zeros(6).half()])
    got = []
    for at_once in (False, True):
        monkeypatch.setattr(fused, "groups_at_once", lambda device, at_once=at_once: at_once)
        got.append(gradzip.codec("sketchml", buckets=2).encode(flat, "g", parts=[("a", (1024,)), ("b", (18,))]).tensors)
    assert torch.equal(got[0][0], got[1][0])


def _alone_sparse(codec, x, name):
    """A member's payload alone, its codes unpacked: (levels, means, first, gaps) or None where
    it goes in its dense form."""
    codes, means, first, gaps = codec.encode(x, name).tensors
    if first.numel() == 0:
        return None
    k = math.ceil(x.numel() * codec.ratio)
    return unpack_bits(codes, max(1, (means.numel() - 1).bit_length()), k), means, first, gaps


@pytest.mark.parametrize("ratio,buckets", [(0.01, 256), (0.05, 16), (0.3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
def test_sketchml_sparse_group_is_its_members_selections_tables_and_gaps(monkeypatch, at_once, dtype, ratio, buckets):
    """A fused sparse group is one payload ``[codes, means, heads, gaps, raw values]``: each coded
    member's selection, quantile table, first index and gaps (in its own width) as alone, its
    codes at the group's width; members whose selection is every value, or whose payload could
    not be smaller, sent as they are. The CPU's way (member by member) and the accelerator's (at
    once) give the same payload; it decodes into a given output, added or cut short."""
    from gradzip.codecs.base import part_spans
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    codec = gradzip.codec("sketchml", ratio=ratio, buckets=buckets)
    sizes = (1000, 50, 3000, 1, 0, 20_000, 333, 140_000, 1 << 12)
    xs = _fused(sizes, dtype, (1e-3, 1.0, 1e3))
    k = math.ceil(sizes[7] * ratio)
    xs[7][: k // 2] += 100  # its selection at both ends: one gap over 65,535 (4 bytes)
    xs[7][k // 2 - k :] -= 100
    if dtype in (torch.float32, torch.float64):
        xs[2][5], xs[2][6], xs[2][7] = float("nan"), float("inf"), -float("inf")
    parts = tuple((f"m{i}.weight", torch.Size((n,))) for i, n in enumerate(sizes))
    spans = part_spans(parts, codec.fused_alignment())
    flat = torch.cat(xs)
    p = codec.encode(flat, "g", parts=parts)
    codes, means, heads, gaps, raw = p.tensors
    lay = codec._group(p.ctx)
    coded = [spans.index((a, n)) for a, n, _ in lay.coded]
    assert len(coded) >= 5 and heads.dtype == torch.int32 and heads.numel() == 2 * len(coded)
    levels = unpack_bits(codes, lay.bits, lay.selected).long()
    at = table = gap_at = 0
    for j, i in enumerate(coded):
        k = lay.coded[j][2]
        alone = _alone_sparse(codec, xs[i], parts[i][0])
        assert alone is not None, i
        own_levels, own_means, own_first, own_gaps = alone
        assert torch.equal(levels[at : at + k], own_levels.long()), i
        torch.testing.assert_close(means[table : table + own_means.numel()], own_means, rtol=0, atol=0, equal_nan=True)
        assert int(heads[j]) == int(own_first) and int(heads[len(coded) + j]) * (k - 1) == own_gaps.numel(), i
        assert torch.equal(gaps[gap_at : gap_at + own_gaps.numel()], own_gaps), i
        at, table, gap_at = at + k, table + own_means.numel(), gap_at + own_gaps.numel()
    assert (at, table, gap_at) == (codes.numel() and lay.selected, means.numel(), gaps.numel())
    assert int(heads[len(coded) + coded.index(7)]) == 4
    sent = [x for i, x in enumerate(xs) if i not in coded and x.numel()]
    assert torch.equal(raw, torch.cat(sent)) and 3 in {i for i, x in enumerate(xs) if i not in coded}
    y = codec.decode(p)
    assert y.dtype == dtype
    for i, ((a, n), x) in enumerate(zip(spans, xs)):
        want = codec.decode(codec.encode(x, parts[i][0])) if i in coded else x
        assert torch.equal(y[a : a + n].nan_to_num(), want.nan_to_num()), i
    _check_decode_into(codec, p, y)
    if dtype != torch.float64:  # (a NaN and ±inf in member 2: its table, its selection's)
        assert bool(codec.nonfinite(p)) == (dtype == torch.float32)


@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
def test_sketchml_sparse_group_goes_as_it_is_where_that_is_smaller(monkeypatch, at_once):
    """A sparse group whose payload would be larger than its values (here fp16 at 90%, the tenth
    left out in one run, so a gap takes two bytes) sends every value as it is, told by
    empty heads; a group of members that all go as they are sends the same."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    codec = gradzip.codec("sketchml", ratio=0.9)
    x = _randn((20_000,), torch.float16)
    x[100:1100] = 0.0
    lay = codec._group(codec.encode(x, "g", parts=[("a", (10_000,)), ("b", (10_000,))]).ctx)
    assert len(lay.coded) == 2  # (each could be smaller alone: one-byte gaps)
    for parts in ([("a", (10_000,)), ("b", (10_000,))], [("a", (3,)), ("b", (19_997,))], [("a", (20_000,))]):
        p = codec.encode(x, "g", parts=parts)
        assert [t.numel() for t in p.tensors[:4]] == [0, 0, 0, 0] and torch.equal(p.tensors[4], x)
        assert torch.equal(codec.decode(p), x.float())
        out = torch.ones(20_000)
        codec.decode_into(p, out, accumulate=True)
        assert torch.equal(out, x.float() + 1)
    tiny = gradzip.codec("sketchml", ratio=0.5)
    p = tiny.encode(_randn((6,)), "g", parts=[("a", (1,)), ("b", (5,))])  # every member's k is (about) all of it
    assert [t.numel() for t in p.tensors[:4]] == [0, 0, 0, 0] and torch.equal(tiny.decode(p), _randn((6,)))


@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
def test_sketchml_sparse_group_gaps_of_one_width_or_several(monkeypatch, at_once):
    """The members' gaps in one width (written and read by one cast) or in several (each in its
    own): each member's bytes as alone, its values back as alone, a member of one value among them."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    codec = gradzip.codec("sketchml", ratio=0.01)
    for widths_wanted in ((1, 1, 1), (2, 2, 2), (1, 2, 4), (4, 4, 1)):
        xs = []
        for i, w in enumerate(widths_wanted):  # the selection spread evenly (1), or at both ends (2, 4)
            n = {1: 30_000, 2: 30_000, 4: 140_000}[w]
            k = math.ceil(n * 0.01)
            x = _randn((n,), seed=i) * 1e-3
            if w == 1:
                x[:: n // k] += 10.0
            else:
                x[: k // 2] += 10.0
                x[k // 2 - k :] += 10.0
            xs.append(x)
        xs.insert(1, _randn((100,), seed=9))  # (k = 1: no gaps)
        parts = [(f"p{i}", (x.numel(),)) for i, x in enumerate(xs)]
        p = codec.encode(torch.cat(xs), "g", parts=parts)
        widths = p.tensors[2][len(xs):].tolist()
        assert widths == [widths_wanted[0], 1, *widths_wanted[1:]] and p.tensors[3].numel() == sum(
            w * (math.ceil(x.numel() * 0.01) - 1) for w, x in zip(widths, xs))
        y, at = codec.decode(p), 0
        for i, x in enumerate(xs):
            k, alone = math.ceil(x.numel() * 0.01), codec.encode(x, parts[i][0]).tensors
            assert k == 1 or widths[i] == alone[3].numel() // (k - 1), (widths_wanted, i)
            assert torch.equal(y[at : at + x.numel()], codec.decode(codec.encode(x, parts[i][0]))), (widths_wanted, i)
            at += x.numel()


def test_sparse_groups_rank_every_nan_alike_on_both_ways(monkeypatch):
    """A 16-bit NaN converted to fp32 need not keep its payload bits alike for a tensor and a
    piece of it; every NaN has one magnitude key (above +inf) in the radix selects and in the
    group's sort, so where k falls among NaNs both ways keep the lowest indices."""
    from gradzip.kernels import fused

    a = torch.zeros(10, dtype=torch.float16)
    a[1] = a[9] = float("nan")
    flat = torch.cat([a, _randn((3000,), torch.float16)])
    parts = [("a", (10,)), ("b", (3000,))]
    got = []
    for at_once in (False, True):
        monkeypatch.setattr(fused, "groups_at_once", lambda device, at_once=at_once: at_once)
        sketch = gradzip.codec("sketchml", ratio=0.05).encode(flat, "g", parts=parts).tensors
        picked = gradzip.codec("topk", ratio=0.05).encode(flat, "g", parts=parts).tensors[1]
        got.append((sketch[2].tolist(), sorted(picked.tolist())))
    assert got[0] == got[1] and got[0][0][0] == 1 and 1 in got[0][1] and 9 not in got[0][1]
