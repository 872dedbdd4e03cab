"""The pipeline's order of stages: fixed by the jobs' arrivals and what their stages yield, never by timing."""
from __future__ import annotations

import torch

from gradzip.sync.pipeline import PART, Pipeline, drive, lockstep


def _job(name: str, log: list, marks: list):
    """Stages that log themselves and yield ``marks`` in turn; returns its name."""
    for i, mark in enumerate(marks):
        log.append(f"{name}{i + 1}")
        yield mark
    log.append(f"{name}{len(marks) + 1}")
    return name


def _fail(what, exc, seconds):
    return RuntimeError(what)


def test_each_arrival_advances_every_older_job_by_a_stage_then_starts_the_new_one():
    log: list = []
    pipe = Pipeline(_fail)
    futures = [torch.futures.Future() for _ in range(3)]
    for name, fut in zip("abc", futures):
        pipe.arrive(_job(name, log, [None, None]), fut, name, flush=name == "c")
    assert log == ["a1", "a2", "b1", "a3", "b2", "c1", "b3", "c2", "c3"]  # older jobs oldest first
    assert [f.value() for f in futures] == ["a", "b", "c"]


def test_the_parts_of_a_stage_take_turns_with_the_other_jobs_parts():
    """A stage in parts (one group's share each) is interleaved with the other jobs' parts: the
    older job's first group, the new job's first, the older's second, ...; a job whose stage has
    fewer parts waits for the next stage until every job has ended this one."""
    log: list = []
    pipe = Pipeline(_fail)
    futures = [torch.futures.Future() for _ in range(2)]
    pipe.arrive(_job("a", log, [PART, PART, None, PART, PART, None]), futures[0], "a", flush=False)
    assert log == ["a1", "a2", "a3"]
    pipe.arrive(_job("b", log, [PART, None, None]), futures[1], "b", flush=True)
    assert log == ["a1", "a2", "a3", "a4", "b1", "a5", "b2", "a6", "a7", "b3", "b4"]
    assert [f.value() for f in futures] == ["a", "b"]


def test_lockstep_marks_each_share_of_a_stage_and_passes_nested_parts_on():
    """lockstep's generators advance a stage each in turn, with PART between their shares (and
    the PARTs they yield themselves passed on); a stage ends with None; drive runs it through."""
    def gen(name, log, stages):
        for i in range(stages):
            log.append(f"{name}{i + 1}")
            yield
        return name

    log: list = []
    steps = list(lockstep([gen("x", log, 2), lockstep([gen("y", log, 1), gen("z", log, 2)]), gen("w", log, 1)]))
    assert steps == [PART, PART, PART, None, PART, PART, PART, None, PART]  # (the last: x ended, then the rest)
    assert log == ["x1", "y1", "z1", "w1", "x2", "z2"]
    log.clear()
    assert drive(lockstep([gen("x", log, 2), gen("y", log, 1)])) == ["x", "y"]
    assert log == ["x1", "y1", "x2"]
