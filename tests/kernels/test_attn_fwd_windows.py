"""Forward windows for short documents (runtime.attn_fwd.fwd_schedule; templates/sm90/attn_fwd.py.j2).

CPU only. The schedule merges documents shorter than a query tile that start in the same tile_m chunk
into windows; the kernel runs a window as one pseudo-document whose key tiles are all masked and whose
rows see only their own document (row_doc). Checked here by brute force, with the rendered kernel's own
`key_tiling` and the template's window rule (n_mask = n_lo = 0, row_lim from row_doc) replayed on ints:
every real row is produced by exactly one item and sees exactly its document's visible keys.
"""

from __future__ import annotations

import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant
from flamia_gen.runtime.attn_fwd import fwd_schedule, make_work_list, num_work
from flamia_gen.spec import load_specs

from test_attn_fwd_template import _key_tiling_fn


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def test_many_one_token_documents_become_one_window_per_chunk():
    cu = _cu([1] * 1000)
    s = fwd_schedule(cu, 128, True, T=1000)
    assert s.cu.dtype == s.work.dtype == s.row_doc.dtype == torch.int32
    assert s.cu.shape == (1001,) and s.work.shape == (num_work(1000, 1000, 128), 3)
    # windows start at every chunk of 128 tokens; unused entries are T
    assert s.cu[:9].tolist() == [0, 128, 256, 384, 512, 640, 768, 896, 1000] and (s.cu[8:] == 1000).all()
    real = s.work[s.work[:, 0] >= 0]
    assert len(real) == 8 and (real[:, 1] == 0).all() and (real[:, 2] == 1).all()
    assert s.row_doc[:3].tolist() == [[0, 1], [1, 2], [2, 3]] and s.row_doc[-1].tolist() == [999, 1000]


def test_long_documents_and_lone_short_ones_are_not_windows():
    cu = _cu([300, 5, 200, 1])  # a short document alone in its chunk is itself (flag 0)
    s = fwd_schedule(cu, 128, True, T=506)
    assert torch.equal(s.cu, cu) and torch.equal(s.work, make_work_list(cu, 128, True, T=506))
    assert (s.work[:, 2] <= 0).all()


def _docs(seed):
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < 1500:
        r = torch.rand(1, generator=g).item()
        lens.append(int(torch.randint(0, 6, (1,), generator=g)) if r < 0.55 else
                    int(torch.randint(6, 140, (1,), generator=g)) if r < 0.9 else
                    int(torch.randint(140, 400, (1,), generator=g)))
    return lens


def _variants():
    plan = make_plan(load_specs(), arch="sm90")
    out = {}
    for v in plan.variants:
        if v.kind.value == "attn_fwd" and not v.param("intra_wg_overlap"):
            # D = 128 renders the window pass (fwd_window_pass), D = 64 the per-row limits: both rules replayed
            key = (v.param("q_fmt") != "bf16", v.param("causal"), v.param("tile_m"), v.param("tile_n"),
                   v.param("head_dim"))
            out.setdefault(key, v)
    return sorted(out.values(), key=lambda v: v.name)


def _row_visibility(v, lens, row_bounds=True, src=None):
    """Replay the schedule and the kernel's masks on ints: {token: keys its row sees} and the
    row_doc table. `row_bounds=False` drops the window rule's per-row bounds (a negative control);
    `src`: another render of `v` (a flag overridden)."""
    src = src or render_variant(v)
    key_tiling, c = _key_tiling_fn(src)
    tm, tn, causal = c["TILE_M"], c["TILE_N"], v.param("causal")
    # fwd_window_pass: pass 1 masks with the unit's limits ((key < 0) only on the FP8 PV side, whose tile 0
    # may hold the previous document's keys), then a second pass cuts a window's rows to their documents
    wpass, pv8 = '"fwd_window_pass": True' in src, v.param("v_fmt") == "e4m3"
    cu = _cu(lens)
    s = fwd_schedule(cu, tm, causal, T=int(cu[-1]), tile_n=tn)
    assert int((s.work[:, 2] == 1).sum()) > 0  # the documents do exercise windows
    pcu, row_doc = s.cu.tolist(), s.row_doc.tolist()
    seen = {}
    for doc, m_block, window in s.work.tolist():
        if doc < 0:
            continue
        start, dlen = pcu[doc], pcu[doc + 1] - pcu[doc]
        kb, delta, nblk, n_mask, n_lo = key_tiling(m_block, start, dlen)
        if window:
            n_mask, n_lo = 0, 0
        assert kb % c["KEY_ALIGN"] == 0 and kb + delta == start
        for r in range(m_block * tm, min((m_block + 1) * tm, dlen)):  # rows the epilogue writes
            tok = start + r
            own = window and row_bounds
            lo, hi = (row_doc[tok][0] - start, row_doc[tok][1] - start) if own else (0, dlen)
            keys = set()
            for n in range(nblk):
                for kk in range(n * tn - delta, (n + 1) * tn - delta):
                    if n >= n_mask or (n_lo and n == 0):  # masked tile: the kernel's mask
                        if wpass:
                            if (pv8 and kk < 0) or kk >= dlen or (causal and kk > r):
                                continue
                            if own and (kk < lo or kk >= hi):  # the window pass
                                continue
                        elif kk < lo or kk >= hi or (causal and kk > r):
                            continue
                    keys.add(start + kk)
            assert tok not in seen, tok  # exactly one item writes a row
            seen[tok] = keys
    return seen, row_doc


def _wrong_rows(v, seen, row_doc):
    causal = v.param("causal")
    return [tok for tok, keys in seen.items()
            if keys != (set(range(row_doc[tok][0], tok + 1)) if causal else set(range(*row_doc[tok])))]


@pytest.mark.parametrize("v", _variants(), ids=lambda v: v.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_row_sees_exactly_its_documents_keys(v, seed):
    lens = _docs(seed)
    seen, row_doc = _row_visibility(v, lens)
    assert sorted(seen) == list(range(sum(lens)))
    assert _wrong_rows(v, seen, row_doc) == []


@pytest.mark.parametrize("causal", [True, False])
def test_window_check_can_fail(causal):
    """The check above catches a kernel that forgets the window's per-row bounds."""
    v = next(v for v in _variants() if v.param("causal") == causal)
    seen, row_doc = _row_visibility(v, _docs(0), row_bounds=False)
    assert len(_wrong_rows(v, seen, row_doc)) > 100


def test_a_cta_stops_at_the_first_padding_entry():
    """Producer and consumers leave the persistent loop at the first padding unit (doc < 0): the work
    list puts padding last and a CTA's units only grow. Without it 131072 one-token documents left
    ~131072·HQ padding units, each a global load of the work list (7 ms on the H200)."""
    for v in _variants():
        src = render_variant(v)
        assert src.count("            if doc < 0:\n                # padding entries come last") == 2, v.name
    s = fwd_schedule(_cu([1] * 5000), 128, True, T=5000)
    valid = (s.work[:, 0] >= 0).tolist()
    assert valid == sorted(valid, reverse=True) and sum(valid) == 40  # 40 windows, then padding only


def test_run_attn_fwd_refuses_a_schedule_of_other_tiles():
    from flamia_gen.runtime.attn_fwd import run_attn_fwd
    from test_attn_fwd_template import VARIANTS, _fp8_inputs, _literals

    v = next(v for v in VARIANTS if v.param("q_fmt") == "e4m3" and v.param("tile_m") == 128)
    lit = _literals(render_variant(v))
    x = _fp8_inputs()
    good = fwd_schedule(x["cu_seqlens"], 128, True, T=40)
    calls = []
    run_attn_fwd(lambda *a: calls.append(a), lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"],
                 x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], schedule=good)
    assert len(calls) == 1
    bad = fwd_schedule(x["cu_seqlens"], 16, True, T=40)  # another tile_m: more work rows
    with pytest.raises(ValueError, match="schedule: built for other documents or tiles"):
        run_attn_fwd(lambda *a: None, lit["ARGS"], x["q"], x["k"], x["v"], x["q_scale"], x["k_scale"],
                     x["v_scale"], cu_seqlens=x["cu_seqlens"], params=lit["PARAMS"], schedule=bad)


def test_window_pass_on_by_default_and_off_renders_the_per_row_limits():
    """fwd_window_pass: on (no per-row limits in the tile loops, a second pass for windows); off renders the
    kernel of 2026-11-29 (per-row limits from row_doc kept across the loops). Both rules are replayed above
    (the off rule through the override below)."""
    from flamia_gen.render.render import render_with_flags

    for d in (64, 128):
        v = next(v for v in _variants() if v.param("head_dim") == d and v.param("q_fmt") == "e4m3"
                 and v.param("tile_m") == 192)
        on, off = render_variant(v), render_with_flags(v, fwd_window_pass=False)
        assert '"fwd_window_pass": True' in on and "row_lim" not in on and "lim_len = -doc_len" in on
        assert "if lim_len < 0:" in on and on.count("mRowDoc[rtok, 0]") == 1
        assert '"fwd_window_pass"' not in off and "lim_len" not in off and "row_lim[2 + rh] = doc_len" in off


@pytest.mark.parametrize("causal", [True, False])
def test_per_row_limit_rule_still_covers_every_row(causal):
    """The off rule (fwd_window_pass=False: row_lim from row_doc in every masked compare) replayed on ints."""
    from flamia_gen.render.render import render_with_flags

    v = next(v for v in _variants() if v.param("causal") == causal and v.param("q_fmt") == "e4m3")
    off = render_with_flags(v, fwd_window_pass=False)
    assert '"fwd_window_pass"' not in off  # the off rule is the one replayed
    seen, row_doc = _row_visibility(v, _docs(0), src=off)
    assert sorted(seen) == list(range(sum(_docs(0)))) and _wrong_rows(v, seen, row_doc) == []
