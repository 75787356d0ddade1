"""Backward windows for short documents and the padding exit (runtime.attn_bwd.bwd_schedule;
templates/sm90/attn_bwd.py.j2).

CPU only. The schedule merges documents shorter than a key tile that start in the same tile_n chunk
into windows (runtime.attn_fwd.merge_windows); the kernel runs a window as one pseudo-document whose
query tiles are all masked and where a key row is seen only by the queries of its own document
(`klim` from row_doc). Checked by brute force with the rendered kernel's own `bwd_tiling` and
`bwd_interior` and the template's key-range rule replayed on ints: every visible (query, key) pair of
every real document is visited exactly once, no other pair survives the mask, and every key's dK/dV
row is written by exactly one unit.
"""

from __future__ import annotations

import ast

import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.runtime.attn_bwd import bwd_schedule, dq_tile_offsets, make_work_list, num_work, run_attn_bwd
from flamia_gen.spec import load_specs


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _variants():
    plan = make_plan(load_specs(), arch="sm90")
    out = {}
    for v in plan.variants:
        if v.kind.value == "attn_bwd" and v.param("head_dim") == 128:
            out.setdefault((v.route, v.param("causal")), v)
    return [out[k] for k in sorted(out)]


def _kernel_fns(src: str):
    """The rendered module's bwd_tiling and bwd_interior and its tile constants, on Python ints."""
    tree = ast.parse(src)
    lit = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("TILE_M", "TILE_N", "KEY_ALIGN"):
            lit[node.targets[0].id] = ast.literal_eval(node.value)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("bwd_tiling", "bwd_interior")]
    ns = dict(lit, cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=fns, type_ignores=[]), "bwd", "exec"), ns)
    return ns["bwd_tiling"], ns["bwd_interior"], lit


def _docs(seed, total=1200):
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        r = torch.rand(1, generator=g).item()
        lens.append(int(torch.randint(0, 6, (1,), generator=g)) if r < 0.55 else
                    int(torch.randint(6, 140, (1,), generator=g)) if r < 0.9 else
                    int(torch.randint(140, 400, (1,), generator=g)))
    return lens


def test_many_one_token_documents_become_one_window_per_key_tile_chunk():
    s = bwd_schedule(_cu([1] * 1000), 64, 128, True, key_align=16, T=1000)
    assert s.cu.dtype == s.work.dtype == s.row_doc.dtype == s.dq_tile_off.dtype == torch.int32
    assert s.work.shape == (num_work(1000, 1000, 128), 3)
    assert s.cu[:9].tolist() == [0, 128, 256, 384, 512, 640, 768, 896, 1000] and (s.cu[8:] == 1000).all()
    real = s.work[s.work[:, 0] >= 0]
    assert len(real) == 8 and (real[:, 1] == 0).all() and (real[:, 2] == 1).all()
    # padding last (the kernel's exit relies on it); dQ tile columns from the windows, not the documents
    valid = (s.work[:, 0] >= 0).tolist()
    assert valid == sorted(valid, reverse=True)
    assert torch.equal(s.dq_tile_off, dq_tile_offsets(s.cu, 64, 16))


def test_long_documents_and_lone_short_ones_are_not_windows():
    cu = _cu([300, 5, 200, 1])  # a short document alone in its chunk is itself (flag 0)
    s = bwd_schedule(cu, 64, 128, True, T=506)
    assert torch.equal(s.cu, cu) and torch.equal(s.work, make_work_list(cu, 64, 128, True, T=506))
    assert (s.work[:, 2] <= 0).all()


def _replay(v, lens, key_range=True):
    """The schedule and the kernel's masks on ints → ({(q_tok, k_tok): visits}, {k_tok: dK writes})."""
    tiling, interior, c = _kernel_fns(render_variant(v))
    M, N, A, causal = c["TILE_M"], c["TILE_N"], c["KEY_ALIGN"], v.param("causal")
    cu = _cu(lens)
    T = int(cu[-1])
    s = bwd_schedule(cu, M, N, causal, key_align=A, T=T)
    assert int((s.work[:, 2] == 1).sum()) > 0  # the documents do exercise windows
    pcu, row_doc = s.cu.tolist(), s.row_doc.tolist()
    pairs, writes = {}, {}
    for doc, n, window in s.work.tolist():
        if doc < 0:
            continue
        start, dlen = pcu[doc], pcu[doc + 1] - pcu[doc]
        base, delta, m_lo, m_hi = tiling(n, start, dlen)
        if m_lo >= m_hi:
            continue
        i_lo, i_hi = interior(n, delta, dlen)
        if window:
            i_lo, i_hi = 0, 0
        key0 = n * N - delta
        for r in range(N):
            kk = key0 + r
            # klim: queries that see key row r (the template's rule); outside the document: none
            lo, hi = 0, 0
            if 0 <= kk < dlen:
                lo, hi = 0, dlen
                if window and key_range:
                    lo, hi = row_doc[start + kk][0] - start, row_doc[start + kk][1] - start
                writes[start + kk] = writes.get(start + kk, 0) + 1  # the epilogue writes rows in [0, doc_len)
            for m in range(m_lo, m_hi):
                masked = not (i_lo <= m < i_hi)
                for qq in range(m * M - delta, (m + 1) * M - delta):
                    if masked and (qq < lo or qq >= hi or (causal and kk > qq)):
                        continue
                    key = (start + qq, start + kk)
                    pairs[key] = pairs.get(key, 0) + 1
    return pairs, writes, row_doc, T


def _expected(row_doc, T, causal):
    return {(q, k) for q in range(T) for k in range(row_doc[q][0], (q + 1) if causal else row_doc[q][1])}


@pytest.mark.parametrize("v", _variants(), ids=lambda v: v.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_visible_pair_once_and_every_key_row_written_once(v, seed):
    pairs, writes, row_doc, T = _replay(v, _docs(seed))
    assert set(pairs) == _expected(row_doc, T, v.param("causal"))
    assert all(c == 1 for c in pairs.values())
    assert sorted(writes) == list(range(T)) and all(c == 1 for c in writes.values())


@pytest.mark.parametrize("causal", [True, False])
def test_window_check_can_fail(causal):
    """The check above catches a kernel that forgets a window key's own-document range."""
    v = next(v for v in _variants() if v.param("causal") == causal)
    pairs, _, row_doc, T = _replay(v, _docs(0), key_range=False)
    assert len(set(pairs) - _expected(row_doc, T, causal)) > 100


def test_kernel_reads_key_ranges_and_stops_at_padding():
    """Rendered kernels: the window flag decoded, no interior tile in a window, the mask from klim,
    and producer and consumers leave the persistent loop at the first padding unit."""
    for v in _variants():
        src = render_variant(v)
        assert "window = mWork[item, 2]" in src
        assert "klim[rh] = mRowDoc[doc_start + kk, 0] - doc_start" in src
        assert "i_lo, i_hi = Int32(0), Int32(0)  # window: every query tile masked" in src
        assert "(qq < klim[rh]) | (qq >= klim[2 + rh])" in src
        # producer and consumer loops (and fp8_tensor's amax sweep, or the dQ writer warp's loop, a third one)
        sweeps = 1 if "def amax_sweep(" in src else 0
        writer = 1 if "def dq_writer(" in src else 0
        assert src.count("            if doc < 0:\n") == 2 + sweeps + writer, v.name
        assert sweeps == (v.route == "fp8_tensor"), v.name
        if v.route == "fp8_token":
            # the dV reference per key row, over the row's own document's queries (klim on masked tiles)
            # (bwd_alu_trim, on by default: dO's exponent word is its int code, the maxima integer)
            assert "mxr[rh] = cutlass.max(mxr[rh], e)" in src
            assert "pow2i(Int32(8 - 127) + Int32(f32_bits(ed[cp])) - run[2 + rh])" in src
            off = render_with_flags(v, bwd_alu_trim=False)
            assert "mxr[rh] = fmax2(mxr[rh], e)" in off and "pow2i(Int32(8) + Int32(ed[cp]) - run[2 + rh])" in off
            # masked tiles per row; interior tiles (one document, both rows equal) share run[2] = run[3]; the split
            # (the D = 128 non-deterministic tile's default since round 45) scales P in dV's operand conversion
            if rendered_params(src).get("bwd_sdp_split"):
                assert "self.convert_p_scaled(acc_S, tdVrP, sRow, rbase, tScS, run[2], run[3], False)" in src
            else:
                assert "self.dv_scale_rows(acc_S, acc_dV, sRow, rbase, tScS, run, mxr)" in src
            assert "                run[2] = r_new\n                run[3] = r_new\n" in src


def test_run_attn_bwd_passes_the_schedule_and_refuses_one_of_other_documents():
    from test_attn_bwd_template import _bf16_inputs, _literals

    v = next(v for v in _variants() if v.route == "bf16" and v.param("causal"))
    lit = _literals(render_variant(v))
    seen = []
    x = _bf16_inputs()  # documents [0, 10) and [10, 40): one window
    run_attn_bwd(lambda *a: seen.extend(a), lit["ARGS"], **x, params=lit["PARAMS"])
    by = dict(zip([a["name"] for a in lit["ARGS"]], seen))
    # the unit list (one CTA per unit, the default): the window's key tile for KV heads 0 and 1, then padding
    assert by["cu_seqlens"].tolist() == [0, 40, 40] and by["work"][:2].tolist() == [[0, 0, 1, 0], [0, 0, 1, 1]]
    assert bool((by["work"][2:, 0] < 0).all())
    assert by["row_doc"].tolist() == [[0, 10]] * 10 + [[10, 40]] * 30
    other = bwd_schedule(torch.tensor([0, 40], dtype=torch.int32), 64, 128, True, T=40)
    with pytest.raises(ValueError, match="schedule: built for other documents or tiles"):
        run_attn_bwd(lambda *a: None, lit["ARGS"], **x, params=lit["PARAMS"], schedule=other)
