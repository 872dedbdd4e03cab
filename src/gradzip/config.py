"""Configuration: keyword arguments or a :class:`Config`, overridden by ``GRADZIP_*`` variables.

The environment wins, so a training script needs no edit to try another codec:
``GRADZIP_CODEC=maxmin GRADZIP_BITS=4 torchrun train.py``. ``GRADZIP_CODEC``, ``GRADZIP_MEMORY``,
``GRADZIP_COLLECTIVE``, ``GRADZIP_MIN_NUMEL``, ``GRADZIP_COMPRESS_1D``, ``GRADZIP_FUSION``, ``GRADZIP_FUSION_MB``, ``GRADZIP_PIPELINE``, ``GRADZIP_IN_PLACE``, ``GRADZIP_PLAN``, ``GRADZIP_WARMUP``, ``GRADZIP_RAMP``, ``GRADZIP_ADAPTIVE``, ``GRADZIP_ADAPTIVE_EVERY``, ``GRADZIP_HIERARCHY``, ``GRADZIP_NODE_DTYPE`` and ``GRADZIP_TIMEOUT``
(seconds) set the fields of the same name; ``GRADZIP_PARTITIONS``, ``GRADZIP_MIN_PARTITION`` (``ps``'s) and
``GRADZIP_SEGMENT`` (``sra``'s and ``allgather``'s) go to the collective;
``GRADZIP_KERNELS`` and ``GRADZIP_CACHE`` choose and cache the kernels (:mod:`gradzip.kernels`);
every other ``GRADZIP_<OPTION>`` becomes the codec option ``<option>`` (lower case),
its value read as an int, a float, a bool (true/false) or else a string.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Sequence

FIELDS = (
    "codec", "memory", "collective", "min_numel", "compress_1d", "fusion", "fusion_mb", "pipeline", "in_place", "plan",
    "warmup", "ramp", "adaptive", "adaptive_every", "hierarchy", "node_dtype", "timeout",
)
COLLECTIVE_OPTIONS = ("partitions", "min_partition", "segment")  # GRADZIP_PARTITIONS etc. go to the collective
PROCESS_SETTINGS = ("kernels", "cache")  # GRADZIP_KERNELS, GRADZIP_CACHE: read by gradzip.kernels
PLANS = ("off", "auto")
ADAPTIVE = ("off", "bytes", "error")  # see gradzip.policy.adaptive
HIERARCHY = ("auto", "on", "off")  # see gradzip.comm.hierarchy
NODE_DTYPES = ("fp32", "bf16", "fp16")  # the intra-node stage's values (gradzip.comm.hierarchy)
# a ramp's default length in steps, where a method needs one: DGC (Lin et al., ICLR'18) begins
# with exponentially growing sparsity; 0 for every other codec
DEFAULT_RAMP = {"dgc": 100}
AUTO = "auto"  # codec="auto": see Config.resolved


def parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low == "none":  # an option whose default is None (a collective's segment, say)
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


@dataclass
class Config:
    """What :func:`gradzip.register` builds: codec and its options, memory, collective, filter.

    ``min_numel``: tensors with fewer elements are sent uncompressed (fused into one plain
    all-reduce per bucket); ``compress_1d``: whether 1-D tensors (biases, norms) are compressed;
    ``fusion``: whether the compressed gradients of a bucket share one encoding and one exchange
    (for codecs that allow it, see :meth:`~gradzip.codecs.base.Codec.fusion_block`) in groups of
    about ``fusion_mb`` MiB (:mod:`gradzip.sync.groups`);
    ``pipeline``: whether a bucket's exchange overlaps the next one's (:mod:`gradzip.sync.pipeline`)
    where waiting for a collective blocks the host (gloo); NCCL queues collectives on the
    device's stream, so there each job runs through (:meth:`~gradzip.sync.engine.Communicator.pipelines`);
    ``in_place``: whether a DDP bucket is averaged in its own memory, its codec blocks running
    across gradients as DDP laid them out (:meth:`gradzip.sync.engine.Communicator.bucket_stages`:
    fewer passes and buffers; a run resumed from a checkpoint then matches an uninterrupted one
    only to rounding, since DDP lays its buckets out anew in a new process);
    ``plan``: ``"auto"`` compresses a group only where the calibrated cost model says it pays
    (:mod:`gradzip.policy.planner`), ``"off"`` compresses every eligible group; ``codec="auto"`` is
    ``maxmin`` 4-bit with residual error feedback and ``plan="auto"``;
    ``warmup``: steps sent dense (plain all-reduce) before compression starts, as DGC and
    PyTorch's PowerSGD hook begin (default 0);
    ``ramp``: steps after the warm-up over which the level goes from dense towards the configured
    one, as DGC's warm-up does (:class:`gradzip.policy.adaptive.Ramp`; sparsifiers send 25 %, 6.25 %, ...
    of the values, PowerSGD 4× then 2× the rank); unset, :data:`DEFAULT_RAMP` of the codec;
    ``adaptive``: per-layer levels (:mod:`gradzip.policy.adaptive`): ``"bytes"`` (or True) sends the
    fewest bytes with no more compression error than the codec's uniform level, ``"error"`` the
    least error in no more bytes, ``"off"`` (or False) keeps the uniform level; unset, it is
    ``"bytes"`` for ``codec="auto"`` and ``"off"`` otherwise. ``adaptive_every``: steps between
    plans;
    ``hierarchy``: ``"auto"`` splits every compressed exchange by node where the job runs on
    several nodes of several ranks each (found from torchrun's variables; plain inside the node,
    compressed across: :mod:`gradzip.comm.hierarchy`), ``"off"`` keeps it flat, ``"on"`` fails
    where the layout is not hierarchical; ``node_dtype``: the values of the intra-node stage of
    such an exchange, ``"fp32"`` (exact), or ``"bf16"`` / ``"fp16"`` for half the bytes inside the
    node (what the rounding loses goes to error feedback; ``plan="auto"`` also times the other);
    ``timeout``: seconds after which a gradient exchange fails (default: the timeout of the
    process group it serves).
    """

    codec: str = "maxmin"
    memory: Optional[str] = None
    collective: Optional[str] = None
    min_numel: int = 1024
    compress_1d: bool = False
    fusion: bool = True
    fusion_mb: float = 8.0
    pipeline: bool = True
    in_place: bool = False
    plan: Optional[str] = None  # None: "auto" under codec="auto", else "off"
    warmup: int = 0  # steps
    ramp: Optional[int] = None  # steps; None: DEFAULT_RAMP of the codec
    adaptive: Optional[str] = None  # None: "bytes" under codec="auto", else "off"
    adaptive_every: int = 100  # steps
    hierarchy: str = "auto"
    node_dtype: str = "fp32"
    timeout: Optional[float] = None  # seconds; None: the served process group's timeout
    options: Dict[str, Any] = field(default_factory=dict)
    collective_options: Dict[str, Any] = field(default_factory=dict)
    # where a setting came from when not from the script: "codec.bits" -> "GRADZIP_BITS=2"
    sources: Dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # settings the script chose: "codec.bits" -> "argument" (register's keywords) or "config"
    given: Dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative integer, got {self.min_numel!r}")
        for name in ("compress_1d", "fusion", "pipeline", "in_place"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if (isinstance(self.fusion_mb, bool) or not isinstance(self.fusion_mb, (int, float))
                or not 0 < self.fusion_mb < math.inf):
            raise ValueError(f"fusion_mb must be a positive, finite number of MiB, got {self.fusion_mb!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative number of steps, got {self.warmup!r}")
        if self.ramp is not None and (isinstance(self.ramp, bool) or not isinstance(self.ramp, int) or self.ramp < 0):
            raise ValueError(f"ramp must be a non-negative number of steps, got {self.ramp!r}")
        if isinstance(self.adaptive, bool):
            self.adaptive = "bytes" if self.adaptive else "off"
        if self.adaptive is not None and self.adaptive not in ADAPTIVE:
            raise ValueError(f"adaptive must be one of {', '.join(ADAPTIVE)} (or True/False), got {self.adaptive!r}")
        if isinstance(self.adaptive_every, bool) or not isinstance(self.adaptive_every, int) or self.adaptive_every < 2:
            raise ValueError(f"adaptive_every must be an integer of at least 2 steps, got {self.adaptive_every!r}")
        if isinstance(self.hierarchy, bool):  # GRADZIP_HIERARCHY=off reads as False
            self.hierarchy = "on" if self.hierarchy else "off"
        if self.hierarchy not in HIERARCHY:
            raise ValueError(f"hierarchy must be one of {', '.join(HIERARCHY)}, got {self.hierarchy!r}")
        if self.node_dtype not in NODE_DTYPES:
            raise ValueError(f"node_dtype must be one of {', '.join(NODE_DTYPES)}, got {self.node_dtype!r}")
        if isinstance(self.plan, bool):  # GRADZIP_PLAN=off reads as False
            self.plan = "auto" if self.plan else "off"
        if self.plan is not None and self.plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        if self.timeout is not None and (
            isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < math.inf
        ):
            raise ValueError(f"timeout must be None or a positive, finite number of seconds, got {self.timeout!r}")

    def resolved(self) -> "Config":
        """This config with ``codec="auto"`` spelled out: 4-bit ``maxmin`` (options given beside
        it still apply), residual error feedback unless a memory is named, ``plan="auto"`` unless
        ``plan`` is set, and adaptive levels (``"bytes"``) unless ``adaptive`` is set; an unset
        ``plan`` or ``adaptive`` is ``"off"`` for every other codec, and an unset ``ramp`` the
        codec's :data:`DEFAULT_RAMP`."""
        if self.codec != AUTO:
            if self.adaptive is not None and self.ramp is not None and self.plan is not None:
                return self
            return replace(
                self, adaptive=self.adaptive or "off", plan=self.plan or "off",
                ramp=self.ramp if self.ramp is not None else DEFAULT_RAMP.get(self.codec, 0),
                given=self._filled(("adaptive", "ramp", "plan"), "default"),
            )
        return replace(
            self, codec="maxmin", options={"bits": 4, **self.options}, memory=self.memory or "residual",
            plan=self.plan or AUTO,
            adaptive=self.adaptive if self.adaptive is not None else "bytes", ramp=self.ramp or 0,
            given=self._filled(("codec.bits", "memory", "plan", "adaptive", "ramp"), "codec 'auto'"),
        )

    def _filled(self, keys: Sequence[str], by: str) -> Dict[str, str]:
        """:attr:`given` with ``by`` as the origin of those ``keys`` nobody set (their value
        is then :meth:`resolved`'s, not a :class:`Config`'s of the user)."""
        return {**{k: by for k in keys if self.origin(k) == "default"}, **self.given}

    def with_env(self, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """This config with every ``GRADZIP_*`` variable of ``environ`` applied on top."""
        environ = os.environ if environ is None else environ
        updates: Dict[str, Any] = {}
        env_options: Dict[str, Any] = {}
        collective_options = dict(self.collective_options)
        sources = dict(self.sources)
        for key, text in sorted(environ.items()):
            if not key.startswith("GRADZIP_") or key == "GRADZIP_" or not text.strip():
                continue  # (a variable set empty is unset, as in a shell's ${X:-default})
            name = key[len("GRADZIP_"):].lower()
            value = parse_value(text)
            origin = f"{key}={text}"
            if name in FIELDS:
                if name in ("codec", "memory", "collective"):
                    updates[name] = text
                elif name in ("compress_1d", "fusion", "pipeline", "in_place") and value in (0, 1):
                    updates[name] = bool(value)
                else:
                    updates[name] = value
                sources[name] = origin
            elif name in COLLECTIVE_OPTIONS:
                collective_options[name] = value
                sources[f"collective.{name}"] = origin
            elif name in PROCESS_SETTINGS:
                sources[name] = origin
            else:
                env_options[name] = value
                sources[f"codec.{name}"] = origin
        switched = "codec" in updates and updates["codec"] != self.codec
        self._warn_conflicts(updates, env_options, collective_options, sources, switched)
        options = {} if switched else dict(self.options)  # another codec: the script's options no longer apply
        if switched and self.options:
            dropped = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items()) if k not in env_options)
            if dropped:
                warnings.warn(
                    f"{sources['codec']} replaces codec {self.codec!r}: its options ({dropped}) are dropped",
                    stacklevel=3,
                )
        if switched and "collective" not in updates:
            updates["collective"] = None  # nor does its collective: the new codec's default is used
        options.update(env_options)
        try:
            return replace(self, options=options, collective_options=collective_options, sources=sources, **updates)
        except ValueError as exc:  # a field's check: name the variables it may have come from
            given = sorted({sources[name] for name in updates if name in sources})
            if not given:
                raise
            raise type(exc)(f"{exc} (set in the environment: {', '.join(given)})") from exc

    def origin(self, key: str) -> str:
        """Where setting ``key`` (``"codec"``, ``"codec.bits"``, ``"min_numel"``, ...) came from:
        ``"environment GRADZIP_X=..."``, ``"argument"``, ``"config"`` or ``"default"``."""
        if key in self.sources:
            return f"environment {self.sources[key]}"
        if key in self.given:
            return self.given[key]
        if key.startswith("codec.") and key[len("codec."):] in self.options:
            return "config"
        if key.startswith("collective.") and key[len("collective."):] in self.collective_options:
            return "config"
        default = _DEFAULTS.get(key, _MISSING)
        if key in FIELDS and default is not _MISSING and getattr(self, key) != default:
            return "config"
        return "default"

    def _warn_conflicts(self, updates, env_options, collective_options, sources, switched) -> None:
        """Warn where a ``GRADZIP_*`` variable overrides a different value the script chose."""
        clashes = []
        for name, value in updates.items():
            mine = getattr(self, name)
            if name != "codec" and value != mine and self.origin(name) != "default":
                clashes.append((sources[name], f"{name}={mine!r}"))
        if not switched:  # after a codec switch the options are dropped (warned about below)
            for name, value in env_options.items():
                if name in self.options and self.options[name] != value:
                    clashes.append((sources[f"codec.{name}"], f"{name}={self.options[name]!r}"))
        for name, value in collective_options.items():
            if name in self.collective_options and self.collective_options[name] != value:
                clashes.append((sources[f"collective.{name}"], f"{name}={self.collective_options[name]!r}"))
        for origin, chosen in clashes:
            warnings.warn(f"{origin} overrides {chosen} set by the script", stacklevel=4)

    def environment_note(self) -> str:
        """``" (set in the environment: GRADZIP_X=..., ...)"``, or "" when nothing came from it."""
        if not self.sources:
            return ""
        return " (set in the environment: " + ", ".join(sorted(set(self.sources.values()))) + ")"


_MISSING = object()
_DEFAULTS = {name: getattr(Config, name) for name in FIELDS}
