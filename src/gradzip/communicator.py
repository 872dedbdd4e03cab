"""The Communicator: codec + memory + collective on one process group, in one ordered worker."""
from __future__ import annotations

import inspect
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import collectives as _collectives
from . import consistency
from . import memory as _memory
from .codecs import registry as _registry
from .codecs.base import FLOAT_DTYPES, Codec
from .collectives import base as _collective_base
from .collectives.base import Collective, world
from .errors import CheckpointError, CommunicationError
from .metrics import Metrics, traffic_factor
from .worker import OrderedWorker

STATE_FORMAT = 1

Timeout = Union[timedelta, float, int, None]


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The collective timeout of ``group`` (the default group when None), as it was created.

    ``init_process_group(timeout=...)`` sets it; a group made later without one gets torch's
    default (30 minutes for gloo), so gradzip must copy it, not assume it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or an older torch without options
            continue
    try:
        from torch.distributed.distributed_c10d import _get_default_timeout

        return _get_default_timeout(dist.get_backend(group))
    except Exception:
        return None


def _as_timedelta(timeout: Timeout) -> Optional[timedelta]:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=float(timeout))


def _dedicated_group(group: Optional[dist.ProcessGroup], timeout: Optional[timedelta]) -> Optional[dist.ProcessGroup]:
    """A new process group over the same ranks, used only by gradzip's worker thread.

    Collectives are matched by issue order within a group; DDP (and the user) issue their own on
    the default group from other threads, so gradzip's must not share it. It gets ``timeout``, so
    a stalled rank makes the others fail when the user's own collectives would, not 30 minutes on.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = dist.get_backend(group)
    if group is None or group is dist.group.WORLD:
        return dist.new_group(backend=backend, timeout=timeout)
    # a subgroup: only its members call this, so only they may take part in making the new one
    return dist.new_group(
        ranks=dist.get_process_group_ranks(group), backend=backend, timeout=timeout, use_local_synchronization=True,
    )


class Communicator:
    """Compressed, averaged all-reduce of named tensors.

    ``Communicator("topk", ratio=0.01, memory="residual")``: codec options go as keywords;
    ``memory`` defaults to the codec's own default and ``collective`` to the first collective
    the codec supports; ``memory_options`` and ``collective_options`` (e.g. ``{"partitions":
    8}`` for ``ps``) go to those. An impossible combination raises ``ValueError`` at construction. Every
    call is executed by one ordered worker thread, so calls made in the same order on every rank
    issue their collectives in the same order.

    Reliability: the communicator's own process group takes ``timeout`` (default: the timeout of
    ``group``, i.e. what ``init_process_group(timeout=...)`` set), so a stalled or dead rank makes
    every call fail with :class:`~gradzip.errors.CommunicationError` within it. Construction
    compares the effective settings of every rank (``verify_settings``) and raises
    :class:`~gradzip.errors.SettingsMismatchError` on every rank if they differ.
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
        timeout: Timeout = None,
        verify_settings: bool = True,
        settings_extra: Optional[Mapping[str, Any]] = None,
        settings_sources: Optional[Mapping[str, str]] = None,
        **codec_options: Any,
    ) -> None:
        self.timeout = _as_timedelta(timeout) or group_timeout(group)
        try:  # every option is checked before the first collective
            self.codec = _registry.codec(codec, **codec_options)
            memory = memory if memory is not None else self.codec.default_memory
            self.memory = _memory.memory(memory, **(memory_options or {}))
            self.collective_name = collective or self.codec.collective
            self.collective = self._make_collective(self.collective_name, self.codec, collective_options or {}, group)
        except ValueError as exc:
            # the other ranks are about to meet this one in collectives: tell them why it is not
            # coming, or they would wait out the timeout and fail without a reason
            if verify_settings and dedicated_group:
                _report_failed_construction(group, self.timeout, exc, settings_sources)
            raise
        self.group = _dedicated_group(group, self.timeout) if dedicated_group else group
        self.collective.group = self.group
        self._plain_codec = _registry.codec("none")
        self._plain = _collectives.get("allreduce")(self.group)
        self._plain_memory = _memory.memory("none")
        self.metrics = Metrics()
        self._steps: Dict[str, int] = {}
        self._worker: Optional[OrderedWorker] = None
        self._closed = False
        self._failure: Optional[CommunicationError] = None
        self._extra = dict(settings_extra or {})
        self._sources = dict(settings_sources or {})
        if verify_settings:
            consistency.verify_same_on_all_ranks(self.settings(), self.group, self._sources)

    def _make_collective(self, name: str, codec: Codec, options: Dict[str, Any], group) -> Collective:
        cls = _collectives.get(name)
        try:
            coll = cls(group, **options)
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

    def settings(self) -> Dict[str, Any]:
        """The effective settings every rank must share: what decides the bytes on the wire."""
        from . import __version__

        out: Dict[str, Any] = {"gradzip": __version__, "codec": self.codec.name}
        out.update({f"codec.{k}": v for k, v in self.codec.config().items()})
        out["memory"] = self.memory.name
        out.update({f"memory.{k}": v for k, v in consistency.init_options(self.memory).items()})
        out["collective"] = self.collective_name
        out.update({f"collective.{k}": v for k, v in consistency.init_options(self.collective).items()})
        if not self.codec.kernels_bit_exact:
            out["kernels"] = _kernels_in_use(self.group)
        out.update(self._extra)
        return out

    def fingerprint(self) -> str:
        """A hash of :meth:`settings`, carried by state dicts."""
        return consistency.fingerprint(self.settings())

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
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"allreduce takes a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        _check_out(t, out)

        def job() -> torch.Tensor:
            if t.is_cuda:  # read on the worker's stream: keep the caller's memory until then
                t.record_stream(torch.cuda.current_stream(t.device))
            return self.reduce_now(t, name, out=out)

        return self.submit(job, t.device, what=f"step {self._steps.get(name, 0)} of tensor {name!r}")

    def submit(self, fn: Callable[[], Any], device: torch.device, what: str = "") -> torch.futures.Future:
        """Run ``fn`` on the ordered communication worker; ``what`` names it in errors.

        A failure (a collective that timed out or lost a peer, or anything else) completes the
        future with :class:`CommunicationError`, and every later job fails at once with it too:
        its collectives would only wait out the timeout again.
        """
        if self._closed:
            raise RuntimeError("this Communicator has been closed")
        if self._worker is None:
            self._worker = OrderedWorker(device=device)
        return self._worker.submit(lambda: self._guarded(fn, what))

    def _guarded(self, fn: Callable[[], Any], what: str) -> Any:
        if self._failure is not None:
            raise CommunicationError(
                f"gradzip (rank {self.rank} of {self.world_size}): {what or 'exchange'} not attempted: "
                f"an earlier exchange failed ({self._failure.brief})"
            ) from self._failure
        start = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            self._failure = self._failed(what, exc, time.monotonic() - start)
            raise self._failure from exc

    def _failed(self, what: str, exc: BaseException, seconds: float) -> CommunicationError:
        limit = self.timeout.total_seconds() if self.timeout is not None else None
        cause = " ".join(str(exc).split()) or type(exc).__name__
        if len(cause) > 300:
            cause = cause[:300] + " ..."
        if limit is not None and seconds >= 0.9 * limit:
            hint = f"no answer within the process group's timeout of {limit:g} s: another rank has stalled or died"
        elif not _from_collective(exc):
            hint = "the error was raised on this rank, not by a collective"
        else:
            hint = "another rank may have stalled, died or issued different collectives"
            hint += f" (timeout {limit:g} s)" if limit is not None else ""
        brief = f"{what or 'exchange'} failed after {seconds:.1f} s"
        return CommunicationError(
            f"gradzip (rank {self.rank} of {self.world_size}): {brief}; {hint}. {type(exc).__name__}: {cause}", brief,
        )

    def reduce_now(self, t: torch.Tensor, name: str, compress: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encode, exchange and decode ``t`` in the calling thread (the worker's job); into ``out`` if given."""
        avg, record = self._reduce(t, name, compress, out)
        self.metrics.record(name, t.numel() * t.element_size(), **record)
        return avg

    def _reduce(self, t: torch.Tensor, name: str, compress: bool, out: Optional[torch.Tensor]):
        """:meth:`reduce_now` without recording: (the average, the metrics of this call)."""
        _check_out(t, out)
        if compress:
            codec, coll, mem = self.codec, self.collective, self.memory
        else:
            codec, coll, mem = self._plain_codec, self._plain, self._plain_memory
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        if t.numel() == 0:
            return (t.clone() if out is None else out), _metrics_of(None, 0, 0.0, compress, codec)
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
        wire = res.wire_bytes if res.payload_bytes is None else res.payload_bytes  # one encoding (metrics.py)
        record = _metrics_of(res, wire, traffic_factor(coll.name, self.world_size), compress, codec)
        if out is None:
            return avg.view(t.shape).to(t.dtype), record
        if dest is None:
            out.copy_(avg.view(t.shape))
        return out, record

    def reduce_many_now(
        self, tensors: Sequence[torch.Tensor], names: Sequence[str], compress: Sequence[bool], inplace: bool = False,
    ) -> List[torch.Tensor]:
        """Reduce several tensors: the uncompressed ones fused into one plain all-reduce.

        With ``inplace`` the averages are written into ``tensors`` themselves (as DDP's bucket
        views want them), and those are returned. The metrics of the fused all-reduce are
        recorded per parameter name (each with its share), so they do not depend on how the
        parameters were grouped into buckets.
        """
        out: List[Optional[torch.Tensor]] = [None] * len(tensors)
        plain = [i for i, c in enumerate(compress) if not c]
        if plain:
            dtype = tensors[plain[0]].dtype
            flat = torch.cat([tensors[i].reshape(-1).to(dtype) for i in plain])
            avg, record = self._reduce(flat, f"uncompressed:{names[plain[0]]}", False, None)
            self.metrics.record_group([(names[i], tensors[i].numel() * flat.element_size()) for i in plain], **record)
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
        """This rank's metrics (see :mod:`gradzip.metrics` for what each figure means)."""
        out = self.metrics.summary(per_tensor)
        out["world_size"] = self.world_size
        return out

    def state_dict(self) -> Dict[str, Any]:
        """This rank's state, with whose it is: rank, world size and the settings' fingerprint.

        It holds everything the next step needs to move the same bytes as an uninterrupted run:
        error-feedback residuals, the codec's per-tensor state, the collective's call counter and
        the step counters that key all randomness (shared and private).
        """
        settings = self.settings()
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "fingerprint": consistency.fingerprint(settings),
            "settings": settings,
            "codec": self.codec.state_dict(),
            "memory": self.memory.state_dict(),
            "collective": self.collective.state_dict(),
            "steps": dict(self._steps),
        }

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict` of this same rank, world size and configuration.

        Anything else raises :class:`~gradzip.errors.CheckpointError` unless ``strict=False``,
        which loads what still applies and drops, with a warning, what does not: per-rank state
        (error-feedback residuals, a codec's per-tensor state) is kept
        only for the same rank of the same world size, because it is this rank's own unsent
        gradient (loaded on another rank, or summed over a different number of ranks, it would
        be applied to the wrong replica or the wrong number of times); codec, memory and
        collective state only where their settings are unchanged. Step counters always carry over.
        """
        problems, same_rank, same = self._compare_owner(state)
        if problems and strict:
            raise CheckpointError(
                f"gradzip (rank {self.rank} of {self.world_size}): this state dict does not belong here: "
                + "; ".join(problems)
                + ". Load each rank's own state saved with the same settings, or pass strict=False to load "
                "what still applies (per-rank residuals are then dropped)."
            )
        dropped = []
        if same("codec"):
            codec_state = dict(state.get("codec", {}))
            key = self.codec.tensor_state  # per-rank (Signum's momentum, AdaComp's residuals, PowerSGD's Q)
            if not same_rank and key and codec_state.pop(key, None):
                dropped.append(f"codec {key}")
            self.codec.load_state_dict(codec_state)
        elif state.get("codec"):
            dropped.append("codec state")
        if same("memory") and same_rank:
            self.memory.load_state_dict(state.get("memory", {}))
        else:  # start from an empty memory, not from whatever this rank held before
            self.memory.load_state_dict({})
            if any(state.get("memory", {}).values()):
                dropped.append("error-feedback memory")
        if same("collective"):  # a call counter, the same on every rank
            self.collective.load_state_dict(state.get("collective", {}))
        self._steps = dict(state.get("steps", {}))
        if problems and dropped:
            warnings.warn(
                f"gradzip (rank {self.rank}): loaded a state dict that does not match ({'; '.join(problems)}); "
                f"dropped: {', '.join(dropped)}",
                stacklevel=2,
            )

    def _compare_owner(self, state: Mapping[str, Any]):
        """(problems, same rank and world size, same(prefix) -> settings under prefix unchanged)."""
        if not isinstance(state, Mapping) or "fingerprint" not in state:
            return ["it has no owner information (not a gradzip state dict of this version)"], False, lambda p: False
        problems = []
        if state.get("world_size") != self.world_size:
            problems.append(f"it was saved with world size {state.get('world_size')}, this job has {self.world_size}")
        elif state.get("rank") != self.rank:
            problems.append(f"it is rank {state.get('rank')}'s state, this is rank {self.rank}")
        mine = self.settings()
        theirs = dict(state.get("settings", {}))
        if state.get("fingerprint") != consistency.fingerprint(mine):
            lines = consistency.differences([theirs, mine], [{}, self._sources], ["the checkpoint", "this run"])
            problems.append("its settings differ: " + ("; ".join(lines) or "fingerprint differs"))
        same_rank = state.get("rank") == self.rank and state.get("world_size") == self.world_size

        def same(prefix: str) -> bool:
            keys = {k for k in set(mine) | set(theirs) if k == prefix or k.startswith(prefix + ".")}
            return all(mine.get(k) == theirs.get(k) for k in keys)

        return problems, same_rank, same

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


def _report_failed_construction(
    group: Optional[dist.ProcessGroup], timeout: Optional[timedelta], exc: Exception,
    sources: Optional[Mapping[str, str]],
) -> None:
    """Take part in the group creation and settings exchange with an error in place of settings."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    own = _dedicated_group(group, timeout)
    try:
        consistency.verify_same_on_all_ranks({"error": f"{type(exc).__name__}: {exc}"}, own, sources)
    except consistency.SettingsMismatchError:
        pass  # this rank raises its own, more precise error
    finally:
        dist.destroy_process_group(own)


_TRANSPORT_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer", "pair", "transport")


def _from_collective(exc: BaseException) -> bool:
    """Whether ``exc`` came out of ``torch.distributed`` (a lost peer, a timeout), not local code."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _TRANSPORT_WORDS)


def _kernels_in_use(group: Optional[dist.ProcessGroup]) -> str:
    """Which codec kernels run (the C ones and torch's agree to the bit for most codecs, not all)."""
    from .kernels import fused, native

    choice = fused.setting()
    backend = dist.get_backend(group) if dist.is_available() and dist.is_initialized() else "gloo"
    if backend == "nccl" or choice == "triton":
        gpu = fused._gpu()
        ok = gpu is not None and gpu.available() is None
        return f"{choice}:{'triton' if ok and choice != 'torch' else 'torch'}"
    ok = native.available() is None
    return f"{choice}:{'native' if ok and choice in ('auto', 'native') else 'torch'}"


def _metrics_of(res: Any, wire: int, factor: float, compress: bool, codec: Codec) -> Dict[str, Any]:
    """The keyword arguments of :meth:`Metrics.record` for one call (``res``: its Result, or None)."""
    if res is None:
        return dict(wire=0, encode_s=0.0, decode_s=0.0, compressed=compress, sent=0.0, codec=codec.name)
    measured = _collective_base._measure_cpu or res.encode_cpu_s or res.decode_cpu_s
    return dict(
        wire=wire, encode_s=res.encode_s, decode_s=res.decode_s, compressed=compress,
        encode_cpu_s=res.encode_cpu_s if measured else None, decode_cpu_s=res.decode_cpu_s if measured else None,
        sent=factor * wire, codec=codec.name,
    )


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
