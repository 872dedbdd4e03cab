"""Vectorised building blocks shared by the codecs.

The building blocks are plain torch (no Python loops over elements, no host syncs) so they run on
CPU and GPU alike. The hot codec kernels (max-min, QSGD, sign packing, FP8 and MX casts) live in :mod:`.fused`,
which runs a fused C version on CPU (:mod:`.native`), a Triton version on CUDA (:mod:`.gpu`) or
the torch specification (:mod:`.reference`), all producing the same bytes; :func:`active` says
which one runs on CPU and on CUDA tensors, and why not a faster one.
"""
from .bitpack import pack_bits, packed_bytes, unpack_bits
from .buckets import bucket_view, pad_to_multiple
from .reference import store as store_into
from .rng import counter_uniform, draw_key, private_generator, shared_generator, stable_hash
from .fused import active  # noqa: E402  (after the building blocks it imports)

__all__ = [
    "pack_bits",
    "unpack_bits",
    "packed_bytes",
    "bucket_view",
    "pad_to_multiple",
    "shared_generator",
    "private_generator",
    "stable_hash",
    "counter_uniform",
    "draw_key",
    "store_into",
    "active",
]
