"""Options of codecs, memories and collectives: declared once, validated one way.

A configurable class lists its constructor options as ``options = {"bits": Option(4, int_in(1, 8),
"an integer in 1..8", "bits per value")}``. :meth:`Configurable.set_options` checks the given
keywords against them (an unknown name or a bad value raises ``ValueError`` naming the valid
choices, at construction) and sets each as an attribute; :meth:`Configurable.config` returns
them, which is what ranks compare and checkpoints record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Optional


@dataclass(frozen=True)
class Option:
    """One constructor option: its default, a validity check and what it must be."""

    default: Any
    check: Callable[[Any], bool]
    expect: str
    doc: str = ""


def int_in(lo: int, hi: Optional[int] = None) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)

    return check


def float_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return check


def one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda v: v in choices


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``check``, or None."""
    return lambda v: v is None or check(v)


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


class Configurable:
    """A class whose constructor options are declared in ``options`` (see the module docstring)."""

    kind: ClassVar[str] = ""  # "codec", "memory", "collective": names the class in errors
    name: ClassVar[str] = ""
    options: ClassVar[Dict[str, Option]] = {}

    def set_options(self, opts: Dict[str, Any]) -> None:
        unknown = sorted(set(opts) - set(self.options))
        if unknown:
            valid = ", ".join(sorted(self.options)) or "(none)"
            raise ValueError(f"{self.kind} {self.name!r}: unknown option(s) {', '.join(unknown)}; valid options: {valid}")
        for key, spec in self.options.items():
            value = opts.get(key, spec.default)
            if not spec.check(value):
                raise ValueError(f"{self.kind} {self.name!r}: {key} must be {spec.expect}, got {value!r}")
            setattr(self, key, value)

    def config(self) -> Dict[str, Any]:
        """The options in force."""
        return {key: getattr(self, key) for key in self.options}
