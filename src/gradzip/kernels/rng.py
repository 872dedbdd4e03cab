"""Generators for codec randomness.

Randomness every rank must agree on (random-k indices, PowerSGD's initial Q) comes from a
generator seeded by (seed, step, tensor name), never from the global RNG, so ranks agree without
communicating and the user's own random stream is left untouched. Randomness that should differ
per rank (stochastic rounding, DGC's sample) is keyed by (seed, rank, tensor name, step, use):
a pure function of what is encoded, not of the order of earlier draws, so a run resumed from a
checkpoint draws exactly what the uninterrupted run drew, even when DDP orders its buckets
differently in the first iteration after the restart.
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


_GOLDEN, _MIX1, _MIX2, _WORD = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 0xFFFFFFFF


def counter_uniform(numel: int, key: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Tensor:
    """``numel`` uniform floats in [0, 1): value ``i`` is a pure function of ``(i, key)``, for
    ``i`` from ``start`` on (the draws of a piece of a longer tensor).

    A counter-based generator (the MurmurHash3 32-bit finaliser of ``i · 0x9E3779B1 + key``,
    top 24 bits scaled by 2^-24) has no state to carry between elements, so a fused CPU loop, a
    GPU kernel and this torch version draw the very same numbers and can be checked against
    each other bit for bit. All arithmetic is modulo 2^32 (done here in int64 with masks).
    """
    x = torch.arange(start, start + numel, device=device, dtype=torch.int64)
    x = (x * _GOLDEN + (key & _WORD)) & _WORD
    x ^= x >> 16
    x = (x * _MIX1) & _WORD
    x ^= x >> 13
    x = (x * _MIX2) & _WORD
    x ^= x >> 16
    return (x >> 8).to(torch.float32).mul_(1.0 / (1 << 24))


def draw_key(gen: torch.Generator) -> int:
    """A fresh 32-bit key for :func:`counter_uniform` from a (CPU) generator."""
    return int(torch.randint(0, 1 << 32, (), generator=gen, dtype=torch.int64))


def private_key(seed: int, name: str, step: int, use: int = 0) -> int:
    """A 32-bit key for this rank's draws on tensor ``name`` at ``step`` (its ``use``-th draw then)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return stable_hash("private", seed, rank, name, step, use)


def shared_key(seed: int, step: int, name: str) -> int:
    """A 32-bit key for draws every rank makes alike on tensor ``name`` at ``step``."""
    return stable_hash("shared", seed, step, name)


def keyed_generator(key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream is a pure function of ``key``."""
    g = torch.Generator(device=device)
    g.manual_seed((key * 0x9E3779B97F4A7C15) & _MASK)
    return g
