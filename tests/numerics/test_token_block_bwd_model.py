"""The sm90 backward model for token-block routes (mxfp8): the forward's tiles for the diagonal decisions,
separate from the backward kernel's (fwd_tile_m, fwd_tile_n), and square_32 dS blocks on the kernel's grid
(edges at doc-local −δ + 32·i, δ = doc_start mod key_align); docs/numerics.md §2.4.2."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys

import pytest
import torch

import flamia_gen.numerics.reference_route as rr
from flamia_gen.numerics.mma import fp8_matmul
from flamia_gen.numerics.reference import attention, attention_backward
from flamia_gen.spec import get_route
from flamia_gen.spec.enums import ExponentRule, Format

BASE = "6ec377a"  # the last commit before the forward tiles and the grid-aligned square_32 blocks
KERNEL = dict(tile_m=64, tile_n=128, key_align=16, mma="sm90_fp8")  # the sm90 FP8 backward's tiling


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: one intra-op thread is faster on a shared 2-core machine
    yield
    torch.set_num_threads(n)


def _original_module():
    """reference_route.py at commit BASE, loaded inside the package; skips without that history."""
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
        sys.modules[name] = mod
        exec(compile(src, f"{BASE}:reference_route.py", "exec"), mod.__dict__)
    return sys.modules[name]


def _inputs(docs, hq, hkv, d, seed):
    """BF16 q, k, v, dO and cu_seqlens; q and dO rows scaled by 2^[-5, 5] so dS block maxima differ."""
    g = torch.Generator().manual_seed(seed)
    T = sum(docs)
    q, k, v, do = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv, hq))
    q = q * torch.exp2(torch.randint(-5, 6, (T, hq, 1), generator=g).float())
    do = do * torch.exp2(torch.randint(-5, 6, (T, hq, 1), generator=g).float())
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(docs), 0).tolist(), dtype=torch.int32)
    return (*(x.to(torch.bfloat16) for x in (q, k, v, do)), cu)


def _forward(route, q, k, v, cu):
    return attention(q, k, v, cu, True, route, return_lse=True, tile_m=128, tile_n=128, key_align=16)


def _exp_ceil(amax):
    return rr.scale_exponent(amax, Format.e4m3, ExponentRule.ceil)


# ---------------------------------------------------------------- 1. regression and the forward tiles


@pytest.mark.parametrize("route, docs", [
    ("fp8_token", [77, 150, 1, 60]),  # token dS: nothing changes, any document starts
    ("mxfp8", [96, 320, 77]),  # square_32 dS, every start a multiple of 16 (δ = 0): grid = document blocks
])
def test_model_without_fwd_tiles_is_the_previous_model(route, docs):
    orig = _original_module()
    q, k, v, do, cu = _inputs(docs, 2, 1, 32, seed=2)
    # a V outlier (document 1, key 130): per-key V and token-block V differ, so diagonal decisions show
    v[226] = (v[226].float() * 2.0 ** 12).to(torch.bfloat16)
    r = get_route(route)
    o, lse = _forward(route, q, k, v, cu)
    new = rr.route_backward(r, q, k, v, o, lse, do, cu, True, **KERNEL)
    explicit = rr.route_backward(r, q, k, v, o, lse, do, cu, True, **KERNEL, fwd_tile_m=64, fwd_tile_n=128)
    old = orig.route_backward(r, q, k, v, o, lse, do, cu, True, **KERNEL)
    for a, b, c in zip(new, explicit, old):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_fwd_tiles_set_the_diagonal_decisions_of_the_model():
    # documents starting off the 16-grid (δ = 8 and 4); a V outlier at doc-local key 130 of document 1 makes its
    # token-block neighbours E4M3-subnormal, so per-key V (diagonal tiles) and token-block V give different dP
    docs = [200, 300, 177]
    q, k, v, do, cu = _inputs(docs, 1, 1, 32, seed=1)
    v[330] = (v[330].float() * 2.0 ** 12).to(torch.bfloat16)
    r = get_route("mxfp8")
    o, lse = _forward("mxfp8", q, k, v, cu)
    base = rr.route_backward(r, q, k, v, o, lse, do, cu, True, **KERNEL)
    # forward tile_m 128 with tile_n 128: the tile holding a query tile's first row is the same as with 64
    # (first rows 128t and 128t + 64, δ < 64): identical decisions, identical gradients
    same = rr.route_backward(r, q, k, v, o, lse, do, cu, True, **KERNEL, fwd_tile_m=128)
    for a, b in zip(base, same):
        assert torch.equal(a, b)
    # forward tile_m 192: document 1's rows 256 … 299 take their diagonal from key tile 1 (first row 192), not 2
    moved = rr.route_backward(r, q, k, v, o, lse, do, cu, True, **KERNEL, fwd_tile_m=192)
    assert torch.equal(moved[2], base[2])  # P does not depend on V: dV unchanged
    diff_q = (moved[0] != base[0]).flatten(1).any(dim=1).nonzero().flatten()
    diff_k = (moved[1] != base[1]).flatten(1).any(dim=1).nonzero().flatten()
    assert len(diff_q) and len(diff_k)
    # dQ rows from the 32-row grid block holding doc-local row 256 (it starts at 256 − δ) on; dK only the
    # keys in key tile 1 (doc-local 120 … 247), document 1 only
    assert int(diff_q.min()) >= 200 + 256 - 8 and int(diff_q.max()) < 500
    assert int(diff_k.min()) >= 200 + 120 and int(diff_k.max()) < 200 + 248


def test_attention_backward_passes_the_fwd_tiles_through():
    q, k, v, do, cu = _inputs([300], 1, 1, 32, seed=1)
    v[130] = (v[130].float() * 2.0 ** 12).to(torch.bfloat16)
    o, lse = _forward("mxfp8", q, k, v, cu)
    kw = dict(tile_m=64, tile_n=128, key_align=16)  # exact sums: fast, the same diagonal rule
    a = attention_backward(q, k, v, o, lse, do, cu, True, "mxfp8", **kw, fwd_tile_m=192)
    b = rr.route_backward(get_route("mxfp8"), q, k, v, o, lse, do, cu, True, **kw, fwd_tile_m=192)
    c = attention_backward(q, k, v, o, lse, do, cu, True, "mxfp8", **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


def test_fwd_tiles_are_validated():
    r, mx = get_route("mxfp8"), get_route("mxfp8_exact")
    for bad in (dict(fwd_tile_m=0), dict(fwd_tile_n=-128), dict(fwd_tile_m=48), dict(fwd_tile_n=80)):
        with pytest.raises(ValueError, match="fwd_tile"):
            rr.make_plan(r, True, 64, 128, 0.125, key_align=16, **bad)
    rr.make_plan(get_route("fp8_token"), True, 64, 128, 0.125, fwd_tile_m=48)  # no 32-token blocks: fine
    q, k, v, do, cu = _inputs([70], 1, 1, 32, seed=0)
    o, lse = _forward("mxfp8_exact", q, k, v, cu)
    # k_fold's dS·K takes one K copy per (row, key tile): the model needs the forward's key tiles
    with pytest.raises(ValueError, match="fwd_tile_n == tile_n"):
        rr.route_backward(mx, q, k, v, o, lse, do, cu, True, **KERNEL, fwd_tile_n=256)
    rr.route_backward(mx, q, k, v, o, lse, do, cu, True, **KERNEL, fwd_tile_m=128)  # tile_m may differ
    rr.route_backward(mx, q, k, v, o, lse, do, cu, True, tile_m=64, tile_n=128, key_align=16, fwd_tile_n=256)


# ---------------------------------------------------------------- 2. square_32 blocks on the kernel grid


@pytest.mark.parametrize("row0, col0", [(0, 0), (5, 11), (43, 70), (31, 1)])
def test_group_amax_on_a_shifted_grid(row0, col0):
    g = torch.Generator().manual_seed(row0 + col0)
    x = torch.randn(2, 77, 101, generator=g) * torch.exp2(torch.randint(-8, 9, (2, 77, 101), generator=g).float())
    got = rr.group_amax(x, 32, 32, row0, col0)
    ref = torch.empty_like(x)
    rb = [(i + row0) // 32 for i in range(77)]
    cb = [(j + col0) // 32 for j in range(101)]
    for bi in set(rb):
        rows = [i for i in range(77) if rb[i] == bi]
        for bj in set(cb):
            cols = [j for j in range(101) if cb[j] == bj]
            ref[:, rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1] = \
                x[:, rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].abs().amax(dim=(1, 2), keepdim=True)
    assert torch.equal(got, ref)
    # a large value just before a grid line moves its own block only
    i, j = 32 - row0 % 32 - 1, 64 - col0 % 32 - 1
    y = x.clone()
    y[:, i, j] = 1e30
    moved = rr.group_amax(y, 32, 32, row0, col0) != got
    assert moved[:, i, j].all() and not moved[:, i + 1, :].any() and not moved[:, :, j + 1].any()


def _kernel_dk_dq(plan, bo, ds, cu, doc, group, origin):
    """dK (L, Hkv, D) and dQ (L, Hq, D) of one document of a square_32 route, tile by tile as the sm90 kernel,
    with the references written as amaxes over block × tile regions: for dK, E_key = running max over the
    visited query tiles of ceil-exp(amax over (the key's 32-key block) × (the 64-row query tile) of
    |dS·2^eq|); for dQ, e_row = ceil-exp(amax over (the row's 32-row block) × (the key tile) of |dS·2^ek|).
    Blocks have edges at doc-local `origin` + 32·i (the kernel's grid: origin = −δ); ds: (Hq, L, L)."""
    tm, tn = plan.tile_m, plan.tile_n
    s, e = int(cu[doc]), int(cu[doc + 1])
    L, delta = e - s, s % plan.key_align
    Hq, D = ds.shape[0], bo.qk.codes.shape[-1]
    Hkv = Hq // group
    n_kt, n_qt = math.ceil((L + delta) / tn), math.ceil((L + delta) / tm)
    lo, hi = -delta, max(n_kt * tn, n_qt * tm) - delta  # doc-local range of all tiles
    blk = torch.arange(lo, hi) - origin
    blk = torch.div(blk, 32, rounding_mode="floor")  # block id of each doc-local index

    def padded(x):  # (L, L) → (hi − lo, hi − lo), zeros outside the document
        return torch.nn.functional.pad(x, (delta, hi - lo - L - delta, delta, hi - lo - L - delta))

    def rows(x):  # (L, ·) → (hi − lo, ·)
        return torch.nn.functional.pad(x, (0, 0, delta, hi - lo - L - delta))

    def block_amax(y, r0, r1, c0, c1, by_row):  # amax over (row block or rows r0:r1) × (cols c0:c1 or col block)
        out = torch.empty(r1 - r0 if by_row else c1 - c0)
        for t in range(len(out)):
            if by_row:  # row t's block, all tile columns
                sel = (blk == blk[r0 + t]).nonzero().flatten()
                out[t] = y[sel][:, c0:c1].abs().max()
            else:  # column t's block, all tile rows
                sel = (blk == blk[c0 + t]).nonzero().flatten()
                out[t] = y[r0:r1][:, sel].abs().max()
        return out

    dq = torch.zeros(L, Hq, D)
    dk = torch.zeros(L, Hkv, D)
    for hkv in range(Hkv):
        ek = rows(bo.kq.exp[s:e, hkv:hkv + 1])[:, 0]
        kcodes = rows(bo.kq.codes[s:e, hkv])
        for nb in range(n_kt):  # dK: one unit (key tile, KV head)
            c0 = nb * tn
            m_lo = max(nb * tn, delta) // tm
            acc, E = torch.zeros(tn, D), torch.full((tn,), -127.0)
            for h in range(hkv * group, (hkv + 1) * group):
                yk = padded(ds[h]) * torch.exp2(rows(bo.qk.exp[s:e, h:h + 1]))  # dS·2^eq
                qcodes = rows(bo.qk.codes[s:e, h])
                for mb in range(m_lo, n_qt):
                    r0 = mb * tm
                    et = _exp_ceil(block_amax(yk, r0, r0 + tm, c0, c0 + tn, by_row=False))
                    up = et > E
                    acc = acc * torch.where(up, torch.exp2(E - et), 1.0)[:, None]
                    E = torch.maximum(E, et)
                    codes = rr.round_to_format(yk[r0:r0 + tm, c0:c0 + tn].T * torch.exp2(-E)[:, None], Format.e4m3)
                    acc = fp8_matmul(codes, qcodes[r0:r0 + tm], acc)
            out = acc * (torch.exp2(E) * plan.scale)[:, None]
            for j in range(tn):
                if 0 <= c0 + j + lo < L:
                    dk[c0 + j + lo, hkv] = out[j]
    for h in range(Hq):  # dQ: query tile by query tile, the visiting key tiles' partials in order
        hkv = h // group
        ek = rows(bo.kq.exp[s:e, hkv:hkv + 1])[:, 0]
        kcodes = rows(bo.kq.codes[s:e, hkv])
        yq = padded(ds[h]) * torch.exp2(ek)[None, :]  # dS·2^ek
        for mb in range(n_qt):
            r0 = mb * tm
            acc = torch.zeros(tm, D)
            for nb in range(n_kt):
                if mb < max(nb * tn, delta) // tm:
                    continue
                c0 = nb * tn
                er = _exp_ceil(block_amax(yq, r0, r0 + tm, c0, c0 + tn, by_row=True))
                codes = rr.round_to_format(yq[r0:r0 + tm, c0:c0 + tn] * torch.exp2(-er)[:, None], Format.e4m3)
                acc = acc + fp8_matmul(codes, kcodes[c0:c0 + tn]) * (torch.exp2(er) * plan.scale)[:, None]
            for i in range(tm):
                if 0 <= r0 + i + lo < L:
                    dq[r0 + i + lo, h] = acc[i]
    return dk, dq


def _doc_ds(plan, bo, o, lse, cu, doc):
    """dS (Hq, L, L) of one whole document under the model's scores and dP (per-key V on diagonal tiles)."""
    s, e = int(cu[doc]), int(cu[doc + 1])
    L = e - s
    Hq, Hkv = bo.do_rows.exp.shape[1], bo.fwd.ks.exp.shape[1]
    heads = torch.arange(Hq) // (Hq // Hkv)
    f = bo.fwd
    g = rr.geometry(plan, 0, L, L, L, "cpu", s % plan.key_align)
    cg = rr._grad_chunk(plan, f.qs.doc(s, e, torch.arange(Hq)), f.ks.doc(s, e, heads), None,
                        f.v.doc(s, e, heads), f.v_tok.doc(s, e, heads), bo.do_rows.doc(s, e, torch.arange(Hq)),
                        o.float()[s:e].transpose(0, 1), lse.float()[s:e].transpose(0, 1) * rr.LOG2E, g)
    return cg.ds


def test_mxfp8_dk_dq_references_are_grid_block_amaxes():
    docs = [37, 230, 70]  # starts 0, 37, 267: δ = 0, 5, 11
    q, k, v, do, cu = _inputs(docs, 2, 1, 64, seed=7)
    r = get_route("mxfp8")
    o, lse = _forward("mxfp8", q, k, v, cu)
    dq, dk, _ = rr.route_backward(r, q, k, v, o, lse, do, cu, True, **KERNEL)
    plan = rr.make_plan(r, True, 64, 128, 64 ** -0.5, key_align=16, mma="sm90_fp8")
    bo = rr.prepare_backward(plan, q, k, v, do, cu)
    doc_aligned_differs = False
    for doc in range(len(docs)):
        s, e = int(cu[doc]), int(cu[doc + 1])
        delta = s % 16
        ds = _doc_ds(plan, bo, o, lse, cu, doc)
        rk, rq = _kernel_dk_dq(plan, bo, ds, cu, doc, 2, origin=-delta)
        assert torch.equal(dk[s:e], rk), f"dK, document {doc}"
        assert torch.equal(dq[s:e], rq), f"dQ, document {doc}"
        if delta:  # blocks from the document start instead: the brute force sees the difference
            ak, aq = _kernel_dk_dq(plan, bo, ds, cu, doc, 2, origin=0)
            doc_aligned_differs |= not (torch.equal(dk[s:e], ak) and torch.equal(dq[s:e], aq))
    assert doc_aligned_differs


# ---------------------------------------------------------------- 3. document isolation under the model


@pytest.mark.parametrize("operand", ["q", "k", "v", "do"])
def test_mxfp8_model_documents_are_isolated(operand):
    docs = [100, 37, 300]  # starts 0, 100, 137: δ = 0, 4, 9
    inputs = dict(zip(("q", "k", "v", "do"), _inputs(docs, 1, 1, 32, seed=3)[:4]))
    cu = _inputs(docs, 1, 1, 32, seed=3)[4]
    r = get_route("mxfp8")

    def grads(x):
        o, lse = _forward("mxfp8", x["q"], x["k"], x["v"], cu)
        return rr.route_backward(r, x["q"], x["k"], x["v"], o, lse, x["do"], cu, True, **KERNEL)

    base = grads(inputs)
    moved_inputs = dict(inputs)
    t = inputs[operand].clone()
    t[120] = (t[120].float() * 1e4).to(torch.bfloat16)  # doc-local token 20 of the middle document
    moved_inputs[operand] = t
    moved = grads(moved_inputs)
    other = torch.cat([torch.arange(0, 100), torch.arange(137, 437)])
    for a, b in zip(base, moved):  # dQ, dK, dV of the other documents: bit for bit
        assert torch.equal(a[other], b[other])
    assert any(not torch.equal(a[100:137], b[100:137]) for a, b in zip(base, moved))


# ---------------------------------------------------------------- 4. the diagonal rule on the forward's tiles


@pytest.mark.parametrize("fwd", [(128, 128), (192, 128), (128, 192)])
@pytest.mark.parametrize("delta", [0, 5, 15])
def test_geometry_diag_uses_the_forward_tiles(fwd, delta):
    ftm, ftn = fwd
    plan = rr.make_plan(get_route("mxfp8"), True, 64, 128, 0.125, key_align=16, fwd_tile_m=ftm, fwd_tile_n=ftn)
    L = 400
    a, b = 64 - delta, 400  # a chunk as the backward model cuts it (from a kernel query tile's first row)
    g = rr.geometry(plan, a, b, b, L, "cpu", delta)
    # the forward (doc-local): query tiles [ftm·t, ftm·(t + 1)), key tiles [ftn·u − δ, ftn·(u + 1) − δ);
    # a (row, key) pair is diagonal when the key's tile is at or after the tile holding its
    # query tile's first row
    key_tiles = [(ftn * u - delta, ftn * (u + 1) - delta) for u in range(L // ftn + 2)]

    def tile_of(j):
        return next(u for u, (k0, k1) in enumerate(key_tiles) if k0 <= j < k1)

    key_tile = torch.tensor([tile_of(j) for j in range(b)])
    ref = torch.zeros(b - a, b, dtype=torch.bool)
    for i in range(a, b):
        ref[i - a] = key_tile >= tile_of((i // ftm) * ftm)  # the tile of the query tile's first row
    assert torch.equal(g.diag, ref)
    if fwd != (128, 128):  # the kernel's tiles alone would decide differently
        g0 = rr.geometry(rr.make_plan(get_route("mxfp8"), True, 64, 128, 0.125, key_align=16), a, b, b, L, "cpu", delta)
        assert not torch.equal(g0.diag, ref)
