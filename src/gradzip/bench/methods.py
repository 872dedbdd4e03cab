"""The methods the demo and the benchmarks compare, by name: plain fp32 DDP, gradzip's codecs and
PyTorch's own communication hooks."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

# config name -> (codec, keyword arguments of gradzip.register); None means plain fp32 DDP.
CONFIGS: Dict[str, Optional[Tuple[str, Dict[str, Any]]]] = {
    "fp32": None,
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "maxmin4": ("maxmin", {"bits": 4, "memory": "residual"}),
    "maxmin2": ("maxmin", {"bits": 2, "memory": "residual"}),
    "qsgd4": ("qsgd", {"bits": 4}),
    "topk": ("topk", {"ratio": 0.01}),
    "randomk": ("randomk", {"ratio": 0.01}),
    "powersgd": ("powersgd", {"rank": 2}),
    "efsignsgd": ("efsignsgd", {}),
    "terngrad": ("terngrad", {}),
    "natural": ("natural", {}),
    "u8bit": ("u8bit", {}),
    "inceptionn": ("inceptionn", {}),
    "tbq": ("tbq", {"threshold": 0.001}),
    "onebit": ("onebit", {}),
    "signsgd": ("signsgd", {}),
    "signum": ("signum", {}),
    "threshold": ("threshold", {"threshold": 0.001}),
    "dgc": ("dgc", {"ratio": 0.01}),
    "graddrop": ("graddrop", {"ratio": 0.01}),
    "adaq": ("adaq", {}),
    "sketchml": ("sketchml", {}),
    "fp8": ("fp8", {}),
    "mxfp8": ("mxfp8", {}),
    "mxfp4": ("mxfp4", {}),
    "maxmin4-ps": ("maxmin", {"bits": 4, "memory": "residual", "collective": "ps"}),
    "maxmin4-adaptive": ("maxmin", {"bits": 4, "memory": "residual", "adaptive": "bytes"}),  # per-layer bits
    "auto": ("auto", {}),  # maxmin4 where the calibrated cost model says it pays, plain fp32 elsewhere
    "torch-fp16": ("torch:fp16_compress_hook", {}),  # PyTorch's own hooks, the baselines to beat
    "torch-powersgd": ("torch:powerSGD_hook", {"rank": 2}),
}
# Optimizer settings a method needs to work at all, applied on top of --lr/--momentum: sign
# methods send ±1 per element, so the step is lr per element (a far smaller lr, and Signum keeps
# its own momentum); DGC's momentum correction *is* the momentum, so the optimizer must not add
# another (with both, training diverges).
OPTIMIZER_OVERRIDES: Dict[str, Dict[str, float]] = {
    "signsgd": {"lr": 0.002, "momentum": 0.0},
    "signum": {"lr": 0.002, "momentum": 0.0},
    "dgc": {"momentum": 0.0},
}


def describe(name: str) -> str:
    """A config as text: ``maxmin bits=4 memory=residual``."""
    spec = CONFIGS[name]
    if spec is None:
        return "DDP all-reduce"
    codec, opts = spec
    if codec.startswith("torch:"):
        return f"PyTorch {codec[len('torch:'):]}"
    optim = OPTIMIZER_OVERRIDES.get(name, {})
    sgd = [f"(SGD {' '.join(f'{k}={v:g}' for k, v in optim.items())})"] if optim else []
    return " ".join([codec] + [f"{k}={v}" for k, v in opts.items()] + sgd)


def attach(ddp: Any, name: str, group: Optional[dist.ProcessGroup] = None, start_powersgd_iter: int = 2) -> Any:
    """Put method ``name`` (a :data:`CONFIGS` key) on the DDP model: nothing for fp32 DDP,
    PyTorch's hook (on ``group``, the DDP model's process group), or ``gradzip.register``.
    Returns gradzip's state, or None. PyTorch's PowerSGD hook starts compressing at
    ``start_powersgd_iter`` (its default: 10)."""
    spec = CONFIGS[name]
    if spec is None:
        return None
    codec, opts = spec
    if codec == "torch:powerSGD_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        hook_state = psgd.PowerSGDState(group, matrix_approximation_rank=opts["rank"], start_powerSGD_iter=start_powersgd_iter)
        ddp.register_comm_hook(hook_state, psgd.powerSGD_hook)
        return None
    if codec.startswith("torch:"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(group, getattr(default_hooks, codec[len("torch:"):]))
        return None
    import gradzip

    return gradzip.register(ddp, codec, **opts)


def rank_group(device: "str | torch.device", world: int) -> Optional[dist.ProcessGroup]:
    """A spawned rank's exchange on ``device``: on a GPU the rank's device made current and, for a
    job of one rank, an NCCL group of its own (NCCL takes one rank per GPU; ranks sharing a GPU
    exchange CUDA tensors over the default gloo group: None)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    torch.cuda.set_device(dev)
    return dist.new_group([0], backend="nccl") if world == 1 else None
