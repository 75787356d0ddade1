"""The per-token FP8 backward tile with its warpgroups drifting at the dQ amax (flag `bwd_amax_drift`, experiment, off;
templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md "Let the warpgroups drift").

Each consumer warpgroup arrives on its own named barrier after its dQ-amax atomics, finishes its dK step and only then
waits on the other warpgroup's barrier. CPU only: the order is read from the rendered kernel and the exchange replayed
on a model of named barriers (and of the two amax buffers) under random interleavings; `-m compile` cross-compiles.
On the H200 `bench.bwd_experiments` (tag `drift`) compares dQ, dK, dV bit for bit with the default kernel.
"""

from __future__ import annotations

import random
import re

import jinja2
import pytest

from flamia_gen.render.render import render_variant

from test_attn_bwd_dq_warp import BWD, _between, _render

FP8_TOKEN = [v for v in BWD if v.route == "fp8_token"]
ONE = next(v for v in FP8_TOKEN if v.param("head_dim") == 128 and v.param("causal")
           and not dict(v.params).get("deterministic"))

# one_tile's statements of the exchange, in the order the drifting tile runs them (first occurrence of each)
_MARKS = [
    ("atomic", "cute.arch.atomic_max(sAmax.iterator"),
    ("arrive_own", "cute.arch.barrier_arrive(barrier_id=AMAX_BAR0 + wg_amax,"),
    ("dk_scale", "e = ds_exponent(quad_max_nan(mx[rh]))"),
    ("dk_codes", "self.convert_p(acc_S, tdKrdS)"),
    ("dk_mma", "self.gemm(tiled_mma_dkv, acc_dK,"),
    ("sync_other", "cute.arch.barrier(barrier_id=AMAX_BAR0 + 1 - wg_amax,"),
    ("read", "amk = self.load2(sAmax, buf * m"),
    ("sync_ds", "cute.arch.barrier(barrier_id=1,"),
    ("zero", "sAmax[buf * m + tidx] = Uint32(0)"),
]


def _one_tile(src: str) -> str:
    return _between(src, "    def one_tile(", "        bufs[0] = 1 - buf")


def _order(body: str) -> list[str]:
    at = {name: body.index(stmt) for name, stmt in _MARKS if stmt in body}
    return sorted(at, key=at.get)


def test_flag_off_renders_the_default_bytes():
    for v in FP8_TOKEN:
        assert _render(v, bwd_amax_drift=False) == render_variant(v)
    assert "AMAX_BAR0" not in render_variant(ONE)


@pytest.mark.parametrize("v", [v for v in FP8_TOKEN if v.param("head_dim") == 128], ids=lambda v: v.name)
def test_drift_order(v):
    """Atomics, arrive on the own barrier, the dK step (exponent, codes, wgmma issue), wait on the other's barrier, then
    the amax reads; the 256-thread barrier 1 is no longer between the atomics and the reads; each statement once."""
    body = _one_tile(_render(v, bwd_amax_drift=True))
    assert _order(body) == [name for name, _ in _MARKS]
    for name, stmt in _MARKS[1:6]:
        assert body.count(stmt) == 1, name
    i, j = body.index("cute.arch.atomic_max(sAmax.iterator"), body.index("amk = self.load2(sAmax")
    assert "barrier_id=1," not in body[i:j]
    # the default: the dK step before the atomics, barrier 1 between atomics and reads
    d = _one_tile(render_variant(v))
    assert d.index("self.gemm(tiled_mma_dkv, acc_dK,") < d.index("cute.arch.atomic_max(sAmax.iterator")
    assert "barrier_id=1," in d[d.index("cute.arch.atomic_max(sAmax.iterator"):d.index("amk = self.load2(sAmax")]


def test_barrier_ids_are_free():
    src = _render(ONE, bwd_amax_drift=True)
    assert re.search(r"^AMAX_BAR0 = 11\b", src, re.M)
    ids = {int(x) for x in re.findall(r"^[A-Z0-9_]*BAR(?:RIER)?0? = (\d+)", src, re.M)}
    ids |= {1}  # the consumers' dS / amax barrier
    assert 11 in ids and 12 not in ids and max(ids) + 1 <= 15  # AMAX_BAR0 + 1 = 12 collides with nothing


@pytest.mark.parametrize("route", ["bf16", "fp8_pv", "mxfp8", "fp8_tensor"])
def test_refused_outside_the_per_token_tile(route):
    v = next(v for v in BWD if v.route == route and v.param("head_dim") == 128)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_amax_drift"):
        _render(v, bwd_amax_drift=True)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_amax_drift"):
        _render(ONE, bwd_amax_drift=True, compute_warpgroups=3, WG=3)


def _program(order: list[str], w: int) -> list[tuple]:
    """Warpgroup w's per-tile program over the exchange (the dK statements do nothing to it)."""
    ops = {"atomic": ("atomic", None), "arrive_own": ("arrive", f"a{w}"), "sync_other": ("sync", f"a{1 - w}"),
           "read": ("read", None), "sync_ds": ("sync", "ds"), "zero": ("zero", None)}
    prog = [ops[n] for n in order if n in ops]
    if w == 1:  # only threads < tile_m (warpgroup 0) re-zero the buffer
        prog = [p for p in prog if p[0] != "zero"]
    return prog


def _simulate(progs: dict, seed: int) -> None:
    """Two warpgroups of 128 threads on named barriers of 256 (a generation completes at 256 arrivals; bar.sync blocks
    until its generation completes) and two amax buffers (tile t uses t % 2): every read sees both warpgroups' atomics
    of its tile and nothing of another tile; no generation mixes two tiles; no deadlock."""
    rnd = random.Random(seed)
    tiles = rnd.randint(1, 7)
    prog = {w: p * tiles for w, p in progs.items()}
    per = {w: len(p) for w, p in progs.items()}
    count, gen = {}, {}
    pc = dict.fromkeys(prog, 0)
    waiting = dict.fromkeys(prog)
    amax = [set(), set()]
    while any(pc[w] < len(prog[w]) for w in prog):
        run = [w for w in prog if pc[w] < len(prog[w]) and (waiting[w] is None or gen.get(waiting[w][0], 0) > waiting[w][1])]
        assert run, f"deadlock at {pc}"
        w = rnd.choice(run)
        if waiting[w] is not None:
            waiting[w] = None
            pc[w] += 1
            continue
        t = pc[w] // per[w]
        op, bar = prog[w][pc[w]]
        if op in ("sync", "arrive"):
            count[bar] = count.get(bar, 0) + 128
            assert count[bar] <= 256, "a generation overran"
            g = gen.get(bar, 0)
            if count[bar] == 256:
                count[bar] = 0
                gen[bar] = g + 1
            if op == "sync" and gen.get(bar, 0) == g:
                waiting[w] = (bar, g)
                continue
        elif op == "atomic":
            assert all(tt == t for _, tt in amax[t % 2]), f"tile {t}'s atomics into a buffer not yet re-zeroed"
            amax[t % 2].add((w, t))
        elif op == "read":
            assert amax[t % 2] == {(0, t), (1, t)}, f"tile {t} read {sorted(amax[t % 2])}"
        elif op == "zero":
            amax[t % 2].clear()
        pc[w] += 1
    assert not any(count.values())


def test_exchange_model_never_deadlocks_and_reads_whole_maxima():
    order = _order(_one_tile(_render(ONE, bwd_amax_drift=True)))
    progs = {w: _program(order, w) for w in (0, 1)}
    for seed in range(400):
        _simulate(progs, seed)
    # the default kernel's exchange (one barrier 1 between atomics and reads) passes the same model
    d = _one_tile(render_variant(ONE))
    i = d.index("cute.arch.atomic_max(sAmax.iterator")
    base = [("atomic", None), ("sync", "ds"), ("read", None), ("sync", "ds")]
    assert d.index("barrier_id=1,", i) < d.index("amk = self.load2(sAmax", i)
    for seed in range(100):
        _simulate({0: base + [("zero", None)], 1: base}, seed)


def test_exchange_model_catches_planted_errors():
    good = {w: _program([n for n, _ in _MARKS], w) for w in (0, 1)}
    # a warpgroup that waits on its own barrier: it completes on its own arrivals, reads before the other's atomics
    own = {w: [("sync", f"a{w}") if p == ("sync", f"a{1 - w}") else p for p in good[w]] for w in (0, 1)}
    # no dS barrier: a warpgroup runs a tile ahead (arrive of tile t + 1 into tile t's generation, or atomics into a
    # buffer not yet re-zeroed)
    nods = {w: [p for p in good[w] if p != ("sync", "ds")] for w in (0, 1)}
    for bad in (own, nods):
        fails = 0
        for seed in range(200):
            try:
                _simulate(bad, seed)
            except AssertionError:
                fails += 1
        assert fails > 0


@pytest.mark.compile
def test_compile_amax_drift(compile_sm90):
    ptx = compile_sm90(ONE, source=_render(ONE, bwd_amax_drift=True))
    assert re.search(r"barrier(\.cta)?\.arrive(\.aligned)?\s+%r\d+, 256;|bar\.arrive\s+%r\d+, 256;", ptx), \
        "the arrive on a warpgroup's own barrier"
