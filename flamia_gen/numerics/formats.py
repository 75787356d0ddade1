"""Bit-exact element formats: E4M3 ("fn"), E5M2, E2M1 and UE8M0.

Encoders work on the fp32 bit pattern with vectorized integer torch ops (no fp8 casts), so
they run unchanged on CPU and CUDA tensors and define, bit for bit, what the GPU kernels'
``cvt.rn{.satfinite}`` conversions must produce (docs/quantizer-contract.md, Step 4).

Conventions (decisions the contract leaves to this module):

* Rounding is IEEE round-to-nearest-even at the target precision; subnormals of the target
  format are produced exactly; fp32 subnormal inputs are honoured (they all round to ±0 in
  these formats). The sign of zero is kept: ``-0.0`` and tiny negative values encode to
  ``0x80`` (E4M3/E5M2) or ``0x8`` (E2M1), as PTX ``cvt`` and torch do.
* ``saturate=True`` (default) is PTX ``.satfinite``: finite values above the largest finite
  magnitude **and ±Inf** become ``±max`` (E4M3 ``0x7E/0xFE`` = ±448, E5M2 ``0x7B/0xFB`` =
  ±57344, E2M1 ``0x7/0xF`` = ±6).
* ``saturate=False`` is the OCP non-saturating mode: E4M3 overflow / ±Inf give ``sign|0x7F``
  (NaN; torch < 2.13 casts did this, torch 2.13's CPU cast saturates instead), E5M2
  overflow / ±Inf give ``sign|0x7C`` (±Inf, as torch's cast). Rounding happens first, so
  E4M3 magnitudes up to 464 (the 448/480 tie, which rounds to even 448) do not overflow.
* NaN inputs encode to the canonical, positive NaN ``0x7F`` for E4M3 and E5M2 (the sign is
  dropped, like PTX ``cvt``; torch keeps it: ``0xFF``), in both modes.
* E2M1 has no NaN/Inf: NaN encodes to ``0x7`` (+6, the positive MAXNORM, the CUDA
  ``__NV_SATFINITE`` convention; not verified on sm100 hardware, which this project lacks).
  ``quantize`` never relies on it: an NVFP4 block containing NaN has a NaN E4M3 scale.
* E2M1 codes are one per uint8 (low nibble) in ``encode_e2m1``/``decode_e2m1``;
  ``pack_e2m1``/``unpack_e2m1`` convert to and from two per byte, element ``2j`` in the low
  nibble, ``2j+1`` in the high nibble (the contract's layout, torch's ``float4_e2m1fn_x2``).
* UE8M0: code ``c`` is ``2**(c-127)``, ``0xFF`` is NaN; ``encode_ue8m0`` clamps exponents to
  ``[-127, 127]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec.enums import Format

__all__ = [
    "FormatInfo",
    "format_info",
    "encode",
    "decode",
    "encode_e4m3",
    "decode_e4m3",
    "encode_e5m2",
    "decode_e5m2",
    "encode_e2m1",
    "decode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "encode_ue8m0",
    "decode_ue8m0",
    "E4M3_NAN",
    "E5M2_NAN",
    "UE8M0_NAN",
]

E4M3_NAN = 0x7F
E5M2_NAN = 0x7F
UE8M0_NAN = 0xFF

# Elements processed per slice: on CPU keeps the int32 temporaries in cache and bounds peak
# memory for (65536, 16, 128) inputs; on a GPU large slices keep kernel launches few.
_CHUNK = 1 << 18
_CHUNK_GPU = 1 << 26


def _chunk(device: torch.device) -> int:
    return _CHUNK if device.type == "cpu" else _CHUNK_GPU


@dataclass(frozen=True)
class FormatInfo:
    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_code: int  # largest finite magnitude code (sign bit clear)
    max: float
    emax: int
    nan_code: int | None  # canonical NaN code the encoder produces
    overflow_code: int | None  # non-saturating overflow / Inf code (sign bit clear)

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exp_bits + self.man_bits)


_INFO = {
    Format.e4m3: FormatInfo("e4m3", 4, 3, 7, 0x7E, 448.0, 8, 0x7F, 0x7F),
    Format.e5m2: FormatInfo("e5m2", 5, 2, 15, 0x7B, 57344.0, 15, 0x7F, 0x7C),
    Format.e2m1: FormatInfo("e2m1", 2, 1, 1, 0x7, 6.0, 2, 0x7, None),
}


def format_info(fmt: Format | str) -> FormatInfo:
    fmt = Format(fmt)
    if fmt not in _INFO:
        raise ValueError(f"format={fmt.value!r} has no low-precision encoding; "
                         f"allowed values: {[f.value for f in _INFO]}")
    return _INFO[fmt]


def _as_f32(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point torch.Tensor, got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    return x.to(torch.float32).contiguous()


def _encode_chunk(b: torch.Tensor, fi: FormatInfo, saturate: bool) -> torch.Tensor:
    """b: int32 fp32 bit patterns (1-D). Returns int32 codes.

    Normal targets: RNE of the fp32 bits at bit ``23-M`` (carries into the exponent are
    right), then rebias. Subnormal targets (``|x| < 2^emin``): ``|x| · 2^(M-emin)`` is exact
    (a power-of-two multiply), and its RNE to an integer (``torch.round`` rounds half to even)
    is the code; a result of ``2^M`` is the smallest normal's code, as it should be."""
    M = fi.man_bits
    shift = 23 - M
    emin = 1 - fi.bias
    a = b & 0x7FFFFFFF  # |x| bits
    code = (a >> shift) & 1  # lsb of the kept mantissa: ties go to even
    code += a
    code += (1 << (shift - 1)) - 1 - ((127 - fi.bias) << 23)  # half-ulp - 1, rebias
    code >>= shift
    sub = (a.view(torch.float32) * 2.0 ** (M - emin)).round_().to(torch.int32)
    code = torch.where(a < ((127 + emin) << 23), sub, code)
    code.clamp_(max=fi.max_code if saturate else fi.overflow_code)
    code |= (b >> (31 - (fi.exp_bits + fi.man_bits))) & fi.sign_bit
    return torch.where(a > 0x7F800000, fi.nan_code, code)


def _encode(x: torch.Tensor, fmt: Format | str, saturate: bool) -> torch.Tensor:
    fi = format_info(fmt)
    if not saturate and fi.overflow_code is None:
        raise ValueError(f"format={fi.name!r} has no Inf/NaN: only saturate=True is defined")
    xf = _as_f32(x)
    shape = xf.shape
    bits = xf.reshape(-1).view(torch.int32)
    n = bits.numel()
    out = torch.empty(n, dtype=torch.uint8, device=xf.device)
    step = _chunk(xf.device)
    for i in range(0, n, step):
        out[i:i + step] = _encode_chunk(bits[i:i + step], fi, saturate).to(torch.uint8)
    return out.reshape(shape)


# ---- decode: integer bit construction of the fp32 value
def _decode_chunk(c: torch.Tensor, fi: FormatInfo) -> torch.Tensor:
    """c: int32 codes (1-D). Returns fp32."""
    E, M = fi.exp_bits, fi.man_bits
    c = c & ((fi.sign_bit << 1) - 1)  # E2M1: ignore a high nibble
    sign = (c & fi.sign_bit) << (31 - (E + M))
    ef = (c >> M) & ((1 << E) - 1)
    mf = c & ((1 << M) - 1)
    frac = mf << (23 - M)
    emin_b = 127 + 1 - fi.bias  # fp32 biased exponent of the smallest normal
    bits = ((ef + (127 - fi.bias)) << 23) | frac
    # subnormal: 0.f * 2^emin = 1.f * 2^emin - 2^emin, an exact fp32 subtraction
    sub = ((frac | (emin_b << 23)).view(torch.float32) - 2.0 ** (1 - fi.bias)).view(torch.int32)
    bits = torch.where(ef == 0, sub, bits)
    if fi.name == "e4m3":  # S.1111.111 is NaN
        bits = torch.where((c & 0x7F) == 0x7F, torch.full_like(bits, 0x7FC00000), bits)
    elif fi.name == "e5m2":  # S.11111.mm: Inf (mm = 0) or NaN
        bits = torch.where(ef == 31, 0x7F800000 | (mf << 21), bits)
    return (bits | sign).view(torch.float32)


def _check_codes(codes: torch.Tensor, name: str = "codes") -> torch.Tensor:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise ValueError(f"{name} must be a uint8 torch.Tensor of bit patterns, got "
                         f"{codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__}")
    return codes


def _decode(codes: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    fi = format_info(fmt)
    codes = _check_codes(codes)
    shape = codes.shape
    flat = codes.reshape(-1)
    n = flat.numel()
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    step = _chunk(codes.device)
    for i in range(0, n, step):
        out[i:i + step] = _decode_chunk(flat[i:i + step].to(torch.int32), fi)
    return out.reshape(shape)


def encode_e4m3(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """fp32 → E4M3fn bit patterns (uint8). RNE; see the module docstring for NaN/overflow."""
    return _encode(x, Format.e4m3, saturate)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3fn bit patterns (uint8) → fp32 (``0x7F``/``0xFF`` → NaN)."""
    return _decode(codes, Format.e4m3)


def encode_e5m2(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """fp32 → E5M2 bit patterns (uint8). RNE; see the module docstring for NaN/overflow."""
    return _encode(x, Format.e5m2, saturate)


def decode_e5m2(codes: torch.Tensor) -> torch.Tensor:
    """E5M2 bit patterns (uint8) → fp32 (``0x7C``/``0xFC`` → ±Inf, ``0x7D-0x7F``... → NaN)."""
    return _decode(codes, Format.e5m2)


def encode_e2m1(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """fp32 → E2M1 codes, one per uint8 (values 0..15). Always saturating (E2M1 has no Inf)."""
    return _encode(x, Format.e2m1, saturate)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes, one per uint8 (only the low nibble is read) → fp32."""
    return _decode(codes, Format.e2m1)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) one-per-byte E2M1 codes → (..., n) bytes, element 2j in the low nibble."""
    codes = _check_codes(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even to pack E2M1 pairs, got {codes.shape[-1]}")
    lo, hi = codes[..., 0::2] & 0xF, codes[..., 1::2] & 0xF
    return lo | (hi << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) packed E2M1 bytes → (..., 2n) codes, one per uint8."""
    packed = _check_codes(packed, "packed")
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def encode_ue8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents e → UE8M0 codes ``e + 127`` (uint8), e clamped to [-127, 127]."""
    if not isinstance(exponent, torch.Tensor) or exponent.is_floating_point() or exponent.is_complex():
        raise ValueError("exponent must be an integer torch.Tensor")
    return (exponent.to(torch.int32).clamp(-127, 127) + 127).to(torch.uint8)


def decode_ue8m0(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 codes → fp32 ``2**(c-127)`` built from bits (``c=0`` is the subnormal 2^-127);
    ``0xFF`` → NaN."""
    codes = _check_codes(codes)
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)  # 0xFF<<23 = +Inf bits
    out = bits.view(torch.float32)
    return torch.where(c == UE8M0_NAN, torch.full_like(out, float("nan")), out)


def encode(x: torch.Tensor, fmt: Format | str, saturate: bool = True) -> torch.Tensor:
    """Generic encoder (E2M1 gives one code per uint8; use ``pack_e2m1`` to pack)."""
    return _encode(x, fmt, saturate)


def decode(codes: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """Generic decoder (E2M1 expects one code per uint8)."""
    return _decode(codes, fmt)
