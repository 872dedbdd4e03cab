"""``gradzip bench overhead``'s timing: methods measured in turns (the end-to-end runs are in
tests/tools/test_cli.py)."""
from __future__ import annotations

import torch

from gradzip.bench.overhead import _interleaved, _paired_overhead, _per_turn


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


def test_the_overhead_turn_by_turn_takes_the_differences_within_each_turn():
    # the machine slows down by 10 ms halfway: the steps' medians mix that in, the turns do not
    fp32 = [0.030, 0.030, 0.030, 0.030, 0.040, 0.040, 0.040, 0.040]
    hook = [0.031, 0.031, 0.032, 0.032, 0.041, 0.041, 0.042, 0.042]
    mid, q1, q3 = _paired_overhead(hook, fp32)
    assert abs(mid - 0.0015) < 1e-9 and abs(q1 - 0.001) < 1e-9 and abs(q3 - 0.002) < 1e-9
    assert _per_turn([mid, q1, q3]) == "+1.5 (+1.0…+2.0)"
    assert _paired_overhead(hook[:2], fp32[:2]) is None  # one turn: no spread to tell
    assert _per_turn(None) == "-"
