"""Route fields `scores_bf16` and `p_reference` and the route `fp8_token_bf16qk` (docs/numerics.md §4.1).

The emulator must: take QKᵀ on the BF16 inputs (so the LSE is the exact one to fp32 rounding, where
fp8_token's moves with Q and K's quantization), keep q's and k's E4M3 codes for the dK and dQ
products, round P̂ under the running fp32 max (the dominant P̂ of a row exactly 2^8), stay causally
exact (leakage probe 0), and reach the issue's 8-bit bound (cosine ≥ 0.997 vs fp32 for O, dQ, dK,
dV) on the outlier-token inputs of `verify --device cuda`, where fp8_token cannot (dK 0.65).
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from flamia_gen.numerics.metrics import cosine
from flamia_gen.numerics.probe import leakage_probe
from flamia_gen.numerics.reference import attention, attention_backward
from flamia_gen.numerics.reference_route import make_plan, prepare_backward, prepare_forward
from flamia_gen.spec import get_route, load_specs
from flamia_gen.spec.route import Route
from flamia_gen.verify.attn_gpu import make_docs, make_qkv

ROUTE = "fp8_token_bf16qk"


def _route_dict(**over):
    d = get_route("fp8_token").model_dump(mode="json")
    d.update(name="x", **over)
    return d


# ----------------------------------------------------------------------------- spec
def test_route_fields_and_rules():
    r = get_route(ROUTE)
    assert r.scores_bf16 and r.p_reference.value == "exact" and r.exact
    assert not r.forward_safeguards(True).rows_q  # no Q scale in a BF16 QKᵀ
    with pytest.raises(ValidationError, match="scores_bf16=true: q and k serve only the dK and dQ products"):
        Route.model_validate(_route_dict(scores_bf16=True, operands=dict(
            get_route("nvfp4_mixed").model_dump(mode="json")["operands"])))
    with pytest.raises(ValidationError, match="p_reference='exact' only applies to a quantized p"):
        Route.model_validate(_route_dict(p_reference="exact", operands=dict(
            get_route("bf16").model_dump(mode="json")["operands"])))
    with pytest.raises(ValidationError, match="p_reference"):
        Route.model_validate(_route_dict(p_reference="round"))  # not in the enum


def test_new_fields_leave_other_routes_hashes_alone():
    """Routes that keep the defaults hash as before the fields existed (tuning tables stay valid)."""
    import hashlib
    import json

    specs = load_specs()
    for name in specs.routes:
        r = specs.route(name)
        if r.scores_bf16 or r.p_reference.value != "ceil":
            continue
        d = r.model_dump(mode="json")
        del d["scores_bf16"], d["p_reference"]
        assert r.spec_hash() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16], name
    a = get_route(ROUTE)
    assert a.spec_hash() != Route.model_validate(dict(a.model_dump(mode="json"), p_reference="ceil")).spec_hash()


# ----------------------------------------------------------------------------- emulator
def _inputs(kind, seed=0, hq=4, hkv=2):
    gen = torch.Generator().manual_seed(seed)
    docs = make_docs(kind, gen)
    q, k, v, cu = make_qkv(docs, hq, hkv, 128, kind, gen, "cpu")
    do = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
    return tuple(x.float() for x in (q, k, v, do)) + (cu,)


def test_representations():
    """QKᵀ takes the inputs as they are; dK and dQ take q's and k's per-token E4M3 codes."""
    q, k, v, do, cu = _inputs("gauss")
    plan = make_plan(get_route(ROUTE), True, 64, 128, 0.088)
    assert plan.scores_bf16 and plan.p_exact and not plan.mma_qk
    b = prepare_backward(plan, q, k, v, do, cu)
    assert torch.equal(b.fwd.qs.value, q) and torch.equal(b.fwd.ks.value, k)
    ref = prepare_forward(make_plan(get_route("fp8_token"), True, 64, 128, 0.088), q, k, v, cu)
    assert torch.equal(b.qk.value, ref.qs.value) and torch.equal(b.kq.value, ref.ks.value)
    assert not torch.equal(b.qk.value, q)  # the codes are quantized


def test_lse_is_the_exact_one_and_dominant_p_is_exact():
    q, k, v, do, cu = _inputs("outlier")
    _, lse_x = attention(q, k, v, cu, causal=True, route=None, return_lse=True)
    _, lse_b = attention(q, k, v, cu, causal=True, route=ROUTE, return_lse=True)
    _, lse_t = attention(q, k, v, cu, causal=True, route="fp8_token", return_lse=True)
    fin = torch.isfinite(lse_x)
    err_b = float(((lse_b - lse_x)[fin].abs() / lse_x[fin].abs().clamp_min(1.0)).max())
    err_t = float(((lse_t - lse_x)[fin].abs() / lse_x[fin].abs().clamp_min(1.0)).max())
    assert err_b < 1e-5 < 1e-3 < err_t, (err_b, err_t)
    # one key far above the rest: P̂ of the row is exactly 2^8 · 2^-8 = 1 on it, so O is that key's V
    qq = torch.zeros(2, 1, 128)
    kk = torch.zeros(2, 1, 128)
    qq[1, 0, 0], kk[0, 0, 0] = 8.0, 64.0  # logit of key 0 for query 1: 512 / sqrt(128) ≈ 45
    vv = torch.randn(2, 1, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float()
    cu2 = torch.tensor([0, 2], dtype=torch.int32)
    o_e = attention(qq, kk, vv, cu2, causal=True, route=ROUTE)
    o_c = attention(qq, kk, vv, cu2, causal=True, route=get_route("fp8_token").model_copy(
        update={"scores_bf16": True, "name": "ceil_ref"}))
    v_codes = prepare_forward(make_plan(get_route(ROUTE), True, 64, 128, 0.088), qq, kk, vv, cu2).v.value
    assert float((o_e[1] - v_codes[0]).abs().max()) < 1e-6 * float(v_codes[0].abs().max())
    assert float((o_c[1] - v_codes[0]).abs().max()) > 1e-3 * float(v_codes[0].abs().max())  # ceil: P̂ ∈ (½, 1]


@pytest.mark.parametrize("kind", ["gauss", "outlier"])
def test_reaches_the_8bit_bound_where_fp8_token_cannot(kind):
    """Issue #9's bound (cosine ≥ 0.997 vs fp32) on verify's inputs, forward and backward emulated in
    the sm90 kernels' tiles; fp8_token misses it on outlier tokens (dQ 0.83, dK 0.65: §4.1)."""
    q, k, v, do, cu = _inputs(kind)
    o_x, lse_x = attention(q, k, v, cu, causal=True, route=None, return_lse=True)
    ex = attention_backward(q, k, v, o_x, lse_x, do, cu, True, None)
    got = {}
    for rn in (ROUTE, "fp8_token"):
        o, lse = attention(q, k, v, cu, causal=True, route=rn, return_lse=True, tile_m=128, tile_n=128, key_align=16)
        g = attention_backward(q, k, v, o, lse, do, cu, True, get_route(rn), tile_m=64, tile_n=128, key_align=16)
        got[rn] = [float(cosine(a, b)) for a, b in zip((o, *g), (o_x, *ex))]
    assert min(got[ROUTE]) >= 0.997, got
    assert all(b >= t - 1e-4 for b, t in zip(got[ROUTE], got["fp8_token"])), got
    if kind == "outlier":
        assert min(got["fp8_token"]) < 0.9, got


def test_leakage_probe_is_exactly_zero():
    for outliers in (False, True):
        gen = torch.Generator().manual_seed(3)
        T = 320
        q, k, v, do = (torch.randn(T, 2, 128, generator=gen).to(torch.bfloat16).float() for _ in range(4))
        if outliers:
            for x, f in ((q, 30.0), (k, 30.0), (v, 100.0)):
                x[::37] *= f
        cu = torch.tensor([0, 200, T], dtype=torch.int32)
        r = leakage_probe(lambda a, b, c, d: attention(a, b, c, d, causal=True, route=ROUTE), q, k, v, cu, do=do)
        assert r.records and r.exact and r.max_leak == 0.0, r


# ----------------------------------------------------------------------------- fp8_pv
def test_fp8_pv_route_and_accuracy():
    """fp8_pv: BF16 Q, K and dS (dK, dQ unquantized), E4M3 P̂V, dP, dV. The 8-bit bound holds on outlier
    tokens, above fp8_token_bf16qk's dQ and dK (no dS rounding), and the probe is exactly 0."""
    r = get_route("fp8_pv")
    assert r.exact and not r.scores_bf16 and not r.operands.q.quantized and not r.operands.ds.quantized
    plan = make_plan(r, True, 64, 128, 0.088, key_align=16, mma="sm90_fp8")
    assert plan.mma_pv and plan.mma_dp and plan.mma_dv and not (plan.mma_qk or plan.mma_dk or plan.mma_dq)
    q, k, v, do, cu = _inputs("outlier")
    o_x, lse_x = attention(q, k, v, cu, causal=True, route=None, return_lse=True)
    ex = attention_backward(q, k, v, o_x, lse_x, do, cu, True, None)
    got = {}
    for rn in ("fp8_pv", ROUTE):
        o, lse = attention(q, k, v, cu, causal=True, route=rn, return_lse=True, tile_m=128, tile_n=128, key_align=16)
        g = attention_backward(q, k, v, o, lse, do, cu, True, get_route(rn), tile_m=64, tile_n=128, key_align=16)
        got[rn] = [float(cosine(a, b)) for a, b in zip((o, *g), (o_x, *ex))]
    assert min(got["fp8_pv"]) >= 0.998, got
    assert got["fp8_pv"][1] > got[ROUTE][1] and got["fp8_pv"][2] >= got[ROUTE][2], got
    gen = torch.Generator().manual_seed(5)
    qq, kk, vv, dd = (torch.randn(300, 2, 128, generator=gen).to(torch.bfloat16).float() for _ in range(4))
    res = leakage_probe(lambda a, b, c, d: attention(a, b, c, d, causal=True, route="fp8_pv"), qq, kk, vv,
                        torch.tensor([0, 190, 300], dtype=torch.int32), do=dd)
    assert res.records and res.exact
