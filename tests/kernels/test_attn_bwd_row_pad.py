"""Per-query words without bank conflicts in the FP8 backward (flag `bwd_row_pad`; templates/sm90/attn_bwd.py.j2;
docs/kernels/attn_bwd.md "Per-query words without bank conflicts").

CPU: the rendered module's own `row_word` is run on Python ints. With the flag every (column, word) has its own slot
inside the stage's `row_words`, and the column pairs that one quarter warp reads at once (threads t = 0 … 3: pairs
4·cg + t; 8-byte loads of one word of two columns, 16-byte loads of two words) fall in distinct banks; without it they
meet two by two, as the H200 profile showed (8 wavefronts per 16-byte load against 4). On by default for the tiles
with dQ on BF16 (fp8_token, fp8_token_bf16qk) and fp8_pv's, off on the other FP8 tiles until measured there.
"""

from __future__ import annotations

import ast

import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant
from flamia_gen.spec import load_specs

from test_attn_bwd_template import _render_with as _render

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
ROUTES_ON = ("fp8_token", "fp8_token_bf16qk", "fp8_pv")
ON = [v for v in BWD if v.route in ROUTES_ON]


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


def test_on_by_default_for_the_dq_bf16_tiles_only():
    assert len(ON) == 24  # 3 routes × D 64, 128 × causal or not × deterministic or not
    for v in BWD:
        src = render_variant(v)
        _, ns = _row_word(src)
        assert (ns["PARAMS"].get("bwd_row_pad") is True) is (v in ON), v.name
        assert ("PAIR_WORDS" in ns) is (v in ON), v.name


@pytest.mark.parametrize("v", [next(v for v in ON if v.route == r) for r in ROUTES_ON], ids=lambda v: v.name)
def test_slots_are_distinct_and_a_quarter_warp_meets_no_bank_twice(v):
    m = v.param("tile_m")
    for src, padded in ((render_variant(v), True), (_render(v, bwd_row_pad=False), False)):
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
    src = _render(v, bwd_row_pad=True)
    ast.parse(src)
    assert "PAIR_WORDS = 20" in src and '"bwd_row_pad": True' in src


def test_ab_tag():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "fp8_token_bf16qk", "fp8_pv", "bf16", "mxfp8"))
    tagged = [v for t, v in experiment_variants(("norowpad",), base_variants=bwd, experiments=EXPERIMENTS)
              if t == "norowpad"]
    assert len(tagged) == 12 and {v.route for v in tagged} == set(ROUTES_ON)
    assert all("PAIR_WORDS" not in _render(v) for v in tagged)


def test_rowpad_tag_covers_the_other_fp8_tiles():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "fp8_tensor", "mxfp8", "bf16"))
    tagged = [v for t, v in experiment_variants(("rowpad",), base_variants=bwd, experiments=EXPERIMENTS) if t == "rowpad"]
    assert {v.route for v in tagged} == {"fp8_tensor", "mxfp8"}
    for v in tagged:
        src = _render(v)
        ast.parse(src)
        assert "PAIR_WORDS = 20" in src and "PAIR_WORDS" not in render_variant(next(b for b in bwd if b.name in v.name))


def test_feasibility_model_agrees_with_the_template():
    """plan.feasibility sizes shared memory with the template's bwd_dq_bf16 and bwd_row_pad defaults: its predicates
    must name the same tiles as the rendered PARAMS, on every backward variant."""
    from flamia_gen.plan.feasibility import bwd_dq_bf16, bwd_row_pad

    for v in BWD:
        p = dict(v.params)
        _, ns = _row_word(render_variant(v))
        assert bwd_dq_bf16(p) is bool(ns["PARAMS"].get("bwd_dq_bf16")), v.name
        assert bwd_row_pad(p) is bool(ns["PARAMS"].get("bwd_row_pad")), v.name
        # and under the A/B copies' overrides
        for over in ({"bwd_row_swz": True}, {"bwd_row_pad": False}, {"bwd_dq_bf16": False}):
            if "bwd_dq_bf16" in over and not bwd_dq_bf16(p):
                continue  # the template refuses the flag there
            _, ns = _row_word(_render(v, **over))
            q = dict(p, **over)
            assert bwd_dq_bf16(q) is bool(ns["PARAMS"].get("bwd_dq_bf16")), (v.name, over)
            assert bwd_row_pad(q) is bool(ns["PARAMS"].get("bwd_row_pad")), (v.name, over)


@pytest.mark.parametrize("v", [next(v for v in ON if v.route == r) for r in ROUTES_ON]
                         + [next(x for x in BWD if x.route == "mxfp8")], ids=lambda v: v.name)
def test_swizzle_keeps_the_slots_and_meets_no_bank_twice(v):
    """bwd_row_swz (experiment): the unpadded 16 words a pair, offsets XOR 8 for threads t = 2, 3; every slot distinct,
    the 16-byte groups of two words × two columns still contiguous, no quarter warp meets a bank twice."""
    m = v.param("tile_m")
    src = _render(v, bwd_row_swz=True)
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
