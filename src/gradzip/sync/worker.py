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
import weakref
from typing import Any, Callable, Optional

import torch


class OrderedWorker:
    """Runs submitted callables one at a time, in order, on a daemon thread."""

    def __init__(self, name: str = "gradzip-comm", device: Optional[torch.device] = None) -> None:
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._device = device if device is not None and device.type == "cuda" else None
        # CUDA: the side stream every job's kernels and collectives are queued on
        self._stream = torch.cuda.Stream(self._device) if self._device is not None else None
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
        so far queued on the side stream (nothing on the CPU).

        A job's future orders its waiters after the side stream only where its value holds
        CUDA tensors (PyTorch records the future's events for the devices of the tensors it
        holds): a job that returns None, or a CPU future completed from another's callback,
        orders nothing. Whatever combines such futures calls this before handing its result on.
        """
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def close(self, timeout: float = 60.0) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=timeout)
        if self._stream is not None and not self._thread.is_alive():
            # the jobs' kernels and collectives finish before their process groups may go
            self._stream.synchronize()
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
