"""The block-scale layout Blackwell's block-scaled GEMMs read (cuBLAS "1D block scaling
factors layout", docs.nvidia.com/cuda/cublas, section on block scaling factors).

A (rows, K // block) scale matrix is padded to (ceil(rows / 128) * 128, ceil(cols / 4) * 4)
and stored as 128x4 tiles, row-major over tiles; inside a tile, scale (r, c) sits at byte
``(r % 32) * 16 + (r // 32) * 4 + c``. torch's ``SwizzleType.SWIZZLE_32_4_4`` names this
layout; ``torch.nn.functional.scaled_mm`` checks that a swizzled scale has
``round_up(rows, 128) * round_up(K // block, 4)`` elements.
"""

from __future__ import annotations

import torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) scales -> flat swizzled tensor of ``round_up(rows,128) * round_up(cols,4)``."""
    rows, cols = scales.shape
    rt, ct = _ceil_div(rows, 128), _ceil_div(cols, 4)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = raw.new_zeros(rt * 128, ct * 4)  # zero padding (E8M0 2**-127 / E4M3 0): unread
    padded[:rows, :cols] = raw
    # (rt, 128, ct, 4) -> tiles (rt, ct, 128, 4); row r of a tile = (r // 32, r % 32)
    tiles = padded.view(rt, 128, ct, 4).permute(0, 2, 1, 3)
    out = tiles.reshape(rt, ct, 4, 32, 4).transpose(2, 3).reshape(-1)  # (r%32, r//32, c)
    return out.view(scales.dtype) if scales.element_size() == 1 else out


def from_blocked(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: the (rows, cols) scales back from the swizzled layout."""
    rt, ct = _ceil_div(rows, 128), _ceil_div(cols, 4)
    raw = flat.view(torch.uint8) if flat.element_size() == 1 else flat
    tiles = raw.reshape(rt, ct, 32, 4, 4).transpose(2, 3)  # (rt, ct, r//32, r%32, c)
    padded = tiles.reshape(rt, ct, 128, 4).permute(0, 2, 1, 3).reshape(rt * 128, ct * 4)
    out = padded[:rows, :cols].contiguous()
    return out.view(flat.dtype) if flat.element_size() == 1 else out


def blocked_offset(r: int, c: int, cols: int) -> int:
    """Flat index of scale (r, c) in the swizzled layout (the cuBLAS formula, for tests)."""
    tiles_per_row = _ceil_div(cols, 4)
    tile = (r // 128) * tiles_per_row + c // 4
    rr, cc = r % 128, c % 4
    return 512 * tile + (rr % 32) * 16 + (rr // 32) * 4 + cc


__all__ = ["blocked_offset", "from_blocked", "to_blocked"]
