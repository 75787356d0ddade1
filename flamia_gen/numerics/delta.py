"""D = rowsum(dÔ ∘ O) of the dO quantizer launch, bit for bit as the kernel computes it.

FLAMIA §3.3: the backward's ``D_i = Σ_d dO[i,d] · O[i,d]`` must use the same dO
representation as the rest of the backward, i.e. the dequantized codes, not BF16 dO. The
dO quantizer launch (``with_delta=True`` variants) computes it while the codes are still in
registers. The summation order is fixed (docs/quantizer-contract.md, "dO launch: D and
the dQ accumulator") so that this emulator and the kernel agree bit for bit:

1. ``dq = decode(c) · 2^e`` (fp32, one RNE multiply: ``Quantized.dequantize()``);
2. ``p_d = dq_d · float32(o_d)`` (fp32, one RNE multiply; no FMA anywhere);
3. the head dim is cut into ``L = D/16`` lane slices of 16 consecutive elements; slice ``k``
   sums its 16 products left to right: ``a_k = (…((p_{16k} + p_{16k+1}) + p_{16k+2}) + …) +
   p_{16k+15}`` (15 RNE adds, the first product is the start value: no ``0 +``);
4. the ``L`` partial sums are reduced by a butterfly tree of RNE adds, neighbours first:
   ``[a_0+a_1, a_2+a_3, …]``, then the same on the result, until one value is left
   (D=128: ``((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7))``).

Only elementwise IEEE fp32 ops: the result is the same on CPU and CUDA. NaN in a dO block
(its codes are the format's NaN) or in ``o`` gives a NaN ``D``; NaN payloads are not part of
the contract.
"""

from __future__ import annotations

import torch

from ..spec.enums import Format
from .quantize import Quantized

__all__ = ["delta_from_quantized", "delta_bf16", "DELTA_LANE_ELEMS"]

DELTA_LANE_ELEMS = 16  # consecutive head-dim elements summed in order by one kernel lane


def delta_from_quantized(do_q: Quantized, o: torch.Tensor) -> torch.Tensor:
    """fp32 ``D`` of shape ``(H, T)`` (the forward's LSE layout): ``D[h, t] = Σ_d
    dequant(dO)[t, h, d] · float32(o[t, h, d])`` in the kernel's fixed order (module doc).

    ``do_q``: the dO ``Quantized`` (8-bit codes ``(T, H, D)``, no Hadamard), ``o``: the
    forward output ``(T, H, D)`` (BF16 per contract; any floating dtype is widened to fp32),
    on the same device. ``D`` must be 16 times a power of two (64 and 128 in the kernels).
    """
    if not isinstance(do_q, Quantized):
        raise ValueError(f"do_q must be a Quantized, got {type(do_q).__name__}")
    spec = do_q.spec
    if spec.format not in (Format.e4m3, Format.e5m2):
        raise ValueError(f"delta needs 8-bit dO codes (e4m3 or e5m2), got format={spec.format.value!r}")
    if spec.hadamard:
        raise ValueError("delta needs dO in the original basis; a Hadamard-rotated dO is not supported "
                         "(its dequantized values are in the rotated domain)")
    codes = do_q.codes
    if codes.dim() != 3:
        raise ValueError(f"dO codes must have shape (T, H, D), got shape {tuple(codes.shape)}")
    if not isinstance(o, torch.Tensor) or not o.is_floating_point():
        raise ValueError(f"o must be a floating-point torch.Tensor, got "
                         f"{o.dtype if isinstance(o, torch.Tensor) else type(o).__name__}")
    if tuple(o.shape) != tuple(codes.shape):
        raise ValueError(f"o has shape {tuple(o.shape)}, dO has shape {tuple(codes.shape)}; they must match")
    if o.device != codes.device:
        raise ValueError(f"o is on {o.device} but dO is on {codes.device}; they must be on the same device")
    t, h, d = codes.shape
    lanes = d // DELTA_LANE_ELEMS
    if d % DELTA_LANE_ELEMS or lanes & (lanes - 1):
        raise ValueError(f"head dim D={d} must be 16 times a power of two (kernels: 64, 128)")

    dq = do_q.dequantize()  # step 1: decode(c) * 2^e, one fp32 multiply
    return _ordered_rowsum(dq * o.to(torch.float32))  # step 2, then steps 3 and 4


def _ordered_rowsum(p: torch.Tensor) -> torch.Tensor:
    """Steps 3 and 4 of the module doc on fp32 products p (T, H, D) → (H, T)."""
    t, h, d = p.shape
    p = p.view(t, h, d // DELTA_LANE_ELEMS, DELTA_LANE_ELEMS)
    a = p[..., 0]
    for i in range(1, DELTA_LANE_ELEMS):  # step 3: in order, inside a lane
        a = a + p[..., i]
    while a.shape[-1] > 1:  # step 4: butterfly over the lanes of a row, neighbours first
        a = a[..., 0::2] + a[..., 1::2]
    return a[..., 0].transpose(0, 1).contiguous()


def delta_bf16(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """fp32 ``D`` (H, T) of the bf16 route's dO launch: the products ``float32(dO_d) · float32(o_d)``
    (exact widenings, one RNE multiply) summed in the fixed order of the module doc (steps 3, 4).
    ``do``, ``o``: BF16 (T, H, D) on one device; D = 16 times a power of two."""
    for name, x in (("do", do), ("o", o)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 3:
            raise ValueError(f"{name} must be a BF16 (T, H, D) torch.Tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}"
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
    if tuple(o.shape) != tuple(do.shape) or o.device != do.device:
        raise ValueError(f"o {tuple(o.shape)} on {o.device} must match dO {tuple(do.shape)} on {do.device}")
    lanes = do.shape[2] // DELTA_LANE_ELEMS
    if do.shape[2] % DELTA_LANE_ELEMS or lanes < 1 or lanes & (lanes - 1):
        raise ValueError(f"head dim D={do.shape[2]} must be 16 times a power of two (kernels: 64, 128)")
    return _ordered_rowsum(do.to(torch.float32) * o.to(torch.float32))
