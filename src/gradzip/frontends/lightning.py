"""Lightning: a DDP strategy that compresses gradients with gradzip, on CPU and GPU alike.

``Trainer(strategy=GradzipDDPStrategy("maxmin", bits=4))``. Lightning's own ``DDPStrategy``
registers ``ddp_comm_hook`` only when the device is CUDA: given gradzip's hook on CPU it trains
without error and without compression. This strategy calls :func:`gradzip.register` on the DDP
model itself, whatever the device, and keeps the returned state as ``strategy.gradzip``.

``import gradzip`` does not import this module; importing it needs ``lightning`` (or, failing
that, ``pytorch_lightning``). ``GradzipPLDDPStrategy`` is the same strategy built on
``pytorch_lightning`` for a ``pytorch_lightning.Trainer`` when both packages are installed.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

__all__ = ["GradzipDDPStrategy", "GradzipPLDDPStrategy"]  # noqa: F822 (built on first use)

_BUILT: Dict[str, type] = {}


def _build(package: str, name: str) -> type:
    """The strategy class on ``package``'s ``DDPStrategy`` (a Trainer accepts only its own)."""
    if package in _BUILT:
        return _BUILT[package]
    strategies = importlib.import_module(f"{package}.strategies")
    base = strategies.DDPStrategy

    def __init__(self, codec: Optional[str] = None, *, gradzip_options: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        """``codec`` and the options of :func:`gradzip.register` (``bits``, ``memory``,
        ``collective``, ``min_numel``, ``timeout``, ...); the keywords DDPStrategy knows
        (``find_unused_parameters``, ``static_graph``, ``start_method``, ...) go to it.
        ``timeout`` is DDPStrategy's, the process group's, which gradzip inherits; a timeout for
        gradzip alone is ``gradzip_options={"timeout": 60}``."""
        given = [k for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper") if kwargs.get(k) is not None]
        if given:
            raise ValueError(f"{name} registers gradzip's hook itself: pass no {', '.join(given)}")
        ddp_keys = set(_ddp_keywords(base))
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in ddp_keys and not _is_ddp_option(k)}
        options.update(gradzip_options or {})
        base.__init__(self, **kwargs)
        self._gradzip_codec = codec
        self._gradzip_options = options
        self.gradzip = None

    def configure_ddp(self) -> None:
        """Wrap in DDP as Lightning does (it registers no hook: none was given), then register
        gradzip on the DDP model, on every device."""
        from . import ddp

        base.configure_ddp(self)
        if self.gradzip is not None:  # a second fit() wraps a new DDP model
            self.gradzip.close()
        self.gradzip = ddp.register(self.model, self._gradzip_codec, **self._gradzip_options)

    def teardown(self) -> None:
        """Stop gradzip's worker and release its process group; ``strategy.gradzip`` stays
        readable (``stats()``, ``state_dict()``)."""
        if self.gradzip is not None:
            self.gradzip.close()
        base.teardown(self)

    cls = type(name, (base,), {
        "__init__": __init__,
        "configure_ddp": configure_ddp,
        "teardown": teardown,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"``{package}``'s DDPStrategy with gradzip's hook registered on every device; "
                   "its state is ``strategy.gradzip`` (None until fit() wraps the model).",
    })
    _BUILT[package] = cls
    return cls


def _ddp_keywords(base: type) -> list:
    import inspect

    return [p for p in inspect.signature(base.__init__).parameters if p not in ("self", "kwargs")]


def _is_ddp_option(key: str) -> bool:
    """DistributedDataParallel's own keywords, which DDPStrategy passes through ``**kwargs``."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return key in inspect.signature(DistributedDataParallel.__init__).parameters


def __getattr__(attr: str) -> Any:
    if attr == "GradzipPLDDPStrategy":
        return _build("pytorch_lightning", attr)
    if attr != "GradzipDDPStrategy":
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    try:
        importlib.import_module("lightning.pytorch")
    except ImportError:
        pass
    else:
        return _build("lightning.pytorch", attr)
    try:  # only the older package: the same class, under the name it was built with
        return _build("pytorch_lightning", "GradzipPLDDPStrategy")
    except ImportError:
        raise ImportError("gradzip.frontends.lightning needs Lightning: pip install lightning (or pytorch_lightning)") from None
