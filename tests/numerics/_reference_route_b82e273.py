# Frozen copy of flamia_gen/numerics/reference_route.py at commit b82e273 (before the backward's
# FP8 products were put under the sm90_fp8 MMA model), relative imports made absolute. Used only by
# tests/numerics/test_mma_backward.py to check that route_backward(mma="exact") is bitwise unchanged.
# Do not edit; do not import from library code.
"""Emulated kernel numerics of a route, forward and backward (docs/numerics.md).

The emulator is the source of truth the generated kernels are checked against (cosine ≥
0.99999, DESIGN.md §1). It reproduces *what* a route rounds, with which scale and from which
reference, tile by tile, including the forward kernel's key-tile order: P̂ of a key tile is
rounded under the running (integer) max of the tiles visited so far, as the kernel does, which
decides the result where P̂ falls in the format's subnormal range (outlier rows). It does not
reproduce the fp32 summation order, nor the tensor cores' accumulation of the scores, which
decides P̂ roundings that fall within ~2^-12 of a tie (see `verify.attn_gpu`).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_gen.spec.enums import ExponentRule, Format, Granularity
from flamia_gen.spec.route import OperandQuant, Route
from flamia_gen.numerics import formats
from flamia_gen.numerics.exp2 import exp2_poly3, poly_columns, poly_quarters
from flamia_gen.numerics.mma import check_model, fp8_matmul
from flamia_gen.numerics.quantize import Quantized, pow2_exponent, quantize
from flamia_gen.numerics.reference_exact import (check_inputs, chunk_rows, doc_ranges, query_chunks, softmax_scale,
                              visible_mask)

__all__ = ["Rep", "Plan", "make_plan", "represent", "route_forward", "route_backward", "scale_exponent",
           "round_to_format"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_FOLDABLE = (Granularity.token, Granularity.token_block, Granularity.tensor)
_E4M3_TB = OperandQuant(format=Format.e4m3, granularity=Granularity.token_block,
                        exponent_rule=ExponentRule.ceil)


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


def group_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """|x| max over (rows × cols) groups of the last two dims, aligned at 0, expanded back."""
    H, R, C = x.shape
    pr, pc = (-R) % rows, (-C) % cols
    a = torch.nn.functional.pad(x.abs(), (0, pc, 0, pr))
    a = a.view(H, (R + pr) // rows, rows, (C + pc) // cols, cols).amax(dim=(2, 4))
    return a.repeat_interleave(rows, 1).repeat_interleave(cols, 2)[:, :R, :C]


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
    exp_poly_quarters: int = 0  # route exp_approx: columns whose exp2 is the FMA polynomial (numerics.exp2)


def _needs_32(route: Route) -> bool:
    return any(oq.granularity in (Granularity.token_block, Granularity.square_32)
               for _, oq in route.operands.items())


def _fp8_codes(spec: OperandQuant) -> bool:
    """Rep.codes of this operand are FP8 code values (what an FP8 wgmma multiplies)."""
    return spec.quantized and spec.format in (Format.e4m3, Format.e5m2) and spec.granularity in _FOLDABLE


def make_plan(route: Route, causal: bool, tile_m: int, tile_n: int, scale: float, chunk: int = 1024,
              key_align: int = 1, mma: str = "exact") -> Plan:
    if tile_m <= 0 or tile_n <= 0:
        raise ValueError(f"tile_m and tile_n must be positive, got {tile_m}, {tile_n}")
    if _needs_32(route) and (tile_m % 32 or tile_n % 32):
        raise ValueError(f"route {route.name!r} has 32-token blocks: tile_m and tile_n must be multiples "
                         f"of 32 (got {tile_m}, {tile_n}); a block straddling a tile edge would leak")
    if key_align <= 0 or key_align > tile_n:
        raise ValueError(f"key_align must be in [1, tile_n={tile_n}], got {key_align}")
    ops = route.operands
    fp8_mma = check_model(mma) == "sm90_fp8"
    sg = route.forward_safeguards(causal)
    per_key_v = sg.per_key_v
    return Plan(
        route=route, causal=causal, tile_m=tile_m, tile_n=tile_n, scale=scale,
        per_key_k=sg.per_key_k,
        per_key_v=per_key_v,
        causal_rows_q=sg.rows_q,
        causal_rows_do=route.exact and ops.do.granularity is Granularity.token_block,
        causal_dq=route.causal_dq_scale,
        chunk=max(tile_m, (chunk // tile_m) * tile_m), key_align=key_align,
        mma_qk=fp8_mma and _fp8_codes(ops.q) and _fp8_codes(ops.k),
        mma_pv=fp8_mma and _fp8_codes(ops.v) and ops.p.quantized,
        exp_poly_quarters=poly_quarters(route.exp_approx.value))


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
    return ForwardOps(
        qs=represent(q, qspec, cu),
        ks=represent(k, ops.k, cu),
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
        kq=fwd.ks if kspec == ops.k else represent(k, kspec, cu),
        kq_tok=represent(k, _token_spec(kspec), cu) if plan.per_key_k else None,
        qk=represent(q, _product_spec(ops.q), cu))


# ---- tile geometry of one query chunk


@dataclass(frozen=True)
class Geometry:
    visible: torch.Tensor  # (M, N) bool
    empty: torch.Tensor  # (M,) bool: no visible key
    diag: torch.Tensor | None  # (M, N) bool: (query tile, key tile) is a diagonal tile


def geometry(plan: Plan, a: int, b: int, n: int, length: int, device, delta: int = 0) -> Geometry:
    """Diagonal tiles are the forward kernel's masked key tiles: with key tiles starting `delta`
    keys before the document (key tile of key j: (j + delta) // tile_n), those from the tile
    holding the query tile's first row on (`n_mask` of the template's `key_tiling`). Every key
    a 32-token block could share with a later position of a query tile lies in them."""
    vis = visible_mask(a, b - a, n, plan.causal, device)
    diag = None
    if plan.causal and (plan.per_key_k or plan.per_key_v):
        i = torch.arange(a, b, device=device)[:, None]
        j = torch.arange(n, device=device)[None, :]
        first_row = (i // plan.tile_m) * plan.tile_m
        diag = (j + delta) // plan.tile_n >= (first_row + delta) // plan.tile_n
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


def _qk(plan: Plan, qr: Rep, kr: Rep) -> torch.Tensor:
    if not plan.mma_qk:
        return qr.value @ kr.value.transpose(-1, -2)
    return fp8_matmul(qr.codes, kr.codes.transpose(-1, -2)) * torch.exp2(qr.exp[..., None] + kr.exp[:, None, :])


def scores_log2(plan: Plan, qr: Rep, kd: Rep, kt: Rep | None, g: Geometry):
    """x = scale·log2(e)·Q̂K̂ᵀ (fp32), -inf where masked; K per key on diagonal tiles."""
    s = _qk(plan, qr, kd)
    if kt is not None and g.diag is not None:
        s = torch.where(g.diag, _qk(plan, qr, kt), s)
    x = s * (plan.scale * LOG2E)
    return x.masked_fill(~g.visible, float("-inf"))


# ---- forward


def tile_visit_rank(plan: Plan, rows: torch.Tensor, length: int, delta: int, n_tiles: int) -> torch.Tensor:
    """(M, n_tiles) int64: the order in which the forward kernel visits key tiles for each query
    row (rank 0 first; tiles it never visits rank last). Key tile t holds doc-local keys
    t·tile_n − delta + [0, tile_n). Order (templates/sm90/attn_fwd.py.j2 `key_tiling`):
    nblk−1 … n_mask (tiles needing a mask, diagonal first), then tile 0 when it opens with
    `delta` keys of the previous document, then n_mask−1 … n_lo."""
    tm, tn = plan.tile_m, plan.tile_n
    mblk = (rows // tm)[:, None]
    last = torch.clamp((mblk + 1) * tm, max=length) if plan.causal else torch.full_like(mblk, length)
    nblk = (last + delta + tn - 1) // tn
    n_mask = torch.minimum((mblk * tm + delta) // tn, nblk - 1) if plan.causal else nblk - 1
    n_lo = torch.clamp(n_mask, max=min(delta, 1))
    t = torch.arange(n_tiles, device=rows.device)[None, :]
    rank = torch.where(t >= n_mask, nblk - 1 - t,
                       torch.where((t == 0) & (n_lo == 1), nblk - n_mask, nblk - 1 + n_lo - t))
    return torch.where(t >= nblk, n_tiles + t, rank)


def running_tile_max(plan: Plan, y: torch.Tensor, a: int, length: int, delta: int):
    """The kernel's integer reference per (row, key tile): ceil(max of y over the tiles visited
    up to and including that tile), -inf before the first visible key (y is -inf there too).
    Returns (H, M, n_tiles) maxima, (N,) key → tile, (M, n_tiles) visit order (tile ids)."""
    H, M, N = y.shape
    tn = plan.tile_n
    n_tiles = (N + delta + tn - 1) // tn
    tiles = torch.nn.functional.pad(y, (delta, n_tiles * tn - N - delta), value=float("-inf"))
    tile_max = tiles.view(H, M, n_tiles, tn).amax(dim=-1)
    rows = torch.arange(a, a + M, device=y.device)
    order = tile_visit_rank(plan, rows, length, delta, n_tiles).argsort(dim=1)
    ordh = order[None].expand(H, M, n_tiles)
    run = torch.empty_like(tile_max).scatter_(2, ordh, tile_max.gather(2, ordh).cummax(dim=2).values)
    key_tile = (torch.arange(N, device=y.device) + delta) // tn
    return torch.ceil(run), key_tile, order


def _pv_in_visit_order(plan: Plan, p_codes, v_codes, run, order, delta, v_codes_diag=None, diag=None):
    """Σ P̂·V (codes) as the kernel accumulates it: per query tile, key tiles in visit order,
    the accumulator rescaled by 2^(m_old − m_new) (exact) before each tile's FP8 wgmma, k-blocks
    of 32 keys under the sm90_fp8 model. Returns the sum under each row's final reference.
    `v_codes_diag`, `diag` (M, N): per-key V codes on the diagonal tiles (one pattern per query
    tile: the kernel loads the per-token Vᵀ copy for a whole key tile)."""
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
    for r0 in range(0, M, tm):
        Vr = V if v_codes_diag is None else torch.where(Dg[r0][None, :, None], Vd, V)
        r1 = min(M, r0 + tm)
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


def _forward_chunk(plan: Plan, qr: Rep, kd, kt, vd, vt, g: Geometry, a: int = 0, length: int = 0, delta: int = 0):
    """O and LSE of one query chunk. P̂ = q(exp2(x + e_v − m)), m = ceil(max visible x + e_v):
    V's scale folds into P̂ (per key), m is an integer so a kernel's running max rescales by a
    power of two; the denominator l = Σ exp2(x − max x) is fp32, unquantized. A quantized P̂
    is rounded under the kernel's running max m_t of the tiles visited so far and carried to
    the final m exactly (× 2^(m_t − m)): the same value unless it is subnormal under m."""
    x = scores_log2(plan, qr, kd, kt, g)
    ev = _pick(g.diag if vt is not None else None, vd.exp[:, None, :], vt.exp[:, None, :] if vt else None)
    y = torch.where(g.visible, x + ev, torch.full_like(x, float("-inf")))
    empty = g.empty[None, :]
    m = torch.where(empty, 0.0, torch.ceil(y.amax(dim=-1)))
    mx = torch.where(empty, 0.0, x.amax(dim=-1))
    pq = plan.route.operands.p
    poly = None
    if plan.exp_poly_quarters:
        poly = poly_columns(y.shape[-1], delta, plan.tile_n, plan.exp_poly_quarters, y.device)
    if pq.quantized or poly is not None:
        run, key_tile, order = running_tile_max(plan, y, a, length, delta)
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
    if plan.mma_pv:
        # codes = P̂·2^static_exponent (E4M3 values); the kernel's accumulator ends under m
        p_scale = float(2.0 ** pq.static_exponent)
        split = vt is not None and g.diag is not None
        acc = _pv_in_visit_order(plan, p_t * p_scale, vd.codes, run, order, delta,
                                 vt.codes if split else None, g.diag if split else None) / p_scale
    else:  # P̂ carried from its running reference to the final m (exact powers of two)
        p_hat = torch.exp2(y - m[..., None]) if p_t is None else p_t * torch.exp2(mt - m[..., None])
        acc = _split_matmul(p_hat, vd.codes, vt.codes if vt else None, g.diag if vt else None)
    o = acc * (torch.exp2(m - mx) / torch.where(empty, 1.0, l))[..., None]
    o = torch.where(empty[..., None], 0.0, o)
    lse = torch.where(empty, float("inf"), (mx + torch.log2(l)) * LN2)
    return o, lse


def route_forward(route: Route, q, k, v, cu_seqlens, causal=True, *, tile_m=128, tile_n=128, scale=None,
                  key_align=1, mma="exact"):
    """Emulated forward: (O (T, Hq, D) fp32, LSE (T, Hq) fp32, natural log). `key_align`: the
    kernel's key tiles start at the document start rounded down to a multiple of it (16 for
    the sm90 FP8 forward, whose Vᵀ TMA needs 16-byte-aligned key coordinates). `mma`: the
    tensor-core accumulation model of the products (numerics.mma; "sm90_fp8" is slow, for
    checking a Hopper kernel)."""
    T, Hq, D, group = check_inputs(q, k, v, cu_seqlens)
    plan = make_plan(route, causal, tile_m, tile_n, softmax_scale(D, scale), key_align=key_align, mma=mma)
    f = prepare_forward(plan, q, k, v, cu_seqlens)
    heads = torch.arange(Hq, device=q.device) // group
    qheads = torch.arange(Hq, device=q.device)
    o = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, Hq), float("inf"), dtype=torch.float32, device=q.device)
    for s, e in doc_ranges(cu_seqlens):
        qd, kd, vd = f.qs.doc(s, e, qheads), f.ks.doc(s, e, heads), f.v.doc(s, e, heads)
        kt = f.ks_tok.doc(s, e, heads) if f.ks_tok else None
        vt = f.v_tok.doc(s, e, heads) if f.v_tok else None
        for a, b in query_chunks(e - s, chunk_rows(plan.chunk, Hq, e - s, plan.tile_m)):
            n = b if causal else e - s
            g = geometry(plan, a, b, n, e - s, q.device, s % plan.key_align)
            oc, lc = _forward_chunk(plan, _rows(qd, a, b), _cut(kd, n), _cut(kt, n), _cut(vd, n),
                                    _cut(vt, n), g, a, e - s, s % plan.key_align)
            o[s + a:s + b] = oc.transpose(0, 1)
            lse[s + a:s + b] = lc.transpose(0, 1)
    return o, lse


def _rows(r: Rep, a: int, b: int) -> Rep:
    return Rep(r.value[:, a:b], r.codes[:, a:b], r.exp[:, a:b])


def _cut(r: Rep | None, n: int) -> Rep | None:
    return None if r is None else Rep(r.value[:, :n], r.codes[:, :n], r.exp[:, :n])


# ---- backward


@dataclass(frozen=True)
class _ChunkGrad:
    ds: torch.Tensor  # (H, M, N) dS (masked entries exactly 0), before the softmax scale
    p: torch.Tensor  # (H, M, N) P = exp2(x − LSE₂)


def _grad_chunk(plan: Plan, qr: Rep, kd, kt, vd, vt, do_r, oc, lse2, g: Geometry) -> _ChunkGrad:
    """Recompute P from the forward's operands and decisions; dS = P ∘ (dO·V̂ᵀ − D)."""
    x = scores_log2(plan, qr, kd, kt, g)
    p = torch.exp2(x - lse2[..., None])
    dp = do_r @ vd.value.transpose(-1, -2)
    if vt is not None and g.diag is not None:
        dp = torch.where(g.diag, do_r @ vt.value.transpose(-1, -2), dp)
    dvec = (do_r * oc).sum(dim=-1)  # D from the same dO representation as dP (FLAMIA §3.3)
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
                   scale=None, mma="exact", key_align=1):
    """Emulated backward → (dQ, dK, dV) fp32, shapes of q, k, v. `mma="sm90_fp8"` recomputes the
    scores QKᵀ under the FP8 tensor-core model (the other products stay exact sums). `tile_m`,
    `tile_n`, `key_align`: the *forward's* tiling, whose diagonal decisions the backward repeats."""
    T, Hq, D, group = check_inputs(q, k, v, cu_seqlens)
    plan = make_plan(route, causal, tile_m, tile_n, softmax_scale(D, scale), mma=mma, key_align=key_align)
    bo = prepare_backward(plan, q, k, v, do, cu_seqlens)
    o32 = o.to(torch.float32)
    lse2 = lse.to(torch.float32) * LOG2E
    tensor_amax = None
    ds = route.operands.ds
    if ds.quantized and ds.granularity is Granularity.tensor:
        tensor_amax = _backward_pass(plan, bo, o32, lse2, cu_seqlens, group, None, amax_only=True)
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
                             do_r.value[:, a:b], od[:, a:b], ld[:, a:b], g)
            ds_q, ds_k = _folds(plan, cg, _cut(kq, n), _cut(kqt, n), qk.exp[:, a:b], g)
            if amax_only:
                amax = torch.maximum(amax, torch.stack([ds_q.abs().amax(), ds_k.abs().amax()]))
                continue
            dsq_hat = quant_ds(plan, ds_q, True, None if tensor_amax is None else tensor_amax[0])
            dsk_hat = quant_ds(plan, ds_k, False, None if tensor_amax is None else tensor_amax[1])
            dq_c = _split_matmul(dsq_hat, kq.codes[:, :n], kqt.codes[:, :n] if kqt else None,
                                 g.diag if kqt else None)
            dq[s + a:s + b] = (dq_c * plan.scale).transpose(0, 1)
            dk[s:s + n] += (dsk_hat.transpose(-1, -2) @ qk.codes[:, a:b] * plan.scale).transpose(0, 1)
            p_hat = quant_p(cg.p, plan.route.operands.p)
            dv[s:s + n] += (p_hat.transpose(-1, -2) @ do_v.value[:, a:b]).transpose(0, 1)
    if amax_only:
        return amax
    return dq, _sum_groups(dk, Hkv, group), _sum_groups(dv, Hkv, group)


def _sum_groups(x: torch.Tensor, hkv: int, group: int) -> torch.Tensor:
    """(T, Hq, D) per-q-head partials → (T, Hkv, D): GQA sums the heads sharing a kv head."""
    T, _, D = x.shape
    return x.view(T, hkv, group, D).sum(dim=2)
