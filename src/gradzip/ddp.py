"""One-line DDP integration: a communication hook that compresses each bucket's gradients.

``state = gradzip.register(ddp_model, "maxmin", bits=4)``. The hook splits a bucket into its
parameters' gradients (named, so state survives DDP's bucket rebuild), sends the small and 1-D
ones uncompressed in one fused all-reduce and every other one through the codec, writes the
averages back into the bucket and returns a future that the ordered worker completes.
"""
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .communicator import Communicator
from .config import Config


class GradzipState:
    """The hook's state: the communicator, the parameter names and the compression filter."""

    def __init__(self, comm: Communicator, param_names: Dict[int, str], config: Config) -> None:
        self.comm = comm
        self.config = config
        self.param_names = param_names

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
        """Per-rank state (error-feedback residuals, codec state, step counters)."""
        return self.comm.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.comm.load_state_dict(state)

    def close(self) -> None:
        self.comm.close()

    def __repr__(self) -> str:
        return f"GradzipState({self.comm!r}, min_numel={self.config.min_numel}, compress_1d={self.config.compress_1d})"


def gradzip_hook(state: GradzipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` through gradzip on the ordered worker."""
    buffer = bucket.buffer()
    params = bucket.parameters()
    grads = bucket.gradients()
    names = [state.param_names.get(id(p), f"bucket{bucket.index()}.{i}") for i, p in enumerate(params)]
    compress = [state.should_compress(g) for g in grads]

    def job() -> torch.Tensor:
        # the gradients are views into the bucket's buffer: the averages are written into them
        state.comm.reduce_many_now(grads, names, compress, inplace=True)
        return buffer

    return state.comm.submit(job, buffer.device)


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
    **codec_options: Any,
) -> GradzipState:
    """Register gradzip's communication hook on a DDP model and return its state.

    Keyword arguments fill a :class:`Config` (or update ``config``); ``GRADZIP_*`` environment
    variables override both. Call it on every rank, after wrapping the model in DDP and before
    the first backward.
    """
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"register() needs a DistributedDataParallel model, got {type(model).__name__}")
    cfg = config or Config()
    fields: Dict[str, Any] = {}
    if codec is not None:
        fields["codec"] = codec
        if codec != cfg.codec:
            fields["options"] = {}
    for key, value in (("memory", memory), ("collective", collective), ("min_numel", min_numel), ("compress_1d", compress_1d)):
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
    comm = Communicator(
        cfg.codec,
        memory=cfg.memory,
        collective=cfg.collective,
        group=group if group is not None else getattr(model, "process_group", None),
        memory_options=memory_options,
        collective_options=cfg.collective_options,
        **cfg.options,
    )
    names = {id(p): n for n, p in model.module.named_parameters()}
    state = GradzipState(comm, names, cfg)
    model.register_comm_hook(state, gradzip_hook)
    return state
