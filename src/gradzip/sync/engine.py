"""The Communicator: codec + memory + collective on one process group, in one ordered worker.

Its fused paths (a group as one flat buffer, a job's plain sum, a DDP bucket in place) are in
:mod:`gradzip.sync.fused`, the residual settled as a collective releases its input in
:mod:`gradzip.sync.settle`, and the choices an accelerator changes in :mod:`gradzip.sync.device`.
"""
from __future__ import annotations

import atexit
import math
import time
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from .. import comm as _collectives
from ..comm import consistency
from . import memory as _memory
from .memory import wire_of
from ..codecs import registry as _registry
from ..codecs.base import FLOAT_DTYPES, Codec, hold_layouts, release_layouts, saturate
from ..comm.pool import BufferPool
from ..comm.allgather import default_collective
from ..comm.base import Collective, overlaps, parse_route, world
from ..comm.hierarchy import NODE_DTYPES, Hierarchical, plain_goes_hierarchical
from ..comm.shm import NodeSharedMemory
from ..comm.topology import Topology, detect as detect_topology, node_groups
from ..config import HIERARCHY
from ..errors import CheckpointError, CommunicationError
from ..kernels.fused import setting as kernels_setting
from ..kernels.native import available as native_available
from ..version import __version__
from . import device as _device
from .fused import FusedGroups
from .metrics import Metrics, record_of
from .pipeline import Pipeline, Stages, drive, lockstep, staged
from .groups import FusedLayout, group_key
from .places import Places
from .settle import PLAIN_RESIDUALS, input_read_after, poison_if, scratch_for, settle_into, settle_residual
from .worker import OrderedWorker

STATE_FORMAT = 2  # 2: one step counter ("step"); 1 had per-name counters and the hook's "hook_step"
# settings that :meth:`Communicator.settings` leaves out where they hold their default (so state
# saved before they existed still loads), with that default: how a mismatch names them
SETTINGS_LEFT_OUT = {"hierarchy": "auto", "node_dtype": "fp32"}

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
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds or a timedelta, got {timeout!r}")
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


@dataclass
class Batch:
    """Tensors to average over the engine's process group: what a front end hands the engine.

    The averages are written back into ``tensors`` (with their parameter ``names``, which key
    error feedback, randomness and metrics). ``compress[i]`` says whether tensor i goes through
    the codec; the others are summed exactly in one plain all-reduce. ``groups`` lists indices
    of compressed tensors that share one encoding (default: all of them, one group).
    ``buffer``: the memory the tensors lie in (a DDP bucket), what the exchange returns; with
    ``in_place`` and the tensors back to back in it, the engine averages it in its own memory
    where it can (:meth:`Communicator.in_place`). ``on_done(seconds)`` runs on the worker when
    the exchange has finished (the planner's drift watch).
    """

    tensors: Sequence[torch.Tensor]
    names: Sequence[str]
    compress: Sequence[bool]
    groups: Optional[Sequence[Sequence[int]]] = None
    buffer: Optional[torch.Tensor] = None
    in_place: bool = False
    on_done: Optional[Callable[[float], None]] = None

    def __post_init__(self) -> None:
        # (checked where it is made: a batch that fails on the worker fails the communicator)
        if not len(self.names) == len(self.compress) == len(self.tensors):
            raise ValueError(f"Batch: a name and a compress flag for each of the {len(self.tensors)} tensors, got "
                             f"{len(self.names)} names and {len(self.compress)} flags")
        odd = next((t for t in self.tensors if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES), None)
        if odd is not None:
            raise TypeError(f"Batch: floating-point tensors, got {getattr(odd, 'dtype', type(odd).__name__)}")


class Communicator(FusedGroups):
    """Compressed, averaged all-reduce of named tensors.

    ``Communicator("topk", ratio=0.01, memory="residual")``: codec options go as keywords;
    ``memory`` defaults to the codec's own default and ``collective`` to the first collective
    the codec supports, except that the all-gather takes the SRA's place at one or two ranks
    and across two nodes (:func:`~gradzip.comm.allgather.default_collective`);
    ``memory_options`` and ``collective_options`` (e.g. ``{"partitions": 8}`` for ``ps``) go to
    those. An impossible combination raises ``ValueError`` at construction. Every
    call is executed by one ordered worker thread, so calls made in the same order on every rank
    issue their collectives in the same order.

    Topology: with ``hierarchy="auto"`` (default) the ranks are grouped by node once, from the
    launcher's environment (:mod:`gradzip.comm.topology`; ``topology`` gives a layout instead);
    on several nodes of several ranks each, every compressed exchange becomes hierarchical
    (:mod:`gradzip.comm.hierarchy`): plain inside the node, the configured collective across
    nodes. ``"off"`` keeps it flat; ``"on"`` raises ``ValueError`` where the layout is not
    hierarchical. :meth:`describe_topology` says what was found.

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
        fusion: bool = True,
        pipeline: bool = True,
        timeout: Timeout = None,
        hierarchy: str = "auto",
        node_dtype: str = "fp32",
        topology: Optional[Topology] = None,
        verify_settings: bool = True,
        settings_extra: Optional[Mapping[str, Any]] = None,
        settings_sources: Optional[Mapping[str, str]] = None,
        **codec_options: Any,
    ) -> None:
        self.timeout = _as_timedelta(timeout) or group_timeout(group)
        try:  # every option is checked before the first collective
            if hierarchy not in HIERARCHY:
                raise ValueError(f"hierarchy must be one of {', '.join(HIERARCHY)}, got {hierarchy!r}")
            if node_dtype not in NODE_DTYPES:
                raise ValueError(f"node_dtype must be one of {', '.join(NODE_DTYPES)}, got {node_dtype!r}")
            kernels_setting()  # GRADZIP_KERNELS, read at the first encode: checked here
            self.codec = _registry.codec(codec, **codec_options)
            _check_declared(self.codec)
            memory = memory if memory is not None else self.codec.default_memory
            self.memory = _memory.memory(memory, **(memory_options or {}))
            _check_pair(self.codec, self.memory)
            # none named: the codec's own, or the one-round all-gather in place of the SRA at one
            # or two ranks (options given for the codec's own keep it, since they are that one's)
            self.collective_defaulted = collective is None and not collective_options
            self.collective_name = collective or (
                default_collective(self.codec, world(group)[1]) if self.collective_defaulted else self.codec.collective
            )
            self.collective = self._make_collective(self.collective_name, self.codec, collective_options or {}, group)
            self.codec.use_memory(self.memory)  # (flat until the nodes are found, below)
        except ValueError as exc:
            # the other ranks are about to meet this one in collectives: tell them why it is not
            # coming, or they would wait out the timeout and fail without a reason
            if verify_settings and dedicated_group:
                _report_failed_construction(group, self.timeout, exc, settings_sources)
            raise
        with consistency.every_rank_meets("make gradzip's process group", self.timeout):
            self.group = _dedicated_group(group, self.timeout) if dedicated_group else group
        self._owns_group = dedicated_group and self.group is not None
        self.collective.group = self.group
        self._hierarchy = hierarchy
        self._node_dtype = node_dtype  # of the intra-node stage of compressed exchanges (gradzip.comm.hierarchy)
        self.topology: Optional[Topology] = None
        self._node_groups: Optional[Tuple[Any, Any]] = None  # (this rank's node group, its group across nodes)
        self._owns_node_groups = True
        self._node_memory: Optional[NodeSharedMemory] = None
        self._plain_codec = _registry.codec("none")
        self._plain = _collectives.get("allreduce")(self.group)
        self._reduce_scatter: Optional[Collective] = None  # made on first use (sharded front ends)
        self._plain.flagged = False  # uncompressed: sums carry NaN/Inf to every rank alike, as DDP's do
        self._plain_memory = _memory.memory("none")
        # plain exchanges of at least this many values go hierarchically (exact: the node's sum,
        # a plain all-reduce of each share across nodes, the shares spread inside the node), on
        # a hierarchical gloo layout only; None: always flat. The planner sets it from its model
        # of the two links (gradzip.policy.planner.Costs.plain_hierarchy_from)
        self.plain_hierarchy_from: Optional[int] = None
        self._plain_hierarchical: Optional[Collective] = None
        # levels other than the codec's own (gradzip.policy.adaptive), set by register(): per parameter
        # (adaptive), or one for every parameter during a ramp (ramp_level, set step by step)
        self.level_codecs: Any = None  # gradzip.policy.adaptive.LevelCodecs
        self.levels: Any = None  # gradzip.policy.adaptive.AdaptiveLevels
        self.ramp_level: Any = None
        # exchanges other than the configured collective, chosen per parameter by the planner
        # (gradzip.policy.planner): a parameter's name -> a route (see route_label), and the collectives
        self.routes: Dict[str, str] = {}
        self._route_collectives: Dict[str, Collective] = {}
        self.metrics = Metrics()
        self.fusion = bool(fusion)
        self.pipelined = bool(pipeline)
        self._queued_on_stream: Dict[str, bool] = {}  # by device type (see queues_on_stream)
        # (a stage's failure is recorded before the jobs' futures fail: a caller woken by one
        # finds every later exchange refused, not only once the worker has unwound)
        self._pipeline = Pipeline(self.record_failure)
        self._group_residuals: Dict[str, torch.Tensor] = {}  # residual buffers per group key (see _group_residual)
        self._flat_pools: Dict[torch.dtype, BufferPool] = {}  # fused groups' input buffers, lent per exchange
        self._residual_key: Dict[str, str] = {}  # a parameter's name -> the bucket residual it lies in
        self._places: Dict[Tuple[Any, ...], Places] = {}  # uncompressed places of in-place buckets, per layout
        self._fused_layouts: Dict[Tuple[Any, ...], FusedLayout] = {}  # fused groups' layouts (see _fused_layout)
        self._layouts_step = 0
        # the one step counter: it keys every exchange's shared and private randomness (with the
        # tensor's name) and is what the DDP hook counts its backward passes with; see next_step
        self.step = 0
        self._named: set = set()  # names exchanged at this step without an explicit step
        self._worker: Optional[OrderedWorker] = None
        self._closed = False
        _OPEN.add(self)  # (closed at exit if the script does not: see _close_open)
        self._failure: Optional[CommunicationError] = None
        self._warned_unnamed = False  # (allreduce without a name, where state is kept by name)
        self._extra = dict(settings_extra or {})
        self._sources = dict(settings_sources or {})
        if verify_settings:
            with consistency.every_rank_meets("compare gradzip's settings", self.timeout):
                consistency.verify_same_on_all_ranks(self.settings(), self.group, self._sources, SETTINGS_LEFT_OUT)
        # several nodes of several ranks: the configured collective runs across nodes, inside a
        # plain intra-node stage (gradzip.comm.hierarchy). After the settings check, which
        # covers ``hierarchy``: every rank takes part in finding the nodes, or none does
        if hierarchy != "off" and dist.is_available() and dist.is_initialized():
            self.topology = topology if topology is not None else detect_topology(self.group)
            if hierarchy == "on" and not self.topology.hierarchical:
                raise ValueError(
                    f"hierarchy='on' needs several nodes with several ranks each; this job has {self.topology.reason} "
                    f"(found from {self.topology.source}); use hierarchy='auto' or 'off'"
                )
            if self.topology.hierarchical:
                whole = group is None or group is dist.group.WORLD
                self._node_groups = node_groups(self.topology, dist.get_backend(self.group), self.timeout, whole)
                if dist.get_backend(self.group) == "gloo":  # CPU tensors: the node's shared memory
                    self._node_memory = NodeSharedMemory(self._node_groups[0], self.topology)
                self._default_across_nodes()
                self.collective = self._hierarchical(self.collective)
                self._plain_hierarchical = self._hierarchical_plain()
                self.codec.use_memory(None)  # (it encodes the node's sums)
                if hierarchy == "on" and self.codec.needs_shapes:  # asked for, and not what happens
                    warnings.warn(
                        f"hierarchy='on': {self.codec.name} factorises each tensor, so its compressed exchange stays "
                        "flat across nodes (the node stage's flat shares could not be factorised); plain exchanges "
                        "still go through the nodes (see describe_topology())", stacklevel=2,
                    )
        hold_layouts()  # (the codecs' layout plans kept until the last communicator closes)
        if _backend(self.group) != "nccl" and kernels_setting() in ("auto", "native"):
            # CPU tensors: build the fused C kernels now (seconds, once per machine and version)
            # rather than inside the first step's encode, whose time the metrics would report
            native_available()

    def _make_collective(self, name: str, codec: Codec, options: Dict[str, Any], group) -> Collective:
        return make_collective(name, codec, options, group)

    def collective_for(self, name: str) -> Collective:
        """The collective that exchanges parameter ``name``: its planned route, else the configured one."""
        label = self.routes.get(name)
        return self.collective if label is None else self._route_collective(label)

    def _route_collective(self, label: str) -> Collective:
        """The collective of a route (made when first asked for, on this communicator's group)."""
        coll = self._route_collectives.get(label)
        if coll is None:
            coll_name, options = parse_route(label)
            flat = options.pop("hierarchy", 1) == 0  # the planner's flat alternative on a hierarchical layout
            node_dtype = options.pop("node", None)  # and its other node stage
            coll = self._make_collective(coll_name, self.codec, options, self.group)
            coll = self._route_collectives[label] = coll if flat else self._hierarchical(coll, node_dtype)
        return coll

    def _default_across_nodes(self) -> None:
        """A collective left to the communicator runs, on a hierarchical layout, across nodes on
        a group of one rank per node: chosen for that group's size (two nodes: the all-gather
        where the codec's own is the SRA), as every rank's topology, and so choice, is the same."""
        if self.collective_defaulted and self.topology is not None:
            name = default_collective(self.codec, len(self.topology.nodes))
            if name != self.collective_name:
                self.collective_name = name
                self.collective = self._make_collective(name, self.codec, {}, self.group)

    def _hierarchical(self, coll: Collective, node_dtype: Optional[str] = None, compressed: bool = True) -> Collective:
        """``coll`` moved across nodes, inside the intra-node stages (of ``node_dtype``, default
        the communicator's), where the topology is hierarchical; else ``coll`` as it is.

        A ``compressed`` exchange stays flat where the codec factorises each tensor by its shape
        (:attr:`Codec.needs_shapes`, PowerSGD): the node stage cuts a group into flat shares
        of 1/L each, which it could only send as they are, where flat its factors, a few
        hundredths of the gradients, cross the slow link."""
        if self._node_groups is None or self.topology is None or (compressed and self.codec.needs_shapes):
            return coll
        node, cross = self._node_groups
        coll.group = cross
        dtype = NODE_DTYPES[node_dtype or self._node_dtype]
        return Hierarchical(coll, node, self.topology, self._node_memory, dtype)

    def _hierarchical_plain(self) -> Optional[Collective]:
        """The exact hierarchical all-reduce for plain exchanges, on gloo (CPU ranks) only: NCCL's
        own algorithms already keep most bytes inside the node, gloo's ring does not (2 nodes ×
        2 ranks at 1 Gbit/s: a node's link carries 1.5× the gradients flat, 1× hierarchically)."""
        if self._node_groups is None or dist.get_backend(self.group) != "gloo":
            return None
        inner = _collectives.get("allreduce")(None)
        inner.flagged = False  # uncompressed: NaN/Inf reach every rank through the sums
        return self._hierarchical(inner, "fp32", compressed=False)  # exact

    def plain_goes_hierarchical(self, numel: int, element_size: int = 4) -> bool:
        """Whether a plain exchange of ``numel`` values of ``element_size`` bytes is hierarchical:
        from :attr:`plain_hierarchy_from` fp32 values' worth of bytes on, where the layout allows."""
        start = self.plain_hierarchy_from
        return self._plain_hierarchical is not None and plain_goes_hierarchical(start, numel, element_size)

    def plain_collective(self, t: torch.Tensor) -> Collective:
        """The collective of a plain exchange of ``t`` (see :meth:`plain_goes_hierarchical`)."""
        if self.plain_goes_hierarchical(t.numel(), t.element_size()):
            return self._plain_hierarchical
        return self._plain

    def sends_as_is(self, dtype: torch.dtype) -> bool:
        """Whether the compressed exchange of a gradient of ``dtype`` is DDP's own sum, value for
        value (non-finite values aside, which a plain sum spreads element by element): a codec
        that sends it as it is (``none``; ``fp16`` of fp16 gradients), no error feedback, the
        all-reduce, and one node (across nodes that exchange goes through them, DDP's flat)."""
        return (self.codec.sends_as_is(dtype) and not self.memory.stateful and self.collective_name == "allreduce"
                and not (self.topology is not None and self.topology.hierarchical))

    def _make_reduce_scatter(self) -> Collective:
        """The compressed reduce-scatter: flat, or on a hierarchical layout plain inside the node and
        compressed across nodes (:class:`~gradzip.comm.hierarchy.HierarchicalReduceScatter`)."""
        from ..comm.hierarchy import HierarchicalReduceScatter
        from ..comm.reducescatter import CompressedReduceScatter

        if self._node_groups is None or self.topology is None:
            return CompressedReduceScatter(self.group)
        node, cross = self._node_groups
        group = self.group
        chunk_of = None if group is None or group == dist.group.WORLD else (lambda r: dist.get_group_rank(group, r))
        return HierarchicalReduceScatter(CompressedReduceScatter(cross), node, self.topology, self._node_memory, chunk_of)

    def use_topology_of(self, other: "Communicator") -> None:
        """Exchange as ``other`` does across nodes, on its node groups (which stay ``other``'s):
        a probe of the same job (the planner's calibration) measures the same exchange."""
        self.topology = other.topology
        if other._node_groups is not None and self._node_groups is None:
            self._node_groups, self._owns_node_groups = other._node_groups, False
            self._node_memory = other._node_memory
            self._default_across_nodes()
            self.collective = self._hierarchical(self.collective)
            self._plain_hierarchical = self._hierarchical_plain()
            self.codec.use_memory(None)

    def describe_topology(self, reduce_scatter: bool = False) -> Dict[str, Any]:
        """The nodes found, whether the exchange is hierarchical, and which link each stage uses
        (of the all-reduce, or with ``reduce_scatter`` of :meth:`reduce_scatter`'s exchange)."""
        if self.topology is None:
            return {"hierarchical": False, "flat_because": "hierarchy='off'"}
        out = self.topology.describe()
        if reduce_scatter and self._reduce_scatter is None:
            self._reduce_scatter = self._make_reduce_scatter()
        coll = self._reduce_scatter if reduce_scatter else self.collective
        if isinstance(coll, Hierarchical):
            out.update(coll.describe())
        elif out.get("hierarchical") and not reduce_scatter and self.codec.needs_shapes:
            out.update(hierarchical=False, flat_because=f"{self.codec.name} factorises each tensor: the node "
                       "stage's flat shares could not be compressed (plain exchanges still go through the nodes)")
        return out

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
        out: Dict[str, Any] = {"gradzip": __version__, "codec": self.codec.name}
        out.update({f"codec.{k}": v for k, v in self.codec.config().items()})
        out["memory"] = self.memory.name
        out.update({f"memory.{k}": v for k, v in self.memory.config().items()})
        out["collective"] = self.collective_name
        out.update({f"collective.{k}": v for k, v in self.collective.config().items()})
        if (self.codec.fusion_block() > 0 or self.codec.parts_format) and (
            not self.fusion or self._records_fusion_always()
        ):
            # (a codec fused by its parts, or fused later, records only the non-default:
            # checkpoints saved before it was fused still load)
            out["fusion"] = self.fusion
        if self._hierarchy != SETTINGS_LEFT_OUT["hierarchy"]:  # absent by default (see SETTINGS_LEFT_OUT)
            out["hierarchy"] = self._hierarchy
        if self._node_dtype != SETTINGS_LEFT_OUT["node_dtype"]:  # likewise
            out["node_dtype"] = self._node_dtype
        if self.topology is not None and self.topology.hierarchical:  # the bytes of a hierarchical exchange differ
            out["topology"] = f"{len(self.topology.nodes)}x{self.topology.local_size}"
        out["pipeline"] = self.pipelined  # pipelined ranks issue collectives in another order
        if not self.codec.kernels_bit_exact:
            out["kernels"] = _kernels_in_use(self.group)
        out.update(self._extra)
        return out

    def _records_fusion_always(self) -> bool:
        """Whether the settings hold ``fusion`` on or off (max-min and the codecs fused from the
        first); the others, fused later, record it only when off."""
        return self.codec.fusion_block() > 0 and self.codec.records_fusion

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
        if not name and not self._warned_unnamed and (self.memory.name != "none" or self.codec.tensor_state):
            self._warned_unnamed = True
            warnings.warn(
                f"gradzip: allreduce without a name, with {self.memory.name!r} memory and codec {self.codec.name!r}: "
                "the state kept for a tensor (its residual, momentum or factors) is keyed by its name, so every "
                "tensor sent without one shares it, and two different tensors would mix theirs; pass name= (one per "
                "tensor, the same on every rank)", stacklevel=2,
            )

        def job() -> torch.Tensor:
            if t.is_cuda:  # read on the worker's stream: keep the caller's memory until then
                t.record_stream(torch.cuda.current_stream(t.device))
            return self.reduce_now(t, name, out=out, step=step)

        step = self._step_of([name])  # taken on the caller's thread, in the caller's order
        return self.submit(job, t.device, what=f"step {step} of tensor {name!r}")

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

    def submit_staged(
        self, make_stages: Callable[[], Stages], device: torch.device, what: str = "", flush: bool = True,
    ) -> torch.futures.Future:
        """Run a job of stages (:meth:`reduce_many_stages`) in the pipeline of the ordered worker.

        The job's first stage runs when it reaches the worker; its later stages run as later
        jobs arrive (see :mod:`gradzip.sync.pipeline`), and all of them when ``flush`` is set (the
        last bucket of a backward pass) or the job is not staged (:meth:`pipelines`). Every rank
        must submit the same jobs with the same ``flush`` flags. The future completes with the
        job's return value.
        """
        fut = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
        in_pipeline = self.pipelines(device)

        def arrive() -> None:
            self._pipeline.arrive(make_stages(), fut, what, flush or not in_pipeline)

        def settle(arrival: torch.futures.Future) -> None:
            try:
                arrival.wait()
            except Exception as exc:  # the job never started (an earlier failure), or a stage failed
                if not fut.done():
                    fut.set_exception(exc)

        self.submit(arrive, device, what).add_done_callback(settle)
        return fut

    def pipelines(self, device: torch.device) -> bool:
        """Whether jobs on ``device``'s tensors are staged in the pipeline: with ``pipeline`` on,
        unless their collectives are queued on the device's stream (:meth:`queues_on_stream`).

        Staging pays where waiting for a collective blocks the worker thread (gloo, on the CPU
        or with CUDA tensors): it encodes the next job meanwhile. NCCL's worker never waits, so
        a job held back for the next one to arrive would only finish later, and the last jobs
        of a backward pass would pile up after it. Measured on an H200 at one rank over NCCL
        (ResNet-50, GPT-2 small, 32 MiB groups): the 4-bit hook's overhead 4.2 → 3.4 ms and
        5.0 → 3.6 ms with the jobs run through."""
        return self.pipelined and not self.queues_on_stream(device)

    def queues_on_stream(self, device: torch.device) -> bool:
        """Whether this communicator's collectives on ``device``'s tensors go through NCCL,
        which queues them on the device's stream instead of blocking the thread that waits."""
        queued = self._queued_on_stream.get(device.type)
        if queued is None:
            queued = self._queued_on_stream[device.type] = _device.collectives_queue_on_stream(self.group, device)
        return queued

    def submit_batch(
        self, batch: Batch, step: int, device: torch.device, what: str = "", flush: bool = True,
    ) -> torch.futures.Future:
        """Average ``batch`` (on ``device``) in the pipeline of the ordered worker: the engine's
        one entry point for front ends. The future completes with ``batch.buffer`` (or the
        averaged tensors) once they hold the averages; see :meth:`submit_staged` for ``flush``."""
        return self.submit_staged(lambda: self.batch_stages(batch, step), device, what=what, flush=flush)

    def batch_stages(self, batch: Batch, step: int) -> Stages:
        """The stages of :meth:`submit_batch`: the bucket averaged in its own memory where
        :meth:`in_place` allows, else the plain all-reduce beside the fused groups."""
        started = time.perf_counter()
        if batch.in_place and batch.buffer is not None and self.in_place(batch.buffer, batch.tensors, batch.names, batch.compress):
            yield from self.bucket_stages(batch.buffer, batch.tensors, batch.names, batch.compress, step)
            result: Any = batch.buffer
        else:
            result = yield from self.reduce_many_stages(
                batch.tensors, batch.names, batch.compress, inplace=True, groups=batch.groups, step=step,
            )
            if batch.buffer is not None:
                result = batch.buffer
        if batch.on_done is not None:
            batch.on_done(time.perf_counter() - started)
        return result

    def flush(self) -> None:
        """Finish every pipelined job still in flight (without waiting for a flushing job); on
        CUDA the caller's current stream then waits for their kernels."""
        if self._worker is not None:
            self._worker.submit(lambda: self._guarded(self._pipeline.drain, "flush")).wait()
            self._worker.order_after_jobs()

    def complete_after_jobs(self, fut: torch.futures.Future, value: Any) -> None:
        """Complete ``fut`` with ``value``; on CUDA its waiters are ordered after the kernels
        and collectives that the jobs run so far queued on the worker's side stream (see
        :meth:`OrderedWorker.complete_after_jobs`): for a future that combines jobs' futures."""
        if self._worker is None:
            fut.set_result(value)
        else:
            self._worker.complete_after_jobs(fut, value)

    def _guarded(self, fn: Callable[[], Any], what: str) -> Any:
        earlier = self.earlier_failure(what)
        if earlier is not None:
            raise earlier
        start = time.monotonic()
        try:
            return fn()
        except CommunicationError as exc:  # a pipelined job's failure, already described
            self._failure = self._failure or exc
            raise
        except Exception as exc:
            raise self.record_failure(what, exc, time.monotonic() - start) from exc

    @property
    def failed(self) -> bool:
        """Whether an exchange has failed (every later one then fails at once)."""
        return self._failure is not None

    def earlier_failure(self, what: str) -> Optional[CommunicationError]:
        """The error for ``what`` when an earlier exchange has failed (it would only time out
        again), else None."""
        if self._failure is None:
            return None
        err = CommunicationError(
            f"gradzip (rank {self.rank} of {self.world_size}): {what or 'exchange'} not attempted: "
            f"an earlier exchange failed ({self._failure.brief})"
        )
        err.__cause__ = self._failure
        return err

    def record_failure(self, what: str, exc: BaseException, seconds: float) -> CommunicationError:
        """Describe the failure of ``what`` (after ``seconds``) and remember it: every later
        exchange then fails at once. Returns the error to raise: the first one recorded, when
        exchanges in flight together fail together."""
        if self._failure is None:
            err = self._failed(what, exc, seconds)
            err.__cause__ = exc
            self._failure = err
        return self._failure

    def _failed(self, what: str, exc: BaseException, seconds: float) -> CommunicationError:
        limit = self.timeout.total_seconds() if self.timeout is not None else None
        cause = " ".join(str(exc).split()) or type(exc).__name__
        if len(cause) > 300:
            cause = cause[:300] + " ..."
        if limit is not None and seconds >= 0.9 * limit:
            hint = f"no answer within the process group's timeout of {limit:g} s: another rank has stalled or died"
        elif not consistency.from_collective(exc):
            hint = "the error was raised on this rank, not by a collective"
        else:
            hint = "another rank may have stalled, died or issued different collectives"
            hint += f" (timeout {limit:g} s)" if limit is not None else ""
        brief = f"{what or 'exchange'} failed after {seconds:.1f} s"
        return CommunicationError(
            f"gradzip (rank {self.rank} of {self.world_size}): {brief}; {hint}. {type(exc).__name__}: {cause}", brief,
        )

    def reduce_now(
        self, t: torch.Tensor, name: str, compress: bool = True, out: Optional[torch.Tensor] = None,
        step: Optional[int] = None,
    ) -> torch.Tensor:
        """Encode, exchange and decode ``t`` in the calling thread (the worker's job); into ``out``
        if given. ``step``: the step it belongs to (default: see :meth:`next_step`)."""
        return drive(self._reduce_one(t, name, compress, out, self._step_of([name]) if step is None else step))

    def reduce_scatter(
        self, x: torch.Tensor, out: torch.Tensor, name: str, step: Optional[int] = None, in_place: bool = False,
    ) -> torch.Tensor:
        """Average ``x`` over the group and write this rank's chunk of the average into ``out``.

        ``x`` holds every rank's chunk in rank order (``W × out.numel()`` values, any shape), as
        a sharded front end hands its unsharded gradient over (FSDP2's reduce-scatter). The
        chunks are compressed with the codec and exchanged by one all-to-all
        (:class:`~gradzip.comm.reducescatter.CompressedReduceScatter`); on several nodes of
        several ranks summed exactly inside the node first and compressed across nodes only
        (:class:`~gradzip.comm.hierarchy.HierarchicalReduceScatter`). With error feedback the
        memory keeps what this rank's input lost, all of it, under ``name``. In the calling
        thread; all-NaN where any rank's input was not finite. Returns ``out``. ``in_place``:
        ``x`` is the caller's to overwrite (FSDP2's reduce-scatter input, which it drops after):
        the residual is added to it where it stands, with no new tensor of its size."""
        if self._closed:  # (its collective has let go of the group: see close)
            raise RuntimeError("this Communicator has been closed")
        w = self.world_size
        if x.numel() != w * out.numel():
            raise ValueError(f"reduce_scatter: input has {x.numel()} values, needs {w} x {out.numel()}")
        if self._reduce_scatter is None:
            self._reduce_scatter = self._make_reduce_scatter()
        step = self._step_of([name]) if step is None else step
        codec, mem, coll = self.codec_for(name), self.memory, self._reduce_scatter

        def run() -> torch.Tensor:
            flat = x.reshape(-1)
            if in_place and mem.stateful and flat.is_contiguous() and flat.dtype == mem.input_dtype(flat.dtype):
                inp = mem.compensate_into(flat, name, flat)
            else:
                inp = mem.compensate(flat.contiguous(), name)
            avg, dest, record = drive(self._exchange(coll, codec, mem, inp, name, step, out, True, wire_of(flat, inp)))
            if dest is None:
                out.copy_(avg.view(out.shape))
            self.metrics.record(name, x.numel() * x.element_size(), **record)
            return out

        return self._guarded(run, f"step {step}, reduce-scatter of {name}")

    def next_step(self) -> int:
        """End the current step: later exchanges belong to the next one. The step so ended.

        The DDP hook calls it when a backward pass hands over its last bucket. Callers that give
        no step of their own need not: exchanging a name a second time in one step starts the
        next step, so a loop that exchanges its tensors once per iteration counts iterations.
        """
        ended, self.step = self.step, self.step + 1
        self._named.clear()
        return ended

    def _step_of(self, names: Sequence[str]) -> int:
        """The step of an exchange of ``names`` called without one (see :meth:`next_step`)."""
        if any(n in self._named for n in names):
            self.next_step()
        self._named.update(names)
        return self.step

    def _reduce_one(self, t: torch.Tensor, name: str, compress: bool, out: Optional[torch.Tensor], step: int) -> Stages:
        """The stages of :meth:`reduce_now`."""
        started = time.perf_counter()
        avg, record = yield from self._reduce(t, name, compress, out, step)
        self.metrics.record(name, t.numel() * t.element_size(), **record)
        if compress:
            self.metrics.record_group_time(group_key([name]), time.perf_counter() - started)
        return avg

    def _reduce(self, t: torch.Tensor, name: str, compress: bool, out: Optional[torch.Tensor], step: int) -> Stages:
        """The stages of :meth:`reduce_now` without recording; returns (the average, the metrics of this call)."""
        _check_out(t, out)
        if compress:
            codec, coll, mem = self.codec_for(name), self.collective_for(name), self.memory
        else:
            codec, coll, mem = self._plain_codec, self.plain_collective(t), self._plain_memory
        if t.numel() == 0:
            return (t.clone() if out is None else out), record_of(None, 0, 0.0, compress, codec)
        inp = self._compensated(mem, coll, t, name, step, compress, into=out)
        avg, dest, record = yield from self._exchange(coll, codec, mem, inp, name, step, out, compress, wire_of(t, inp))
        return _delivered(t, out, avg, dest), record

    def _compensated(self, mem: Any, coll: Collective, t: torch.Tensor, name: str, step: int, compress: bool,
                     into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The codec's input for one gradient: ``mem``'s compensation, in the gradient's shape
        (low-rank codecs need it); observed for adaptive levels on their sampled steps. Where
        the average goes into the gradient itself (``into`` is ``t``) and the memory makes the
        input again when it updates (:attr:`~gradzip.sync.memory.Memory.remakes_input`: DGC's),
        it is compensated there: no tensor of the gradient's size is held through the exchange,
        unless the collective ``coll`` reads the input after the exchange (:func:`input_read_after`)."""
        in_place = into is t and mem.stateful and not input_read_after(mem, coll)
        if in_place and t.is_contiguous() and t.dtype == mem.input_dtype(t.dtype):
            inp = mem.compensate_into(t, name, t)
        else:
            inp = mem.compensate(t.contiguous(), name)
        if compress:
            self._observe([name], [inp], step)
        return inp

    def _observe(self, names: Sequence[str], inputs: Sequence[torch.Tensor], step: int) -> None:
        """The codec's inputs observed for adaptive levels, on their sampled steps."""
        if self.levels is not None and self.levels.sampling:
            for name, inp in zip(names, inputs):
                self.levels.observe(name, inp, step)

    def _exchange(
        self, coll: Collective, codec: Codec, mem: Any, inp: torch.Tensor, name: str, step: int,
        out: Optional[torch.Tensor], compress: bool, wire: Optional[torch.dtype] = None,
    ) -> Stages:
        """``inp`` (compensated by ``mem``) through ``coll``, error feedback settled: returns
        (the result, all-NaN where some rank's input was not; where it went: ``out`` flat when
        the collective could write there, else None; the metrics of the call). ``wire``: the
        gradient's dtype where ``inp`` is a wider compensation of it (:func:`wire_of`)."""
        dest = _dest(out, inp, mem, coll)
        res = yield from staged(coll.stages(codec, inp, name, step, need_own=mem.stateful, out=dest, wire=wire))
        avg, record = self._settled(coll, codec, mem, inp, name, res, compress)
        return avg, dest, record

    def _settled(self, coll: Collective, codec: Codec, mem: Any, inp: torch.Tensor, name: str, res: Any, compress: bool,
                 update: bool = True, sent_per_byte: Optional[float] = None):
        """After one tensor's exchange: its memory updated (kept on a non-finite step; not
        here when ``update`` is False: the caller updated it), the average (all-NaN where some
        rank's input was not finite) and the metrics of the call. ``sent_per_byte``: the
        collective's, when the caller has it (a batch asks once, not once a tensor)."""
        if mem.stateful and update:
            mem.update(name, inp, res.own.view(inp.shape), skip=res.nonfinite)
        # a fresh tensor, or dest; an unflagged (plain) sum's flag is always False: no pass for it
        avg = poison_if(res.avg, res) if coll.flagged else res.avg
        wire = res.wire_bytes if res.payload_bytes is None else res.payload_bytes  # one encoding (metrics.py)
        if sent_per_byte is None:
            sent_per_byte = coll.sent_per_byte(self.world_size)
        return avg, record_of(res, wire, sent_per_byte, compress, codec)

    def _batchable(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> bool:
        """Whether these gradients, which cannot share one encoding, can share one collective
        call (:meth:`_reduce_batched`): one codec and one collective that moves several tensors
        together, and none empty."""
        if not self.fusion or len(tensors) < 2 or any(t.numel() == 0 for t in tensors):
            return False
        codec, coll = self.codec_for(names[0]), self.collective_for(names[0])
        if type(coll).exchange_many is Collective.exchange_many:
            return False  # it would exchange them one by one anyway
        return all(self.codec_for(n) is codec and self.collective_for(n) is coll for n in names)

    def _reduce_batched(self, tensors: Sequence[torch.Tensor], names: Sequence[str], inplace: bool, step: int) -> Stages:
        """Gradients that cannot share one encoding (PowerSGD's matrices, random-k) in one call
        of a collective that moves them together (:meth:`Collective.stages_many`): each encoded
        and decoded on its own, their payloads summed in one all-reduce per round, not one per
        gradient. One non-finite flag covers them, as it covers a fused group."""
        started = time.perf_counter()
        codec, coll, mem = self.codec_for(names[0]), self.collective_for(names[0]), self.memory
        if self._settles_batch_in_place(tensors, inplace, names):
            results = yield from self._batch_in_place(codec, coll, tensors, names, step)
            inputs, dests, settled = list(tensors), [t.view(-1) for t in tensors], True
        else:
            inputs = mem.compensate_many([t.contiguous() for t in tensors], names)  # a few multi-tensor operations
            self._observe(names, inputs, step)
            dests = [_dest(t if inplace else None, x, mem, coll) for t, x in zip(tensors, inputs)]
            results = yield from coll.stages_many(codec, inputs, names, step, mem.stateful, dests,
                                                  wires=[wire_of(t, x) for t, x in zip(tensors, inputs)])
            settled = not mem.stateful
        one_flag = all(res.nonfinite is results[0].nonfinite for res in results)
        if not settled and one_flag:  # one flag covers the batch: the residuals updated together
            mem.update_many(names, inputs, [res.own for res in results], skip=results[0].nonfinite)
        out, sent = [], coll.sent_per_byte(self.world_size)
        update = not (settled or one_flag)  # each residual on its own: flags per gradient, not settled
        for t, name, x, dest, res in zip(tensors, names, inputs, dests, results):
            avg, record = self._settled(coll, codec, mem, x, name, res, True, update=update, sent_per_byte=sent)
            out.append(_delivered(t, t if inplace else None, avg, dest))
            self.metrics.record(name, t.numel() * t.element_size(), **record)
        self.metrics.record_group_time(group_key(sorted(names)), time.perf_counter() - started)
        return out

    def _settles_batch_in_place(self, tensors: Sequence[torch.Tensor], inplace: bool, names: Sequence[str]) -> bool:
        """Whether gradients that cannot share an encoding, with error feedback, can each be
        compensated where it lies and its residual settled as the collective releases it
        (:meth:`_batch_in_place`): on DDP's path (the averages overwrite the gradients anyway),
        fp32 gradients, a plain residual memory (:data:`PLAIN_RESIDUALS`), one codec and one
        collective that releases its inputs before it writes the averages."""
        if not (inplace and tensors and self.memory.name in PLAIN_RESIDUALS):
            return False
        codec, coll = self.codec_for(names[0]), self.collective_for(names[0])
        return coll.releases_input and all(
            t.is_contiguous() and t.dtype == torch.float32 and t.numel() > 0
            and self.codec_for(n) is codec and self.collective_for(n) is coll for t, n in zip(tensors, names)
        )

    def _batch_in_place(self, codec: Codec, coll: Collective, tensors: Sequence[torch.Tensor], names: Sequence[str],
                        step: int) -> Stages:
        """The exchange of a batch with error feedback in its own memory: each gradient
        compensated in place (a few multi-tensor operations), exchanged, its residual settled
        from its own payloads when the collective releases it, and its average written over it.
        No compensated copy of the batch, and no buffer of this rank's decoded payloads kept from
        step to step per tensor (what :meth:`Memory.update_many` needs): the same values. On an
        accelerator the new residuals go to one scratch buffer and the agreed flag picks old or
        new in one operation, as for a fused group (:func:`settle_residual`)."""
        mem = self.memory
        residuals, had = mem.residuals_for(names, tensors)
        if mem.gamma != 1.0:
            torch._foreach_mul_(list(tensors), mem.gamma)
        owed = [i for i, h in enumerate(had) if h]  # a residual of zeros would turn -0.0 into +0.0
        if owed:
            torch._foreach_add_([tensors[i] for i in owed], [residuals[i] for i in owed], alpha=mem.beta)
        self._observe(names, tensors, step)
        flat = scratch = None
        lent: List[torch.Tensor] = []
        try:
            if _device.reads_flag_on_host(tensors[0].device):
                settles = [settle_residual(r.view(-1)) for r in residuals]
            else:
                flat = mem.flat_residuals(names, residuals)
                scratch = scratch_for(flat, self._pool(torch.float32, step), lent)  # lent until the pick
                parts = _unflatten_dense_tensors(scratch, residuals)
                settles = [settle_into(part) for part in parts]
            results = yield from coll.stages_many(codec, list(tensors), names, step, True,
                                                  [t.view(-1) for t in tensors], on_release=settles)
            if flat is not None:
                if all(res.nonfinite is results[0].nonfinite for res in results):  # one flag covers the batch
                    torch.where(results[0].nonfinite, flat, scratch, out=flat)
                else:  # exchanged side by side, each with its own flag
                    for name, part, res in zip(names, parts, results):
                        old = mem.residuals[name]
                        torch.where(res.nonfinite, old, part, out=old)
        finally:
            if lent:
                self._flat_pools[torch.float32].give_back(lent)
        return results

    def reduce_many_now(
        self, tensors: Sequence[torch.Tensor], names: Sequence[str], compress: Sequence[bool], inplace: bool = False,
        step: Optional[int] = None,
    ) -> List[torch.Tensor]:
        """Reduce several tensors: the uncompressed ones fused into one plain all-reduce, the
        compressed ones fused into one encoding where the codec allows (:meth:`_reduce_fused`).

        With ``inplace`` the averages are written into ``tensors`` themselves (as DDP's bucket
        views want them), and those are returned. The metrics of a fused call are recorded per
        parameter name (each with its share), so they do not depend on how the parameters were
        grouped into buckets.
        """
        return drive(self.reduce_many_stages(tensors, names, compress, inplace, step=step))

    def reduce_many_stages(
        self, tensors: Sequence[torch.Tensor], names: Sequence[str], compress: Sequence[bool], inplace: bool = False,
        groups: Optional[Sequence[Sequence[int]]] = None, step: Optional[int] = None,
    ) -> Stages:
        """The stages of :meth:`reduce_many_now` (for :meth:`submit_staged`): the uncompressed
        all-reduce and the compressed exchanges advance side by side. ``groups``: indices of
        the compressed tensors that share one encoding (default: all of them, one group).
        ``step``: give it when the stages run on another thread (default: see :meth:`next_step`,
        counted when the stages start)."""
        if step is None:
            step = self._step_of(names)
        plain = [i for i, c in enumerate(compress) if not c]
        if groups is None:
            groups = [[i for i, c in enumerate(compress) if c]]
        else:  # (a tensor summed plain is not also exchanged compressed: the same memory, twice at once)
            groups = [kept for kept in ([i for i in group if compress[i]] for group in groups) if kept]
        parts, owners = [], []
        for dtype in dict.fromkeys(tensors[i].dtype for i in plain):  # one exact sum per dtype
            same = [i for i in plain if tensors[i].dtype == dtype]
            parts.append(self._reduce_plain([tensors[i] for i in same], [names[i] for i in same], inplace, step))
            owners.append(same)
        alone = []  # gradients that cannot share an encoding
        for group in groups:
            if self._fusable([tensors[i] for i in group], [names[i] for i in group]):
                parts.append(self._reduce_fused([tensors[i] for i in group], [names[i] for i in group], inplace, step))
                owners.append(list(group))
            else:
                alone.extend(group)
        if self._batchable([tensors[i] for i in alone], [names[i] for i in alone]):
            parts.append(self._reduce_batched([tensors[i] for i in alone], [names[i] for i in alone], inplace, step))
            owners.append(alone)
        else:  # one by one, each with its own flag (on DDP's path in its own memory: see _batch_in_place)
            for i in alone:
                if self._settles_batch_in_place([tensors[i]], inplace, [names[i]]):
                    parts.append(self._reduce_batched([tensors[i]], [names[i]], inplace, step))
                    owners.append([i])
                else:
                    parts.append(self._reduce_one(tensors[i], names[i], True, tensors[i] if inplace else None, step))
                    owners.append(i)
        results = yield from lockstep(parts)
        out: List[Optional[torch.Tensor]] = [None] * len(tensors)
        for owner, result in zip(owners, results):
            if isinstance(owner, list):
                for i, avg in zip(owner, result):
                    out[i] = avg
            else:
                out[owner] = result
        return out

    def codec_for(self, name: str) -> Codec:
        """The codec that compresses parameter ``name``: the one of the ramp's present level, of
        the parameter's adaptive level (:mod:`gradzip.policy.adaptive`), or the configured one."""
        if self.ramp_level is not None and self.level_codecs is not None:
            return self.level_codecs.get(self.ramp_level)
        return self.codec if self.levels is None else self.levels.codec_for(name)

    # ------------------------------------------------------------------ state
    def stats(self, per_tensor: bool = False) -> Dict[str, Any]:
        """This rank's metrics (see :mod:`gradzip.sync.metrics` for what each figure means)."""
        out = self.metrics.summary(per_tensor)
        out["world_size"] = self.world_size
        return out

    def state_dict(self) -> Dict[str, Any]:
        """This rank's state, with whose it is: rank, world size and the settings' fingerprint.

        It holds everything the next step needs to move the same bytes as an uninterrupted run:
        error-feedback residuals, the codec's per-tensor state, the collective's call counter and
        the step counter that keys all randomness (shared and private).
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
            "route_collectives": {label: c.state_dict() for label, c in self._route_collectives.items()},
            # the next step to run: a step that has begun (standalone calls) counts as done
            "step": self.step + 1 if self._named else self.step,
            "levels": self.levels.state_dict() if self.levels is not None else None,
            "level_codecs": self.level_codecs.state_dict() if self.level_codecs is not None else None,
        }

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict` of this same rank, world size and configuration.

        Anything else raises :class:`~gradzip.errors.CheckpointError` unless ``strict=False``,
        which loads what still applies and drops, with a warning, what does not: per-rank state
        (error-feedback residuals, a codec's per-tensor state) is kept
        only for the same rank of the same world size, because it is this rank's own unsent
        gradient (loaded on another rank, or summed over a different number of ranks, it would
        be applied to the wrong replica or the wrong number of times); codec, memory and
        collective state only where their settings are unchanged. The step counter always carries over.
        """
        problems, same_rank, same = self._compare_owner(state)
        if problems and strict:
            raise CheckpointError(
                f"gradzip (rank {self.rank} of {self.world_size}): this state dict does not belong here: "
                + "; ".join(problems)
                + ". Load each rank's own state saved with the same settings, or pass strict=False to load "
                "what still applies (a warning names what is dropped: another rank's residuals, state of "
                "settings that changed)."
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
            for label, coll_state in (state.get("route_collectives") or {}).items():
                if label in self.routes.values():  # the planner chose it again
                    self._route_collective(label).load_state_dict(coll_state)
        self.step = _saved_step(state)
        self._named.clear()
        if self.levels is not None and state.get("levels") and same("adaptive") and same("codec"):
            levels = dict(state["levels"])
            if not same_rank:  # this rank's own partial sums
                levels.pop("errors", None)
                levels.pop("seen", None)
            self.levels.load_state_dict(levels)
        if self.level_codecs is not None and state.get("level_codecs") and same("codec"):
            key = self.codec.tensor_state  # per-rank, as the configured codec's
            if same_rank or not key:
                self.level_codecs.load_state_dict(state["level_codecs"])
            else:
                dropped.append(f"codec {key} of other levels")
        if problems:  # (also where all of it still applies: a strict load refused the same difference)
            warnings.warn(
                f"gradzip (rank {self.rank}): loaded a state dict that does not match ({'; '.join(problems)}); "
                f"dropped: {', '.join(dropped) or 'nothing (all of it still applies)'}",
                stacklevel=2,
            )

    def owns(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` is this rank's own, saved with these settings: what
        :meth:`load_state_dict` loads whole, strict or not."""
        return not self._compare_owner(state)[0]

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
        if "fusion" not in theirs and mine.get("fusion") is False and not self._records_fusion_always():
            del mine["fusion"]  # saved before this codec was fused (it records ``fusion`` only when off): it ran unfused, as this run does
        if state.get("fingerprint") != consistency.fingerprint(mine):
            lines = consistency.differences([theirs, mine], [{}, self._sources], ["the checkpoint", "this run"],
                                            SETTINGS_LEFT_OUT)
            problems.append("its settings differ: " + ("; ".join(lines) or "fingerprint differs"))
        same_rank = state.get("rank") == self.rank and state.get("world_size") == self.world_size

        def same(prefix: str) -> bool:
            keys = {k for k in set(mine) | set(theirs) if k == prefix or k.startswith(prefix + ".")}
            return all(mine.get(k) == theirs.get(k) for k in keys)

        return problems, same_rank, same

    def close(self, wait: bool = True) -> None:
        """Stop the worker thread and release the dedicated process group. ``wait=False`` (at
        exit): no flush; the worker runs what is queued and stops, and a job stuck in a
        collective gets 10 s before the group is released under it."""
        if self._closed:
            return
        if wait and self._worker is not None and self._failure is None:
            try:
                self.flush()
            except CommunicationError:
                pass  # already raised to the caller of the failed job
        self._closed = True
        if self._worker is not None:
            self._worker.close(timeout=60.0 if wait else 10.0)
        # buffers several times the gradients' size: free them now, not when the state is collected
        self._group_residuals.clear()
        self._flat_pools.clear()
        self._places.clear()
        self._fused_layouts.clear()
        release_layouts()  # (the last to close: the codecs' plans a fused layout each, and their device tensors)
        # the collectives let go of their buffers and of the process groups, so that a group
        # destroyed below is freed now, its gloo threads joined, not when the interpreter
        # finalises: a thread of it that still drops its last collective's tensors then needs
        # the GIL, and the interpreter ends such a thread by unwinding C++ frames, which aborts
        # the process ("terminate called without an active exception")
        for coll in [self.collective, self._plain, self._reduce_scatter, self._plain_hierarchical,
                     *self._route_collectives.values()]:
            if coll is not None:
                coll.release()
        if self._node_memory is not None and self._owns_node_groups:
            self._node_memory.release()
        self._node_memory = None
        if self._node_groups is not None and self._owns_node_groups and dist.is_initialized():
            for g in self._node_groups:
                dist.destroy_process_group(g)
        self._node_groups = None
        if self._owns_group and dist.is_initialized():  # a group it was lent stays its owner's
            dist.destroy_process_group(self.group)
            self.group = None


_OPEN: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    """Close the communicators a script left open before the interpreter finalises, so their
    process groups go now (see :meth:`Communicator.close`). Registered after the worker
    module's handler, so it runs first."""
    for comm in list(_OPEN):
        try:
            comm.close(wait=False)
        except Exception:  # at exit there is no one to raise to
            pass


def make_collective(name: str, codec: Codec, options: Dict[str, Any], group) -> Collective:
    """Collective ``name`` with ``options`` on ``group`` for ``codec``: ``ValueError`` for an
    unknown collective, option or value, or one the codec cannot use (naming those it can)."""
    coll = _collectives.get(name)(group, **options)
    if not coll.supports(codec):
        valid = [n for n in _collectives.names() if _collectives.get(n)(None).supports(codec)]
        raise ValueError(
            f"codec {codec.name!r} cannot use collective {name!r}; valid collectives for it: {', '.join(valid)}"
        )
    return coll


def _check_declared(codec: Codec) -> None:
    """A ``ValueError`` where the codec declares a collective or a default memory that does
    not exist (a codec of the user's, whose module may register those after it, is checked
    here, at its first use, not when it registers)."""
    unknown = [c for c in codec.collectives if c not in _collectives.names()]
    if unknown:
        raise ValueError(f"codec {codec.name!r} declares unknown collective(s) {', '.join(map(repr, unknown))}; "
                         f"valid collectives: {', '.join(_collectives.names())}")
    if codec.default_memory not in _memory.names():
        raise ValueError(f"codec {codec.name!r} declares an unknown default_memory {codec.default_memory!r}; "
                         f"valid memories: {', '.join(_memory.names())}")


def _check_pair(codec: Codec, memory: "_memory.Memory") -> None:
    """A ``ValueError`` where the codec, as configured, cannot take that error feedback."""
    problem = memory.refused_by(codec)
    if problem is not None:
        raise ValueError(problem)


def check_settings(codec: str, options: Mapping[str, Any], memory: Optional[str] = None,
                   collective: Optional[str] = None, collective_options: Optional[Mapping[str, Any]] = None) -> None:
    """Build what a :class:`Communicator` builds from these settings (its codec, memory and
    collective), without a process group, so that a bad one is a ``ValueError`` before any
    rank starts (the launcher, the benchmarks' command line)."""
    made = _registry.codec(codec, **options)
    _check_declared(made)
    _check_pair(made, _memory.memory(memory if memory is not None else made.default_memory))
    if collective is not None or collective_options:
        make_collective(collective or made.collective, made, dict(collective_options or {}), None)


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


def _backend(group: Optional[dist.ProcessGroup]) -> str:
    """The backend of ``group`` ("gloo" outside a distributed job)."""
    return dist.get_backend(group) if dist.is_available() and dist.is_initialized() else "gloo"


def _kernels_in_use(group: Optional[dist.ProcessGroup]) -> str:
    """Which codec kernels run (the C ones and torch's agree to the bit for most codecs, not all)."""
    from ..kernels import fused, native

    choice = fused.setting()
    if _backend(group) == "nccl" or choice == "triton":
        gpu = fused._gpu()
        ok = gpu is not None and gpu.available() is None
        return f"{choice}:{'triton' if ok and choice != 'torch' else 'torch'}"
    ok = native.available() is None
    return f"{choice}:{'native' if ok and choice in ('auto', 'native') else 'torch'}"


def _check_out(t: torch.Tensor, out: Optional[torch.Tensor]) -> None:
    if out is not None and (out.shape != t.shape or out.dtype != t.dtype or out.device != t.device):
        raise ValueError(
            f"out must match the input: shape {tuple(t.shape)}, {t.dtype} on {t.device}; "
            f"got shape {tuple(out.shape)}, {out.dtype} on {out.device}"
        )


def _delivered(t: torch.Tensor, out: Optional[torch.Tensor], avg: torch.Tensor, dest: Optional[torch.Tensor]) -> torch.Tensor:
    """The average of ``t`` as the caller gets it: in ``out`` (copied there unless the collective
    wrote it there, ``dest``), else a tensor of ``t``'s shape and dtype."""
    # (a narrower dtype by a saturating cast: an average beyond a 16-bit gradient's range, from
    # an fp32 compensation, is its largest value, not ±inf; NaN and ±inf stay as they are)
    if out is None:
        return avg.view(t.shape) if avg.dtype == t.dtype else saturate(avg.view(t.shape), t.dtype)
    if dest is None:
        if out.dtype == avg.dtype:
            out.copy_(avg.view(t.shape))
        elif out.is_contiguous():
            saturate(avg.reshape(-1), out.dtype, out=out.view(-1))
        else:
            out.copy_(saturate(avg.view(t.shape), out.dtype))
    return out


def _dest(out: Optional[torch.Tensor], inp: torch.Tensor, mem: Any, coll: Collective) -> Optional[torch.Tensor]:
    """Where ``coll`` may write ``inp``'s average: ``out`` flat, when it is contiguous and of
    the input's dtype, and not while the input that aliases it is still to be read (:func:`input_read_after`)."""
    dest = out.view(-1) if out is not None and out.is_contiguous() and out.dtype == inp.dtype else None
    if dest is not None and input_read_after(mem, coll) and overlaps(dest, inp):
        return None
    return dest


def _saved_step(state: Mapping[str, Any]) -> int:
    """The step a state dict resumes at; format 1 kept the DDP hook's count and one per name."""
    if "step" in state:
        return int(state["step"])
    if "hook_step" in state:
        return int(state["hook_step"])
    return max((int(v) for v in (state.get("steps") or {}).values()), default=0)

