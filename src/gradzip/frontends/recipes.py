"""Glue for training frameworks that wrap the model in DDP themselves: Accelerate, the Hugging
Face Trainer, Ray Train (Lightning has its own strategy: :mod:`gradzip.frontends.lightning`).

Each of them builds the ``DistributedDataParallel`` model for you, so gradzip must be registered
on *their* DDP model, after they have wrapped it and before the first backward. None of these
frameworks is imported here: the functions only look at the objects they are given.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .ddp import GradzipState, _compiled_module, register

__all__ = [  # noqa: F822 (GradzipCallback is built on first use)
    "GradzipCallback", "find_ddp", "register_accelerate", "register_prepared", "register_trainer",
]


def find_ddp(model: Any) -> Optional[DistributedDataParallel]:
    """The DDP model inside ``model``'s wrappers (``torch.compile``'s ``_orig_mod``), or None."""
    model = _compiled_module(model)
    return model if isinstance(model, DistributedDataParallel) else None


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def register_prepared(model: Any, codec: Optional[str] = None, **options: Any) -> Optional[GradzipState]:
    """Register gradzip on a model a framework has prepared (e.g. ``ray.train.torch.prepare_model``).

    Returns the state, or None in a single process, where nothing is exchanged and frameworks
    leave the model unwrapped. Several processes without a DDP model (FSDP, DeepSpeed, ...)
    raise: silently training uncompressed is the failure this guards against.
    """
    ddp = find_ddp(model)
    if ddp is not None:
        return register(ddp, codec, **options)
    if _world_size() > 1:
        raise ValueError(
            f"gradzip needs a DistributedDataParallel model, got {type(model).__name__} in a job of "
            f"{_world_size()} processes (FSDP and DeepSpeed wrap the model in something else)"
        )
    return None


def register_accelerate(
    accelerator: Any, model: Any, codec: Optional[str] = None, **options: Any
) -> Optional[GradzipState]:
    """Register gradzip on the model ``accelerator.prepare`` returned; None in one process.

    ``model, opt, data = accelerator.prepare(model, opt, data)`` then
    ``state = register_accelerate(accelerator, model, "maxmin", bits=4)``.
    """
    if find_ddp(model) is None and accelerator.num_processes > 1:
        raise ValueError(
            f"gradzip needs the model that accelerator.prepare() returned (a DistributedDataParallel), got "
            f"{type(model).__name__} with {accelerator.num_processes} processes "
            f"(distributed_type={accelerator.distributed_type})"
        )
    return register_prepared(model, codec, **options)


class _CallbackMixin:
    """Hugging Face Trainer callback: registers gradzip on the Trainer's DDP model.

    The Trainer wraps the model in DDP inside ``train()`` (``trainer.model_wrapped``), and a
    callback's ``on_train_begin`` only receives the unwrapped model; so the callback holds the
    Trainer: ``trainer.add_callback(GradzipCallback(trainer, "maxmin", bits=4))``, or
    :func:`register_trainer`. The state is ``callback.state`` once training has begun.
    """

    def __init__(self, trainer: Any, codec: Optional[str] = None, **options: Any) -> None:
        self.trainer = trainer
        self.codec = codec
        self.options = options
        self.state: Optional[GradzipState] = None
        self._ddp: Optional[DistributedDataParallel] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = find_ddp(self.trainer.model_wrapped)
        if ddp is not None and ddp is self._ddp:  # train() again on the same DDP model: the hook stays
            return
        if self.state is not None:
            self.state.close()
        self.state = register_prepared(self.trainer.model_wrapped, self.codec, **self.options)
        self._ddp = ddp


_CALLBACK: Optional[type] = None


def __getattr__(attr: str) -> Any:
    """``GradzipCallback`` is built on ``transformers.TrainerCallback`` at first use, so that
    importing this module does not import transformers."""
    global _CALLBACK
    if attr != "GradzipCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    if _CALLBACK is None:
        from transformers import TrainerCallback

        _CALLBACK = type("GradzipCallback", (_CallbackMixin, TrainerCallback), {
            "__module__": __name__, "__qualname__": "GradzipCallback", "__doc__": _CallbackMixin.__doc__,
        })
    return _CALLBACK


def register_trainer(trainer: Any, codec: Optional[str] = None, **options: Any) -> Any:
    """Add a :class:`GradzipCallback` to a Hugging Face ``Trainer`` and return it; its
    ``.state`` is the :class:`GradzipState` once ``trainer.train()`` has begun."""
    callback = __getattr__("GradzipCallback")(trainer, codec, **options)
    trainer.add_callback(callback)
    return callback
