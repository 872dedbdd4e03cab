"""Name → class tables for codecs, memories and collectives, with one error message style.

An unknown name raises ``ValueError`` that lists every valid name, so a typo in a config or an
environment variable is caught at construction with the fix in plain sight.
"""
from __future__ import annotations

from typing import Dict, Generic, List, Type, TypeVar

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
        return cls

    def names(self) -> List[str]:
        return sorted(self._classes)

    def get(self, name: object) -> Type[T]:
        cls = self._classes.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; valid {self.plural}: {', '.join(self.names())}")
        return cls
