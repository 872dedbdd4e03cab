"""CaSync's pipeline: the encode of one bucket overlaps the transfer of another.

A job (the exchange of one DDP bucket) is a generator of *stages*: it yields each time it has
issued asynchronous collectives and would next wait for them (see
:meth:`gradzip.comm.base.Collective.stages`). The :class:`Pipeline` keeps several jobs in
flight on the ordered worker thread. When a job arrives, its first stage runs (encode, issue the
scatter), then every older job advances by one stage, oldest first (reduce and issue the
all-gather; then decode). So while bucket k's payloads are on the wire, bucket k+1 is encoded
and bucket k−1 decoded (Bai et al., HiPress, SOSP'21).

The order in which collectives are issued depends only on the sequence of jobs and on which of
them flush (the last bucket of a backward pass drains the pipeline), never on timing, so every
rank issues the same collectives in the same order, the rule that keeps gloo and NCCL matched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, Sequence

import torch

from ..comm.stages import Stages, drive, lockstep, staged  # noqa: F401  (re-exported for the engine)


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
        """Start a job: its first stage, then one stage of every older job; all of them to the
        end when ``flush``. ``future`` completes with the job's return value."""
        job = _Job(stages, future, what)
        older = list(self._jobs)
        self._jobs.append(job)
        self._advance(job)
        for other in older:
            self._advance(other)
        if flush:
            self.drain()

    def drain(self) -> None:
        """Advance every job in flight, a stage each in turn, until all have finished."""
        while self._jobs:
            for job in list(self._jobs):
                self._advance(job)

    def _advance(self, job: _Job) -> None:
        if job not in self._jobs:
            return
        try:
            next(job.stages)
        except StopIteration as stop:
            self._jobs.remove(job)
            job.future.set_result(stop.value)
        except Exception as exc:
            failure = self._on_failure(job.what, exc, time.monotonic() - job.start)
            jobs, self._jobs = self._jobs, []
            for other in jobs:
                if not other.future.done():
                    other.future.set_exception(failure)
            raise failure from exc
