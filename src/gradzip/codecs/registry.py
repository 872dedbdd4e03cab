"""Codec names → classes: ``codec("qsgd", bits=4)`` builds one, ``names()`` lists them."""
from __future__ import annotations

from typing import Any, List, Type

from ..options import Registry
from .base import Codec

_CODECS: Registry[Codec] = Registry("codec", "codecs")


def register_codec(cls: Type[Codec]) -> Type[Codec]:
    """Class decorator that makes a codec available under ``cls.name``. A definition that could
    only fail later, at its first exchange and with an error that would not say why, is refused
    here with a ``ValueError`` (see :func:`check_definition`)."""
    check_definition(cls)
    return _CODECS.add(cls)


def check_definition(cls: Type[Codec]) -> None:
    """``ValueError`` where ``cls`` declares no collective, or is a CompLL codec without its
    ``compress`` or ``decompress`` body. (The collectives and the default memory it names are
    checked where it is first used: a module may register those after its codec.)"""
    label = getattr(cls, "name", "") or cls.__name__
    colls = cls.collectives
    if isinstance(colls, str) or (isinstance(colls, (tuple, list)) and (
            not colls or not all(isinstance(c, str) for c in colls))):  # (a property: the instance's own)
        raise ValueError(f"codec {label!r}: collectives must name one or more collectives (the first is "
                         f"its default), got {colls!r}")
    from .compll import CompLLCodec

    if issubclass(cls, CompLLCodec):
        missing = [m for m in ("compress", "decompress") if getattr(cls, m) is getattr(CompLLCodec, m)]
        if missing:
            raise ValueError(f"CompLL codec {label!r} defines no {' and no '.join(missing)}: "
                             "compress(self, x, ctx) returns the list of tensors sent, decompress(self, wire, ctx) "
                             "the flat fp32 result")


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
