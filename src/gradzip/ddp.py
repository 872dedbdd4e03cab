"""One-line DDP integration: a communication hook that compresses each bucket's gradients.

``state = gradzip.register(ddp_model, "maxmin", bits=4)``. The hook splits a bucket into its
parameters' gradients (named, so state survives DDP's bucket rebuild), sends the small and 1-D
ones uncompressed in one fused all-reduce and every other one through the codec, writes the
averages back into the bucket and returns a future that the ordered worker completes.
"""
from datetime import timedelta
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from .communicator import Communicator
from .config import Config
from .errors import SettingsMismatchError


class GradzipState:
    """The hook's state: the communicator, the parameter names and the compression filter.

    ``step`` counts the backward passes whose gradients went through the hook (one per
    optimizer step without gradient accumulation); errors name it.
    """

    def __init__(self, comm: Communicator, param_names: Dict[int, str], config: Config) -> None:
        self.comm = comm
        self.config = config
        self.param_names = param_names
        self.step = 0
        self._errors: List[BaseException] = []
        self._inflight: List[torch.futures.Future] = []
        self._check_queued = False

    def should_compress(self, grad: torch.Tensor) -> bool:
        if grad.numel() < self.config.min_numel:
            return False
        return self.config.compress_1d or grad.dim() > 1

    def stats(self, per_tensor: bool = False) -> Dict[str, Any]:
        """Bytes on the wire vs raw, compression ratio, encode/decode seconds (this rank)."""
        out = self.comm.stats(per_tensor)
        out.update(codec=self.comm.codec.name, memory=self.comm.memory.name, collective=self.comm.collective_name)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Per-rank state (error-feedback residuals, codec state, step counters), marked with
        this rank, the world size and the settings' fingerprint."""
        state = self.comm.state_dict()
        state["hook_step"] = self.step
        return state

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Restore this rank's own :meth:`state_dict`; see :meth:`Communicator.load_state_dict`
        for what ``strict=False`` accepts and drops."""
        self.comm.load_state_dict(state, strict=strict)
        self.step = int(state.get("hook_step", 0)) if isinstance(state, dict) else 0

    def close(self) -> None:
        self.comm.close()

    def __repr__(self) -> str:
        return f"GradzipState({self.comm!r}, min_numel={self.config.min_numel}, compress_1d={self.config.compress_1d})"

    # ------------------------------------------------------------ failures
    def deliver(self, fut: torch.futures.Future, buffer: torch.Tensor) -> torch.futures.Future:
        """The future DDP waits on, with failures raised as gradzip's own exceptions.

        DDP reads a hook's future in C++, which turns any Python exception stored in it into
        ``RuntimeError: Unable to cast <message> to Tensor``. So a failed job completes DDP's
        future with the (untouched) bucket, and a callback queued on the autograd engine waits
        for this backward's jobs and re-raises the failure itself, type and message intact,
        before DDP's own end-of-backward step: ``loss.backward()`` raises it and the optimizer
        never steps on those gradients. Outside a backward pass the future itself fails.
        """
        try:
            if not self._check_queued:
                Variable._execution_engine.queue_callback(self._raise_failures)
                self._check_queued = True
        except RuntimeError:  # not inside a backward pass (the hook called by hand)
            return fut
        out = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)

        def done(f: torch.futures.Future) -> None:
            try:
                out.set_result(f.value())
            except Exception as exc:
                self._errors.append(exc)
                out.set_result(buffer)

        fut.add_done_callback(done)
        self._inflight.append(out)
        return out

    def _raise_failures(self) -> None:
        self._check_queued = False
        inflight, self._inflight = self._inflight, []
        for f in inflight:
            f.wait()
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first


def _bucket_label(index: int, names: List[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"bucket {index} ({shown})"


def gradzip_hook(state: GradzipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` through gradzip on the ordered worker."""
    buffer = bucket.buffer()
    params = bucket.parameters()
    grads = bucket.gradients()
    names = [state.param_names.get(id(p), f"bucket{bucket.index()}.{i}") for i, p in enumerate(params)]
    compress = [state.should_compress(g) for g in grads]
    what = f"step {state.step}, {_bucket_label(bucket.index(), names)}"
    if bucket.is_last():
        state.step += 1

    def job() -> torch.Tensor:
        # the gradients are views into the bucket's buffer: the averages are written into them
        state.comm.reduce_many_now(grads, names, compress, inplace=True)
        return buffer

    return state.deliver(state.comm.submit(job, buffer.device, what=what), buffer)


def register(
    model: DistributedDataParallel,
    codec: Optional[str] = None,
    *,
    memory: Optional[str] = None,
    collective: Optional[str] = None,
    min_numel: Optional[int] = None,
    compress_1d: Optional[bool] = None,
    group: Optional[dist.ProcessGroup] = None,
    config: Optional[Config] = None,
    memory_options: Optional[Dict[str, Any]] = None,
    collective_options: Optional[Dict[str, Any]] = None,
    timeout: Union[timedelta, float, None] = None,
    **codec_options: Any,
) -> GradzipState:
    """Register gradzip's communication hook on a DDP model and return its state.

    Keyword arguments fill a :class:`Config` (or update ``config``); ``GRADZIP_*`` environment
    variables override both. Call it on every rank, after wrapping the model in DDP and before
    the first backward.

    It compares every rank's effective settings (one small collective) and raises
    :class:`~gradzip.errors.SettingsMismatchError` on every rank if they differ. gradzip's
    collectives time out after ``timeout`` (seconds or a ``timedelta``; default: the timeout of
    the model's process group, as given to ``init_process_group``); then ``backward()`` raises
    :class:`~gradzip.errors.CommunicationError` naming the step and the bucket.
    """
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"register() needs a DistributedDataParallel model, got {type(model).__name__}")
    cfg = config or Config()
    fields: Dict[str, Any] = {}
    if codec is not None:
        fields["codec"] = codec
        if codec != cfg.codec:
            fields["options"] = {}
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    for key, value in (
        ("memory", memory), ("collective", collective), ("min_numel", min_numel), ("compress_1d", compress_1d),
        ("timeout", seconds),
    ):
        if value is not None:
            fields[key] = value
    if collective_options:
        fields["collective_options"] = {**cfg.collective_options, **collective_options}
    if fields or codec_options:
        merged = dict(fields.get("options", cfg.options))
        merged.update(codec_options)
        fields["options"] = merged
        cfg = Config(**{**cfg.__dict__, **fields})
    cfg = cfg.with_env()
    try:
        comm = Communicator(
            cfg.codec,
            memory=cfg.memory,
            collective=cfg.collective,
            group=group if group is not None else getattr(model, "process_group", None),
            memory_options=memory_options,
            collective_options=cfg.collective_options,
            timeout=cfg.timeout,
            settings_extra={"min_numel": cfg.min_numel, "compress_1d": cfg.compress_1d},
            settings_sources=cfg.sources,
            **cfg.options,
        )
    except ValueError as exc:
        note = cfg.environment_note()
        if not note or isinstance(exc, SettingsMismatchError):  # that one names its sources itself
            raise
        raise type(exc)(f"{exc}{note}") from exc
    names = {id(p): n for n, p in model.module.named_parameters()}
    state = GradzipState(comm, names, cfg)
    model.register_comm_hook(state, gradzip_hook)
    return state
