"""Error feedback: what a lossy codec did not send this step is added to the next step's input.

``compensate`` turns the gradient into the codec's input, ``update`` stores
``input - decoded own payload`` as the residual. State is keyed by parameter name (DDP rebuilds
its buckets after the first iteration, so bucket indices are not stable).

Non-finite policy: when a step's gradient holds NaN or Inf on any rank, the collective reports it
to every rank and every rank leaves its residual unchanged for that step, so one bad batch (for
example an fp16 overflow that a GradScaler will skip) never poisons the memory.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch._utils import _unflatten_dense_tensors

from ..kernels import fused
from ..options import Registry
from ..options import Configurable, Option, float_in, optional


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def reads_on_host(flag: torch.Tensor) -> bool:
    """Whether a non-finite flag is read on the host (free for a CPU tensor: the memory then
    touches nothing on a skipped step) rather than used on the device (no host sync)."""
    return flag.device.type == "cpu"


def _all_fp32(tensors: Sequence[torch.Tensor], residuals: Sequence[Optional[torch.Tensor]]) -> bool:
    """Every tensor fp32 and every residual there, in fp32: what the multi-tensor operations take."""
    return all(r is not None and r.dtype == torch.float32 and t.dtype == torch.float32 for t, r in zip(tensors, residuals))


Flats = Dict[Tuple[str, ...], List["weakref.ref[torch.Tensor]"]]


def flat_views(store: Dict[str, torch.Tensor], flats: Flats, names: Sequence[str],
               olds: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors of ``names`` in ``store`` (``olds``, fp32) as views of one flat buffer, back to
    back, so one operation updates them all; the buffer is made (one multi-tensor copy) the
    first time these names are updated together, and again after any of them was replaced (a
    checkpoint loaded, a name released, a fused group's residual put in its place). ``flats``
    records which names share a buffer (weakly: a buffer is held by its views alone)."""
    key = tuple(names)
    views = _live_views(store, flats, key)
    if views is not None:
        return views[0]._base
    detach_views(store, flats, key)
    flat = torch.empty(sum(old.numel() for old in olds), dtype=torch.float32, device=olds[0].device)
    views = list(_unflatten_dense_tensors(flat, olds))
    torch._foreach_copy_(views, list(olds))
    for n, v in zip(names, views):
        store[n] = v
    flats[key] = [weakref.ref(v) for v in views]
    return flat


def _live_views(store: Dict[str, torch.Tensor], flats: Flats, key: Tuple[str, ...]) -> Optional[List[torch.Tensor]]:
    """The tensors of ``key``'s flat buffer, where each is still the one of its name in ``store``."""
    refs = flats.get(key)
    views = None if refs is None else [ref() for ref in refs]
    if views is None or any(v is None or store.get(n) is not v for n, v in zip(key, views)):
        return None
    return views


def detach_views(store: Dict[str, torch.Tensor], flats: Flats, names: Sequence[str]) -> None:
    """Forget the flat buffers that hold a tensor of ``names``, or one whose tensor was
    replaced; the tensors of other names still in them get copies of their own, so no buffer
    stays alive for a part of it."""
    for key in [k for k in flats if not set(k).isdisjoint(names) or _live_views(store, flats, k) is None]:
        for n, ref in zip(key, flats.pop(key)):
            v = ref()
            if n not in names and v is not None and store.get(n) is v:
                store[n] = v.clone()


def wire_of(grad: torch.Tensor, inp: torch.Tensor) -> Optional[torch.dtype]:
    """The gradient's dtype where the codec's input is a wider compensation of it (a 16-bit
    gradient with its fp32 residual), else None: values that a codec sends as they are go in
    the gradient's own width, not the residual's (:attr:`~gradzip.codecs.base.Meta.wire`)."""
    return grad.dtype if grad.dtype != inp.dtype and grad.dtype.is_floating_point else None


class Memory(Configurable):
    """No error feedback: the codec sees the raw gradient."""

    kind = "memory"
    name = "none"

    def __init__(self, **opts: Any) -> None:
        self.set_options(opts)

    def compensate(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return t

    def input_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype :meth:`compensate` returns for gradients of ``dtype``."""
        return dtype

    def compensate_into(self, t: torch.Tensor, name: str, out: torch.Tensor) -> torch.Tensor:
        """:meth:`compensate` written into ``out`` (a slice of a fused buffer), which it returns."""
        return out.copy_(self.compensate(t, name).reshape(out.shape))

    def update(self, name: str, compensated: torch.Tensor, decoded: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        """Record what was lost; ``skip`` is a 0-dim bool tensor: when True, keep the old state."""

    def compensate_many(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> List[torch.Tensor]:
        """:meth:`compensate` of several gradients (contiguous) encoded one by one but exchanged
        together; a memory may do them in a few multi-tensor operations instead of one each."""
        return [self.compensate(t, name) for t, name in zip(tensors, names)]

    def compensate_many_into(self, tensors: Sequence[torch.Tensor], names: Sequence[str],
                             outs: Sequence[torch.Tensor]) -> None:
        """:meth:`compensate_into` of several gradients, each into its ``out`` (their places in
        a fused group's buffer); a memory may do them in a few multi-tensor operations."""
        for t, name, out in zip(tensors, names, outs):
            self.compensate_into(t, name, out)

    def update_many(self, names: Sequence[str], compensated: Sequence[torch.Tensor], decoded: Sequence[torch.Tensor],
                    skip: Optional[torch.Tensor] = None) -> None:
        """:meth:`update` of several gradients under one flag."""
        for name, c, d in zip(names, compensated, decoded):
            self.update(name, c, d, skip=skip)

    @property
    def stateful(self) -> bool:
        return False

    #: whether :meth:`update` makes the compensated input again from its own state rather than
    #: reading it: the input may then be compensated into the gradient's own memory, which the
    #: average overwrites (see :meth:`Communicator._reduce <gradzip.sync.engine.Communicator._reduce>`)
    remakes_input = False

    @property
    def reads_input(self) -> bool:
        """Whether :meth:`update` reads the compensated input after the exchange: the engine
        then keeps it intact until then (no average written over it, its buffer not lent on)."""
        return self.stateful and not self.remakes_input

    def release(self, name: str) -> Optional[torch.Tensor]:
        """Remove and return what parameter ``name`` still owes the other ranks (its unsent
        remainder, fp32, in the gradient's shape), or None: the parameter is sent uncompressed
        from now on, and adding this to its next gradient loses nothing."""
        return None

    def _stores(self) -> Tuple[Dict[str, torch.Tensor], ...]:
        """The state this memory keeps per parameter, by name (none here)."""
        return ()

    def refused_by(self, codec: Any) -> Optional[str]:
        """Why ``codec``, as configured, cannot take this error feedback
        (:meth:`~gradzip.codecs.base.Codec.memory_problem`), or None: a memory that keeps no
        state, whatever its name, is no error feedback, which every codec takes."""
        return codec.memory_problem(self.name) if self.stateful else None

    def clear_at(self, name: str, index: torch.Tensor) -> None:
        """Zero parameter ``name``'s state at the flat positions ``index`` (places that hold no
        value of the parameter: a sharded front end's padding), where it has any."""
        for store in self._stores():
            kept = store.get(name)
            if kept is not None:
                kept.view(-1).index_fill_(0, index.to(kept.device), 0)

    def holding(self) -> Set[str]:
        """The parameters this memory keeps state for (a residual, a momentum), by name: what
        they may still owe the other ranks."""
        return {name for store in self._stores() for name in store}

    def set_aside(self, name: str) -> Optional[List[Optional[torch.Tensor]]]:
        """Take parameter ``name``'s state out of this step: a copy of it is returned and it is
        zeroed where it lies (a view of a group's buffer stays one), so this step compensates
        nothing into the parameter and sends none of what it owes. For a parameter that had no
        gradient on this rank in this step (DDP's ``find_unused_parameters``): DDP does not
        apply an average to a parameter that no rank used, so its remainder would be lost, and
        where other ranks used it, this rank's remainder waits for a step that uses it here.
        None where there is nothing to hold."""
        held = []
        for store in self._stores():
            kept = store.get(name)
            held.append(None if kept is None else kept.clone())
            if kept is not None:
                kept.zero_()
        return held if any(h is not None for h in held) else None

    def put_back(self, name: str, held: List[Optional[torch.Tensor]]) -> None:
        """Add what :meth:`set_aside` took to parameter ``name``'s state once the step has
        updated it (from zero: what this step's own encoding of it lost)."""
        for store, kept in zip(self._stores(), held):
            if kept is None:
                continue
            now = store.get(name)
            if now is None:
                store[name] = kept
            else:
                now.add_(kept.to(device=now.device, dtype=now.dtype).view(now.shape))  # (a loaded state sits on the CPU)

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ResidualMemory(Memory):
    """Residual error feedback: ``input = beta * residual + gamma * grad``.

    As in GRACE's residual memory (Xu et al., ICDCS'21) and 1-bit SGD (Seide et al., 2014). The
    residual is kept in fp32 whatever the gradient's dtype, so small remainders of fp16/bf16
    gradients are not rounded away. A residual is overwritten in place at each step (no fresh
    tensor, and no page faults, per step); :meth:`state_dict` returns copies.
    """

    name = "residual"
    options = {
        "beta": Option(1.0, float_in(0.0, math.inf, hi_open=True), "a finite number >= 0", "weight of the residual"),
        "gamma": Option(1.0, float_in(0.0, math.inf, hi_open=True), "a finite number >= 0", "weight of the gradient"),
    }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)  # beta and gamma, where they are options (1 where they are not)
        self.beta, self.gamma = float(getattr(self, "beta", 1.0)), float(getattr(self, "gamma", 1.0))
        self.residuals: Dict[str, torch.Tensor] = {}
        # names updated together -> their residuals, views of one flat buffer (weakly: see _flat)
        self._flats: Flats = {}

    @property
    def stateful(self) -> bool:
        return True

    def input_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def _residual(self, name: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The stored residual on ``like``'s device (a restored checkpoint may sit on the CPU)."""
        res = self.residuals.get(name)
        if res is None or res.shape != like.shape:
            return None
        if res.device != like.device:
            res = self.residuals[name] = res.to(like.device)
        return res

    def compensate(self, t: torch.Tensor, name: str) -> torch.Tensor:
        x = t.float()
        if self.gamma != 1.0:
            x = x * self.gamma
        res = self._residual(name, t)
        if res is None:
            return x
        return torch.add(x, res, alpha=self.beta)  # a new tensor: the caller's gradient stays as it was

    def compensate_into(self, t: torch.Tensor, name: str, out: torch.Tensor) -> torch.Tensor:
        res = self._residual(name, t)
        src = t.reshape(out.shape)
        if self.gamma != 1.0:
            return super().compensate_into(t, name, out)
        if res is None:
            return out if out.data_ptr() == src.data_ptr() else out.copy_(src)  # in place: nothing to add
        return torch.add(src, res.reshape(out.shape), alpha=self.beta, out=out)  # one pass, no temporary

    def compensate_many(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> List[torch.Tensor]:
        """One multi-tensor add (``torch._foreach_add``: one launch for them all on a GPU) where
        every gradient is fp32 and has its residual; else one :meth:`compensate` each."""
        olds = [self._residual(name, t) for t, name in zip(tensors, names)]
        if len(tensors) > 1 and self.gamma == 1.0 and _all_fp32(tensors, olds):
            return list(torch._foreach_add(list(tensors), olds, alpha=self.beta))  # new tensors, as compensate's
        return super().compensate_many(tensors, names)

    def update_many(self, names: Sequence[str], compensated: Sequence[torch.Tensor], decoded: Sequence[torch.Tensor],
                    skip: Optional[torch.Tensor] = None) -> None:
        """With the flag on the device (an accelerator's, not read back): the new residuals
        written into one scratch buffer by a multi-tensor copy and subtraction, then picked
        against the old ones, which are views of one buffer (:meth:`_flat`), in one
        ``torch.where`` (NaN-safe, which arithmetic on the flag is not), where every residual
        exists in fp32 on one device; else one :meth:`update` each."""
        olds = [self._residual(name, c) for name, c in zip(names, compensated)]
        if (skip is None or reads_on_host(skip) or len(names) < 2 or not _all_fp32(compensated, olds)
                or any(old.device != olds[0].device for old in olds)):
            return super().update_many(names, compensated, decoded, skip)
        flat = self._flat(names, olds)
        news = torch.empty_like(flat)
        parts = _unflatten_dense_tensors(news, olds)  # views of the scratch, shaped as the residuals
        torch._foreach_copy_(parts, list(compensated))
        torch._foreach_sub_(parts, [d.view(c.shape) for c, d in zip(compensated, decoded)])
        torch.where(skip, flat, news, out=flat)  # one pick for the batch: NaN-safe, no host read

    def residuals_for(self, names: Sequence[str], likes: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], List[bool]]:
        """The fp32 residuals of ``names`` on their gradients' (``likes``) devices, contiguous, to
        be settled in place by an exchange, and whether each was there already: one without a
        residual of its gradient's shape gets zeros, registered now (adding nothing to its
        gradient); one of another dtype or layout is replaced by an fp32 contiguous copy."""
        had = []
        for name, like in zip(names, likes):
            res = self._residual(name, like)
            had.append(res is not None)
            if res is None or res.dtype != torch.float32 or not res.is_contiguous():
                # none yet: zeros; one of another dtype (a checkpoint's) or layout: as fp32, contiguous
                new = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
                if res is not None:
                    new.copy_(res)
                self.residuals[name] = new
                if self._flats:  # (the other names of its flat buffer get copies of their own)
                    self._detach([name])
        return [self.residuals[name] for name in names], had  # read once every replacement is done

    def flat_residuals(self, names: Sequence[str], residuals: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`_flat`: the residuals of ``names`` as views of one flat buffer (they may be
        copied there: use ``self.residuals`` afterwards), so one operation picks them all."""
        return self._flat(names, residuals)

    def _flat(self, names: Sequence[str], olds: Sequence[torch.Tensor]) -> torch.Tensor:
        """The residuals of ``names`` (``olds``) as views of one flat buffer (:func:`flat_views`),
        so the flag picks them all in one operation."""
        return flat_views(self.residuals, self._flats, names, olds)

    def _detach(self, names: Sequence[str]) -> None:
        detach_views(self.residuals, self._flats, names)

    def update(self, name: str, compensated: torch.Tensor, decoded: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        old = self._residual(name, compensated)
        if skip is not None and reads_on_host(skip):
            if bool(skip):  # free to read on the CPU: keep the old residual, touch nothing
                if old is None:
                    self.residuals[name] = torch.zeros(compensated.shape, dtype=torch.float32, device=compensated.device)
                return
            skip = None
        if skip is None:
            # written over the previous residual: no fresh tensor (and its page faults) per step
            dest = old if old is not None and old.dtype == torch.float32 else torch.empty(
                compensated.shape, dtype=torch.float32, device=compensated.device,
            )
            self.residuals[name] = torch.sub(compensated.float(), decoded.reshape(compensated.shape).float(), out=dest)
            return
        new = compensated.float() - decoded.reshape(compensated.shape).float()
        self.residuals[name] = torch.where(skip, old if old is not None else torch.zeros_like(new), new)
        if self._flats:  # ``old`` may have been a view of a flat buffer
            self._detach([name])

    def _stores(self) -> Tuple[Dict[str, torch.Tensor], ...]:
        return (self.residuals,)

    def release(self, name: str) -> Optional[torch.Tensor]:
        res = self.residuals.pop(name, None)
        if self._flats:
            self._detach([name])
        return None if res is None else res * self.beta  # as compensate() would add it

    def state_dict(self) -> Dict[str, Any]:
        # copies: the residuals are updated in place at the next step
        return {"residuals": {k: v.detach().to("cpu", copy=True) for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        self._flats.clear()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(beta={self.beta}, gamma={self.gamma})"


class EFSignMemory(ResidualMemory):
    """EF-signSGD's error feedback (Karimireddy et al., ICML'19): the residual memory with
    ``beta = gamma = 1``; the learning rate is applied by the optimizer after decoding."""

    name = "efsign"
    options: Dict[str, Option] = {}


class PowerSGDMemory(ResidualMemory):
    """PowerSGD's error feedback (Vogels et al., NeurIPS'19): the residual memory with
    ``beta = gamma = 1``, kept for the full matrix."""

    name = "powersgd"
    options: Dict[str, Option] = {}


def _masked_sum_into(v: torch.Tensor, u: torch.Tensor, sent: torch.Tensor, zero: torch.Tensor) -> None:
    """``v ← 0 where sent, else v + u`` in one pass over ``v``: a piece of
    :data:`fused.TORCH_PIECE <gradzip.kernels.fused.TORCH_PIECE>` values at a time on the CPU
    (the sum's temporary a piece long), the sum then the mask elsewhere."""
    step = fused.piece_length(v)
    if step >= v.numel() or not (v.is_contiguous() and u.is_contiguous() and sent.is_contiguous()):
        v.add_(u).masked_fill_(sent, 0.0)
        return
    fv, fu, fs = v.view(-1), u.reshape(-1), sent.reshape(-1)
    for a in range(0, fv.numel(), step):
        piece = fv[a : a + step]
        torch.where(fs[a : a + step], zero, piece + fu[a : a + step], out=piece)


class DGCMemory(Memory):
    """Deep Gradient Compression's memory (Lin et al., ICLR'18): momentum correction, momentum
    factor masking and local gradient clipping, per tensor name, in fp32.

    ``compensate``: optionally clip the gradient ``g`` to L2 norm ``clip_norm`` (scaled on the
    device, no host sync), then ``u ← momentum·u + g``, ``v ← v + u``, and hand ``v`` to the codec.
    ``update``: where the decoded own payload is nonzero (the values that were sent), zero both
    ``u`` and ``v`` (momentum factor masking); elsewhere both carry over. With ``skip`` (a
    non-finite step on some rank) ``u`` and ``v`` keep their previous values.

    Made for sparsifying codecs (``dgc``, ``topk``, ...): a sent value leaves nothing behind.
    With a quantiser, whose decode is nonzero nearly everywhere, the quantisation error would be
    dropped. Use plain SGD (no optimizer momentum): ``u`` is the momentum. The paper clips the
    gradient of each worker at the global threshold times ``N^(-1/2)`` for N workers; here
    ``clip_norm`` is that per-tensor threshold, applied as given.

    Options (``memory_options``): ``momentum`` (default 0.9, in [0, 1)), ``clip_norm`` (default
    None = no clipping; else a positive number).
    """

    name = "dgc"
    remakes_input = True  # v + u, summed again where v lies
    options = {
        "momentum": Option(0.9, float_in(0.0, 1.0, hi_open=True), "a float in [0, 1)", "momentum factor"),
        "clip_norm": Option(
            None, optional(float_in(0.0, math.inf, lo_open=True, hi_open=True)), "None or a positive number",
            "local gradient clipping (L2 norm)",
        ),
    }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self.momentum = float(self.momentum)
        self.clip_norm = None if self.clip_norm is None else float(self.clip_norm)
        self.momentums: Dict[str, torch.Tensor] = {}  # u
        self.velocities: Dict[str, torch.Tensor] = {}  # v
        self._pending: Dict[str, torch.Tensor] = {}  # this step's u, until update() decides
        # a fused group's u and v as views of one flat buffer each (see flat_views)
        self._flats: Tuple[Flats, Flats] = ({}, {})

    @property
    def stateful(self) -> bool:
        return True

    def input_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    @staticmethod
    def _get(store: Dict[str, torch.Tensor], name: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        t = store.get(name)
        if t is None or t.shape != like.shape:
            return None
        return t if t.device == like.device else t.to(like.device)

    def _momentum_of(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """This step's ``u = momentum·u + g`` (``g`` clipped), a new tensor, kept until
        :meth:`update` decides whether it becomes the state."""
        g = t.float()
        if self.clip_norm is not None:
            norm = torch.linalg.vector_norm(g)
            g = g * (self.clip_norm / (norm + 1e-6)).clamp(max=1.0)
        u_old = self._get(self.momentums, name, g)
        u = g.clone() if u_old is None else torch.add(g, u_old, alpha=self.momentum)
        self._pending[name] = u
        return u

    def compensate(self, t: torch.Tensor, name: str) -> torch.Tensor:
        u = self._momentum_of(t, name)
        v_old = self._get(self.velocities, name, u)
        return u.clone() if v_old is None else v_old + u  # new tensors: neither aliases the state nor t

    def compensate_into(self, t: torch.Tensor, name: str, out: torch.Tensor) -> torch.Tensor:
        """``v + u`` summed straight into ``out`` (a fused group's slice): the same sum as
        :meth:`compensate`'s, no tensor of the gradient's size made and copied."""
        if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != t.numel():
            return super().compensate_into(t, name, out)
        u = self._momentum_of(t, name)
        v_old = self._get(self.velocities, name, u)
        shaped = out.view(u.shape)
        if v_old is None:
            shaped.copy_(u)
        else:
            torch.add(v_old, u, out=shaped)
        return out

    def _group_state(self, tensors: Sequence[torch.Tensor], names: Sequence[str]
                     ) -> Optional[Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor], List[torch.Tensor]]]:
        """A group's u and v as views of one flat buffer each (flat u, flat v, and their views by
        name), where it can be taken at once: on an accelerator, several gradients, each with
        both states in fp32 on its device, and no clipping (a norm a tensor); else None."""
        if len(tensors) < 2 or self.clip_norm is not None or not fused.groups_at_once(tensors[0].device):
            return None
        flats = []
        for store, kept in zip((self.momentums, self.velocities), self._flats):
            olds = [self._get(store, n, t) for n, t in zip(names, tensors)]
            if any(o is None or o.dtype != torch.float32 or o.device != tensors[0].device for o in olds):
                return None
            flats.append(flat_views(store, kept, names, olds))
        return flats[0], flats[1], [self.momentums[n] for n in names], [self.velocities[n] for n in names]

    def compensate_many_into(self, tensors: Sequence[torch.Tensor], names: Sequence[str],
                             outs: Sequence[torch.Tensor]) -> None:
        """A fused group's ``u`` and ``v`` in a few multi-tensor operations (:meth:`_group_state`):
        this step's ``u = g + momentum·u`` in one flat buffer, ``v + u`` written into ``outs``;
        the same operations as :meth:`compensate`'s, tensor by tensor elsewhere."""
        state = self._group_state(tensors, names)
        if state is None:
            return super().compensate_many_into(tensors, names, outs)
        u_flat, _, us, vs = state
        pending = list(_unflatten_dense_tensors(torch.empty_like(u_flat), us))
        torch._foreach_copy_(pending, [t.view(u.shape) for t, u in zip(tensors, us)])
        torch._foreach_add_(pending, us, alpha=self.momentum)
        self._pending.update(zip(names, pending))
        shaped = [out.view(v.shape) for out, v in zip(outs, vs)]
        torch._foreach_copy_(shaped, vs)
        torch._foreach_add_(shaped, pending)

    def update_many(self, names: Sequence[str], compensated: Sequence[torch.Tensor], decoded: Sequence[torch.Tensor],
                    skip: Optional[torch.Tensor] = None) -> None:
        """A group compensated at once (its pending ``u`` one flat buffer): the sent values'
        mask, the masking and the flag's pick in a few flat operations (the flag not read on the
        host); else one :meth:`update` each."""
        pending = [self._pending.get(n) for n in names]
        base = None if pending[0] is None else pending[0]._base
        state = None
        if base is not None and all(p is not None and p._base is base for p in pending):
            state = self._group_state(compensated, names)
        if state is None:
            return super().update_many(names, compensated, decoded, skip)
        if skip is not None and reads_on_host(skip):  # (free to read: a skipped step touches nothing)
            if bool(skip):
                for n in names:
                    self._pending.pop(n, None)
                return
            skip = None
        u_flat, v_flat, us, _ = state
        sent = torch.empty_like(base)
        torch._foreach_copy_(list(_unflatten_dense_tensors(sent, us)), [d.view(u.shape) for d, u in zip(decoded, us)])
        mask = sent != 0
        v_new = torch.add(v_flat, base, out=sent)  # v + u again (remakes_input); the decoded values' buffer takes it
        u_new = base.masked_fill_(mask, 0.0)
        v_new.masked_fill_(mask, 0.0)
        for flat, new in ((u_flat, u_new), (v_flat, v_new)):
            if skip is None:
                flat.copy_(new)
            else:
                torch.where(skip, flat, new, out=flat)
        for n in names:
            self._pending.pop(n, None)

    def update(self, name: str, compensated: torch.Tensor, decoded: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        """The masking written into the state where it lies (this step's ``u`` masked in its
        own tensor; ``v`` masked straight into the old one): no tensor of the gradient's size
        made beyond the pending ``u``. A flag on the CPU is read (a skipped step touches
        nothing); one on a device picks old or new there.

        The compensated ``v + u`` is summed again from the state (the same sum, the same bits),
        not read from ``compensated``: the engine may have compensated into the gradient's own
        memory, which holds the average by now (:attr:`remakes_input`). Only without this
        step's ``u`` (no :meth:`compensate` before) is ``compensated`` read."""
        shape = compensated.shape  # (its shape and device, whatever it holds now)
        u = self._pending.pop(name, None)
        if u is not None and u.shape != shape:
            u = None
        if skip is not None and reads_on_host(skip):
            if bool(skip):  # the old state stays (zeros for a name seen the first time)
                for store in (self.momentums, self.velocities):
                    if self._get(store, name, compensated) is None:
                        store[name] = torch.zeros(shape, dtype=torch.float32, device=compensated.device)
                return
            skip = None
        sent = decoded.reshape(shape) != 0
        zero = torch.zeros((), dtype=torch.float32, device=compensated.device)
        v_new = None
        if u is None:  # (the input as given)
            v_new = compensated.float().masked_fill(sent, 0.0)
            u = torch.zeros_like(v_new)
        else:
            old = self._in_place(self.velocities, name, compensated)
            if old is not None and skip is None:  # v + u summed and masked where v lies
                _masked_sum_into(old, u, sent, zero)
            else:
                v_old = self._get(self.velocities, name, u)
                v_new = (u.clone() if v_old is None else v_old + u).masked_fill_(sent, 0.0)
        u.masked_fill_(sent, 0.0)  # (this step's u: no one else holds it)
        self._keep(self.momentums, name, u, skip, zero)
        if v_new is not None:
            self._keep(self.velocities, name, v_new, skip, zero)

    @staticmethod
    def _in_place(store: Dict[str, torch.Tensor], name: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The state of ``name`` where a new value can be written into it (fp32, ``like``'s
        shape and device), else None."""
        old = store.get(name)
        if old is None or old.shape != like.shape or old.device != like.device or old.dtype != torch.float32:
            return None
        return old

    def _keep(self, store: Dict[str, torch.Tensor], name: str, new: torch.Tensor, skip: Optional[torch.Tensor],
              zero: torch.Tensor) -> None:
        """``new`` as the state of ``name``, or the old state where the device flag ``skip`` is
        set (zeros where there was none): into the old one where it lies, else in its place (the
        old one moved to ``new``'s device and dtype)."""
        old = self._in_place(store, name, new)
        if skip is None:
            if old is not None and old._base is not None:
                old.copy_(new)  # (a view of a fused group's state stays one)
            else:
                store[name] = new
        elif old is not None:
            torch.where(skip, old, new, out=old)
        else:  # (a state elsewhere, one loaded from a checkpoint on the CPU, is kept too)
            kept = self._get(store, name, new)
            store[name] = torch.where(skip, zero if kept is None else kept.to(new.dtype), new)

    def _stores(self) -> Tuple[Dict[str, torch.Tensor], ...]:
        return (self.momentums, self.velocities)

    def release(self, name: str) -> Optional[torch.Tensor]:
        for store, kept in zip((self.momentums, self.velocities), self._flats):
            detach_views(store, kept, [name])
        self.momentums.pop(name, None)  # momentum correction ends with compression
        return self.velocities.pop(name, None)  # accumulated, not yet sent

    def state_dict(self) -> Dict[str, Any]:
        return {
            # copies: a fused group's are updated in place at the next step
            "momentums": {k: v.detach().to("cpu", copy=True) for k, v in self.momentums.items()},
            "velocities": {k: v.detach().to("cpu", copy=True) for k, v in self.velocities.items()},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.momentums = {k: v.clone() for k, v in state.get("momentums", {}).items()}
        self.velocities = {k: v.clone() for k, v in state.get("velocities", {}).items()}
        self._pending = {}
        self._flats = ({}, {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(momentum={self.momentum}, clip_norm={self.clip_norm})"


_MEMORIES: Registry[Memory] = Registry("memory", "memories")
for _cls in (Memory, ResidualMemory, EFSignMemory, PowerSGDMemory, DGCMemory):
    _MEMORIES.add(_cls)
register_memory = _MEMORIES.add
names = _MEMORIES.names


def memory(kind: "str | Memory | None" = "none", **opts: Any) -> Memory:
    """Build a memory by name (``none``, ``residual``, ``efsign``, ``powersgd``, ``dgc``)."""
    if isinstance(kind, Memory):
        if opts:
            raise ValueError("options cannot be given together with a Memory instance")
        return kind
    if kind is None:
        kind = "none"
    return _MEMORIES.get(kind)(**opts)  # ValueError for an unknown option or a bad value
