"""FSDP2: gradzip's compressed reduce-scatter on every ``fully_shard`` unit.

FSDP2 reduces each unit's gradients with one reduce-scatter per backward: its input is every
rank's chunk in rank order (each chunk the unit's parameters' padded flat shards), its output
this rank's shard of the reduced gradient. ``FSDPModule.set_custom_reduce_scatter`` lets a
:class:`~torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter` take its place. gradzip's
compresses each chunk with the codec, exchanges the chunks by one all-to-all and averages only
this rank's (:meth:`gradzip.sync.engine.Communicator.reduce_scatter`), with error feedback kept
per rank for the whole unit, keyed by the unit's name. A unit smaller than ``min_numel`` values
per rank goes through a plain reduce-scatter.

FSDP2 hands over the reduce operation it wants (``AVG``; ``SUM`` with
``set_force_sum_reduction_for_comms`` or fp16, where it divides itself; ``PREMUL_SUM(f)`` with
``set_gradient_divide_factor``): gradzip averages and scales the shard to match, on gloo too,
which has no ``PREMUL_SUM`` of its own. The call returns when the shard is reduced (FSDP reads it
right after).

With ``weight_bits`` the weights' all-gather is compressed too (``set_custom_all_gather``): each
rank's shard is quantised to ``weight_bits`` bits in blocks of 1024 values, each with its own
minimum and scale, rounded to nearest (ZeRO++'s qwZ), gathered, and decoded by every rank alike,
its own shard included. The sharded parameters, which the optimizer updates, stay in full
precision; only the unsharded copy used by forward and backward is quantised.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

try:  # FSDP2 (fully_shard) and its communication seams
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # an older torch: no FSDP2 seam
    FSDPModule = None  # type: ignore[assignment,misc]
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]

from ..sync.engine import Communicator

# register() settings that only the DDP hook has (fused groups, pipelining, the planner...)
DDP_ONLY = ("collective", "compress_1d", "fusion", "fusion_mb", "pipeline", "in_place", "plan", "warmup", "ramp",
            "adaptive", "adaptive_every")


def is_fsdp2(model: Any) -> bool:
    """Whether ``model`` is the root (or any unit) of an FSDP2 ``fully_shard``."""
    return FSDPModule is not None and isinstance(model, FSDPModule)


def is_fsdp1(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(model, FullyShardedDataParallel)


def shard_group(unit: Any) -> Optional[dist.ProcessGroup]:
    """The process group a unit reduce-scatters over (None: it holds no parameters)."""
    groups = unit._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(
            f"register(): FSDP unit {type(unit).__name__} has {len(groups)} parameter groups (a per-parameter "
            "mesh from shard_placement_fn); FSDP2's custom reduce-scatter takes one: shard it without "
            "shard_placement_fn, or leave this model uncompressed"
        )
    return groups[0].mesh_info.shard_process_group if groups else None


def _reduce_scatter_plain(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    single = getattr(dist, "reduce_scatter_single", None)
    if single is not None:
        single(output, input, op=dist.ReduceOp.SUM, group=group)
    else:  # torch < 2.10
        dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=group)


class GradzipReduceScatter(ReduceScatter):
    """One unit's reduce-scatter through the engine (see the module's notes)."""

    def __init__(self, state: "FSDPState", name: str) -> None:
        self.state = state
        self.name = name
        self.how = "not run yet"  # "compressed" or "plain", once called

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        state = self.state
        w = group.size()
        if group is not state.group and w != state.comm.world_size:
            raise RuntimeError(
                f"gradzip: unit {self.name!r} reduce-scatters over a group of {w} ranks, gradzip was registered "
                f"on {state.comm.world_size}"
            )
        if output_tensor.numel() < state.min_numel:
            _reduce_scatter_plain(output_tensor, input_tensor, group)
            output_tensor.div_(w)
            state.plain_calls += 1
            self.how = "plain"
            raw = input_tensor.numel() * input_tensor.element_size()
            state.comm.metrics.record(self.name, raw, raw, 0.0, 0.0, compressed=False, sent=raw * (w - 1) / w)
        else:
            state.comm.reduce_scatter(input_tensor, output_tensor, self.name)
            state.compressed_calls += 1
            self.how = "compressed"
        # the engine averages; FSDP may want the sum, or a sum scaled by its own factor
        if isinstance(op, dist.ReduceOp.RedOpType):
            if op == dist.ReduceOp.SUM:
                output_tensor.mul_(w)
            elif op != dist.ReduceOp.AVG:
                raise ValueError(f"gradzip: FSDP asked for a {op} reduce-scatter; gradzip reduces by SUM or AVG")
        elif op.op == dist.ReduceOp.PREMUL_SUM:
            output_tensor.mul_(w * float(op.factor))
        else:
            raise ValueError(f"gradzip: FSDP asked for a {op} reduce-scatter; gradzip reduces by SUM or AVG")
        return None


class GradzipAllGather(AllGather):
    """One unit's weight all-gather, quantised (see the module's notes)."""

    def __init__(self, codec: Any, name: str) -> None:
        self.codec = codec
        self.name = name
        self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        from ..comm.allgather import gather_encoded

        if not output_tensor.is_floating_point():  # FSDP's byte-typed gathers: as they are
            dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            return None
        gather_encoded(self.codec, input_tensor, output_tensor, group, self.name, self.calls)
        self.calls += 1
        return None  # done: FSDP waits on a handle only when it gets one


class FSDPState:
    """What :func:`gradzip.register` returns for an FSDP2 model: the engine, the units it
    reduces, and the stats, checkpoint and close of the DDP state."""

    def __init__(self, comm: Communicator, min_numel: int, group: Optional[dist.ProcessGroup]) -> None:
        self.comm = comm
        self.min_numel = min_numel
        self.group = group
        self.units: Dict[str, Any] = {}
        self.gathers: Dict[str, Any] = {}
        self.compressed_calls = 0
        self.plain_calls = 0

    def stats(self, per_tensor: bool = False) -> Dict[str, Any]:
        """The engine's figures (per unit with ``per_tensor``; plain units count at their fp32
        bytes), plus the units and how many of their calls were compressed."""
        out = self.comm.stats(per_tensor)
        out.update(units=len(self.units), compressed_calls=self.compressed_calls, plain_calls=self.plain_calls,
                   weight_gathers=sum(g.calls for g in self.gathers.values()), codec=self.comm.codec.name,
                   memory=self.comm.memory.name, collective="reducescatter")
        return out

    def plan(self) -> Dict[str, Any]:
        """Each unit's reduce-scatter (compressed, or plain below ``min_numel``, once it has run)
        and the topology: on several nodes of several ranks, the two stages and their links."""
        units = {name: handler.how for name, handler in self.units.items()}
        return {"front_end": "fsdp2", "codec": self.comm.codec.name, "units": units,
                "topology": self.comm.describe_topology(reduce_scatter=True)}

    def state_dict(self) -> Dict[str, Any]:
        return self.comm.state_dict()

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        self.comm.load_state_dict(state, strict=strict)

    def close(self) -> None:
        self.comm.close()


def units_of(model: Any) -> List[Tuple[str, Any, dist.ProcessGroup]]:
    """(name, unit, the group it reduce-scatters over) of every FSDP2 unit of ``model`` that
    holds parameters (the root included, named ``root``)."""
    out = []
    for name, m in model.named_modules():
        if is_fsdp2(m):
            group = shard_group(m)
            if group is not None:  # a unit with no parameters of its own has nothing to reduce
                out.append((name or "root", m, group))
    return out


def install(
    units: List[Tuple[str, Any, dist.ProcessGroup]], comm: Communicator, min_numel: int, weight_bits: Optional[int] = None,
) -> FSDPState:
    """Give every unit (:func:`units_of`) gradzip's reduce-scatter, and with ``weight_bits`` its
    quantised weight all-gather."""
    state = FSDPState(comm, min_numel, units[0][2] if units else None)
    for name, unit, _ in units:
        handler = GradzipReduceScatter(state, name)
        unit.set_custom_reduce_scatter(handler)
        state.units[name] = handler
        if weight_bits is not None:
            from ..codecs import codec

            gather = GradzipAllGather(codec("maxmin", bits=weight_bits, mode="nearest"), f"{name}.weights")
            unit.set_custom_all_gather(gather)
            state.gathers[name] = gather
    return state
