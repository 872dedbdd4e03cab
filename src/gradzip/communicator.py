"""The Communicator: codec + memory + collective on one process group, in one ordered worker."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import collectives as _collectives
from . import memory as _memory
from .codecs import registry as _registry
from .codecs.base import Codec
from .collectives.base import Collective, world
from .metrics import Metrics
from .worker import OrderedWorker


def _dedicated_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """A new process group over the same ranks, used only by gradzip's worker thread.

    Collectives are matched by issue order within a group; DDP (and the user) issue their own on
    the default group from other threads, so gradzip's must not share it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = dist.get_backend(group)
    if group is None or group is dist.group.WORLD:
        return dist.new_group(backend=backend)
    # a subgroup: only its members call this, so only they may take part in making the new one
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend=backend, use_local_synchronization=True)


class Communicator:
    """Compressed, averaged all-reduce of named tensors.

    ``Communicator("topk", ratio=0.01, memory="residual")``: codec options go as keywords;
    ``memory`` defaults to the codec's own default and ``collective`` to the first collective
    the codec supports; ``memory_options`` and ``collective_options`` (e.g. ``{"partitions":
    8}`` for ``ps``) go to those. An impossible combination raises ``ValueError`` at construction. Every
    call is executed by one ordered worker thread, so calls made in the same order on every rank
    issue their collectives in the same order.
    """

    def __init__(
        self,
        codec: "str | Codec" = "none",
        *,
        memory: "str | _memory.Memory | None" = None,
        collective: Optional[str] = None,
        group: Optional[dist.ProcessGroup] = None,
        memory_options: Optional[Dict[str, Any]] = None,
        collective_options: Optional[Dict[str, Any]] = None,
        dedicated_group: bool = True,
        **codec_options: Any,
    ) -> None:
        self.codec = _registry.codec(codec, **codec_options)
        self.memory = _memory.memory(memory if memory is not None else self.codec.default_memory, **(memory_options or {}))
        self.collective_name = collective or self.codec.collective
        self.group = _dedicated_group(group) if dedicated_group else group
        self.collective = self._make_collective(self.collective_name, self.codec, collective_options or {})
        self._plain_codec = _registry.codec("none")
        self._plain = _collectives.get("allreduce")(self.group)
        self._plain_memory = _memory.memory("none")
        self.metrics = Metrics()
        self._steps: Dict[str, int] = {}
        self._worker: Optional[OrderedWorker] = None
        self._closed = False

    def _make_collective(self, name: str, codec: Codec, options: Dict[str, Any]) -> Collective:
        cls = _collectives.get(name)
        try:
            coll = cls(self.group, **options)
        except TypeError:
            params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "group")]
            raise ValueError(
                f"collective {name!r}: invalid options {sorted(options)}; valid options: {', '.join(params) or '(none)'}"
            ) from None
        if not coll.supports(codec):
            valid = [n for n in _collectives.names() if _collectives.get(n)(None).supports(codec)]
            raise ValueError(
                f"codec {codec.name!r} cannot use collective {name!r}; valid collectives for it: {', '.join(valid)}"
            )
        return coll

    @property
    def rank(self) -> int:
        return world(self.group)[0]

    @property
    def world_size(self) -> int:
        return world(self.group)[1]

    def __repr__(self) -> str:
        return f"Communicator({self.codec!r}, memory={self.memory!r}, collective={self.collective_name!r})"

    # ------------------------------------------------------------------ calls
    def allreduce(self, t: torch.Tensor, name: str = "", out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Average ``t`` over all ranks through the codec.

        Returns a new tensor like ``t``, or ``out`` (same shape and dtype; ``t`` itself for an
        in-place all-reduce) holding the average: reusing a destination saves allocating, and
        first touching, a result as large as the gradient on every call.
        """
        return self.allreduce_async(t, name, out).wait()

    def allreduce_async(self, t: torch.Tensor, name: str = "", out: Optional[torch.Tensor] = None) -> torch.futures.Future:
        """Like :meth:`allreduce`, returning a ``torch.futures.Future[Tensor]``."""
        _check_out(t, out)

        def job() -> torch.Tensor:
            if t.is_cuda:  # read on the worker's stream: keep the caller's memory until then
                t.record_stream(torch.cuda.current_stream(t.device))
            return self.reduce_now(t, name, out=out)

        return self.submit(job, t.device)

    def submit(self, fn, device: torch.device) -> torch.futures.Future:
        """Run ``fn`` on the ordered communication worker."""
        if self._closed:
            raise RuntimeError("this Communicator has been closed")
        if self._worker is None:
            self._worker = OrderedWorker(device=device)
        return self._worker.submit(fn)

    def reduce_now(self, t: torch.Tensor, name: str, compress: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encode, exchange and decode ``t`` in the calling thread (the worker's job); into ``out`` if given."""
        _check_out(t, out)
        if compress:
            codec, coll, mem = self.codec, self.collective, self.memory
        else:
            codec, coll, mem = self._plain_codec, self._plain, self._plain_memory
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        raw = t.numel() * t.element_size()
        if t.numel() == 0:
            self.metrics.record(name, raw, 0, 0.0, 0.0, compress)
            return t.clone() if out is None else out
        inp = mem.compensate(t.contiguous(), name)  # keeps the shape: low-rank codecs need it
        # the collective writes straight into ``out`` when it can; not while the memory still has
        # to read an input that aliases it
        dest = out.view(-1) if out is not None and out.is_contiguous() and out.dtype == inp.dtype else None
        if dest is not None and mem.stateful and _overlaps(dest, inp):
            dest = None
        res = coll.run(codec, inp, name, step, need_own=mem.stateful, out=dest)
        if mem.stateful:
            mem.update(name, inp, res.own.view(inp.shape), skip=res.nonfinite)
        avg = _poison_if(res.avg, res.nonfinite)  # a fresh tensor, or dest
        self.metrics.record(
            name, raw, res.wire_bytes, res.encode_s, res.decode_s, compress,
            encode_cpu_s=res.encode_cpu_s, decode_cpu_s=res.decode_cpu_s,
        )
        if out is None:
            return avg.view(t.shape).to(t.dtype)
        if dest is None:
            out.copy_(avg.view(t.shape))
        return out

    def reduce_many_now(
        self, tensors: Sequence[torch.Tensor], names: Sequence[str], compress: Sequence[bool], inplace: bool = False,
    ) -> List[torch.Tensor]:
        """Reduce several tensors: the uncompressed ones fused into one plain all-reduce.

        With ``inplace`` the averages are written into ``tensors`` themselves (as DDP's bucket
        views want them), and those are returned.
        """
        out: List[Optional[torch.Tensor]] = [None] * len(tensors)
        plain = [i for i, c in enumerate(compress) if not c]
        if plain:
            dtype = tensors[plain[0]].dtype
            flat = torch.cat([tensors[i].reshape(-1).to(dtype) for i in plain])
            avg = self.reduce_now(flat, f"uncompressed:{names[plain[0]]}", compress=False)
            offset = 0
            for i in plain:
                n = tensors[i].numel()
                out[i] = avg[offset : offset + n].view(tensors[i].shape).to(tensors[i].dtype)
                if inplace:
                    out[i] = tensors[i].copy_(out[i])
                offset += n
        for i, c in enumerate(compress):
            if c:
                out[i] = self.reduce_now(tensors[i], names[i], out=tensors[i] if inplace else None)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ state
    def stats(self, per_tensor: bool = False) -> Dict[str, Any]:
        return self.metrics.summary(per_tensor)

    def state_dict(self) -> Dict[str, Any]:
        return {"codec": self.codec.state_dict(), "memory": self.memory.state_dict(), "steps": dict(self._steps)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.codec.load_state_dict(state.get("codec", {}))
        self.memory.load_state_dict(state.get("memory", {}))
        self._steps = dict(state.get("steps", {}))

    def close(self) -> None:
        """Stop the worker thread and release the dedicated process group."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.close()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None


def _check_out(t: torch.Tensor, out: Optional[torch.Tensor]) -> None:
    if out is not None and (out.shape != t.shape or out.dtype != t.dtype or out.device != t.device):
        raise ValueError(
            f"out must match the input: shape {tuple(t.shape)}, {t.dtype} on {t.device}; "
            f"got shape {tuple(out.shape)}, {out.dtype} on {out.device}"
        )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share storage (then writing one may change the other)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _poison_if(avg: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """All-NaN ``avg`` where some rank's input was not finite (the agreed outcome)."""
    if avg.device.type == "cpu":  # reading the flag is free here; skip a pass over the result
        return avg.fill_(float("nan")) if bool(nonfinite) else avg
    return avg.masked_fill_(nonfinite, float("nan"))  # no host sync on accelerators
