"""What the agreed non-finite flag decides after an exchange: error feedback settled as the
collective releases its input, or an all-NaN average.

A residual memory's new state is the input less this rank's share of the average as counted.
Where the average overwrites the input (a DDP bucket averaged in place, a fused group's buffer
reused for its result), that difference is taken when the collective releases the input
(:attr:`~gradzip.comm.base.Call.on_release`), from the flag every rank agreed on, so every rank
keeps or replaces its residual alike. The functions here make those ``on_release`` callbacks for
the engine's paths (:mod:`gradzip.sync.engine`, :mod:`gradzip.sync.fused`) and say when the
input must be kept for a later reading instead.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from ..comm.base import Call, Collective, LateOut
from ..comm.pool import BufferPool
from . import device as _device

# the memories whose state is a plain fp32 residual, input − this rank's share (ResidualMemory's
# update; EF-signSGD's and PowerSGD's are it with beta = gamma = 1): settled in place
PLAIN_RESIDUALS = ("residual", "efsign", "powersgd")
# error feedbacks the in-place bucket path implements (input = gamma * grad + beta * residual)
IN_PLACE_MEMORIES = ("none", *PLAIN_RESIDUALS)


def residual_settles(mem: Any, dtype: torch.dtype) -> bool:
    """Whether ``mem``'s state is a plain fp32 residual that :func:`settle_residual` can
    update from the agreed flag."""
    return mem.name in IN_PLACE_MEMORIES and dtype == torch.float32


def scratch_for(flat: torch.Tensor, pool: BufferPool, lent: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """Where :func:`settle_residual` computes the new residual before the agreed flag picks
    it: on an accelerator, a pool buffer as long as ``flat`` (reading the flag on the host
    would stall the device's queue); None on the CPU, which reads the flag for free."""
    return None if _device.reads_flag_on_host(flat.device) else pool.lend((flat.numel(),), flat.device, lent)


def input_read_after(mem: Any, coll: Collective) -> bool:
    """Whether the compensated input is read after the exchange: by the memory's update
    (:attr:`~gradzip.sync.memory.Memory.reads_input`), or, with error feedback, by the collective
    ``coll`` to give this rank's share (:attr:`~gradzip.comm.base.Collective.own_reads_input`)."""
    return mem.reads_input or (mem.stateful and coll.own_reads_input)


def late_out(pool: BufferPool, lent_input: List[torch.Tensor], lent: List[torch.Tensor],
             flat: torch.Tensor, remade: bool = False) -> LateOut:
    """A group's :class:`LateOut`: its input buffer ``flat`` (lent into ``lent_input``) goes back
    to ``pool`` once the collective has read it for the last time (encoded it, or released it;
    encoded it where error feedback makes it again: ``remade``, see :func:`settle_remade`), and
    the average gets a buffer of the pool (into ``lent``) when it is written, or ``flat`` itself
    if it never went back. On a GPU the next borrower's work is queued behind the encode on the
    same stream."""
    def input_read() -> None:
        pool.give_back(lent_input)

    def lend() -> torch.Tensor:
        return flat if lent_input else pool.lend((flat.numel(),), flat.device, lent)

    return LateOut(lend, input_read, remade)


def settle_residual(residual: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> Callable[[Call, torch.Tensor], None]:
    """The ``on_release`` of an exchange whose average overwrites its input: there and then,
    residual = input − this rank's share as counted (:func:`_settle`)."""

    def settle(call: Call, nonfinite: torch.Tensor) -> None:
        _settle(residual, scratch, call, nonfinite)

    return settle


def _settle(residual: torch.Tensor, scratch: Optional[torch.Tensor], call: Call, nonfinite: torch.Tensor,
            x: Optional[torch.Tensor] = None) -> None:
    """residual = the input (``x`` where it was made again, :func:`settle_remade`) − this rank's
    share as counted (its own payloads decoded into the residual, then one subtraction;
    :meth:`Call.residual_into`); kept as it was on a non-finite step (every rank alike, from the
    agreed flag). With a ``scratch`` buffer (accelerators) the new residual is computed there
    and the flag, left on the device, picks old or new: one pass more, no wait for the device."""
    if scratch is not None:
        call.residual_into(scratch, x)
        torch.where(nonfinite, residual, scratch, out=residual)
        return
    if bool(nonfinite):
        return
    call.residual_into(residual, x)


def settle_remade(residual: torch.Tensor, remake: Callable[[List[torch.Tensor]], torch.Tensor],
                   pool: BufferPool) -> Callable[[Call, torch.Tensor], None]:
    """The ``on_release`` of an exchange whose input went back to ``pool`` once encoded
    (:attr:`LateOut.remade`): the input is made again by ``remake`` (the compensation run anew
    on the gradients and the residual, both untouched until then: the same bits) and the
    residual settled from it (:func:`_settle`), the buffers given back at once. A group in
    flight thus holds its payloads alone, not its input, for one pass more over the gradients
    at release; on the CPU a non-finite step, which keeps the residual, makes nothing."""

    def settle(call: Call, nonfinite: torch.Tensor) -> None:
        if _device.reads_flag_on_host(residual.device) and bool(nonfinite):
            return
        held: List[torch.Tensor] = []
        try:
            x = remake(held)
            _settle(residual, scratch_for(x, pool, held), call, nonfinite, x)
        finally:
            pool.give_back(held)

    return settle


def settle_into(scratch: torch.Tensor) -> Callable[[Call, torch.Tensor], None]:
    """The ``on_release`` that writes the input less this rank's share into ``scratch``
    whatever the flag (the caller then picks old or new residuals by the agreed flag)."""

    def settle(call: Call, nonfinite: torch.Tensor) -> None:
        call.residual_into(scratch.view(-1))

    return settle


def poison_if(avg: torch.Tensor, res: Any) -> torch.Tensor:
    """All-NaN ``avg`` where some rank's input was not finite (the agreed outcome), from the
    collective's :class:`~gradzip.comm.base.Result` ``res``: nothing to do where the collective
    poisoned the average itself (``res.poisoned``)."""
    nonfinite = res.nonfinite
    if res.poisoned:
        return avg
    if _device.reads_flag_on_host(avg.device):  # free here; skip a pass over the result
        return avg.fill_(float("nan")) if bool(nonfinite) else avg
    return avg.masked_fill_(nonfinite, float("nan"))  # no host sync on accelerators
