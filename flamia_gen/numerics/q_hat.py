"""Q̂, the BF16 operand of the sm90 backward's `bwd_dk_bf16` dK = dS'ᵀ·Q̂ (docs/kernels/attn_bwd.md "dK on BF16 dS'").

Q̂ = Q's E4M3 codes · 2^eq · 2^edo per (token, head): the factor the FP8 tile keeps in per-query word 3 under
`bwd_dof_fold` — 2^eq from Q's UE8M0 scale code as fp32 bits (code << 23: code 0 → 0, 255 → inf), 2^edo from dO's the
same way except the NaN code 255 → 1 (a NaN dO row keeps factor 1) — multiplied in fp32, then each code times it in
fp32, rounded to BF16. Exact (a code's 4 significant bits times a power of two, in BF16's 8 bits and FP32's exponent
range) unless the product leaves BF16's normal range. The backward call's `q_hat_build` launch writes it; this is the
bitwise reference `verify` holds it to.
"""

from __future__ import annotations

import torch


def _code_pow2(code: torch.Tensor) -> torch.Tensor:
    """A UE8M0 code's 2^(code − 127) as the kernel forms it: the code shifted into an fp32 exponent field."""
    return (code.to(torch.int32) << 23).view(torch.float32)


def q_hat(q_codes: torch.Tensor, q_scale: torch.Tensor, do_scale: torch.Tensor) -> torch.Tensor:
    """(T, H, D) BF16 Q̂ from Q's E4M3 codes (T, H, D) (uint8 or float8_e4m3fn), Q's scale codes and dO's (T, H) uint8."""
    if q_codes.dim() != 3 or q_scale.shape != q_codes.shape[:2] or do_scale.shape != q_codes.shape[:2]:
        raise ValueError(f"q_hat: codes (T, H, D) and scale codes (T, H) expected, got {tuple(q_codes.shape)}, "
                         f"{tuple(q_scale.shape)}, {tuple(do_scale.shape)}")
    codes = q_codes.view(torch.float8_e4m3fn) if q_codes.dtype == torch.uint8 else q_codes
    fdo = torch.where(do_scale == 255, torch.ones((), dtype=torch.float32, device=do_scale.device),
                      _code_pow2(do_scale))
    f = _code_pow2(q_scale) * fdo
    return (codes.to(torch.float32) * f.unsqueeze(-1)).to(torch.bfloat16)
