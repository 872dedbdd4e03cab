"""FSDP2: gradzip's compressed reduce-scatter on every ``fully_shard`` unit.

FSDP2 reduces each unit's gradients with one reduce-scatter per backward: its input is every
rank's chunk in rank order (each chunk the unit's parameters' padded flat shards), its output
this rank's shard of the reduced gradient. ``FSDPModule.set_custom_reduce_scatter`` lets a
:class:`~torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter` take its place. gradzip's
compresses each chunk with the codec, exchanges the chunks by one all-to-all and averages only
this rank's (:meth:`gradzip.sync.engine.Communicator.reduce_scatter`), with error feedback kept
per rank for the whole unit. The residual is laid out as the unit's input, and known parameter by
parameter (FSDP2's post-backward is watched for which parameters it reduces): an unused
parameter keeps its residual until it is reduced again, and checkpoints hold residuals by
parameter name, so they load whatever the units or the world size. A unit smaller than
``min_numel`` values per rank goes through a plain reduce-scatter.

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

import math
import warnings
import weakref
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
            "adaptive", "adaptive_every", "node_dtype")


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


# One unit's reduce-scatter input, parameter by parameter: (world size, ((name, unsharded size,
# values per chunk), ...)). FSDP2 pads each gradient's dim 0 to a multiple of W, cuts it into W
# chunks and lays out row j as chunk j of every gradient in turn (``torch._chunk_cat``).
Layout = Tuple[int, Tuple[Tuple[str, Tuple[int, ...], int], ...]]


def unpack(flat: torch.Tensor, layout: Layout) -> Dict[str, torch.Tensor]:
    """A unit's flat reduce-scatter-shaped tensor as one tensor per parameter, in its own shape."""
    w, entries = layout
    rows = flat.reshape(w, -1)
    out, at = {}, 0
    for name, size, k in entries:
        padded = rows[:, at : at + k].reshape((-1,) + size[1:])
        out[name] = padded[: size[0]].clone()
        at += k
    return out


def padding_of(layout: Layout) -> Optional[torch.Tensor]:
    """The flat positions of a unit's reduce-scatter input that are FSDP2's padding (each
    gradient's dim 0 filled up to a multiple of W), or None where there is none."""
    w, entries = layout
    chunk = sum(k for _, _, k in entries)
    spans, at = [], 0
    for _, size, k in entries:
        j = torch.arange(math.prod(size), w * k)  # places of the padded gradient past its values
        if j.numel():
            spans.append(j.div(k, rounding_mode="floor").mul_(chunk).add_(j.remainder(k)).add_(at))
        at += k
    return torch.cat(spans) if spans else None


def pack(params: Dict[str, torch.Tensor], layout: Layout, device: torch.device) -> torch.Tensor:
    """:func:`unpack` reversed: zeros where ``params`` has no tensor (and in the padding)."""
    w, entries = layout
    rows = torch.zeros(w, sum(k for _, _, k in entries), dtype=torch.float32, device=device)
    at = 0
    for name, size, k in entries:
        t = params.get(name)
        if t is not None:  # padded to W chunks of k values, then into column block [at, at + k) of the rows
            padded = torch.zeros((w * k,), dtype=torch.float32, device=device)
            padded[: t.numel()].copy_(t.reshape(-1))
            rows[:, at : at + k].copy_(padded.view(w, k))
        at += k
    return rows.reshape(-1)


class GradzipReduceScatter(ReduceScatter):
    """One unit's reduce-scatter through the engine (see the module's notes)."""

    def __init__(self, state: "FSDPState", name: str, param_group: Any = None) -> None:
        self.state = state
        self.name = name
        self.how = "not run yet"  # "compressed" or "plain", once called
        self.layout: Optional[Layout] = None  # that of the residual kept under ``name``
        self.padding: Optional[torch.Tensor] = None  # the layout's padding places (padding_of)
        self._group: Any = None  # the FSDP param group whose post-backward is watched
        self.reduced: Optional[List[Any]] = None  # FSDP's parameters in the coming reduce-scatter, in order
        if param_group is not None:
            self._watch(param_group)

    def _watch(self, group: Any) -> None:
        """Note, as FSDP2's post-backward starts, which of the unit's parameters it will reduce
        (those with a gradient: an unused parameter is left out of the reduce-scatter's input)."""
        post_backward = group.post_backward
        self._group = group

        def noted(*args: Any, **kwargs: Any) -> Any:
            unused = getattr(group, "reduce_scatter_unused_params", False)
            self.reduced = [
                fp for fp in group.fsdp_params if hasattr(fp, "_unsharded_param") and (
                    fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
                    or (unused and fp.unsharded_param.requires_grad)
                )
            ]
            return post_backward(*args, **kwargs)

        group.post_backward = noted

    def detach(self) -> None:
        """Stop watching the param group's post-backward (its own method again)."""
        if self._group is not None:
            self._group.__dict__.pop("post_backward", None)
            self._group = None

    def _layout(self, w: int, chunk: int) -> Optional[Layout]:
        """The input's parameters, or None where they cannot be told (a parameter sharded on
        another dimension, or the sizes do not add up: the residual then stays whole, by unit)."""
        if self.reduced is None:
            return None
        entries = []
        for fp in self.reduced:
            size = tuple(getattr(fp, "_orig_size", ()))
            placement = getattr(getattr(fp, "fsdp_placement", None), "dim", None)
            if not size or placement != 0 or not getattr(fp, "_param_fqn", None):
                return None
            rows = -(-size[0] // w)
            entries.append((fp._param_fqn, size, rows * math.prod(size[1:])))
        if sum(k for _, _, k in entries) != chunk:
            return None
        return (w, tuple(entries))

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
            layout = self._layout(w, output_tensor.numel())
            if layout != self.layout:  # other parameters than last time: move the residual over
                state.relayout(self.name, self.layout, layout, input_tensor.device)
                self.layout = layout
                padding = padding_of(layout) if layout is not None else None
                # (on the input's device once: no copy to it at each call)
                self.padding = padding.to(input_tensor.device) if padding is not None else None
            state.comm.reduce_scatter(input_tensor, output_tensor, self.name, in_place=True)  # FSDP drops the input after
            if self.padding is not None:
                # FSDP2's padding holds zeros and its average is dropped: what the codec made of it is
                # no gradient's, and kept it would widen the next step's ranges and be lost at a
                # checkpoint (which holds residuals by parameter)
                state.comm.memory.clear_at(self.name, self.padding)
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
        self.parked: Dict[str, torch.Tensor] = {}  # residuals by parameter, of parameters not in a unit's layout
        # (unit, FSDP2's reduce-scatter, its all-gather where gradzip replaced it): put back at close
        self.defaults: List[Tuple[Any, Any, Any]] = []

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

    def relayout(self, name: str, old: Optional[Layout], new: Optional[Layout], device: torch.device) -> None:
        """Unit ``name`` now reduces the parameters of ``new``: its residual (laid out as ``old``)
        is kept per parameter, and rebuilt for ``new`` from what its parameters are owed. A
        parameter left out (unused this step) keeps its residual until it is reduced again."""
        residuals = getattr(self.comm.memory, "residuals", None)
        if residuals is None:
            return
        kept = residuals.pop(name, None)
        if kept is not None and old is not None:
            self.parked.update(unpack(kept, old))
        if new is not None and any(p in self.parked for p, _, _ in new[1]):
            residuals[name] = pack({p: self.parked.pop(p) for p, _, _ in new[1] if p in self.parked}, new, device)

    def state_dict(self) -> Dict[str, Any]:
        """The engine's state, with error-feedback residuals by parameter name
        (``parameter_residuals``, each in its parameter's unsharded shape): they load whatever
        the units, their padding or the parameters used in the last step."""
        state = self.comm.state_dict()
        residuals = state.get("memory", {}).get("residuals")
        if residuals is not None:
            params = {k: v.detach().to("cpu", copy=True) for k, v in self.parked.items()}
            for handler in self.units.values():
                if handler.layout is not None and handler.name in residuals:
                    params.update(unpack(residuals.pop(handler.name), handler.layout))
            state["parameter_residuals"] = params  # what stays in ``residuals``: units of a layout not known
        return state

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict`, as the engine does. Residuals by parameter name are kept
        for the same rank of the same world size; with ``strict=False`` also on another world size
        (resharded), where this rank takes those saved by the rank of its index: each is a
        replica's own unsent gradient, in the parameter's full shape, whatever the sharding."""
        state = dict(state)
        params = state.pop("parameter_residuals", None) or {}
        problems, same_rank, same = self.comm._compare_owner(state)
        self.comm.load_state_dict(state, strict=strict)
        self.parked = {}
        if params and same("memory") and (same_rank or state.get("rank") == self.comm.rank):
            self.parked = {k: v.clone() for k, v in params.items()}
            if not same_rank:
                warnings.warn(
                    f"gradzip (rank {self.comm.rank} of {self.comm.world_size}): carried over the error-feedback "
                    f"residuals rank {state.get('rank')} saved on world size {state.get('world_size')}, by parameter",
                    stacklevel=2,
                )
        for handler in self.units.values():  # rebuilt from ``parked`` at each unit's next call
            handler.layout = None

    def close(self) -> None:
        """Put FSDP2's own reduce-scatter (and weight all-gather) back on every unit, then close
        the engine: the model trains on as plain FSDP2, or takes another ``register``."""
        for handler in self.units.values():
            handler.detach()
        for unit, reduce_scatter, all_gather in self.defaults:
            unit.set_custom_reduce_scatter(reduce_scatter)
            if all_gather is not None:
                unit.set_custom_all_gather(all_gather)
        self.defaults = []
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


def weight_bits_problem(bits: Any) -> Optional[str]:
    """What is wrong with ``weight_bits`` (the weights' all-gather: 2..8 bits), or None."""
    if bits is None or (isinstance(bits, int) and not isinstance(bits, bool) and bits in range(2, 9)):
        return None
    return f"weight_bits must be an integer in 2..8, got {bits!r}"


def registered(units: List[Tuple[str, Any, dist.ProcessGroup]]) -> bool:
    """Whether gradzip's reduce-scatter of a state not yet closed is installed on one of these units."""
    for _, unit, _ in units:
        ref = getattr(unit, "_gradzip_state", None)
        state = ref() if ref is not None else None
        if state is not None and not state.comm._closed:
            return True
    return False


def install(
    units: List[Tuple[str, Any, dist.ProcessGroup]], comm: Communicator, min_numel: int, weight_bits: Optional[int] = None,
) -> FSDPState:
    """Give every unit (:func:`units_of`) gradzip's reduce-scatter, and with ``weight_bits`` its
    quantised weight all-gather."""
    state = FSDPState(comm, min_numel, units[0][2] if units else None)
    for name, unit, _ in units:
        unit._gradzip_state = weakref.ref(state)  # (see registered)
        groups = unit._get_fsdp_state()._fsdp_param_groups
        group = groups[0] if groups else None
        handler = GradzipReduceScatter(state, name, group)
        own = (getattr(group, "_reduce_scatter_comm", None), getattr(group, "_all_gather_comm", None))
        unit.set_custom_reduce_scatter(handler)
        state.units[name] = handler
        if weight_bits is not None:
            from ..codecs import codec

            gather = GradzipAllGather(codec("maxmin", bits=weight_bits, mode="nearest"), f"{name}.weights")
            unit.set_custom_all_gather(gather)
            state.gathers[name] = gather
        if own[0] is not None:
            state.defaults.append((unit, own[0], own[1] if weight_bits is not None else None))
    return state
