"""Codec names → classes: ``codec("qsgd", bits=4)`` builds one, ``names()`` lists them."""
from __future__ import annotations

from typing import Any, List, Type

from ..options import Registry
from .base import Codec

_CODECS: Registry[Codec] = Registry("codec", "codecs")


def register_codec(cls: Type[Codec]) -> Type[Codec]:
    """Class decorator that makes a codec available under ``cls.name``."""
    return _CODECS.add(cls)


def names() -> List[str]:
    """Every registered codec name, sorted."""
    return _CODECS.names()


def get(name: str) -> Type[Codec]:
    return _CODECS.get(name)


def codec(name: str | Codec, **opts: Any) -> Codec:
    """Build the codec registered as ``name`` with its options (an instance passes through)."""
    if isinstance(name, Codec):
        if opts:
            raise ValueError("options cannot be given together with a codec instance")
        return name
    if not isinstance(name, str):
        raise ValueError(f"codec must be a name or a Codec, got {type(name).__name__}")
    return get(name)(**opts)
