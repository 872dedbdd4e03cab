"""Small host-to-device copies that do not wait.

A copy from pageable host memory to a GPU waits on the host until the stream's queued work is
done, which stalls the thread that queues the next kernels; from pinned memory it does not.
"""
from __future__ import annotations

from typing import Sequence

import torch


def ints_on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``; to a GPU through pinned memory, without a
    host wait (PyTorch keeps the pinned block until the copy has run)."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
