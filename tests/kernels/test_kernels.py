"""Unit tests of the vectorised kernels: bit packing, shared generators, bucketing."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.kernels import (
    bucket_view,
    pack_bits,
    packed_bytes,
    pad_to_multiple,
    private_generator,
    shared_generator,
    stable_hash,
    unpack_bits,
)

FIXED_SIZES = [0, 1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1001, 4096]


def _levels(n: int, bits: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


# ------------------------------------------------------------------------------------- bitpack
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", FIXED_SIZES)
def test_pack_unpack_round_trip_fixed_sizes(bits, n):
    levels = _levels(n, bits, seed=n * 10 + bits)
    packed = pack_bits(levels, bits)
    assert packed.dtype == torch.uint8
    assert packed.dim() == 1
    assert packed.numel() == packed_bytes(n, bits)
    out = unpack_bits(packed, bits, n)
    assert out.dtype == torch.uint8
    assert torch.equal(out, levels)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip_hypothesis(bits, n, seed):
    levels = _levels(n, bits, seed)
    packed = pack_bits(levels, bits)
    assert packed.numel() == packed_bytes(n, bits)
    assert torch.equal(unpack_bits(packed, bits, n), levels)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_extreme_values(bits):
    """All-zero and all-max levels survive (catches lost high bits / sign extension)."""
    for n in (1, 7, 9, 1001):
        for fill in (0, (1 << bits) - 1):
            levels = torch.full((n,), fill, dtype=torch.uint8)
            assert torch.equal(unpack_bits(pack_bits(levels, bits), bits, n), levels)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_pack_is_dense(bits):
    """Eight values of ``bits`` bits take exactly ``bits`` bytes; bits=1 packs LSB-first per byte."""
    assert packed_bytes(8, bits) == bits
    assert packed_bytes(800, bits) == 100 * bits
    assert packed_bytes(0, bits) == 0
    if bits == 1:
        levels = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
        assert pack_bits(levels, 1).tolist() == [0b10000001]


def test_pack_non_contiguous_input():
    base = _levels(64, 3, seed=5)
    view = base[::2]  # strided
    assert not view.is_contiguous()
    packed = pack_bits(view, 3)
    assert torch.equal(unpack_bits(packed, 3, view.numel()), view.contiguous())


@pytest.mark.parametrize("bits", [0, 9, -1])
def test_pack_bad_bits(bits):
    with pytest.raises(ValueError, match="1..8"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="1..8"):
        unpack_bits(torch.zeros(8, dtype=torch.uint8), bits, 8)


# ----------------------------------------------------------------------------------------- rng
def _draw(g: torch.Generator, n: int = 16) -> torch.Tensor:
    return torch.randint(0, 1 << 30, (n,), generator=g)


def test_shared_generator_same_key_same_stream():
    a = _draw(shared_generator(3, 7, "fc.weight"))
    b = _draw(shared_generator(3, 7, "fc.weight"))
    assert torch.equal(a, b)


def test_shared_generator_different_keys_differ():
    base = _draw(shared_generator(3, 7, "fc.weight"))
    for other in [(3, 7, "fc.bias"), (3, 8, "fc.weight"), (4, 7, "fc.weight"), (3, 0, "fc.weight")]:
        assert not torch.equal(base, _draw(shared_generator(*other))), other


def test_shared_generator_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    _draw(shared_generator(0, 0, "x"))
    assert torch.equal(torch.rand(4), expected)


def test_stable_hash_is_deterministic_and_distinguishes():
    assert stable_hash(0, 1, "a") == stable_hash(0, 1, "a")
    assert stable_hash(0, 1, "a") != stable_hash(0, 1, "b")
    assert stable_hash(0, 1, "a") != stable_hash(0, 2, "a")


def test_private_generator_seeded():
    assert torch.equal(_draw(private_generator(1)), _draw(private_generator(1)))
    assert not torch.equal(_draw(private_generator(1)), _draw(private_generator(2)))


# ------------------------------------------------------------------------------------- buckets
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), bucket=st.integers(1, 70), seed=st.integers(0, 1000))
def test_bucket_view_padding_keeps_min_max(n, bucket, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    b = bucket_view(x, bucket)
    nb = -(-n // bucket)
    assert b.shape == (nb, bucket)
    assert torch.equal(b.reshape(-1)[:n], x)
    lo, hi = torch.aminmax(b, dim=1)
    for i in range(nb):
        chunk = x[i * bucket : (i + 1) * bucket]
        assert lo[i] == chunk.min() and hi[i] == chunk.max()


def test_pad_to_multiple_edge_cases():
    x = torch.arange(6.0)
    assert pad_to_multiple(x, 3) is x  # nothing to pad: no copy
    assert pad_to_multiple(x, 4).tolist() == [0, 1, 2, 3, 4, 5, 5, 5]
    empty = torch.empty(0)
    assert pad_to_multiple(empty, 4).numel() == 0
    assert bucket_view(torch.arange(5.0), 1).shape == (5, 1)
