"""Stages: an exchange cut where it waits for the wire.

A collective's exchange is a generator that yields each time it has issued asynchronous
collectives and would next wait for them; it returns its result. Whoever drives it decides what
runs in between (:class:`gradzip.sync.pipeline.Pipeline` encodes and decodes other groups).
"""
from __future__ import annotations

import inspect
from typing import Any, Generator, List, Sequence

Stages = Generator[None, None, Any]


def lockstep(parts: Sequence[Stages]) -> Generator[None, None, List[Any]]:
    """Run several stage generators side by side: stage 1 of each, then stage 2 of each, ...;
    their return values in order. (One bucket's uncompressed and compressed exchanges.)"""
    results: List[Any] = [None] * len(parts)
    live = list(range(len(parts)))
    while live:
        for i in list(live):
            try:
                next(parts[i])
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
        if live:
            yield
    return results


def drive(stages: Any) -> Any:
    """Run a generator of stages (or a plain value: already done) to its end; its return value."""
    if not inspect.isgenerator(stages):
        return stages
    while True:
        try:
            next(stages)
        except StopIteration as stop:
            return stop.value


def staged(stages: Any) -> Stages:
    """``yield from staged(x)``: the stages of ``x`` if it is a generator, else ``x`` at once."""
    if inspect.isgenerator(stages):
        return (yield from stages)
    return stages
