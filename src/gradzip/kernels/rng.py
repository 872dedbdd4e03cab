"""Generators for codec randomness.

Randomness every rank must agree on (random-k indices, PowerSGD's initial Q) comes from a
generator seeded by (seed, step, tensor name), never from the global RNG, so ranks agree without
communicating and the user's own random stream is left untouched. Randomness that should differ
per rank (stochastic rounding) comes from a private generator seeded by (seed, rank).
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

_MASK = (1 << 63) - 1


def stable_hash(*parts: object) -> int:
    """A hash of ``parts`` that is the same in every process (unlike ``hash()`` on strings)."""
    return zlib.crc32(repr(parts).encode()) & 0xFFFFFFFF


def shared_generator(seed: int, step: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator that produces the same stream on every rank for (seed, step, name)."""
    g = torch.Generator(device=device)
    g.manual_seed((stable_hash(seed, step, name) * 0x9E3779B97F4A7C15) & _MASK)
    return g


def private_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream differs between ranks (seeded by seed and rank)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    g = torch.Generator(device=device)
    g.manual_seed((stable_hash("private", seed, rank) * 0x9E3779B97F4A7C15) & _MASK)
    return g
