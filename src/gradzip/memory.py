"""Error feedback: what a lossy codec did not send this step is added to the next step's input.

``compensate`` turns the gradient into the codec's input, ``update`` stores
``input - decoded own payload`` as the residual. State is keyed by parameter name (DDP rebuilds
its buckets after the first iteration, so bucket indices are not stable).

Non-finite policy: when a step's gradient holds NaN or Inf on any rank, the collective reports it
to every rank and every rank leaves its residual unchanged for that step, so one bad batch (for
example an fp16 overflow that a GradScaler will skip) never poisons the memory.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .naming import Registry


class Memory:
    """No error feedback: the codec sees the raw gradient."""

    name = "none"

    def compensate(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return t

    def update(self, name: str, compensated: torch.Tensor, decoded: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        """Record what was lost; ``skip`` is a 0-dim bool tensor: when True, keep the old state."""

    @property
    def stateful(self) -> bool:
        return False

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ResidualMemory(Memory):
    """Residual error feedback: ``input = beta * residual + gamma * grad``.

    As in GRACE's residual memory (Xu et al., ICDCS'21) and 1-bit SGD (Seide et al., 2014). The
    residual is kept in fp32 whatever the gradient's dtype, so small remainders of fp16/bf16
    gradients are not rounded away.
    """

    name = "residual"

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        for key, value in (("beta", beta), ("gamma", gamma)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"memory {self.name!r}: {key} must be a number, got {value!r}")
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.residuals: Dict[str, torch.Tensor] = {}

    @property
    def stateful(self) -> bool:
        return True

    def compensate(self, t: torch.Tensor, name: str) -> torch.Tensor:
        x = t.float()
        if self.gamma != 1.0:
            x = x * self.gamma
        res = self.residuals.get(name)
        if res is None or res.shape != t.shape or res.device != t.device:
            return x
        return torch.add(x, res, alpha=self.beta)  # a new tensor: the caller's gradient stays as it was

    def update(self, name: str, compensated: torch.Tensor, decoded: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        new = compensated.float() - decoded.float()
        if skip is not None:
            old = self.residuals.get(name)
            keep = old if old is not None and old.shape == new.shape else torch.zeros_like(new)
            new = torch.where(skip, keep, new)
        self.residuals[name] = new

    def state_dict(self) -> Dict[str, Any]:
        return {"residuals": {k: v.cpu() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(beta={self.beta}, gamma={self.gamma})"


class EFSignMemory(ResidualMemory):
    """EF-signSGD's error feedback (Karimireddy et al., ICML'19): the residual memory with
    ``beta = gamma = 1``; the learning rate is applied by the optimizer after decoding."""

    name = "efsign"

    def __init__(self) -> None:
        super().__init__(1.0, 1.0)


class PowerSGDMemory(ResidualMemory):
    """PowerSGD's error feedback (Vogels et al., NeurIPS'19): the residual memory with
    ``beta = gamma = 1``, kept for the full matrix."""

    name = "powersgd"

    def __init__(self) -> None:
        super().__init__(1.0, 1.0)


_MEMORIES: Registry[Memory] = Registry("memory", "memories")
for _cls in (Memory, ResidualMemory, EFSignMemory, PowerSGDMemory):
    _MEMORIES.add(_cls)
register_memory = _MEMORIES.add
names = _MEMORIES.names


def memory(kind: "str | Memory | None" = "none", **opts: Any) -> Memory:
    """Build a memory by name (``none``, ``residual``, ``efsign``, ``powersgd``)."""
    if isinstance(kind, Memory):
        if opts:
            raise ValueError("options cannot be given together with a Memory instance")
        return kind
    if kind is None:
        kind = "none"
    cls = _MEMORIES.get(kind)
    try:
        return cls(**opts)
    except TypeError:
        valid = {"residual": "beta, gamma"}.get(kind, "(none)")
        raise ValueError(f"memory {kind!r}: invalid options {sorted(opts)}; valid options: {valid}") from None
