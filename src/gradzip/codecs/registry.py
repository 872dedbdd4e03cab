"""Codec names → classes: ``codec("qsgd", bits=4)`` builds one, ``names()`` lists them."""
from __future__ import annotations

from typing import Any, Dict, List, Type

from .base import Codec

_REGISTRY: Dict[str, Type[Codec]] = {}


def register_codec(cls: Type[Codec]) -> Type[Codec]:
    """Class decorator that makes a codec available under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a codec named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> List[str]:
    """Every registered codec name, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> Type[Codec]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(names())}") from None


def codec(name: str | Codec, **opts: Any) -> Codec:
    """Build the codec registered as ``name`` with its options (an instance passes through)."""
    if isinstance(name, Codec):
        if opts:
            raise ValueError("options cannot be given together with a codec instance")
        return name
    if not isinstance(name, str):
        raise ValueError(f"codec must be a name or a Codec, got {type(name).__name__}")
    return get(name)(**opts)
