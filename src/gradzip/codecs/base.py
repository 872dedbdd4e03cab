"""The codec protocol: what every compression method provides.

A codec turns a gradient into a :class:`Payload` — the tensors that go on the wire plus a local
context that never leaves the rank — and back. A codec also declares which collectives can carry
its payloads (``collectives``; the first is the default), whether payloads can simply be summed
(``summable``: then a plain all-reduce is enough), and how many bytes a payload takes before any
encoding happens (``wire_bytes``), so buffers and plans can be made ahead of time.

Decoding another rank's payload uses *this* rank's context: a context may only hold facts that
are the same on every rank (shape, dtype, name, step, shared random indices, shared factors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from ..kernels import draw_key, private_generator, store_into


@dataclass
class Meta:
    """Local context of one encoded tensor; identical on every rank for the same tensor/step."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    name: str = ""
    step: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Payload:
    """An encoded tensor: ``tensors`` go on the wire, ``ctx`` stays on this rank."""

    tensors: List[torch.Tensor]
    ctx: Meta

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True)
class Option:
    """One constructor option of a codec: its default, a validity check and what it must be."""

    default: Any
    check: Callable[[Any], bool]
    expect: str
    doc: str = ""


def int_in(lo: int, hi: Optional[int] = None) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)

    return check


def float_in(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        return (v > lo if lo_open else v >= lo) and v <= hi

    return check


def one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda v: v in choices


SEED = Option(0, int_in(0), "a non-negative integer", "seed of the codec's random streams")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Codec:
    """Base class of every gradient codec. Subclasses implement ``_encode``/``_decode``."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    collectives: ClassVar[Tuple[str, ...]] = ("allgather",)
    default_memory: ClassVar[str] = "none"
    summable: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True  # payload size depends only on (numel, dtype, shape)
    # an aggregator (``ps``) may decode, average and re-encode it without systematically losing
    # what the ranks sent: False for sparsifiers (the union of W selections would be cut back to
    # one selection) and for threshold quantizers (an average lies inside the threshold)
    reencodable: ClassVar[bool] = True
    # per-tensor state kept across steps (PowerSGD's Q, Signum's momentum, ...): the key under
    # which state_dict() saves it; the codec holds it in the dict attribute ``_<key>``
    tensor_state: ClassVar[str] = ""
    options: ClassVar[Dict[str, Option]] = {}

    def __init__(self, **opts: Any) -> None:
        unknown = sorted(set(opts) - set(self.options))
        if unknown:
            valid = ", ".join(sorted(self.options)) or "(none)"
            raise ValueError(f"codec {self.name!r}: unknown option(s) {', '.join(unknown)}; valid options: {valid}")
        for key, spec in self.options.items():
            value = opts.get(key, spec.default)
            if not spec.check(value):
                raise ValueError(f"codec {self.name!r}: {key} must be {spec.expect}, got {value!r}")
            setattr(self, key, value)
        self._calls: Dict[str, int] = {}
        self._generators: Dict[torch.device, torch.Generator] = {}

    # ----------------------------------------------------------------- public API
    @property
    def collective(self) -> str:
        """The collective used when none is asked for."""
        return self.collectives[0]

    def config(self) -> Dict[str, Any]:
        return {key: getattr(self, key) for key in self.options}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({opts})"

    def encode(self, t: torch.Tensor, name: str = "", step: Optional[int] = None) -> Payload:
        """Encode ``t``; ``step`` keys shared randomness (defaults to a per-name call counter)."""
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"codec {self.name!r} encodes floating-point tensors, got {t.dtype}")
        if step is None:
            step = self._calls.get(name, 0)
            self._calls[name] = step + 1
        meta = Meta(t.shape, t.dtype, t.device, name, step)
        if t.numel() == 0:
            return Payload([], meta)
        return Payload(self._encode(t.reshape(-1), meta), meta)

    def decode(self, payload: Payload) -> torch.Tensor:
        """Decode a payload (this rank's or another rank's) to a tensor of the original shape/dtype."""
        meta = payload.ctx
        if meta.numel == 0:
            return torch.empty(meta.shape, dtype=meta.dtype, device=meta.device)
        return self._decode(payload.tensors, meta).reshape(meta.shape).to(meta.dtype)

    def decode_into(self, payload: Payload, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
        """Decode the first ``out.numel()`` values of a payload into the flat ``out`` (or add them).

        Collectives decode chunks straight into their result and sum ranks in place with this,
        which saves a fresh allocation and a pass over memory per payload; codecs with fused
        kernels override :meth:`_decode_into`. The values are exactly those of :meth:`decode`.
        """
        if out.numel() > payload.ctx.numel:
            raise ValueError(f"out has {out.numel()} values, the payload only {payload.ctx.numel}")
        if out.numel() == 0:
            return out
        return self._decode_into(payload.tensors, payload.ctx, out, accumulate)

    def aggregate(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Combine every rank's payload (in rank order) into the averaged gradient."""
        meta = payloads[0].ctx
        total = torch.empty(meta.numel, dtype=torch.float32, device=meta.device)
        for i, p in enumerate(payloads):
            self.decode_into(p, total, accumulate=i > 0)
        return total.div_(len(payloads)).reshape(meta.shape).to(meta.dtype)

    def next_round(self, payload: Payload, reduced: List[torch.Tensor]) -> Optional[Payload]:
        """For multi-round summable codecs: after an all-reduce round, the next payload or None."""
        return None

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32, shape: Optional[Tuple[int, ...]] = None) -> int:
        """Bytes one rank puts on the wire for a tensor of ``numel`` elements (before encoding).

        ``shape`` matters only to codecs that factor matrices (PowerSGD). For codecs whose
        payload size depends on the data (``fixed_size`` false) it is an upper bound.
        """
        if numel == 0:
            return 0
        return self._wire_bytes(numel, dtype)

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"calls": dict(self._calls)}
        if self.tensor_state:
            state[self.tensor_state] = {k: v.cpu() for k, v in getattr(self, f"_{self.tensor_state}").items()}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._calls = dict(state.get("calls", {}))
        if self.tensor_state:
            setattr(self, f"_{self.tensor_state}", {k: v.clone() for k, v in state.get(self.tensor_state, {}).items()})

    # ------------------------------------------------------------ for subclasses
    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        raise NotImplementedError

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        raise NotImplementedError

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        return store_into(self._decode(tensors, meta).reshape(-1)[: out.numel()], out, accumulate)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def _key(self) -> int:
        """A fresh 32-bit key for this rank's counter-based stochastic rounding."""
        return draw_key(self._generator(torch.device("cpu")))

    def _generator(self, device: torch.device) -> torch.Generator:
        """This rank's private generator for stochastic rounding on ``device``."""
        device = torch.device(device)
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = private_generator(getattr(self, "seed", 0), device)
        return g
