"""Codecs on extreme finite input: rank-deficient matrices, values near the dtype's maximum,
empty payloads and payloads that must not outgrow the raw tensor (single process).

tests/codecs/test_fuzz.py searches the same ground at random; these are the fixed cases.
"""
from __future__ import annotations


import pytest
import torch

import gradzip
from gradzip.codecs import Payload
from gradzip.codecs.base import Meta, raw_bytes
from gradzip.codecs.lowrank import orthogonalize, orthonormal_stacks, orthonormalize
from gradzip.comm import get as collective
from gradzip.comm.base import nonfinite_flag

from ..tensors import randn as _randn
from .test_codecs import _power_round

NAMES = gradzip.codecs.names()
FLT_MAX = torch.finfo(torch.float32).max
FP16_MAX = torch.finfo(torch.float16).max


def _round_trip(c, x, name="t", step=0):
    return c.decode(c.encode(x, name=name, step=step))


# ================================================================================ PowerSGD
@pytest.mark.parametrize("value", [1.0, -3.5, 1e-20, 2e19])
def test_powersgd_constant_matrix_comes_back(value):
    """A constant matrix has rank 1 < r: the power step must reproduce it, not double it."""
    m = torch.full((64, 32), value)
    for c in (gradzip.codec("powersgd", rank=2), gradzip.codec("powersgd", rank=4)):
        for y in (_round_trip(c, m, name="w"), _power_round(c, m, "w"), _power_round(c, m, "w")):
            assert torch.isfinite(y).all()
            assert ((y - m).double().norm() / m.double().norm()).item() < 1e-5


def test_powersgd_rank_deficient_and_zero():
    g = torch.Generator().manual_seed(0)
    rank1 = torch.randn(50, 1, generator=g) @ torch.randn(1, 20, generator=g)
    for m in (rank1, torch.zeros(50, 20)):
        c = gradzip.codec("powersgd", rank=3)
        for _ in range(3):  # the first step, then warm starts from a rank-deficient Q
            y = _power_round(c, m, "w")
            assert torch.isfinite(y).all()
            torch.testing.assert_close(y, m, rtol=0, atol=1e-5 * (1 + m.abs().max().item()))


@pytest.mark.parametrize("seed", range(5))
def test_powersgd_is_a_projection(seed):
    """P Pᵀ M with orthonormal P: the error is never larger than M itself."""
    m = _randn((40, 30), seed=seed)
    c = gradzip.codec("powersgd", rank=2)
    for _ in range(3):
        y = _power_round(c, m, "w")
        assert (y - m).norm() <= m.norm() * (1 + 1e-6)


def test_orthogonalize_is_orthonormal_deterministic_and_keeps_nan():
    p = torch.ones(64, 2)  # rank 1: Gram-Schmidt with an eps made a second column of noise
    q = orthogonalize(p.clone())
    torch.testing.assert_close(q.T @ q, torch.eye(2), rtol=0, atol=1e-6)
    assert torch.equal(q, orthogonalize(p.clone()))
    z = orthogonalize(torch.zeros(5, 3))
    assert torch.isfinite(z).all()
    torch.testing.assert_close(z.T @ z, torch.eye(3), rtol=0, atol=1e-6)
    bad = torch.ones(6, 2)
    bad[2, 1] = float("nan")
    assert torch.isnan(orthogonalize(bad)).all()


def test_orthonormalize_many_matrices_at_once():
    """Matrices of many heights (and two widths) in batches: each result has orthonormal
    columns spanning the matrix's, a NaN or an infinity spoils only its own matrix, magnitudes
    from 1e-30 to 1e30 change nothing, and the bits do not depend on the run."""
    g = torch.Generator().manual_seed(5)
    mats = [torch.randn(n, r, generator=g) for n, r in [(7, 2), (300, 2), (64, 2), (64, 2), (5, 3), (2048, 2), (2, 2)]]
    mats += [mats[1] * 1e30, mats[2] * 1e-30, torch.zeros(9, 2), torch.ones(40, 3)]
    bad, inf = mats[3].clone(), mats[4].clone()
    bad[1, 0], inf[2, 2] = float("nan"), float("inf")
    mats += [bad, inf]
    qs = orthonormalize(mats)
    assert [q.shape for q in qs] == [m.shape for m in mats]
    for m, q in zip(mats[:-2], qs[:-2]):
        assert torch.isfinite(q).all()
        torch.testing.assert_close(q.T @ q, torch.eye(m.shape[1]), rtol=0, atol=2e-6)
        scale = m.abs().max().clamp_min(1e-38)
        torch.testing.assert_close(q @ (q.T @ (m / scale)), m / scale, rtol=0, atol=1e-5)  # the span holds m
    assert torch.isnan(qs[-2]).all() and torch.isnan(qs[-1]).all()
    torch.testing.assert_close(qs[7], qs[1], rtol=0, atol=1e-6)  # scaled by 1e30: the same directions
    torch.testing.assert_close(qs[8], qs[2], rtol=0, atol=1e-6)
    again = orthonormalize([m.clone() for m in mats])
    assert all(torch.equal(a, b) for a, b in zip(qs[:-2], again[:-2]))
    batches = orthonormal_stacks(mats)
    assert sorted(i for b, _ in batches for i in b) == list(range(len(mats)))
    assert len(batches) < len(mats)  # batched, not one by one


def test_powersgd_recovers_rank_after_a_zero_step():
    """A zero gradient first (an unused layer) leaves a warm-start Q whose columns came from the
    fixed directions, not zeros: later steps still find the best rank-2 approximation."""
    from .test_codecs import _decaying_spectrum

    mat, best = _decaying_spectrum(60, 40)
    c = gradzip.codec("powersgd", rank=2)
    assert torch.equal(_power_round(c, torch.zeros(60, 40), "w"), torch.zeros(60, 40))
    errs = [(_power_round(c, mat, "w") - mat).norm().item() for _ in range(25)]
    assert errs[-1] <= best * 1.001


def _power_rounds(c, mats, names):
    """One PowerSGD step of several tensors batched as ``AllReduce.exchange_many`` drives them."""
    payloads = [c.encode(m, name=n) for m, n in zip(mats, names)]
    reduced = [[t.clone() for t in p.tensors] for p in payloads]
    while True:
        nexts = c.next_round_many(payloads, reduced)
        live = [i for i, p in enumerate(nexts) if p is not None]
        if not live:
            break
        for i in live:
            payloads[i], reduced[i] = nexts[i], [t.clone() for t in nexts[i].tensors]
    return [c.decode(Payload(r, p.ctx)) for r, p in zip(reduced, payloads)]


def _power_parts(c, flat, parts, key="group"):
    """One PowerSGD step of a fused buffer of ``parts``, one call, as the all-reduce drives it
    at one rank."""
    payloads = [c.encode(flat, name=key, parts=parts)]
    sizes = [[t.numel() for t in payloads[0].tensors]]
    reduced = [t.clone() for t in payloads[0].tensors]
    while (nxt := c.next_round(payloads[-1], reduced)) is not None:
        payloads.append(nxt)
        sizes.append([t.numel() for t in nxt.tensors])
        reduced = [t.clone() for t in nxt.tensors]
    return c.decode(Payload(reduced, payloads[-1].ctx)), sizes


POWER_PARTS = {"a.weight": (48, 30), "a.bias": (48,), "b.weight": (16, 3, 3, 3), "d.weight": (64, 8), "c.weight": (3, 3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_powersgd_encodes_a_fused_buffer_tensor_by_tensor(dtype):
    """A fused group given as parts: one payload a round for all its tensors, each factorised
    by its own shape with its own warm start, the ones too small to factorise (1-D, 3 × 3)
    sent as they are in the last round; over steps the values are those of each tensor alone,
    and so are the per-name Qs a checkpoint holds, to rounding: a product's last bits may
    follow where its output lies in memory (BLAS takes another path for an unaligned one), so
    a group's layout, the same on every rank, decides them."""
    parts = list(POWER_PARTS.items())
    fused, alone = gradzip.codec("powersgd", rank=2), gradzip.codec("powersgd", rank=2)
    for step in range(3):
        grads = [_randn(shape, dtype, seed=10 * step + i) for i, shape in enumerate(POWER_PARTS.values())]
        flat = torch.cat([g.reshape(-1) for g in grads])
        got, sizes = _power_parts(fused, flat, parts)
        expected = _power_rounds(alone, grads, list(POWER_PARTS))
        assert got.dtype == dtype
        torch.testing.assert_close(got, torch.cat([e.reshape(-1) for e in expected]), rtol=1e-5, atol=1e-5)
    # Pᵀ of the three matrices packed; then their Qᵀ, and the 48 + 9 values sent as they are
    # (in the same tensor for an fp32 input, in their own dtype beside it for a 16-bit one)
    raw = [57] if dtype == torch.float32 else [0, 57]
    assert sizes == [[2 * (48 + 16 + 64)], [2 * (30 + 27 + 8) + raw[0]] + raw[1:]]
    assert fused._q.keys() == alone._q.keys() == {"a.weight", "b.weight", "d.weight"}
    for n in fused._q:
        torch.testing.assert_close(fused._q[n], alone._q[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16], ids=str)
def test_powersgd_sends_what_goes_as_it_is_in_a_16_bit_gradients_width(wire):
    """The fp32 compensation of a 16-bit gradient (error feedback, ``wire``): the factors stay
    fp32 and are those without the wire; the tensors too small to factorise go in the
    gradient's width beside them (as a 16-bit input's do), saturated; a group with nothing to
    factorise goes wholly in that width; and whether a matrix pays off is judged against it."""
    parts = list(POWER_PARTS.items())
    flat = torch.cat([_randn(shape, seed=i).reshape(-1) for i, shape in enumerate(POWER_PARTS.values())]) * 100
    flat[30 * 48] = 1e6  # (the first value of a.bias, sent as it is)
    plain, narrow = gradzip.codec("powersgd", rank=2), gradzip.codec("powersgd", rank=2)
    first = [c.encode(flat, name="g", parts=parts, **kw) for c, kw in ((plain, {}), (narrow, {"wire": wire}))]
    assert torch.equal(first[0].tensors[0], first[1].tensors[0])
    second = [c.next_round(p, [t.clone() for t in p.tensors]) for c, p in zip((plain, narrow), first)]
    assert [[t.dtype for t in p.tensors] for p in second] == [[torch.float32], [torch.float32, wire]]
    assert [[t.numel() for t in p.tensors] for p in second] == [[2 * (30 + 27 + 8) + 57], [2 * (30 + 27 + 8), 57]]
    assert torch.equal(second[0].tensors[0][: 2 * 65], second[1].tensors[0])
    raw = second[0].tensors[0][2 * 65 :]
    assert torch.equal(second[1].tensors[1], gradzip.codecs.base.saturate(raw, wire))
    vectors = [("v", (300,)), ("u", (20,))]
    alone = narrow.encode(flat[:320], name="vs", parts=vectors, wire=wire)
    assert [t.dtype for t in alone.tensors] == [wire] and alone.nbytes == 320 * wire.itemsize
    assert torch.equal(narrow.decode(alone), gradzip.codecs.base.saturate(flat[:320], wire).float())
    # (3, 5, 7) as 3 × 35: fp32 factors (304 bytes) pay off against fp32 values, not against 16-bit ones
    assert plain.wire_bytes(105, torch.float32, shape=(3, 5, 7)) == (3 + 35) * 2 * 4
    assert plain.wire_bytes(105, torch.float32, shape=(3, 5, 7), wire=wire) == 105 * 2
    sent = narrow.encode(_randn((3, 5, 7)), name="t", wire=wire)
    assert [t.dtype for t in sent.tensors] == [wire] and sent.nbytes == 105 * 2


def test_powersgd_fused_buffer_keeps_nonfinite_values_where_they_are():
    """A NaN in a tensor sent as it is and an inf in a factorised one reach the decoded sum,
    and each alone flags the first round's payload (a collective flags the step from it: see
    tests/sync/test_engine.py): a factorised tensor's through its factor, a tensor sent as it
    is, which goes in the last round, as a NaN first value of the first factor."""
    c = gradzip.codec("powersgd", rank=2)
    grads = [_randn(shape, seed=i) for i, shape in enumerate(POWER_PARTS.values())]
    grads[1][3], grads[3][1, 1] = float("nan"), float("inf")
    got, _ = _power_parts(c, torch.cat([g.reshape(-1) for g in grads]), list(POWER_PARTS.items()))
    bias, d = 48 * 30, 48 * 30 + 48 + 16 * 27
    assert torch.isnan(got[bias + 3]) and not torch.isfinite(got[d : d + 64 * 8]).all()
    for spoilt in (1, 3):  # the bias alone, then d.weight alone
        clean = [_randn(shape, seed=i) for i, shape in enumerate(POWER_PARTS.values())]
        clean[spoilt].view(-1)[3] = float("nan") if spoilt == 1 else float("inf")
        first = c.encode(torch.cat([g.reshape(-1) for g in clean]), name="g", parts=list(POWER_PARTS.items()))
        assert bool(c.nonfinite(first)), spoilt
    clean = [_randn(shape, seed=i) for i, shape in enumerate(POWER_PARTS.values())]
    first = c.encode(torch.cat([g.reshape(-1) for g in clean]), name="g", parts=list(POWER_PARTS.items()))
    assert not bool(c.nonfinite(first))


def test_encode_checks_that_parts_cover_the_tensor():
    c = gradzip.codec("powersgd")
    with pytest.raises(ValueError, match=r"parts cover 9 values \(each padded to a multiple of 1\), the tensor has 10"):
        c.encode(torch.zeros(10), parts=[("a", (3, 3))])
    assert c.encode(torch.zeros(10), parts=[("a", [2, 5])]).ctx.parts == (("a", torch.Size([2, 5])),)
    # a codec whose members start on blocks counts each member's padding
    ef = gradzip.codec("efsignsgd")
    block = ef.fused_alignment()
    with pytest.raises(ValueError, match=f"parts cover {2 * block} values"):
        ef.encode(torch.zeros(block + 10), parts=[("a", (10,)), ("b", (block,))])
    assert len(ef.encode(torch.zeros(2 * block), parts=[("a", (10,)), ("b", (10,))]).tensors[1]) == 2


@pytest.mark.parametrize("name,in_turn", [("efsignsgd", True), ("efsignsgd", False), ("onebit", True),
                                          ("onebit", False), ("terngrad", False), ("natural", False)])
def test_a_group_encoded_by_its_parts_decodes_each_member_as_alone_and_its_padding_defined(name, in_turn, monkeypatch):
    """By its parts, each member decodes to what it decodes to alone (TernGrad: each value 0 or
    its member's ±max), the CPU's way (member by member) and the accelerator's (by blocks) on
    CPU tensors; the padding is zero where decoded member by member, finite where by blocks,
    and a prefix of the group decodes to the prefix of the whole."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: not in_turn)
    c = gradzip.codec(name)
    block = c.fused_alignment()
    parts = [("a", (7, 9)), ("b", (0,)), ("c", (block + 5,)), ("d", (3,))]
    spans = [(0, 63), (block, 0), (block, block + 5), (3 * block, 3)]
    x = torch.zeros(4 * block)
    for (a, n), scale in zip(spans, (1.0, 1.0, 1e3, 1e-3)):
        x[a : a + n] = torch.randn(n, generator=torch.Generator().manual_seed(a)) * scale
    payload = c.encode(x, name="g", parts=parts)
    out = torch.full((4 * block,), float("nan"))
    got = c.decode_into(payload, out)
    for (a, n), (_, shape) in zip(spans, parts):
        alone = c.decode(c.encode(x[a : a + n].clone().view(shape), name="m"))
        if name == "terngrad":  # stochastic: the draws are the group's
            top = x[a : a + n].abs().max() if n else 0.0
            assert all(float(v) in (0.0, float(top), -float(top)) for v in got[a : a + n])
        elif name == "natural":  # stochastic too: the member's own header, each value 0 or a bracketing power of two
            member = list(spans).index((a, n))
            if n:
                assert torch.equal(payload.tensors[1][member : member + 1], c.encode(x[a : a + n].clone(), name="m").tensors[1])
            v, m = got[a : a + n].abs(), x[a : a + n].abs()
            assert bool(((v == 0) | ((v <= 2 * m) & (v >= m / 2) & (torch.frexp(v).mantissa == 0.5))).all())
        else:
            assert torch.equal(got[a : a + n], alone.reshape(-1))
    assert torch.isfinite(got).all()  # the padding defined
    if in_turn:
        assert not got[63:block].any() and not got[2 * block + 5 : 3 * block].any()
    prefix = c.decode_into(payload, torch.empty(block + 100))
    assert torch.equal(prefix, got[: block + 100])


def test_powersgd_resumes_bit_exactly_from_its_state_dict():
    import io

    mats = [_randn((40, 30), seed=s) for s in range(3)]
    names = ["a", "b", "c"]
    c = gradzip.codec("powersgd", rank=2)
    for _ in range(3):
        _power_rounds(c, mats, names)
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    again = gradzip.codec("powersgd", rank=2)
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert all(torch.equal(again._q[n], c._q[n]) for n in names)
    for x, y in zip(_power_rounds(c, mats, names), _power_rounds(again, mats, names)):
        assert torch.equal(x, y)


def test_powersgd_non_finite_step_keeps_each_tensors_latest_q():
    """The fallback is each tensor's Q of the step before, whatever batches it came from, and
    a tensor whose shape changed falls back to an orthonormal Q of its new shape."""
    a, b, c3 = _randn((40, 30), seed=1), _randn((40, 30), seed=2), _randn((20, 30), seed=3)
    codec = gradzip.codec("powersgd", rank=2)
    _power_rounds(codec, [a, b], ["a", "b"])
    _power_rounds(codec, [a * 2 + 1, b, c3], ["a", "b", "c"])  # another batch: a's Q moves on
    latest = codec._q["a"].clone()
    bad = a.clone()
    bad[3, 4] = float("nan")
    out = _power_rounds(codec, [bad, b], ["a", "b"])
    assert torch.isnan(out[0]).all() and torch.equal(codec._q["a"], latest)
    narrow = _randn((40, 25), seed=4)
    narrow[0, 0] = float("inf")
    _power_rounds(codec, [a, narrow], ["a", "b"])  # b changed shape in a non-finite step
    q = codec._q["b"]
    assert q.shape == (25, 2)
    torch.testing.assert_close(q.T @ q, torch.eye(2), rtol=0, atol=1e-6)


def test_orthonormalize_fills_a_matrix_the_same_whatever_shares_its_batch():
    z = torch.zeros(6, 2)
    alone = orthonormalize([z])[0]
    batched = orthonormalize([_randn((9, 2), seed=1), z])[1]
    torch.testing.assert_close(alone, batched, rtol=0, atol=1e-6)
    torch.testing.assert_close(alone.T @ alone, torch.eye(2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale", [1e-21, 1e-30, 1e-36])
def test_orthonormalize_keeps_a_column_tiny_beside_the_others_orthonormal(scale):
    """A finite column far smaller than the others (its squares below fp32's normal range once
    the matrix is scaled by its largest value) still comes out a unit vector orthogonal to the
    others: each column is scaled by its own largest magnitude first."""
    for first in (False, True):
        m = _randn((16, 3), seed=5)
        m[:, 0 if first else 1] *= scale
        q = orthonormalize([m])[0]
        torch.testing.assert_close(q.T @ q, torch.eye(3), rtol=0, atol=1e-5)
        lost = (q @ (q.T @ m) - m).abs().amax(dim=0)  # the columns spanned, each to its own scale
        assert (lost <= 1e-5 * m.abs().amax(dim=0)).all(), lost


def test_orthonormalize_costs_the_same_operations_for_2_or_16_matrices():
    """A stack is orthonormalised by a fixed number of operations a column (each column after
    the first projected side by side with its filler: one product and one update a projection
    for both), whatever its number of matrices: on an accelerator each operation is host time."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.work: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.work[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for k in (2, 16):
        mats = [_randn((40, 4), seed=i) for i in range(k)]
        orthonormalize(mats)  # the layout's index and filler tensors made once
        with Ops() as ops:
            qs = orthonormalize(mats)
        counts.append(ops.work)
        for q in qs:
            torch.testing.assert_close(q.T @ q, torch.eye(4), rtol=0, atol=1e-5)
    assert counts[0] == counts[1], counts
    assert counts[0]["bmm"] == counts[0]["baddbmm"] == 2 * 3, counts[0]  # twice for columns 2-4


def test_powersgd_warm_start_survives_large_finite_steps():
    """The warm-start Q is kept for finite (if huge) steps and stays orthonormal in use."""
    m = _randn((40, 30), seed=3) * 1e30
    c = gradzip.codec("powersgd", rank=2)
    for _ in range(3):
        y = _power_round(c, m, "w")
        assert torch.isfinite(y).all() and torch.isfinite(c._q["w"]).all()
    assert (y - m).norm() <= m.norm()


def test_powersgd_non_finite_step_is_nan_and_keeps_warm_start():
    c = gradzip.codec("powersgd", rank=2)
    _power_round(c, _randn((40, 30)), "w")
    q = c._q["w"].clone()
    bad = _randn((40, 30), seed=1)
    bad[3, 4] = float("inf")
    assert not torch.isfinite(_power_round(c, bad, "w")).all()
    assert torch.isfinite(c._q["w"]).all() and c._q["w"].shape == q.shape


# ======================================================================= non-finite checks
def test_nonfinite_flag_does_not_overflow():
    assert not nonfinite_flag(torch.full((15,), 1e38))
    assert not nonfinite_flag(torch.tensor([FLT_MAX, -FLT_MAX] * 8))
    assert not nonfinite_flag(torch.full((40,), FP16_MAX, dtype=torch.float16))
    assert nonfinite_flag(torch.tensor([1.0, float("nan")]))
    assert nonfinite_flag(torch.tensor([-float("inf"), 1.0], dtype=torch.bfloat16))
    assert not nonfinite_flag(torch.empty(0))
    flag = nonfinite_flag(torch.ones(3))
    assert flag.dim() == 0 and flag.dtype == torch.bool


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("spec", ["maxmin", "qsgd", "u8bit", "fp8", "mxfp8", "mxfp4"])
def test_bucket_statistics_tell_every_nonfinite_input_and_no_finite_one(spec, kernels, monkeypatch):
    """The flag read from the statistics of max-min, QSGD, the 8-bit codec, FP8 and MX (no pass
    over the input): true for a NaN, +inf or -inf in any bucket, false for values at the top of
    fp32 of both signs."""
    monkeypatch.setenv("GRADZIP_KERNELS", kernels)
    c = gradzip.codec(spec, **{"block_size" if spec.startswith(("fp8", "mx")) else "bucket_size": 64})
    assert not bool(c.nonfinite(c.encode(torch.tensor([FLT_MAX, -FLT_MAX, 3e38, -2e38] * 50), "w")))
    assert not bool(c.nonfinite(c.encode(_randn((1000,)), "w")))
    for where, bad in [(0, float("nan")), (500, float("inf")), (999, -float("inf"))]:
        x = _randn((1000,))
        x[where] = bad
        assert bool(c.nonfinite(c.encode(x, "w"))), (where, bad)
    x = torch.full((128,), float("inf"))  # every value +inf: the range inf - inf is NaN
    assert bool(c.nonfinite(c.encode(x, "w")))
    big = torch.tensor([1e300, 1.0] * 64, dtype=torch.float64)  # finite, but an inf in the codec's fp32
    p = c.encode(big, "w")
    assert bool(c.nonfinite(p)) and not torch.isfinite(c.decode(p)).all()


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("spec", ["fp16", "bf16", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_casts_tell_every_nonfinite_input_from_the_values_they_send(spec, dtype, kernels, monkeypatch):
    """The casts' flag, read from the values sent (no pass over the input): true for a NaN,
    +inf or -inf anywhere, false for finite values however large (the cast saturates them)."""
    monkeypatch.setenv("GRADZIP_KERNELS", kernels)
    c = gradzip.codec(spec)
    top = torch.finfo(dtype).max
    assert not bool(c.nonfinite(c.encode(torch.tensor([top, -top, 1.0, 0.0] * 40, dtype=dtype), "w")))
    assert not bool(c.nonfinite(c.encode(torch.empty(0, dtype=dtype), "w")))
    for where, bad in [(0, float("nan")), (500, float("inf")), (999, -float("inf"))]:
        x = _randn((1000,)).to(dtype)
        x[where] = bad
        assert bool(c.nonfinite(c.encode(x, "w"))), (where, bad)


def test_allgather_of_huge_finite_values_is_finite():
    x = torch.full((15,), 1e38)
    for name in ("none", "topk", "signsgd"):
        res = collective("allgather")().run(gradzip.codec(name), x, "w", 0, need_own=False)
        assert not bool(res.nonfinite) and torch.isfinite(res.avg).all()


def test_signum_momentum_and_adaq_residual_take_huge_finite_steps():
    x = torch.full((20,), 1e38)
    s = gradzip.codec("signum", momentum=0.5)
    s.encode(x, name="w")
    assert torch.equal(s._momentum["w"], x * 0.5)  # updated: the step is finite
    g = _randn((120,), seed=2) * 1e37
    g[::5] = 1e38  # an fp32 sum of these overflows; the residual must still be updated
    a = gradzip.codec("adaq")
    sent = a.decode(a.encode(g, name="w"))
    assert torch.equal(a._residuals["w"], g - sent) and (a._residuals["w"] != 0).any()


# ====================================================================== near the maximum
def test_qsgd_norm_does_not_overflow():
    for kernels in ("native", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GRADZIP_KERNELS", kernels)
            c = gradzip.codec("qsgd")
            y = _round_trip(c, torch.tensor([2e19]))
            torch.testing.assert_close(y, torch.tensor([2e19]), rtol=1e-6, atol=0)
            big = torch.tensor([3e38, -3e38, 1.0, 2e38] * 3)  # the norm itself exceeds fp32
            assert torch.isfinite(_round_trip(c, big)).all()
            tiny = torch.tensor([1e-45, 0.0, -1e-44, 3e-45] * 5)  # subnormal norm: s / norm overflows
            y = _round_trip(c, tiny)
            assert torch.isfinite(y).all() and (y[1::4] == 0).all()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["stochastic", "nearest"])
def test_maxmin_range_beyond_fp32(bits, mode):
    x = torch.tensor([FLT_MAX, -FLT_MAX, 0.0, 1e38, -2e38, 3e38, 5.0, -FLT_MAX])
    for kernels in ("native", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GRADZIP_KERNELS", kernels)
            c = gradzip.codec("maxmin", bits=bits, bucket_size=8, mode=mode)
            y = _round_trip(c, x)
            assert torch.isfinite(y).all()
            if bits > 1:  # one step is (max - min) / q; with 1 bit the scale saturates at FLT_MAX
                step = 2 * FLT_MAX / (2**bits - 1)
                assert ((y.double() - x.double()).abs() <= step * 1.0001).all()


@pytest.mark.parametrize("name", ["qsgd", "natural", "bf16", "powersgd", "maxmin", "u8bit", "terngrad", "sketchml"])
def test_fp16_near_max_stays_finite(name):
    x = torch.full((64, 32), FP16_MAX, dtype=torch.float16)
    x[::2] = -60000.0
    x[:, 3] = 65000.0
    c = gradzip.codec(name)
    for _ in range(20):  # stochastic rounding: many chances to round beyond the range
        y = _round_trip(c, x, name="w")
        assert y.dtype == torch.float16 and torch.isfinite(y).all()
    # non-finite input stays non-finite (the saturation is for finite values only)
    bad = x.clone()
    bad[0, 0] = float("inf")
    if name in ("bf16", "natural"):
        assert not torch.isfinite(_round_trip(c, bad, name="v")).all()


def test_saturating_decode_into_fp16_destination():
    c = gradzip.codec("natural", seed=1)
    x = torch.full((4096,), 50000.0, dtype=torch.float16)  # rounds to 2**16 with p = 0.53
    p = c.encode(x)
    out = torch.empty(4096, dtype=torch.float16)
    c.decode_into(p, out)
    assert torch.isfinite(out).all() and (out == FP16_MAX).any()
    assert torch.equal(out, c.decode(p))


def test_natural_fp32_max_saturates():
    x = torch.full((1000,), FLT_MAX)
    y = _round_trip(gradzip.codec("natural"), x)
    assert torch.isfinite(y).all() and set(y.unique().tolist()) <= {2.0**127, FLT_MAX}


@pytest.mark.parametrize("name", ["onebit", "cl_onebit", "efsignsgd", "adaq"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sums_of_huge_values_do_not_overflow(name, sign):
    x = torch.full((64,), sign * 1e38)
    x[::7] = -sign * 3e38
    y = _round_trip(gradzip.codec(name), x, name="w")
    assert torch.isfinite(y).all() and y.abs().max() <= 3e38 * (1 + 1e-6)


def test_cl_onebit_still_matches_onebit_on_huge_values():
    x = _randn((3001,), seed=4) * 1e37
    for opts in ({}, {"bucket_size": 100}):
        a = gradzip.codec("onebit", **opts).encode(x)
        b = gradzip.codec("cl_onebit", **opts).encode(x)
        assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))


@pytest.mark.parametrize("scale", [True, False])
def test_randomk_scaled_value_saturates(scale):
    x = torch.full((8,), FLT_MAX)
    y = _round_trip(gradzip.codec("randomk", ratio=0.5, scale=scale), x)
    assert torch.isfinite(y).all()


# ========================================================================= empty payloads
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 5)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_aggregate_of_empty_payloads(name, shape, dtype):
    c = gradzip.codec(name)
    payloads = [c.encode(torch.empty(shape, dtype=dtype), name="w") for _ in range(3)]
    assert all(p.nbytes == 0 for p in payloads)
    meta = Meta(torch.Size(shape), dtype, torch.device("cpu"), "w", 0)
    for ps in (payloads, [Payload([], meta)]):
        out = c.aggregate(ps)
        assert out.shape == shape and out.dtype == dtype


# ================================================================ no more bytes than raw
@pytest.mark.parametrize("name", NAMES)
def test_wire_bytes_never_above_raw(name):
    c = gradzip.codec(name)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in list(range(1, 70)) + [127, 255, 256, 257, 1000, 4099]:
            for shape in {(n,), (1, n), (n, 1)} | ({(n // 4, 4)} if n % 4 == 0 else set()):
                assert c.wire_bytes(n, dtype, shape=shape) <= raw_bytes(n, dtype), (dtype, shape)


@pytest.mark.parametrize(
    "name,opts",
    [("threshold", {}), ("threshold", {"threshold": 0.0}), ("graddrop", {"ratio": 1.0}), ("dgc", {"ratio": 1.0}),
     ("topk", {"ratio": 1.0}), ("topk", {"ratio": 0.7}), ("inceptionn", {}), ("inceptionn", {"error_bound": 1e-30}),
     ("adaq", {"bin_size": 1}), ("sketchml", {"ratio": 0.9}), ("maxmin", {"bucket_size": 1}),
     ("onebit", {"bucket_size": 1}), ("u8bit", {"bucket_size": 1}), ("qsgd", {"bucket_size": 1})],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dense_data_never_above_raw(name, opts, dtype):
    c = gradzip.codec(name, **opts)
    for n in (1, 2, 3, 9, 1001):
        x = _randn((n,), dtype, seed=n) * 100
        p = c.encode(x, name="w")
        assert p.nbytes <= raw_bytes(n, dtype) and p.nbytes <= c.wire_bytes(n, dtype)
        y = c.decode(p)
        assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()


def test_threshold_dense_form_decodes_the_same_and_mixes_with_sparse():
    """Each rank picks its own form; the decoder reads it from the payload's lengths."""
    c = gradzip.codec("threshold", threshold=1.0)
    dense_x = torch.tensor([4.0, 0.5, 3.0, 2.0, -1.5, 0.0, 7.0, 1.0])  # 6 of 8 pass: dense
    sparse_x = torch.tensor([0.0, 5.0, 0.2, 0.0, 0.0, 0.0, 0.0, -2.0])
    pd, ps = c.encode(dense_x, name="w"), c.encode(sparse_x, name="w")
    assert pd.tensors[1].numel() == 0 and pd.nbytes == 32 and ps.tensors[1].numel() == 2
    assert [t.dtype for t in pd.tensors] == [t.dtype for t in ps.tensors]  # what the all-gather expects
    keep = dense_x.abs() >= 1.0
    assert torch.equal(c.decode(pd), torch.where(keep, dense_x, torch.zeros(8)))
    want = (torch.where(keep, dense_x, torch.zeros(8)) + torch.where(sparse_x.abs() >= 1, sparse_x, torch.zeros(8))) / 2
    for pair in ([pd, ps], [ps, pd]):
        torch.testing.assert_close(c.aggregate([Payload(p.tensors, ps.ctx) for p in pair]), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,opts,dense_x,sparse_x",
    [
        ("inceptionn", {}, torch.full((64,), 1e9, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)),
        ("adaq", {"bin_size": 2}, _randn((64,), torch.float16), torch.zeros(64, dtype=torch.float16)),
        ("sketchml", {"ratio": 0.9}, _randn((64,)), _randn((64,), seed=3)),
    ],
)
def test_dense_forms_keep_tensor_count_and_dtypes(name, opts, dense_x, sparse_x):
    c = gradzip.codec(name, **opts)
    pd, ps = c.encode(dense_x, name="w", step=0), c.encode(sparse_x, name="u", step=0)
    assert pd.nbytes <= raw_bytes(64, dense_x.dtype)
    assert [t.dtype for t in pd.tensors] == [t.dtype for t in ps.tensors]
    y = c.decode(pd)
    assert y.dtype == dense_x.dtype and torch.isfinite(y).all()
    if name == "inceptionn":  # the dense form holds the raw values
        assert torch.equal(y, dense_x)
    out = c.aggregate([pd, Payload(ps.tensors, pd.ctx)])
    assert out.shape == (64,) and torch.isfinite(out).all()


def test_powersgd_layouts_follow_the_rank_and_batches_of_fused_buffers_keep_each_q():
    """A layout is made again when ``rank`` changes; two fused buffers orthonormalised in one
    batch (``next_round_many``) keep the Qs each would keep alone (an fp32 buffer's raw values
    follow its Qᵀ in the same tensor and are not read as Qs)."""
    c = gradzip.codec("powersgd", rank=2)
    x = _randn((64, 32), seed=1)
    assert c.encode(x, name="w").tensors[0].numel() == 2 * 64
    c.set_options({"rank": 4})
    assert c.encode(x, name="w").tensors[0].numel() == 4 * 64
    parts_a, parts_b = [("a.w", (40, 30)), ("a.b", (40,))], [("b.w", (24, 16)), ("b.b", (24,))]
    xa = torch.cat([_randn(s, seed=2 + i).reshape(-1) for i, (_, s) in enumerate(parts_a)])
    xb = torch.cat([_randn(s, seed=5 + i).reshape(-1) for i, (_, s) in enumerate(parts_b)])
    many, alone = gradzip.codec("powersgd", rank=2), gradzip.codec("powersgd", rank=2)
    payloads = [many.encode(xa, name="A", parts=parts_a), many.encode(xb, name="B", parts=parts_b)]
    reduced = [[t.clone() for t in p.tensors] for p in payloads]
    nexts = many.next_round_many(payloads, reduced)
    while all(n is not None for n in nexts):
        payloads, reduced = nexts, [[t.clone() for t in n.tensors] for n in nexts]
        nexts = many.next_round_many(payloads, reduced)
    _power_parts(alone, xa, parts_a, "A")
    _power_parts(alone, xb, parts_b, "B")
    for name in ("a.w", "b.w"):
        torch.testing.assert_close(many._q[name], alone._q[name], rtol=1e-5, atol=1e-6)
