"""Places: the uncompressed gradients of a bucket gathered, zeroed and scattered back at once."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from gradzip.sync.places import Places


@st.composite
def _layouts(draw):
    """A bucket cut into gradients (some empty), and which of them are the places."""
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=30))
    chosen = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    long_run = draw(st.sampled_from([1, 16, 1 << 16]))
    return sizes, chosen, long_run


@settings(max_examples=200, deadline=None)
@given(_layouts(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_gather_fill_scatter_match_the_gradients_one_by_one(layout, dtype):
    sizes, chosen, long_run = layout
    flat = torch.randn(sum(sizes)).to(dtype)
    where, offset = [], 0
    for n in sizes:
        where.append((offset, n))
        offset += n
    places = [w for w, c in zip(where, chosen) if c]
    p = Places(places, flat.device, long_run=long_run)
    assert p.numel == sum(n for _, n in places)

    packed = p.gather(flat, torch.empty(p.numel, dtype=dtype))
    # the packed values are the places' values (in the packing's own order)
    expected = torch.cat([flat[s : s + n] for s, n in places]) if places else flat[:0]
    assert torch.equal(packed.sort().values, expected.sort().values)

    filled = p.fill_(flat.clone(), 0)
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    for s, n in places:
        mask[s : s + n] = True
    assert torch.equal(filled[~mask], flat[~mask]) and not filled[mask].any()

    # what is scattered back lands where it was gathered from
    assert torch.equal(p.scatter_(filled, packed), flat)
    doubled = p.scatter_(flat.clone(), packed * 2)
    assert torch.equal(doubled[mask], flat[mask] * 2) and torch.equal(doubled[~mask], flat[~mask])


def test_adjacent_places_merge_and_long_runs_move_as_slices():
    p = Places([(0, 4), (4, 4), (10, 100), (200, 3)], torch.device("cpu"), long_run=50)
    assert p.long == [(10, 100, 0)]  # one slice for the long run, first in the packed values
    assert p.index.tolist() == list(range(8)) + [200, 201, 202]  # one index for the short ones, merged
    assert Places([], torch.device("cpu")).index is None
