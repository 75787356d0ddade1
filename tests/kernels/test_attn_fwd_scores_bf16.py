"""fp8_token_bf16qk on the sm90 forward: the qk_bf16 mode (BF16 QKᵀ wgmma, FP8 PV) on the BF16 inputs
themselves (qk_tensor_scale = 1), and P̂ under the running fp32 max (p_reference exact: no ceil).

COMPILED, NOT RUN on a GPU (2026-12-01: the session had no device time), so the family in specs/ does
not list the route yet: the variants here come from the family with its routes replaced. CPU only,
except the `compile` tests (sm_90a cross-compile).
"""

from __future__ import annotations

import pytest
import torch

from flamia_gen.plan.feasibility import SMEM_LIMIT, attn_smem_bytes, qk_smem_bytes
from flamia_gen.render.render import render_variant
from flamia_gen.runtime.attention import assemble_forward_inputs
from flamia_gen.runtime.attn_fwd import fwd_mode
from flamia_gen.spec import Arch, load_specs

from test_attn_fwd_nvfp4 import _family_variants
from test_attn_fwd_template import _literals

ROUTE = "fp8_token_bf16qk"
VARIANTS = _family_variants([ROUTE])
TWINS = {v.name: v for v in _family_variants(["nvfp4_mixed", "fp8_token"])}


def _twin(v, route):
    return TWINS[v.name.replace(ROUTE, route)]


def test_shipped_and_expands_like_nvfp4_mixed():
    assert ROUTE in load_specs().families["attn_fwd_sm90"].routes  # since its first H200 run (2026-12-01)
    assert {(v.param("tile_m"), v.param("tile_n")) for v in VARIANTS} == \
        {(v.param("tile_m"), v.param("tile_n")) for v in _family_variants(["nvfp4_mixed"])}
    for v in VARIANTS:
        p = dict(v.params)
        assert p["scores_bf16"] is True and p["p_reference"] == "exact" and p["q_fmt"] == "e4m3"
        assert not p["diag_k"] and not p["diag_v"] and not p["rows_q"]  # per-token V: no diagonal copies
        assert qk_smem_bytes(Arch.sm90, p, 1) == 2  # BF16 Q, K tiles
        assert attn_smem_bytes(p, 1, 2) <= SMEM_LIMIT[Arch.sm90]
    # the other routes' variants carry neither key (their names, params and renders are unchanged)
    assert all("scores_bf16" not in dict(v.params) and "p_reference" not in dict(v.params) for v in TWINS.values())


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_render_is_the_qk_bf16_mode_with_the_exact_max(v):
    src = render_variant(v)
    assert render_variant(v) == src
    lit = _literals(src)
    args = [(a["name"], a["dtype"]) for a in lit["ARGS"]]
    assert args[:4] == [("q", "bfloat16"), ("k", "bfloat16"), ("v_t", "float8_e4m3fn"), ("v_scale", "uint8")]
    assert ("qk_tensor_scale", "float32") in args and fwd_mode(lit["ARGS"]) == "qk_bf16"
    assert "m_new = fmax2(row_max[rh], quad_max(mx[rh]))" in src and "ceil_f32(quad_max" not in src
    name = v.name.replace(ROUTE, "nvfp4_mixed")
    # causal nvfp4_mixed keeps tile_n 128 only (plan.feasibility.BWD_KEY_TILE_SM90: its backward repeats the forward's
    # diagonal decisions on 128-key tiles); the same tiles' non-causal twin carries the same reference
    tv = TWINS.get(name) or TWINS[name + "_noncausal"]
    twin = render_variant(tv)
    if ("EX2_RING_BAR0" in twin) != ("EX2_RING_BAR0" in src):
        # the ex2 turns (a speed choice, on for nvfp4_mixed and for the BF16-QKᵀ mode at D = 64 since 2026-12-03,
        # off for this route at D = 128): compare the twin rendered with this variant's setting
        from flamia_gen.render.render import render_with_flags

        twin = render_with_flags(tv, ex2_ring="EX2_RING_BAR0" in src)
    assert "ceil_f32(quad_max" in twin
    if not v.param("causal"):  # (causal: nvfp4_mixed's token-block V adds the diagonal per-key copies)
        # the kernel body is nvfp4_mixed's except for the reference and its comments
        body = lambda s: s[s.index("class AttnFwdSm90"):]  # noqa: E731
        diff = [ln for ln in set(body(src).splitlines()) ^ set(body(twin).splitlines())]
        assert diff and all("m_new = fmax2(row_max[rh]" in ln or "scale_o[rh] = ex2(row_max[rh] - mu)" in ln
                            for ln in diff), diff


def test_runtime_passes_the_bf16_inputs_and_a_unit_tensor_scale():
    v = VARIANTS[0]
    q = torch.randn(40, 4, 128).to(torch.bfloat16)
    k = torch.randn(40, 2, 128).to(torch.bfloat16)
    vv = torch.randn(40, 2, 128).to(torch.bfloat16)
    asked = []

    def quant(x, op, per_token):
        asked.append((op, per_token))
        t = x.shape[0]
        return dict(codes=torch.zeros_like(x, dtype=torch.uint8), codes_t=torch.zeros(x.shape[1], 128, 48, dtype=torch.uint8),
                    scales=torch.zeros(t, x.shape[1], dtype=torch.uint8))

    ins = assemble_forward_inputs(dict(v.params), q, k, vv, quant)
    assert asked == [("v", False)]  # Q, K are not quantized for the forward
    assert ins["q"] is q or torch.equal(ins["q"], q)
    assert torch.equal(ins["k"], k) and torch.equal(ins["qk_tensor_scale"], torch.ones(1))
    assert set(ins) == {"q", "k", "qk_tensor_scale", "v", "v_scale"}


@pytest.mark.compile
@pytest.mark.parametrize("causal", [True, False])
def test_compile_variant(compile_sm90, causal):
    v = next(x for x in VARIANTS if x.param("causal") == causal and not x.param("intra_wg_overlap")
             and x.param("tile_m") == 128 and x.param("tile_n") == 128)
    ptx = compile_sm90(v)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx  # QKᵀ on the BF16 inputs
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # PV, P̂ E4M3 from registers
    assert "cvt.rpi.ftz.f32.f32" not in ptx  # no ceil of the running max


def test_fp8_pv_forward_is_the_same_kernel():
    """fp8_pv (BF16 Q, K; FP8 PV; P̂ exact) takes the same forward as fp8_token_bf16qk: the renders differ
    in names, route and the q/k fields of PARAMS only (its q, k are never quantized)."""
    pv = {v.name.replace("fp8_pv", ROUTE): v for v in _family_variants(["fp8_pv"])}
    assert set(pv) == {v.name for v in VARIANTS}
    for v in VARIANTS:
        a, b = render_variant(v).splitlines(), render_variant(pv[v.name]).splitlines()
        diff = [(x, y) for x, y in zip(a, b) if x != y]
        assert len(a) == len(b) and diff
        for x, y in diff:
            assert x.replace(ROUTE, "fp8_pv") == y or any(t in x for t in ('"q_fmt"', '"q_gran"', '"k_fmt"', '"k_gran"',
                                                                               '"spec_hash"', "(spec ")), (x, y)
    p = dict(next(iter(pv.values())).params)
    ins = assemble_forward_inputs(p, torch.zeros(8, 2, 128, dtype=torch.bfloat16), torch.zeros(8, 1, 128, dtype=torch.bfloat16),
                                  torch.zeros(8, 1, 128, dtype=torch.bfloat16),
                                  lambda x, op, t: dict(codes_t=torch.zeros(1, 128, 16, dtype=torch.uint8),
                                                        scales=torch.zeros(8, 1, dtype=torch.uint8)))
    assert ins["q"].dtype == torch.bfloat16 and torch.equal(ins["qk_tensor_scale"], torch.ones(1))
