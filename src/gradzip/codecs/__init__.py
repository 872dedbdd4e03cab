"""Gradient codecs and their registry.

``gradzip.codecs.names()`` lists every codec; ``gradzip.codec(name, **options)`` builds one.
"""
from . import (  # noqa: F401  (registers the codecs)
    compll_catalog,  # noqa: E402,F401  (codecs written with gradzip.codecs.compll; after the rest)
    floatx,
    lowrank,
    quantize,
    sign,
    sketch,
    sparse,
)
from .base import Codec, Meta, Option, Payload
from .registry import codec, get, names, register_codec

__all__ = ["Codec", "Meta", "Option", "Payload", "codec", "get", "names", "register_codec"]
