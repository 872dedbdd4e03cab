"""Dense bit packing of small unsigned integers (1 to 8 bits each) into bytes.

Eight values of ``bits`` bits always fill exactly ``bits`` bytes, so the input is padded to a
multiple of eight values and each group of eight is packed into one integer word whose bytes are
then split out. Widths that divide eight (1, 2, 4) take a cheaper path that works on bytes only.
"""
from __future__ import annotations

import torch


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` values of ``bits`` bits occupy once packed.

    Widths below 8 pad to a multiple of eight values; 8-bit values are sent as they are.
    """
    if bits == 8:
        return numel
    return ((numel + 7) // 8) * bits


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def pack_bits(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of values < 2**bits into ``packed_bytes(n, bits)`` bytes."""
    _check_bits(bits)
    n = levels.numel()
    levels = levels.reshape(-1).to(torch.uint8)
    if bits == 8:
        return levels.contiguous()
    pad = (-n) % 8
    if pad:
        levels = torch.cat([levels, levels.new_zeros(pad)])
    if 8 % bits == 0:
        per_byte = 8 // bits
        groups = levels.view(-1, per_byte)
        out = groups[:, 0].clone()
        for j in range(1, per_byte):
            out |= groups[:, j] << (bits * j)
        return out
    groups = levels.view(-1, 8).to(torch.int64)
    word = groups[:, 0].clone()
    for j in range(1, 8):
        word |= groups[:, j] << (bits * j)
    shifts = torch.arange(0, 8 * bits, 8, device=levels.device, dtype=torch.int64)
    return ((word.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` values as a uint8 tensor."""
    _check_bits(bits)
    packed = packed.reshape(-1)
    if bits == 8:
        return packed[:numel]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        levels = (packed.unsqueeze(1) >> shifts) & mask
        return levels.reshape(-1)[:numel]
    words = packed.view(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(0, 8 * bits, 8, device=packed.device, dtype=torch.int64)
    word = (words << byte_shifts).sum(dim=1)
    value_shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=torch.int64)
    levels = (word.unsqueeze(1) >> value_shifts) & mask
    return levels.to(torch.uint8).reshape(-1)[:numel]
