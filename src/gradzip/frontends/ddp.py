"""One-line DDP integration: a communication hook that compresses each bucket's gradients.

``state = gradzip.register(ddp_model, "maxmin", bits=4)``. The hook splits a bucket into its
parameters' gradients (named, so state survives DDP's bucket rebuild), sends the small and 1-D
ones uncompressed in one fused all-reduce and every other one through the codec, writes the
averages back into the bucket and returns a future that the ordered worker completes.
"""
import logging
import os
import threading
import time
import weakref
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from ..policy.adaptive import AdaptiveLevels, LevelCodecs, Ramp, LEVELS, check as adaptive_check
from ..sync.engine import Batch, Communicator
from ..sync.groups import group_key
from ..config import AUTO, Config
from ..errors import CommunicationError, SettingsMismatchError
from ..comm import consistency
from ..comm.base import traffic_factor
from ..sync.metrics import CSVLogger, format_table, scalars, summary_table
from ..policy import planner
from ..sync.groups import FusionPlan, GroupCollector

# MiB per fused group for gradients on an accelerator, where the config's default is the CPU's
# (see GradzipState.group_mb); DDP's own buckets are 25 MiB. Over NCCL within one node, where a
# group costs host time and the wire is fast, groups are larger still
ACCELERATOR_FUSION_MB = 32.0
NCCL_NODE_FUSION_MB = 128.0
# the most plain gradients a step holds for a later job (GroupCollector.hold), as a share of a
# group's bytes: bias and norm vectors, far below it in the models measured
HELD_PLAIN_SHARE = 1 / 8

logger = logging.getLogger("gradzip")


class GradzipState:
    """The hook's state: the communicator, the parameter names and the compression filter.

    ``step`` counts the backward passes whose gradients went through the hook (one per
    optimizer step without gradient accumulation); errors name it. It is the communicator's
    step counter (:attr:`Communicator.step`), the one that keys every exchange's randomness,
    decides the warm-up, the ramp and the adaptive schedule, and is saved in the state dict.
    """

    def __init__(self, comm: Communicator, param_names: Dict[int, str], config: Config) -> None:
        self.comm = comm
        self.config = config
        self.param_names = param_names
        self.fusion_plan = FusionPlan([])  # made by register() (apply, regroup)
        self.collector = GroupCollector(self.fusion_plan)
        self.decisions: List[planner.Decision] = []  # per group of compressible parameters
        self.costs: Optional[planner.Costs] = None  # the calibrated model with plan="auto"
        self.levels: Optional[AdaptiveLevels] = None  # per-parameter levels with adaptive on
        self.ramp: Optional[Ramp] = None  # the levels of the first compressed steps
        self._compressed: List[Tuple[str, torch.Tensor]] = []  # what the plan compresses, in order
        # what the planner decides from (set by register): the groups of compressible parameters,
        # the parameters by name in registration order, the routes it may choose, their device
        self.candidates: List[List[str]] = []
        self.params: Dict[str, torch.Tensor] = {}
        self.route_candidates: List[str] = []
        self.device: Optional[torch.device] = None
        self.drift: Optional[planner.DriftWatch] = None  # with plan="auto": when to calibrate again
        self._flush: set = set()  # parameters no longer compressed whose remainder is still owed
        # the buckets averaged in their own memory (the lean path), by DDP's bucket index: the
        # values each encodes and its parameters, as of the last step that exchanged it
        self.in_place_buckets: Dict[int, Tuple[int, List[str]]] = {}
        self._step_buckets: Dict[int, Tuple[int, List[str]]] = {}  # this step's, so far
        self.backward_done: Optional[float] = None
        self.ddp: Optional[Callable[[], Any]] = None  # a weak reference to the model (see provisional_buckets)
        self.passes = 0  # backward passes hooked in this process (a checkpoint restores the step, not this)
        self._errors: List[BaseException] = []
        self._inflight: List[torch.futures.Future] = []
        self._check_queued = False
        self._csv: Dict[str, CSVLogger] = {}
        self._csv_writers: Dict[int, List[str]] = {}
        # with DDP's find_unused_parameters and error feedback: the parameters that got a
        # gradient on this rank since the last exchange (ids), and the state set aside for
        # those that did not until this step's exchanges are done (see Memory.set_aside)
        self.used: Optional[set] = None
        self._use_hooks: List[Any] = []
        self._forward_hooks: List[Any] = []
        self._aside: Dict[str, List[Optional[torch.Tensor]]] = {}
        self._aside_due = False

    @property
    def step(self) -> int:
        return self.comm.step

    def should_compress(self, grad: torch.Tensor) -> bool:
        if grad.numel() < self.config.min_numel or self.comm.sends_as_is(grad.dtype):
            return False  # (sent as it is: DDP's own sum makes the same average, with no copy)
        return self.config.compress_1d or grad.dim() > 1

    def compresses(self, name: str, grad: torch.Tensor) -> bool:
        """Whether the hook compresses this gradient (past the warm-up): eligible
        (:meth:`should_compress`) and in a group of the plan, which a planner may leave plain."""
        return name in self.fusion_plan.group_of and self.should_compress(grad)

    def stats(self, per_tensor: bool = False) -> Dict[str, Any]:
        """This rank's metrics since registration (or the last ``comm.metrics.reset()``), rounded.

        ``codec``, ``memory``, ``collective``, ``world_size``; ``steps`` (backward passes through
        the hook since the metrics were last reset); ``params_compressed``/``params_uncompressed`` (parameters, by whether the codec
        compressed them); ``raw_bytes`` (the gradients in their dtype), ``wire_bytes`` (their
        compressed size), ``ratio`` = raw_bytes / wire_bytes (independent of the world size),
        ``sent_bytes`` (what this rank sent: 2(W−1)/W × wire_bytes, (W−1)× for allgather);
        ``encode_s``/``decode_s`` (wall seconds); ``encode_cpu_s``/``decode_cpu_s`` only when CPU
        time was measured. ``per_tensor``: the same per parameter. See :mod:`gradzip.sync.metrics`.
        """
        stats = self.comm.stats(per_tensor)
        out: Dict[str, Any] = {
            "codec": self.comm.codec.name, "memory": self.comm.memory.name, "collective": self.comm.collective_name,
            "world_size": stats.pop("world_size"),
        }
        out.update(stats)
        return out

    def plan(self) -> Dict[str, Any]:
        """The plan: per group of compressible parameters, whether it is compressed, the
        planner's predictions (plain fp32 all-reduce vs the codec; NaN without ``plan="auto"``)
        and the median measured time of its compressed exchanges so far (from the first stage
        to the last; with pipelining, other jobs' stages run in between). ``costs``: the
        calibrated model (:mod:`gradzip.policy.planner`), None without ``plan="auto"``; each group's
        ``route``: the collective the planner chose for it (None: the configured one); ``drift``:
        the watch of measured against predicted times and how often it re-calibrated;
        ``group_mb``: the size of a fused group in use (:meth:`group_mb`), which the settings
        compared between ranks give as configured (``fusion_mb``)."""
        measured = {}
        for d in self.decisions:
            times = self.comm.metrics.group_times.get(group_key(sorted(d.members)))
            if times:
                measured[d.group] = times
        out = planner.report(self.decisions, measured, self.costs)
        out["group_mb"] = self.group_mb()  # in use: fusion_mb as given, or the device's default
        out["topology"] = self.comm.describe_topology()
        if self.drift is not None:
            out["drift"] = self.drift.as_dict()
        if self.levels is not None:
            out["levels"] = self.levels.describe()
        return out

    def replan(self, costs: Optional[planner.Costs] = None) -> None:
        """Decide every group again (compress or not, and its route) and apply the plan.

        Without ``costs`` the cost model is calibrated anew on the process group: a collective
        call, so every rank must call it at the same point, between steps (the drift watch does
        so on the ordered worker). A parameter that stops being compressed owes the other ranks
        its error-feedback remainder: it is added to its next gradient (sent plain), so nothing
        is lost."""
        if costs is None:
            largest = max((planner.padded_numel(self.comm.codec, [self.params[n] for n in g]) for g in self.candidates),
                          default=0)
            costs = planner.calibrate(self.comm, self.device, routes=self.route_candidates, largest=largest)
        self.apply(planner.decide(self.candidates, self.params, self.comm.codec, costs), costs)

    def apply(self, decisions: List[planner.Decision], costs: Optional[planner.Costs]) -> None:
        """Use ``decisions`` (made from ``costs``): the compressed set, routes, levels and groups."""
        before = {n for n, _ in self._compressed}
        self.decisions, self.costs = decisions, costs
        compressed = {n for d in decisions if d.compress for n in d.members}
        self._compressed = [(n, p) for n, p in self.params.items() if n in compressed]
        self.comm.routes = {n: d.route for d in decisions if d.compress and d.route is not None for n in d.members}
        self.comm.plain_hierarchy_from = costs.plain_hierarchy_from if costs is not None else None
        self._flush = (self._flush | (before - compressed)) - compressed
        cfg = self.config
        if cfg.adaptive != "off" and self._compressed:  # measured and planned once the ramp is over
            old = self.levels
            self.levels = self.comm.levels = AdaptiveLevels(
                self.comm.level_codecs, cfg.adaptive, cfg.adaptive_every, [n for n, _ in self._compressed],
                [tuple(p.shape) for _, p in self._compressed], warmup=self.ramp.end if self.ramp else cfg.warmup,
                dtypes=[p.dtype for _, p in self._compressed],
            )
            if old is not None:
                self.levels.carry_over(old)
        else:
            self.levels = self.comm.levels = None
        if self.levels is not None and self.levels.plans:
            self.regroup()  # the levels chosen so far, one a group
        else:
            self.fusion_plan = FusionPlan([d.members for d in decisions if d.compress])
            self.collector = self._collector()
        if self.drift is not None:
            self.drift.reset()

    def regroup(self) -> None:
        """Rebuild the fused groups so that each holds one adaptive level and one route (after
        a new adaptive plan).

        Every rank calls it at the same step with the same levels, so the groups stay alike."""
        levels, routes = self.levels, self.comm.routes
        self.fusion_plan = self.build_plan(
            self._compressed, lambda p: True,
            level=lambda name: (levels.level(name) if levels is not None else None, routes.get(name)),
        )
        self.collector = self._collector()

    def _collector(self) -> GroupCollector:
        """A collector for the current plan, holding plain gradients of buckets that complete no
        group up to :data:`HELD_PLAIN_SHARE` of a group's size."""
        return GroupCollector(self.fusion_plan, hold_bytes=int(self.group_mb() * 2**20 * HELD_PLAIN_SHARE))

    def build_plan(
        self, params: Sequence[Tuple[str, torch.Tensor]], compress: Callable[[torch.Tensor], bool],
        level: Optional[Callable[[str], Any]] = None,
    ) -> FusionPlan:
        """:meth:`FusionPlan.build` with this state's codec block and group size."""
        block = self.comm.codec.fused_alignment() if self.comm.fusion else 0
        return FusionPlan.build(params, compress, block, int(self.group_mb() * 2**20), level=level)

    def group_mb(self) -> float:
        """The size of a fused group: ``fusion_mb``; by default :data:`ACCELERATOR_FUSION_MB` for
        gradients on an accelerator (:data:`NCCL_NODE_FUSION_MB` over NCCL on one node), and for
        CPU ranks on several nodes 2L × the default.

        On a GPU a group's encode, exchange and decode cost a fixed number of kernel launches
        (tens of microseconds of host time each) and microseconds of device time, so fewer,
        larger groups are cheaper; on the CPU the codec's work is what a group costs, and smaller
        groups overlap more of it with backward. Over NCCL on one node the wire is fast and the
        host time is all a group costs. Measured on an H200, 4-bit max-min, one rank over NCCL
        (``gradzip bench overhead --device cuda``): what the hook adds to a ResNet-50 step with
        16 / 32 / 64 / 128 MiB groups 3.9 / 3.4 / 2.3 / 1.2 ms, to a GPT-2 small step 12.0 /
        3.6 / 2.7 / 2.4 ms (one run); in three later runs 32 / 128 MiB gave 3.8, 3.7, 1.7 /
        2.6, 3.3, 0.8 ms on ResNet-50 and 1.9, 1.4, 2.4 / 1.8, 1.5, 1.6 ms on GPT-2. Two ranks
        sharing the GPU over gloo, whose collectives block the worker, were faster with 32 MiB
        (1.09× fp32 DDP) than with 128 MiB (0.98×). Across nodes smaller groups let more of the
        slow transfer hide behind backward (not yet measured on GPUs).

        A hierarchical exchange (:mod:`gradzip.comm.hierarchy`) has four rounds a group where a
        flat one has two, and each rank carries 1/L of the group, so its groups are larger to
        pay those rounds' latency less often. Measured with 2 nodes × 2 ranks at 1 Gbit/s
        (ResNet-50, ``gradzip bench models --ranks-per-node 2``): 8 MiB groups 0.741 s a step,
        16 MiB 0.646 s, 32 MiB 0.593 s, the flat exchange 0.631 s."""
        mb = self.config.fusion_mb
        if self.config.origin("fusion_mb") != "default":
            return mb
        topo = self.comm.topology
        if self.device is not None and self.device.type != "cpu":
            if topo is not None and len(topo.nodes) == 1 and self.comm.queues_on_stream(self.device):
                return NCCL_NODE_FUSION_MB
            return ACCELERATOR_FUSION_MB  # already four times the CPU's; 2L × it would be one group
        if topo is not None and topo.hierarchical:
            mb *= 2 * topo.local_size
        return mb

    def summary(self, per_layer: bool = False) -> str:
        """A readable table of :meth:`stats`: totals per codec (the codec's parameters and the
        uncompressed ones) and, with ``per_layer``, one row per parameter; ``print`` it."""
        s = self.stats()
        options = ", ".join(f"{k}={v}" for k, v in self.comm.codec.config().items())
        title = (
            f"gradzip: {s['codec']}({options}), memory={s['memory']}, collective={s['collective']}; "
            f"rank {self.comm.rank} of {s['world_size']}, {s['steps']} steps; ratio = raw / wire bytes"
        )
        return summary_table(self.comm.metrics, title, per_layer=per_layer, steps=s["steps"])

    def log_to(self, writer: Any = None, step: Optional[int] = None) -> Dict[str, float]:
        """Write the numeric fields of :meth:`stats` at ``step`` (default: the steps so far).

        ``writer``: anything with ``add_scalar(tag, value, step)`` (a TensorBoard
        ``SummaryWriter``; tags ``gradzip/<field>``), a :class:`~gradzip.sync.metrics.CSVLogger` or a
        CSV path (one row per call, a header first), a ``csv.writer`` (a header row the first time
        it is seen), or None / a ``logging.Logger`` (one INFO line; default the "gradzip"
        logger). Returns the values written.
        """
        stats = self.stats()
        step = stats["steps"] if step is None else step
        values = scalars(stats)
        if writer is None or isinstance(writer, logging.Logger):
            (writer or logger).info("%s", _log_line(step, values))
        elif hasattr(writer, "add_scalar"):
            for key, value in values.items():
                writer.add_scalar(f"gradzip/{key}", float(value), step)
        elif isinstance(writer, CSVLogger):
            writer.log(step, values)
        elif isinstance(writer, (str, os.PathLike)):
            path = os.fspath(writer)
            self._csv.setdefault(path, CSVLogger(path)).log(step, values)
        elif hasattr(writer, "writerow"):
            if id(writer) not in self._csv_writers:
                self._csv_writers[id(writer)] = list(values)
                writer.writerow(["step"] + list(values))
            writer.writerow([step] + [values.get(k, "") for k in self._csv_writers[id(writer)]])
        else:
            raise TypeError(
                f"log_to() takes a writer with add_scalar (TensorBoard), a CSV path, a CSVLogger, a csv.writer "
                f"or a logging.Logger, got {type(writer).__name__}"
            )
        return values

    def state_dict(self) -> Dict[str, Any]:
        """Per-rank state (error-feedback residuals, codec state, step counters), marked with
        this rank, the world size and the settings' fingerprint."""
        if self._aside:  # what a step that failed set aside for unused parameters: theirs again
            self._put_back()
        out = self.comm.state_dict()
        if self.costs is not None:  # the planner's model: a resumed run takes the same plan
            out["plan_costs"] = self.costs.to_dict()
        return out

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Restore this rank's own :meth:`state_dict`; see :meth:`Communicator.load_state_dict`
        for what ``strict=False`` accepts and drops. Under the planner, the plan of the saved
        run is taken again (its calibrated costs, where the state is this rank's own under these
        settings), not the one this process calibrated, so the run goes on as it would have."""
        saved = state.get("plan_costs") if isinstance(state, Mapping) else None
        if saved is not None and self.costs is not None and self.candidates and self.comm.owns(state):
            # this rank's own state of these settings (else the load below raises, or drops what
            # no longer applies, this run's own plan kept); applied first, so the levels and the
            # routes' collectives of the state load into its plan
            costs = planner.Costs.from_dict(saved)
            costs.routes = {label: line for label, line in costs.routes.items() if label in self.route_candidates}
            self.apply(planner.decide(self.candidates, self.params, self.comm.codec, costs), costs)
        self.comm.load_state_dict(state, strict=strict)
        # what a parameter compressed when the state was saved, and plain under this plan (the
        # planner calibrated anew, another min_numel), still owes goes with its next plain sum
        compressed = {n for n, _ in self._compressed}
        self._flush |= {n for n in self.comm.memory.holding() if n in self.params and n not in compressed}
        if self.levels is not None:
            self.regroup()  # the groups of the loaded levels

    def close(self) -> None:
        for handle in self._use_hooks + self._forward_hooks:
            handle.remove()
        self._use_hooks, self._forward_hooks = [], []
        self.comm.close()

    def refuse_after_failure(self, module: Any, args: Any) -> None:
        """A forward pre-hook on the DDP model: after a failed exchange, the next forward that
        builds a graph raises the :class:`CommunicationError` that names the failure. That
        backward ended early (the failure raised before DDP's end of backward), so DDP's own
        bookkeeping would otherwise fail there with an internal assertion that tells nothing."""
        if self.comm.failed and torch.is_grad_enabled():  # (one test a forward: nothing for a compiler to guard on)
            earlier = self.comm.earlier_failure(f"step {self.step}")
            raise CommunicationError(
                f"{earlier}. After a failed exchange the process group cannot be trusted: end the job "
                "and restart it from a checkpoint (torchrun --max-restarts restarts it)", earlier.brief,
            ) from earlier.__cause__

    def watch_use(self, params: Sequence[torch.Tensor]) -> None:
        """Note which parameters get a gradient on this rank in a step, so that the memory's
        state of the others is set aside for it (see :meth:`Memory.set_aside`): one Python call
        a parameter a backward pass, taken only with DDP's ``find_unused_parameters`` and a
        stateful memory."""
        self.used = set()
        used = self.used
        self._use_hooks = [p.register_post_accumulate_grad_hook(lambda p: used.add(id(p)))
                           for p in params if p.requires_grad]

    def _set_aside(self, names: List[str]) -> None:
        """On the ordered worker, before the jobs of these parameters' groups."""
        memory = self.comm.memory
        for name in names:
            if name in self._aside:  # held by a step that ended before putting it back: first returned
                memory.put_back(name, self._aside.pop(name))
            held = memory.set_aside(name)
            if held is not None:
                self._aside[name] = held

    def _put_back(self) -> None:
        """On the ordered worker, after this step's exchanges (or by :meth:`state_dict`, where a
        failed step never got there)."""
        aside, self._aside = self._aside, {}
        for name, held in aside.items():
            self.comm.memory.put_back(name, held)

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
        if self.backward_done is not None:
            # what backward's end waited for gradzip: exchanges not hidden behind the compute
            self.comm.metrics.record_exposed(time.perf_counter() - self.backward_done)
            self.backward_done = None
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first


def _log_line(step: int, v: Dict[str, float]) -> str:
    return (
        f"gradzip step {step}: ratio {v['ratio']:.2f}x, wire {v['wire_bytes'] / 1e6:.3f} MB of "
        f"{v['raw_bytes'] / 1e6:.3f} MB raw, sent {v['sent_bytes'] / 1e6:.3f} MB, "
        f"encode {v['encode_s'] * 1e3:.1f} ms, decode {v['decode_s'] * 1e3:.1f} ms, "
        f"{int(v['params_compressed'])} parameters compressed, {int(v['params_uncompressed'])} not"
    )


def settings_report(comm: Communicator, cfg: Config, collective: Optional[str] = None,
                    group_mb: Optional[float] = None) -> str:
    """The effective settings and where each came from (argument, config, environment, default).
    ``collective``: the one a front end runs in place of the communicator's own (FSDP2's
    reduce-scatter), shown without the options of the one it replaces. ``group_mb``: the size
    of a fused group in use, shown beside ``fusion_mb`` where the device or the layout chose
    another. Several nodes exchanged flat say why."""
    settings = dict(comm.settings())
    version = settings.pop("gradzip", "")
    if collective is not None:
        settings = {key: value for key, value in settings.items() if not key.startswith("collective.")}
        settings["collective"] = collective
    rows = [[key, repr(value), "front end" if key == "collective" and collective else cfg.origin(key)]
            for key, value in settings.items()]
    for row in rows:
        if row[0] == "fusion_mb" and group_mb is not None and settings["fusion_mb"] != group_mb:
            row[1] += f"; {group_mb:g} in use"  # (the device's or the layout's size: GradzipState.group_mb)
    topology = comm.describe_topology()
    if topology.get("nodes", 1) > 1 and not topology.get("hierarchical"):
        rows.append(["exchange", f"flat across {topology['nodes']} nodes", str(topology.get("flat_because", ""))])
    if comm.timeout is not None:
        origin = cfg.origin("timeout") if cfg.timeout is not None else "the process group's"
        rows.append(["timeout", f"{comm.timeout.total_seconds():g} s", origin])
    head = f"gradzip {version} on {comm.world_size} rank(s): effective settings"
    return head + "\n" + format_table(["setting", "value", "from"], rows, left=3)


def _bucket_label(index: int, names: List[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"bucket {index} ({shown})"


def gradzip_hook(state: GradzipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` through gradzip on the ordered worker.

    The bucket's uncompressed gradients go in one plain all-reduce; its compressed ones join
    their groups of the plan (:mod:`gradzip.sync.groups`), and every group completed by this bucket is
    exchanged in the same job. The bucket is done when its job and every group holding one of
    its gradients are done (a group may complete with a later bucket).
    """
    buffer = bucket.buffer()
    params = bucket.parameters()
    grads = bucket.gradients()
    known = state.param_names.get  # (a default name made only for a parameter without one)
    names = [known(id(p)) or f"bucket{bucket.index()}.{i}" for i, p in enumerate(params)]
    step = state.step  # this backward pass's, taken here: the jobs run later, on the worker
    what = f"step {step}, {_bucket_label(bucket.index(), names)}"
    # warm-up: the first steps go dense, as plain all-reduces; memories and codec state stay
    # untouched, so compression starts from an empty residual on every rank alike. So do the
    # steps in DDP's provisional buckets where they would be averaged in place with error
    # feedback (see provisional_buckets)
    dense = step < state.config.warmup
    provisional = provisional_buckets(state.ddp() if state.ddp is not None else None, state.passes)
    if not dense and state.config.in_place and state.comm.memory.stateful and state.comm.averages_in_place():
        dense = provisional
        if dense and state.drift is not None and state.drift.start <= step + 1:
            state.drift.start = step + 2  # (it leaves out the first compressed step: now a later one)
    last = bucket.is_last()
    levels = state.levels
    if state.ramp is not None:
        state.comm.ramp_level = None if dense else state.ramp.level_at(step)
    if levels is not None:  # adaptive levels: measure on some steps, plan after the last of them
        levels.sampling = not dense and levels.sample_at(step)
    # after this step's exchanges, on the ordered worker (backward ends when they are done):
    # the adaptive plan, and the check of measured against predicted times
    after: List[Tuple[str, Callable[[], None]]] = []
    if last and not dense and levels is not None and levels.plan_after(step):
        after.append(("adaptive plan", lambda: _replan(state, buffer.device)))
    if last and state.drift is not None and state.drift.due(step):
        after.append(("drift check", lambda: _check_drift(state, step)))
    if last:
        state.comm.next_step()
        state.passes += 1
        state.backward_done = time.perf_counter()  # the last bucket is ready: backward's work is over
    plain = [
        i for i, g in enumerate(grads)
        if dense or not state.compresses(names[i], g)
    ]
    settled = None
    if state._flush:  # no longer compressed: what their memory still owes goes with this sum
        settled = _settle_debts(state, [names[i] for i in plain], [grads[i] for i in plain], what)
    compress = [i not in plain for i in range(len(grads))]
    aside: List[torch.futures.Future] = []
    if state.used is not None and not dense:  # parameters without a gradient here: their memory waits
        idle = [names[i] for i, p in enumerate(params) if compress[i] and id(p) not in state.used]
        if idle:
            aside = [state.comm.submit(lambda: state._set_aside(idle), buffer.device, what=f"{what}: unused parameters")]
            state._aside_due = True
    if last and state.used is not None:
        state.used.clear()
        if state._aside_due:
            after.append(("unused parameters' memory", state._put_back))
            state._aside_due = False
    if dense or not state.fusion_plan.groups:  # nothing compressed in this step
        if not dense and state.comm.plain_goes_hierarchical(buffer.numel(), buffer.element_size()):
            # on several nodes, the planner's exact hierarchical all-reduce; each job drains at
            # once, since a later (smaller) bucket may take DDP's sum instead of the worker
            waits = _bucket_job(state, buffer, names, grads, list(range(len(grads))), True, step, what)
        else:  # DDP's own sum
            waits = [_plain_bucket(state, buffer, names, grads, what, step, settled)]
            settled = None
    elif state.config.in_place and not provisional and state.comm.in_place(buffer, grads, names, compress):
        # the lean path: the bucket is the group (not DDP's provisional bucket of the whole
        # model, whose payloads would all be in flight at once: it takes the groups, a job each)
        state._step_buckets[bucket.index()] = (buffer.numel(), names)
        waits = _leftovers(state, buffer, step, last, what) + [_in_place_job(state, buffer, names, grads, compress, last, step, what)]
    else:
        waits = _bucket_job(state, buffer, names, grads, plain, last, step, what, one_each=provisional)
    if last:
        state.in_place_buckets, state._step_buckets = state._step_buckets, {}
    waits = aside + ([settled] if settled is not None else []) + waits
    for label, fn in after:
        waits.append(state.comm.submit(fn, buffer.device, what=f"{what}: {label}"))
    return state.deliver(waits[0] if len(waits) == 1 else _all_of(waits, buffer, state.comm), buffer)


def provisional_buckets(ddp: Optional[DistributedDataParallel], passes: int) -> bool:
    """Whether ``ddp`` still averages in the buckets it builds anew once it has seen backward's
    order, in the backward pass after ``passes`` (those hooked in this process): its first, or
    its first two with a static graph; one bucket of the whole model where it looks for no unused
    parameters. An error-feedback residual laid out by them would stand beside the rebuilt
    buckets' until every name had moved: twice the residual at the step after. Every rank
    rebuilds at the same pass, so every rank answers alike; the bound on passes keeps it so where
    DDP rebuilds without noting it (a rank that has joined under ``Join`` rebuilds through its
    join hook and leaves ``_has_rebuilt_buckets`` unset)."""
    if ddp is None:
        return False
    static = getattr(ddp, "static_graph", False)
    rebuilds = static or not getattr(ddp, "find_unused_parameters", False)
    return rebuilds and passes < (2 if static else 1) and not getattr(ddp, "_has_rebuilt_buckets", True)


def _bucket_job(
    state: GradzipState, buffer: torch.Tensor, names: List[str], grads: List[torch.Tensor], plain: List[int],
    last: bool, step: int, what: str, flush: Optional[bool] = None, one_each: bool = False,
) -> List[torch.futures.Future]:
    """Submit a bucket's job to the pipeline: its plain gradients (with those held from earlier
    buckets) in one all-reduce and every group it completes; the futures the bucket waits on
    (the job, and its gradients' groups). ``flush``: whether the job drains the pipeline
    (default: when ``last``). ``one_each``: a job a group instead (the first with the plain
    sum), so that the pipeline holds a few groups' payloads in flight, not every group's at once:
    for DDP's provisional bucket of the whole model (see :func:`provisional_buckets`). (A job a
    group in every pass would hold fewer still, but waits for each group's exchange sooner:
    ResNet-50 at 2 ranks on loopback took 10-15% longer a step.)"""
    waits: Dict[int, torch.futures.Future] = {}
    for i, g in enumerate(grads):
        if i not in plain:
            group, fut = state.collector.add(names[i], g)
            waits[group] = fut
    ready = state.collector.ready(last)
    if waits and not ready and not last:  # the bucket waits for a later group's job anyway
        # (the groups' futures complete with another bucket's job: DDP gets this one's buffer)
        if not plain:
            return [_all_of(list(waits.values()), buffer, state.comm)]
        held = state.collector.hold([names[i] for i in plain], [grads[i] for i in plain], step)
        if held is not None:  # its plain sum rides in that job's
            return [_all_of(list(waits.values()) + [held], buffer, state.comm)]
    held_names, held_grads, held_futures = state.collector.take_held(step)
    if not (held_grads or plain or ready):
        return [_all_of(list(waits.values()), buffer, state.comm)] if waits else []
    flush = last if flush is None else flush
    runs: List[List[Any]] = [[group] for group in ready] if one_each and len(ready) > 1 else [ready]
    jobs = []
    for k, run in enumerate(runs):
        tensors = held_grads + [grads[i] for i in plain] if k == 0 else []
        job_names = held_names + [names[i] for i in plain] if k == 0 else []
        compress = [False] * len(tensors)
        groups = []
        for members, member_grads, _ in run:
            groups.append(list(range(len(tensors), len(tensors) + len(members))))
            tensors.extend(member_grads)
            job_names.extend(members)
            compress.extend([True] * len(members))
        predicted = _predicted_s(state, tensors[: len(tensors) - sum(len(g) for g in groups)], run)
        # the gradients are views into DDP's bucket buffers: the averages are written into them;
        # pipelined: this job's encode overlaps the previous one's transfer; the last bucket drains
        batch = Batch(tensors, job_names, compress, groups=groups, buffer=buffer,
                      on_done=_drift_watch(state, predicted, step))
        done = state.comm.submit_batch(batch, step, buffer.device, what=what, flush=flush and k == len(runs) - 1)
        for _, _, group_future in run:
            done.add_done_callback(_settle_with(group_future))
        if k == 0:
            for held_future in held_futures:
                done.add_done_callback(_settle_with(held_future))
        jobs.append(done)
    return jobs + list(waits.values())


def _leftovers(state: GradzipState, buffer: torch.Tensor, step: int, last: bool, what: str) -> List[torch.futures.Future]:
    """Before a bucket averaged in its own memory (which joins no group): a job for the plain
    gradients held from earlier buckets and, as backward ends, for the groups still waiting for
    members that went in place, so that the buckets waiting on them complete."""
    return _bucket_job(state, buffer, [], [], [], last, step, f"{what}: held gradients", flush=False)


def _in_place_job(
    state: GradzipState, buffer: torch.Tensor, names: List[str], grads: List[torch.Tensor], compress: List[bool],
    last: bool, step: int, what: str,
) -> torch.futures.Future:
    """Submit a bucket averaged in its own memory (:meth:`Communicator.bucket_stages`)."""
    predicted = float("nan")
    if state.costs is not None and state.drift is not None:
        plain = [g for g, c in zip(grads, compress) if not c]
        predicted = state.costs.compressed_s(buffer.numel(), state.comm.routes.get(names[compress.index(True)]))
        if plain:
            predicted += state.costs.plain_s(sum(g.numel() for g in plain), plain[0].element_size())

    batch = Batch(grads, names, compress, buffer=buffer, in_place=True, on_done=_drift_watch(state, predicted, step))
    return state.comm.submit_batch(batch, step, buffer.device, what=what, flush=last)


def _drift_watch(state: GradzipState, predicted: float, step: int) -> Optional[Callable[[float], None]]:
    """What a job reports its measured time to: the planner's drift watch, if on."""
    if state.drift is None:
        return None
    return lambda seconds: state.drift.add(predicted, seconds, step)


def _predicted_s(state: GradzipState, plain: Sequence[torch.Tensor], ready: Sequence[Any]) -> float:
    """The planner's seconds for a job: its plain all-reduce and the groups it exchanges."""
    costs = state.costs
    if costs is None or state.drift is None:
        return float("nan")
    total = costs.plain_s(sum(t.numel() for t in plain), plain[0].element_size()) if plain else 0.0
    for members, member_grads, _ in ready:
        numel = planner.padded_numel(state.comm.codec, member_grads)
        total += costs.compressed_s(numel, state.comm.routes.get(members[0]))
    return total


def _settle_debts(
    state: GradzipState, names: List[str], grads: List[torch.Tensor], what: str,
) -> Optional[torch.futures.Future]:
    """Add to these plain gradients what their parameters' memory still owes (they were
    compressed under an earlier plan): every rank adds its own remainder before the sum. A job
    of the worker's, ahead of the bucket's own (None where nothing is owed): the memory is the
    worker's, and on CUDA its tensors live on the worker's stream, where they are read and
    freed in order."""
    owing = [(name, g) for name, g in zip(names, grads) if name in state._flush]
    if not owing:
        return None
    state._flush.difference_update(name for name, _ in owing)

    def settle() -> List[torch.Tensor]:
        for name, g in owing:
            owed = state.comm.memory.release(name)
            if owed is not None:
                g.add_(owed.to(device=g.device, dtype=g.dtype).view(g.shape))
        return [g for _, g in owing]  # (on CUDA: the future's events cover the adds)

    return state.comm.submit(settle, grads[0].device, what=f"{what}: memory owed by parameters sent plain now")


def _plain_bucket(
    state: GradzipState, buffer: torch.Tensor, names: List[str], grads: List[torch.Tensor], what: str, step: int,
    settled: Optional[torch.futures.Future] = None,
) -> torch.futures.Future:
    """A bucket of a step that compresses nothing (warm-up, or a plan left wholly plain): one
    in-place all-reduce of DDP's buffer, issued right here as DDP's default hook does, with none
    of the worker's or the codec's steps. Every bucket of such a step comes here, in DDP's bucket
    order on every rank, and the worker issues nothing meanwhile, so the order of collectives
    on gradzip's group stays the same on every rank. NaN and Inf spread through the sum as in
    DDP's own all-reduce."""
    comm = state.comm
    earlier = comm.earlier_failure(what)
    if settled is not None and earlier is None:  # the memory's debts, added on the worker, go in this sum
        try:
            settled.wait()  # (on CUDA this stream then waits for the adds too)
        except Exception as exc:
            earlier = exc
    if earlier is not None:
        failed = torch.futures.Future()
        failed.set_exception(earlier)
        return failed
    w = comm.world_size
    nbytes = buffer.numel() * buffer.element_size()
    comm.metrics.record_group(
        [(n, g.numel() * g.element_size()) for n, g in zip(names, grads)], wire=nbytes, encode_s=0.0, decode_s=0.0,
        compressed=False, sent=traffic_factor("allreduce", w) * nbytes, codec="none",
    )
    if w == 1:
        done = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        done.set_result(buffer)
        return done
    started = time.monotonic()
    predicted = _predicted_s(state, [buffer], [])
    fut = dist.all_reduce(buffer.div_(w), group=comm.group, async_op=True).get_future()
    out = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)

    def finish(f: torch.futures.Future) -> None:
        try:
            f.wait()
        except Exception as exc:  # raised as it is (Future.then would wrap it in a RuntimeError)
            out.set_exception(comm.record_failure(what, exc, time.monotonic() - started))
            return
        if state.drift is not None:
            state.drift.add(predicted, time.monotonic() - started, step)
        out.set_result(buffer)

    fut.add_done_callback(finish)
    return out


def _replan(state: GradzipState, device: torch.device) -> None:
    assert state.levels is not None
    if state.levels.replan(state.comm.group, device):
        state.regroup()
        if state.drift is not None:
            state.drift.reset()  # other levels move other bytes: a new baseline


def _check_drift(state: GradzipState, step: int) -> None:
    """Compare measured with predicted times (a collective); calibrate and plan again on drift."""
    assert state.drift is not None
    if state.drift.check(step, state.comm.group, state.device):
        logger.info("gradzip: exchange times drifted from the planner's model; calibrating again")
        state.replan()


def _settle_with(target: torch.futures.Future):
    """A callback that completes ``target`` as the future it is added to completed."""

    def settle(f: torch.futures.Future) -> None:
        try:
            target.set_result(f.value())
        except Exception as exc:
            target.set_exception(exc)

    return settle


def _all_of(futures: List[torch.futures.Future], value: torch.Tensor, comm: Communicator) -> torch.futures.Future:
    """A future that completes with ``value`` once all ``futures`` have, or with the first failure.

    On CUDA its waiters are ordered after everything ``comm``'s worker queued on its side
    stream until then: the last of ``futures`` to complete may order nothing (a job that
    returns None, a group's CPU future, one complete before its callback was added), and DDP
    reads the bucket on its own stream once this future's events allow."""
    out = torch.futures.Future(devices=[value.device] if value.is_cuda else None)
    left = [len(futures)]
    errors: List[BaseException] = []
    lock = threading.Lock()

    def one_done(f: torch.futures.Future) -> None:
        try:
            f.wait()
        except Exception as exc:
            errors.append(exc)
        with lock:
            left[0] -= 1
            finished = left[0] == 0
        if finished:
            if errors:
                out.set_exception(errors[0])
            else:
                comm.complete_after_jobs(out, value)

    for f in futures:
        f.add_done_callback(one_done)
    return out


def _compiled_module(model: Any) -> Any:
    """The module ``torch.compile`` wrapped (its ``_orig_mod``, through several wrappers), or
    ``model`` itself: a hook registered on the DDP model inside serves the compiled forward."""
    seen = set()
    while not isinstance(model, DistributedDataParallel) and id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


def register(
    model: DistributedDataParallel,
    codec: Optional[str] = None,
    *,
    memory: Optional[str] = None,
    collective: Optional[str] = None,
    min_numel: Optional[int] = None,
    compress_1d: Optional[bool] = None,
    fusion: Optional[bool] = None,
    fusion_mb: Optional[float] = None,
    pipeline: Optional[bool] = None,
    in_place: Optional[bool] = None,
    plan: Optional[str] = None,
    warmup: Optional[int] = None,
    ramp: Optional[int] = None,
    adaptive: Union[str, bool, None] = None,
    adaptive_every: Optional[int] = None,
    hierarchy: Optional[str] = None,
    node_dtype: Optional[str] = None,
    weight_bits: Optional[int] = None,
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

    On an FSDP2 model (``fully_shard``) it compresses every unit's gradient reduce-scatter
    instead (:mod:`gradzip.frontends.fsdp`), and with ``weight_bits`` (2..8) the weights'
    all-gather too.
    """
    from . import fsdp

    model = _compiled_module(model)
    if fsdp.is_fsdp1(model):
        raise ValueError(
            "register() takes FSDP2 (torch.distributed.fsdp.fully_shard), not FullyShardedDataParallel (FSDP1): "
            "shard the model with fully_shard"
        )
    sharded = fsdp.is_fsdp2(model)
    if weight_bits is not None and not sharded:
        raise ValueError("register(): weight_bits compresses FSDP2's weight all-gather; a DDP model has none")
    problem = fsdp.weight_bits_problem(weight_bits)
    if problem:
        raise ValueError(f"register(): {problem}")
    if not isinstance(model, DistributedDataParallel) and not sharded:
        raise ValueError(
            f"register() needs a DistributedDataParallel model or an FSDP2 module (fully_shard), got {type(model).__name__}"
        )
    cfg = config or Config()
    fields: Dict[str, Any] = {}
    if codec is not None:
        fields["codec"] = codec
        if codec != cfg.codec:
            fields["options"] = {}
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    for key, value in (
        ("memory", memory), ("collective", collective), ("min_numel", min_numel), ("compress_1d", compress_1d),
        ("fusion", fusion), ("fusion_mb", fusion_mb), ("pipeline", pipeline), ("in_place", in_place), ("plan", plan), ("warmup", warmup),
        ("ramp", ramp), ("adaptive", adaptive), ("adaptive_every", adaptive_every), ("hierarchy", hierarchy), ("node_dtype", node_dtype),
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
    given = dict(cfg.given)
    for key in fields:
        if key not in ("options", "collective_options"):
            given[key] = "argument"
    given.update({f"codec.{k}": "argument" for k in codec_options})
    given.update({f"collective.{k}": "argument" for k in collective_options or {}})
    given.update({f"memory.{k}": "argument" for k in memory_options or {}})
    cfg = replace(cfg, given=given).with_env()
    check_codec_name(cfg)
    if sharded:  # (its settings checked before "auto" fills in the DDP hook's own)
        return _register_fsdp(model, cfg, group, memory_options, weight_bits)
    cfg = cfg.resolved()
    if getattr(model, "_comm_hooks", None):  # (DDP takes one; checked before any collective)
        raise ValueError("register(): this DDP model already has a communication hook (gradzip's, or another); "
                         "DDP takes one a model: wrap the module in a new DDP to register again")
    try:
        adaptive_check(cfg.codec, cfg.adaptive, cfg.ramp)
        comm = Communicator(
            cfg.codec,
            memory=cfg.memory,
            collective=cfg.collective,
            group=group if group is not None else getattr(model, "process_group", None),
            memory_options=memory_options,
            collective_options=cfg.collective_options,
            timeout=cfg.timeout,
            hierarchy=cfg.hierarchy, node_dtype=cfg.node_dtype,
            fusion=cfg.fusion,
            pipeline=cfg.pipeline,
            settings_extra={
                "min_numel": cfg.min_numel, "compress_1d": cfg.compress_1d, "fusion_mb": cfg.fusion_mb, "in_place": cfg.in_place, "plan": cfg.plan,
                "warmup": cfg.warmup, "ramp": cfg.ramp, "adaptive": cfg.adaptive, "adaptive_every": cfg.adaptive_every,
            },  # hierarchy: the communicator's "topology" setting says what it changed
            settings_sources=cfg.sources,
            **cfg.options,
        )
    except ValueError as exc:
        note = cfg.environment_note()
        if not note or isinstance(exc, SettingsMismatchError):  # that one names its sources itself
            raise
        raise type(exc)(f"{exc}{note}") from exc
    named = list(model.module.named_parameters())
    _verify_names(comm, [n for n, p in named if p.requires_grad])
    state = GradzipState(comm, {id(p): n for n, p in named}, cfg)
    state.device = named[0][1].device if named else None  # the gradients' device (CUDA for NCCL)
    plan = state.build_plan(named, state.should_compress)  # the filter decides what may be compressed
    state.candidates, state.params = plan.groups, dict(named)
    if comm.codec.name in LEVELS and (cfg.adaptive != "off" or cfg.ramp > 0):
        comm.level_codecs = LevelCodecs(comm.codec, comm.memory)
    if cfg.ramp > 0:
        state.ramp = Ramp(comm.codec, cfg.ramp, start=cfg.warmup)
    if cfg.plan == AUTO:
        # the planner chooses the collective too, unless the user named one or gave it options
        if cfg.origin("collective") == "default" and not cfg.collective_options:
            state.route_candidates = planner.candidate_routes(comm)
        state.replan()  # calibrate; groups it leaves uncompressed go with their bucket's plain all-reduce
        state.drift = planner.DriftWatch(start=(state.ramp.end if state.ramp else cfg.warmup) + 1)
    else:
        state.apply(planner.decide(plan.groups, state.params, comm.codec, None), None)
    state.ddp = weakref.ref(model)
    if getattr(model, "find_unused_parameters", False) and comm.memory.stateful:
        state.watch_use([p for _, p in named])
    model.register_comm_hook(state, gradzip_hook)
    state._forward_hooks.append(model.register_forward_pre_hook(state.refuse_after_failure))
    if comm.rank == 0:
        logger.info("%s", settings_report(comm, cfg, group_mb=state.group_mb()))
        hint = bucket_view_hint(getattr(model, "gradient_as_bucket_view", True), state.device)
        if hint:
            logger.info("%s", hint)
    return state


def _verify_names(comm: Communicator, names: List[str]) -> None:
    """:func:`consistency.verify_same_names` over ``comm``'s group; ``comm`` closed where the
    names differ (registration ends there, on every rank)."""
    try:
        consistency.verify_same_names(names, comm.group)
    except SettingsMismatchError:
        comm.close()
        raise


def check_codec_name(cfg: Config) -> None:
    """``ValueError`` for a codec that no front end takes, naming ``auto`` beside every
    registered codec (and the variable it came from)."""
    from .. import codecs

    if isinstance(cfg.codec, str) and cfg.codec != AUTO and cfg.codec not in codecs.names():
        where = f" (set in the environment: {cfg.sources['codec']})" if "codec" in cfg.sources else ""
        raise ValueError(f"unknown codec {cfg.codec!r}; valid codecs: auto (4-bit max-min, where the planner says it "
                         f"pays), {', '.join(codecs.names())}{where}")


def bucket_view_hint(bucket_view: bool, device: Optional[torch.device]) -> Optional[str]:
    """What to tell a GPU user whose DDP copies every average into ``.grad`` (None: nothing).
    With ``gradient_as_bucket_view=True`` the gradients are views of DDP's buckets, where the
    hook writes the averages, so that copy, issued after a step's last exchange, does not happen
    (docs/gpu.md times what it saves)."""
    if bucket_view or device is None or device.type == "cpu":
        return None
    return ("gradzip: build the model with DDP(..., gradient_as_bucket_view=True) so DDP does not copy every "
            "averaged gradient into .grad after the last exchange of a step")


def _register_fsdp(
    model: Any, cfg: Config, group: Optional[dist.ProcessGroup], memory_options, weight_bits: Optional[int],
) -> Any:
    """:func:`register` for an FSDP2 model: the engine on the units' group, their reduce-scatters."""
    from ..comm.reducescatter import CompressedReduceScatter, sharded_codecs
    from . import fsdp

    odd = [k for k in fsdp.DDP_ONLY if cfg.origin(k) != "default"]  # given, in a Config, or from the environment
    if odd:
        raise ValueError(
            f"register(): {', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not supported on an FSDP2 model "
            f"(set by {', '.join(sorted({cfg.origin(k) for k in odd}))}); there gradzip takes the codec and its "
            "options, memory, min_numel, hierarchy, weight_bits, timeout and group"
        )
    cfg = cfg.resolved()  # "auto": 4-bit max-min with error feedback (its planner and levels are the DDP hook's)
    units = fsdp.units_of(model)
    if fsdp.registered(units):  # (checked before any collective)
        raise ValueError("register(): gradzip is registered on this FSDP2 model already; close() that state first")
    if group is None and units:
        group = units[0][2]
    try:
        comm = Communicator(
            cfg.codec, memory=cfg.memory, group=group, memory_options=memory_options, timeout=cfg.timeout,
            hierarchy=cfg.hierarchy, fusion=False, pipeline=False, settings_extra={"min_numel": cfg.min_numel, "front_end": "fsdp2", "weight_bits": weight_bits},
            settings_sources=cfg.sources, **cfg.options,
        )
    except ValueError as exc:
        note = cfg.environment_note()
        if not note or isinstance(exc, SettingsMismatchError):
            raise
        raise type(exc)(f"{exc}{note}") from exc
    if not CompressedReduceScatter(None).supports(comm.codec):
        comm.close()
        raise ValueError(
            f"register(): codec {comm.codec.name!r} cannot compress a sharded reduce-scatter (its payload size "
            f"depends on the values, or it needs several rounds, so chunks cannot go in one all-to-all); codecs "
            f"that can: {', '.join(sharded_codecs())}"
        )
    _verify_names(comm, [name for name, _, _ in units])
    state = fsdp.install(units, comm, cfg.min_numel, weight_bits)
    if comm.rank == 0:
        logger.info("%s (FSDP2: %d units)", settings_report(comm, cfg, collective="reducescatter"), len(state.units))
    return state
