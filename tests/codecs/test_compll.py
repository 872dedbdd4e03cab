"""CompLL authoring: the primitives, the catalogue codecs written with them, compilation."""
from __future__ import annotations

import functools
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import compll as cl

TWINS = [("terngrad", "cl_terngrad"), ("tbq", "cl_tbq"), ("onebit", "cl_onebit")]
OPTIONS = {
    "terngrad": [{}, {"bucket_size": 7}, {"bucket_size": 1024}],
    "tbq": [{}, {"threshold": 0.3}],
    "onebit": [{}, {"bucket_size": 7}, {"bucket_size": 1000}],
}


def _make(name, **opts):
    if "seed" in gradzip.codecs.get(name).options:
        opts.setdefault("seed", 5)
    return gradzip.codec(name, **opts)


def _assert_twins(hand, written, x, steps=3):
    for step in range(steps):  # several calls: stochastic streams must advance in lockstep
        pa, pb = hand.encode(x, name="w", step=step), written.encode(x, name="w", step=step)
        assert len(pa.tensors) == len(pb.tensors)
        for a, b in zip(pa.tensors, pb.tensors):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(hand.decode(pa), written.decode(pb))
        assert written.wire_bytes(x.numel(), x.dtype) == pb.nbytes == hand.wire_bytes(x.numel(), x.dtype)


@pytest.mark.parametrize("hand,written", TWINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (1001,), (33, 17), (4096,)], ids=str)
def test_compll_codecs_match_hand_written_bit_for_bit(hand, written, dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    for opts in OPTIONS[hand]:
        _assert_twins(_make(hand, **opts), _make(written, **opts), x)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5000), twin=st.sampled_from(TWINS), scale=st.floats(1e-4, 1e3), seed=st.integers(0, 100))
def test_compll_codecs_match_on_any_size(n, twin, scale, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    _assert_twins(_make(twin[0]), _make(twin[1]), x, steps=1)


def test_compll_codec_sources_are_short():
    import inspect

    from gradzip.codecs import compll_catalog

    for cls in (compll_catalog.CLTernGrad, compll_catalog.CLTBQ, compll_catalog.CLOneBit):
        assert len(inspect.getsource(cls).splitlines()) <= 30, cls.__name__


# ------------------------------------------------------------------------------ primitives
@pytest.mark.parametrize("op", ["sum", "max", "min", "absmax", "l1", "l2"])
@pytest.mark.parametrize("n,bucket", [(10, 0), (10, 3), (12, 4), (1, 5)])
def test_reduce_per_bucket(op, n, bucket):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got = cl.reduce(x, op, bucket)
    chunks = [x] if bucket == 0 else list(x.split(bucket))
    ref = {
        "sum": lambda c: c.sum(), "max": lambda c: c.max(), "min": lambda c: c.min(),
        "absmax": lambda c: c.abs().max(), "l1": lambda c: c.abs().sum(), "l2": lambda c: c.norm(),
    }[op]
    expected = torch.stack([ref(c) for c in chunks]) if bucket else ref(x)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_reduce_rejects_unknown_op():
    with pytest.raises(ValueError, match="valid: absmax"):
        cl.reduce(torch.ones(3), "median")


def test_select_topk_scatter():
    x = torch.tensor([0.1, -3.0, 0.0, 2.0, -0.5])
    values, idx = cl.select(x, x.abs() > 0.4)
    assert values.tolist() == [-3.0, 2.0, -0.5] and idx.tolist() == [1, 3, 4] and idx.dtype == torch.int32
    values, idx = cl.topk(x, 2)
    assert sorted(idx.tolist()) == [1, 3]
    assert torch.equal(cl.scatter(values, idx, 5), torch.tensor([0.0, -3.0, 0.0, 2.0, 0.0]))


def test_pack_concat_extract_round_trip():
    levels = torch.randint(0, 8, (101,), dtype=torch.uint8)
    header = torch.tensor([1.5, -2.25])
    buf = cl.concat(header, cl.pack(levels, 3))
    head, body = cl.extract(buf, 2)
    assert torch.equal(head, header)
    assert torch.equal(cl.unpack(body, 3, 101), levels)


class _Recorder(cl.CompLLCodec):
    """Exposes ``random`` through a codec so streams can be compared (not registered)."""

    name = "_recorder"
    options = {"seed": cl.SEED}
    wire_bits = 32

    def compress(self, x, ctx):
        return [cl.random(ctx, x.numel(), shared=True), cl.random(ctx, x.numel())]

    def decompress(self, wire, ctx):
        return wire[0]


def test_random_shared_and_private_streams():
    x = torch.zeros(16)
    a, b = _Recorder(seed=1), _Recorder(seed=1)
    pa, pb = a.encode(x, name="w", step=4), b.encode(x, name="w", step=4)
    assert torch.equal(pa.tensors[0], pb.tensors[0])  # shared: same (seed, step, name)
    assert torch.equal(pa.tensors[1], pb.tensors[1])  # private: same seed and rank here
    assert not torch.equal(a.encode(x, name="w", step=5).tensors[0], pa.tensors[0])  # next step
    assert not torch.equal(a.encode(x, name="v", step=4).tensors[0], pa.tensors[0])  # other tensor
    state = torch.random.get_rng_state()
    a.encode(x, name="w")
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is untouched


# ------------------------------------------------------------------ a user's own codec
class _Ternary(cl.CompLLCodec):
    """The module docstring's example: a user codec in a few lines (registered by the test
    itself, so other modules never see it in ``names()``)."""

    name = "_test_user_ternary"
    options = {"threshold": cl.Option(0.01, cl.float_in(0, 1e9), "a non-negative float")}
    default_memory = "residual"
    collectives = ("allgather",)
    wire_bits = 2

    def compress(self, x, ctx):
        t = self.threshold
        code = cl.map(lambda v: (v > t).to(torch.uint8) | ((v < -t).to(torch.uint8) << 1), x)
        return [cl.pack(code, 2)]

    def decompress(self, wire, ctx):
        code = cl.unpack(wire[0], 2, ctx.numel).float()
        return cl.map(lambda c: self.threshold * ((c == 1).float() - (c == 2).float()), code)


def test_user_codec_works_like_any_codec():
    cl.register(_Ternary)
    try:
        c = gradzip.codec("_test_user_ternary", threshold=0.5)
        x = torch.tensor([[0.7, -0.2], [-0.9, 0.5]])
        y = c.decode(c.encode(x))
        assert y.shape == x.shape and y.tolist() == [[0.5, 0.0], [-0.5, 0.0]]
        assert c.wire_bytes(4) == 2 == c.encode(x).nbytes
        comm = gradzip.Communicator("_test_user_ternary", threshold=0.5)  # single process
        assert comm.memory.name == "residual"
        assert torch.equal(comm.allreduce(x, name="w"), y)
        comm.close()
        with pytest.raises(ValueError, match="threshold"):
            gradzip.codec("_test_user_ternary", threshold=-1.0)
        with pytest.raises(ValueError, match="compile"):
            gradzip.codec("_test_user_ternary", compile="sometimes")
    finally:
        from gradzip.codecs.registry import _CODECS

        _CODECS._classes.pop("_test_user_ternary", None)  # keep names() clean for other tests



@pytest.mark.parametrize("change,match", [
    ({"decompress": None}, "defines no decompress"),
    ({"compress": None, "decompress": None}, "defines no compress and no decompress"),
    ({"collectives": ()}, "collectives must name one or more"),
    ({"collectives": "allgather"}, "collectives must name one or more"),
], ids=["no-decompress", "no-bodies", "no-collective", "a-string"])
def test_a_malformed_codec_is_refused_when_it_registers(change, match):
    """A definition that could only fail at its first exchange (a body missing, no collective)
    raises ``ValueError`` at registration, saying what is wrong; nothing is registered."""
    body = {k: v for k, v in {**vars(_Ternary), "name": "_test_malformed", **change}.items()
            if v is not None and not k.startswith("__")}
    cls = type("_Malformed", (cl.CompLLCodec,), body)
    with pytest.raises(ValueError, match=match):
        cl.register(cls)
    assert "_test_malformed" not in gradzip.codecs.names()



@pytest.mark.parametrize("change,match", [
    ({"collectives": ("allgather", "ring")}, "declares unknown collective.*'ring'.*valid collectives: .*sra"),
    ({"default_memory": "residuals"}, "unknown default_memory 'residuals'.*valid memories: .*residual"),
], ids=["unknown-collective", "unknown-memory"])
def test_a_codec_naming_a_collective_or_memory_that_does_not_exist_is_refused_at_its_first_use(change, match):
    """The collectives and default memory a codec names are checked where it is first used (a
    module may register its own collective after its codec): a clear ``ValueError`` before any
    collective, not an error inside one."""
    from gradzip.sync.engine import check_settings

    name = "_test_names_later"
    cl.register(type("_Later", (_Ternary,), {"name": name, **change}))
    try:
        with pytest.raises(ValueError, match=match):
            check_settings(name, {})
        with pytest.raises(ValueError, match=match):
            gradzip.Communicator(name)
    finally:
        from gradzip.codecs.registry import _CODECS

        _CODECS._classes.pop(name, None)


def test_bodies_that_return_the_wrong_kind_say_so():
    """``compress`` must return a list of tensors and ``decompress`` a tensor: a bare tensor or
    a list is named at once, not met later as another error inside the collective."""

    class Bare(_Ternary):
        name = "_test_bare"

        def compress(self, x, ctx):
            return super().compress(x, ctx)[0]

    class Listed(_Ternary):
        name = "_test_listed"

        def decompress(self, wire, ctx):
            return [super().decompress(wire, ctx)]

    x = torch.randn(10)
    with pytest.raises(TypeError, match=r"compress must return a list of tensors, got Tensor \(put it in a list"):
        Bare().encode(x)
    with pytest.raises(TypeError, match="decompress must return a tensor, got list"):
        Listed().decode(Listed().encode(x))


def test_a_compll_codec_by_buckets_encodes_a_fused_group_as_its_members_alone():
    """``cl_terngrad`` with buckets (``block``): a group whose members start on buckets decodes
    each value to 0 or ± its own bucket's largest magnitude (a bucket never mixes members) in
    one encode; one reduce a tensor (no buckets) never fuses."""
    c = gradzip.codec("cl_terngrad", bucket_size=64)
    members = [torch.randn(100) * 1e-20, torch.randn(64) * 1e20, torch.randn(3)]
    starts, at = [], 0
    for m in members:
        starts.append(at)
        at += m.numel() + (-m.numel() % 64)
    flat = torch.zeros(at)
    for a, m in zip(starts, members):
        flat[a : a + m.numel()] = m
    y = c.decode(c.encode(flat, name="g"))
    for a, m in zip(starts, members):
        for b in range(0, m.numel(), 64):
            top = float(m[b : b + 64].abs().max())
            got = y[a + b : a + min(b + 64, m.numel())]
            assert all(float(v) in (0.0, top, -top) for v in got)
    assert not y[100:128].any()  # the padding: zeros, a zero's code is 0


def _group(sizes, scales=(0.1, 1.0, 10.0), seed=0):
    """A fused group laid out as the engine lays out a codec's taken by its parts."""
    from gradzip.codecs.base import PART_ALIGN, part_spans

    parts = tuple((f"m{i}.weight", torch.Size((n,))) for i, n in enumerate(sizes))
    spans = part_spans(parts, PART_ALIGN)
    flat = torch.zeros(sum(n + (-n % PART_ALIGN) for n in sizes))
    g = torch.Generator().manual_seed(seed)
    for i, (a, n) in enumerate(spans):
        flat[a : a + n] = torch.randn(n, generator=g) * scales[i % len(scales)]
    return flat, parts, spans


@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
@pytest.mark.parametrize("hand,opts", [("terngrad", {}), ("onebit", {}), ("onebit", {"bucket_size": 512})])
def test_compll_codecs_take_a_group_by_its_parts_as_their_twins(monkeypatch, at_once, hand, opts):
    """``cl_terngrad`` and ``cl_onebit`` reduce, spread and count through ``ctx``
    (:attr:`~gradzip.codecs.compll.CompLLCodec.by_parts`): a fused group is one call, each
    member's scale or bucket means its own, the very payload and values of the hand-written
    twin's group (taken at once; on the CPU's way the twin adds each member's fp64 sums alone,
    the same here, which could differ in a last bit), NaN and infinities included; buckets
    that are not whole blocks, and ``cl_tbq`` (a block), do not go by parts."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    flat, parts, spans = _group((1000, 50, 3000, 7, 0, 20_000, 333, 1 << 12))
    flat[spans[1][0] : spans[1][0] + 50] = -flat[spans[1][0] : spans[1][0] + 50].abs()  # all negative: its padding is not a 0
    flat[spans[2][0] + 3], flat[spans[2][0] + 9] = float("nan"), float("inf")  # (NaN: no sign bit set, as onebit)
    twin, mine = _make(hand, **opts), _make("cl_" + hand, **opts)
    assert mine.parts_format and mine.fused_alignment() == twin.fused_alignment()
    for step in range(2):
        a, b = twin.encode(flat, "g", step=step, parts=parts), mine.encode(flat, "g", step=step, parts=parts)
        assert len(a.tensors) == len(b.tensors)
        same = functools.partial(torch.testing.assert_close, rtol=0, atol=0, equal_nan=True)
        for u, v in zip(a.tensors, b.tensors):
            same(u, v)
        da, db = twin.decode(a), mine.decode(b)
        for s, n in spans:
            same(da[s : s + n], db[s : s + n])
    assert not _make("cl_onebit", bucket_size=100).parts_format and not _make("cl_terngrad", bucket_size=512).parts_format
    assert not _make("cl_tbq").parts_format


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "absmax", "l1", "l2"])
@pytest.mark.parametrize("bucket", [0, 512])
def test_reduce_given_a_groups_context_takes_each_members_values_alone(op, bucket):
    """Given ``ctx`` of a fused group, a reduction is one a member (or a member's bucket) over
    its own values: the padding after each member never counts, whatever the body's map made
    of it (an all-negative member's maximum is its own, not the padding's 0; a count of ones
    holds only the member's); :func:`spread` puts each statistic back on its values and
    :func:`count` says how many each covers."""
    from gradzip.codecs.base import Meta

    flat, parts, spans = _group((1000, 1, 0, 300, 2049), scales=(1.0,), seed=op.__len__())
    a, n = spans[3]
    flat[a : a + n] = -flat[a : a + n].abs() - 1  # all negative
    codec = _make("cl_onebit", bucket_size=bucket)
    ctx = cl.Context(codec, Meta(flat.shape, flat.dtype, flat.device, "g", 0, parts=parts))
    units = [(s + b, min(bucket or n, n - b)) for s, n in spans for b in range(0, max(n, 1), bucket or max(n, 1))]
    got, ones = cl.reduce(flat, op, bucket, ctx), cl.reduce(torch.ones_like(flat, dtype=torch.long), "sum", bucket, ctx)
    assert got.shape == (len(units),) and torch.equal(ones, cl.count(ctx, bucket))
    for i, (s, m) in enumerate(units):
        assert int(ones[i]) == m
        if m:
            want = cl.reduce(flat[s : s + m], op)
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=0)
            if op in ("max", "min", "absmax"):
                assert torch.equal(got[i], want)
    spread = cl.spread(got, ctx, bucket)
    for i, (s, m) in enumerate(units):
        assert (spread[s : s + m] == got[i]).all()
    with pytest.raises(ValueError, match="multiple of 256"):
        cl.reduce(flat, "sum", 100, ctx)


# ---------------------------------------------------------------------------- compilation
@pytest.mark.timeout(600)
def test_compiled_bodies_match_eager(caplog):
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    eager = gradzip.codec("cl_tbq", threshold=0.5, compile=False)
    compiled = gradzip.codec("cl_tbq", threshold=0.5, compile=True)
    with caplog.at_level(logging.WARNING, logger="gradzip.codecs.compll"):
        for _ in range(2):
            pe, pc = eager.encode(x, name="w"), compiled.encode(x, name="w")
            assert torch.equal(pe.tensors[0], pc.tensors[0])
            assert torch.equal(eager.decode(pe), compiled.decode(pc))
    assert not [r for r in caplog.records if "eagerly" in r.message], "the compiled path was not used"


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no compiler here")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    c = gradzip.codec("cl_tbq", threshold=0.5, compile=True)
    x = torch.tensor([0.7, -0.9, 0.1])
    with caplog.at_level(logging.WARNING, logger="gradzip.codecs.compll"):
        assert c.decode(c.encode(x)).tolist() == [0.5, -0.5, 0.0]
        assert c.decode(c.encode(x)).tolist() == [0.5, -0.5, 0.0]
    assert sum("running eagerly" in r.message for r in caplog.records) == 2  # once per body


def test_auto_compiles_only_for_cuda():
    c = gradzip.codec("cl_tbq")
    c.encode(torch.ones(4))
    assert c._bodies[("compress", "cpu")].__func__ is type(c).compress


def test_reduce_over_a_group_keeps_the_dtypes_of_one_member_alone():
    """16-bit values are reduced in fp32 and rounded once (a mean of 70,000 fp16 ones is 1, an
    l2 of 300s is finite), integer sums are exact and int64, booleans reduce as alone, and a
    mean of integers is refused as alone."""
    from gradzip.codecs.base import Meta

    _, parts, spans = _group((70_000, 300, 5))
    n = spans[-1][0] + 256
    ctx = cl.Context(_make("cl_onebit"), Meta(torch.Size((n,)), torch.float32, torch.device("cpu"), "g", 0, parts=parts))
    ones = torch.zeros(n, dtype=torch.float16)
    for s, m in spans:
        ones[s : s + m] = 1
    assert torch.equal(cl.reduce(ones, "mean", 0, ctx), torch.ones(3, dtype=torch.float16))
    big = ones * 300
    alone = torch.stack([cl.reduce(big[s : s + m], "l2") for s, m in spans])  # (the first beyond fp16: inf alone too)
    assert torch.isfinite(alone[1:]).all()
    torch.testing.assert_close(cl.reduce(big, "l2", 0, ctx), alone, rtol=1e-3, atol=0)
    wide = torch.zeros(n, dtype=torch.int64)
    wide[spans[0][0]] = 2**60
    wide[spans[0][0] + 1] = 1
    assert cl.reduce(wide, "sum", 0, ctx).tolist() == [2**60 + 1, 0, 0]
    flags = ones.bool()
    assert cl.reduce(flags, "max", 0, ctx).dtype == torch.bool and cl.reduce(flags, "sum", 0, ctx).tolist() == [70_000, 300, 5]
    with pytest.raises(ValueError, match="floating-point"):
        cl.reduce(wide, "mean", 0, ctx)
