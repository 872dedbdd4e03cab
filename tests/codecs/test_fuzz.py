"""Property-based fuzzing of every registered codec on extreme input (hypothesis).

Every codec of ``gradzip.codecs.names()`` (plus option sets whose formats differ) meets shapes of
one to three dimensions (empty, one element, odd sizes), fp32/fp16/bf16 input and values chosen
to break arithmetic: zeros, constants, ±the dtype's maximum, subnormals, mixes of huge and tiny
magnitudes, and NaN/±inf. The properties:

- encode, decode and aggregate never raise; decode keeps the input's shape and dtype, aggregate
  its shape and dtype;
- finite input decodes to finite values (the one documented exception: PowerSGD's fp32 factors
  overflow for entries above about ``3.4e38 / max(n, m)``);
- a payload never takes more bytes than the raw tensor nor than ``wire_bytes``, and a fixed-size
  codec's payload takes exactly ``wire_bytes``.

Examples are derandomised (the same ones on every run) so CI is stable.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.codecs import Payload
from gradzip.codecs.base import raw_bytes

FLT_MAX = torch.finfo(torch.float32).max
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# every codec with its defaults, plus option sets whose wire format or arithmetic differs
CONFIGS: List[Tuple[str, Dict[str, Any]]] = [(n, {}) for n in gradzip.codecs.names()]
CONFIGS += [
    ("maxmin", {"bits": 1, "bucket_size": 8}),
    ("maxmin", {"bits": 8, "bucket_size": 1, "mode": "nearest"}),
    ("maxmin", {"bits": 3, "bucket_size": 7}),
    ("fp8", {"format": "e5m2", "block_size": 3}),
    ("fp8", {"format": "e4m3", "block_size": 1}),
    ("mxfp4", {"block_size": 64}),
    ("qsgd", {"bits": 2, "bucket_size": 1}),
    ("qsgd", {"bits": 8, "bucket_size": 8}),
    ("terngrad", {"bucket_size": 3}),
    ("cl_terngrad", {"bucket_size": 5}),
    ("u8bit", {"bucket_size": 0}),
    ("onebit", {"bucket_size": 3}),
    ("cl_onebit", {"bucket_size": 3}),
    ("efsignsgd", {}),
    ("signum", {"momentum": 0.0}),
    ("topk", {"ratio": 1.0}),
    ("topk", {"ratio": 0.5}),
    ("randomk", {"ratio": 0.5, "scale": True}),
    ("threshold", {"threshold": 0.0}),
    ("threshold", {"threshold": 1e30}),
    ("dgc", {"ratio": 1.0, "sample_ratio": 1.0}),
    ("graddrop", {"ratio": 0.5}),
    ("adaq", {"bin_size": 1}),
    ("adaq", {"bin_size": 300, "self_adjust": False}),
    ("inceptionn", {"error_bound": 1e-30}),
    ("inceptionn", {"error_bound": 1e30}),
    ("tbq", {"threshold": 1e-30}),
    ("sketchml", {"ratio": 0.3}),
    ("sketchml", {"buckets": 2}),
    ("powersgd", {"rank": 1}),
]
CONFIG_IDS = [n + "".join(f"-{k}{v}" for k, v in o.items()) for n, o in CONFIGS]
WORLD = 3  # payloads per aggregate

KINDS = ["zeros", "constant", "extreme", "subnormal", "mix", "randn", "nonfinite"]


def _values(kind: str, shape: Tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``kind`` values, made in fp64 and cast (finite kinds stay finite in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    n = math.prod(shape)
    big, tiny = float(info.max), float(info.smallest_normal)
    sub = tiny * 2.0**-6 if dtype != torch.bfloat16 else tiny * 2.0**-3  # a subnormal of dtype
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, big, -big, big / 2, -big / 3, tiny, -tiny, sub, -sub, 1e-3, 7.0],
                        dtype=torch.float64)
    if kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "constant":
        x = pool[torch.randint(len(pool), (1,), generator=g)].expand(n).clone()
    elif kind == "extreme":  # only ±max, ±max/2 and zeros: the worst case for sums and ranges
        x = pool[torch.tensor([0, 4, 5, 6, 7])[torch.randint(5, (n,), generator=g)]]
    elif kind == "subnormal":
        x = torch.randint(-64, 65, (n,), generator=g).double() * sub
    elif kind == "mix":  # huge and tiny magnitudes in one tensor
        exp = torch.empty(n, dtype=torch.float64).uniform_(math.log10(tiny) - 2, math.log10(big), generator=g)
        x = torch.randn(n, generator=g, dtype=torch.float64).sign() * 10.0**exp
    elif kind == "randn":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    else:  # nonfinite: special values with some NaN and ±inf
        x = pool[torch.randint(len(pool), (n,), generator=g)]
        if n:
            x[torch.randint(n, (1 + n // 4,), generator=g)] = float("nan")
            x[torch.randint(n, (1 + n // 8,), generator=g)] = float("inf")
            x[torch.randint(n, (1 + n // 8,), generator=g)] = -float("inf")
    if kind != "nonfinite":
        x = x.clamp(-big, big)  # fp64 → dtype rounding must not overflow
    return x.to(dtype).reshape(shape)


def _finite_expected(name: str, opts: Dict[str, Any], x: torch.Tensor) -> bool:
    """Whether the codec promises finite output for ``x`` (finite input; see the docstring)."""
    if not bool(torch.isfinite(x).all()):
        return False
    if name == "powersgd" and x.dim() >= 2 and x.numel():
        n, m = x.shape[0], x.numel() // x.shape[0]
        return float(x.float().abs().max()) * max(n, m) < FLT_MAX / 4
    return True


shapes = st.lists(st.integers(0, 11), min_size=1, max_size=3).map(tuple).filter(lambda s: math.prod(s) <= 700)


@pytest.mark.parametrize("name,opts", CONFIGS, ids=CONFIG_IDS)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.one_of(st.sampled_from([(0,), (1,), (1, 1), (2, 0, 3), (7,), (5, 3), (3, 1, 5)]), shapes),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
)
def test_codec_survives_extreme_input(name, opts, shape, dtype, kind, seed):
    c = gradzip.codec(name, **opts)
    xs = [_values(kind, shape, dtype, seed + r) for r in range(WORLD)]
    x = xs[0]
    numel = x.numel()
    raw = raw_bytes(numel, dtype)
    wire = c.wire_bytes(numel, dtype, shape=shape)
    assert wire <= raw

    before = x.clone()
    payloads = [c.encode(t, name="w", step=0) for t in xs]
    assert torch.equal(x.nan_to_num(), before.nan_to_num()), "encode modified its input"
    for p in payloads:
        assert p.nbytes <= raw, (p.nbytes, raw)
        assert p.nbytes <= wire, (p.nbytes, wire)
        if c.fixed_size and name != "powersgd":
            assert p.nbytes == wire

    p = payloads[0]
    if name == "powersgd" and p.ctx.extra.get("round") == 1:  # the second round's factor too
        q = c.next_round(p, [p.tensors[0].clone()])
        assert p.nbytes + q.nbytes <= wire
        c.next_round(q, [q.tensors[0].clone()])
        y = c.decode(Payload([q.tensors[0].clone()], q.ctx))
    else:
        y = c.decode(p)
    assert y.shape == x.shape and y.dtype == dtype
    if _finite_expected(name, opts, x):
        assert bool(torch.isfinite(y).all()), (y.reshape(-1)[:8], x.reshape(-1)[:8])

    if name == "powersgd":  # two all-reduce rounds, no aggregate of whole payloads
        return
    agg = c.aggregate([Payload(q.tensors, p.ctx) for q in payloads])  # decoded with rank 0's context
    assert agg.shape == x.shape and agg.dtype == dtype
    # the average sums W decodes in fp32 before dividing: finite where that sum cannot overflow
    largest = max(float(t.float().abs().max()) for t in xs) if numel else 0.0
    if all(_finite_expected(name, opts, t) for t in xs) and largest * WORLD < FLT_MAX:
        assert bool(torch.isfinite(agg).all())
