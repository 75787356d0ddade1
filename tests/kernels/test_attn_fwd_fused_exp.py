"""fwd_fused_exp (template flag of templates/sm90/attn_fwd.py.j2; docs/kernels/attn_fwd.md "One FFMA for the exp
argument"): where no key carries its own offset (the bf16 route; fp8_tensor with fwd_uniform_kv), pass 1 takes the row
max of the raw accumulator and pass 2 computes y − m as one FFMA. These tests check where the flag is taken and
refused, the rendered passes, and on fp32 numbers that the reference m is the same float as the default's while the
exp argument moves by at most the default's extra rounding."""

from __future__ import annotations

import numpy as np
import pytest

from flamia_gen.bench.fwd_experiments import experiment_variants
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.spec import load_specs

VARIANTS = [v for v in make_plan(load_specs()).variants if v.kind.value == "attn_fwd" and v.arch.value == "sm90"]
BF16 = [v for v in VARIANTS if v.route == "bf16"]
TENSOR = [v for v in VARIANTS if v.route == "fp8_tensor"]


def _softmax(src: str) -> str:
    i = src.index("    def softmax(")
    return src[i:src.index("\n    def ", i + 1)]


def _on_by_default(v) -> bool:
    return v.route == "fp8_tensor" or v.param("causal") or v.param("head_dim") == 64 or v.param("intra_wg_overlap")


def test_default_set():
    """On for every fp8_tensor variant and every bf16 one but D = 128 non-causal without the overlap (2026-12-04)."""
    off = {v.name for v in BF16 + TENSOR if not _on_by_default(v)}
    assert off and all(n.startswith("attn_fwd_sm90_bf16_d128_") and n.endswith("_noncausal") and "_ovl_" not in n
                       for n in off)
    assert {v.name for v in BF16 if v.param("head_dim") == 128 and not v.param("causal")
            and not v.param("intra_wg_overlap")} == off
    assert any("_ovl_" in v.name and v.param("head_dim") == 128 and not v.param("causal") and _on_by_default(v)
               for v in BF16)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_default_exactly_where_it_applies(v):
    src = render_variant(v)
    if v.route in ("bf16", "fp8_tensor") and _on_by_default(v):
        assert '"fwd_fused_exp": True' in src and "ffma(acc_S[i], row_q[rh], m_arg[rh])" in src
        assert render_with_flags(v, fwd_fused_exp=True) == src
        off = render_with_flags(v, fwd_fused_exp=False)
        assert off != src and "fwd_fused_exp" not in off and "ffma(" not in off
    else:
        assert "fwd_fused_exp" not in src and "ffma(" not in src
        assert render_with_flags(v, fwd_fused_exp=False) == src


@pytest.mark.parametrize("route", ["fp8_token", "mxfp8", "fp8_pv", "fp8_token_bf16qk", "nvfp4_mixed", "fp8_tensor"])
def test_refused_where_keys_carry_offsets(route):
    """Per-key offsets (ev, 2^ek) make y − m a per-(row, key) FADD anyway; fp8_tensor only with fwd_uniform_kv."""
    v = next(v for v in VARIANTS if v.route == route)
    extra = dict(fwd_uniform_kv=False) if route == "fp8_tensor" else {}
    with pytest.raises(Exception, match="fwd_fused_exp_needs_keys_without_per_key_offsets"):
        render_with_flags(v, fwd_fused_exp=True, **extra)


@pytest.mark.parametrize("v", BF16 + TENSOR, ids=lambda v: v.name)
def test_rendered_passes(v):
    src = render_with_flags(v, fwd_fused_exp=True)
    compile(src, v.name, "exec")
    sm = _softmax(src)
    assert "y = acc_S[i]  # fwd_fused_exp" in sm and "y = acc_S[i] * row_q[rh]" not in sm
    assert "ffma(acc_S[i], row_q[rh], m_arg[rh])" in sm and "acc_S[i] - m_arg[rh]" not in sm
    if v.route == "bf16":
        assert "ymax = quad_max(mx[rh]) * row_q[rh]\n" in sm and "m_arg[rh] = -mu" in sm
    else:
        p = v.param("p_static_exponent")
        assert "ymax = quad_max(mx[rh]) * row_q[rh] + row_q[2]\n" in sm
        assert f"m_arg[rh] = row_q[2] - mu + Float32({p}.0)" in sm
        assert "qc = Int32(127)" in src  # rows past T keep a positive factor: no −inf · 0 in the FFMA
    assert "ceil_f32(ymax)" in sm or "fmax2(row_max[rh], ymax)" in sm


def _f32(x):
    return np.float32(x)


def test_same_reference_max_and_one_rounding_apart():
    """fp32: the default's y = fl(acc·rq + ev) per key, m = ceil(max y), argument fl(y − m'); the flag's
    m from fl(max(acc)·rq + ev) (the same float: rounding is monotone, rq > 0) and argument fl(acc·rq + (ev − m'))
    (an FFMA: one rounding, emulated in float64). The two arguments differ by at most the default's two roundings."""
    rng = np.random.default_rng(7)
    changed = 0
    for trial in range(200):
        acc = (rng.standard_normal(128) * rng.choice([1.0, 30.0, 900.0])).astype(np.float32)
        if trial % 5 == 0:
            acc[rng.integers(0, 128, 9)] = -np.inf  # masked keys
        rq = _f32(2.0 ** rng.integers(-8, 3) * 0.08838834764 * 1.4426950408889634)
        ev = _f32(rng.integers(-6, 7)) if trial % 2 else _f32(0.0)
        p = _f32(8.0)
        y = np.array([_f32(np.float64(a) * np.float64(rq) + np.float64(ev)) for a in acc], dtype=np.float32)
        ymax_default = np.max(y)
        ymax_flag = _f32(np.float64(np.max(acc)) * np.float64(rq) + np.float64(ev))
        assert ymax_default == ymax_flag
        m = np.ceil(ymax_default)
        m_arg = _f32(m - p)
        arg_default = (y - m_arg).astype(np.float32)
        addend = _f32(ev - m + p)  # integers: exact
        arg_flag = np.array([_f32(np.float64(a) * np.float64(rq) + np.float64(addend)) for a in acc], dtype=np.float32)
        fin = np.isfinite(acc)
        assert np.all(np.isneginf(arg_flag[~fin])) and np.all(np.isneginf(arg_default[~fin]))
        # the default rounds twice (y: half an ulp of y; y − m': half an ulp of the argument), the flag once
        bound = 0.5 * np.spacing(np.abs(y[fin])).astype(np.float64) + np.spacing(np.abs(arg_default[fin])).astype(np.float64)
        diff = np.abs(arg_flag[fin].astype(np.float64) - arg_default[fin].astype(np.float64))
        assert np.all(diff <= bound)
        changed += int(np.count_nonzero(diff))
    assert changed > 0  # a change at the last bit, not a no-op (the kernel is not bitwise equal to the default)


def test_experiment_copies():
    for route, variants in (("bf16", BF16), ("fp8_tensor", TENSOR)):
        on = [v for t, v in experiment_variants(("fexp",), route=route) if t]
        off = [v for t, v in experiment_variants(("nofexp",), route=route) if t]
        assert len(on) + len(off) == len(variants)
        assert all(v.name.endswith("_xfexp") for v in on) and all(v.name.endswith("_xnofexp") for v in off)
        assert len(on) == sum(not _on_by_default(v) for v in variants)
    for tag in ("fexp", "nofexp"):
        assert experiment_variants((tag,), route="fp8_token") == experiment_variants((), route="fp8_token")


@pytest.mark.compile
def test_compile_fused_exp(compile_sm90):
    v = next(v for v in BF16 if v.param("causal") and v.param("head_dim") == 128)
    ptx = compile_sm90(v, source=render_variant(v))
    assert "fma.rn.f32" in ptx and "ex2.approx" in ptx
