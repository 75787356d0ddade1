"""fwd_uniform_kv (template flag of templates/sm90/attn_fwd.py.j2; docs/kernels/attn_fwd.md "Uniform K and V factors"):
with tensor-scaled K and V (fp8_tensor) the consumers take 2^ek, ev and 2^(−ev−p) once per unit instead of per column
pair from shared memory. These tests check where the flag is taken and refused, that the softmax passes then load no
per-key factor, and that the per-unit values are the ones the producer writes for every key (same bit formulas)."""

from __future__ import annotations

import pytest

from flamia_gen.bench.fwd_experiments import _uniform_kv_applies, experiment_variants
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.spec import load_specs

VARIANTS = [v for v in make_plan(load_specs()).variants if v.kind.value == "attn_fwd" and v.arch.value == "sm90"]
TENSOR = [v for v in VARIANTS if v.route == "fp8_tensor"]


def _softmax(src: str) -> str:
    i = src.index("    def softmax(")
    return src[i:src.index("\n    def ", i + 1)]


def test_applies_exactly_to_tensor_scaled_k_and_v():
    on = {v.route for v in VARIANTS if _uniform_kv_applies(dict(v.params))}
    assert on == {"fp8_tensor"}
    assert all(_uniform_kv_applies(dict(v.params)) for v in TENSOR)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_default_exactly_where_it_applies(v):
    """On by default for fp8_tensor (since 2026-12-04), absent elsewhere; fwd_uniform_kv=false renders the
    per-key kernel, which differs from the default."""
    src = render_variant(v)
    if v.route == "fp8_tensor":
        assert '"fwd_uniform_kv": True' in src and "kc_u" in src
        assert render_with_flags(v, fwd_uniform_kv=True) == src
        off = render_with_flags(v, fwd_uniform_kv=False, fwd_fused_exp=False)  # fused exp needs uniform factors
        assert off != src and "fwd_uniform_kv" not in off and "kc_u" not in off
        assert "load_scales" in _softmax(off)
    else:
        assert "fwd_uniform_kv" not in src and "kc_u" not in src


@pytest.mark.parametrize("route", ["fp8_token", "mxfp8", "fp8_pv", "bf16", "nvfp4_mixed"])
def test_refused_where_keys_carry_their_own_factors(route):
    v = next(v for v in VARIANTS if v.route == route)
    with pytest.raises(Exception, match="fwd_uniform_kv_needs_e4m3_qk_with_tensor_granularity_k_and_v"):
        render_with_flags(v, fwd_uniform_kv=True)


@pytest.mark.parametrize("v", TENSOR, ids=lambda v: v.name)
def test_softmax_loads_no_per_key_factor(v):
    # the two-rounding exp argument (fwd_fused_exp's own test covers it)
    src = render_with_flags(v, fwd_fused_exp=False)
    compile(src, v.name, "exec")
    assert '"fwd_uniform_kv": True' in src
    sm = _softmax(src)
    assert "load_scales" not in sm and "fk[" not in sm and "fi[" not in sm
    assert "y = acc_S[i] * row_q[rh] + ev" in sm and "ev = row_q[2]" in sm and "inv = row_q[3]" in sm
    assert "row_q = cute.make_rmem_tensor((4,), Float32)" in src
    # 2^ek folded into the row factor; the per-unit values use the producer's bit formulas for every key
    assert "* scale_log2 * ck_u" in src
    # since fwd_ukv_bare_k (default) the producer writes no per-key factor words at all; the formulas are checked
    # against the producer of the kernel before it (the per-key words the per-unit values replace)
    assert "sScale[base + scale_word(" not in src[src.index("    def load_k("):]
    old = render_with_flags(v, fwd_fused_exp=False, fwd_ukv_bare_k=False)
    prod = old[old.index("    def load_k("):]  # the producer's factor words
    assert "bits_f32(Uint32(kc) << Uint32(23))" in prod and "ck_u = bits_f32(Uint32(kc_u) << Uint32(23))" in src
    assert "sScale[base + scale_word(c, 1)] = Float32(vc - 127)" in prod and "row_q[2] = Float32(vc_u - 127)" in src
    p = v.param("p_static_exponent")
    assert f"cutlass.max(Int32({254 - p}) - vc, Int32(1))" in prod
    assert f"cutlass.max(Int32({254 - p}) - vc_u, Int32(1))" in src


def test_experiment_copies():
    tags = [(t, v.name) for t, v in experiment_variants(("noukv",), route="fp8_tensor") if t]
    assert len(tags) == len(TENSOR) and all(n.endswith("_xnoukv") for _, n in tags)
    assert experiment_variants(("noukv",), route="fp8_token") == experiment_variants((), route="fp8_token")


@pytest.mark.compile
def test_compile_uniform_kv(compile_sm90):
    v = next(v for v in TENSOR if v.param("causal") and v.param("head_dim") == 128 and v.param("tile_m") == 192)
    ptx = compile_sm90(v, source=render_variant(v))
    assert "ex2.approx" in ptx
