"""The backward's mask-free path for interior tiles (template flag `bwd_interior_nomask`,
templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md "Interior tiles without masks").

CPU only. The flag is on by default since 2026-11-29 (H200: same cosines, −6 … −15 % backward
time); explicit False renders the masked-everywhere kernel (no interior path, no PARAMS key). On, `bwd_interior` (the rendered module's own function, run on Python ints) must classify a
(key tile, query tile) pair as interior exactly when no (query, key) of it is outside the document
or, causal, has key > query: checked against a brute-force visibility matrix. `compile` tests
cross-compile the flag-on variants for sm_90a and count the mask selects in the PTX.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs


@pytest.fixture(scope="module")
def variants():
    plan = make_plan(load_specs(), arch="sm90")
    # the BF16 and E4M3-score tiles (the BF16-score routes' modes have their own tests: test_attn_bwd_scores_bf16)
    vs = [v for v in plan.variants if v.kind.value == "attn_bwd" and v.route in ("bf16", "fp8_token")]
    assert len(vs) == 16  # 2 routes × causal/non-causal × det/not × D = 64, 128
    return vs


def _render_no_bulk(v, **over):
    """render_with_flags with the dQ bulk reduce off unless asked (these tests look at the mask and the
    per-element red path it predicates)."""
    return render_with_flags(v, **{"bwd_dq_bulk": False, **over})


def _is_det(v) -> bool:
    return bool(dict(v.params).get("deterministic", False))


# ----------------------------------------------------------------------------- render
def test_default_is_on_and_off_renders_the_masked_kernel(variants):
    """The default render is the flag-on kernel; explicit False has no interior path, no PARAMS key."""
    for v in variants:
        src = render_variant(v)
        assert _render_no_bulk(v, bwd_interior_nomask=True, bwd_dq_bulk=True) == src, v.name
        assert rendered_params(src)["bwd_interior_nomask"] is True
        off = _render_no_bulk(v, bwd_interior_nomask=False)
        assert off != src
        assert "bwd_interior" not in off and "mask: cutlass.Constexpr[bool]" not in off
        assert "bwd_interior_nomask" not in rendered_params(off)


def _fn(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _is_const_mask(test: ast.expr) -> bool:
    return (isinstance(test, ast.Call) and getattr(test.func, "id", "") == "const_expr"
            and isinstance(test.args[0], ast.Name) and test.args[0].id == "mask")


def _under_const_mask(fn: ast.FunctionDef, pred) -> list[bool]:
    """For every node matching `pred` in fn: is it inside the body of an `if const_expr(mask):`?"""
    out = []

    def walk(node, inside):
        if pred(node):
            out.append(inside)
        if isinstance(node, ast.If) and _is_const_mask(node.test):
            for c in node.body:
                walk(c, True)
            for c in node.orelse:
                walk(c, inside)
            return
        for c in ast.iter_child_nodes(node):
            walk(c, inside)

    walk(fn, False)
    return out


def test_flag_on_render_specialises_one_tile(variants):
    for v in variants:
        src = _render_no_bulk(v, bwd_interior_nomask=True)
        assert rendered_params(src)["bwd_interior_nomask"] is True
        assert rendered_params(src)["deterministic_dq"] is _is_det(v)
        tree = ast.parse(src)
        one_tile = _fn(tree, "AttnBwdSm90", "one_tile")
        last = one_tile.args.args[-1]
        assert last.arg == "mask" and ast.unparse(last.annotation) == "cutlass.Constexpr[bool]"
        # every use of the document-local indices kk, qq (the mask compares) is under const_expr(mask)
        uses = _under_const_mask(one_tile, lambda n: isinstance(n, ast.Name) and n.id in ("kk", "qq"))
        assert uses and all(uses), v.name
        # the dQ row predicate (qrow0 + r ... doc_len) only on masked tiles; both paths reduce-add
        row_pred = _under_const_mask(one_tile, lambda n: isinstance(n, ast.Compare)
                                     and "qrow0 + r" in ast.unparse(n.left))
        assert len(row_pred) == 2 and all(row_pred)
        adds = _under_const_mask(one_tile, lambda n: isinstance(n, ast.Call)
                                 and getattr(n.func, "id", "") == "red_add_v2_f32")
        assert sorted(adds) == [False, True]
        # the NaN-propagating amax (quantizer contract) stays on both paths: not under the mask
        if v.route == "fp8_token":
            nan_max = _under_const_mask(one_tile, lambda n: isinstance(n, ast.Call)
                                        and getattr(n.func, "id", "") == "fmax_nan")
            assert nan_max and not any(nan_max)
        # call site: mask=False exactly on [i_lo, i_hi) of bwd_interior, in the unchanged m order
        mma = _fn(tree, "AttnBwdSm90", "mma")
        ifs = [n for n in ast.walk(mma) if isinstance(n, ast.If)
               and ast.unparse(n.test) == "(m_block >= i_lo) & (m_block < i_hi)"]
        assert len(ifs) == 1
        (call_in,), (call_out,) = ([c.value for c in b] for b in (ifs[0].body, ifs[0].orelse))
        assert ast.unparse(call_in.func) == ast.unparse(call_out.func) == "self.one_tile"
        assert ast.unparse(call_in.args[:-1]) == ast.unparse(call_out.args[:-1])
        assert [call_in.args[-1].value, call_out.args[-1].value] == [False, True]
        assert "i_lo, i_hi = bwd_interior(n_block, delta, doc_len)" in src
        assert src.count("self.one_tile(") == 2


# ----------------------------------------------------------------------------- classification
def _functions(src: str, tile_m=None, tile_n=None):
    """bwd_tiling and bwd_interior of a rendered module, run on Python ints (optionally with
    other tile sizes: both read TILE_M / TILE_N / KEY_ALIGN as module globals)."""
    tree = ast.parse(src)
    consts, fns = {}, []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("TILE_M", "TILE_N", "KEY_ALIGN", "CAUSAL"):
            consts[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.FunctionDef) and node.name in ("bwd_tiling", "bwd_interior"):
            fns.append(node)
    assert {f.name for f in fns} == {"bwd_tiling", "bwd_interior"}
    if tile_m:
        consts.update(TILE_M=tile_m, TILE_N=tile_n)
    ns = dict(consts, cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=fns, type_ignores=[]), "bwd_interior", "exec"), ns)
    return ns["bwd_tiling"], ns["bwd_interior"], consts


def _classify(tiling, interior, c, start: int, L: int) -> tuple[list, int]:
    """(mistakes, interior pairs) of one document: a mistake is (n, m, interior?, needs a mask?) for
    a visited pair where `interior` disagrees with a brute-force check of all its (query, key)
    pairs (document-local indices, fp8 delta included)."""
    M, N, causal = c["TILE_M"], c["TILE_N"], c["CAUSAL"]
    delta = start % c["KEY_ALIGN"]
    n_tiles = -(-(L + delta) // N) + 1  # one past the last: bwd_tiling gives it no query tile
    m_tiles = -(-(L + delta) // M)
    q = torch.arange(m_tiles * M) - delta
    k = torch.arange(n_tiles * N) - delta
    vis = ((q >= 0) & (q < L))[:, None] & ((k >= 0) & (k < L))[None, :]
    if causal:
        vis &= k[None, :] <= q[:, None]
    bad, n_in = [], 0
    for n in range(n_tiles):
        base, d, m_lo, m_hi = tiling(n, start, L)
        assert d == delta and base == start - delta
        i_lo, i_hi = interior(n, d, L)
        for m in range(m_lo, m_hi):
            clean = bool(vis[m * M:(m + 1) * M, n * N:(n + 1) * N].all())
            n_in += i_lo <= m < i_hi
            if (i_lo <= m < i_hi) != clean:
                bad.append((n, m, i_lo <= m < i_hi, not clean))
    return bad, n_in


def _misclassified(tiling, interior, c, start: int, L: int) -> list:
    return _classify(tiling, interior, c, start, L)[0]


def _documents(seed: int, n_docs: int = 60):
    """Random packed documents (starts mostly not multiples of 16), lengths 1..600, plus edges and
    two longer ones."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 601, (n_docs,), generator=g).tolist()
    off = int(torch.randint(0, 10 ** 5, (1,), generator=g))
    starts = [off]
    for L in lens[:-1]:
        starts.append(starts[-1] + L)
    docs = list(zip(starts, lens))
    edges = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 383, 384, 385, 600]
    docs += [(s, L) for s in (0, 1, 7, 15, 16, 17, 33, 4096, 4111) for L in edges]
    docs += [(s, L) for s in (0, 7, 16) for L in (1000, 2049)]  # many interior pairs for every tile size
    return docs


_TILES = [None, (128, 128), (192, 128), (64, 64), (16, 128)]  # None: the spec's tiles (64, 128)


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])  # key_align 1 and 16
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tiles", _TILES, ids=lambda t: "spec" if t is None else f"m{t[0]}n{t[1]}")
def test_interior_classification_is_exact(variants, route, causal, tiles):
    """Interior ⇔ every (query, key) of the pair is in the document and visible, for every pair a
    unit visits: `⇒` is the safety of the mask-free path, `⇐` its coverage (no mask left behind)."""
    v = next(v for v in variants if v.route == route and v.param("causal") == causal and not _is_det(v))
    tiling, interior, c = _functions(_render_no_bulk(v, bwd_interior_nomask=True), *(tiles or (None, None)))
    assert c["KEY_ALIGN"] == (16 if route == "fp8_token" else 1) and c["CAUSAL"] == causal
    n_interior = 0
    for start, L in _documents(seed=7 + causal + 2 * (route == "bf16")):
        bad, n_in = _classify(tiling, interior, c, start, L)
        assert bad == [], (start, L)
        n_interior += n_in
    assert n_interior > 50  # the documents do exercise the mask-free path


def test_classification_check_catches_wrong_rules(variants):
    """The brute-force check above fails on plausible mistakes (it can fail)."""
    v = next(v for v in variants if v.route == "fp8_token" and v.param("causal") and not _is_det(v))
    tiling, interior, c = _functions(_render_no_bulk(v, bwd_interior_nomask=True))
    wrong = {
        # causal bound off by one query tile (the diagonal tile counted as interior)
        "diagonal": lambda n, d, L: (interior(n, d, L)[0] - 1, interior(n, d, L)[1]),
        # fp8 delta ignored: key tile 0 holds tokens of the previous document
        "delta": lambda n, d, L: interior(n, 0, L),
        # one query tile more at the end (a partial last query tile counted as interior)
        "tail": lambda n, d, L: (lambda lo, hi: (lo, hi + (hi > lo)))(*interior(n, d, L)),
        # the keys' document bounds forgotten (a key tile reaching past doc_len)
        "keys": lambda n, d, L: (interior(n, d, L)[0], max(interior(n, d, L)[1], (L + d) // c["TILE_M"])),
    }
    docs = [(s, L) for s in (0, 5, 16, 21) for L in (100, 300, 517, 600)]
    for why, fn in wrong.items():
        assert any(_misclassified(tiling, fn, c, s, L) for s, L in docs), why
    assert not any(_misclassified(tiling, interior, c, s, L) for s, L in docs)


# ----------------------------------------------------------------------------- compile
_PTX_ENTRY = re.compile(r"^\.visible \.entry", re.M)


def _counts(ptx: str) -> dict:
    return {"entries": len(_PTX_ENTRY.findall(ptx)), "selp.f32": ptx.count("selp.f32"),
            "ex2": ptx.count("ex2.approx.ftz.f32"), "max.NaN": ptx.count("max.NaN.f32"),
            "red.v2": ptx.count("red.global.add.v2.f32")}


@pytest.mark.compile
@pytest.mark.parametrize("route, causal", [("fp8_token", True), ("bf16", False)])
def test_compile_flag_on_drops_the_mask_selects(variants, compile_sm90, tmp_path, route, causal):
    """Flag on: the kernel holds two copies of the tile (ex2 and dQ reduce-adds double) but the
    interior copy adds no mask select: selp.f32 per tile copy at most about half of flag off.
    The NaN-propagating amax (fp8) stays in both copies."""
    v = next(v for v in variants if v.route == route and v.param("causal") == causal and not _is_det(v))
    # the ALU trim off in both: its reduce-scatter adds selects of its own (tests/kernels/test_attn_bwd_dq_amax.py)
    off = _counts(compile_sm90(v, source=_render_no_bulk(v, bwd_interior_nomask=False, bwd_alu_trim=False)))
    for p in (tmp_path / "dump").glob("*.ptx"):  # the fixture's per-test dump folder: next build only
        p.unlink()
    on = _counts(compile_sm90(v, source=_render_no_bulk(v, bwd_interior_nomask=True, bwd_alu_trim=False)))
    assert off["entries"] == on["entries"] == 1
    assert off["ex2"] == 32 and on["ex2"] == 2 * off["ex2"]  # 32 exp2 per thread per tile copy
    assert on["red.v2"] == 2 * off["red.v2"] == 32
    assert off["selp.f32"] >= 64  # masked: ≥ one select per P and per dS element (32 each)
    assert on["selp.f32"] - off["selp.f32"] <= off["selp.f32"] // 8, (off, on)  # interior copy: ~none
    assert on["selp.f32"] / 2 < 0.6 * off["selp.f32"]  # per tile copy
    if route == "fp8_token":
        assert on["max.NaN"] == 2 * off["max.NaN"] > 0


@pytest.mark.compile
def test_compile_flag_on_deterministic_variant(variants, compile_sm90):
    v = next(v for v in variants if v.route == "fp8_token" and v.param("causal") and _is_det(v))
    assert v.name.endswith("_det")
    ptx = compile_sm90(v, source=_render_no_bulk(v, bwd_interior_nomask=True))
    c = _counts(ptx)
    assert c["entries"] == 1 and c["ex2"] == 64 and c["red.v2"] == 32  # both tile copies
    # the ordered-dQ protocol is in both copies
    assert ptx.count("red.release.gpu.global.add.s32") == 2 and "ld.global.acquire.gpu.b32" in ptx
