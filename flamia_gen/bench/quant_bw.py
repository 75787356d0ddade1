"""Quantizer bandwidth benchmark (issue #4): achieved bytes/s of our fused quantizer
against a device-to-device copy and against a torch.compile'd quantizer of the same
granularity, measured in the same process.

Bytes counted (DESIGN §5 "fewest bytes"): BF16 read once (2 B/elt), codes written once
(1 B/elt), the K-major copy written once (1 B/elt), scales. The copy moves 2 B read +
2 B written per element. A speed is never asserted in a test: this prints and saves.
"""

from __future__ import annotations

import math

import torch

from .timing import time_cuda


def quant_bytes(T: int, H: int, D: int, transposed: bool, scale_bytes: int) -> int:
    return T * H * D * 2 + T * H * D * (2 if transposed else 1) + scale_bytes


def _exponent_ceil(amax: torch.Tensor, fmax: float, emax: int) -> torch.Tensor:
    """Power-of-two exponent with no saturation (ceil rule), same as the contract."""
    m, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
    e0 = e - 1
    e_ = e0 - emax
    over = amax > fmax * torch.exp2(e_.float())
    e_ = torch.where(over, e_ + 1, e_)
    e_ = torch.where(amax == 0, torch.full_like(e_, -127), e_)
    return e_.clamp(-127, 127)


def torch_quantizer(granularity: str, block: int = 32):
    """A plain torch implementation (codes + K-major copy + UE8M0 scales), for
    torch.compile. Token-block grouping here ignores documents (one long document):
    it is a speed peer, not a numerics reference."""

    def quant(x: torch.Tensor):
        T, H, D = x.shape
        xf = x.float()
        if granularity == "token":
            amax = xf.abs().amax(dim=-1, keepdim=True)
        elif granularity == "token_block":
            Tp = math.ceil(T / block) * block
            xp = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, Tp - T))
            amax = xp.abs().view(Tp // block, block, H, D).amax(dim=(1, 3), keepdim=True)
            amax = amax.expand(Tp // block, block, H, 1).reshape(Tp, H, 1)[:T]
        elif granularity == "tensor":
            amax = xf.abs().amax().reshape(1, 1, 1)
        else:
            raise ValueError(f"granularity {granularity!r} has no torch peer here")
        e = _exponent_ceil(amax, 448.0, 8)
        codes = (xf * torch.exp2(-e.float())).to(torch.float8_e4m3fn)
        codes_t = codes.permute(1, 2, 0).contiguous()
        scales = (e + 127).to(torch.uint8)
        return codes, codes_t, scales

    return quant


def copy_bandwidth(numel: int, iters: int = 30) -> dict:
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    stats = time_cuda(lambda: y.copy_(x), warmup=5, repeats=iters, measure_memory=False)
    return dict(impl="d2d copy", median_ms=stats.median_ms, gbps=4 * numel / (stats.median_ms * 1e-3) / 1e9)


def bench_one(name: str, fn, nbytes: int, iters: int = 30) -> dict:
    stats = time_cuda(fn, warmup=5, repeats=iters, measure_memory=False)
    return dict(impl=name, median_ms=stats.median_ms, p20_ms=stats.p20_ms, p80_ms=stats.p80_ms,
                gbps=nbytes / (stats.median_ms * 1e-3) / 1e9)
