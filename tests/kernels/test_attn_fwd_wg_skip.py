"""fwd_wg_skip (template flag of templates/sm90/attn_fwd.py.j2; docs/kernels/attn_fwd.md "Dead warpgroup tiles"):
a consumer warpgroup skips the key tiles none of its 64 rows can see. These tests check, on Python ints, that the
rendered rule marks exactly the tiles without a visible (row, key) pair, that the skipped causal tiles come before
every live tile of the warpgroup (so O, m and l are still at their start values: skipping them is bit-exact), and
that a skipped tile keeps the pipelines' and the ex2 turns' protocol."""

from __future__ import annotations

import ast
import re

import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags
from flamia_gen.spec import load_specs

VARIANTS = [v for v in make_plan(load_specs()).variants if v.kind.value == "attn_fwd" and v.arch.value == "sm90"]
NO_OVERLAP = [v for v in VARIANTS if not v.param("intra_wg_overlap")]
WG3 = [v for v in NO_OVERLAP if v.param("compute_warpgroups") == 3]


def _key_tiling(src: str):
    tree = ast.parse(src)
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) in ("TILE_M", "TILE_N", "KEY_ALIGN")}
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "key_tiling")
    ns = dict(consts, cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "key_tiling", "exec"), ns)
    return ns["key_tiling"], consts


def _dead_prefix(src: str):
    """The rendered `dead_prefix` (module level, integer arithmetic), run on Python ints."""
    tree = ast.parse(src)
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "TILE_N"}
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "dead_prefix")
    ns = dict(consts, cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "dead_prefix", "exec"), ns)
    return ns["dead_prefix"]


def _on_by_default(v) -> bool:
    """The default since 2026-12-04: causal kernels of 3+ consumer warpgroups without intra-warpgroup overlap,
    except nvfp4_mixed at D = 64 (measured 0.93× at 1×16384)."""
    nvfp4_d64 = v.param("q_fmt") == "e2m1" and v.param("head_dim") == 64
    return v.param("causal") and v.param("compute_warpgroups") >= 3 and not v.param("intra_wg_overlap") \
        and not nvfp4_d64


def test_default_rule_covers_the_3_warpgroup_causal_tiles():
    on = [v for v in VARIANTS if _on_by_default(v)]
    assert on and all(v.param("tile_m") == 192 for v in on)
    assert {v.route for v in on} >= {"fp8_token", "mxfp8", "fp8_pv"}
    assert any(not _on_by_default(v) and v.param("compute_warpgroups") == 3 for v in VARIANTS)  # non-causal ones
    assert not any(_on_by_default(v) for v in VARIANTS if v.route == "nvfp4_mixed" and v.param("head_dim") == 64)

    from flamia_gen.bench.fwd_experiments import _wg_skip_default
    assert all(_wg_skip_default(dict(v.params)) == _on_by_default(v) for v in VARIANTS)  # the A/B tags follow it


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_default_and_render_identical(v):
    """On where the rule says (the rendered source equals the flag given explicitly), off elsewhere (no trace)."""
    src = render_variant(v)
    if _on_by_default(v):
        assert '"fwd_wg_skip": True' in src and "def dead_tile(" in src
        assert ("def dead_prefix(" in src) and render_with_flags(v, fwd_wg_skip=True) == src
        assert "dead_tile" not in render_with_flags(v, fwd_wg_skip=False)
    else:
        assert "fwd_wg_skip" not in src and "dead_prefix" not in src and "dead_tile" not in src
        if not v.param("intra_wg_overlap"):
            assert render_with_flags(v, fwd_wg_skip=False) == src


def test_refused_with_intra_warpgroup_overlap():
    v = next(v for v in VARIANTS if v.param("intra_wg_overlap"))
    with pytest.raises(Exception, match="fwd_wg_skip_needs_the_kernel_without_intra_warpgroup_overlap"):
        render_with_flags(v, fwd_wg_skip=True)


def _one_per_tiling():
    """One variant per (tile_m, tile_n, causal, key alignment): what the rule and key_tiling depend on."""
    seen, out = set(), []
    for v in NO_OVERLAP:
        key = (v.param("tile_m"), v.param("tile_n"), v.param("causal"), v.param("v_fmt") == "e4m3")
        if v.param("compute_warpgroups") >= 2 and key not in seen:
            seen.add(key)
            out.append(v)
    return out


@pytest.mark.parametrize("v", _one_per_tiling(), ids=lambda v: v.name)
def test_dead_tiles_are_exactly_the_invisible_ones_and_come_first(v):
    """A warpgroup with every row past the document passes all the unit's tiles; otherwise it passes the first
    n_skip tiles of key_tiling's order (causal) and runs the rest: the passed ones are exactly the tiles without a
    visible (row, key) pair, they lead the order (O, m, l still at their start values), and every tile of the unit
    is consumed once (the pipelines' count)."""
    src = render_with_flags(v, fwd_wg_skip=True)
    ast.parse(src)
    key_tiling, c = _key_tiling(src)
    causal = v.param("causal")
    dead_prefix = _dead_prefix(src) if causal else (lambda *a: 0)
    assert ("def dead_prefix(" in src) is causal
    mma = src[src.index("    def mma("):src.index("    def gemm(")]
    branch = ("                if row0 + 64 * wg >= doc_len:\n"
              "                    for i in cutlass.range(nblk, unroll=1):\n"
              "                        kv_state = self.dead_tile(pipe_k, pipe_v, kv_state)\n"
              "                else:\n")
    assert branch in mma
    rest = mma[mma.index(branch) + len(branch):]
    if causal:
        assert rest.startswith("                    n_skip = dead_prefix(row0 + 64 * wg, nblk, n_hi, delta)\n"
                               "                    for i in cutlass.range(n_skip, unroll=1):\n"
                               "                        kv_state = self.dead_tile(")
    masked_loop = "for i in cutlass.range(n_skip, n_hi + n_lo, unroll=1):" if causal else \
        "for i in cutlass.range(n_hi + n_lo, unroll=1):"
    assert "                    " + masked_loop in rest  # inside the else branch, as is the unmasked loop
    assert "                    for i in cutlass.range(n_mask - n_lo, unroll=1):" in rest
    tm, tn = c["TILE_M"], c["TILE_N"]
    n_wg = v.param("compute_warpgroups")
    assert tm == 64 * n_wg
    g = torch.Generator().manual_seed(3)
    starts = [0, 1, 6, 15, 16, 17, 1000, 1300] + torch.randint(0, 10 ** 6, (6,), generator=g).tolist()
    lens = [1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 300, 383, 384, 385, 1000, 4096]
    skipped = total = 0
    for s in starts:
        for L in lens:
            for mb in range(-(-L // tm)):
                _, delta, nblk, n_mask, n_lo = key_tiling(mb, s, L)
                n_hi = nblk - n_mask
                masked = list(range(nblk - 1, n_mask - 1, -1)) + ([0] if n_lo else [])
                unmasked = list(range(n_mask - 1, n_lo - 1, -1))
                row0 = mb * tm
                for w in range(n_wg):
                    rows = [r for r in range(row0 + 64 * w, row0 + 64 * w + 64) if r < L]
                    if row0 + 64 * w >= L:
                        dead, live = masked + unmasked, []
                    else:
                        n_skip = dead_prefix(row0 + 64 * w, nblk, n_hi, delta)
                        dead, live = masked[:n_skip], masked[n_skip:] + unmasked
                    assert sorted(dead + live) == list(range(nblk)), (s, L, mb, w)

                    def visible(n):
                        keys = [k for k in range(n * tn - delta, (n + 1) * tn - delta) if 0 <= k < L]
                        return any((k <= r) or not causal for r in rows for k in keys)

                    assert not any(visible(n) for n in dead), (s, L, mb, w)
                    assert all(visible(n) for n in live), (s, L, mb, w)
                    skipped += len(dead)
                    total += nblk
    assert 0 < skipped < total


@pytest.mark.parametrize("v", WG3[:2] + [v for v in NO_OVERLAP if v.param("compute_warpgroups") == 2][:1],
                         ids=lambda v: v.name)
def test_dead_tile_keeps_the_pipelines_and_the_turns(v):
    src = render_with_flags(v, fwd_wg_skip=True)
    assert '"fwd_wg_skip": True' in src
    body = src[src.index("    def dead_tile("):]
    body = body[:body.index("return kv_state")]
    steps = [ln.strip() for ln in body.splitlines()[1:] if ln.strip() and not ln.strip().startswith(('"', "released", "the ex2"))]
    # every stage waited for before its release (a release before the full wait could count toward the stage's
    # previous use), K before V, as one_tile does; the state advances once
    k_wait, k_rel = steps.index("pipe_k.consumer_wait(kv_state)"), steps.index("pipe_k.consumer_release(kv_state)")
    v_wait, v_rel = steps.index("pipe_v.consumer_wait(kv_state)"), steps.index("pipe_v.consumer_release(kv_state)")
    assert k_wait < k_rel < v_wait < v_rel < steps.index("kv_state.advance()")
    ring = "EX2_RING_BAR0" in src
    i = src.index("    def softmax(")
    sm = src[i:src.index("\n    def ", i + 1)]
    lines = ("cute.arch.barrier(barrier_id=EX2_RING_BAR0 + cwg, number_of_threads=256)",
             "cute.arch.barrier_arrive(barrier_id=EX2_RING_BAR0 + nxt, number_of_threads=256)",
             "nxt = cwg + 1", f"if nxt == {v.param('compute_warpgroups')}:")
    for line in lines:
        # a dead tile takes its ex2 turn and hands it on with softmax's own statements
        # (test_ex2_ring_protocol_alternates_and_never_deadlocks), between the K release and the V wait
        assert (line in steps) is ring
        if ring:
            assert line in sm and k_rel < steps.index(line) < v_wait


@pytest.mark.compile
def test_compile_wg_skip(compile_sm90):
    v = next(v for v in WG3 if v.route == "fp8_token" and v.param("causal") and v.param("head_dim") == 128)
    ptx = compile_sm90(v, source=render_with_flags(v, fwd_wg_skip=True))
    assert "bar.arrive" in ptx


def test_fwd_experiments_run_takes_workloads(monkeypatch):
    """`fwd_experiments run --workloads` (the skewed row is where fwd_wg_skip pays) reaches `run` as rows of
    document lengths, through the tuner's parser; a bad row is a clear error."""
    import flamia_gen.bench.fwd_experiments as fx

    seen = {}
    monkeypatch.setattr(fx, "run", lambda bundle, **kw: seen.update(kw) or [])
    assert fx.main(["run", "b", "--workloads", "1x16384,4x4096,8192+224x256", "--no-verify"]) == 0
    assert seen["workloads"] == ((16384,), (4096,) * 4, (8192,) + (256,) * 224) and seen["verify"] is False
    assert fx.main(["run", "b"]) == 0 and seen["workloads"] == ((16384,), (4096,) * 4)
    with pytest.raises(SystemExit, match="--workloads"):
        fx.main(["run", "b", "--workloads", "4x"])
