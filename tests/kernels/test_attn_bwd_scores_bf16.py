"""fp8_token_bf16qk on the sm90 backward: Sᵀ = K·Qᵀ as a BF16 wgmma on the BF16 q, k (route field
scores_bf16), every other product FP8 as fp8_token's (Qᵀ, Kᵀ codes and their per-token factors for dK,
dQ), recomputing the forward's scores exactly (numerics.reference_route).

COMPILED, NOT RUN on a GPU (2026-12-01: no device time), so specs/kernels/attn_bwd_sm90.yaml does not
list the route yet: the variants come from the family with its routes replaced. CPU only, except the
`compile` tests.
"""

from __future__ import annotations

import pytest
import torch

from flamia_gen.plan.feasibility import SMEM_LIMIT, attn_bwd_smem_bytes
from flamia_gen.plan.variants import expand_family
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.runtime.attention import saves_codes
from flamia_gen.runtime.attn_bwd import check_bwd_inputs, is_ds16_spec, is_scores_bf16_spec, run_attn_bwd
from flamia_gen.spec import Arch, load_specs

from test_attn_bwd_template import _fp8_inputs
from test_attn_fwd_template import _literals

ROUTE = "fp8_token_bf16qk"


def _variants(route):
    specs = load_specs()
    fam = specs.families["attn_bwd_sm90"]
    return expand_family(fam.model_copy(update={"routes": [route]}), specs).variants


VARIANTS = _variants(ROUTE)
TWINS = {v.name: v for v in _variants("fp8_token")}


def _sbf16_inputs(T=40, HQ=4, HKV=2, D=128):
    x = _fp8_inputs(T, HQ, HKV, D)
    x.update(q=torch.zeros(T, HQ, D, dtype=torch.bfloat16), k=torch.zeros(T, HKV, D, dtype=torch.bfloat16))
    return x


def test_shipped_and_fits():
    assert ROUTE in load_specs().families["attn_bwd_sm90"].routes  # since its first H200 run (2026-12-01)
    assert not saves_codes(ROUTE)  # the forward quantizes no Q, K: the backward recomputes their codes
    assert len(VARIANTS) == len(TWINS) == 8  # D = 64, 128 × causal or not × deterministic or not
    for v in VARIANTS:
        p = dict(v.params)
        assert p["scores_bf16"] is True
        smem = attn_bwd_smem_bytes(p, 1)
        # + the BF16 K and Q tiles of Sᵀ; − fp8_token's BF16 K̂ tile for dQ (bwd_dq_bf16: this tile's dQ takes the BF16 K)
        assert smem == (attn_bwd_smem_bytes(dict(p, scores_bf16=False), 1) + 128 * p["head_dim"]
                        + 2 * 64 * p["head_dim"] - 2 * 128 * p["head_dim"])
        assert smem <= SMEM_LIMIT[Arch.sm90]


@pytest.mark.parametrize("v", [v for v in VARIANTS if v.param("head_dim") == 128], ids=lambda v: v.name)
def test_render_differs_from_fp8_token_only_in_the_scores(v):
    src = render_variant(v)
    lit = _literals(src)
    dt = {a["name"]: a["dtype"] for a in lit["ARGS"]}
    assert dt["q"] == dt["k"] == "bfloat16" and dt["q_t"] == dt["k_t"] == "float8_e4m3fn"
    assert is_scores_bf16_spec(lit["ARGS"]) and not is_scores_bf16_spec(_literals(render_variant(
        TWINS[v.name.replace(ROUTE, "fp8_token")]))["ARGS"])
    assert "p = ex2(acc_S[i] * qx[cp] - lse2[cp])" in src and "acc_S[i] * kf[rh] * qx[cp]" not in src
    assert "self.gemm(tiled_mma_s, acc_S, tSrK, tSrQ" in src
    assert "vals[4 * j + 2] = scale_log2" in src
    # dK still folds 2^eq (the Qᵀ codes' factor); dQ takes the BF16 k of the scores since 2026-12-04 (bwd_dq_bf16):
    # no 2^ek fold of dS, which the FP8 dQ (the nodq16 copy) keeps
    assert "row_word(tScS[4 * cg][1], 3)" in src and "acc_dP[i] * kf[rh]" not in src
    assert "acc_dP[i] * kf[rh]" in render_with_flags(v, bwd_dq_bf16=False)


def test_runtime_takes_bf16_q_k_and_fp8_rest():
    v = next(v for v in VARIANTS if v.param("head_dim") == 128 and v.param("causal")
             and not dict(v.params).get("deterministic"))
    lit = _literals(render_variant(v))
    x = _sbf16_inputs()
    assert check_bwd_inputs(**x, fp8=True, head_dim=128, scores_bf16=True) == (40, 4, 2, 128)
    with pytest.raises(ValueError, match="q: dtype"):
        check_bwd_inputs(**_fp8_inputs(), fp8=True, scores_bf16=True)  # codes where BF16 q belongs
    with pytest.raises(ValueError, match="needs fp8=True"):
        check_bwd_inputs(**x, fp8=False, scores_bf16=True)
    seen = []
    run_attn_bwd(lambda *a: seen.extend(a), lit["ARGS"], **x, params=lit["PARAMS"])
    by = dict(zip([a["name"] for a in lit["ARGS"]], seen))
    assert by["q"].dtype == by["k"].dtype == torch.bfloat16
    assert by["q_t"].dtype == by["k_t"].dtype == by["v"].dtype == by["do"].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="q: dtype"):  # the FP8 route's codes do not fit this variant
        run_attn_bwd(lambda *a: None, lit["ARGS"], **_fp8_inputs(), params=lit["PARAMS"])


@pytest.mark.compile
@pytest.mark.parametrize("det", [False, True])
def test_compile_variant(compile_sm90, det):
    v = next(v for v in VARIANTS if v.param("head_dim") == 128 and v.param("causal")
             and bool(dict(v.params).get("deterministic")) == det)
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx  # Sᵀ = K·Qᵀ on BF16
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx  # dPᵀ, dQ
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # dV, dK


# ----------------------------------------------------------------------------- fp8_pv (ds16)
PV = _variants("fp8_pv")


def _pv_inputs(T=40, HQ=4, HKV=2, D=128):
    x = _sbf16_inputs(T, HQ, HKV, D)
    for name in ("q_t", "k_t", "q_scale", "k_scale"):
        del x[name]
    return x


def test_fp8_pv_shipped_and_fits():
    assert "fp8_pv" in load_specs().families["attn_bwd_sm90"].routes
    assert not saves_codes("fp8_pv") and len(PV) == 8
    for v in PV:
        p = dict(v.params)
        assert p["scores_bf16"] is True and p["ds_fmt"] == "bf16" and p["q_fmt"] == "bf16" and p["v_fmt"] == "e4m3"
        plain = attn_bwd_smem_bytes(dict(p, scores_bf16=False, ds_fmt="e4m3"), 1)
        # K, Q BF16 instead of K, Kᵀ, Q, Qᵀ codes (same bytes), dS BF16 (twice the bytes), per-query words padded
        # (bwd_row_pad: 4 words per column pair, two stages)
        assert attn_bwd_smem_bytes(p, 1) == plain + 2 * 64 * 128 + 2 * 4 * 4 * 32
        assert attn_bwd_smem_bytes(p, 1) <= SMEM_LIMIT[Arch.sm90]


@pytest.mark.parametrize("v", [v for v in PV if v.param("head_dim") == 128], ids=lambda v: v.name)
def test_fp8_pv_render(v):
    src = render_variant(v)
    lit = _literals(src)
    names = [a["name"] for a in lit["ARGS"]]
    dt = {a["name"]: a["dtype"] for a in lit["ARGS"]}
    assert names[:7] == ["q", "k", "v", "v_scale", "do", "do_t", "do_scale"]
    assert dt["q"] == dt["k"] == "bfloat16" and dt["v"] == dt["do"] == dt["do_t"] == "float8_e4m3fn"
    assert not ({"q_t", "k_t", "q_scale", "k_scale"} & set(names))
    assert is_ds16_spec(lit["ARGS"]) and is_scores_bf16_spec(lit["ARGS"])
    # dS: no amax, no scale; dK and dQ BF16 wgmmas; dS stored before the dK wgmma is issued
    assert "atomic_max" not in src and "ds_exponent(" not in src.split("class AttnBwdSm90")[1]
    assert "self.gemm(tiled_mma_dk, acc_dK, tdKrdS, tdKrQ" in src and "self.convert_bf16(acc_dP, tdKrdS)" in src
    body = src[src.index("    def one_tile("):]
    # the element-wise stores, or (bwd_ds_stsm: the non-deterministic D = 128 tile's default since round 36) stmatrix
    store = "self.store_ds(" if rendered_params(src).get("bwd_ds_stsm") else "dst[i] = rdS[i]"
    assert body.index(store) < body.index("self.gemm(tiled_mma_dk, ")
    assert "fk[rh] = softmax_scale  # dK from BF16 dS" in src
    # the dV side is fp8_token's: P̂ fold, per-key V factor, the dV reference per key row
    assert "self.dv_scale_rows(acc_S, acc_dV" in src and "self.gemm(tiled_mma_dkv, acc_dV, tdVrP" in src


def test_fp8_pv_runtime():
    v = next(v for v in PV if v.param("head_dim") == 128 and v.param("causal") and not dict(v.params).get("deterministic"))
    lit = _literals(render_variant(v))
    x = _pv_inputs()
    assert check_bwd_inputs(**x, fp8=True, head_dim=128, scores_bf16=True, ds16=True) == (40, 4, 2, 128)
    with pytest.raises(ValueError, match="q_t: this variant's dK and dQ are BF16"):
        check_bwd_inputs(**_sbf16_inputs(), fp8=True, scores_bf16=True, ds16=True)
    seen = []
    run_attn_bwd(lambda *a: seen.extend(a), lit["ARGS"], **x, params=lit["PARAMS"])
    by = dict(zip([a["name"] for a in lit["ARGS"]], seen))
    assert len(seen) == len(lit["ARGS"]) and by["q"].dtype == torch.bfloat16
    assert by["do_t"].dtype == by["v"].dtype == torch.float8_e4m3fn


@pytest.mark.compile
def test_compile_fp8_pv_variant(compile_sm90):
    v = next(v for v in PV if v.param("head_dim") == 128 and v.param("causal") and not dict(v.params).get("deterministic"))
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx  # Sᵀ, dQ
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx  # dK (A = dSᵀ from registers)
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in ptx  # dPᵀ
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # dV
    assert "atom.shared.max" not in ptx


@pytest.mark.compile
@pytest.mark.parametrize("route", [ROUTE, "fp8_pv"])
def test_compile_no_wgmma_serialisation(compile_sm90, tmp_path, route):
    """ptxas serialises every wgmma when the consumers run out of registers (C7512: it did for fp8_pv before
    dS went to shared memory ahead of the dK wgmma): read from the SASS of the compiled object (the DSL's own
    compile does not report it; `flamia_gen.bench.sass` counts the wgmmas waited for one by one)."""
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    if missing_tools():
        pytest.skip(missing_tools())
    v = next(v for v in _variants(route) if v.param("head_dim") == 128 and v.param("causal")
             and not dict(v.params).get("deterministic"))
    compile_sm90(v)
    loops = describe(str(tmp_path / f"{v.name}.o"))["loops"]
    assert loops and not any(serialised(lp) for lp in loops), loops
