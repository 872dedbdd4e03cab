"""Options of codecs, memories and collectives: declared once, validated one way.

A configurable class lists its constructor options as ``options = {"bits": Option(4, int_in(1, 8),
"an integer in 1..8", "bits per value")}``. :meth:`Configurable.set_options` checks the given
keywords against them (an unknown name or a bad value raises ``ValueError`` naming the valid
choices, at construction) and sets each as an attribute; :meth:`Configurable.config` returns
them, which is what ranks compare and checkpoints record.

:class:`Registry` is the name → class table of codecs, memories and collectives: an unknown name
raises ``ValueError`` that lists every valid one, so a typo in a config or an environment
variable is caught at construction with the fix in plain sight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Generic, List, Optional, Sequence, Type, TypeVar


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
    registry: ClassVar[Optional["Registry[Any]"]] = None  # where the class is registered (Registry.add)

    def set_options(self, opts: Dict[str, Any]) -> None:
        unknown = sorted(set(opts) - set(self.options))
        if unknown:
            valid = ", ".join(sorted(self.options)) or "(none)"
            raise ValueError(f"{self.kind} {self.name!r}: unknown option(s) {', '.join(unknown)}; valid options: {valid}"
                             + self._elsewhere(unknown))
        for key, spec in self.options.items():
            value = opts.get(key, spec.default)
            if not spec.check(value):
                raise ValueError(f"{self.kind} {self.name!r}: {key} must be {spec.expect}, got {value!r}")
            setattr(self, key, value)

    def config(self) -> Dict[str, Any]:
        """The options in force."""
        return {key: getattr(self, key) for key in self.options}

    def _elsewhere(self, unknown: Sequence[str]) -> str:
        """Where options unknown here are known: the other classes of this kind that take them
        (``partitions`` set for the scatter-reduce belongs to ``ps``)."""
        registry = type(self).registry
        if registry is None:
            return ""
        notes = []
        for key in unknown:
            owners = [n for n in registry.names() if n != self.name and key in registry.get(n).options]
            if owners:
                notes.append(f"{key} is an option of {self.kind} {', '.join(repr(n) for n in owners)}")
        return "; " + "; ".join(notes) if notes else ""


T = TypeVar("T")


class Registry(Generic[T]):
    """Classes registered under their ``name`` attribute."""

    def __init__(self, kind: str, plural: str) -> None:
        self.kind = kind
        self.plural = plural
        self._classes: Dict[str, Type[T]] = {}

    def add(self, cls: Type[T]) -> Type[T]:
        """Register ``cls`` under ``cls.name`` (usable as a class decorator)."""
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{cls.__name__} has no name")
        if self._classes.get(name, cls) is not cls:
            raise ValueError(f"a {self.kind} named {name!r} is already registered")
        self._classes[name] = cls
        cls.registry = self  # (an error about an option names the classes that take it)
        return cls

    def names(self) -> List[str]:
        return sorted(self._classes)

    def get(self, name: object) -> Type[T]:
        cls = self._classes.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; valid {self.plural}: {', '.join(self.names())}")
        return cls
