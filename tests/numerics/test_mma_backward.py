"""The backward's FP8 products under the sm90_fp8 tensor-core model (route_backward(mma="sm90_fp8")).

The model follows templates/sm90/attn_bwd.py.j2: units (document, key tile, KV head) visit the KV
head's query heads and, per head, their query tiles in increasing order; dV += Pᵀ·dO and dK += dSᵀ·Q
contract over each tile's query rows (k-blocks of 32) with running references; dQ = dS·K per
(query tile, key tile), partials added in fp32. Here the per-tile products are recomputed with
explicit loops over units and tiles, from P and dS, and compared bitwise.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys

import pytest
import torch

import flamia_gen.numerics.reference_exact as reference_exact
import flamia_gen.numerics.reference_route as rr
from flamia_gen.numerics.metrics import cosine
from flamia_gen.numerics.mma import fp8_matmul
from flamia_gen.numerics.reference import attention
from flamia_gen.spec import get_route
from flamia_gen.spec.enums import Format


BASE = "b82e273"  # the last commit before the backward model


def _original_module():
    """reference_route.py as it was before the backward model (commit BASE), read from the git
    history and loaded inside the package (its relative imports resolve); skips where the history
    is not available (a shallow clone)."""
    name = f"flamia_gen.numerics._reference_route_{BASE}"
    if name not in sys.modules:
        repo = pathlib.Path(__file__).resolve().parents[2]
        try:
            src = subprocess.run(["git", "show", f"{BASE}:flamia_gen/numerics/reference_route.py"], cwd=repo,
                                 capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            pytest.skip(f"commit {BASE} is not in this clone's history")
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
        mod.__package__ = "flamia_gen.numerics"
        sys.modules[name] = mod  # dataclasses look their module up while the class is built
        exec(compile(src, f"{BASE}:reference_route.py", "exec"), mod.__dict__)
    return sys.modules[name]


def _inputs(docs, hq, hkv, d, seed, spread=False):
    """BF16 q, k, v, dO and cu_seqlens. `spread`: per-token power-of-two magnitudes over 2^±5 on q and dO
    (and later dO rows larger), so the kernel's running references of dV and dK move between tiles."""
    g = torch.Generator().manual_seed(seed)
    T = sum(docs)
    q = torch.randn(T, hq, d, generator=g)
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)
    do = torch.randn(T, hq, d, generator=g)
    if spread:
        q = q * torch.exp2(torch.randint(-5, 6, (T, hq, 1), generator=g).float())
        ramp = torch.linspace(-5, 5, T).round()[:, None, None]
        do = do * torch.exp2(ramp + torch.randint(-2, 3, (T, hq, 1), generator=g).float())
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(docs), 0).tolist(), dtype=torch.int32)
    return (*(x.to(torch.bfloat16) for x in (q, k, v, do)), cu)


def _forward(route, q, k, v, cu, causal):
    return attention(q, k, v, cu, causal, route, return_lse=True, tile_m=64, tile_n=64)


# ---------------------------------------------------------------- exact mode is unchanged


@pytest.mark.parametrize("route", ["bf16", "fp8_token", "fp8_tensor", "mxfp8_exact", "nvfp4_mixed"])
@pytest.mark.parametrize("causal", [True, False])
def test_exact_mode_is_bitwise_the_original_implementation(route, causal):
    orig = _original_module()
    q, k, v, do, cu = _inputs([77, 200, 1, 130], 4, 2, 64, seed=5)
    o, lse = _forward(route, q, k, v, cu, causal)
    r = get_route(route)
    for tiles in (dict(tile_m=64, tile_n=64, key_align=16), dict(tile_m=64, tile_n=128, key_align=1)):
        new = rr.route_backward(r, q, k, v, o, lse, do, cu, causal, **tiles)
        old = orig.route_backward(r, q, k, v, o, lse, do, cu, causal, **tiles)
        for a, b in zip(new, old):
            assert torch.equal(a, b)


def test_bf16_under_the_model_is_the_exact_backward():
    # no FP8 product: mma="sm90_fp8" changes nothing
    q, k, v, do, cu = _inputs([100, 60], 2, 2, 64, seed=1)
    o, lse = _forward("bf16", q, k, v, cu, True)
    r = get_route("bf16")
    plan = rr.make_plan(r, True, 64, 128, 0.125, mma="sm90_fp8")
    assert not (plan.mma_dp or plan.mma_dv or plan.mma_dk or plan.mma_dq)
    a = rr.route_backward(r, q, k, v, o, lse, do, cu, True, tile_m=64, tile_n=128)
    b = rr.route_backward(r, q, k, v, o, lse, do, cu, True, tile_m=64, tile_n=128, mma="sm90_fp8")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fp8_token_models_every_backward_product():
    plan = rr.make_plan(get_route("fp8_token"), True, 64, 128, 0.125, mma="sm90_fp8")
    assert plan.mma_qk and plan.mma_dp and plan.mma_dv and plan.mma_dk and plan.mma_dq
    plan = rr.make_plan(get_route("fp8_token"), True, 64, 128, 0.125)
    assert not (plan.mma_qk or plan.mma_dp or plan.mma_dv or plan.mma_dk or plan.mma_dq)


# ---------------------------------------------------------------- per-tile products, written out


def _e4m3(x):
    return rr.round_to_format(x, Format.e4m3)


def _exp_ceil(amax):
    """E4M3 `ceil` scale exponent of a group maximum (quantizer contract Step 3; -127 for 0)."""
    return rr.scale_exponent(amax, Format.e4m3, get_route("fp8_token").operands.ds.exponent_rule)


def _doc_p_ds(plan, bo, o, lse, cu, doc):
    """P and dS (Hq, L, L) of one whole document, heads-first, under the model's scores and dP."""
    s, e = int(cu[doc]), int(cu[doc + 1])
    L = e - s
    Hq, Hkv = bo.do_rows.exp.shape[1], bo.fwd.ks.exp.shape[1]
    heads = torch.arange(Hq) // (Hq // Hkv)
    qh = torch.arange(Hq)
    g = rr.geometry(plan, 0, L, L, L, "cpu", s % plan.key_align)
    f = bo.fwd
    cg = rr._grad_chunk(plan, f.qs.doc(s, e, qh), f.ks.doc(s, e, heads), None, f.v.doc(s, e, heads), None,
                        bo.do_rows.doc(s, e, qh), o.float()[s:e].transpose(0, 1),
                        lse.float()[s:e].transpose(0, 1) * rr.LOG2E, g)
    return cg.p, cg.ds


def _kernel_doc(plan, bo, p, ds, cu, doc, group):
    """dQ (L, Hq, D), dK, dV (L, Hkv, D) of one document, unit by unit and tile by tile as the kernel."""
    tm, tn = plan.tile_m, plan.tile_n
    s, e = int(cu[doc]), int(cu[doc + 1])
    L, T = e - s, bo.do_rows.exp.shape[0]
    delta = s % plan.key_align
    Hq, D = p.shape[0], bo.qk.codes.shape[-1]
    Hkv = Hq // group
    n_kt, m_hi = math.ceil((L + delta) / tn), math.ceil((L + delta) / tm)
    dq = torch.zeros(L, Hq, D)
    dk = torch.zeros(L, Hkv, D)
    dv = torch.zeros(L, Hkv, D)
    moves = dict(dv=0, dk=0)

    def tile(x, q0, k0):  # (L, L) doc-local queries × keys → (tm, tn), zeros outside the document
        out = torch.zeros(tm, tn)
        for i in range(tm):
            if 0 <= q0 + i < L:
                for j0 in range(tn):
                    if 0 <= k0 + j0 < L:
                        out[i, j0] = x[q0 + i, k0 + j0]
        return out

    def rows(x, q0):  # (T, ·) global tokens s + q0 + [0, tm) → (tm, ·), zeros outside the document
        out = torch.zeros(tm, *x.shape[1:])
        for i in range(tm):
            if 0 <= q0 + i < L:
                out[i] = x[s + q0 + i]
        return out

    for hkv in range(Hkv):
        for nb in range(n_kt):  # one unit
            k0 = nb * tn - delta
            m_lo = max(nb * tn, delta) // tm if plan.causal else 0
            acc_dv, R = torch.zeros(tn, D), -127.0
            acc_dk, E = torch.zeros(tn, D), torch.full((tn,), -127.0)
            for hh in range(group):
                h = hkv * group + hh
                for mb in range(m_lo, m_hi):
                    q0 = mb * tm - delta
                    # dV: R = running max of the tile's largest dO exponent over its tokens of this document
                    # (the tile's rows of neighbouring documents do not count: no cross-document reference)
                    toks = [s + q0 + i for i in range(tm)]
                    r_new = max(float(bo.do_dv.exp[t, h]) if s <= t < e else -127.0 for t in toks)
                    if r_new > R:
                        acc_dv = acc_dv * 2.0 ** (R - r_new)
                        R, moves["dv"] = r_new, moves["dv"] + (R > -127)
                    edo = rows(bo.do_dv.exp[:, h:h + 1], q0)[:, 0]  # (tm,)
                    pt = tile(p[h], q0, k0).T * torch.exp2(8 + edo - R)[None, :]
                    acc_dv = fp8_matmul(_e4m3(pt), rows(bo.do_dv.codes[:, h], q0), acc_dv)
                    # dK: y = dSᵀ·2^eq, per (key, tile) ceil exponent, E = the key's running max
                    eq = rows(bo.qk.exp[:, h:h + 1], q0)[:, 0]
                    y = tile(ds[h], q0, k0).T * torch.exp2(eq)[None, :]  # (keys, rows)
                    et = _exp_ceil(y.abs().amax(dim=1))
                    up = et > E
                    moves["dk"] += int((up & (E > -127)).sum())
                    acc_dk = acc_dk * torch.where(up, torch.exp2(E - et), 1.0)[:, None]
                    E = torch.maximum(E, et)
                    acc_dk = fp8_matmul(_e4m3(y * torch.exp2(-E)[:, None]), rows(bo.qk.codes[:, h], q0), acc_dk)
            for j in range(tn):  # epilogue
                if 0 <= k0 + j < L:
                    dv[k0 + j, hkv] = acc_dv[j] * 2.0 ** (R - 8)
                    dk[k0 + j, hkv] = acc_dk[j] * (torch.exp2(E[j]) * plan.scale)
    for h in range(Hq):  # dQ: query tile by query tile, partials of the visiting key tiles in order
        hkv = h // group
        for mb in range(m_hi):
            q0 = mb * tm - delta
            acc = torch.zeros(tm, D)
            for nb in range(n_kt):
                m_lo = max(nb * tn, delta) // tm if plan.causal else 0
                if mb < m_lo:
                    continue
                k0 = nb * tn - delta
                kcodes = torch.zeros(tn, D)
                ek = torch.zeros(tn)
                for j in range(tn):
                    if 0 <= k0 + j < L:
                        kcodes[j] = bo.kq.codes[s + k0 + j, hkv]
                        ek[j] = bo.kq.exp[s + k0 + j, hkv]
                y = tile(ds[h], q0, k0) * torch.exp2(ek)[None, :]  # (rows, keys)
                er = _exp_ceil(y.abs().amax(dim=1))
                part = fp8_matmul(_e4m3(y * torch.exp2(-er)[:, None]), kcodes)
                acc = acc + part * (torch.exp2(er) * plan.scale)[:, None]
            for i in range(tm):
                if 0 <= q0 + i < L:
                    dq[q0 + i, h] = acc[i]
    return dq, dk, dv, moves


@pytest.mark.parametrize("docs, hq, hkv, causal", [
    ([40, 200], 4, 2, True),
    ([40, 200], 4, 2, False),
    ([1, 2, 3, 130, 1, 64, 19], 2, 1, True),  # tiny documents, starts at every offset mod 16
], ids=["gqa-causal", "gqa-noncausal", "tiny-docs"])
def test_fp8_token_products_equal_a_per_tile_computation(docs, hq, hkv, causal):
    # the kernel's tiles (64 queries × 128 keys), FP8 tiles start at doc_start rounded down to 16
    tm, tn = 64, 128
    q, k, v, do, cu = _inputs(docs, hq, hkv, 64, seed=11, spread=True)
    if docs[0] == 40:
        # large dO on tokens 140 … 147, inside document 1's second query tile (rows 96 … 159 of the packed
        # row; its tiles start at token 32): its dO reference R moves there and rescales the accumulators
        # of the key tiles that visit it
        do[140:148] = (do[140:148].float() * 2.0 ** 12).to(torch.bfloat16)
    route = get_route("fp8_token")
    o, lse = _forward("fp8_token", q, k, v, cu, causal)
    dq, dk, dv = rr.route_backward(route, q, k, v, o, lse, do, cu, causal, tile_m=tm, tile_n=tn, key_align=16,
                                   mma="sm90_fp8")
    plan = rr.make_plan(route, causal, tm, tn, 64 ** -0.5, key_align=16, mma="sm90_fp8")
    bo = rr.prepare_backward(plan, q, k, v, do, cu)
    for doc in range(len(docs)):
        s, e = int(cu[doc]), int(cu[doc + 1])
        p, ds = _doc_p_ds(plan, bo, o, lse, cu, doc)
        rq, rk, rv, moves = _kernel_doc(plan, bo, p, ds, cu, doc, hq // hkv)
        assert torch.equal(dv[s:e], rv), f"dV, document {doc}"
        assert torch.equal(dk[s:e], rk), f"dK, document {doc}"
        assert torch.equal(dq[s:e], rq), f"dQ, document {doc}"
        if docs[0] == 40 and doc == 1:  # the rescale paths ran
            assert moves["dv"] > 0 and moves["dk"] > 0


def test_fp8_backward_documents_share_no_reference():
    """Document 0's last tokens share document 1's first FP8 query tile (tiles start at doc_start rounded
    down to 16): a large dO there must not move document 1's gradients by a bit (the dV reference R spans
    each document's own queries; dK's and dQ's exponents see only the pair's dS, 0 across documents)."""
    q, k, v, do, cu = _inputs([40, 200], 4, 2, 64, seed=11, spread=True)
    route = get_route("fp8_token")
    o, lse = _forward("fp8_token", q, k, v, cu, True)
    kw = dict(tile_m=64, tile_n=128, key_align=16, mma="sm90_fp8")
    base = rr.route_backward(route, q, k, v, o, lse, do, cu, True, **kw)
    do2 = do.clone()
    do2[32:40] = (do2[32:40].float() * 2.0 ** 12).to(torch.bfloat16)
    moved = rr.route_backward(route, q, k, v, o, lse, do2, cu, True, **kw)
    for a, b in zip(base, moved):
        assert torch.equal(a[40:], b[40:])
    assert not torch.equal(base[2][:40], moved[2][:40])  # document 0's own dV does move


def test_model_scores_and_dp_are_fp8_products_of_the_codes():
    q, k, v, do, cu = _inputs([150], 2, 2, 64, seed=4)
    route = get_route("fp8_token")
    o, lse = _forward("fp8_token", q, k, v, cu, True)
    plan = rr.make_plan(route, True, 64, 128, 64 ** -0.5, key_align=16, mma="sm90_fp8")
    bo = rr.prepare_backward(plan, q, k, v, do, cu)
    p, ds = _doc_p_ds(plan, bo, o, lse, cu, 0)
    qs, ks, vs, dos = (x.doc(0, 150, torch.arange(2)) for x in (bo.fwd.qs, bo.fwd.ks, bo.fwd.v, bo.do_rows))
    x = fp8_matmul(qs.codes, ks.codes.transpose(1, 2)) * torch.exp2(qs.exp[..., None] + ks.exp[:, None, :])
    x = x * (plan.scale * rr.LOG2E)
    vis = torch.ones(150, 150, dtype=torch.bool).tril()
    p_ref = torch.where(vis, torch.exp2(x - lse.float()[:, :].T[..., None] * rr.LOG2E), 0.0)
    dp = fp8_matmul(dos.codes, vs.codes.transpose(1, 2)) * torch.exp2(dos.exp[..., None] + vs.exp[:, None, :])
    dvec = (dos.value * o.float().transpose(0, 1)).sum(-1)
    ds_ref = torch.where(vis, p_ref * (dp - dvec[..., None]), 0.0)
    torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(ds, ds_ref, rtol=1e-5, atol=1e-9)
    # and they are not the exact sums
    exact = rr.make_plan(route, True, 64, 128, 64 ** -0.5, key_align=16)
    p_x, ds_x = _doc_p_ds(exact, bo, o, lse, cu, 0)
    assert not torch.equal(ds, ds_x)


# ---------------------------------------------------------------- properties of the model's outputs


@pytest.mark.parametrize("route", ["fp8_token", "mxfp8_exact", "fp8_tensor"])
def test_model_is_close_to_exact_sums_and_finite(route):
    q, k, v, do, cu = _inputs([300, 1, 129, 77], 4, 2, 128, seed=3)
    o, lse = _forward(route, q, k, v, cu, True)
    r = get_route(route)
    a = rr.route_backward(r, q, k, v, o, lse, do, cu, True, tile_m=64, tile_n=128, key_align=16)
    b = rr.route_backward(r, q, k, v, o, lse, do, cu, True, tile_m=64, tile_n=128, key_align=16, mma="sm90_fp8")
    for x, y in zip(a, b):
        assert torch.isfinite(y).all()
        assert not torch.equal(x, y)
        assert float(cosine(x, y)) > 0.9999


def test_model_does_not_depend_on_the_query_chunks(monkeypatch):
    q, k, v, do, cu = _inputs([300, 45], 2, 1, 64, seed=8)
    route = get_route("fp8_token")
    o, lse = _forward("fp8_token", q, k, v, cu, True)
    kw = dict(tile_m=64, tile_n=128, key_align=16, mma="sm90_fp8")
    whole = rr.route_backward(route, q, k, v, o, lse, do, cu, True, **kw)
    monkeypatch.setattr(reference_exact, "SCORE_BUDGET", 300 * 64)  # 64-row chunks (one kernel query tile)
    chunked = rr.route_backward(route, q, k, v, o, lse, do, cu, True, **kw)
    for x, y in zip(whole, chunked):
        assert torch.equal(x, y)
