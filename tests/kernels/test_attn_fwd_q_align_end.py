"""fwd_q_align_end (template flag of templates/sm90/attn_fwd.py.j2, off; experiment "qend"): causal query tiles end
at the document's end, so the partial tile comes first. These tests run the rendered tiling on Python ints (the tiles
cover every row once, each sees every key its rows see, fewer key-tile steps than the default), check that the
numerics emulator visits key tiles in the same order row by row, that its O does not depend on the tiling where P̂
is not rounded, and that the flag refuses the kernels it cannot serve."""

from __future__ import annotations

import ast

import jinja2
import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.spec import get_route, load_specs

VARIANTS = [v for v in make_plan(load_specs()).variants if v.kind.value == "attn_fwd" and v.arch.value == "sm90"]
QEND = [v for v in VARIANTS if v.param("causal") and not v.param("diag_k") and not v.param("diag_v")
        and v.param("head_dim") == 128]


def _fns(src: str):
    """The rendered `key_tiling` and `q_shift` on Python ints, with TILE_M, TILE_N, KEY_ALIGN."""
    tree = ast.parse(src)
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in ("TILE_M", "TILE_N", "KEY_ALIGN")}
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("key_tiling", "q_shift")]
    ns = dict(consts, cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=fns, type_ignores=[]), "tiling", "exec"), ns)
    return ns.get("key_tiling"), ns.get("q_shift"), consts


def _order(nblk, n_mask, n_lo):
    return list(range(nblk - 1, n_mask - 1, -1)) + ([0] if n_lo else []) + list(range(n_mask - 1, n_lo - 1, -1))


@pytest.mark.parametrize("v", QEND, ids=lambda v: v.name)
def test_end_aligned_tiles_cover_mask_and_save_steps(v):
    key_tiling, q_shift, c = _fns(render_with_flags(v, fwd_q_align_end=True))
    base, _, _ = _fns(render_variant(v))
    assert q_shift is not None
    tm, tn = c["TILE_M"], c["TILE_N"]
    for s in (0, 1, 6, 15, 16, 1000, 4099):
        for L in (1, 2, 5, 64, 127, 128, 129, 191, 192, 193, 256, 300, 1000, 4096, 8192):
            sh = q_shift(L)
            assert 0 <= sh < tm and (L + sh) % tm == 0
            seen, steps, base_steps = [], 0, 0
            for mb in range(-(-L // tm)):
                kb, delta, nblk, n_mask, n_lo = key_tiling(mb, s, L, sh)
                base_steps += base(mb, s, L)[2]
                steps += nblk
                row0 = mb * tm - sh
                rows = range(max(row0, 0), min(row0 + tm, L))
                assert rows, (s, L, mb)  # no tile without a row of the document
                seen += list(rows)
                assert row0 + tm <= L  # the last tile ends at the document's end, none runs past it
                order = _order(nblk, n_mask, n_lo)
                assert sorted(order) == list(range(nblk)) and n_mask >= 0
                masked = set(range(n_mask, nblk)) | ({0} if n_lo else set())
                for n in range(nblk):
                    keys = range(n * tn - delta, (n + 1) * tn - delta)
                    # a tile holding a key after the tile's first row (a negative row sees none) is masked
                    if keys[0] < 0 or keys[-1] >= L or keys[-1] > row0:
                        assert n in masked, (s, L, mb, n)
                assert (rows[-1] + delta) // tn < nblk  # every visible key of the rows is visited
            assert seen == list(range(L))  # every row in exactly one tile, in order
            assert steps <= base_steps, (s, L)
            if tm == 192 and tn == 128 and s == 0 and L in (256, 4096, 8192):
                # the partial tile moved to where it sees 1 key tile (the figures of the flag's comment)
                assert (base_steps, steps) == {256: (4, 3), 4096: (384, 363), 8192: (1429, 1408)}[L]


@pytest.mark.parametrize("v", [v for v in QEND if v.route in ("fp8_token", "bf16")], ids=lambda v: v.name)
def test_emulator_follows_the_end_aligned_tile_order(v):
    from flamia_gen.numerics.reference_route import make_plan as emu_plan, tile_visit_rank

    key_tiling, q_shift, c = _fns(render_with_flags(v, fwd_q_align_end=True))
    tm, tn = c["TILE_M"], c["TILE_N"]
    plan = emu_plan(get_route(v.route), True, tm, tn, 1.0, key_align=c["KEY_ALIGN"], q_align_end=True)
    for s in (0, 6, 16, 1300):
        for L in (1, 64, 127, 129, 200, 300, 1000):
            delta = s % c["KEY_ALIGN"]
            n_tiles = (L + delta + tn - 1) // tn
            order = tile_visit_rank(plan, torch.arange(L), L, delta, n_tiles).argsort(dim=1)
            sh = q_shift(L)
            for mb in range(-(-L // tm)):
                _, _, nblk, n_mask, n_lo = key_tiling(mb, s, L, sh)
                for r in (max(mb * tm - sh, 0), min((mb + 1) * tm - sh, L) - 1):
                    assert order[r, :nblk].tolist() == _order(nblk, n_mask, n_lo), (s, L, mb, r)


def test_emulator_output_independent_of_tiling_where_p_is_not_rounded():
    from flamia_gen.numerics.reference_route import route_forward

    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 1, 70, 200, 457], dtype=torch.int32)
    q, k, v = (torch.randn(457, 2, 64, generator=g).to(torch.bfloat16).float() for _ in range(3))
    o0, l0 = route_forward(get_route("bf16"), q, k, v, cu, tile_m=64, tile_n=32)
    o1, l1 = route_forward(get_route("bf16"), q, k, v, cu, tile_m=64, tile_n=32, q_align_end=True)
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    # fp8_token rounds P̂ under the running max of the tiles visited so far: the tiling may move a subnormal
    # code, nothing more
    r = get_route("fp8_token")
    o0, l0 = route_forward(r, q, k, v, cu, tile_m=64, tile_n=32)
    o1, l1 = route_forward(r, q, k, v, cu, tile_m=64, tile_n=32, q_align_end=True)
    assert torch.equal(l0, l1)
    assert float((o0 - o1).abs().max()) < 1e-3 * float(o0.abs().max())


def test_flag_refuses_what_it_cannot_serve():
    from flamia_gen.numerics.reference_route import make_plan as emu_plan

    noncausal = next(v for v in VARIANTS if not v.param("causal"))
    diag = next(v for v in VARIANTS if v.param("causal") and (v.param("diag_k") or v.param("diag_v")))
    for v in (noncausal, diag):
        with pytest.raises(jinja2.exceptions.UndefinedError, match="fwd_q_align_end"):
            render_with_flags(v, fwd_q_align_end=True)
    with pytest.raises(ValueError, match="q_align_end"):
        emu_plan(get_route(diag.route), True, 128, 128, 1.0, q_align_end=True)
    # off by default: the default render has no end-aligned tiling
    assert "def q_shift(" not in render_variant(QEND[0])
    assert "def q_shift(" in render_with_flags(QEND[0], fwd_q_align_end=True)


def test_emulator_groups_rows_by_their_shifted_query_tile():
    """The FP8 PV model accumulates one query tile at a time in one visit order (`query_tile_spans`): with
    end-aligned tiles every span must hold rows of one tile only, so one order serves all its rows."""
    from flamia_gen.numerics.reference_route import make_plan as emu_plan, query_tile_spans, q_shift, tile_visit_rank

    plan = emu_plan(get_route("fp8_token"), True, 64, 32, 1.0, key_align=16, q_align_end=True)
    for L in (1, 63, 64, 65, 200, 300):
        sh = q_shift(plan, L)
        for a, b in ((0, L), (0, min(L, 128)), (128, L)):
            if a >= b:
                continue
            rows = torch.arange(a, b)
            order = tile_visit_rank(plan, rows, L, 0, (L + 31) // 32)
            spans = query_tile_spans(b - a, 64, (a + sh) % 64)
            assert spans[0][0] == 0 and spans[-1][1] == b - a
            for r0, r1 in spans:
                tiles = {(a + r + sh) // 64 for r in range(r0, r1)}
                assert len(tiles) == 1, (L, a, r0, r1)
                assert (order[r0:r1] == order[r0]).all()
    # and the FP8 model's O barely depends on the tiling (subnormal roundings under another running max only)
    from flamia_gen.numerics.reference_route import route_forward

    g = torch.Generator().manual_seed(9)
    cu = torch.tensor([0, 37, 237], dtype=torch.int32)
    q, k, v = (torch.randn(237, 2, 64, generator=g).to(torch.bfloat16).float() for _ in range(3))
    o0, l0 = route_forward(get_route("fp8_token"), q, k, v, cu, tile_m=64, tile_n=32, key_align=16, mma="sm90_fp8")
    o1, l1 = route_forward(get_route("fp8_token"), q, k, v, cu, tile_m=64, tile_n=32, key_align=16, mma="sm90_fp8",
                           q_align_end=True)
    assert torch.equal(l0, l1)
    assert float((o0 - o1).abs().max()) < 1e-3 * float(o0.abs().max())
