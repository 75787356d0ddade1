"""The backward's query-row permutation (flag `bwd_q_row_perm`, on by default for fp8_token since 2026-12-02; templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md
"The query-row permutation").

The Q and dO tiles (B operands of Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ) are loaded with their rows permuted within 16-query
groups, so Sᵀ column c holds query query_of_col(c) and the accumulators are already the E4M3 A fragments of dV and
dK. Everything that names a query by its column must go through the same map: the per-query words the producer
writes, the masks, the dS tile in shared memory (dQ's A operand, natural rows) and the dQ row factor's amax slot.
CPU only: the rendered module's own helpers run on Python ints against the wgmma fragment layouts; `-m compile`
cross-compiles. On the H200 `bench.bwd_experiments` compares dQ, dK, dV with the default bit for bit.
"""

from __future__ import annotations

import ast
import re

import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
FP8_TOKEN = [v for v in BWD if v.route == "fp8_token"]
_HELPERS = ("query_of_col", "col_of_query", "p_pack", "row_word")


def _module_fns(src: str, names):
    tree = ast.parse(src)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {f.name for f in fns} == set(names)
    ns: dict = {}
    for node in tree.body:  # the module's constants (ROW_WORDS, and PAIR_WORDS with bwd_row_pad)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("ROW_WORDS", "PAIR_WORDS"):
            ns[node.targets[0].id] = ast.literal_eval(node.value)
    exec(compile(ast.Module(body=fns, type_ignores=[]), "helpers", "exec"), ns)
    return [ns[n] for n in names]


def test_on_by_default_for_the_fp8_token_tile_only():
    """On for fp8_token's tile (every variant, `_det` too); bwd_q_row_perm=False renders the shuffle path of convert_p
    again. Every other route renders without it, and the flag does not change its kernel."""
    assert FP8_TOKEN
    for v in BWD:
        src = render_variant(v)
        on = v.route == "fp8_token"
        assert ("def query_of_col(" in src) is on and bool(rendered_params(src).get("bwd_q_row_perm")) is on
        if on:
            off = render_with_flags(v, bwd_q_row_perm=False)
            assert "shuffle_sync(send_a" not in src and "shuffle_sync(send_a" in off
            assert "query_of_col" not in off and "bwd_q_row_perm" not in rendered_params(off)
        else:
            assert render_with_flags(v, bwd_q_row_perm=True) == src, v.name


@pytest.mark.parametrize("v", FP8_TOKEN, ids=lambda v: v.name)
def test_mapping_matches_fragments_words_masks_and_dq_slots(v):
    src = render_with_flags(v, bwd_q_row_perm=True)
    query_of_col, col_of_query, p_pack, row_word = _module_fns(src, _HELPERS)
    m, n = v.param("tile_m"), v.param("tile_n")
    # a bijection inside every 16-query group, col_of_query its inverse
    assert sorted(query_of_col(c) for c in range(m)) == list(range(m))
    for c in range(m):
        assert query_of_col(c) // 16 == c // 16 and col_of_query(query_of_col(c)) == c
    # Sᵀ accumulator (m64nMk32 C): thread (g, t), index cp + 2·rh + 4·cg holds key row g + 8·rh, column 8·cg + 2t + cp.
    # E4M3 A of dV / dK (k32): register 4·kb + 2·q + rh, byte j holds key row g + 8·rh, query 32·kb + 16·q + 4t + j
    # (dOᵀ and Qᵀ, the B operands, are not permuted)
    for t in range(4):
        for kb in range(m // 32):
            for q in range(2):
                for rh in range(2):
                    for j, i in enumerate(p_pack(kb, q, rh)):
                        cp, rh_i, cg = i % 2, (i // 2) % 2, i // 4
                        assert rh_i == rh
                        assert query_of_col(8 * cg + 2 * t + cp) == 32 * kb + 16 * q + 4 * t + j
        # the masks' query: query_of_col(col) = query_of_col(8·cg + cp) + query_of_col(2t) (qcol0)
        for cg in range(m // 8):
            for cp in range(2):
                assert query_of_col(8 * cg + 2 * t + cp) == query_of_col(8 * cg + cp) + query_of_col(2 * t)
    packed = [i for kb in range(m // 32) for q in range(2) for rh in range(2) for i in p_pack(kb, q, rh)]
    assert sorted(packed) == list(range(m // 2))
    # per-query words: the producer writes query q's at row_word(col_of_query(q), w); a consumer reading column c
    # gets query_of_col(c)'s, which is the query its accumulator column holds
    assert "c = col_of_query(lane + 32 * j)  # the Sᵀ column that holds this query" in src
    written = {row_word(col_of_query(q), w): (q, w) for q in range(m) for w in range(6)}
    assert len(written) == 6 * m  # no two words share a slot
    for c in range(0, m, 2):  # load2 at row_word(c even, w): columns c, c + 1, their queries' words
        for w in range(6):
            assert [written[row_word(c, w) + d] for d in (0, 1)] == [(query_of_col(c), w), (query_of_col(c + 1), w)]
    # dS to shared memory: (key, column, buffer) through the composed layout must land on (key, query_of_col(column))
    # of the natural (queries, keys, 2) tile, linear index q + m·key + m·n·buf
    lay = "cute.make_layout((n, (2, 2, 2, 2, m // 16), 2),\n" \
          "                                                      stride=(m, (1, 4, 8, 2, 16), m * n))"
    assert lay in src
    for key in (0, 5, n - 1):
        for c in range(m):
            bits = (c & 1, (c >> 1) & 1, (c >> 2) & 1, (c >> 3) & 1, c >> 4)
            idx = m * key + sum(b * s for b, s in zip(bits, (1, 4, 8, 2, 16))) + m * n * 1
            assert idx == query_of_col(c) + m * key + m * n
    # the dQ amax (the FP8 dQ, bwd_dq_bf16 off: the nodq16 A/B copy; the default takes dQ on BF16 dS, no amax slots):
    # writers and the dS scale readers index slots by column; dQ row r (natural) reads col_of_query(r), the slot of
    # the column that holds query r
    assert "sAmax[buf * m + col_of_query(" not in src
    assert "sAmax[buf * m + col_of_query(tdQcdQ[2 * rh][0])]" in render_with_flags(v, bwd_q_row_perm=True,
                                                                                   bwd_dq_bf16=False)
    untrimmed = render_with_flags(v, bwd_q_row_perm=True, bwd_alu_trim=False, bwd_dq_bf16=False)
    assert "e = ds_exponent(bits_f32(sAmax[buf * m + col_of_query(tdQcdQ[2 * rh][0])]))" in untrimmed
    # the Q and dO TMA view: smem row r of a 16-aligned tile receives token offset (2, 4, 2, ·):(1, 4, 2, 16)(r)
    assert "((2, 4, 2, t_pad // 16), row), stride=((row, 4 * row, 2 * row, 16 * row), 1)" in src
    for r in range(m):
        assert (r % 2) + ((r // 2) % 4) * 4 + ((r // 8) % 2) * 2 + (r // 16) * 16 == query_of_col(r)
    # every query index of the tile's masks goes through the map (no raw `c + cp` left in the fp8 tile)
    tile = src[src.index("    def one_tile("):src.index("    def wait_dq_turn(") if "def wait_dq_turn(" in src
               else src.index("    def epilogue(")]
    assert not re.search(r"qq = qrow0 \+ c \+ cp", tile)


def test_runtime_pads_the_permuted_rows():
    """The wrapper gives the kernel Q and dO codes whose storage holds T_PAD rows (the TMA reads whole 16-row groups)."""
    import inspect

    from flamia_gen.runtime import attn_bwd

    import torch

    from flamia_gen.runtime.attn_fwd import k_rows_for_tma
    from flamia_gen.runtime.quant import padded_token_rows

    body = inspect.getsource(attn_bwd.run_attn_bwd)
    assert 'if params.get("bwd_q_row_perm"):' in body
    # T_PAD from dOᵀ (q_t and do_t agree where both exist: check_bwd_inputs; a bwd_dk_bf16 call has no q_t)
    assert "k_rows_for_tma(q, do_t.shape[2]), k_rows_for_tma(do, do_t.shape[2])" in body
    # unpadded codes: a copy whose storage holds T_PAD rows, the rows past T zero, the first T equal
    q = torch.randint(1, 255, (20, 2, 16), dtype=torch.uint8)
    got = k_rows_for_tma(q, 32)
    assert got.shape == q.shape and torch.equal(got, q) and got.data_ptr() != q.data_ptr()
    full = torch.as_strided(got, (32, 2, 16), got.stride())
    assert torch.count_nonzero(full[20:]) == 0
    # the quantizers' padded storage: no copy
    pq = padded_token_rows((20, 2, 16), torch.uint8, "cpu")
    assert k_rows_for_tma(pq, 32).data_ptr() == pq.data_ptr()


def test_bwd_experiments_off_tag_applies_to_fp8_token_only():
    from flamia_gen.bench import bwd_experiments as bx

    bwd, _ = bx.base_variants()
    tagged = [v for tag, v in bx.experiment_variants(("noqperm",), base_variants=bwd, experiments=bx.EXPERIMENTS)
              if tag == "noqperm"]
    assert tagged and all(v.route == "fp8_token" and dict(v.params)["bwd_q_row_perm"] is False for v in tagged)
    assert len(tagged) == len([v for v in bwd if v.route == "fp8_token"])


@pytest.mark.compile
def test_compile_q_row_perm(compile_sm90):
    """Cross-compiles for sm_90a; convert_p's shuffles go (2 per 16-query half and conversion: 16 per tile copy)."""
    v = next(x for x in FP8_TOKEN if x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    off = compile_sm90(v, source=render_with_flags(v, bwd_q_row_perm=False)).count("shfl.sync")
    on = compile_sm90(v, source=render_variant(v)).count("shfl.sync")
    assert on <= off - 32, (off, on)
