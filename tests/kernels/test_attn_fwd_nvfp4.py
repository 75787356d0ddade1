"""nvfp4_mixed on the sm90 forward (a numerics path, DESIGN.md §3): Q, K in NVFP4, the rest FP8.

Hopper has no FP4 tensor cores: QKᵀ runs as a BF16 wgmma on Q, K dequantized to BF16
code·block-scale (exact), their fp32 tensor scales reach the kernel as one device scalar
(`qk_tensor_scale`) that joins the softmax scale, and everything from S on is the FP8 route's
path (per-key V exponents folded into P̂, Vᵀ E4M3 K-major, per-key V copies on diagonal tiles).

specs/kernels/attn_fwd_sm90.yaml lists the route since 2026-11-29 (verified on the H200: O vs the
emulator cosine ≥ 0.99999997); the variants here come from the family with its routes narrowed.
CPU only, except the `compile` tests (sm_90a cross-compile).
"""

from __future__ import annotations

import ast
import difflib
import math
import re

import pytest
import torch

from flamia_gen.numerics import formats as F
from flamia_gen.numerics import quantize
from flamia_gen.plan.feasibility import SMEM_LIMIT, attn_smem_bytes, check_attn, qk_smem_bytes
from flamia_gen.plan.variants import expand_family
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.runtime.attn_fwd import diag_inputs_needed, fwd_mode, num_work, run_attn_fwd
from flamia_gen.runtime.nvfp4 import E2M1_VALUES, dequantize_bf16, mixed_qk_inputs
from flamia_gen.spec import Arch, get_route, load_specs
from flamia_gen.spec.enums import Granularity

from test_attn_fwd_template import _fp8_inputs, _key_tiling_fn, _literals, _tile_order

ROUTE = "nvfp4_mixed"
TAIL = ["cu_seqlens", "row_doc", "work", "unit_counter", "softmax_scale", "o", "lse"]  # unit_counter: fwd_dynamic


def _family_variants(routes, head_dim=128):
    """The sm90 forward family of the shipped specs, its routes replaced by `routes`, at one head dim
    (D = 64 renders the same code at other sizes: the diff tests below pin D = 128)."""
    specs = load_specs()
    fam = specs.families["attn_fwd_sm90"]
    return [v for v in expand_family(fam.model_copy(update={"routes": list(routes)}), specs).variants
            if v.param("head_dim") == head_dim]


def _shipped_routes():
    return load_specs().families["attn_fwd_sm90"].routes


MIXED = [v for v in _family_variants([ROUTE])]
_OTHERS = {v.name: v for v in _family_variants(["mxfp8", "fp8_token"])}


def _by(causal=True, ovl=False, m=128, n=128):
    return next(v for v in MIXED if v.param("causal") == causal and v.param("intra_wg_overlap") == ovl
                and v.param("tile_m") == m and v.param("tile_n") == n)


def _twin(v, route):
    return _OTHERS[v.name.replace(ROUTE, route)]


# ----------------------------------------------------------------------------- variants and render
def test_route_shipped_and_variants_expand():
    """The spec lists the route (shipped after the H200 verify and tune); the family expands it to
    the same tile points as the FP8 routes, per-key V on causal."""
    assert ROUTE in _shipped_routes()
    # causal variants (per-key V on the diagonal) keep tile_n 128 only: the sm90 backward repeats the forward's
    # diagonal decisions on 128-key tiles (plan.feasibility.BWD_KEY_TILE_SM90)
    assert len(MIXED) == 7
    assert len(_family_variants([ROUTE], head_dim=64)) == 8  # D = 64 also fits m192n192 (non-causal)
    assert not any(v.param("causal") and v.param("tile_n") != 128 for v in MIXED)
    assert {(v.param("tile_m"), v.param("tile_n")) for v in MIXED} == {(128, 128), (128, 192), (192, 128)}
    sg = get_route(ROUTE).forward_safeguards
    assert tuple(sg(True)) == (False, True, False) and tuple(sg(False)) == (False, False, False)
    for v in MIXED:
        assert v.param("q_fmt") == v.param("k_fmt") == "e2m1" and v.param("v_fmt") == "e4m3"
        assert v.param("diag_v") == v.param("causal") and not v.param("diag_k") and not v.param("rows_q")
    # the twins the diff tests compare against exist for every point
    assert all(_twin(v, "mxfp8") and _twin(v, "fp8_token") for v in MIXED)


@pytest.mark.parametrize("v", MIXED, ids=lambda v: v.name)
def test_render_deterministic_parses_and_args(v):
    a, b = render_variant(v), render_variant(v)
    assert a == b
    ast.parse(a)
    lit = _literals(a)
    assert lit["NAME"] == v.name and lit["ARCH"] == "sm_90a"
    assert lit["PARAMS"]["q_fmt"] == "e2m1" and lit["PARAMS"]["route"] == ROUTE
    diag = list(diag_inputs_needed(lit["PARAMS"]))
    assert diag == (["v_t_diag", "v_diag_scale"] if v.param("causal") else [])
    names = [x["name"] for x in lit["ARGS"]]
    assert names == ["q", "k", "v_t", "v_scale"] + diag + ["qk_tensor_scale"] + TAIL
    dt = {x["name"]: (x["dtype"], x["shape"]) for x in lit["ARGS"]}
    assert dt["q"] == ("bfloat16", ["T", "HQ", "D"]) and dt["k"] == ("bfloat16", ["T", "HKV", "D"])
    assert dt["v_t"] == ("float8_e4m3fn", ["HKV", "D", "T_PAD"]) and dt["v_scale"] == ("uint8", ["T", "HKV"])
    assert dt["qk_tensor_scale"] == ("float32", ["1"]) and dt["softmax_scale"] == ("float32", [])
    if diag:
        assert dt["v_t_diag"] == dt["v_t"] and dt["v_diag_scale"] == dt["v_scale"]
    assert fwd_mode(lit["ARGS"]) == "qk_bf16"
    assert "KEY_ALIGN = 16" in a and "K_ROW_PERM = False" in a
    assert "self.qk_dtype = BFloat16" in a and "self.v_dtype = Float8E4M3FN" in a
    for tok in ("def load(", "def mma(", "def softmax(", "def epilogue(", "def can_implement(",
                "def _setup_attributes(", "def compile_args("):
        assert tok in a
    _launcher_order_matches_args(a, names)


_PARAM_OF = {"q": "mQ", "k": "mK", "v_t": "mV", "v_scale": "mVs", "v_t_diag": "mVd", "v_diag_scale": "mVds",
             "qk_tensor_scale": "mTs", "cu_seqlens": "mCu", "row_doc": "mRowDoc", "work": "mWork",
             "unit_counter": "mUnitCtr", "softmax_scale": "softmax_scale",
             "o": "mO", "lse": "mLSE"}


def _launcher_order_matches_args(src: str, names: list[str]) -> None:
    """__call__'s parameters and compile_args' fake inputs come in ARGS order (tvm-ffi passes
    the runtime's tensors positionally)."""
    tree = ast.parse(src)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AttnFwdSm90")
    call = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__call__")
    params = [a.arg for a in call.args.args[1:]]
    assert params == [_PARAM_OF[n] for n in names] + ["stream"]
    body = src[src.index("def compile_args("):]
    fakes = []
    for m in re.finditer(r"inputs \+?= \(([^)]*)\)", body):
        fakes += [x.strip() for x in m.group(1).split(",") if x.strip()]
    assert fakes == names[:names.index("cu_seqlens")]


def _render_mode_neutral(v) -> str:
    """The render without the E4M3-QKᵀ mode's speed defaults of 2026-12-02 (k_row_perm, ex2_ring): speed choices,
    not numerics, and the comparisons below are about the Q/K side. The mixed mode never permutes K rows; its ex2
    turns are on since 2026-12-03 (nvfp4_mixed, docs/kernels/attn_fwd.md "The ex2 turns for the BF16-QKᵀ mode"), so
    its mode-neutral render is its render without the turns."""
    return render_with_flags(v, k_row_perm=False, ex2_ring=False)


def _code_lines(v) -> list[str]:
    """Rendered source without the module docstring and comment-only lines, the variant's name
    normalised, stripped: what the diff against another route's render compares."""
    s = _render_mode_neutral(v).replace(v.name, "NAME")
    i = s.index('"""')
    s = s[:i] + s[s.index('"""', i + 3) + 3:]
    return [ln.strip() for ln in s.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _diff(a, b) -> tuple[set, set]:
    rem, add = set(), set()
    for ln in difflib.ndiff(_code_lines(a), _code_lines(b)):
        if ln.startswith("- "):
            rem.add(ln[2:])
        elif ln.startswith("+ "):
            add.add(ln[2:])
    return rem, add


# What the mixed mode changes relative to the FP8 (all-E4M3) render: the Q/K side only.
_PARAM_LINE = re.compile(r'^"(route|q_fmt|q_gran|k_fmt|k_gran|v_gran|spec_hash)": ')
_FP8_ONLY = {
    '{"name": "q", "dtype": "float8_e4m3fn", "shape": ["T", "HQ", "D"], "role": "in"},',
    '{"name": "q_scale", "dtype": "uint8", "shape": ["T", "HQ"], "role": "in"},',
    '{"name": "k", "dtype": "float8_e4m3fn", "shape": ["T", "HKV", "D"], "role": "in"},',
    '{"name": "k_scale", "dtype": "uint8", "shape": ["T", "HKV"], "role": "in"},',
    "self.qk_dtype = Float8E4M3FN",
    "self.sV_layout = make_smem_layout(self.qk_dtype, (d, n), self.stages)",
    "self.bytes_kv = n * d * self.qk_dtype.width // 8",
    "self.p_dtype, self.qk_dtype, warpgroup.OperandMajorMode.K,",
    "sV: cute.struct.Align[cute.struct.MemRange[self.qk_dtype, cute.cosize(sV_layout)], 1024]",
    "consumer_group=consumers, tx_count=self.bytes_kv, defer_sync=True)",
    "mQs: cute.Tensor,", "mKs: cute.Tensor,", "mQs, mKs, mVs,", "mQs: cute.Tensor, mKs: cute.Tensor, mVs: cute.Tensor,",
    "mKs, mVs,", "mQs,", "mKs: cute.Tensor, mVs: cute.Tensor,", "HKV = mKs.shape[1]", "T = mKs.shape[0]",
    "mKs, mVs, sScale, key_base, hkv, T, lane,",
    "mKs: cute.Tensor, mVs: cute.Tensor, sScale: cute.Tensor, key_base: Int32, hkv: Int32, T: Int32,",
    "lane: Int32,",
    # producer: K's per-key exponent (2^ek word) — none for NVFP4 K
    "kcs = cute.make_rmem_tensor(self.tile_n // 32, Int32)", "kcs[j] = Int32(0)", "kcs[j] = Int32(mKs[tok, hkv])",
    "kc = kcs[j]", "sScale[base + scale_word(c, 0)] = bits_f32(Uint32(kc) << Uint32(23))",
    # consumer: Q's per-row exponent, K's per-column factor
    "tok = q0 + tScS[2 * rh][0]", "qc = Int32(0)", "if tok < T:", "qc = Int32(mQs[tok, head])",
    "row_q[rh] = bits_f32(Uint32(qc) << Uint32(23)) * scale_log2",
    "fk = self.load_scales(sScale, base + scale_word(tScS[4 * cg][1], 0), 4)", "ck = fk[cp]", "ev = fk[2 + cp]",
    "y = acc_S[i] * ck * row_q[rh] + ev",
    "q = make_fake_compact_tensor(Float8E4M3FN, (t, hq, 128), stride_order=row_major3, assumed_align=16)",
    "q_scale = make_fake_compact_tensor(Uint8, (t, hq), stride_order=(1, 0), assumed_align=1)",
    "k = make_fake_compact_tensor(Float8E4M3FN, (t, hkv, 128), stride_order=row_major3, assumed_align=16)",
    "k_scale = make_fake_compact_tensor(Uint8, (t, hkv), stride_order=(1, 0), assumed_align=1)",
    "inputs = (q, q_scale, k, k_scale, v_t, v_scale)",
}
_MIXED_ONLY = {
    '{"name": "q", "dtype": "bfloat16", "shape": ["T", "HQ", "D"], "role": "in"},',
    '{"name": "k", "dtype": "bfloat16", "shape": ["T", "HKV", "D"], "role": "in"},',
    '{"name": "qk_tensor_scale", "dtype": "float32", "shape": ["1"], "role": "in"},',
    "self.qk_dtype = BFloat16  # Q, K: NVFP4 code·block-scale (≤ 6 significant bits: exact in BF16)",
    "self.v_dtype = Float8E4M3FN",
    "self.sV_layout = make_smem_layout(self.v_dtype, (d, n), self.stages)",
    "self.bytes_k = n * d * self.qk_dtype.width // 8", "self.bytes_v = n * d * self.v_dtype.width // 8",
    "self.p_dtype, self.v_dtype, warpgroup.OperandMajorMode.K,",
    "sV: cute.struct.Align[cute.struct.MemRange[self.v_dtype, cute.cosize(sV_layout)], 1024]",
    "consumer_group=consumers, tx_count=self.bytes_k, defer_sync=True)",
    "consumer_group=consumers, tx_count=self.bytes_v, defer_sync=True)",
    "mTs: cute.Tensor,", "mVs, mTs,", "mVs: cute.Tensor, mTs: cute.Tensor,", "mVs,", "mTs,", "mVs: cute.Tensor,",
    "HKV = mK.shape[2]", "T = mK.shape[0]", "mVs, sScale, key_base, hkv, T, lane,",
    "mVs: cute.Tensor, sScale: cute.Tensor, key_base: Int32, hkv: Int32, T: Int32, lane: Int32,",
    "qk_scale_log2 = mTs[0] * scale_log2", "row_q[rh] = qk_scale_log2",
    "fv = self.load_scales(sScale, base + scale_word(tScS[4 * cg][1], 1), 2)", "ev = fv[cp]",
    "y = acc_S[i] * row_q[rh] + ev",
    "q = make_fake_compact_tensor(BFloat16, (t, hq, 128), stride_order=row_major3, assumed_align=16)",
    "k = make_fake_compact_tensor(BFloat16, (t, hkv, 128), stride_order=row_major3, assumed_align=16)",
    "inputs = (q, k, v_t, v_scale)",
    "qk_tensor_scale = make_fake_compact_tensor(Float32, (1,), assumed_align=4)", "inputs += (qk_tensor_scale,)",
}
# everything after S: identical source in both modes
_SHARED_AFTER_S = ("convert_p", "rescale_o", "one_tile", "first_tile", "overlap_tile", "last_pv", "epilogue",
                   "load_scales", "gemm", "key_tiling", "key_of_col", "col_of_key", "scale_word", "p_pack")


def _defs(src: str) -> dict:
    tree = ast.parse(src)
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ast.get_source_segment(src, node)
    return out


@pytest.mark.parametrize("v", MIXED, ids=lambda v: v.name)
def test_mixed_render_differs_from_fp8_only_on_the_qk_side(v):
    """Against the mxfp8 render (same V side: token-block E4M3, per-key V on the diagonal) and, where
    there is no diagonal safeguard (non-causal), against fp8_token: exactly the Q/K-side lines differ."""
    twins = [_twin(v, "mxfp8")] + ([_twin(v, "fp8_token")] if not v.param("causal") else [])
    for tw in twins:
        rem, add = _diff(tw, v)
        rem = {x for x in rem if not _PARAM_LINE.match(x)}
        add = {x for x in add if not _PARAM_LINE.match(x)}
        assert rem == _FP8_ONLY, (tw.name, sorted(rem ^ _FP8_ONLY))
        assert add == _MIXED_ONLY, (tw.name, sorted(add ^ _MIXED_ONLY))
        assert render_with_flags(v, k_row_perm=False) == render_variant(v)  # K rows never permuted in the mixed mode
        assert ("EX2_RING_BAR0" in render_variant(v)) is (v.param("compute_warpgroups") >= 2
                                                         and not v.param("intra_wg_overlap"))  # the turns
        mine, theirs = _defs(render_variant(v)), _defs(_render_mode_neutral(tw))
        for fn in _SHARED_AFTER_S:
            assert mine.get(fn) == theirs.get(fn), fn
    # and the render is not the fp8_token one in disguise (the check above can fail)
    assert _diff(_twin(v, "fp8_token"), v) != (set(), set())


@pytest.mark.parametrize("v", [_by(True), _by(False), _by(True, m=192)], ids=lambda v: v.name)
def test_key_tiling_aligned_for_the_fp8_vt(v):
    """Vᵀ is E4M3 (keys contiguous): key tiles start at doc_start rounded down to 16, the leading
    delta keys of the previous document are masked (tile 0 visited with the masked ones)."""
    key_tiling, c = _key_tiling_fn(render_variant(v))
    assert c["KEY_ALIGN"] == 16
    tm, tn = c["TILE_M"], c["TILE_N"]
    for s in (0, 1, 6, 15, 16, 17, 1000, 1300, 4099):
        for L in (1, 2, 64, 127, 128, 129, 300, 1000):
            for mb in range(-(-L // tm)):
                kb, delta, nblk, n_mask, n_lo = key_tiling(mb, s, L)
                assert kb + delta == s and kb % 16 == 0 and delta == s % 16
                order = _tile_order(nblk, n_mask, n_lo)
                assert sorted(order) == list(range(nblk))
                masked = set(range(n_mask, nblk)) | ({0} if n_lo else set())
                first_row = mb * tm
                for n in range(nblk):
                    keys = range(n * tn - delta, (n + 1) * tn - delta)
                    needs = keys[0] < 0 or keys[-1] >= L or (v.param("causal") and keys[-1] > first_row)
                    assert not needs or n in masked, (s, L, mb, n)


@pytest.mark.parametrize("v", [_by(True), _by(True, m=192)], ids=lambda v: v.name)
def test_emulator_diagonal_tiles_and_order_are_the_kernel_ones(v):
    """The emulator (source of truth) calls the kernel's masked tiles diagonal (per-key V there)
    and rounds P̂ in the kernel's tile order."""
    from test_attn_fwd_diag import test_emulator_diagonal_tiles_are_the_kernel_masked_tiles
    from test_attn_fwd_template import test_emulator_visits_key_tiles_in_the_kernel_order

    test_emulator_diagonal_tiles_are_the_kernel_masked_tiles(v)
    test_emulator_visits_key_tiles_in_the_kernel_order(v)


def _smem_struct_bytes(p: dict) -> int:
    """Bytes of the template's SharedStorage for the mixed mode: mbarriers (Q 2, K and V 2·stages
    each, 8 B), sScale (4 fp32 per key per stage, align 16), sO (BF16 rows padded by 16 B, align
    128), sQ, sK BF16 and sV E4M3 (align 1024)."""
    d, m, n, st = p["head_dim"], p["tile_m"], p["tile_n"], p["stages"]
    off = 0
    for size, align in ((8 * (2 + 4 * st), 8), (4 * st * 4 * n, 16), (m * (d + 8) * 2, 128), (m * d * 2, 1024),
                        (st * n * d * 2, 1024), (st * n * d, 1024)):
        off = -(-off // align) * align + size
    return off


def test_smem_estimate_counts_bf16_q_and_k():
    """sm90 stages the mixed route's Q, K as BF16 (2 bytes) and V as E4M3: the plan's estimate must
    count that, or it would keep points that cannot launch."""
    p = dict(_by(False, n=192).params)
    assert qk_smem_bytes(Arch.sm90, p, 1) == 2 and qk_smem_bytes(Arch.sm100, p, 1) == 1
    fp8 = dict(_twin(_by(False, n=192), "mxfp8").params)
    assert qk_smem_bytes(Arch.sm90, fp8, 1) == 1
    assert attn_smem_bytes(fp8, 1) == attn_smem_bytes(fp8, 1, 1)  # other routes: unchanged
    mixed = attn_smem_bytes(p, 1, 2)
    assert mixed - attn_smem_bytes(p, 1) == (p["tile_m"] + p["stages"] * p["tile_n"]) * p["head_dim"]
    assert mixed <= SMEM_LIMIT[Arch.sm90]
    # the template's SharedStorage, field by field with its alignments, at every mixed point
    for v in MIXED:
        vp = dict(v.params)
        assert _smem_struct_bytes(vp) <= attn_smem_bytes(vp, 1, 2) <= SMEM_LIMIT[Arch.sm90], v.name
    # 3 stages at n192: fits counted as all-E4M3 (wrongly), pruned counted right
    p3 = dict(p, stages=3)
    assert attn_smem_bytes(p3, 1) <= SMEM_LIMIT[Arch.sm90]
    ok, why = check_attn(Arch.sm90, 1, p3)
    assert not ok and "shared memory" in why


# ----------------------------------------------------------------------------- NVFP4 → BF16 on the device
def _all_pairs():
    """codes (256, 1, 8): token s holds the 16 E2M1 codes 0..15 in one block; scales (256, 1, 1) = s."""
    byte = torch.tensor([(2 * j) | ((2 * j + 1) << 4) for j in range(8)], dtype=torch.uint8)
    codes = byte.view(1, 1, 8).expand(256, 1, 8).contiguous()
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(256, 1, 1)
    return codes, scales


def test_bf16_holds_every_code_times_block_scale_exactly():
    """E2M1 code (≤ 2 significant bits) × E4M3 scale (≤ 4) has ≤ 6 significant bits: every one of
    the 16 × 254 finite pairs is exact in BF16 (8), through the runtime's dequantization."""
    codes, scales = _all_pairs()
    got = dequantize_bf16(codes, scales).view(256, 16)
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    assert torch.equal(F.decode_e2m1(torch.arange(16, dtype=torch.int32).to(torch.uint8)).double(), e2m1)
    sb = F.decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8)).double()
    exact = sb[:, None] * e2m1[None, :]  # fp64: exact
    finite = torch.isfinite(sb)
    assert int(finite.sum()) == 254  # 0x7F, 0xFF are NaN
    assert torch.equal(got[finite].double(), exact[finite])
    assert torch.isnan(got[~finite].float()).all()
    # significant bits of every nonzero product ≤ 6 (so the claim, not luck, makes it exact)
    nz = exact[finite][exact[finite] != 0].abs()
    mant = nz / torch.exp2(torch.floor(torch.log2(nz)))
    assert torch.equal(mant * 32, torch.round(mant * 32))
    assert nz.min() >= 2.0 ** -10 and nz.max() <= 448 * 6  # deep inside BF16's exponent range
    # negative control: BF16 does lose a 9-bit product, so the comparison above can fail
    nine = torch.tensor([1 + 2.0 ** -8], dtype=torch.float64)
    assert not torch.equal(nine.to(torch.bfloat16).double(), nine)


def _qkv(T=200, H=2, D=128, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    if outliers:
        q[7] *= 300.0
        k[T - 50, 1, 3] = 5e4
        v[3] *= 50.0
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def test_runtime_dequant_and_scale_fold_match_the_emulator_quantize():
    """The kernel's Q, K inputs (runtime.nvfp4) against the emulator's quantize: BF16 equal bit
    for bit to decode(code)·decode(block scale); times the tensor scale, equal bit for bit to the
    emulator's dequantized value (the same single fp32 rounding); qk_tensor_scale = ts_q·ts_k."""
    route = get_route(ROUTE)
    q, k, _ = _qkv()
    cu = torch.tensor([0, 77, 78, 200], dtype=torch.int32)
    qz, kz = quantize(q, route.operands.q, cu), quantize(k, route.operands.k, cu)
    ins = mixed_qk_inputs(*(dict(codes=z.codes, scales=z.scales, tensor_scale=z.tensor_scale) for z in (qz, kz)))
    for name, z, x in (("q", qz, q), ("k", kz, k)):
        got = ins[name]
        assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
        cs = F.decode_e2m1(F.unpack_e2m1(z.codes)).view(*z.scales.shape, 16) * F.decode_e4m3(z.scales)[..., None]
        want = cs.view(x.shape)
        assert torch.equal(got.float(), want)  # exact: no rounding in the BF16 conversion
        assert torch.equal(got, want.to(torch.bfloat16))
        assert torch.equal(got.float() * z.tensor_scale, z.dequantize())
        assert z.tensor_scale.item() != 1.0  # the fold is exercised, not a no-op
    assert ins["qk_tensor_scale"].dtype == torch.float32 and ins["qk_tensor_scale"].shape == (1,)
    assert torch.equal(ins["qk_tensor_scale"], qz.tensor_scale * kz.tensor_scale)


def test_kernel_scores_algebra_matches_the_emulator_scores():
    """What the kernel computes from those inputs, x = (Q̃·K̃ᵀ)·(ts_q·ts_k)·softmax_scale·log2 e,
    is the emulator's scores_log2 (Q̂K̂ᵀ of its dequantized values) to fp32 rounding."""
    from flamia_gen.numerics.reference_route import geometry, make_plan, prepare_forward, scores_log2

    route = get_route(ROUTE)
    q, k, v = _qkv(T=256, outliers=False)
    cu = torch.tensor([0, 256], dtype=torch.int32)
    scale = 1.0 / math.sqrt(128)
    plan = make_plan(route, True, 128, 128, scale, key_align=16, mma="sm90_fp8")
    assert not plan.mma_qk and plan.mma_pv  # QKᵀ is no FP8 product; PV is
    f = prepare_forward(plan, q, k, v, cu)
    g = geometry(plan, 0, 256, 256, 256, "cpu", 0)
    heads = torch.arange(2)
    x_emu = scores_log2(plan, f.qs.doc(0, 256, heads), f.ks.doc(0, 256, heads), None, g)
    qz, kz = quantize(q, route.operands.q, cu), quantize(k, route.operands.k, cu)
    ins = mixed_qk_inputs(*(dict(codes=z.codes, scales=z.scales, tensor_scale=z.tensor_scale) for z in (qz, kz)))
    s = ins["q"].float().transpose(0, 1) @ ins["k"].float().transpose(0, 1).transpose(-1, -2)
    x_ker = s * (ins["qk_tensor_scale"] * (scale * 1.4426950408889634))
    vis = torch.isfinite(x_emu)
    assert bool(vis.any()) and torch.equal(vis, g.visible.expand_as(vis))
    err = (x_ker[vis] - x_emu[vis]).abs().max() / x_emu[vis].abs().max()
    assert err < 1e-5, float(err)


def test_nan_block_propagates_like_the_emulator():
    route = get_route(ROUTE)
    q, _, _ = _qkv(T=32, outliers=False)
    q[5, 1, 40] = float("nan")
    cu = torch.tensor([0, 32], dtype=torch.int32)
    qz = quantize(q, route.operands.q, cu)
    got = dequantize_bf16(qz.codes, qz.scales).float()
    emu = qz.dequantize()
    assert torch.equal(torch.isnan(got), torch.isnan(emu))
    assert torch.isnan(got[5, 1, 32:48]).all() and not torch.isnan(got[5, 1, :32]).any()


def test_dequantize_rejects_bad_layouts():
    codes, scales = _all_pairs()
    with pytest.raises(ValueError, match="uint8"):
        dequantize_bf16(codes.to(torch.int32), scales)
    with pytest.raises(ValueError, match=r"\(T, H, D/2\)"):
        dequantize_bf16(codes, scales[:, :, :0])


# ----------------------------------------------------------------------------- host wrapper
def _mixed_inputs(T=40, HQ=4, HKV=2, D=128, diag=True):
    x = _fp8_inputs(T, HQ, HKV, D)
    ins = dict(q=torch.zeros(T, HQ, D, dtype=torch.bfloat16), k=torch.zeros(T, HKV, D, dtype=torch.bfloat16),
               v=x["v"], v_scale=x["v_scale"], qk_tensor_scale=torch.tensor([0.25], dtype=torch.float32),
               cu_seqlens=x["cu_seqlens"])
    if diag:
        ins["diag"] = dict(v_t_diag=x["v"].clone(), v_diag_scale=torch.full((T, HKV), 3, dtype=torch.uint8))
    return ins


def test_fwd_mode_of_each_kind():
    lit = {r: _literals(render_variant(v))["ARGS"]
           for r, v in (("mixed", _by()), ("fp8", _twin(_by(), "fp8_token")))}
    assert fwd_mode(lit["mixed"]) == "qk_bf16" and fwd_mode(lit["fp8"]) == "fp8"
    bf16 = [{"name": n} for n in ("q", "k", "v", *TAIL)]
    assert fwd_mode(bf16) == "bf16"


@pytest.mark.parametrize("causal", [True, False])
def test_run_attn_fwd_passes_mixed_inputs_in_args_order(causal):
    """A recording fake kernel: BF16 q, k as given, Vᵀ (and its diagonal copy) viewed as E4M3,
    the device scalar qk_tensor_scale as given, softmax_scale the caller's (1/√D by default: the
    tensor scales are folded in the kernel, not on the host)."""
    lit = _literals(render_variant(_by(causal)))
    names = [a["name"] for a in lit["ARGS"]]
    seen = []
    x = _mixed_inputs(diag=causal)
    diag = x.pop("diag", None)
    o, lse = run_attn_fwd(lambda *a: seen.extend(a), lit["ARGS"], x["q"], x["k"], x["v"], v_scale=x["v_scale"],
                          cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], qk_tensor_scale=x["qk_tensor_scale"],
                          diag=diag, poison=True)
    assert len(seen) == len(names)
    got = dict(zip(names, seen))
    assert got["q"] is x["q"] and got["k"] is x["k"] and got["q"].dtype == torch.bfloat16
    assert got["v_t"].dtype == torch.float8_e4m3fn and got["v_t"].shape == (2, 128, 48)
    assert got["v_scale"] is x["v_scale"] and got["qk_tensor_scale"] is x["qk_tensor_scale"]
    assert got["softmax_scale"] == pytest.approx(128 ** -0.5)
    assert got["work"].shape == (num_work(40, 2, lit["PARAMS"]["tile_m"]), 3)
    assert got["o"] is o and got["lse"] is lse and torch.isnan(o.float()).all()
    if causal:
        assert got["v_t_diag"].dtype == torch.float8_e4m3fn and got["v_diag_scale"] is diag["v_diag_scale"]
    run_attn_fwd(lambda *a: seen.__setitem__(slice(None), a), lit["ARGS"], x["q"], x["k"], x["v"],
                 v_scale=x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], softmax_scale=0.5,
                 qk_tensor_scale=x["qk_tensor_scale"], diag=diag)
    assert seen[names.index("softmax_scale")] == 0.5


@pytest.mark.parametrize("mutate, match", [
    (lambda x: x.pop("qk_tensor_scale"), "qk_tensor_scale: expected a torch.Tensor"),
    (lambda x: x.update(qk_tensor_scale=torch.ones(2)), r"qk_tensor_scale: shape \(2,\)"),
    (lambda x: x.update(qk_tensor_scale=torch.ones(1, dtype=torch.float64)), "qk_tensor_scale: dtype"),
    (lambda x: x.update(q=torch.zeros(40, 4, 128, dtype=torch.uint8)), "q: dtype"),
    (lambda x: x.update(k=torch.zeros(40, 2, 128, dtype=torch.float8_e4m3fn)), "k: dtype"),
    (lambda x: x.update(q_scale=torch.zeros(40, 4, dtype=torch.uint8)), "q_scale: nvfp4_mixed takes no"),
    (lambda x: x.update(v=torch.zeros(40, 2, 128, dtype=torch.bfloat16)), "v_t: dtype"),
    (lambda x: x.update(v_scale=None), "v_scale: expected a torch.Tensor"),
    (lambda x: x.pop("diag"), "v_t_diag: required"),
])
def test_run_attn_fwd_mixed_input_checks(mutate, match):
    lit = _literals(render_variant(_by(True)))
    x = _mixed_inputs()
    mutate(x)
    kw = {n: x[n] for n in ("v_scale", "q_scale", "qk_tensor_scale", "diag") if n in x}
    with pytest.raises(ValueError, match=match):
        run_attn_fwd(lambda *a: None, lit["ARGS"], x["q"], x["k"], x["v"], cu_seqlens=x["cu_seqlens"],
                     params=lit["PARAMS"], **kw)


def test_other_modes_refuse_qk_tensor_scale():
    for v in (_twin(_by(), "fp8_token"),):
        lit = _literals(render_variant(v))
        x = _fp8_inputs()
        with pytest.raises(ValueError, match="qk_tensor_scale: only the nvfp4_mixed"):
            run_attn_fwd(lambda *a: None, lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"],
                         x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"],
                         qk_tensor_scale=torch.ones(1))


# ----------------------------------------------------------------------------- the two input paths
def test_verify_kernel_inputs_for_mixed():
    """verify's emulator-made inputs: BF16 Q, K from the route's NVFP4 quantization, Vᵀ token-block
    codes, per-token Vᵀ copies on causal variants only."""
    from flamia_gen.verify.attn_gpu import emulator_options, kernel_inputs

    route = get_route(ROUTE)
    q, k, v = _qkv(T=96)
    cu = torch.tensor([0, 70, 96], dtype=torch.int32)
    for causal in (True, False):
        ins = kernel_inputs(route, q, k, v, cu, dict(_by(causal).params))
        assert set(ins) == {"q", "k", "v", "v_scale", "qk_tensor_scale"} | ({"diag"} if causal else set())
        qz = quantize(q, route.operands.q, cu)
        assert torch.equal(ins["q"], dequantize_bf16(qz.codes, qz.scales))
        vz = quantize(v, route.operands.v, cu)
        assert torch.equal(ins["v"], vz.codes_t) and torch.equal(ins["v_scale"], vz.scales)
        if causal:
            tok = route.operands.v.model_copy(update={"granularity": Granularity.token})
            assert torch.equal(ins["diag"]["v_t_diag"], quantize(v, tok, cu).codes_t)
    opts = emulator_options(dict(_by().params))
    assert opts["key_align"] == 16 and opts["mma"] == "sm90_fp8"


def test_gpu_path_fp8_forward_inputs_equals_the_verify_path(monkeypatch):
    """runtime.attention.fp8_forward_inputs (the op's quantizer launches) on a stand-in bundle whose
    quantizers are the emulator's (the GPU quantizers are bitwise equal to it, tests/kernels/
    test_quant_template.py): the kernel inputs equal verify's, bit for bit."""
    import flamia_gen.runtime.attention as att
    from flamia_gen.verify.attn_gpu import kernel_inputs

    route = get_route(ROUTE)
    q, k, v = _qkv(T=96)
    cu = torch.tensor([0, 70, 96], dtype=torch.int32)
    launched = []

    def fake_pick(root, kind, r, d, causal, profile, op=None, det=False):
        return {"name": f"{r}.{op}", "use": (r, op)}

    def fake_quantize(b, entry, x, cu_, o=None, skip_transposed=False, skip_codes=False):
        r, op = entry["use"]
        assert not skip_transposed and not skip_codes  # fp8_forward_inputs' default: every launch writes all
        launched.append((r, op))
        z = quantize(x, getattr(get_route(r).operands, op), cu_)
        out = dict(codes=z.codes, scales=z.scales)
        if z.tensor_scale is not None:
            out["tensor_scale"] = z.tensor_scale
        if z.codes_t is not None:
            out["codes_t"] = z.codes_t
        return out

    monkeypatch.setattr(att, "_pick_cached", fake_pick)
    monkeypatch.setattr(att, "_quantize", fake_quantize)
    monkeypatch.setattr(att, "token_copy_use", lambda root, r, op, d: ("fp8_token", op))
    bundle = type("B", (), {"root": "/nonexistent"})()
    for causal in (True, False):
        launched.clear()
        fwd = {"params": dict(_by(causal).params)}
        got = att.fp8_forward_inputs(bundle, fwd, ROUTE, q, k, v, cu, None)
        want = kernel_inputs(route, q, k, v, cu, fwd["params"])
        assert set(got) == set(want)
        for n in ("q", "k", "v", "v_scale", "qk_tensor_scale"):
            assert torch.equal(got[n], want[n]), n
        if causal:
            assert all(torch.equal(got["diag"][n], want["diag"][n]) for n in want["diag"])
        assert launched == [(ROUTE, "q"), (ROUTE, "k"), (ROUTE, "v")] + ([("fp8_token", "v")] if causal else [])


# ----------------------------------------------------------------------------- emulator sanity
def test_emulator_nvfp4_mixed_forward_vs_exact_fp32():
    """The source of truth itself: NVFP4 Q, K cost accuracy (paper, B200: O cosine 0.9920), but the
    emulated forward must stay ≥ 0.99 against exact fp32 on Gaussian inputs (verify.cpu's floor)."""
    from flamia_gen.numerics.metrics import cosine
    from flamia_gen.numerics.reference import attention
    from flamia_gen.verify.cpu import expected_o_cosine

    q, k, v = _qkv(T=640, outliers=False, seed=1)
    cu = torch.tensor([0, 300, 301, 640], dtype=torch.int32)
    emu = attention(q, k, v, cu, causal=True, route=ROUTE, key_align=16)
    exact = attention(q, k, v, cu, causal=True, route=None)
    c = float(cosine(emu, exact))
    assert expected_o_cosine(ROUTE) == 0.99
    assert 0.99 <= c < 0.9999, c  # below 0.9999: the quantization is really there


# ----------------------------------------------------------------------------- compile (sm_90a)
@pytest.mark.compile
@pytest.mark.parametrize("causal, ovl", [(True, True), (False, False)])
def test_compile_nvfp4_mixed_variant(compile_sm90, causal, ovl):
    v = _by(causal, ovl)
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx  # QKᵀ on BF16 Q, K
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # PV, P̂ E4M3 from registers
    assert "k32.f32.e4m3.e4m3" not in ptx.replace("m64n128k32.f32.e4m3.e4m3", "")  # no FP8 QKᵀ
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cp.async.bulk.tensor" in ptx
    # one tensor map per TMA source: Q, K, Vᵀ (+ the per-token Vᵀ copy on causal variants)
    assert ptx.count("prefetch.tensormap") >= (4 if causal else 3)
