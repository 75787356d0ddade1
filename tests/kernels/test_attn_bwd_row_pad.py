"""Per-query words without bank conflicts in the FP8 backward (flag `bwd_row_pad`; templates/sm90/attn_bwd.py.j2;
docs/kernels/attn_bwd.md "Per-query words without bank conflicts").

CPU: the rendered module's own `row_word` is run on Python ints. With the flag every (column, word) has its own slot
inside the stage's `row_words`, and the column pairs that one quarter warp reads at once (threads t = 0 … 3: pairs
4·cg + t; 8-byte loads of one word of two columns, 16-byte loads of two words) fall in distinct banks; without it they
meet two by two, as the H200 profile showed (8 wavefronts per 16-byte load against 4). The XOR swizzle
(`bwd_row_swz`) gets the same banks without the padding: the default of every FP8 tile but fp8_pv's since round 30
(H200: faster than the padding or nothing on every measured row), fp8_pv's keeps the padding (the two measured even).
"""

from __future__ import annotations

import ast

import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.spec import load_specs


PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
ROUTES_ON = ("fp8_token", "fp8_token_bf16qk", "fp8_pv")  # the tiles that took the padding first (and tests below)
ON = [v for v in BWD if v.route in ROUTES_ON]
PADDED = [v for v in BWD if v.route == "fp8_pv"]  # the padding's default since round 30
SWIZZLED = [v for v in BWD if v.context.get("v_fmt") == "e4m3" and v.route != "fp8_pv"]


def _row_word(src: str):
    """The module's row_word with its constants, and its PARAMS."""
    tree = ast.parse(src)
    ns: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("ROW_WORDS", "PAIR_WORDS", "PARAMS"):
            ns[node.targets[0].id] = ast.literal_eval(node.value)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "row_word")
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "<row_word>", "exec"), ns)
    return ns["row_word"], ns


def _banks(row_word, c: int, which: int, words: int) -> set:
    return {(row_word(c, which) + i) % 32 for i in range(words)}


def test_defaults_swizzle_every_fp8_tile_but_fp8_pvs():
    assert len(PADDED) == 8 and len(SWIZZLED) == 48  # fp8_pv; six routes × D 64, 128 × causal or not × det or not
    for v in BWD:
        src = render_variant(v)
        _, ns = _row_word(src)
        assert (ns["PARAMS"].get("bwd_row_pad") is True) is (v in PADDED), v.name
        assert ("PAIR_WORDS" in ns) is (v in PADDED), v.name
        assert (ns["PARAMS"].get("bwd_row_swz") is True) is (v in SWIZZLED), v.name


@pytest.mark.parametrize("v", [next(v for v in ON if v.route == r) for r in ROUTES_ON], ids=lambda v: v.name)
def test_slots_are_distinct_and_a_quarter_warp_meets_no_bank_twice(v):
    m = v.param("tile_m")
    for src, padded in ((render_with_flags(v, bwd_row_pad=True), True),
                        (render_with_flags(v, bwd_row_pad=False, bwd_row_swz=False), False)):
        row_word, ns = _row_word(src)
        rw = ns["ROW_WORDS"]
        row_words = (ns["PAIR_WORDS"] * (m // 2)) if padded else rw * m
        assert f"self.row_words = {'PAIR_WORDS * (m // 2)' if padded else 'ROW_WORDS * m'}" in src
        slots = [row_word(c, w) for c in range(m) for w in range(rw)]
        assert len(set(slots)) == len(slots) and 0 <= min(slots) and max(slots) < row_words
        conflicts = 0
        for cg in range(m // 8):
            for w in range(0, rw, 2):
                # 16-byte load: words (w, w + 1) of columns c, c + 1 (4 words from row_word(c, w)); 8-byte: word w
                for n_words in (4, 2):
                    seen: set = set()
                    for t in range(4):
                        b = _banks(row_word, 8 * cg + 2 * t, w, n_words)
                        conflicts += bool(b & seen)
                        seen |= b
        assert (conflicts == 0) is padded, conflicts


@pytest.mark.parametrize("v", [x for x in BWD if x.route not in ROUTES_ON
                               and x.context.get("v_fmt") == "e4m3"][:3], ids=lambda v: v.name)
def test_flag_renders_on_the_other_fp8_tiles(v):
    src = render_with_flags(v, bwd_row_pad=True)
    ast.parse(src)
    assert "PAIR_WORDS = 20" in src and '"bwd_row_pad": True' in src


def test_ab_tags():
    """norowpad: fp8_pv's tile unpadded; norowswz: the other FP8 tiles as before round 30 (padded where dQ is on BF16,
    plain elsewhere); rowswz: fp8_pv's tile swizzled."""
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "fp8_token_bf16qk", "fp8_pv", "bf16", "mxfp8"))
    tagged = {t: [v for u, v in experiment_variants((t,), base_variants=bwd, experiments=EXPERIMENTS) if u == t]
              for t in ("norowpad", "norowswz", "rowswz")}
    assert len(tagged["norowpad"]) == 4 and {v.route for v in tagged["norowpad"]} == {"fp8_pv"}
    assert all("PAIR_WORDS" not in render_variant(v) and "bwd_row_swz" not in render_variant(v)
               for v in tagged["norowpad"])
    base = lambda v: render_variant(next(b for b in bwd if v.name.startswith(b.name + "_x")))  # noqa: E731
    # each tag turns its flag the other way from the base kernel's default
    assert len(tagged["rowswz"]) == 4
    assert all('"bwd_row_swz": True' in render_variant(v) and '"bwd_row_swz"' not in base(v) for v in tagged["rowswz"])
    assert len(tagged["norowswz"]) == 12
    assert {v.route for v in tagged["norowswz"]} == {"fp8_token", "fp8_token_bf16qk", "mxfp8"}
    for v in tagged["norowswz"]:
        src = render_variant(v)
        assert '"bwd_row_swz": True' in base(v) and "bwd_row_swz" not in src and ("PAIR_WORDS = 20" in src) is (v.route != "mxfp8"), v.name


def test_feasibility_model_agrees_with_the_template():
    """plan.feasibility sizes shared memory with the template's bwd_dq_bf16 and bwd_row_pad defaults: its predicates
    must name the same tiles as the rendered PARAMS, on every backward variant."""
    from flamia_gen.plan.feasibility import bwd_dq_bf16, bwd_row_pad, bwd_row_swz

    for v in BWD:
        p = dict(v.params)
        _, ns = _row_word(render_variant(v))
        assert bwd_dq_bf16(p) is bool(ns["PARAMS"].get("bwd_dq_bf16")), v.name
        assert bwd_row_pad(p) is bool(ns["PARAMS"].get("bwd_row_pad")), v.name
        assert bwd_row_swz(p) is bool(ns["PARAMS"].get("bwd_row_swz")), v.name
        # and under the A/B copies' overrides
        for over in ({"bwd_row_swz": True}, {"bwd_row_swz": False}, {"bwd_row_pad": True}, {"bwd_row_pad": False},
                     {"bwd_dq_bf16": False}):
            if "bwd_dq_bf16" in over and not bwd_dq_bf16(p):
                continue  # the template refuses the flag there
            _, ns = _row_word(render_with_flags(v, **over))
            q = dict(p, **over)
            assert bwd_dq_bf16(q) is bool(ns["PARAMS"].get("bwd_dq_bf16")), (v.name, over)
            assert bwd_row_pad(q) is bool(ns["PARAMS"].get("bwd_row_pad")), (v.name, over)
            assert bwd_row_swz(q) is bool(ns["PARAMS"].get("bwd_row_swz")), (v.name, over)


@pytest.mark.parametrize("v", [next(v for v in ON if v.route == r) for r in ROUTES_ON]
                         + [next(x for x in BWD if x.route == "mxfp8")], ids=lambda v: v.name)
def test_swizzle_keeps_the_slots_and_meets_no_bank_twice(v):
    """bwd_row_swz (the default but on fp8_pv's tile): the unpadded 16 words a pair, offsets XOR 8 for threads t = 2, 3; every slot distinct,
    the 16-byte groups of two words × two columns still contiguous, no quarter warp meets a bank twice."""
    m = v.param("tile_m")
    src = render_with_flags(v, bwd_row_swz=True)
    row_word, ns = _row_word(src)
    assert "PAIR_WORDS" not in ns and ns["PARAMS"]["bwd_row_swz"] is True and "bwd_row_pad" not in ns["PARAMS"]
    rw = ns["ROW_WORDS"]
    slots = [row_word(c, w) for c in range(m) for w in range(rw)]
    assert len(set(slots)) == len(slots) and max(slots) < rw * m
    for cg in range(m // 8):
        for t in range(4):
            c = 8 * cg + 2 * t
            for w in range(0, rw, 2):
                assert [row_word(c + d, w + e) for e in (0, 1) for d in (0, 1)] == list(range(row_word(c, w),
                                                                                              row_word(c, w) + 4))
        for w in range(0, rw, 2):
            for n_words in (4, 2):
                seen: set = set()
                for t in range(4):
                    b = _banks(row_word, 8 * cg + 2 * t, w, n_words)
                    assert not b & seen
                    seen |= b
