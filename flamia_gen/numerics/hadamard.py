"""Fast Walsh–Hadamard transform over the head dim, bit for bit as the quantizer contract's
Step 1 (docs/quantizer-contract.md).

``fwht(y)``: natural (Sylvester) order; stages ``h = 1, 2, 4, …, D/2``; in each stage every
pair ``(i, i+h)`` with ``i & h == 0`` becomes ``(y[i] + y[i+h], y[i] − y[i+h])`` in fp32
(IEEE RNE, one rounding per add); then one multiply of every element by
``float32(1/sqrt(D))`` (``HADAMARD_SCALE[D]``: the double ``1/sqrt(D)`` rounded once to fp32;
exactly 2^-3 for D=64, 0x3DB504F3 for D=128). No FMA contraction is possible (separate
add/sub then multiply), so CPU and GPU agree bit for bit.

The transform is orthonormal and symmetric (its own inverse up to rounding), so applying it
to both q and k along D leaves q·kᵀ unchanged.
"""

from __future__ import annotations

import math

import torch

__all__ = ["fwht", "hadamard_matrix", "hadamard_scale"]

_CHUNK = 1 << 18  # elements per slice


def hadamard_scale(d: int) -> torch.Tensor:
    """``float32(1/sqrt(d))`` as a 0-d fp32 tensor (CPU)."""
    _check_pow2(d)
    return torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)


def _check_pow2(d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard dimension D must be a power of two, got D={d}")


def fwht(y: torch.Tensor) -> torch.Tensor:
    """Orthonormal FWHT along the last dim of an fp32 tensor ``(..., D)``; returns a new fp32
    tensor (the input is not modified)."""
    if not isinstance(y, torch.Tensor) or y.dtype != torch.float32:
        raise ValueError(f"y must be an fp32 torch.Tensor, got "
                         f"{y.dtype if isinstance(y, torch.Tensor) else type(y).__name__}")
    if y.dim() < 1:
        raise ValueError("y must have at least one dimension (the head dim D)")
    d = y.shape[-1]
    _check_pow2(d)
    lead = y.shape[:-1]
    rows = y.reshape(-1, d)
    out = torch.empty_like(rows)
    scale = hadamard_scale(d).to(y.device)
    step = max(1, (_CHUNK if y.device.type == "cpu" else _CHUNK << 8) // d)  # rows per slice
    bufs = None
    for r0 in range(0, rows.shape[0], step):
        src = rows[r0:r0 + step]
        n = src.shape[0]
        if bufs is None or bufs[0].shape[0] != n:
            bufs = (torch.empty_like(src), torch.empty_like(src))
        h, k = 1, 0
        while h < d:  # stage h reads src, writes bufs[k]; ping-pong, no extra copies
            dst = bufs[k]
            v = src.view(n, d // (2 * h), 2, h)
            w = dst.view(n, d // (2 * h), 2, h)
            torch.add(v[:, :, 0, :], v[:, :, 1, :], out=w[:, :, 0, :])
            torch.sub(v[:, :, 0, :], v[:, :, 1, :], out=w[:, :, 1, :])
            src, k, h = dst, 1 - k, 2 * h
        torch.mul(src, scale, out=out[r0:r0 + step])
    return out.reshape(*lead, d)


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``H`` (``H[i, j] = (-1)^popcount(i & j) / sqrt(d)``),
    symmetric, such that ``fwht(y) ≈ y @ H`` (for tests and references)."""
    _check_pow2(d)
    i = torch.arange(d)
    pc = torch.zeros(d, d, dtype=torch.int64)
    x = i[:, None] & i[None, :]
    while bool(x.any()):
        pc += x & 1
        x = x >> 1
    return ((1 - 2 * (pc % 2)).to(torch.float64) / math.sqrt(d)).to(dtype)
