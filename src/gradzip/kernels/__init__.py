"""Vectorised building blocks shared by the codecs.

Everything here is plain torch (no Python loops over elements, no host syncs) so it runs on CPU
and GPU alike; faster fused versions can replace a function without touching the codecs.
"""
from .bitpack import pack_bits, packed_bytes, unpack_bits
from .buckets import bucket_view, pad_to_multiple
from .rng import private_generator, shared_generator, stable_hash

__all__ = [
    "pack_bits",
    "unpack_bits",
    "packed_bytes",
    "bucket_view",
    "pad_to_multiple",
    "shared_generator",
    "private_generator",
    "stable_hash",
]
