"""The pipeline's order of stages: fixed by the jobs' arrivals and what their stages yield, never by timing."""
from __future__ import annotations

import torch

from gradzip.sync.pipeline import Pipeline


def _job(name: str, log: list, marks: list):
    """Stages that log themselves and yield ``marks`` in turn; returns its name."""
    for i, mark in enumerate(marks):
        log.append(f"{name}{i + 1}")
        yield mark
    log.append(f"{name}{len(marks) + 1}")
    return name


def _fail(what, exc, seconds):
    return RuntimeError(what)


def test_each_arrival_advances_the_new_job_then_every_older_one_by_a_stage():
    log: list = []
    pipe = Pipeline(_fail)
    futures = [torch.futures.Future() for _ in range(3)]
    for name, fut in zip("abc", futures):
        pipe.arrive(_job(name, log, [None, None]), fut, name, flush=name == "c")
    assert log == ["a1", "b1", "a2", "c1", "a3", "b2", "b3", "c2", "c3"]  # older jobs oldest first
    assert [f.value() for f in futures] == ["a", "b", "c"]
