"""The exceptions gradzip raises where training must stop rather than go on wrong.

Every one is a ``RuntimeError`` or ``ValueError`` as well, so code that catches those keeps working.
"""
from __future__ import annotations


class GradzipError(RuntimeError):
    """Base class of gradzip's own errors."""


class CommunicationError(GradzipError):
    """A gradient exchange failed or timed out: another rank stalled, died or issued other collectives.

    The message names this rank, the step and the tensors or bucket being exchanged; the error
    from ``torch.distributed`` is chained as ``__cause__``. Once one exchange has failed every
    later one of the same communicator fails at once with this error, instead of waiting for its
    own timeout: the process group cannot be trusted any more, so the job should stop (and be
    restarted from a checkpoint, e.g. by ``torchrun --max-restarts``).
    """

    def __init__(self, message: str, brief: str = "") -> None:
        super().__init__(message)
        self.brief = brief or message  # what failed, in a few words (repeated by later failures)


class SettingsMismatchError(GradzipError, ValueError):
    """Ranks were configured differently (codec, options, memory, collective, filter, version)."""


class CheckpointError(GradzipError, ValueError):
    """A state dict belongs to another rank, world size or configuration."""
