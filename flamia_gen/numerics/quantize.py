"""The quantizer emulator: the bit-exact source of truth of docs/quantizer-contract.md.

``quantize(x, spec, cu_seqlens)`` follows the contract step by step (fp32 Hadamard, block
amax, power-of-two exponent with the ``floor``/``ceil`` rule, one fp32 multiply by
``2^-e`` and an RNE ``satfinite`` encode; NVFP4's E4M3 block scale and fp32 tensor scale),
with pure torch ops, so it runs on CPU and CUDA tensors and GPU quantizer kernels are
compared against it bit for bit.

Scale layouts (``Quantized.scales``, uint8):

=====================  ===================================  ===================================
granularity            block                                scales
=====================  ===================================  ===================================
``tensor``             every element (documents ignored)    ``(1,)``
``static``             none: ``e = spec.static_exponent``   ``(1,)``
``token``              one ``(t, h)`` row of D              ``(T, H)``
``token_block``        32 tokens × D of one head,           ``(T, H)``, expanded: each token
                       document-local                       carries its block's exponent
``block1d_32``         ``axis=-1``: 32 consecutive d of     ``(T, H, D/32)``
                       one ``(t, h)``
``block1d_32``         ``axis=0``: 32 consecutive tokens    ``(T, H, D)``, expanded per token
                       of one ``(h, d)`` column,            (every element carries its column
                       document-local (OCP V / dO for PV,   block's exponent)
                       dV)
``square_32``          32×32 tiles of an ``(M, N)`` matrix  ``(H, ceil(M/32), ceil(N/32))`` or
                       (input ``(H, M, N)`` or ``(M, N)``)  ``(ceil(M/32), ceil(N/32))``, one
                                                            per tile (compact)
``nvfp4``              16 consecutive d of one ``(t, h)``   ``(T, H, D/16)`` E4M3 bit patterns
                       + tensor-wide amax                   + ``tensor_scale`` fp32 ``(1,)``
=====================  ===================================  ===================================

Decisions the contract leaves open (all documented here):

* Power-of-two scale codes are UE8M0 (``e + 127``); ``0xFF`` marks a block whose amax is NaN
  or ±Inf (all its codes are ``0x7F``, the format's NaN); ``Quantized.exponents`` reports 128
  there. An all-zero block has code 0 (``e = -127``) and all codes 0x00 (``-0.0`` included).
* Blocks of document-local granularities (``token_block``, ``block1d_32`` with ``axis=0``)
  start at every document's first token (``cu_seqlens``); the last block of a document may
  be short. ``token``, ``block1d_32`` (``axis=-1``) and ``nvfp4`` blocks never span tokens,
  so ``cu_seqlens`` is only validated for them; ``tensor`` ignores documents (the leaky
  baseline); ``square_32`` takes one matrix per call (``cu_seqlens`` is refused: the caller
  quantizes each document's dS separately, tiles start at its first row and column).
* ``static``: no amax and no NaN/Inf block rule: each element is ``encode(y · 2^-e)`` with
  ``satfinite`` (what the in-kernel cvt does): NaN stays NaN, ±Inf become ±fmax.
* ``nvfp4``: Step 4′ literally, edge cases included. A NaN element makes its block amax and
  E4M3 block scale NaN (0x7F), so the whole block dequantizes to NaN (its E2M1 codes are 0x7,
  formats.py). Two edge cases follow from the contract's text as written and are *not*
  "propagate, never hide": a ±Inf element saturates its block scale to 448 (satfinite) and
  dequantizes to ±2688·tensor_scale (finite); and a tensor whose amax is below
  ``2688 / FLT_MAX`` (≈ 7.9e-36, e.g. all-subnormal) overflows ``enc`` to +Inf, giving
  ``tensor_scale = 0`` and NaN codes in its all-zero blocks. Reported upstream; kept
  bit-identical to the contract until the contract changes.
* ``codes_t`` (``(H, D, T_pad)``, ``T_pad = ceil(T/16)·16``, zero padding) is produced by
  default (``transposed=None``) for 8-bit formats when ``x`` is 3-D ``(T, H, D)`` and the
  granularity is not ``square_32``; ``transposed=True`` demands it, ``False`` skips it.
  It is always the same codes transposed: for ``block1d_32`` its scale blocks therefore stay
  along D; an operand scaled along tokens (OCP V/dO) is a separate call with ``axis=0``.
* Inputs are converted to fp32 first (any floating dtype is accepted; BF16 per contract).
  ``D`` only has to be a multiple of the block (32, or 16 for nvfp4) and a power of two when
  ``hadamard`` is set; the kernels' ``D ∈ {64, 128}`` is not enforced here.
* ``dequantize()`` returns fp32 ``decode(c) · 2^e`` (NVFP4: ``e2m1(c) · e4m3(sb) ·
  tensor_scale``), in the rotated domain when the spec has ``hadamard``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..spec.enums import ExponentRule, Format, Granularity
from ..spec.route import OperandQuant
from . import formats as F
from .hadamard import fwht

__all__ = ["Quantized", "quantize", "fake_quantize", "validate_cu_seqlens", "token_block_ids",
           "pow2_exponent"]

_TOKEN_GRANULARITIES = (Granularity.token, Granularity.token_block, Granularity.block1d_32,
                        Granularity.nvfp4)
_NVFP4_BLOCK = 16
_NVFP4_ENC_NUM = 2688.0  # 448 * 6


@dataclass
class Quantized:
    """Output of ``quantize``; see the module docstring for the layouts."""

    codes: torch.Tensor  # uint8 (T,H,D) bit patterns, or (T,H,D/2) packed E2M1
    scales: torch.Tensor  # uint8 UE8M0 exponents, or E4M3 bits for nvfp4
    spec: OperandQuant
    codes_t: torch.Tensor | None = None  # uint8 (H, D, T_pad), 8-bit formats only
    tensor_scale: torch.Tensor | None = None  # fp32 (1,), nvfp4 only
    cu_seqlens: torch.Tensor | None = None
    axis: int = -1  # block1d_32 only: -1 (along D) or 0 (along tokens)

    @property
    def exponents(self) -> torch.Tensor:
        """int32 ``e`` (scale = 2^e) in the layout of ``scales``; 128 marks a NaN/Inf block."""
        if self.spec.granularity is Granularity.nvfp4:
            raise ValueError("nvfp4 scales are E4M3 values, not power-of-two exponents")
        return self.scales.to(torch.int32) - 127

    def dequantize(self) -> torch.Tensor:
        """fp32 values ``decode(c) · scale`` (rotated domain when ``spec.hadamard``)."""
        g = self.spec.granularity
        if g is Granularity.nvfp4:
            vals = F.decode_e2m1(F.unpack_e2m1(self.codes))
            sb = F.decode_e4m3(self.scales)
            v = vals.view(*sb.shape, _NVFP4_BLOCK) * sb.unsqueeze(-1)
            return (v * self.tensor_scale).view(vals.shape)
        vals = F.decode(self.codes, self.spec.format)
        s = F.decode_ue8m0(self.scales)
        if g in (Granularity.tensor, Granularity.static):
            return vals * s
        if g in (Granularity.token, Granularity.token_block):
            return vals * s.unsqueeze(-1)
        if g is Granularity.block1d_32:
            if self.axis == 0:
                return vals * s
            blk = self.spec.block
            return (vals.view(*s.shape, blk) * s.unsqueeze(-1)).view(vals.shape)
        if g is Granularity.square_32:
            blk = self.spec.block
            m, n = vals.shape[-2:]
            full = s.repeat_interleave(blk, dim=-2).repeat_interleave(blk, dim=-1)[..., :m, :n]
            return vals * full
        raise ValueError(f"cannot dequantize granularity={g.value!r}")


# ---------------------------------------------------------------- validation helpers
def validate_cu_seqlens(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """Check the contract's rules for ``cu_seqlens`` (int32, 1-D, starts at 0, non-decreasing,
    ends at ``total``, on ``device``); raises ValueError naming the first violation."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but x is on {device}; "
                         "they must be on the same device")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(cu[0])}")
    diffs = cu[1:] - cu[:-1]
    bad = (diffs < 0).nonzero()
    if bad.numel():
        i = int(bad[0, 0]) + 1
        raise ValueError(f"cu_seqlens not monotonic at index {i} "
                         f"(cu_seqlens[{i}]={int(cu[i])} < cu_seqlens[{i - 1}]={int(cu[i - 1])})")
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens[-1] must equal T = x.shape[0] = {total}, got {int(cu[-1])}")
    return cu_seqlens


def token_block_ids(cu_seqlens: torch.Tensor | None, total: int, block: int,
                    device: torch.device) -> tuple[torch.Tensor, int]:
    """Per-token id (int64, ``(T,)``) of its document-local block of ``block`` tokens, and the
    number of blocks. Blocks start at every document's first token; vectorized."""
    if cu_seqlens is None:
        return torch.arange(total, device=device) // block, -(-total // block)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    nblk = (lengths + block - 1) // block
    first_blk = torch.cumsum(nblk, 0) - nblk
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
    local = torch.arange(total, device=device) - cu[:-1][doc]
    return first_blk[doc] + local // block, int(nblk.sum())


# ---------------------------------------------------------------- Step 3
def pow2_exponent(amax: torch.Tensor, fmt: Format, rule: ExponentRule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contract Step 3 on an fp32 tensor of block maxima (≥ 0, NaN or Inf allowed).

    Returns ``(e, zero, bad)``: int32 ``e`` clamped to [-127, 127] (-127 for zero blocks, 0 for
    bad ones), and the masks ``amax == 0`` and ``amax`` not finite. ``e0 = floor(log2 amax)``
    comes from the fp32 bits (subnormal amax included); the ``ceil`` compare
    ``amax ≤ fmax · 2^(e0-emax)`` is done exactly as ``frac(amax) ≤ fmax/2^emax - 1`` on the
    23 fraction bits (identical to the fp32 compare wherever the result is not clamped).
    """
    fi = F.format_info(fmt)
    a = amax.to(torch.float32)
    bits = a.view(torch.int32) & 0x7FFFFFFF
    E = bits >> 23
    mant = bits & 0x7FFFFF
    bad = E == 255
    zero = bits == 0
    sub = (E == 0) & ~zero
    # subnormal amax: floor(log2 mant) from the exact int → fp32 conversion of mant (< 2^23)
    p = (mant.to(torch.float32).view(torch.int32) >> 23) - 127
    p = torch.where(sub, p, torch.zeros_like(p))
    e0 = torch.where(sub, p - 149, E - 127)
    frac = torch.where(sub, (mant << (23 - p)) & 0x7FFFFF, mant)
    e = e0 - fi.emax
    if ExponentRule(rule) is ExponentRule.ceil:
        frac_max = int(round((fi.max / 2.0 ** fi.emax - 1.0) * (1 << 23)))  # 0x600000: 1.75
        e = e + (frac > frac_max).to(torch.int32)
    e = e.clamp(-127, 127)
    e = torch.where(zero, torch.full_like(e, -127), e)
    e = torch.where(bad, torch.zeros_like(e), e)
    return e, zero, bad


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^e from bits, e int32 in [-126, 127]."""
    return ((e + 127) << 23).view(torch.float32)


def _pow2_codes(y: torch.Tensor, amax: torch.Tensor, fmt: Format, rule: ExponentRule,
                ids: torch.Tensor | None = None):
    """Steps 3-4. ``amax``: block maxima that broadcast against ``y`` (after ``amax[ids]``
    when ``ids`` is given: the exponent math runs on the compact blocks, then expands).

    Returns (codes uint8 shaped like y, scale codes uint8 shaped like ``amax[ids]``)."""
    e, zero, bad = pow2_exponent(amax, fmt, rule)
    mult = _pow2(-e)  # -e in [-120, 127]: a normal fp32 power of two, exact
    scales = torch.where(bad, torch.full_like(e, F.UE8M0_NAN), e + 127).to(torch.uint8)
    any_zero, any_bad = bool(zero.any()), bool(bad.any())
    if ids is not None:
        mult, scales = mult[ids], scales[ids]
        zero = zero[ids] if any_zero else zero
        bad = bad[ids] if any_bad else bad
    codes = F.encode(y * mult, fmt, saturate=True)
    if any_zero:
        codes = torch.where(zero, torch.zeros((), dtype=torch.uint8, device=y.device), codes)
    if any_bad:
        codes = torch.where(bad, torch.full((), F.format_info(fmt).nan_code, dtype=torch.uint8,
                                            device=y.device), codes)
    return codes, scales


def _abs_inf(t: torch.Tensor) -> torch.Tensor:
    """|t| with NaN mapped to +Inf (both mark a bad block) for reductions whose NaN
    propagation is not guaranteed (index_reduce)."""
    return t.abs().nan_to_num_(nan=float("inf"), posinf=float("inf"))


def _absmax_lastdim(y: torch.Tensor) -> torch.Tensor:
    """max |y| over the last dim in one pass, without an |y| temporary; NaN propagates."""
    mn, mx = torch.aminmax(y, dim=-1)
    return torch.maximum(mx.abs(), mn.abs())


def _segment_amax(src: torch.Tensor, ids: torch.Tensor, nblocks: int) -> torch.Tensor:
    """amax of ``src`` (≥ 0, no NaN) over dim 0 grouped by ``ids``."""
    out = torch.zeros((nblocks, *src.shape[1:]), dtype=src.dtype, device=src.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # index_reduce is "beta"
        return out.index_reduce_(0, ids, src, "amax", include_self=True)


def _transpose_codes(codes: torch.Tensor) -> torch.Tensor:
    t, h, d = codes.shape
    t_pad = -(-t // 16) * 16
    out = torch.zeros((h, d, t_pad), dtype=torch.uint8, device=codes.device)
    out[:, :, :t] = codes.permute(1, 2, 0)
    return out


# ---------------------------------------------------------------- public API
def quantize(x: torch.Tensor, spec: OperandQuant, cu_seqlens: torch.Tensor | None = None, *,
             transposed: bool | None = None, axis: int = -1) -> Quantized:
    """Quantize ``x`` as ``spec`` says, bit for bit as docs/quantizer-contract.md.

    ``x``: floating tensor ``(T, H, D)`` for ``token``, ``token_block``, ``block1d_32`` and
    ``nvfp4``; ``(H, M, N)`` or ``(M, N)`` for ``square_32``; any shape for ``tensor`` and
    ``static``. ``cu_seqlens``: int32 ``(num_docs+1,)`` on x's device (3-D x only).
    ``axis``: ``block1d_32`` only, ``-1`` (32 along D) or ``0`` (32 tokens of a column).
    ``transposed``: whether to build ``codes_t`` (None: for 8-bit formats with 3-D x).
    """
    if not isinstance(spec, OperandQuant):
        raise ValueError(f"spec must be an OperandQuant, got {type(spec).__name__}")
    if not spec.quantized:
        raise ValueError("spec has format 'bf16' (granularity 'none'): nothing to quantize; "
                         "use fake_quantize for the BF16 rounding")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point torch.Tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    g, fmt = spec.granularity, spec.format
    if g in _TOKEN_GRANULARITIES and x.dim() != 3:
        raise ValueError(f"x must have shape (T, H, D) for granularity={g.value!r}, "
                         f"got shape {tuple(x.shape)}")
    if g is Granularity.square_32 and x.dim() not in (2, 3):
        raise ValueError(f"x must have shape (H, M, N) or (M, N) for granularity='square_32', "
                         f"got shape {tuple(x.shape)}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if g is Granularity.block1d_32:
        if axis not in (-1, 0, 2):
            raise ValueError(f"axis={axis} is not allowed for granularity='block1d_32'; "
                             "allowed values: -1 (along D), 0 (along tokens)")
        axis = -1 if axis == 2 else axis
    elif axis != -1:
        raise ValueError(f"axis={axis} is only allowed for granularity='block1d_32'; "
                         f"granularity={g.value!r} takes axis=-1")
    if cu_seqlens is not None:
        if g is Granularity.square_32:
            raise ValueError("cu_seqlens is not accepted for granularity='square_32': quantize "
                             "each document's matrix separately")
        if x.dim() != 3:
            raise ValueError(f"cu_seqlens needs x of shape (T, H, D), got shape {tuple(x.shape)}")
        validate_cu_seqlens(cu_seqlens, x.shape[0], x.device)
    if transposed and (fmt is Format.e2m1 or x.dim() != 3 or g is Granularity.square_32):
        raise ValueError("transposed=True needs an 8-bit format and x of shape (T, H, D)")

    y = x.to(torch.float32)
    if spec.hadamard:
        y = fwht(y.contiguous())
    y = y.contiguous()
    blk = spec.block
    tensor_scale = None

    if g is Granularity.nvfp4:
        codes, scales, tensor_scale = _quantize_nvfp4(y)
    elif g is Granularity.static:
        e = spec.static_exponent
        mult = torch.tensor(2.0 ** -e, dtype=torch.float32, device=y.device)
        codes = F.encode(y * mult, fmt, saturate=True)
        scales = torch.tensor([e + 127], dtype=torch.uint8, device=y.device)
    elif g is Granularity.tensor:
        amax = y.abs().amax().reshape(1)
        codes, scales = _pow2_codes(y, amax, fmt, spec.exponent_rule)
    elif g is Granularity.token:
        amax = _absmax_lastdim(y).unsqueeze(-1)
        codes, scales = _pow2_codes(y, amax, fmt, spec.exponent_rule)
        scales = scales.squeeze(-1)
    elif g is Granularity.token_block:
        t = y.shape[0]
        ids, nb = token_block_ids(cu_seqlens, t, blk, y.device)
        row_amax = _abs_inf(_absmax_lastdim(y))  # (T, H), NaN → Inf
        amax = _segment_amax(row_amax, ids, nb).unsqueeze(-1)  # (NB, H, 1)
        codes, scales = _pow2_codes(y, amax, fmt, spec.exponent_rule, ids)  # expanded to (T, H, 1)
        scales = scales.squeeze(-1)
    elif g is Granularity.block1d_32:
        t, h, d = y.shape
        if axis == -1:
            if d % blk:
                raise ValueError(f"x: D={d} must be a multiple of the block ({blk}) for 'block1d_32'")
            yv = y.view(t, h, d // blk, blk)
            amax = _absmax_lastdim(yv).unsqueeze(-1)
            codes, scales = _pow2_codes(yv, amax, fmt, spec.exponent_rule)
            codes, scales = codes.view(t, h, d), scales.squeeze(-1)
        else:
            ids, nb = token_block_ids(cu_seqlens, t, blk, y.device)
            amax = _segment_amax(_abs_inf(y), ids, nb)  # (NB, H, D)
            codes, scales = _pow2_codes(y, amax, fmt, spec.exponent_rule, ids)  # expanded (T, H, D)
    elif g is Granularity.square_32:
        m, n = y.shape[-2:]
        lead = y.shape[:-2]
        mb, nbk = -(-m // blk), -(-n // blk)
        yp = torch.nn.functional.pad(y, (0, nbk * blk - n, 0, mb * blk - m))
        yv = yp.view(*lead, mb, blk, nbk, blk)
        amax = yv.abs().amax(dim=(-3, -1), keepdim=True)
        codes, scales = _pow2_codes(yv, amax, fmt, spec.exponent_rule)
        codes = codes.view(*lead, mb * blk, nbk * blk)[..., :m, :n].contiguous()
        scales = scales.view(*lead, mb, nbk)
    else:  # pragma: no cover - OperandQuant forbids 'none' with an 8/4-bit format
        raise ValueError(f"granularity={g.value!r} cannot be quantized")

    if transposed is None:
        transposed = fmt is not Format.e2m1 and x.dim() == 3 and g is not Granularity.square_32
    codes_t = _transpose_codes(codes) if transposed else None
    return Quantized(codes=codes, scales=scales, spec=spec, codes_t=codes_t, tensor_scale=tensor_scale,
                     cu_seqlens=cu_seqlens, axis=axis)


def _quantize_nvfp4(y: torch.Tensor):
    """Contract Step 4′. y: fp32 (T, H, D)."""
    t, h, d = y.shape
    if d % _NVFP4_BLOCK:
        raise ValueError(f"x: D={d} must be a multiple of {_NVFP4_BLOCK} for 'nvfp4'")
    dev = y.device
    one = torch.ones((), dtype=torch.float32, device=dev)
    amax_t = y.abs().amax()
    enc = torch.tensor(_NVFP4_ENC_NUM, dtype=torch.float32, device=dev) / amax_t
    enc = torch.where((amax_t == 0) | ~torch.isfinite(amax_t), one, enc)
    tensor_scale = (one / enc).reshape(1)
    yv = y.view(t, h, d // _NVFP4_BLOCK, _NVFP4_BLOCK)
    bamax = _absmax_lastdim(yv)
    tb = (bamax * enc) / torch.tensor(6.0, dtype=torch.float32, device=dev)
    sb = F.encode_e4m3(tb, saturate=True)
    sbv = F.decode_e4m3(sb)
    zero = (sbv == 0).unsqueeze(-1)
    r = (enc / torch.where(zero.squeeze(-1), one, sbv)).unsqueeze(-1)
    c = F.encode_e2m1(yv * r)
    c = torch.where(zero, torch.zeros((), dtype=torch.uint8, device=dev), c)
    return F.pack_e2m1(c.view(t, h, d)), sb, tensor_scale


def fake_quantize(x: torch.Tensor, spec: OperandQuant, cu_seqlens: torch.Tensor | None = None, *,
                  axis: int = -1) -> torch.Tensor:
    """fp32 ``quantize(x, spec, cu_seqlens, axis=axis).dequantize()`` (no ``codes_t``).

    For a BF16 spec (granularity ``none``) it returns ``x`` rounded to BF16 (RNE) as fp32."""
    if isinstance(spec, OperandQuant) and not spec.quantized:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError("x must be a floating-point torch.Tensor")
        return x.to(torch.bfloat16).to(torch.float32)
    return quantize(x, spec, cu_seqlens, transposed=False, axis=axis).dequantize()
