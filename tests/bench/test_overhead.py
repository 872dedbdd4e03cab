"""``gradzip bench overhead``'s timing: methods measured in turns (the end-to-end runs are in
tests/tools/test_cli.py)."""
from __future__ import annotations

import torch

from gradzip.bench.overhead import _interleaved


def test_methods_are_timed_in_rotating_turns_of_two_steps():
    order = []
    built = [(name, None, None, (lambda name=name: order.append(name))) for name in ("fp32", "a", "b")]
    times = _interleaved(built, torch.device("cpu"), 5)
    assert {k: len(v) for k, v in times.items()} == {"fp32": 5, "a": 5, "b": 5}
    assert all(t >= 0 for v in times.values() for t in v)
    # turns of two steps (one in the last), and each turn starts with the next method
    assert order[:6] == ["fp32", "fp32", "a", "a", "b", "b"]
    assert order[6:12] == ["a", "a", "b", "b", "fp32", "fp32"]
    assert order[12:] == ["b", "fp32", "a"]
