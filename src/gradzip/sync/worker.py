"""One ordered communication thread per process group.

DDP calls the comm hook for buckets in the same order on every rank, but anything launched from
completion callbacks runs in an order that differs per rank, and with several buckets in flight
that mismatches collectives (gloo: "Received data size doesn't match expected size"). gradzip
instead hands every job to a single thread with a FIFO queue: jobs run — encode, collectives,
decode — strictly in submission order, so every rank issues the same collectives in the same
order, while the caller (backward) keeps computing. This is CaSync's pipelining made safe.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch


class OrderedWorker:
    """Runs submitted callables one at a time, in order, on a daemon thread."""

    def __init__(self, name: str = "gradzip-comm", device: Optional[torch.device] = None) -> None:
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._device = device if device is not None and device.type == "cuda" else None
        # CUDA: the side stream every job's kernels and collectives are queued on, and the one
        # that futures combining several jobs complete on (see complete_after_jobs)
        self._stream = torch.cuda.Stream(self._device) if self._device is not None else None
        self._join = torch.cuda.Stream(self._device) if self._device is not None else None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        # Stop the thread before the interpreter finalises: CPython ends a daemon thread that is
        # still alive then with pthread_exit, and unwinding through C++ frames (a gloo call)
        # aborts the process ("terminate called without an active exception").
        _LIVE.add(self)

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``fn``; the returned future completes with its result (or its exception).

        Called from the worker itself (a callback chained on one of its futures), ``fn`` runs at
        once: that is its place in the order, and queueing it would wait on itself forever.
        """
        if threading.current_thread() is self._thread:
            fut = torch.futures.Future()
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
            return fut
        if not self._thread.is_alive():
            raise RuntimeError("the gradzip communication worker has been closed")
        if self._device is not None:
            fut = torch.futures.Future(devices=[self._device])
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))  # inputs are complete here
        else:
            fut = torch.futures.Future()
            ready = None
        self._queue.put((fn, fut, ready))
        return fut

    def order_after_jobs(self) -> None:
        """Make the calling thread's current CUDA stream wait for everything the jobs that ran
        so far queued on the side stream (nothing on the CPU)."""
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def complete_after_jobs(self, fut: torch.futures.Future, value: Any) -> None:
        """Complete ``fut`` with ``value`` so that its waiters are ordered after everything the
        jobs that ran so far queued on the side stream, and after the calling thread's current
        stream.

        A job's future orders its waiters after the side stream only where its value holds
        CUDA tensors (PyTorch records a future's events on the current stream, for the devices
        of the tensors its value holds): a job that returns None orders nothing, nor does a
        future whose callback runs on the thread that adds it (it was complete already), on
        that thread's stream. The events are recorded on a stream of the worker's own, which
        waits for both: made to wait on the side stream itself, the calling thread's stream
        (backward's, for a callback run where it was added) would stall until the codec work
        was done."""
        if self._join is None:
            fut.set_result(value)
            return
        self._join.wait_stream(torch.cuda.current_stream(self._device))
        self._join.wait_stream(self._stream)
        with torch.cuda.stream(self._join):
            fut.set_result(value)

    def close(self, timeout: float = 60.0) -> None:
        """Let the queued jobs finish and stop the thread; on CUDA, then wait for the jobs'
        kernels and collectives (all within ``timeout`` seconds), which must finish before
        their process groups are destroyed."""
        deadline = time.monotonic() + timeout
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=timeout)
        if self._stream is not None and not self._thread.is_alive():
            try:  # (polled: a collective that hangs on the device must not hold the process)
                while not self._stream.query() and time.monotonic() < deadline:
                    time.sleep(0.001)
            except RuntimeError:  # a device error: the job that met it has already said so
                pass
        _LIVE.discard(self)

    def _loop(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut, ready = item
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(ready)
                        result = fn()
                        fut.set_result(result)
                else:
                    fut.set_result(fn())
            except BaseException as exc:  # hand every failure to the waiting caller
                fut.set_exception(exc)


_LIVE: "weakref.WeakSet[OrderedWorker]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Let every worker finish its queue and stop (a job stuck in a collective gets 10 s)."""
    for worker in list(_LIVE):
        worker.close(timeout=10.0)
