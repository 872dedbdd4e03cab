"""The engine's choices that differ on an accelerator, in one place.

On the CPU a kernel call costs next to nothing and reading a device flag is free; on a GPU a
launch costs more than a pass over a small gradient, and reading a flag on the host waits until
the device's queue has run dry. The engine asks these predicates, by this module's names, where
its paths part; a test takes the accelerator's paths on the CPU by replacing them here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def multi_tensor(device: torch.device) -> bool:
    """Whether a fused group's gradients are gathered with multi-tensor operations (one launch
    for many gradients, then the residual added in one more pass) rather than one fused pass
    per gradient: on accelerators, where a launch costs more than a pass over a small gradient."""
    return device.type != "cpu"


def reads_flag_on_host(device: torch.device) -> bool:
    """Whether the agreed non-finite flag of an exchange on ``device`` is read on the host: free
    on the CPU; on an accelerator it would wait until the device's queue has run dry."""
    return device.type == "cpu"


def collectives_queue_on_stream(group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """Whether ``group``'s collectives on ``device``'s tensors run on NCCL, which queues them
    on the device's stream instead of blocking the thread that waits for them."""
    if device.type != "cuda" or not (dist.is_available() and dist.is_initialized()):
        return False
    backend = str(dist.get_backend(group))
    return backend == "nccl" or "cuda:nccl" in backend
