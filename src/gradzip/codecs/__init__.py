"""Gradient codecs and their registry.

``gradzip.codecs.names()`` lists every codec; ``gradzip.codec(name, **options)`` builds one.
"""
from . import lowrank, quantize, sign, sparse  # noqa: F401  (registers the codecs)
from .base import Codec, Meta, Option, Payload
from .registry import codec, get, names, register_codec

__all__ = ["Codec", "Meta", "Option", "Payload", "codec", "get", "names", "register_codec"]
