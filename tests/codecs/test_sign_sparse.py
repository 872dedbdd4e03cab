"""Expected behaviour of onebit, signum, threshold, dgc, graddrop, adaq and the DGC memory.

The generic properties (shapes, dtypes, wire bytes, aggregate) are in tests/codecs/test_codecs.py; these
tests pin down what each method is meant to compute.
"""
from __future__ import annotations

import math

import pytest
import torch

import gradzip
from gradzip.codecs import Payload
from gradzip.sync.memory import DGCMemory, memory

from ..tensors import LargestMade
from ..tensors import randn as _randn
from ..tensors import with_nonfinite

NEW = ["onebit", "signum", "threshold", "dgc", "graddrop", "adaq"]


def _round_trip(c, x, name="t", step=0):
    return c.decode(c.encode(x, name=name, step=step))


def _distinct(n: int, seed: int = 0) -> torch.Tensor:
    """Values with distinct magnitudes and random signs."""
    g = torch.Generator().manual_seed(seed)
    mags = (torch.randperm(n, generator=g) + 1).float() / n
    return mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


# ============================================================================ all new codecs
@pytest.mark.parametrize("name", NEW)
def test_metadata(name):
    c = gradzip.codec(name)
    assert c.collectives == ("allgather",)
    assert c.paper and c.family and type(c).__doc__ and "Wire" in type(c).__doc__
    expected_memory = {"signum": "none", "dgc": "dgc"}.get(name, "residual")
    assert c.default_memory == expected_memory
    assert c.fixed_size == (name in ("onebit", "signum"))
    comm = gradzip.Communicator(name)
    assert comm.memory.name == expected_memory and comm.collective_name == "allgather"
    comm.close()


@pytest.mark.parametrize("name", NEW)
def test_decode_other_ranks_payload_with_own_ctx(name):
    a, b = gradzip.codec(name), gradzip.codec(name)
    mine = a.encode(_randn((1001,), seed=1), name="w", step=3)
    other = b.encode(_randn((1001,), seed=2) * 3, name="w", step=3)
    assert torch.equal(a.decode(Payload(other.tensors, mine.ctx)), b.decode(other))


@pytest.mark.parametrize(
    "name,opts",
    [
        ("onebit", {"bucket_size": 1}),
        ("onebit", {"bucket_size": 7}),
        ("onebit", {"bucket_size": 5000}),
        ("threshold", {"threshold": 0.0}),
        ("threshold", {"threshold": 1.0}),
        ("dgc", {"ratio": 0.3, "sample_ratio": 1.0}),
        ("dgc", {"ratio": 1.0}),
        ("graddrop", {"ratio": 0.5}),
        ("adaq", {"bin_size": 1}),
        ("adaq", {"bin_size": 7, "self_adjust": False}),
        ("adaq", {"bin_size": 300}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 7, 1001, 4099])
def test_wire_bytes_of_option_variants(name, opts, dtype, n):
    c = gradzip.codec(name, **opts)
    x = _randn((n,), dtype, seed=n)
    for step in range(2):  # adaq's second step selects with its kept residual
        p = c.encode(x, name="w", step=step)
        bound = c.wire_bytes(n, dtype)
        if c.fixed_size:
            assert p.nbytes == bound
        else:
            assert p.nbytes <= bound
        y = c.decode(p)
        assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()


@pytest.mark.parametrize(
    "name,opts,expect",
    [
        ("onebit", {"bucket_size": -1}, "non-negative"),
        ("onebit", {"bucket_size": 2.0}, "non-negative"),
        ("signum", {"momentum": 1.0}, r"\[0, 1\)"),
        ("signum", {"momentum": -0.1}, r"\[0, 1\)"),
        ("signum", {"momentum": True}, r"\[0, 1\)"),
        ("threshold", {"threshold": -0.1}, "non-negative"),
        ("threshold", {"threshold": float("nan")}, "non-negative"),
        ("threshold", {"threshold": "0.1"}, "non-negative"),
        ("dgc", {"ratio": 0.0}, r"\(0, 1\]"),
        ("dgc", {"sample_ratio": 0.0}, r"\(0, 1\]"),
        ("dgc", {"sample_ratio": 1.5}, r"\(0, 1\]"),
        ("dgc", {"seed": -1}, "non-negative"),
        ("graddrop", {"ratio": 1.5}, r"\(0, 1\]"),
        ("adaq", {"bin_size": 0}, "1..32767"),
        ("adaq", {"bin_size": 40000}, "1..32767"),
        ("adaq", {"self_adjust": 1}, "True or False"),
    ],
)
def test_bad_options(name, opts, expect):
    with pytest.raises(ValueError, match=expect) as err:
        gradzip.codec(name, **opts)
    assert next(iter(opts)) in str(err.value)


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
def test_sampling_leaves_global_rng_alone(name):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    gradzip.codec(name).encode(_randn((100_000,)), name="w")
    assert torch.equal(torch.rand(3), expected)


# =================================================================================== onebit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_onebit_decodes_to_the_two_means(dtype):
    x = _randn((33, 17), dtype, seed=3)
    x[0, :5] = 0.0  # zero counts as non-negative
    p = gradzip.codec("onebit").encode(x)
    y = gradzip.codec("onebit").decode(p)
    xf = x.float()
    pos, neg = xf >= 0, xf < 0
    mean_pos, mean_neg = xf[pos].mean(), xf[neg].mean()
    torch.testing.assert_close(p.tensors[1], torch.stack([mean_neg, mean_pos]), rtol=1e-6, atol=1e-7)
    sent_neg, sent_pos = p.tensors[1]
    assert torch.equal(y, torch.where(pos, sent_pos, sent_neg).to(dtype))  # exactly the two sent means
    assert len(torch.unique(y)) == 2


def test_onebit_per_bucket_means_and_tail():
    x = _randn((1001,), seed=4)
    y = _round_trip(gradzip.codec("onebit", bucket_size=7), x)
    for b in range(0, 1001, 7):  # the last bucket holds 0 values beyond 1001: its means are its own
        xb, yb = x[b : b + 7], y[b : b + 7]
        for mask in (xb >= 0, xb < 0):
            if mask.any():
                torch.testing.assert_close(yb[mask], xb[mask].mean().expand(int(mask.sum())))
    # one-signed tensors: everything decodes to the mean
    assert torch.allclose(_round_trip(gradzip.codec("onebit"), torch.full((9,), 2.5)), torch.full((9,), 2.5))
    z = torch.arange(1.0, 11.0).neg()
    assert torch.allclose(_round_trip(gradzip.codec("onebit"), z), z.mean().expand(10))
    assert torch.equal(_round_trip(gradzip.codec("onebit"), torch.zeros(9)), torch.zeros(9))


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("shape", [(1, 3 << 18), (3000, 256), (700, 1000), (5, (1 << 18) + 3)], ids=str)
def test_onebit_sums_its_sides_in_one_pass_or_a_piece_at_a_time_with_the_values_of_one_sum(shape, kernels,
                                                                                            monkeypatch):
    """Each side's fp64 row sums and the non-negative counts: on the CPU one C pass, or torch a
    piece of rows (or of a long row) at a time, with no temporary of the tensor's size; the
    means are those of one sum, to fp32 (a NaN stays)."""
    from gradzip.kernels import fused

    monkeypatch.setenv("GRADZIP_KERNELS", kernels)
    xb = _randn(shape, seed=8) * 1e3
    xb[-1, 7] = float("nan")
    want = torch.stack([xb.clamp(max=0).double().sum(dim=1), xb.clamp(min=0).double().sum(dim=1),
                        (xb >= 0).sum(dim=1, dtype=torch.float64)], 1)
    with LargestMade() as made:
        got = fused.side_sums(xb)
    assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    assert bool(got[-1, :2].isnan().all()) and torch.equal(got[:, 2], want[:, 2])  # counts exact
    assert made.numel <= 1 << 18, made.numel
    if kernels == "torch" and shape[1] <= 1 << 18:  # whole rows: the same operation on each row
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


# =================================================================================== signum
def test_signum_momentum_follows_the_formula():
    beta = 0.8
    c = gradzip.codec("signum", momentum=beta)
    g1 = _randn((50,), seed=1)
    g2 = -0.5 * g1 + 0.01 * _randn((50,), seed=2)  # m2 ≈ 0.06 g1: the opposite sign of g2
    p1 = c.encode(g1, name="w")
    m1 = (1 - beta) * g1
    torch.testing.assert_close(c._momentum["w"], m1)
    assert torch.equal(c.decode(p1), torch.where(m1 >= 0, 1.0, -1.0))
    p2 = c.encode(g2, name="w")
    m2 = beta * m1 + (1 - beta) * g2
    torch.testing.assert_close(c._momentum["w"], m2)
    assert torch.equal(c.decode(p2), torch.where(m2 >= 0, 1.0, -1.0))
    assert not torch.equal(torch.sign(m2), torch.sign(g2))  # the momentum, not the gradient, is sent
    # other names keep their own momentum; a new shape starts over
    c.encode(g1, name="b")
    torch.testing.assert_close(c._momentum["b"], m1)
    c.encode(torch.ones(4), name="w")
    torch.testing.assert_close(c._momentum["w"], torch.full((4,), 1 - beta))


def test_signum_state_dict_round_trip():
    c = gradzip.codec("signum")
    for s in range(3):
        c.encode(_randn((40,), seed=s), name="w")
    c2 = gradzip.codec("signum")
    c2.load_state_dict(c.state_dict())
    g = _randn((40,), seed=9)
    assert torch.equal(c2.encode(g, name="w").tensors[0], c.encode(g, name="w").tensors[0])
    assert torch.equal(c2._momentum["w"], c._momentum["w"])
    c2._momentum["w"].add_(1)  # the loaded state is a copy
    assert not torch.equal(c2._momentum["w"], c._momentum["w"])


def test_signum_majority_vote_and_momentum_zero_is_signsgd():
    xs = [_randn((7, 143), seed=s) for s in range(3)]
    c = gradzip.codec("signum")
    payloads = [gradzip.codec("signum").encode(x, name="g") for x in xs]  # one codec per "rank"
    out = c.aggregate(payloads)
    assert torch.equal(out, torch.sign(sum(torch.where(x >= 0, 1.0, -1.0) for x in xs)))
    tie = c.aggregate([c.encode(torch.tensor([1.0, -1.0]), name="t"), gradzip.codec("signum").encode(torch.tensor([-1.0, -3.0]), name="t")])
    assert torch.equal(tie, torch.tensor([0.0, -1.0]))
    s0, plain = gradzip.codec("signum", momentum=0.0), gradzip.codec("signsgd")
    for x in xs:
        assert torch.equal(s0.encode(x, name="w").tensors[0], plain.encode(x, name="w").tensors[0])


def test_signum_nonfinite_gradient_keeps_momentum():
    c = gradzip.codec("signum")
    c.encode(_randn((20,), seed=1), name="w")
    before = c._momentum["w"].clone()
    bad = _randn((20,), seed=2)
    bad[3] = float("nan")
    c.encode(bad, name="w")
    assert torch.equal(c._momentum["w"], before)


def test_signum_updates_its_momentum_in_place_on_the_cpu():
    """On the CPU the momentum is updated where it lies once the step's gradient is known to be
    finite (read on the host), with the bits of ``β·m + (1 − β)·g``: no tensor of the
    gradient's size made; a step with a NaN keeps it (and sends the sign of the would-be one)."""
    beta = 0.9
    c = gradzip.codec("signum", momentum=beta)
    m = torch.zeros(3000)
    for step in range(4):
        g = _randn((3000,), seed=40 + step)
        if step == 2:
            g[5] = float("nan")
        with LargestMade((torch.float32,)) as made:
            p = c.encode(g, name="w", step=step)
        new = torch.add(m * beta, g, alpha=1 - beta)
        assert torch.equal(p.tensors[0], gradzip.codec("signsgd").encode(new.nan_to_num(-1.0)).tensors[0])
        if step != 2:
            m = new
            if step:
                assert made.numel <= 1, made.numel
        assert torch.equal(c._momentum["w"], m), step


# ================================================================================ threshold
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tau", [0.0, 0.01, 0.5, 2.0, 100.0])
def test_threshold_keeps_exactly_the_values_at_or_above(tau, dtype):
    x = _randn((2003,), seed=6).to(dtype)
    x[:3] = torch.tensor([tau, -tau, tau / 2], dtype=dtype)  # ties are kept
    c = gradzip.codec("threshold", threshold=tau)
    p = c.encode(x)
    keep = x.float().abs() >= tau
    assert p.tensors[1].dtype == torch.int32 and p.tensors[0].dtype == dtype
    sparse = int(keep.sum()) * (x.element_size() + 4)
    if sparse <= x.numel() * x.element_size():
        assert torch.equal(p.tensors[1].long(), keep.nonzero().reshape(-1))
        assert p.nbytes == sparse
    else:  # values and indices would exceed the raw size: the kept values densely, no indices
        assert p.tensors[1].numel() == 0 and p.nbytes == x.numel() * x.element_size()
        assert torch.equal(p.tensors[0], torch.where(keep, x, torch.zeros_like(x)))
    y = c.decode(p)
    assert torch.equal(y, torch.where(keep, x, torch.zeros_like(x)))


def test_threshold_aggregate_overlapping_indices():
    c = gradzip.codec("threshold", threshold=1.0)
    a = torch.tensor([4.0, 0.5, 3.0, 0.0])
    b = torch.tensor([2.0, 5.0, 0.2, -1.0])
    out = c.aggregate([c.encode(a), c.encode(b)])
    torch.testing.assert_close(out, torch.tensor([3.0, 2.5, 1.5, -0.5]))


# ====================================================================================== dgc
def test_dgc_keeps_about_ratio_n_on_randn():
    n, ratio = 1 << 20, 0.001
    k = math.ceil(n * ratio)
    c = gradzip.codec("dgc", ratio=ratio)
    x = _randn((n,), seed=7)
    counts = []
    for step in range(10):
        p = c.encode(x, name="w", step=step)
        m = p.tensors[0].numel()
        assert m <= 2 * k and p.nbytes == m * 8 <= c.wire_bytes(n)
        y = c.decode(p)
        kept = y != 0
        assert torch.equal(y[kept], x[kept]) and int(kept.sum()) == m
        if (~kept).any():  # a threshold: nothing dropped is larger than what was kept
            assert x[kept].abs().min() >= x[~kept].abs().max()
        counts.append(m)
    mean = sum(counts) / len(counts)
    assert 0.7 * k <= mean <= 1.5 * k, counts
    assert len(set(counts)) > 1  # the sample, hence the count, changes from step to step


@pytest.mark.parametrize("n", [1, 7, 1001, 4099])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5])
def test_dgc_whole_tensor_sample_is_top_k(n, ratio):
    x = _distinct(n, seed=n)
    k = max(1, min(n, math.ceil(n * ratio)))
    y = _round_trip(gradzip.codec("dgc", ratio=ratio, sample_ratio=1.0), x)
    kept = y != 0
    thr = x.abs().topk(k).values.min()
    assert int(kept.sum()) == k
    assert (x[kept].abs() >= thr).all()
    assert torch.equal(y, _round_trip(gradzip.codec("topk", ratio=ratio), x))


def test_dgc_over_selection_is_cut_to_exact_top_k():
    x = torch.ones(1000)  # every sampled magnitude is 1: the threshold lets everything through
    x[500] = 3.0
    x[17] = -2.0
    p = gradzip.codec("dgc", ratio=0.01).encode(x)
    assert p.tensors[0].numel() == 10  # 1000 > 2k = 20 selected: exact top-k
    y = gradzip.codec("dgc", ratio=0.01).decode(p)
    assert y[500] == 3.0 and y[17] == -2.0 and int((y != 0).sum()) == 10


def test_dgc_seeded_sampling_is_reproducible():
    x = _randn((50_000,), seed=8)
    enc = lambda seed: gradzip.codec("dgc", ratio=0.01, seed=seed).encode(x, name="w").tensors[1]  # noqa: E731
    assert torch.equal(enc(3), enc(3))
    assert not torch.equal(enc(3), enc(4))


# ================================================================================= graddrop
def test_graddrop_keeps_about_ratio_n_without_a_cap():
    n, ratio = 1 << 20, 0.01
    c = gradzip.codec("graddrop", ratio=ratio)
    x = _randn((n,), seed=9)
    counts = []
    for step in range(10):
        p = c.encode(x, name="w", step=step)
        y = c.decode(p)
        kept = y != 0
        assert torch.equal(y[kept], x[kept])
        assert x[kept].abs().min() >= x[~kept].abs().max()
        assert p.nbytes < 4 * n / 10  # measured: far below the raw size
        counts.append(p.tensors[0].numel())
    mean = sum(counts) / len(counts)
    assert 0.85 * ratio * n <= mean <= 1.15 * ratio * n, counts
    assert all(0.5 * ratio * n <= m <= 1.6 * ratio * n for m in counts), counts
    assert len(set(counts)) > 1  # not an exact selection


def test_graddrop_has_no_cap_unlike_dgc():
    x = torch.ones(1000)
    assert gradzip.codec("graddrop", ratio=0.01).encode(x).tensors[0].numel() == 1000
    assert gradzip.codec("dgc", ratio=0.01).encode(x).tensors[0].numel() == 10


def test_graddrop_whole_tensor_sample_is_top_k():
    x = _distinct(4099)
    y = _round_trip(gradzip.codec("graddrop", ratio=0.05, sample_ratio=1.0), x)
    assert torch.equal(y, _round_trip(gradzip.codec("topk", ratio=0.05), x))


def _group(members):
    """A fused group of ``members`` (flat tensors) on blocks of 256 values: (buffer, parts, starts)."""
    parts, starts, at = [], [], 0
    for i, m in enumerate(members):
        parts.append((f"m{i}", tuple(m.shape)))
        starts.append(at)
        at += m.numel() + (-m.numel() % 256)
    flat = torch.zeros(at)
    for a, m in zip(starts, members):
        flat[a : a + m.numel()] = m.reshape(-1)
    return flat, parts, starts


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
def test_a_group_by_parts_samples_each_member_for_its_own_threshold(name):
    """Members 1e60 apart in scale (one threshold for the group would send none of the small
    one) each send about ``ratio`` of their values, over steps as many as alone; a member of
    ties goes over DGC's cap and is cut to its own ``k``, as alone; an empty member is allowed."""
    members = [_randn((4099,), seed=1) * 1e-30, torch.empty(0), _randn((3000,), seed=2) * 1e30,
               torch.ones(1000), _randn((20_000,), seed=3)]
    flat, parts, starts = _group(members)
    c = gradzip.codec(name, ratio=0.02)
    sent = [[], []]
    for step in range(40):
        y = c.decode(c.encode(flat, name="g", step=step, parts=parts))
        assert not y[4099:4352].any()  # the padding: zeros in, nothing sent
        for i, (a, m) in enumerate(zip(starts, members)):
            if m.numel() in (4099, 20_000):
                kept = y[a : a + m.numel()] != 0
                assert torch.equal(y[a : a + m.numel()][kept], m[kept])
                alone = _round_trip(c, m, name=f"m{i}", step=step) != 0
                sent[0].append(int(kept.sum()) / m.numel())
                sent[1].append(int(alone.sum()) / m.numel())
            elif m.numel() == 1000:  # ties: every value reaches the threshold
                assert int((y[a : a + 1000] != 0).sum()) == (20 if name == "dgc" else 1000)
        big = y[starts[2] : starts[2] + 3000]
        assert 0 < int((big != 0).sum()) < 3000
    grouped, alone = sum(sent[0]) / len(sent[0]), sum(sent[1]) / len(sent[1])
    assert 0.01 <= grouped <= 0.12 and 0.7 <= grouped / alone <= 1.4, (grouped, alone)  # (DGC: capped at k)


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
def test_a_group_by_parts_never_sends_its_padding(name):
    """A member whose threshold is 0 (fewer nonzeros than its ``k``) sends its zeros, as alone,
    but never the padding after it; DGC's cap then counts its own values only."""
    sparse_member = torch.zeros(10)
    sparse_member[3] = 1.0
    members = [sparse_member, _randn((3000,), seed=13)]
    flat, parts, starts = _group(members)
    c = gradzip.codec(name, ratio=0.2, sample_ratio=1.0)
    p = c.encode(flat, name="g", parts=parts)
    idx = p.tensors[1].long() if p.tensors[1].numel() else torch.nonzero(p.tensors[0]).reshape(-1)
    assert not ((idx >= 10) & (idx < starts[1])).any()
    alone = c.decode(c.encode(sparse_member, name="m0"))
    assert torch.equal(c.decode(p)[:10], alone)


def test_a_group_by_parts_sampled_whole_sends_each_members_top_k():
    members = [_distinct(1001, seed=4), _distinct(257, seed=5) * 1e-20, _distinct(1, seed=6)]
    flat, parts, starts = _group(members)
    for name in ("dgc", "graddrop"):
        c = gradzip.codec(name, ratio=0.05, sample_ratio=1.0)
        y = c.decode(c.encode(flat, name="g", parts=parts))
        for a, m in zip(starts, members):
            assert torch.equal(y[a : a + m.numel()], _round_trip(gradzip.codec("topk", ratio=0.05), m))


def test_a_top_k_group_selected_at_once_is_each_members_own_k_largest(monkeypatch):
    """The accelerator's way (candidates above a threshold from a fixed sample, one sort by
    member and magnitude) selects each member's own ``k`` largest, ties to the lowest index
    as the radix selects break them, NaN among the largest; where a member's candidates fall
    short of its ``k`` (a sample far off) the members are selected one by one instead."""
    from gradzip.codecs import sparse
    from gradzip.kernels import fused

    def both(members, ratio):
        flat = torch.cat([m.reshape(-1) for m in members])
        parts = [(f"m{i}", tuple(m.shape)) for i, m in enumerate(members)]
        c = gradzip.codec("topk", ratio=ratio)
        monkeypatch.setattr(fused, "groups_at_once", lambda device: False)
        one_by_one = c.encode(flat, name="g", parts=parts)
        monkeypatch.setattr(fused, "groups_at_once", lambda device: True)
        at_once = c.encode(flat, name="g", parts=parts)
        indices = [p.tensors[1].long().sort().values for p in (one_by_one, at_once)]
        grouped = sparse._group_topk(flat, tuple((n, torch.Size(s)) for n, s in parts), ratio)
        return torch.equal(*indices), grouped is not None, c.decode(at_once).nan_to_num(7.0), flat

    ties = [torch.randint(-3, 4, s).float() for s in ((37, 29), (3000,), (5, 7, 61), (100_000,))]
    nan = [_randn((3000,), seed=11), _randn((5000,), seed=12)]
    nan[1][17] = float("nan")
    for members, ratio in [([_randn((37, 29)), torch.empty(0), _randn((3000,)) * 1e-30, _randn((200_000,)), _randn((1,))], 0.01),
                           (ties, 0.05), ([_randn((4096,)), _randn((300,))], 0.5), ([torch.zeros(10), torch.zeros(3)], 0.01),
                           (nan, 0.01)]:
        same, grouped, decoded, flat = both(members, ratio)
        assert same and grouped
    assert decoded[3017] == 7.0  # (the NaN sent, as a member's largest)
    # fp64 magnitudes that fp32 would tie: member by member, as the radix selects tell them apart
    close = [torch.tensor([1 + 2.0**-40, 1 + 2.0**-35, 1 + 2.0**-30], dtype=torch.float64), _randn((50,)).double()]
    same, grouped, _, _ = both(close, 0.5)
    assert same and not grouped
    # a member whose large values are all in the sample: its threshold leaves too few candidates
    plan = sparse._topk_plan((("m0", torch.Size([100_000])),), 0.05, torch.device("cpu"))
    x = torch.rand(100_000)
    x[plan.sample] += 10.0
    same, grouped, _, _ = both([x], 0.05)
    assert same and not grouped


def test_random_k_draws_a_group_at_once_each_members_own_k_in_its_own_range(monkeypatch):
    """The accelerator's way: one draw keyed by the group, every rank alike, each member's ``k``
    indices in its own range (uniform: every value of a small member drawn over the steps), the
    drawn values sent as they are and, with ``scale``, each weighted by its own member's n/k."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: True)
    members = [_randn((37, 29), seed=1), torch.empty(0), _randn((50,), seed=2) * 1e-20, _randn((3000,), seed=3)]
    flat = torch.cat([m.reshape(-1) for m in members])
    parts = [(f"m{i}", tuple(m.shape)) for i, m in enumerate(members)]
    starts = [0, 1073, 1073, 1123]
    seen = torch.zeros(50, dtype=torch.bool)
    for step in range(60):
        a, b = (gradzip.codec("randomk", ratio=0.1, scale=True) for _ in range(2))
        pa, pb = a.encode(flat, name="g", step=step, parts=parts), b.encode(flat, name="g", step=step, parts=parts)
        idx = pa.ctx.extra["indices"]
        assert torch.equal(idx, pb.ctx.extra["indices"]) and torch.equal(pa.tensors[0], flat[idx])
        for (s, m), n_drawn in zip([(starts[0], members[0]), (starts[2], members[2]), (starts[3], members[3])], (108, 5, 300)):
            mine = idx[(idx >= s) & (idx < s + m.numel())]
            assert mine.numel() == n_drawn
        seen[idx[(idx >= 1073) & (idx < 1123)] - 1073] = True
        decoded = a.decode(pa)
        drawn = idx[(idx >= 1073) & (idx < 1123)]
        assert torch.allclose(decoded[drawn], flat[drawn] * 10 * torch.bincount(drawn - 1073, minlength=50)[drawn - 1073])
    assert seen.all()


@pytest.mark.parametrize("name,opts", [("threshold", {"threshold": 2.0}), ("dgc", {"ratio": 0.05}),
                                       ("graddrop", {"ratio": 0.05, "sample_ratio": 1.0})])
def test_selections_taken_a_piece_at_a_time_on_the_cpu_are_the_whole_ones(name, opts, monkeypatch):
    """On the CPU the magnitudes and the mask of a selection are made a piece at a time (not a
    fused group's size): the same payload as in one piece."""
    from gradzip.kernels import fused

    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the C loops make no pieces)

    members = [_randn((3000,), seed=7), _randn((700,), seed=8) * 1e-3, _randn((5000,), seed=9)]
    flat, parts, _ = _group(members)
    whole = gradzip.codec(name, **opts).encode(flat, name="g", parts=None if name == "threshold" else parts)
    monkeypatch.setattr(fused, "TORCH_PIECE", 512)
    pieces = gradzip.codec(name, **opts).encode(flat, name="g", parts=None if name == "threshold" else parts)
    assert all(torch.equal(a, b) for a, b in zip(whole.tensors, pieces.tensors))
    assert 0 < pieces.tensors[0].numel() < flat.numel() // 4


def test_threshold_measured_wire_below_raw_when_tuned():
    x = _randn((1 << 20,), seed=10)
    p = gradzip.codec("threshold", threshold=2.0).encode(x)
    assert p.nbytes < 4 * x.numel() / 5  # ~4.6 % of N(0, 1) reach 2.0


# ===================================================================================== adaq
def _bins(x: torch.Tensor, size: int) -> torch.Tensor:
    pad = (-x.numel()) % size
    return torch.nn.functional.pad(x, (0, pad)).view(-1, size)


@pytest.mark.parametrize("self_adjust", [True, False])
@pytest.mark.parametrize("bin_size,n", [(50, 1 << 16), (7, 1001), (300, 4099), (1, 37)])
def test_adaq_keeps_each_bins_max(bin_size, n, self_adjust):
    x = _distinct(n, seed=bin_size)
    c = gradzip.codec("adaq", bin_size=bin_size, self_adjust=self_adjust)
    p = c.encode(x, name="w")
    y = c.decode(p)
    xb, yb = _bins(x, bin_size), _bins(y, bin_size)
    arg = xb.abs().argmax(dim=1, keepdim=True)
    top = yb.gather(1, arg).reshape(-1)
    assert (top != 0).all()
    assert torch.equal(top > 0, xb.gather(1, arg).reshape(-1) > 0)
    kept = y != 0
    # ternary: ±scale, scale = mean |x| over what was sent, signs kept
    scale = x[kept].abs().mean()
    torch.testing.assert_close(y[kept].abs(), scale.expand(int(kept.sum())))
    assert torch.equal(y[kept] > 0, x[kept] > 0)
    gmax = xb.abs().amax(dim=1, keepdim=True)
    if self_adjust:  # first step: H = G + dW = 2G, so |G| >= g_max / 2 is sent
        expected = (2 * xb.abs() >= gmax) & (xb != 0)
    else:
        expected = xb.abs() >= gmax
    assert torch.equal(yb != 0, expected)


def test_adaq_second_step_selects_on_g_plus_dw():
    c, m = gradzip.codec("adaq", bin_size=10), memory("residual")
    g1, g2 = _randn((1000,), seed=11), _randn((1000,), seed=12)
    inp1 = m.compensate(g1, "w")
    m.update("w", inp1, c.decode(c.encode(inp1, name="w")))
    torch.testing.assert_close(c._residuals["w"], m.residuals["w"])  # the codec's view of the residual
    inp2 = m.compensate(g2, "w")  # G = residual + dW
    y2 = c.decode(c.encode(inp2, name="w"))
    h = inp2 + g2  # H = G + dW
    expected = (_bins(h.abs(), 10) >= _bins(inp2.abs(), 10).amax(1, keepdim=True)) & (_bins(inp2, 10) != 0)
    assert torch.equal(_bins(y2, 10) != 0, expected)


@pytest.mark.parametrize("bin_size", [50, 7, 1500])
def test_adaq_selects_a_piece_of_bins_at_a_time_on_the_cpu(monkeypatch, bin_size):
    """On the CPU the bins are compared a piece of whole bins at a time (a bin longer than a
    piece on its own): over three steps under the residual memory, whose residual it reads, the
    payloads of one pass over the tensor, with no magnitudes, ``H`` or mask of the tensor's size
    made, and no dense tensor of what was sent (the memory keeps the residual)."""
    from gradzip.kernels import fused

    monkeypatch.setenv("GRADZIP_KERNELS", "torch")  # (the torch versions: the C loops make no pieces)

    n = 20011
    gs = [_randn((n,), seed=20 + s) for s in range(3)]

    def run():
        c, m = gradzip.codec("adaq", bin_size=bin_size), memory("residual")
        c.use_memory(m)
        payloads, largest = [], 0
        for step, g in enumerate(gs):
            inp = m.compensate(g, "w")
            with LargestMade((torch.float32, torch.bool)) as made:
                p = c.encode(inp, name="w", step=step)
            largest = max(largest, made.numel)
            m.update("w", inp, c.decode(p))
            payloads.append(p.tensors)
        return payloads, largest

    want, _ = run()
    monkeypatch.setattr(fused, "TORCH_PIECE", 1000)
    got, largest = run()
    assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    sent = max(int(p[1].numel()) for p in got)
    assert largest <= max(bin_size, 1000, sent) < n, largest


def test_adaq_error_feedback_and_state_dict():
    c, m = gradzip.codec("adaq"), memory("residual")
    g = _randn((3000,), seed=13)
    sent = torch.zeros(3000)
    for step in range(15):
        inp = m.compensate(g, "w")
        out = c.decode(c.encode(inp, name="w", step=step))
        m.update("w", inp, out)
        sent += out
    torch.testing.assert_close(sent + m.residuals["w"], 15 * g, rtol=1e-4, atol=1e-3)
    c2 = gradzip.codec("adaq")
    c2.load_state_dict(c.state_dict())
    inp = m.compensate(g, "w")
    assert all(torch.equal(a, b) for a, b in zip(c2.encode(inp, name="w").tensors, c.encode(inp, name="w").tensors))


def test_adaq_zeros_and_nonfinite():
    c = gradzip.codec("adaq")
    p = c.encode(torch.zeros(120), name="z")
    assert p.tensors[1].numel() == 0 and torch.equal(c.decode(p), torch.zeros(120))
    c.encode(_randn((120,)), name="w")
    before = c._residuals["w"].clone()
    bad = _randn((120,), seed=1)
    bad[7] = float("inf")
    c.encode(bad, name="w")
    assert torch.equal(c._residuals["w"], before)


def test_adaq_wire_format_is_compact():
    n = 1 << 20
    c = gradzip.codec("adaq")
    assert c.wire_bytes(n, torch.float32) < 1.2 * n  # < 1.2 bytes per element even if all were sent
    assert c.wire_bytes(n, torch.float16) < 2 * n
    p = c.encode(_randn((n,), seed=14), name="w")
    counts, local, signs, scale = p.tensors
    assert counts.dtype == local.dtype == torch.uint8 and counts.numel() == math.ceil(n / 50)
    assert signs.numel() == math.ceil(local.numel() / 8) and scale.dtype == torch.float32
    assert int(counts.sum()) == local.numel()
    assert gradzip.codec("adaq", bin_size=500).encode(_randn((2000,)), name="w").tensors[1].dtype == torch.int16


# =============================================================================== DGC memory
def test_dgc_memory_factory_and_options():
    m = memory("dgc")
    assert isinstance(m, DGCMemory) and m.momentum == 0.9 and m.clip_norm is None and m.stateful
    m = memory("dgc", momentum=0.5, clip_norm=2.0)
    assert m.momentum == 0.5 and m.clip_norm == 2.0
    for bad in ({"momentum": 1.0}, {"momentum": -0.1}, {"momentum": "0.9"}, {"clip_norm": 0.0}, {"clip_norm": -1.0}, {"clip_norm": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            memory("dgc", **bad)
    with pytest.raises(ValueError, match="unknown option\\(s\\) beta; valid options: clip_norm, momentum"):
        memory("dgc", beta=1.0)
    comm = gradzip.Communicator("dgc", memory_options={"momentum": 0.5})
    assert isinstance(comm.memory, DGCMemory) and comm.memory.momentum == 0.5
    comm.close()


def test_dgc_memory_momentum_correction_and_masking():
    mom = 0.5
    m = memory("dgc", momentum=mom)
    g1, g2, g3 = (_randn((4, 5), seed=s) for s in (1, 2, 3))
    keep = [g.clone() for g in (g1, g2, g3)]

    v1 = m.compensate(g1, "w")  # u = g1, v = g1
    torch.testing.assert_close(v1, g1)
    sent1 = torch.zeros(4, 5, dtype=torch.bool)
    sent1[0] = True
    sent1[2, 3] = True
    m.update("w", v1, torch.where(sent1, v1, torch.zeros_like(v1)))
    u1 = torch.where(sent1, 0.0, g1)
    torch.testing.assert_close(m.momentums["w"], u1)
    torch.testing.assert_close(m.velocities["w"], torch.where(sent1, 0.0, g1))

    v2 = m.compensate(g2, "w")  # u = mom * u1 + g2, v = v1 (masked) + u
    u2 = mom * u1 + g2
    torch.testing.assert_close(v2, torch.where(sent1, 0.0, g1) + u2)
    sent2 = v2.abs() > 1.0
    m.update("w", v2, torch.where(sent2, v2, torch.zeros_like(v2)))
    torch.testing.assert_close(m.momentums["w"], torch.where(sent2, 0.0, u2))
    torch.testing.assert_close(m.velocities["w"], torch.where(sent2, 0.0, v2))

    torch.testing.assert_close(m.compensate(g3, "other"), g3)  # other names are independent
    for g, k in zip((g1, g2, g3), keep):
        assert torch.equal(g, k), "memory modified its input in place"


def test_dgc_memory_skip_keeps_old_state():
    m = memory("dgc")
    g = _randn((6,))
    m.update("w", m.compensate(g, "w"), torch.zeros(6))
    u, v = m.momentums["w"].clone(), m.velocities["w"].clone()
    nan = torch.full((6,), float("nan"))
    m.update("w", m.compensate(nan, "w"), torch.zeros(6), skip=torch.tensor(True))
    assert torch.equal(m.momentums["w"], u) and torch.equal(m.velocities["w"], v)
    # the step after a skip starts from the old state
    torch.testing.assert_close(m.compensate(g, "w"), v + 0.9 * u + g)
    m.update("fresh", m.compensate(nan, "fresh"), torch.zeros(6), skip=torch.tensor(True))
    assert torch.equal(m.momentums["fresh"], torch.zeros(6)) and torch.equal(m.velocities["fresh"], torch.zeros(6))


def test_dgc_memory_takes_a_group_at_once_as_tensor_by_tensor(monkeypatch):
    """On an accelerator a group's momenta and velocities are one buffer each, compensated and
    masked in a few multi-tensor operations: the same values as tensor by tensor, a skipped
    step (the flag on the device) keeps them, a name released leaves the others intact, and a
    checkpoint holds copies."""
    from gradzip.kernels import fused
    from gradzip.sync import memory as memories

    names, shapes = ["a", "b", "c"], [(5, 3), (7,), (2, 2, 2)]
    group, alone = memory("dgc"), memory("dgc")
    for step in range(4):
        gs = [_randn(s, seed=10 * step + i) for i, s in enumerate(shapes)]
        decoded = [torch.where(g.abs() > 1.0, g, torch.zeros(())) for g in gs]
        skip = torch.tensor(step == 2)
        monkeypatch.setattr(fused, "groups_at_once", lambda device: True)
        monkeypatch.setattr(memories, "reads_on_host", lambda flag: False)
        outs = [torch.full((g.numel(),), float("nan")) for g in gs]
        group.compensate_many_into(gs, names, outs)
        group.update_many(names, [o.view(g.shape) for o, g in zip(outs, gs)], decoded, skip=skip)
        monkeypatch.setattr(fused, "groups_at_once", lambda device: False)
        ins = [alone.compensate(g, n) for g, n in zip(gs, names)]
        assert all(torch.equal(o, i.reshape(-1)) for o, i in zip(outs, ins))
        alone.update_many(names, ins, decoded, skip=skip)
        for store in ("momentums", "velocities"):
            assert all(torch.equal(getattr(group, store)[n], getattr(alone, store)[n]) for n in names)
    assert group.momentums["a"]._base is group.momentums["c"]._base is not None  # one buffer
    saved = group.state_dict()
    assert saved["velocities"]["a"].data_ptr() != group.velocities["a"].data_ptr()
    owed = group.release("b")
    assert torch.equal(owed, alone.velocities["b"]) and "b" not in group.momentums
    assert torch.equal(group.velocities["c"], alone.velocities["c"])


def test_dgc_memory_keeps_a_loaded_state_through_a_step_skipped_by_a_device_flag(monkeypatch):
    """A state loaded from a checkpoint may lie elsewhere than the gradient (on the CPU, the
    gradient on a GPU): a skipped step whose flag stays on the device keeps it, as the host's
    reading of the flag does. (fp64 states stand in for another device: both make the state one
    the update cannot write into where it lies.)"""
    from gradzip.sync import memory as memories

    saved = {"momentums": {"w": torch.full((4,), 2.0, dtype=torch.float64)},
             "velocities": {"w": torch.full((4,), 3.0, dtype=torch.float64)}}
    for on_host in (True, False):
        monkeypatch.setattr(memories, "reads_on_host", lambda flag, on_host=on_host: on_host)
        mem = memory("dgc")
        mem.load_state_dict(saved)
        inp = mem.compensate(torch.ones(4), "w")
        mem.update("w", inp, torch.zeros(4), skip=torch.tensor(True))
        assert mem.momentums["w"].tolist() == [2.0] * 4 and mem.velocities["w"].tolist() == [3.0] * 4, on_host


def test_dgc_memory_settles_in_place_with_no_tensor_of_the_gradients_size_made():
    """In a fused group's buffer (the CPU's path, tensor by tensor), compensation makes only
    this step's momentum, which the update masks in place and keeps; the velocity is masked
    straight into the old one: the same values as :meth:`compensate` and a fresh update."""
    from tests.tensors import LargestMade

    n, names = 1000, ["w"]
    fused_mem, plain = memory("dgc", momentum=0.5), memory("dgc", momentum=0.5)
    for step in range(4):
        g = _randn((n,), seed=step)
        out = torch.full((n,), float("nan"))
        with LargestMade(dtypes=(torch.float32,)) as made:
            fused_mem.compensate_many_into([g], names, [out])
        v = plain.compensate(g, "w")
        assert torch.equal(out, v)
        if step:  # (the first step's states are new)
            assert made.nbytes == n * 4, made.nbytes  # this step's u alone
        decoded = torch.where(v.abs() > 1.0, v, torch.zeros(()))
        skip = torch.tensor(step == 2)
        with LargestMade(dtypes=(torch.float32,)) as made:
            fused_mem.update_many(names, [out], [decoded], skip=skip)
        plain.update("w", v, decoded, skip=skip)
        if step:
            assert made.numel <= 1, made.numel  # (a zero to mask with)
        for store in ("momentums", "velocities"):
            assert torch.equal(getattr(fused_mem, store)["w"], getattr(plain, store)["w"]), (step, store)
    torch.testing.assert_close(plain.velocities["w"], torch.where(decoded != 0, 0.0, v))


def test_dgc_memory_sums_and_masks_the_velocity_a_piece_at_a_time(monkeypatch):
    """On the CPU the update's ``v ← 0 where sent, else v + u`` goes a piece of
    :data:`fused.TORCH_PIECE` values at a time (one pass; the sum's temporary a piece long):
    both states are those of the formula over the whole tensor, bit for bit, a skipped step
    included."""
    from gradzip.kernels import fused
    from tests.tensors import LargestMade

    monkeypatch.setattr(fused, "TORCH_PIECE", 300)
    n, m = 1000, memory("dgc", momentum=0.5)
    u_want = v_want = torch.zeros(n)
    for step in range(4):
        g = _randn((n,), seed=10 + step)
        v = m.compensate(g, "w")
        decoded = torch.where(v.abs() > 1.0, v, torch.zeros(()))
        with LargestMade(dtypes=(torch.float32,)) as made:
            m.update("w", v, decoded, skip=torch.tensor(step == 2))
        if step:  # (the first step's velocity is new)
            assert made.numel <= 300, made.numel
        if step != 2:
            u = torch.add(g, u_want, alpha=0.5)
            sent = decoded != 0
            u_want, v_want = u.masked_fill(sent, 0.0), (v_want + u).masked_fill(sent, 0.0)
        assert torch.equal(m.momentums["w"], u_want) and torch.equal(m.velocities["w"], v_want), step


def test_dgc_memory_clipping():
    m = memory("dgc", clip_norm=1.0)
    big = torch.tensor([3.0, 4.0])  # norm 5: scaled to norm 1
    torch.testing.assert_close(m.compensate(big, "a"), big / 5, rtol=1e-5, atol=1e-6)
    small = torch.tensor([0.3, 0.4])  # norm 0.5: untouched
    torch.testing.assert_close(m.compensate(small, "b"), small)


def test_dgc_memory_does_not_alias_input_and_state_dict():
    m = memory("dgc")
    g = _randn((8,))
    keep = g.clone()
    v = m.compensate(g, "w")
    v.mul_(3)  # a codec writing into its input must not reach the gradient or the momentum
    assert torch.equal(g, keep)
    m.update("w", v, torch.zeros(8))
    torch.testing.assert_close(m.momentums["w"], g)
    m2 = memory("dgc")
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.compensate(g, "w"), m.compensate(g, "w"))
    m2.momentums["w"].add_(1)
    assert not torch.equal(m2.momentums["w"], m.momentums["w"])


def test_dgc_without_momentum_loses_nothing():
    """momentum = 0: v is plain residual accumulation, so sent + v is the sum of gradients."""
    c, m = gradzip.codec("dgc", ratio=0.05), memory("dgc", momentum=0.0)
    g = _randn((400,), seed=15)
    sent = torch.zeros(400)
    for step in range(30):
        inp = m.compensate(g, "w")
        out = c.decode(c.encode(inp, name="w", step=step))
        m.update("w", inp, out)
        sent += out
    torch.testing.assert_close(sent + m.velocities["w"], 30 * g, rtol=1e-4, atol=1e-4)


def test_dgc_communicator_single_process():
    comm = gradzip.Communicator("dgc", ratio=0.01)
    x = _randn((100, 50), seed=16)
    y = comm.allreduce(x, name="w")
    assert y.shape == x.shape and 0 < int((y != 0).sum()) <= 100
    assert isinstance(comm.memory, DGCMemory) and "w" in comm.memory.velocities
    comm.close()


@pytest.mark.parametrize("dtype,votes", [(torch.bfloat16, 257), (torch.float16, 2049)])
def test_signsgd_counts_its_vote_exactly_into_a_16_bit_destination(dtype, votes):
    """``aggregate_into`` a 16-bit ``out`` (a reduce-scatter's, in the input's dtype): one more
    '+' than '-' vote still gives +1 where the 16-bit count would round the tie away."""
    c = gradzip.codec("signsgd")
    plus, minus = c.encode(torch.ones(8, dtype=dtype), "w", 0), c.encode(-torch.ones(8, dtype=dtype), "w", 0)
    payloads = [plus] * votes + [minus] * (votes - 1)
    out = torch.zeros(8, dtype=dtype)
    assert torch.equal(c.aggregate_into(payloads, out), torch.ones(8, dtype=dtype))
    assert torch.equal(c.aggregate(payloads), torch.ones(8, dtype=dtype))
    fp32 = torch.zeros(8)
    assert c.aggregate_into(payloads, fp32) is fp32 and torch.equal(fp32, torch.ones(8))


@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_topk_flags_a_nonfinite_input_from_the_values_it_sends(monkeypatch, dtype, at_once):
    """A NaN or ±inf has the largest magnitude, so a selection holds every one of them (or
    nothing finite): the values sent are the non-finite flag, alone, in a group, in the dense
    form, with more non-finite values than a member sends."""
    from gradzip.kernels import fused

    monkeypatch.setattr(fused, "groups_at_once", lambda device: at_once)
    codec = gradzip.codec("topk", ratio=0.01)
    parts = [("a", (10_000,)), ("b", (100,)), ("c", (20_000,))]
    for where, bad, flat in with_nonfinite(30_100, dtype, (None, 5, 10_050, 25_000, "many")):  # (many: over a's k)
        assert bool(codec.nonfinite(codec.encode(flat, "g", parts=parts))) == (where is not None), (where, bad)
        assert bool(codec.nonfinite(codec.encode(flat[10_100:], "c"))) == (where == 25_000), (where, bad)
    dense = gradzip.codec("topk", ratio=0.9).encode(torch.tensor([1.0, float("nan"), 2.0], dtype=dtype))
    assert not dense.tensors[1].numel() and bool(codec.nonfinite(dense))


@pytest.mark.parametrize("name,options", [
    ("topk", {"ratio": 0.01}), ("threshold", {"threshold": 2.0}), ("threshold", {"threshold": 0.0}),
    ("dgc", {}), ("graddrop", {}),
], ids=["topk", "threshold", "threshold-dense", "dgc", "graddrop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_sparse_average_is_summed_into_out_with_the_bits_of_aggregate(name, options, dtype):
    """Every rank's values and indices added into the flat fp32 ``out`` in rank order and
    divided there: the bits of :meth:`aggregate`, a NaN sent by one rank included, and for an
    fp32 gradient no float tensor made but the indices' widening (a selection's length, not the
    group's). A dense payload (every value selected) is added whole."""
    codec = gradzip.codec(name, **options)
    n = 40_000
    xs = [_randn(n, seed=r).to(dtype) for r in range(3)]
    xs[1][123] = float("nan")
    payloads = [codec.encode(x, "g", 5) for x in xs]
    want = codec.aggregate(payloads).float()
    out = torch.full((n,), 7.0)
    with LargestMade(dtypes=(torch.float32, torch.float16)) as made:
        got = codec.aggregate_into(payloads, out)
    assert got is out and torch.equal(out.nan_to_num(9.0), want.nan_to_num(9.0))
    assert bool(out[123].isnan()) == bool(want[123].isnan())
    if dtype == torch.float32:
        assert made.numel == 0, made.numel
        total = codec.aggregate_into(payloads, torch.empty(n), mean=False)  # the sum, unscaled
        assert torch.equal(total.div_(3).nan_to_num(9.0), want.nan_to_num(9.0))


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,opts", [("topk", {"ratio": 0.01}), ("topk", {"ratio": 0.6}),
                                       ("threshold", {"threshold": 0.0}), ("dgc", {}), ("graddrop", {"ratio": 0.5})],
                         ids=["topk", "topk-dense", "threshold-dense", "dgc", "graddrop"])
def test_a_16_bit_gradients_fp32_compensation_sends_its_values_in_16_bits(name, opts, wire):
    """An fp32 input that compensates a 16-bit gradient (``wire``: error feedback's fp32
    residual added) sends its selected values, and its dense form, in the gradient's width: no
    more bytes than the raw 16-bit gradient; a value beyond fp16's range goes as its largest,
    a NaN as NaN (the flag); decoded, each value is its 16-bit rounding."""
    x = _randn((4096,), seed=3) * 100
    x[7], x[8] = 1e6, float("nan")
    c = gradzip.codec(name, **opts)
    p = c.encode(x, "w", 0, wire=wire)
    values, idx = p.tensors
    assert values.dtype == wire
    assert sum(t.numel() * t.element_size() for t in p.tensors) <= x.numel() * wire.itemsize
    if name == "topk" and wire == torch.float16:  # the largest magnitudes: the huge value and the NaN among them
        sent = values if idx.numel() == 0 else torch.zeros(x.numel(), dtype=wire).index_copy_(0, idx.long(), values)
        assert sent[7] == torch.finfo(torch.float16).max and sent[8].isnan()
    flag = c.nonfinite(p)  # (None: the engine reads the input for it)
    assert flag is None or bool(flag)
    got = c.decode(p)
    assert got.dtype == torch.float32
    kept = got.nan_to_num(7.0) != 0
    assert torch.equal(got.nan_to_num(7.0)[kept], gradzip.codecs.base.saturate(x, wire).float().nan_to_num(7.0)[kept])


def _group_of(lengths, block, seed=5):
    """A fused group's buffer and parts: members of ``lengths`` values, each on a block."""
    parts, x = [], []
    for i, n in enumerate(lengths):
        parts.append((f"m{i}", (n,)))
        x += [_randn((n,), seed=seed + i), torch.zeros(-(-n // block) * block - n)]
    return torch.cat(x), parts


# (codec, options, values, a fused group's member lengths or None): each case sends values as
# they are in some form (a drawn sample, a dense form, a raw tensor or member) that it would send
# as fp32 values without the wire dtype
AS_THEY_ARE = {
    "randomk": ("randomk", {"ratio": 0.6}, 4096, None),
    "randomk-group": ("randomk", {"ratio": 0.6}, 0, [4000, 10, 300]),
    "adacomp-dense": ("adaq", {"bin_size": 1}, 4096, None),
    "sketchml-dense": ("sketchml", {"ratio": 0.99}, 4096, None),
    "sketchml-raw-member": ("sketchml", {}, 0, [4000, 10]),
    "sketchml-sparse-raw": ("sketchml", {"ratio": 0.99}, 0, [4000, 4000]),
    "inceptionn-dense": ("inceptionn", {"error_bound": 1e-30}, 4096, None),
    "none": ("none", {}, 4096, None),
    "maxmin-raw": ("maxmin", {"bits": 8}, 3, None),
}


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(AS_THEY_ARE))
def test_every_form_that_sends_values_as_they_are_takes_a_16_bit_gradients_width(case, wire):
    """Values a codec sends as they are (random-k's sample, AdaComp's, SketchML's and
    INCEPTIONN's dense forms, SketchML's members sent raw, a tensor too small for its format)
    go in a 16-bit gradient's width where its fp32 compensation is encoded: no more bytes than
    the raw 16-bit gradient, fewer than without the wire dtype, and each decoded value is the
    one without it, its 16-bit rounding, or the input's where the narrower width makes a form
    as it is the smaller (a value beyond fp16's range as its largest, a NaN as NaN)."""
    name, opts, n, lengths = AS_THEY_ARE[case]
    plain, narrow = gradzip.codec(name, **opts), gradzip.codec(name, **opts)  # (each its own draws and state)
    parts = None
    if lengths is None:
        x = _randn((n,), seed=3) * 100
    else:
        x, parts = _group_of(lengths, plain.fused_alignment())
        n = sum(lengths)
    x[1] = 1e6
    if name not in ("inceptionn", "adaq"):  # (those two: NaN is their dense form's trigger too; see test_fuzz)
        x[2] = float("nan")
    before = plain.encode(x, "w", 0, parts=parts)
    after = narrow.encode(x, "w", 0, parts=parts, wire=wire)
    assert after.nbytes <= n * wire.itemsize + (x.numel() - n) * wire.itemsize, (after.nbytes, n)
    assert after.nbytes < before.nbytes, (after.nbytes, before.nbytes)
    was, got = plain.decode(before), narrow.decode(after)
    assert got.dtype == torch.float32 and got.shape == x.shape
    rounded = gradzip.codecs.base.saturate(was, wire).float()
    dense = gradzip.codecs.base.saturate(x, wire).float()  # (a form as it is that 16 bits make the smaller)
    same = (got == was) | (got == rounded) | (got == dense) | (got.isnan() & (was.isnan() | x.isnan()))
    assert bool(same.all()), (got[~same][:5], was[~same][:5])
    assert bool(((got == rounded) | (got == dense)).any() & (got != was).any())  # (some value went in 16 bits)


def test_scaled_random_k_goes_without_error_feedback():
    """``scale=True`` makes random-k unbiased by sending each drawn value ``numel/k`` times: the
    residual error feedback keeps would be ``-(numel/k - 1)`` times it and grow at every draw
    (to 1e5 in 20 steps), so that pair is refused at construction and its default memory is none."""
    from gradzip.sync.engine import check_settings

    assert gradzip.codec("randomk", scale=True).default_memory == "none"
    assert gradzip.codec("randomk").default_memory == "residual"
    check_settings("randomk", {"scale": True})
    check_settings("randomk", {"scale": True}, memory="none")
    check_settings("randomk", {}, memory="residual")
    for memory in ("residual", "dgc"):
        with pytest.raises(ValueError, match="scale=True cannot take memory"):
            check_settings("randomk", {"scale": True}, memory=memory)
