"""Stages: an exchange cut where it waits for the wire.

A collective's exchange is a generator that yields each time it has issued asynchronous
collectives and would next wait for them; it returns its result. Whoever drives it decides what
runs in between (:class:`gradzip.sync.pipeline.Pipeline` encodes and decodes other groups).

Several exchanges advanced side by side (:func:`lockstep`: a bucket's groups) yield :data:`PART`
between one exchange's share of a stage and the next's: the stage is not over, but a driver may
run another job's work there, so that one bucket's groups are encoded between another's decodes
and fewer groups hold their payloads at once. A plain ``yield`` (None) ends a stage.
"""
from __future__ import annotations

import inspect
from typing import Any, Generator, List, Sequence

Stages = Generator[Any, None, Any]

PART = "part"  # yielded inside a stage, between the shares of the exchanges advanced side by side


def lockstep(parts: Sequence[Stages]) -> Generator[Any, None, List[Any]]:
    """Run several stage generators side by side: stage 1 of each, then stage 2 of each, ...;
    their return values in order. (One bucket's uncompressed and compressed exchanges.) Between
    one generator's share of a stage and the next one's it yields :data:`PART`, and passes on
    the ones its generators yield."""
    results: List[Any] = [None] * len(parts)
    live = list(range(len(parts)))
    while live:
        for k, i in enumerate(list(live)):
            if k:
                yield PART
            while True:
                try:
                    if next(parts[i]) is not PART:
                        break
                except StopIteration as stop:
                    results[i] = stop.value
                    live.remove(i)
                    break
                yield PART
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
