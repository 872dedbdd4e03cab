"""Every rank must run the same gradzip: settings compared across ranks, and their fingerprint.

Two ranks with different codecs, options or collectives do not fail cleanly on their own: they
diverge silently (fp16 on one rank, bf16 on another), abort inside gloo ("Received data size
doesn't match expected size") or wait forever on a collective the other never issues. So a
communicator compares the effective settings of every rank once, with one small collective, at
construction, and raises :class:`~gradzip.errors.SettingsMismatchError` on every rank, naming
the fields, the values, the ranks and (when it came from there) the ``GRADZIP_*`` variable.

The same settings, hashed, are the fingerprint that state dicts carry, so a checkpoint of one
configuration is not loaded into another without a word.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch.distributed as dist

from ..errors import CommunicationError, GradzipError, SettingsMismatchError

Settings = Dict[str, Any]
WAIT_WARNING_S = 60.0  # how long a rank waits for the others to meet it before it says what may be wrong
logger = logging.getLogger("gradzip")


def fingerprint(settings: Mapping[str, Any]) -> str:
    """A short hash of ``settings`` that is the same in every process for the same settings."""
    text = repr(sorted((k, repr(v)) for k, v in settings.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(value: Any, who: str, source: Optional[str]) -> str:
    origin = f" (from {source})" if source else ""
    return f"{value!r} on {who}{origin}"


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def differences(
    all_settings: List[Settings], all_sources: List[Mapping[str, str]], labels: Optional[List[str]] = None,
    defaults: Optional[Mapping[str, Any]] = None,
) -> List[str]:
    """One line per setting that is not the same on every rank (empty when they all agree).

    ``labels`` names the parties (default: their ranks), e.g. ``["the checkpoint", "this run"]``.
    ``defaults``: the values of settings left out where they hold their default (a party
    without the key is shown with it, "(the default)"; without one, "unset").
    """
    lines = []
    keys = sorted(set().union(*all_settings))
    missing = object()
    for key in keys:
        groups: Dict[str, List[int]] = {}
        for rank, s in enumerate(all_settings):
            groups.setdefault(repr(s.get(key, missing)), []).append(rank)
        if len(groups) == 1:
            continue
        parts = []
        for ranks in groups.values():
            value = all_settings[ranks[0]].get(key, missing)
            sources = sorted({all_sources[r].get(key, "") for r in ranks} - {""})
            who = " and ".join(labels[r] for r in ranks) if labels else _ranks(ranks)
            if value is missing:
                known = defaults is not None and key in defaults
                shown = f"{defaults[key]!r} (the default)" if known else "unset"
                parts.append(f"{shown} on {who}")
            else:
                parts.append(describe(value, who, ", ".join(sources) or None))
        lines.append(f"{key}: " + "; ".join(parts))
    return lines


def verify_same_on_all_ranks(
    settings: Settings, group: Optional[dist.ProcessGroup], sources: Optional[Mapping[str, str]] = None,
    defaults: Optional[Mapping[str, Any]] = None,
) -> None:
    """Raise :class:`SettingsMismatchError` on every rank of ``group`` unless all hold ``settings``.

    One ``all_gather_object`` of the settings (a few hundred bytes) over ``group``, which must be
    a group that no other thread issues collectives on at the same time.
    """
    gathered = _from_every_rank((dict(settings), dict(sources or {})), group)
    if gathered is None:
        return
    failed = [(r, g[0]["error"]) for r, g in enumerate(gathered) if set(g[0]) == {"error"}]
    if failed:  # (a rank whose construction failed sends its error in place of settings: that is the cause)
        raise SettingsMismatchError(
            f"gradzip: {_ranks([r for r, _ in failed])} could not build its communicator (seen from rank "
            f"{dist.get_rank(group)}): " + "; ".join(f"{error} on rank {r}" for r, error in failed)
        )
    lines = differences([g[0] for g in gathered], [g[1] for g in gathered], defaults=defaults)
    if lines:
        rank = dist.get_rank(group)
        raise SettingsMismatchError(
            f"gradzip settings differ between ranks (seen from rank {rank}); every rank must use the same "
            "codec, options, memory, collective, filter and gradzip version:\n  " + "\n  ".join(lines)
        )


def verify_same_names(names: List[str], group: Optional[dist.ProcessGroup]) -> None:
    """Raise :class:`SettingsMismatchError` on every rank of ``group`` unless every rank names
    the tensors it exchanges alike, in the same order.

    Each tensor's shared randomness (random-k's indices, stochastic rounding), its fused group
    and its saved state are keyed by its name, so a parameter named differently on one rank (a
    model wrapped once more, or compiled on that rank alone: ``_orig_mod.``) would draw other
    indices there and the replicas would drift apart without an error. One
    ``all_gather_object`` of the names, at registration.
    """
    gathered = _from_every_rank(list(names), group)
    if gathered is None:
        return
    first = gathered[0]
    for rank, other in enumerate(gathered):
        if other == first:
            continue
        at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
        mine = first[at] if at < len(first) else "nothing"
        theirs = other[at] if at < len(other) else "nothing"
        raise SettingsMismatchError(
            f"gradzip: the parameters' names differ between ranks (seen from rank {dist.get_rank(group)}): "
            f"the gradient {at} is {mine!r} on rank 0 and {theirs!r} on rank {rank} ({len(first)} and "
            f"{len(other)} gradients). gradzip keys each gradient's randomness and state by its name: wrap "
            "and compile the model alike on every rank"
        )


def _from_every_rank(obj: Any, group: Optional[dist.ProcessGroup]) -> Optional[List[Any]]:
    """Every rank's ``obj`` (one ``all_gather_object`` over ``group``, which no other thread may
    use meanwhile), or None where there is nothing to compare (no process group, one rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


@contextlib.contextmanager
def every_rank_meets(what: str, timeout: Optional[timedelta]) -> Iterator[None]:
    """Around a step every rank must take (making gradzip's process group, comparing settings).

    A rank that builds its communicator alone (``gradzip.register`` under ``if rank == 0:``)
    would otherwise wait, silent, for the process group's timeout (30 minutes by default) and
    then fail with the store's or the backend's own error. After :data:`WAIT_WARNING_S` a rank
    still waiting logs what it waits for and the likely cause, and goes on waiting (a rank may
    be merely slow); if torch.distributed gives up, the error is a
    :class:`~gradzip.errors.CommunicationError` saying the same.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    rank = dist.get_rank()
    limit = "the process group's timeout" + (f" ({timeout.total_seconds():g} s)" if timeout is not None else "")
    cause = ("every rank of the group must build its communicator (gradzip.register, a Communicator, a strategy "
             "or recipe) at the same point of the script, not under `if rank == 0:`")
    timer = threading.Timer(WAIT_WARNING_S, lambda: logger.warning(
        "gradzip: rank %d has waited %g s for the other ranks to %s; %s. Still waiting, up to %s.",
        rank, WAIT_WARNING_S, what, cause, limit))
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as exc:
        if not from_collective(exc):
            raise
        raise CommunicationError(
            f"gradzip: rank {rank} waited {limit} for the other ranks to {what} and they did not come: {cause} "
            f"(or one of them failed or stalled before it; {type(exc).__name__}: {exc})"
        ) from exc
    finally:
        timer.cancel()


_TRANSPORT_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer", "pair", "transport")


def from_collective(exc: BaseException) -> bool:
    """Whether ``exc`` came out of ``torch.distributed`` (a lost peer, a timeout), not local code:
    its own errors, or gloo's, which raise a plain ``RuntimeError`` naming the transport (never
    gradzip's own errors, whose messages may name a timeout or a backend)."""
    if isinstance(exc, GradzipError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _TRANSPORT_WORDS)
