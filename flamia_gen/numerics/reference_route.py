"""Emulated kernel numerics of a route, forward and backward (docs/numerics.md).

The emulator is the source of truth the generated kernels are checked against (cosine ≥
0.99999, DESIGN.md §1). It reproduces *what* a route rounds, with which scale and from which
reference, tile by tile, including the forward kernel's key-tile order: P̂ of a key tile is
rounded under the running (integer) max of the tiles visited so far, as the kernel does, which
decides the result where P̂ falls in the format's subnormal range (outlier rows). It does not
reproduce the fp32 summation order. With `mma="exact"` (the default) products are exact fp32 sums;
`mma="sm90_fp8"` puts every product of FP8 codes under the Hopper tensor-core accumulation model
(numerics.mma), in the kernels' k-block orders: QKᵀ and P̂V in the forward, and in the backward QKᵀ,
dO·Vᵀ, and dV, dK, dQ per key-tile unit with the kernel's running references
(`_backward_pass_mma`; docs/numerics.md §2.3.1, §2.4.1).

Representations. Every input operand X is held as `Rep(value, codes, exp)` with
`value = codes · 2**exp` exactly: `exp` is the per-token fold exponent (the token's own or its
block's scale exponent, or the tensor's), `codes` the decoded format codes. Scales that cannot
fold along tokens (block1d_32, nvfp4, bf16) have `exp = 0` and `codes = value`.

Safeguards (what each removes is in docs/numerics.md):
- `diagonal: per_key_v` → on diagonal tiles V is used per key (token granularity);
- `k_fold` → on diagonal tiles K is used per key, in QKᵀ and in dS·K, its scale folded;
- `causal_dq_scale` → dS for dQ is scaled per (query row, key tile) from visible keys;
- `exact` with token_block Q/dO → Q and dO rows use per-token exponents in the products that
  feed O_i and dQ_i (QKᵀ, dP = dO·Vᵀ, D = rowsum(dO∘O)); the token-block copies serve dK, dV.

Score precision (docs/numerics.md §4.1, outlier tokens):
- `scores_bf16` → QKᵀ and its backward recomputation take the BF16 q, k (exact fp32 sums, as a
  BF16 wgmma); q's and k's representations serve only dK = dSᵀ·Q and dQ = dS·K;
- `p_reference: exact` → the forward's P̂ is rounded under the running fp32 row max, not its
  integer ceil, so a row's dominant P̂ is exactly 2^static_exponent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec.enums import ExponentRule, Format, Granularity, PReference
from ..spec.route import OperandQuant, Route
from . import formats
from .exp2 import exp2_poly3, poly_columns, poly_quarters
from .mma import check_model, fp8_matmul
from .quantize import Quantized, pow2_exponent, quantize
from .reference_exact import (check_inputs, chunk_rows, doc_ranges, query_chunks, softmax_scale,
                              visible_mask)

__all__ = ["Rep", "Plan", "make_plan", "represent", "route_forward", "route_backward", "scale_exponent",
           "round_to_format"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_FOLDABLE = (Granularity.token, Granularity.token_block, Granularity.tensor)
_E4M3_TB = OperandQuant(format=Format.e4m3, granularity=Granularity.token_block,
                        exponent_rule=ExponentRule.ceil)
_BF16 = OperandQuant(format=Format.bf16, granularity=Granularity.none)  # scores_bf16: q, k in QKᵀ


# ---- element and scale arithmetic (docs/quantizer-contract.md, Steps 3-4)


def scale_exponent(amax: torch.Tensor, fmt: Format, rule: ExponentRule) -> torch.Tensor:
    """fp32 power-of-two exponent of blocks with max magnitude `amax`: the quantizer's Step 3
    (`quantize.pow2_exponent`: -127 for a zero block), NaN for a NaN/Inf block so every value
    of that block dequantizes to NaN (propagated, never hidden)."""
    e, _, bad = pow2_exponent(amax.to(torch.float32).contiguous(), fmt, rule)
    e = e.to(torch.float32)
    return torch.where(bad, torch.full_like(e, float("nan")), e)


_TORCH_FP8 = {Format.e4m3: torch.float8_e4m3fn, Format.e5m2: torch.float8_e5m2}


def round_to_format(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """RNE with saturation into `fmt` (PTX cvt.rn.satfinite), as fp32 values.

    Clamp-then-torch-cast for E4M3/E5M2: value-identical to `formats.encode`/`decode` (the
    bit-exact definition; tests/numerics/test_reference.py checks ties, subnormals, NaN, Inf)
    and far faster on the large P and dS tensors."""
    fmt = Format(fmt)
    if fmt in _TORCH_FP8:
        m = formats.format_info(fmt).max
        return y.clamp(-m, m).to(_TORCH_FP8[fmt]).to(torch.float32)
    return formats.decode(formats.encode(y, fmt, saturate=True), fmt)


def quant_with_exponent(y: torch.Tensor, e: torch.Tensor, fmt: Format) -> torch.Tensor:
    """ŷ = decode(encode(y · 2^-e)) · 2^e (one exact power-of-two multiply each way)."""
    return round_to_format(y * torch.exp2(-e), fmt) * torch.exp2(e)


def quant_p(p: torch.Tensor, spec: OperandQuant) -> torch.Tensor:
    """P̂ for the PV and dV products: codes = fmt(P · 2^static_exponent) (the exponent is the
    range multiplier: P ≤ 1 lands in [0, 2^8] for E4M3), returned in true units."""
    if not spec.quantized:
        return p
    if spec.granularity is not Granularity.static:
        raise ValueError(f"p.granularity={spec.granularity.value!r}: the emulator supports 'static' only")
    e = torch.tensor(-float(spec.static_exponent))
    return quant_with_exponent(p, e, spec.format)


def flip_one_p(e: torch.Tensor, p_t: torch.Tensor, log2_carry: torch.Tensor, spec: OperandQuant,
               rel) -> torch.Tensor:
    """P̂ with, in each row, the one code the kernel may legitimately round the other way: of the
    values e (before rounding) within relative `rel` (a float or a tensor like e) of a rounding
    midpoint (e·(1 ± rel) round to a different code), the one of largest final weight
    p_t·2^log2_carry. The emulator's FP8 MMA model places scores to ~5e-5 of their size, not bit for
    bit, so a P̂ that close to a midpoint is the kernel's either way (verify.attn_gpu `P_FLIP_SCORE_REL`)."""
    up, dn = quant_p(e * (1.0 + rel), spec), quant_p(e * (1.0 - rel), spec)
    alt = torch.where(up != p_t, up, torch.where(dn != p_t, dn, p_t))
    w = torch.where((alt != p_t) & torch.isfinite(e), p_t * torch.exp2(log2_carry), torch.full_like(p_t, -1.0))
    best = w.argmax(dim=-1, keepdim=True)
    has = w.gather(-1, best) > 0
    return p_t.scatter(-1, best, torch.where(has, alt.gather(-1, best), p_t.gather(-1, best)))


def group_amax(x: torch.Tensor, rows: int, cols: int, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """|x| max over (rows × cols) groups of the last two dims, expanded back. Groups are aligned on a
    grid in which x[…, 0, 0] sits at (row0, col0): group edges at grid coordinates ≡ 0 (mod rows, cols)."""
    H, R, C = x.shape
    fr, fc = row0 % rows, col0 % cols
    pr, pc = (-(R + fr)) % rows, (-(C + fc)) % cols
    a = torch.nn.functional.pad(x.abs(), (fc, pc, fr, pr))
    a = a.view(H, (fr + R + pr) // rows, rows, (fc + C + pc) // cols, cols).amax(dim=(2, 4))
    return a.repeat_interleave(rows, 1).repeat_interleave(cols, 2)[:, fr:fr + R, fc:fc + C]


# ---- representations of the input operands


@dataclass(frozen=True)
class Rep:
    """value = codes · 2**exp[..., None]; (T, H, D), (T, H, D), (T, H) fp32."""

    value: torch.Tensor
    codes: torch.Tensor
    exp: torch.Tensor

    def doc(self, s: int, e: int, heads: torch.Tensor) -> "Rep":
        """Rows s:e, heads-first (H, L, ·), heads gathered by `heads` (GQA)."""
        def cut(t):
            return t[s:e].transpose(0, 1).index_select(0, heads)
        return Rep(cut(self.value), cut(self.codes), cut(self.exp))


def _fold_exponents(qz: Quantized, T: int, H: int) -> torch.Tensor:
    """The UE8M0 scales of a foldable quantization ((T, H) or (1,)) as fp32 exponents (T, H),
    NaN for a NaN/Inf block (``Quantized.exponents`` reports 128 there)."""
    e = qz.exponents.to(torch.float32)
    e = torch.where(qz.scales == formats.UE8M0_NAN, torch.full_like(e, float("nan")), e)
    return e.expand(T, H)


def represent(x: torch.Tensor, spec: OperandQuant, cu_seqlens: torch.Tensor) -> Rep:
    """Quantize (BF16 input, document-local scales) and split into codes and fold exponent."""
    T, H, _ = x.shape
    xb = x.to(torch.bfloat16)
    zeros = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if not spec.quantized:
        v = xb.to(torch.float32)
        return Rep(v, v, zeros)
    qz = quantize(xb, spec, cu_seqlens)
    value = qz.dequantize().to(torch.float32)
    if spec.granularity not in _FOLDABLE:
        return Rep(value, value, zeros)
    e = _fold_exponents(qz, T, H)
    return Rep(value, value * torch.exp2(-e)[..., None], e)


def _token_spec(spec: OperandQuant) -> OperandQuant:
    return spec.model_copy(update={"granularity": Granularity.token})


def _product_spec(spec: OperandQuant) -> OperandQuant:
    """Q or K in the dK / dQ products: unrotated; NVFP4 is QKᵀ-only (E4M3 token-block there)."""
    if spec.granularity is Granularity.nvfp4:
        return _E4M3_TB
    return spec.model_copy(update={"hadamard": False}) if spec.hadamard else spec


# ---- the plan: static, route-derived decisions


@dataclass(frozen=True)
class Plan:
    route: Route
    causal: bool
    tile_m: int
    tile_n: int
    scale: float
    per_key_k: bool  # k_fold: per-key K on diagonal tiles (QKᵀ and dS·K)
    per_key_v: bool  # diagonal per_key_v: per-key V on diagonal tiles (PV and dO·Vᵀ)
    causal_rows_q: bool  # exact + token_block Q: per-token Q in QKᵀ
    causal_rows_do: bool  # exact + token_block dO: per-token dO in dP and D
    causal_dq: bool  # causal dQ scale: dS for dQ per (row, key tile)
    chunk: int  # max query rows per step (a multiple of tile_m; fewer for long documents)
    key_align: int = 1  # forward kernel's key tiles start at doc_start rounded down to this
    mma_qk: bool = False  # QKᵀ under the sm90 FP8 tensor-core accumulation model (numerics.mma)
    mma_pv: bool = False  # P̂V likewise, key tiles in the kernel's visit order
    mma_dp: bool = False  # backward dP = dO·V̂ᵀ likewise (contraction over D)
    mma_dv: bool = False  # dV += Pᵀ·dO likewise, per key-tile unit over its query tiles (_backward_pass_mma)
    mma_dk: bool = False  # dK += dSᵀ·Q likewise
    mma_dq: bool = False  # dQ = dS·K likewise, per (query tile, key tile); the cross-tile sum stays fp32
    exp_poly_quarters: int = 0  # route exp_approx: columns whose exp2 is the FMA polynomial (numerics.exp2)
    scores_bf16: bool = False  # route scores_bf16: QKᵀ on the BF16 inputs (q, k codes serve dK, dQ only)
    p_exact: bool = False  # route p_reference exact: P̂ under the running fp32 max, not its integer ceil
    fwd_tile_m: int = 0  # the forward kernel's tiles, whose diagonal decisions the backward repeats
    fwd_tile_n: int = 0  # (0: tile_m / tile_n; they differ when tile_m, tile_n are a backward kernel's)
    q_align_end: bool = False  # causal forward: query tiles end at the document's end (the partial tile first)
    dq_bf16: bool = False  # backward dQ = dS·K̂ on the unquantized dS (the kernel's bwd_dq_bf16: BF16 wgmma)
    dk_bf16: bool = False  # backward dK = dSᵀ·Q̂ on the unquantized dS, Q̂ = Q codes·2^eq (no dK scale group)

    @property
    def fwd_tiles(self) -> tuple[int, int]:
        return self.fwd_tile_m or self.tile_m, self.fwd_tile_n or self.tile_n


def _needs_32(route: Route) -> bool:
    return any(oq.granularity in (Granularity.token_block, Granularity.square_32)
               for _, oq in route.operands.items())


def _fp8_codes(spec: OperandQuant) -> bool:
    """Rep.codes of this operand are FP8 code values (what an FP8 wgmma multiplies)."""
    return spec.quantized and spec.format in (Format.e4m3, Format.e5m2) and spec.granularity in _FOLDABLE


def _fp8_format(spec: OperandQuant) -> bool:
    """A quantized P or dS whose codes are FP8 (E4M3/E5M2) values: the A operand of an FP8 wgmma."""
    return spec.quantized and spec.format in (Format.e4m3, Format.e5m2)


def make_plan(route: Route, causal: bool, tile_m: int, tile_n: int, scale: float, chunk: int = 1024,
              key_align: int = 1, mma: str = "exact", *, fwd_tile_m: int | None = None,
              fwd_tile_n: int | None = None, q_align_end: bool = False, dq_bf16: bool = False,
              dk_bf16: bool = False) -> Plan:
    for name, tm, tn in (("tile", tile_m, tile_n),
                         ("fwd_tile", tile_m if fwd_tile_m is None else fwd_tile_m,
                          tile_n if fwd_tile_n is None else fwd_tile_n)):
        if tm <= 0 or tn <= 0:
            raise ValueError(f"{name}_m and {name}_n must be positive, got {tm}, {tn}")
        if _needs_32(route) and (tm % 32 or tn % 32):
            raise ValueError(f"route {route.name!r} has 32-token blocks: {name}_m and {name}_n must be multiples "
                             f"of 32 (got {tm}, {tn}); a block straddling a tile edge would leak")
    if key_align <= 0 or key_align > tile_n:
        raise ValueError(f"key_align must be in [1, tile_n={tile_n}], got {key_align}")
    ops = route.operands
    fp8_mma = check_model(mma) == "sm90_fp8"
    sg = route.forward_safeguards(causal)
    per_key_v = sg.per_key_v
    if dq_bf16 and not (_fp8_format(ops.ds) and _fp8_codes(_product_spec(ops.k))):
        raise ValueError(f"dq_bf16: route {route.name!r} has no FP8 dS·K product to take in BF16")
    if dq_bf16 and _product_spec(ops.k) != ops.k:
        raise ValueError(f"dq_bf16: route {route.name!r} keeps K in a format of its own ({ops.k.format.value}) with "
                         "an E4M3 copy for dQ; no BF16 K is defined for its dQ")
    if dk_bf16 and not (_fp8_format(ops.ds) and _fp8_codes(_product_spec(ops.q))):
        raise ValueError(f"dk_bf16: route {route.name!r} has no FP8 dSᵀ·Q product to take in BF16")
    if dk_bf16 and (_product_spec(ops.q) != ops.q or sg.rows_q):
        raise ValueError(f"dk_bf16: route {route.name!r} takes dK's Q in a copy of its own (a token-block or per-row "
                         "Q); no BF16 Q̂ is defined for its dK")
    if q_align_end and causal and (sg.per_key_k or per_key_v):
        raise ValueError(f"q_align_end: route {route.name!r} takes per-key operands on diagonal tiles, which the "
                         "backward repeats on query tiles from the document start; not with end-aligned tiles")
    return Plan(
        route=route, causal=causal, tile_m=tile_m, tile_n=tile_n, scale=scale,
        per_key_k=sg.per_key_k,
        per_key_v=per_key_v,
        causal_rows_q=sg.rows_q,
        causal_rows_do=route.exact and ops.do.granularity is Granularity.token_block,
        causal_dq=route.causal_dq_scale,
        chunk=max(tile_m, (chunk // tile_m) * tile_m), key_align=key_align,
        mma_qk=fp8_mma and not route.scores_bf16 and _fp8_codes(ops.q) and _fp8_codes(ops.k),
        mma_pv=fp8_mma and _fp8_codes(ops.v) and ops.p.quantized,
        mma_dp=fp8_mma and _fp8_codes(ops.do) and _fp8_codes(ops.v),
        mma_dv=fp8_mma and _fp8_format(ops.p) and _fp8_codes(ops.do),
        mma_dk=fp8_mma and _fp8_format(ops.ds) and _fp8_codes(_product_spec(ops.q)) and not dk_bf16,
        mma_dq=fp8_mma and _fp8_format(ops.ds) and _fp8_codes(_product_spec(ops.k)) and not dq_bf16,
        exp_poly_quarters=poly_quarters(route.exp_approx.value),
        scores_bf16=route.scores_bf16, p_exact=route.p_reference is PReference.exact,
        fwd_tile_m=fwd_tile_m or 0, fwd_tile_n=fwd_tile_n or 0, q_align_end=bool(q_align_end and causal),
        dq_bf16=bool(dq_bf16), dk_bf16=bool(dk_bf16))


def q_shift(plan: Plan, length: int) -> int:
    """Rows before a document's first that its first query tile covers: with `q_align_end` (causal) the tiles
    end at the document's end, so the partial tile comes first, where it sees the fewest keys; else 0."""
    return (-length) % plan.tile_m if plan.q_align_end else 0


@dataclass(frozen=True)
class ForwardOps:
    qs: Rep  # Q in QKᵀ
    ks: Rep  # K in QKᵀ (off-diagonal tiles, or all tiles)
    ks_tok: Rep | None  # K per key on diagonal tiles
    v: Rep
    v_tok: Rep | None


@dataclass(frozen=True)
class BackwardOps:
    fwd: ForwardOps
    do_rows: Rep  # dO in dP = dO·Vᵀ and in D = rowsum(dO∘O)
    do_dv: Rep  # dO in dV = Pᵀ·dO
    kq: Rep  # K in dQ = dS·K
    kq_tok: Rep | None
    qk: Rep  # Q in dK = dSᵀ·Q


def prepare_forward(plan: Plan, q, k, v, cu) -> ForwardOps:
    ops = plan.route.operands
    qspec = _token_spec(ops.q) if plan.causal_rows_q else ops.q
    kspec = ops.k
    if plan.scores_bf16:  # QKᵀ on the BF16 inputs: no scale, nothing to fold
        qspec = kspec = _BF16
    return ForwardOps(
        qs=represent(q, qspec, cu),
        ks=represent(k, kspec, cu),
        ks_tok=represent(k, _token_spec(ops.k), cu) if plan.per_key_k else None,
        v=represent(v, ops.v, cu),
        v_tok=represent(v, _token_spec(ops.v), cu) if plan.per_key_v else None)


def prepare_backward(plan: Plan, q, k, v, do, cu) -> BackwardOps:
    ops = plan.route.operands
    fwd = prepare_forward(plan, q, k, v, cu)
    do_dv = represent(do, ops.do, cu)
    kspec = _product_spec(ops.k)
    return BackwardOps(
        fwd=fwd,
        do_rows=represent(do, _token_spec(ops.do), cu) if plan.causal_rows_do else do_dv,
        do_dv=do_dv,
        # dq_bf16 on a BF16-score route: dQ takes the BF16 k of QKᵀ itself (the kernel's sK), not K's E4M3 codes
        kq=fwd.ks if (kspec == ops.k and not plan.scores_bf16) or (plan.dq_bf16 and plan.scores_bf16)
        else represent(k, kspec, cu),
        kq_tok=represent(k, _token_spec(kspec), cu) if plan.per_key_k else None,
        qk=represent(q, _product_spec(ops.q), cu))


# ---- tile geometry of one query chunk


@dataclass(frozen=True)
class Geometry:
    visible: torch.Tensor  # (M, N) bool
    empty: torch.Tensor  # (M,) bool: no visible key
    diag: torch.Tensor | None  # (M, N) bool: (query tile, key tile) is a diagonal tile


def geometry(plan: Plan, a: int, b: int, n: int, length: int, device, delta: int = 0) -> Geometry:
    """Diagonal tiles are the forward kernel's masked key tiles, on the forward's tiles (`plan.fwd_tiles`
    FTM, FTN; the backward kernel's may differ): with query tiles from the document start and key
    tiles starting `delta` keys before it (key tile of key j: (j + delta) // FTN), those from the
    tile holding the query tile's first row on (`n_mask` of the template's `key_tiling`). Every key
    a 32-token block could share with a later position of a query tile lies in them."""
    vis = visible_mask(a, b - a, n, plan.causal, device)
    diag = None
    if plan.causal and (plan.per_key_k or plan.per_key_v):
        ftm, ftn = plan.fwd_tiles
        i = torch.arange(a, b, device=device)[:, None]
        j = torch.arange(n, device=device)[None, :]
        first_row = (i // ftm) * ftm
        diag = (j + delta) // ftn >= (first_row + delta) // ftn
    return Geometry(vis, ~vis.any(dim=-1), diag)


def _pick(mask, a, b):
    """Per (row, key) choice between two tensors; `mask` None → `a`."""
    return a if mask is None else torch.where(mask, b, a)


def _split_matmul(w, x, x_diag, diag):
    """Σ_j w[., j] · x(j) with x(j) from `x_diag` on diagonal tiles: two masked matmuls."""
    if diag is None or x_diag is None:
        return w @ x
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    return torch.where(diag, zero, w) @ x + torch.where(diag, w, zero) @ x_diag


def _fp8_matmul_visible(a: torch.Tensor, b: torch.Tensor, visible: torch.Tensor | None, rows: int = 64):
    """fp8_matmul(a (…, M, K), b (…, K, N)) where `visible` (M, N) is True; elsewhere 0 or the model's
    value (callers mask those entries). Each block of `rows` rows is computed on the key prefix that
    holds its visible keys (a causal mask's upper triangle is skipped); every computed entry is the
    full product's (the model is per element)."""
    if visible is None:
        return fp8_matmul(a, b)
    M, N = visible.shape
    out = torch.zeros(*a.shape[:-1], N, dtype=torch.float32, device=a.device)
    last = torch.where(visible, torch.arange(1, N + 1, device=a.device), 0)
    for r0 in range(0, M, rows):
        kmax = int(last[r0:r0 + rows].max()) if N else 0
        if kmax:
            out[..., r0:r0 + rows, :kmax] = fp8_matmul(a[..., r0:r0 + rows, :], b[..., :kmax])
    return out


def _qk(plan: Plan, qr: Rep, kr: Rep, visible: torch.Tensor | None = None) -> torch.Tensor:
    if not plan.mma_qk:
        return qr.value @ kr.value.transpose(-1, -2)
    return (_fp8_matmul_visible(qr.codes, kr.codes.transpose(-1, -2), visible)
            * torch.exp2(qr.exp[..., None] + kr.exp[:, None, :]))


def scores_log2(plan: Plan, qr: Rep, kd: Rep, kt: Rep | None, g: Geometry, visible_only: bool = False):
    """x = scale·log2(e)·Q̂K̂ᵀ (fp32), -inf where masked; K per key on diagonal tiles. `visible_only`:
    under the MMA model, skip the products of masked row blocks (the backward; same values)."""
    vis = g.visible if visible_only else None
    s = _qk(plan, qr, kd, vis)
    if kt is not None and g.diag is not None:
        s = torch.where(g.diag, _qk(plan, qr, kt, vis), s)
    x = s * (plan.scale * LOG2E)
    return x.masked_fill(~g.visible, float("-inf"))


# ---- forward


def tile_visit_rank(plan: Plan, rows: torch.Tensor, length: int, delta: int, n_tiles: int,
                    window: bool = False) -> torch.Tensor:
    """(M, n_tiles) int64: the order in which the forward kernel visits key tiles for each query
    row (rank 0 first; tiles it never visits rank last). Key tile t holds doc-local keys
    t·tile_n − delta + [0, tile_n). Order (templates/sm90/attn_fwd.py.j2 `key_tiling`):
    nblk−1 … n_mask (tiles needing a mask, diagonal first), then tile 0 when it opens with
    `delta` keys of the previous document, then n_mask−1 … n_lo. `window`: the document runs inside a
    window of short documents (runtime.attn_fwd.merge_windows), whose tiles are all masked: the last
    tile first, then descending (tiles past a row's keys hold none of them and change nothing)."""
    tm, tn = plan.tile_m, plan.tile_n
    if window:
        t = torch.arange(n_tiles, device=rows.device)[None, :].expand(rows.numel(), n_tiles)
        return n_tiles - 1 - t
    sh = q_shift(plan, length)
    mblk = ((rows + sh) // tm)[:, None]
    row0 = mblk * tm - sh  # the query tile's first row (negative: rows before the document, q_align_end)
    last = torch.clamp(row0 + tm, max=length) if plan.causal else torch.full_like(mblk, length)
    nblk = (last + delta + tn - 1) // tn
    n_mask = torch.minimum(torch.clamp((row0 + delta) // tn, min=0), nblk - 1) if plan.causal else nblk - 1
    n_lo = torch.clamp(n_mask, max=min(delta, 1))
    t = torch.arange(n_tiles, device=rows.device)[None, :]
    rank = torch.where(t >= n_mask, nblk - 1 - t,
                       torch.where((t == 0) & (n_lo == 1), nblk - n_mask, nblk - 1 + n_lo - t))
    return torch.where(t >= nblk, n_tiles + t, rank)


def running_tile_max(plan: Plan, y: torch.Tensor, a: int, length: int, delta: int, window: bool = False):
    """The kernel's reference per (row, key tile): ceil(max of y over the tiles visited up to and
    including that tile) — the max itself under p_reference exact —, -inf before the first visible
    key (y is -inf there too).
    Returns (H, M, n_tiles) maxima, (N,) key → tile, (M, n_tiles) visit order (tile ids)."""
    H, M, N = y.shape
    tn = plan.tile_n
    n_tiles = (N + delta + tn - 1) // tn
    tiles = torch.nn.functional.pad(y, (delta, n_tiles * tn - N - delta), value=float("-inf"))
    tile_max = tiles.view(H, M, n_tiles, tn).amax(dim=-1)
    rows = torch.arange(a, a + M, device=y.device)
    order = tile_visit_rank(plan, rows, length, delta, n_tiles, window).argsort(dim=1)
    ordh = order[None].expand(H, M, n_tiles)
    run = torch.empty_like(tile_max).scatter_(2, ordh, tile_max.gather(2, ordh).cummax(dim=2).values)
    key_tile = (torch.arange(N, device=y.device) + delta) // tn
    return (run if plan.p_exact else torch.ceil(run)), key_tile, order


def query_tile_spans(M: int, tm: int, off: int = 0) -> list[tuple[int, int]]:
    """[r0, r1) of the query tiles over a chunk of M rows whose first row lies `off` rows into its tile."""
    starts = [0, *range(tm - off if off else tm, M, tm)]
    return list(zip(starts, [*starts[1:], M]))


def _pv_in_visit_order(plan: Plan, p_codes, v_codes, run, order, delta, v_codes_diag=None, diag=None, off: int = 0):
    """Σ P̂·V (codes) as the kernel accumulates it: per query tile, key tiles in visit order,
    the accumulator rescaled by 2^(m_old − m_new) (exact) before each tile's FP8 wgmma, k-blocks
    of 32 keys under the sm90_fp8 model. Returns the sum under each row's final reference.
    `v_codes_diag`, `diag` (M, N): per-key V codes on the diagonal tiles (one pattern per query
    tile: the kernel loads the per-token Vᵀ copy for a whole key tile). `off`: how far into its query tile the
    chunk's first row lies (q_align_end shifts the tiles; the chunk itself starts on a multiple of tile_m)."""
    H, M, N = p_codes.shape
    tm, tn = plan.tile_m, plan.tile_n
    n_tiles = run.shape[-1]
    pad = (0, 0, delta, n_tiles * tn - N - delta)
    P = torch.nn.functional.pad(p_codes, (delta, n_tiles * tn - N - delta))
    V = torch.nn.functional.pad(v_codes, pad)
    if v_codes_diag is not None:
        Vd = torch.nn.functional.pad(v_codes_diag, pad)
        Dg = torch.nn.functional.pad(diag, (delta, n_tiles * tn - N - delta))
    out = torch.zeros(H, M, v_codes.shape[-1], dtype=torch.float32, device=p_codes.device)
    for r0, r1 in query_tile_spans(M, tm, off):
        Vr = V if v_codes_diag is None else torch.where(Dg[r0][None, :, None], Vd, V)
        acc = torch.zeros(H, r1 - r0, v_codes.shape[-1], dtype=torch.float32, device=p_codes.device)
        m_old = torch.full((H, r1 - r0), float("-inf"), device=p_codes.device)
        for t in order[r0].tolist():  # one visit order per query tile
            m_t = run[:, r0:r1, t]
            live = torch.isfinite(m_t)
            if not bool(live.any()):
                continue
            f = torch.where(torch.isfinite(m_old) & live, torch.exp2(m_old - m_t), torch.ones_like(m_t))
            acc = acc * f[..., None]
            m_old = torch.where(live, m_t, m_old)
            acc = fp8_matmul(P[:, r0:r1, t * tn:(t + 1) * tn], Vr[:, t * tn:(t + 1) * tn], acc)
        out[:, r0:r1] = acc
    return out


def _forward_chunk(plan: Plan, qr: Rep, kd, kt, vd, vt, g: Geometry, a: int = 0, length: int = 0, delta: int = 0,
                   p_flip_rel: float = 0.0, window: bool = False):
    """O and LSE of one query chunk. P̂ = q(exp2(x + e_v − m)), m = ceil(max visible x + e_v):
    V's scale folds into P̂ (per key), m is an integer so a kernel's running max rescales by a
    power of two (p_reference exact: m = max visible x + e_v, the dominant P̂ is exactly 2^static and a
    rescale is an fp32 multiply); the denominator l = Σ exp2(x − max x) is fp32, unquantized. A quantized P̂
    is rounded under the kernel's running max m_t of the tiles visited so far and carried to
    the final m exactly (× 2^(m_t − m)): the same value unless it is subnormal under m.
    p_flip_rel > 0 (the relative error of a score the kernel may have against the model): also return O
    with one P̂ per row rounded the other way where that error allows it (`flip_one_p`): a third result."""
    x = scores_log2(plan, qr, kd, kt, g)
    ev = _pick(g.diag if vt is not None else None, vd.exp[:, None, :], vt.exp[:, None, :] if vt else None)
    y = torch.where(g.visible, x + ev, torch.full_like(x, float("-inf")))
    empty = g.empty[None, :]
    ymax = y.amax(dim=-1)
    m = torch.where(empty, 0.0, ymax if plan.p_exact else torch.ceil(ymax))
    mx = torch.where(empty, 0.0, x.amax(dim=-1))
    pq = plan.route.operands.p
    poly = None
    if plan.exp_poly_quarters:
        poly = poly_columns(y.shape[-1], delta, plan.tile_n, plan.exp_poly_quarters, y.device)
    if pq.quantized or poly is not None:
        run, key_tile, order = running_tile_max(plan, y, a, length, delta, window)
        mt = run[:, :, key_tile]
        mt = torch.where(torch.isinf(mt), m[..., None].expand_as(mt), mt)
        e = torch.exp2(y - mt)  # exp2 under the running reference, as the kernel evaluates it
        if poly is not None:
            s = float(pq.static_exponent) if pq.quantized else 0.0  # the kernel's argument is y − m + s
            e = torch.where(poly, exp2_poly3(y - mt + s) * 2.0 ** -s, e)
        p_t = quant_p(e, pq)  # P̂ under the running reference
    else:
        p_t = None
    if poly is None:
        l = torch.exp2(x - mx[..., None]).sum(dim=-1)
    else:  # the kernel's l sums the same exponentials, V's fold taken back out
        l = torch.where(g.visible, e * torch.exp2(mt - ev - mx[..., None]), 0.0).sum(dim=-1)

    def output(p_t):
        if plan.mma_pv:
            # codes = P̂·2^static_exponent (E4M3 values); the kernel's accumulator ends under m
            p_scale = float(2.0 ** pq.static_exponent)
            split = vt is not None and g.diag is not None
            acc = _pv_in_visit_order(plan, p_t * p_scale, vd.codes, run, order, delta,
                                     vt.codes if split else None, g.diag if split else None,
                                     (a + q_shift(plan, length)) % plan.tile_m) / p_scale
        else:  # P̂ carried from its running reference to the final m (exact powers of two)
            p_hat = torch.exp2(y - m[..., None]) if p_t is None else p_t * torch.exp2(mt - m[..., None])
            acc = _split_matmul(p_hat, vd.codes, vt.codes if vt else None, g.diag if vt else None)
        o = acc * (torch.exp2(m - mx) / torch.where(empty, 1.0, l))[..., None]
        return torch.where(empty[..., None], 0.0, o)

    o = output(p_t)
    lse = torch.where(empty, float("inf"), (mx + torch.log2(l)) * LN2)
    if p_flip_rel <= 0.0:
        return o, lse
    if p_t is None or poly is not None:
        return o, lse, o
    # a score off by p_flip_rel of its size moves exp2 of it by ln 2 · p_flip_rel · |x| relative
    rel = torch.where(torch.isfinite(x), LN2 * p_flip_rel * (x.abs() + 1.0), torch.zeros_like(x))
    o_flip = output(flip_one_p(e, p_t, mt - m[..., None], pq, rel))
    return o, lse, o_flip


def route_forward(route: Route, q, k, v, cu_seqlens, causal=True, *, tile_m=128, tile_n=128, scale=None,
                  key_align=1, mma="exact", p_flip_rel: float = 0.0, q_align_end: bool = False,
                  windows: bool = False):
    """Emulated forward: (O (T, Hq, D) fp32, LSE (T, Hq) fp32, natural log). `key_align`: the
    kernel's key tiles start at the document start rounded down to a multiple of it (16 for
    the sm90 FP8 forward, whose Vᵀ TMA needs 16-byte-aligned key coordinates). `mma`: the
    tensor-core accumulation model of the products (numerics.mma; "sm90_fp8" is slow, for
    checking a Hopper kernel). `p_flip_rel` > 0: a third result, O with one P̂ per row rounded the
    other way where a score error of that relative size lets the kernel round it so (`flip_one_p`;
    verification only). `q_align_end`: the kernel's causal query tiles end at each document's end
    (`fwd_q_align_end`: the partial tile first), which sets their key-tile visit order. `windows`: as the sm90
    forward kernel, documents shorter than tile_m run inside windows (runtime.attn_fwd.merge_windows): their key
    tiles start at the window's start (rounded down to key_align) and are visited last-first, which sets which
    keys share a tile, and so P̂'s running reference and the P̂V k-blocks (at most 1e-4 of a row's O apart)."""
    T, Hq, D, group = check_inputs(q, k, v, cu_seqlens)
    plan = make_plan(route, causal, tile_m, tile_n, softmax_scale(D, scale), key_align=key_align, mma=mma,
                     q_align_end=q_align_end)
    f = prepare_forward(plan, q, k, v, cu_seqlens)
    heads = torch.arange(Hq, device=q.device) // group
    qheads = torch.arange(Hq, device=q.device)
    o = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, Hq), float("inf"), dtype=torch.float32, device=q.device)
    o_flip = torch.zeros_like(o) if p_flip_rel > 0.0 else None
    win_start = window_starts(cu_seqlens, plan.tile_m, T) if windows else {}
    for s, e in doc_ranges(cu_seqlens):
        qd, kd, vd = f.qs.doc(s, e, qheads), f.ks.doc(s, e, heads), f.v.doc(s, e, heads)
        kt = f.ks_tok.doc(s, e, heads) if f.ks_tok else None
        vt = f.v_tok.doc(s, e, heads) if f.v_tok else None
        ws = win_start.get(s)
        delta = s % plan.key_align if ws is None else (s - (ws - ws % plan.key_align)) % plan.tile_n
        for a, b in query_chunks(e - s, chunk_rows(plan.chunk, Hq, e - s, plan.tile_m)):
            n = b if causal else e - s
            g = geometry(plan, a, b, n, e - s, q.device, delta)
            res = _forward_chunk(plan, _rows(qd, a, b), _cut(kd, n), _cut(kt, n), _cut(vd, n),
                                 _cut(vt, n), g, a, e - s, delta, p_flip_rel, ws is not None)
            o[s + a:s + b] = res[0].transpose(0, 1)
            lse[s + a:s + b] = res[1].transpose(0, 1)
            if o_flip is not None:
                o_flip[s + a:s + b] = res[2].transpose(0, 1)
    return (o, lse) if o_flip is None else (o, lse, o_flip)


def window_starts(cu_seqlens: torch.Tensor, tile_m: int, T: int) -> dict[int, int]:
    """{document start: its window's start} for the documents the sm90 forward runs inside a window of two or
    more short documents (runtime.attn_fwd.merge_windows with chunk tile_m, the kernel's own schedule)."""
    from ..runtime.attn_fwd import merge_windows  # torch only; the schedule the kernel runs

    w = merge_windows(cu_seqlens.cpu(), tile_m, T)
    pcu, flag = w.cu.to(torch.int64), w.flag
    out = {}
    for s, e in doc_ranges(cu_seqlens):
        i = int(torch.searchsorted(pcu, torch.tensor(s), right=True)) - 1
        if flag[i]:
            out[s] = int(pcu[i])
    return out


def _rows(r: Rep, a: int, b: int) -> Rep:
    return Rep(r.value[:, a:b], r.codes[:, a:b], r.exp[:, a:b])


def _cut(r: Rep | None, n: int) -> Rep | None:
    return None if r is None else Rep(r.value[:, :n], r.codes[:, :n], r.exp[:, :n])


# ---- backward


@dataclass(frozen=True)
class _ChunkGrad:
    ds: torch.Tensor  # (H, M, N) dS (masked entries exactly 0), before the softmax scale
    p: torch.Tensor  # (H, M, N) P = exp2(x − LSE₂)


def _dp(plan: Plan, do_r: Rep, vr: Rep, visible: torch.Tensor) -> torch.Tensor:
    """dP = dO·V̂ᵀ (H, M, N): exact fp32 sums, or the FP8 wgmma of the codes under the model with
    the two per-token exponents applied after (the kernel's dP_acc·2^ev·2^edo; masked entries are
    not computed: dS is 0 there)."""
    if not plan.mma_dp:
        return do_r.value @ vr.value.transpose(-1, -2)
    return (_fp8_matmul_visible(do_r.codes, vr.codes.transpose(-1, -2), visible)
            * torch.exp2(do_r.exp[..., None] + vr.exp[:, None, :]))


def _grad_chunk(plan: Plan, qr: Rep, kd, kt, vd, vt, do_r: Rep, oc, lse2, g: Geometry) -> _ChunkGrad:
    """Recompute P from the forward's operands and decisions; dS = P ∘ (dO·V̂ᵀ − D)."""
    x = scores_log2(plan, qr, kd, kt, g, visible_only=True)
    p = torch.exp2(x - lse2[..., None])
    dp = _dp(plan, do_r, vd, g.visible)
    if vt is not None and g.diag is not None:
        dp = torch.where(g.diag, _dp(plan, do_r, vt, g.visible), dp)
    dvec = (do_r.value * oc).sum(dim=-1)  # D from the same dO representation as dP (FLAMIA §3.3)
    ds = torch.where(g.visible, p * (dp - dvec[..., None]), torch.zeros_like(p))
    return _ChunkGrad(ds, p)


def _ds_groups(plan: Plan, for_dq: bool) -> tuple[int, int] | None:
    """(rows, keys) of one dS scale group in a chunk; None for tensor/static/none."""
    ds = plan.route.operands.ds
    if for_dq and plan.causal_dq:
        return (1, plan.tile_n)  # causal dQ scale: per (query row, key tile), visible keys only
    if ds.granularity is Granularity.token:
        return (1, plan.tile_n) if for_dq else (plan.tile_m, 1)
    if ds.granularity is Granularity.square_32:
        return (ds.block, ds.block)
    return None


def quant_ds(plan: Plan, y: torch.Tensor, for_dq: bool, tensor_amax: torch.Tensor | None) -> torch.Tensor:
    """Quantize a folded dS (H, M, N) with the route's ds spec for the dQ or the dK product."""
    ds = plan.route.operands.ds
    if not ds.quantized:
        return y
    groups = _ds_groups(plan, for_dq)
    if groups is not None:
        e = scale_exponent(group_amax(y, *groups), ds.format, ds.exponent_rule)
    elif ds.granularity is Granularity.tensor:
        e = scale_exponent(tensor_amax, ds.format, ds.exponent_rule)
    elif ds.granularity is Granularity.static:
        e = torch.tensor(-float(ds.static_exponent))
    else:
        raise ValueError(f"ds.granularity={ds.granularity.value!r} is not supported by the emulator")
    return quant_with_exponent(y, e, ds.format)


def _folds(plan: Plan, cg: _ChunkGrad, kq: Rep, kqt: Rep | None, qk_exp, g: Geometry):
    """dS with K's per-key exponent folded in (dQ product) and with Q's per-row exponent (dK)."""
    ek = _pick(g.diag if kqt is not None else None, kq.exp[:, None, :], kqt.exp[:, None, :] if kqt else None)
    return cg.ds * torch.exp2(ek), cg.ds * torch.exp2(qk_exp[..., None])


def route_backward(route: Route, q, k, v, o, lse, do, cu_seqlens, causal=True, *, tile_m=128, tile_n=128,
                   scale=None, mma="exact", key_align=1, fwd_tile_m=None, fwd_tile_n=None, dq_bf16=False,
                   dk_bf16=False):
    """Emulated backward → (dQ, dK, dV) fp32, shapes of q, k, v. `dq_bf16` (the sm90 backward kernel's flag
    `bwd_dq_bf16`, on for fp8_token and fp8_token_bf16qk since 2026-12-04; off here by default, the route spec's E4M3
    dS): dQ = dS·K̂ takes dS unquantized (fp32 here; the kernel's BF16 wgmma rounds it to BF16) with K̂ = K codes·2^ek
    (on a BF16-score route the BF16 k of QKᵀ itself), so no dQ scale group exists; dK, dV unchanged. `dk_bf16` (the
    same for dK, 2026-12-07, for a kernel not built yet: docs/kernels/attn_bwd.md "Ablations"): dK = dSᵀ·Q̂ on the
    unquantized dS with Q̂ = Q codes·2^eq, no dK scale group or running exponent; dQ, dV unchanged. `tile_m`,
    `tile_n`, `key_align`: the backward's tiling (chunks, per-tile dS groups); `fwd_tile_m`, `fwd_tile_n` (default `tile_m`,
    `tile_n`): the *forward's* tiles, whose diagonal decisions the backward repeats (its key tiles
    start at doc_start − δ as well, δ = doc_start mod key_align). `mma="sm90_fp8"`: every product
    whose operands are FP8 codes (QKᵀ, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K) under the FP8 tensor-core model, as
    the sm90 backward kernel forms them (`_backward_pass_mma`) on its tiles `tile_m`, `tile_n`,
    `key_align` (sm90 FP8: 64, 128, 16). Routes without FP8 products (bf16) give the exact result."""
    T, Hq, D, group = check_inputs(q, k, v, cu_seqlens)
    plan = make_plan(route, causal, tile_m, tile_n, softmax_scale(D, scale), mma=mma, key_align=key_align,
                     fwd_tile_m=fwd_tile_m, fwd_tile_n=fwd_tile_n, dq_bf16=dq_bf16, dk_bf16=dk_bf16)
    model = plan.mma_dv or plan.mma_dk or plan.mma_dq
    if model and plan.per_key_k and plan.fwd_tiles[1] != tile_n:
        # the model takes the K copy of dS·K per (row, key tile): one choice per tile only when the tiles agree
        raise ValueError(f"route {route.name!r} (k_fold) under mma='sm90_fp8' needs fwd_tile_n == tile_n "
                         f"(got {plan.fwd_tiles[1]}, {tile_n}): a backward key tile would hold both K copies")
    bo = prepare_backward(plan, q, k, v, do, cu_seqlens)
    o32 = o.to(torch.float32)
    lse2 = lse.to(torch.float32) * LOG2E
    tensor_amax = None
    ds = route.operands.ds
    if ds.quantized and ds.granularity is Granularity.tensor:
        tensor_amax = _backward_pass(plan, bo, o32, lse2, cu_seqlens, group, None, amax_only=True)
    if model:
        return _backward_pass_mma(plan, bo, o32, lse2, cu_seqlens, group, tensor_amax)
    return _backward_pass(plan, bo, o32, lse2, cu_seqlens, group, tensor_amax)


def _backward_pass(plan, bo: BackwardOps, o32, lse2, cu, group, tensor_amax, amax_only=False):
    """One sweep over documents and query chunks. With a tensor-scaled dS the first sweep
    (`amax_only`) only returns the two folded dS amaxes (dQ fold, dK fold), which the second
    sweep takes as `tensor_amax`."""
    T, Hq, D = o32.shape
    Hkv = Hq // group
    dev = o32.device
    amax = torch.zeros(2, dtype=torch.float32, device=dev)
    dq = torch.zeros(T, Hq, D, dtype=torch.float32, device=dev)
    dk = torch.zeros(T, Hq, D, dtype=torch.float32, device=dev)
    dv = torch.zeros(T, Hq, D, dtype=torch.float32, device=dev)
    heads = torch.arange(Hq, device=dev) // group
    qh = torch.arange(Hq, device=dev)
    f = bo.fwd
    for s, e in doc_ranges(cu):
        L = e - s
        qd, kd, vd = f.qs.doc(s, e, qh), f.ks.doc(s, e, heads), f.v.doc(s, e, heads)
        kt = f.ks_tok.doc(s, e, heads) if f.ks_tok else None
        vt = f.v_tok.doc(s, e, heads) if f.v_tok else None
        do_r, do_v = bo.do_rows.doc(s, e, qh), bo.do_dv.doc(s, e, qh)
        kq = bo.kq.doc(s, e, heads)
        kqt = bo.kq_tok.doc(s, e, heads) if bo.kq_tok else None
        qk = bo.qk.doc(s, e, qh)
        od, ld = o32[s:e].transpose(0, 1), lse2[s:e].transpose(0, 1)
        for a, b in query_chunks(L, chunk_rows(plan.chunk, Hq, L, plan.tile_m)):
            n = b if plan.causal else L
            g = geometry(plan, a, b, n, L, dev, s % plan.key_align)
            cg = _grad_chunk(plan, _rows(qd, a, b), _cut(kd, n), _cut(kt, n), _cut(vd, n), _cut(vt, n),
                             _rows(do_r, a, b), od[:, a:b], ld[:, a:b], g)
            ds_q, ds_k = _folds(plan, cg, _cut(kq, n), _cut(kqt, n), qk.exp[:, a:b], g)
            if amax_only:
                amax = torch.maximum(amax, torch.stack([ds_q.abs().amax(), ds_k.abs().amax()]))
                continue
            dsq_hat = ds_q if plan.dq_bf16 else quant_ds(plan, ds_q, True, None if tensor_amax is None else tensor_amax[0])
            dsk_hat = ds_k if plan.dk_bf16 else quant_ds(plan, ds_k, False,
                                                         None if tensor_amax is None else tensor_amax[1])
            dq_c = _split_matmul(dsq_hat, kq.codes[:, :n], kqt.codes[:, :n] if kqt else None,
                                 g.diag if kqt else None)
            dq[s + a:s + b] = (dq_c * plan.scale).transpose(0, 1)
            dk[s:s + n] += (dsk_hat.transpose(-1, -2) @ qk.codes[:, a:b] * plan.scale).transpose(0, 1)
            p_hat = quant_p(cg.p, plan.route.operands.p)
            dv[s:s + n] += (p_hat.transpose(-1, -2) @ do_v.value[:, a:b]).transpose(0, 1)
    if amax_only:
        return amax
    return dq, _sum_groups(dk, Hkv, group), _sum_groups(dv, Hkv, group)


# ---- backward under the sm90 FP8 tensor-core model: the kernel's tiles, references and orders


def _pow2i(e: torch.Tensor) -> torch.Tensor:
    """The kernel's `pow2i` of an integer-valued fp32 tensor: 2^e, 0 for e ≤ −127 (flushed), 2^127 for
    e ≥ 127; NaN stays NaN."""
    return torch.where(e <= -127, torch.zeros_like(e), torch.exp2(e.clamp(max=127.0)))


def _ds_exponents(plan: Plan, y: torch.Tensor, for_dq: bool, tensor_amax, row0: int, key0: int) -> torch.Tensor:
    """Per-element scale exponent (H, M, N) of the route's dS groups for the dQ or dK fold, from which
    the model takes the kernel's references (a max over a tile). Groups that are the kernel's tile
    (token dS, causal dQ scale) are taken per element: the exponent rule is monotone, so the tile
    max of element exponents is the exponent of the tile's amax. square_32 blocks lie on the kernel's
    grid (`row0`, `key0`: y[0, 0]'s doc-local row and key + δ; block edges at doc-local −δ + 32·i on
    both axes), so no block straddles a kernel tile (its amax would need another CTA's dS); the δ
    leading tokens are the previous document's, dS 0 there, so no block mixes two documents. tensor
    and static scales are one constant; an unquantized dS has exponent 0."""
    ds = plan.route.operands.ds
    if not ds.quantized:
        return torch.zeros_like(y)
    if (for_dq and plan.causal_dq) or ds.granularity is Granularity.token:
        return scale_exponent(y.abs(), ds.format, ds.exponent_rule)
    if ds.granularity is Granularity.square_32:
        a = group_amax(y, ds.block, ds.block, row0, key0)
        return scale_exponent(a, ds.format, ds.exponent_rule)
    if ds.granularity is Granularity.tensor:
        return scale_exponent(tensor_amax, ds.format, ds.exponent_rule).expand_as(y)
    if ds.granularity is Granularity.static:
        return torch.full_like(y, -float(ds.static_exponent))
    raise ValueError(f"ds.granularity={ds.granularity.value!r} is not supported by the emulator")


def _round_codes(y: torch.Tensor, spec: OperandQuant) -> torch.Tensor:
    return round_to_format(y, spec.format) if spec.quantized else y


def _visited_key_tiles(plan: Plan, m: int, delta: int, n_kt: int) -> int:
    """How many key tiles (a prefix 0 … c − 1) visit query tile m: the template's `bwd_tiling`, causal
    m_lo(n) = max(n·tile_n, delta) // tile_m ≤ m (non-decreasing in n), non-causal every tile."""
    if not plan.causal:
        return n_kt
    end = (m + 1) * plan.tile_m  # m_lo(n) ≤ m ⇔ max(n·tile_n, delta) < end
    if delta >= end:
        return 0
    return min(n_kt, -(-end // plan.tile_n))


def _tile_max_exponent(plan: Plan, exp: torch.Tensor, start: int, delta: int, n_qt: int, end: int) -> torch.Tensor:
    """(H, n_qt): the largest fold exponent over each query tile's tokens of the document [start, end)
    (exp is (T, H)): the tile starts `delta` tokens before the document and may hold tokens of the
    neighbouring documents, which the kernel leaves out of the dV reference (each key row's R spans its
    own document's queries only: no document's dV depends on another's dO); a NaN scale reads 128.
    Documents the kernel runs inside a backward window (shorter than tile_n: runtime.attn_bwd.bwd_schedule)
    are tiled from the window's start there, not from their own: the emulator keeps per-document tiles, so
    its k-block groupings and running references are not bit-faithful for them (verify's cosine bound
    absorbs it; the document isolation itself is exact in both)."""
    T = exp.shape[0]
    tok = start - delta + torch.arange(n_qt * plan.tile_m, device=exp.device)
    ok = (tok >= start) & (tok < end)
    e = exp[tok.clamp(0, T - 1)]
    e = torch.where(torch.isnan(e), torch.full_like(e, 128.0), e)
    e = torch.where(ok[:, None], e, torch.full_like(e, -127.0))
    return e.view(n_qt, plan.tile_m, -1).amax(dim=1).transpose(0, 1)


def _mm(model: bool, a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """acc + a @ b under the sm90_fp8 model, or in plain fp32 when the product is not an FP8 one."""
    if model:
        return fp8_matmul(a, b, acc)
    out = a @ b
    return out if acc is None else acc + out


def _backward_pass_mma(plan: Plan, bo: BackwardOps, o32, lse2, cu, group, tensor_amax):
    """The backward as the sm90 kernel forms its FP8 products (templates/sm90/attn_bwd.py.j2), under the
    sm90_fp8 accumulation model (numerics.mma); docs/numerics.md §2.4.1.

    Tiles: key tile n holds doc-local keys n·tile_n − δ + [0, tile_n), query tile m rows m·tile_m − δ +
    [0, tile_m), δ = doc_start mod key_align (16 for the FP8 kernel). A unit (document, key tile, KV
    head) visits the KV head's query heads in order and, for each, its query tiles m_lo … m_hi − 1 in
    increasing order; each visit contracts over the tile's tile_m query rows (k-blocks of 32 rows):
    - dV += Pᵀ·dO: A = Pᵀ codes fmt(P·2^(s + edo_i − R)) (s: P's static exponent, R: the unit's running
      max of each visited tile's largest dO exponent over the document's own query rows; a moved R
      rescales the accumulator by 2^(R_old − R_new) first), B = dO codes; dV = acc·2^(R − s).
    - dK += dSᵀ·Q: A = dSᵀ codes fmt(dS·2^eq_i·2^−E_j) (E_j: the key's running max of its per-tile dS
      scale exponents; a moved E rescales that accumulator row), B = Q codes; dK = acc·2^E·scale.
    - dQ: per (query tile, key tile) A = dS codes fmt(dS·2^ek_j·2^−e_i) (e_i: scale exponent of row i
      over the key tile), B = K codes, k-blocks of 32 keys; partial acc·2^e·scale, the key tiles'
      partials added in fp32 in increasing key-tile order.
    dS, P come from `_grad_chunk` (scores and dP under the model too); chunks of query tiles follow
    the kernel's tiles. Diagonal decisions are the forward's (`plan.fwd_tiles`), per element, so a kernel
    tile may mix both copies of V; k_fold's dS·K takes one K copy per (row, key tile), which needs the
    forward's tile_n (route_backward refuses others). Products whose operands are not FP8 codes
    (plan.mma_dv/dk/dq off) use the same structure with exact fp32 sums."""
    T, Hq, D = o32.shape
    Hkv = Hq // group
    dev = o32.device
    tm, tn = plan.tile_m, plan.tile_n
    ops = plan.route.operands
    s_p = float(ops.p.static_exponent) if ops.p.quantized else 0.0
    if ops.p.quantized and ops.p.granularity is not Granularity.static:
        raise ValueError(f"p.granularity={ops.p.granularity.value!r}: the emulator supports 'static' only")
    amax_q = None if tensor_amax is None else tensor_amax[0]
    amax_k = None if tensor_amax is None else tensor_amax[1]
    f32 = dict(dtype=torch.float32, device=dev)
    dq = torch.zeros(T, Hq, D, **f32)
    dk = torch.zeros(T, Hkv, D, **f32)
    dv = torch.zeros(T, Hkv, D, **f32)
    f = bo.fwd
    kvh = torch.arange(Hkv, device=dev)
    for s, e in doc_ranges(cu):
        L = e - s
        delta = s % plan.key_align
        n_kt, n_qt = -(-(L + delta) // tn), -(-(L + delta) // tm)
        kd, vd = f.ks.doc(s, e, kvh), f.v.doc(s, e, kvh)
        kt = f.ks_tok.doc(s, e, kvh) if f.ks_tok else None
        vt = f.v_tok.doc(s, e, kvh) if f.v_tok else None
        kq = bo.kq.doc(s, e, kvh)
        kqt = bo.kq_tok.doc(s, e, kvh) if bo.kq_tok else None
        # the units' registers: accumulators and running references per (KV head, key tile)
        acc_dv = torch.zeros(Hkv, n_kt, tn, D, **f32)
        acc_dk = torch.zeros(Hkv, n_kt, tn, D, **f32)
        ref_dv = torch.full((Hkv, n_kt), -127.0, **f32)
        # dk_bf16: no dK scale group, so the reference stays 0 (the epilogue's 2^E is 1)
        ref_dk = torch.full((Hkv, n_kt * tn), 0.0 if plan.dk_bf16 else -127.0, **f32)
        rows = chunk_rows(plan.chunk, Hkv, L, tm)
        for hh in range(group):  # a unit visits its KV head's query heads in order
            qh = kvh * group + hh
            qd = f.qs.doc(s, e, qh)
            do_r, do_v, qk = bo.do_rows.doc(s, e, qh), bo.do_dv.doc(s, e, qh), bo.qk.doc(s, e, qh)
            od, ld = o32[s:e, qh].transpose(0, 1), lse2[s:e, qh].transpose(0, 1)
            edo_tile = _tile_max_exponent(plan, bo.do_dv.exp[:, qh], s, delta, n_qt, e)
            for a0 in range(0, L + delta, rows):  # chunks of whole kernel query tiles
                a, b = max(a0 - delta, 0), min(a0 + rows - delta, L)
                n = b if plan.causal else L
                g = geometry(plan, a, b, n, L, dev, delta)
                cg = _grad_chunk(plan, _rows(qd, a, b), _cut(kd, n), _cut(kt, n), _cut(vd, n), _cut(vt, n),
                                 _rows(do_r, a, b), od[:, a:b], ld[:, a:b], g)
                kqn, kqtn = _cut(kq, n), _cut(kqt, n)
                ds_q, ds_k = _folds(plan, cg, kqn, kqtn, qk.exp[:, a:b], g)
                # pad to whole tiles: rows from a0 − δ, keys from −δ (zeros: masked or outside the document)
                front = a - (a0 - delta)
                Mp = -(-(front + b - a) // tm) * tm
                Np = -(-(n + delta) // tn) * tn

                def pad(x, value=0.0):  # (H, M, N) → (H, Mp, Np)
                    return torch.nn.functional.pad(x, (delta, Np - n - delta, front, Mp - front - (b - a)),
                                                   value=value)

                def pad_rows(x, value=0.0):  # (H, M, D) → (H, Mp, D)
                    return torch.nn.functional.pad(x, (0, 0, front, Mp - front - (b - a)), value=value)

                def pad_keys(x):  # (H, n, D) → (H, Np, D)
                    return torch.nn.functional.pad(x, (0, 0, delta, Np - n - delta))

                p_pad = pad(cg.p)
                edo = torch.nn.functional.pad(do_v.exp[:, a:b], (front, Mp - front - (b - a)), value=-127.0)
                do_c, q_c = pad_rows(do_v.codes[:, a:b]), pad_rows(qk.codes[:, a:b])
                yk = pad(ds_k)
                ek = None if plan.dk_bf16 else pad(_ds_exponents(plan, ds_k, False, amax_k, a + delta, delta), -127.0)
                yq = pad(ds_q)
                # dq_bf16: no dQ scale group, so no exponents to take
                eq = None if plan.dq_bf16 else pad(_ds_exponents(plan, ds_q, True, amax_q, a + delta, delta), -127.0)
                k_c = pad_keys(kqn.codes)
                kt_c = pad_keys(kqtn.codes) if kqtn is not None and g.diag is not None else None
                diag = pad(g.diag.to(torch.float32)) > 0 if kt_c is not None else None
                for mi in range(Mp // tm):
                    m = a0 // tm + mi
                    nh = _visited_key_tiles(plan, m, delta, n_kt)
                    if nh == 0:
                        continue
                    r, kn = slice(mi * tm, (mi + 1) * tm), nh * tn

                    # dV += Pᵀ·dO, the unit's reference R over its visited tiles' largest dO exponent
                    r_new = edo_tile[:, m:m + 1]
                    R = ref_dv[:, :nh]
                    up = r_new > R
                    acc_dv[:, :nh] *= torch.where(up, _pow2i(R - r_new), torch.ones_like(R))[..., None, None]
                    R = torch.where(up, r_new.expand_as(R), R)
                    ref_dv[:, :nh] = R
                    pf = _pow2i(s_p + edo[:, None, r] - R[:, :, None])  # (H, nh, tm)
                    pt = p_pad[:, r, :kn].reshape(Hkv, tm, nh, tn).permute(0, 2, 3, 1)  # (H, nh, keys, rows)
                    a_dv = _round_codes(pt * pf[:, :, None, :], ops.p).contiguous()
                    acc_dv[:, :nh] = _mm(plan.mma_dv, a_dv, do_c[:, None, r], acc_dv[:, :nh])

                    # dK += dSᵀ·Q, per-key running reference E over the per-tile dS exponents
                    if plan.dk_bf16:  # dS unquantized (fp32 here), Q codes: exact sums, no scale group
                        a_dk = yk[:, r, :kn]
                    else:
                        et = ek[:, r, :kn].amax(dim=1)  # (H, kn)
                        E = ref_dk[:, :kn]
                        up = et > E
                        acc_dk[:, :nh] *= torch.where(up, _pow2i(E - et), torch.ones_like(E)).view(Hkv, nh, tn, 1)
                        E = torch.where(up, et, E)
                        ref_dk[:, :kn] = E
                        a_dk = _round_codes(yk[:, r, :kn] * _pow2i(-E)[:, None, :], ops.ds)
                    a_dk = a_dk.view(Hkv, tm, nh, tn).permute(0, 2, 3, 1).contiguous()
                    acc_dk[:, :nh] = _mm(plan.mma_dk, a_dk, q_c[:, None, r], acc_dk[:, :nh])

                    # dQ partials of the visiting key tiles: per (row, key tile) exponent e, fp32 sum over tiles
                    if plan.dq_bf16:  # dS unquantized (fp32 here), K codes: exact sums, no scale group
                        e_r = torch.zeros(Hkv, tm, nh, **f32)
                        a_dq = yq[:, r, :kn].view(Hkv, tm, nh, tn)
                    else:
                        e_r = eq[:, r, :kn].view(Hkv, tm, nh, tn).amax(dim=-1)  # (H, tm, nh)
                        a_dq = _round_codes(yq[:, r, :kn].view(Hkv, tm, nh, tn) * _pow2i(-e_r)[..., None], ops.ds)
                    a_dq = a_dq.permute(0, 2, 1, 3).contiguous()  # (H, nh, rows, keys)
                    part = _mm(plan.mma_dq, a_dq, k_c[:, :kn].view(Hkv, nh, tn, D))
                    if kt_c is not None:  # K per key on diagonal tiles (k_fold): the row's tile decides
                        part_d = _mm(plan.mma_dq, a_dq, kt_c[:, :kn].view(Hkv, nh, tn, D))
                        dg = diag[r, :kn].view(tm, nh, tn).any(dim=-1).transpose(0, 1)  # (nh, rows)
                        part = torch.where(dg[None, :, :, None], part_d, part)
                    part = part * (_pow2i(e_r) * plan.scale).permute(0, 2, 1)[..., None]
                    acc = part[:, 0]
                    for j in range(1, nh):  # reduce-add of the partials, key tiles in order (exact fp32 adds)
                        acc = acc + part[:, j]
                    lo, hi = max(m * tm - delta, 0), min((m + 1) * tm - delta, L)
                    dq[s + lo:s + hi, qh] = acc[:, lo - (m * tm - delta):hi - (m * tm - delta)].transpose(0, 1)
        # epilogue: dV = acc·2^(R − s), dK = acc·2^E·scale, keys of the document
        keys = slice(delta, delta + L)
        dv_d = (acc_dv * _pow2i(ref_dv - s_p)[..., None, None]).view(Hkv, n_kt * tn, D)[:, keys]
        dk_d = acc_dk.view(Hkv, n_kt * tn, D) * (_pow2i(ref_dk) * plan.scale)[..., None]
        dv[s:e] = dv_d.transpose(0, 1)
        dk[s:e] = dk_d[:, keys].transpose(0, 1)
    return dq, dk, dv


def _sum_groups(x: torch.Tensor, hkv: int, group: int) -> torch.Tensor:
    """(T, Hq, D) per-q-head partials → (T, Hkv, D): GQA sums the heads sharing a kv head."""
    T, _, D = x.shape
    return x.view(T, hkv, group, D).sum(dim=2)
