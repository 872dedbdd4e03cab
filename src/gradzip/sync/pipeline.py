"""CaSync's pipeline: the encode of one bucket overlaps the transfer of another.

A job (the exchange of one DDP bucket) is a generator of *stages*: it yields each time it has
issued asynchronous collectives and would next wait for them (see
:meth:`gradzip.comm.base.Collective.stages`). The :class:`Pipeline` keeps several jobs in
flight on the ordered worker thread. When a job arrives, every job in flight advances by one
stage, oldest first (reduce and issue the all-gather; decode), and the new job runs its first
(encode, issue the scatter). So while bucket k's payloads are on the wire, bucket k+1 is encoded
and bucket k−1 decoded (Bai et al., HiPress, SOSP'21).

A stage of a job of several groups comes in parts (one group's share each: the stages yield
:data:`~gradzip.comm.stages.PART` between them), and the jobs advanced together take turns part
by part: bucket k−1's first group is decoded, then bucket k's first group encoded, then the
second of each, and so on. A group's payload buffers go back to the pool as soon as it is
decoded, and the next group takes them, so one bucket's groups hold payloads at a time, where
running one job's stage to its end before the next one's held two buckets' (the peak of a step,
as backward ends). The wire's queue does not run dry: the group waited for was issued a whole
bucket earlier, and the rest of its bucket is queued behind it.

The order in which collectives are issued depends only on the sequence of jobs and on which of
them flush (the last bucket of a backward pass drains the pipeline), never on timing, so every
rank issues the same collectives in the same order, the rule that keeps gloo and NCCL matched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List

import torch

from ..comm.stages import PART, Stages, drive, lockstep, staged  # noqa: F401  (re-exported for the engine)


@dataclass
class _Job:
    stages: Stages
    future: torch.futures.Future
    what: str
    start: float = field(default_factory=time.monotonic)


class Pipeline:
    """Staged jobs in flight, advanced in a fixed order; used only from the worker thread.

    ``on_failure(what, exc, seconds)`` turns a stage's exception into the error every job in
    flight then fails with (their collectives may already be mismatched).
    """

    def __init__(self, on_failure: Callable[[str, BaseException, float], BaseException]) -> None:
        self._jobs: List[_Job] = []
        self._on_failure = on_failure

    def __len__(self) -> int:
        return len(self._jobs)

    def arrive(self, stages: Stages, future: torch.futures.Future, what: str, flush: bool) -> None:
        """Start a job: one stage of every older job, oldest first, and the new job's first, part
        by part in turn; all of them to the end when ``flush``. ``future`` completes with the
        job's return value."""
        self._jobs.append(_Job(stages, future, what))
        self._stage(list(self._jobs))  # (oldest first: the new job last)
        if flush:
            self.drain()

    def drain(self) -> None:
        """Advance every job in flight, a stage each in turn, until all have finished."""
        while self._jobs:
            self._stage(list(self._jobs))

    def _stage(self, jobs: List[_Job]) -> None:
        """One stage of each of ``jobs``, their parts taking turns in that order."""
        while jobs:
            jobs = [job for job in jobs if self._advance(job)]

    def _advance(self, job: _Job) -> bool:
        """One part of ``job``'s stage; whether the stage has more parts."""
        if job not in self._jobs:
            return False
        try:
            return next(job.stages) is PART
        except StopIteration as stop:
            self._jobs.remove(job)
            job.future.set_result(stop.value)
            return False
        except Exception as exc:
            failure = self._on_failure(job.what, exc, time.monotonic() - job.start)
            jobs, self._jobs = self._jobs, []
            for other in jobs:
                if not other.future.done():
                    other.future.set_exception(failure)
            raise failure from exc
