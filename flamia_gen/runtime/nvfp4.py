"""NVFP4 Q and K for the sm90 forward (route nvfp4_mixed; DESIGN.md §3).

Hopper has no FP4 tensor cores, so QKᵀ runs as a BF16 wgmma on Q and K dequantized to
BF16 *without* their fp32 tensor scales: an E2M1 code (≤ 2 significant bits) times its E4M3
block scale (≤ 4 significant bits) has ≤ 6 significant bits and an exponent well inside
BF16's range, so the BF16 value is exact. The two tensor scales travel to the kernel as one
fp32 device scalar (`qk_tensor_scale` = ts_q·ts_k, no host sync) that joins the softmax scale
there; the kernel's scores are then Σ (c_q·s_q)(c_k·s_k) · ts_q·ts_k, the emulator's
Σ (c_q·s_q·ts_q)(c_k·s_k·ts_k) up to fp32 rounding.

Torch only (no CuTe DSL); runs on the tensors' device. Layouts are the quantizer's
(numerics.quantize, templates/common/quant_body.py.j2): codes (T, H, D/2) uint8, two E2M1
codes per byte (element 2j in the low nibble), scales (T, H, D/16) E4M3 bit patterns,
tensor_scale fp32 (1,).
"""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = ["NVFP4_BLOCK", "E2M1_VALUES", "dequantize_bf16", "mixed_qk_inputs"]

NVFP4_BLOCK = 16
# E2M1 code → value (sign bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (-0.0 kept)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_bf16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(T, H, D/2) packed E2M1 codes, (T, H, D/16) E4M3 block scales → (T, H, D) BF16
    code·block-scale (exact; the tensor scale left out). A NaN block scale (0x7F / 0xFF) gives a
    NaN block, as the emulator's dequantization does."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"codes and scales must be uint8 bit patterns, got {codes.dtype}, {scales.dtype}")
    if codes.dim() != 3 or scales.dim() != 3 or codes.shape[:2] != scales.shape[:2] \
            or 2 * codes.shape[2] != NVFP4_BLOCK * scales.shape[2]:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} are not (T, H, D/2) and "
                         f"(T, H, D/{NVFP4_BLOCK})")
    T, H, half = codes.shape
    # one gather of a 256-entry (byte → two BF16 values) table with int32 indices, then one BF16 multiply
    # by the block scale: the product is exact in BF16 (≤ 6 significant bits), so BF16 arithmetic rounds
    # nothing. (Was: nibble stack, int64 indices, fp32 values: ~4× the memory traffic, 8-byte indices.)
    pairs = torch.nn.functional.embedding(codes.reshape(-1).to(torch.int32), _pair_table(codes.device))
    sb = scales.view(torch.float8_e4m3fn).to(torch.bfloat16)  # exact (E4M3 ⊂ BF16); 0x7F/0xFF → NaN
    return (pairs.view(T, H, scales.shape[2], NVFP4_BLOCK) * sb.unsqueeze(-1)).view(T, H, 2 * half)


_PAIR_TABLES: dict = {}


def _pair_table(device) -> torch.Tensor:
    """(256, 2) BF16: byte b → (E2M1 value of its low nibble, of its high nibble)."""
    key = str(device)
    t = _PAIR_TABLES.get(key)
    if t is None:
        v = torch.tensor(E2M1_VALUES, dtype=torch.bfloat16)
        b = torch.arange(256)
        t = _PAIR_TABLES[key] = torch.stack([v[b & 0xF], v[b >> 4]], dim=-1).to(device)
    return t


def mixed_qk_inputs(q: Mapping[str, torch.Tensor], k: Mapping[str, torch.Tensor]) -> dict:
    """The forward's Q, K arguments from two NVFP4 quantizations (mappings with `codes`,
    `scales`, `tensor_scale`: a quantizer launch's outputs): q, k BF16 code·block-scale and
    qk_tensor_scale = ts_q·ts_k (fp32 (1,), on the device)."""
    ts = (q["tensor_scale"].to(torch.float32) * k["tensor_scale"].to(torch.float32)).reshape(1).contiguous()
    return dict(q=dequantize_bf16(q["codes"], q["scales"]), k=dequantize_bf16(k["codes"], k["scales"]),
                qk_tensor_scale=ts)
