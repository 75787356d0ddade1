"""exp2 as the kernels evaluate it (route field `exp_approx`, docs/numerics.md §2.3.2).

`ex2`: MUFU `ex2.approx.ftz.f32` (max rel. error ~2^-22): emulated by torch.exp2.
`poly3`: FA4's trick to move part of the softmax exponentials from the MUFU pipe to the FMA
pipe: 2^floor(x) · p(x − floor(x)) with the degree-3 polynomial p(f) = 1 + 0.6951461 f +
0.2275644 f² + 0.0771191 f³ (Horner, fp32 FMAs), relative error ≤ 8.8e-5 on [0, 1); the kernel
evaluates it on the columns whose group of 8 (S accumulator layout) has index mod 4 below
POLY_QUARTERS, the rest on MUFU.
"""

from __future__ import annotations

import torch

# coefficients as the kernel's PTX has them (fp32 bit patterns)
_C3, _C2, _C1 = (torch.tensor(b, dtype=torch.int32).view(torch.float32).item()
                 for b in (0x3D9DF09D, 0x3E6906A4, 0x3F31F519))
POLY_QUARTERS = {"ex2": 0, "poly3": 2}  # quarters of each 32 columns evaluated by the polynomial


def poly_quarters(exp_approx: str) -> int:
    if exp_approx not in POLY_QUARTERS:
        raise ValueError(f"exp_approx={exp_approx!r} is not implemented (kernels and emulator know "
                         f"{sorted(POLY_QUARTERS)})")
    return POLY_QUARTERS[exp_approx]


def _fma32(a, b, c):
    """fp32 fused multiply-add (exact product in fp64, one rounding; double rounding is possible
    only for results within 2^-53 of an fp32 tie)."""
    return (a.double() * b.double() + c.double()).float()


def exp2_poly3(x: torch.Tensor) -> torch.Tensor:
    """The kernel's `ex2_poly3` on fp32 `x` (x ≤ 127): clamp at −127, split, Horner, scale."""
    xc = torch.clamp(x.float(), min=-127.0)
    xb = torch.floor(xc)
    f = xc - xb
    p = _fma32(f, torch.full_like(f, _C3), torch.full_like(f, _C2))
    p = _fma32(p, f, torch.full_like(f, _C1))
    p = _fma32(p, f, torch.ones_like(f))
    return torch.where(xb >= -126, torch.ldexp(p, xb), torch.zeros_like(p))


def poly_columns(n_keys: int, delta: int, tile_n: int, quarters: int, device=None) -> torch.Tensor:
    """(n_keys,) bool: document-local keys whose exp2 the kernel takes from the polynomial (their
    column in the key tile, c = (key + delta) mod tile_n, has (c // 8) mod 4 < quarters)."""
    c = (torch.arange(n_keys, device=device) + delta) % tile_n
    return (c // 8) % 4 < quarters
