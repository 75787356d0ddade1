"""The backward's dQ writer warp (flag `bwd_dq_warp`, on by default; templates/sm90/attn_bwd.py.j2;
docs/kernels/attn_bwd.md "A dQ writer warp").

Warp 1 of the producer warpgroup issues each query tile's bulk reduce-adds of the dQ partial rows; the consumers write
sdQ and only arrive on a named barrier. CPU only: the protocol is read from the rendered kernel (barrier ids, thread
counts, the order of the waits, arrives and sdQ accesses) and replayed on a model of named barriers under random
interleavings; the writer must visit the consumers' tiles (its loop is the producer's). `-m compile` cross-compiles.
On the H200 `bench.bwd_experiments` compares dQ, dK, dV with the kernel without it (`nodqwarp`).
"""

from __future__ import annotations

import random
import re

import pytest

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]


def _between(src: str, start: str, end: str) -> str:
    i = src.index(start)
    return src[i:src.index(end, i + len(start))]


def _constants(src: str) -> dict:
    out = {}
    for name in ("DQ_FULL_BAR", "DQ_EMPTY_BAR", "SQ32_BARRIER0", "DQ_BARRIER"):
        m = re.search(rf"^{name} = (\d+)", src, re.M)
        if m:
            out[name] = int(m.group(1))
    m = re.search(r"^DQ_WRITERS = (\d+)", src, re.M)
    out["writers"] = int(m.group(1)) if m else 1
    m = re.search(r"^DQ_WARP_THREADS = 128 \* (\d+) \+ 32( \* DQ_WRITERS)?  #", src, re.M)
    out["threads"] = 128 * int(m.group(1)) + 32 * (out["writers"] if m.group(2) else 1) if m else None
    if m:
        assert (m.group(2) is not None) == (out["writers"] > 1)
    return out


def test_on_by_default_where_the_rows_go_by_bulk_copies():
    """Every non-deterministic backward with the per-row bulk dQ path has the writer warp, except fp8_tensor's two
    launches (its amax launch has no dQ tiles); `_det` variants keep the ordered per-element adds."""
    for v in BWD:
        p = rendered_params(render_variant(v))
        want = not p.get("deterministic") and p["ds_gran"] != "tensor"
        assert bool(p.get("bwd_dq_warp")) is want, v.name
        assert bool(p.get("bwd_dq_bulk")) is (not p.get("deterministic"))


@pytest.mark.parametrize("v", [v for v in BWD if v.route in ("fp8_token", "bf16", "mxfp8_exact")
                               and not dict(v.params).get("deterministic")], ids=lambda v: v.name)
def test_protocol_read_from_the_kernel(v):
    src = render_variant(v)
    c = _constants(src)
    wg = rendered_params(src)["compute_warpgroups"]
    nw = c["writers"]
    assert c["threads"] == 128 * wg + 32 * nw and nw in (1, 2)
    full, empty = c["DQ_FULL_BAR"], c["DQ_EMPTY_BAR"]
    # distinct from every other named barrier of the kernel: 0 (CTA), 1 (consumers), 2 (det), 3 … 6 (square_32)
    assert len({full, empty}) == 2 and {full, empty}.isdisjoint({0, 1, 2, 3, 4, 5, 6}) and max(full, empty) < 16
    writer = _between(src, "    def dq_writer(", "    # Consumer warpgroups")
    tile = _between(src, "    def one_tile(", "        bufs[0] = 1 - buf")
    # the writer: one arrive on EMPTY before its loop; per tile: sync FULL, copies, wait for their reads, arrive EMPTY
    w_events = [(m.start(), m.group(0)) for m in re.finditer(
        r"barrier_arrive\(barrier_id=DQ_EMPTY_BAR|barrier\(barrier_id=DQ_FULL_BAR|bulk_reduce_add_f32\("
        r"|cp_async_bulk_wait_group\(0, read=True\)|while unit < num_units", writer)]
    kinds = [e for _, e in w_events]
    assert kinds == ["barrier_arrive(barrier_id=DQ_EMPTY_BAR", "while unit < num_units",
                     "barrier(barrier_id=DQ_FULL_BAR", "bulk_reduce_add_f32(", "cp_async_bulk_wait_group(0, read=True)",
                     "barrier_arrive(barrier_id=DQ_EMPTY_BAR"], kinds
    assert "number_of_threads=DQ_WARP_THREADS" in writer and "cp_async_bulk_wait_group(0, read=False)" in writer
    # the consumers: sync EMPTY, write sdQ, fence, arrive FULL; no bulk copy of their own, no wait on copies
    bulk = tile[tile.index("dQ writer warp: sdQ"):]
    i_empty = bulk.index("cute.arch.barrier(barrier_id=DQ_EMPTY_BAR, number_of_threads=DQ_WARP_THREADS)")
    i_store = bulk.index("cute.autovec_copy(v2, dst2)")
    i_fence = bulk.index("cute.arch.fence_view_async_shared()", i_store)
    i_full = bulk.index("cute.arch.barrier_arrive(barrier_id=DQ_FULL_BAR, number_of_threads=DQ_WARP_THREADS)")
    assert i_empty < i_store < i_fence < i_full
    assert "bulk_reduce_add_f32(" not in tile and "cp_async_bulk_wait_group" not in tile
    # the writer visits the consumers' tiles: its unit and tile loops are the producer's, line for line
    load = _between(src, "    def load(", "    # -----------")

    def loops(body: str) -> list[str]:
        keep = ("while unit < num_units", ".decode(unit, mWork, mCu, HKV)", "bwd_tiling(n_block, doc_start, doc_len)",
                "if (doc >= 0) & (m_lo < m_hi):", "for hh in cutlass.range(group, unroll=1):",
                "for mi in cutlass.range(m_hi - m_lo, unroll=1):", "m_block = m_lo + mi", ".next_unit(unit, num_units)",
                "unit = num_units")
        return [ln.strip() for ln in body.splitlines() if any(k in ln for k in keep)]

    assert loops(writer) == loops(load)
    # the writer's rows are one_tile's: document-local row qrow0 + r inside [0, doc_len), token q_tok0 + r
    assert "qrow0 = m_block * self.tile_m - delta" in writer and "q_tok0 = base + m_block * self.tile_m" in writer
    assert "m_block * m - delta, base + m_block * m, head" in src  # one_tile's qrow0, q_tok0 arguments
    assert "if (qrow0 + r >= 0) & (qrow0 + r < doc_len):" in writer
    # the writers run on warps 1 … nw of the producer warpgroup (after its register decrease), warp 0 loads
    kern = _between(src, "        if warp_idx < 4:", "        else:")
    head = "if warp_idx == 1:" if nw == 1 else "if (warp_idx >= 1) & (warp_idx <= DQ_WRITERS):"
    assert kern.index("setmaxregister_decrease") < kern.index(head) < kern.index("self.dq_writer(")
    # together the writer warps cover every row of the tile exactly once
    loop = re.search(r"for j in cutlass\.range_constexpr\(self\.tile_m // (?:32|\(32 \* DQ_WRITERS\))\):\s+r = (.+?)(?:  #.*)?$",
                     writer, re.M)
    tile_m = rendered_params(src)["tile_m"]
    rows = [eval(loop.group(1), {"lane": lane, "wk": wk, "j": j, "DQ_WRITERS": nw})  # noqa: S307 (our render)
            for wk in range(nw) for lane in range(32) for j in range(tile_m // (32 * nw))]
    assert sorted(rows) == list(range(tile_m))


_EVENTS = (("sync", "empty", "cute.arch.barrier(barrier_id=DQ_EMPTY_BAR, number_of_threads=DQ_WARP_THREADS)"),
           ("arrive", "empty", "cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BAR, number_of_threads=DQ_WARP_THREADS)"),
           ("sync", "full", "cute.arch.barrier(barrier_id=DQ_FULL_BAR, number_of_threads=DQ_WARP_THREADS)"),
           ("arrive", "full", "cute.arch.barrier_arrive(barrier_id=DQ_FULL_BAR, number_of_threads=DQ_WARP_THREADS)"),
           ("write",  None, "cute.autovec_copy(v2, dst2)"),
           ("read", None, "bulk_reduce_add_f32(mdQacc.iterator + off, sdQ.iterator + r * DQ_LD"))


def _events(body: str, indent: int | None = None) -> list[tuple]:
    """The protocol's statements of `body` in source order, each with its indentation; `indent`: keep only those."""
    out = []
    for line in body.splitlines():
        for op, bar, stmt in _EVENTS:
            if line.strip().startswith(stmt):
                ind = len(line) - len(line.lstrip())
                if indent is None or ind == indent:
                    out.append((op, bar, ind))
    return out


def _programs(src: str):
    """(consumer program per tile, writer prologue, writer program per tile) as the rendered kernel runs them. Every
    statement must be unconditional inside its block: one_tile's at its body's indentation (mma calls one_tile once
    per query tile: an interior / masked if-else of two calls), the writer's at its tile loop's body's."""
    tile = _between(src, "    def one_tile(", "        bufs[0] = 1 - buf")
    cons = _events(tile)
    writes = [e for e in cons if e[0] == "write"]
    assert writes and len({e[2] for e in writes}) == 1  # the sdQ stores of one loop
    assert all(e[2] == 8 for e in cons if e[0] != "write"), cons  # barriers at one_tile's body level: unconditional
    cons_prog = []  # in source order, the stores of the one loop as one "write"
    for op, bar, _ in cons:
        if not (op == "write" and cons_prog and cons_prog[-1] == ("write", None)):
            cons_prog.append((op, bar))
    mma = _between(src, "    def mma(", "    def amax_sweep(" if "def amax_sweep(" in src else "    def load2(")
    loop = mma[mma.index("for mi in cutlass.range(m_hi - m_lo, unroll=1):"):mma.index("pipe_kv.consumer_release(kv_state)")]
    calls = [ln for ln in loop.splitlines() if "self.one_tile(" in ln]
    if len(calls) == 2:  # interior / masked: an if-else, one call each
        heads = [ln.strip() for ln in loop.splitlines() if ln.strip().startswith(("if (m_block >= i_lo)", "else:"))]
        assert len(heads) == 2 and heads[1] == "else:"
    else:
        assert len(calls) == 1
    writer = _between(src, "    def dq_writer(", "    # Consumer warpgroups")
    pro = [(op, bar) for op, bar, _ in _events(writer[:writer.index("while unit < num_units")])]
    mi = writer[writer.index("for mi in cutlass.range(m_hi - m_lo, unroll=1):"):]
    ind = len(mi.splitlines()[1]) - len(mi.splitlines()[1].lstrip())  # the tile loop's body
    # the barriers at the tile loop's body level (unconditional); the copies sit under the row predicate
    per = [(op, bar) for op, bar, i in _events(mi) if i == ind or op == "read"]
    assert len(per) == len(_events(mi)), "a writer barrier of the tile loop under a condition"
    return cons_prog, pro, per


@pytest.mark.parametrize("v", [v for v in BWD if v.route in ("fp8_token", "bf16")
                               and not dict(v.params).get("deterministic")], ids=lambda v: v.name)
def test_protocol_model_never_deadlocks_and_never_overlaps(v):
    """Named barriers as the hardware counts them (a generation completes when count arrivals are in; bar.sync blocks
    its threads until then), running the programs read from the rendered kernel: consumers (256 threads, acting
    together at each barrier) and the writer (32), any number of tiles, random interleavings. Every tile's rows are
    read after the consumers wrote them and before they write the next tile's; nothing deadlocks; the writer's last
    EMPTY arrive stays pending at exit."""
    src = render_variant(v)
    cons_tile, writer_pro, writer_tile = _programs(src)
    assert cons_tile == [("sync", "empty"), ("write", None), ("arrive", "full")]
    assert writer_pro == [("arrive", "empty")] and writer_tile == [("sync", "full"), ("read", None), ("arrive", "empty")]
    c = _constants(src)
    for seed in range(300):
        _simulate(cons_tile, writer_pro, writer_tile, c["threads"], seed, writers=c["writers"])


def _simulate(cons_tile, writer_pro, writer_tile, threads: int, seed: int, writers: int = 1,
              consumers: int | None = None) -> None:
    """The consumers (acting together) and `writers` writer warps (each on its own) run their programs; each writer warp
    reads its share of every tile after the consumers wrote it and before they write the next one."""
    rnd = random.Random(seed)
    tiles = rnd.randint(1, 6)
    ws = [f"w{k}" for k in range(writers)]
    n = {"c": threads - 32 * writers if consumers is None else consumers, **dict.fromkeys(ws, 32)}
    prog = {"c": cons_tile * tiles, **{w: writer_pro + writer_tile * tiles for w in ws}}
    count = {"full": 0, "empty": 0}  # arrivals of the open generation
    gen = {"full": 0, "empty": 0}  # completed generations
    pc = dict.fromkeys(n, 0)
    waiting = dict.fromkeys(n)  # (barrier, generation) a blocked sync waits for
    written, read = 0, dict.fromkeys(ws, 0)
    while any(pc[who] < len(prog[who]) for who in n):
        runnable = [who for who in n if pc[who] < len(prog[who])
                    and (waiting[who] is None or gen[waiting[who][0]] > waiting[who][1])]
        assert runnable, f"deadlock at {pc}"
        who = rnd.choice(runnable)
        if waiting[who] is not None:  # its sync completed
            waiting[who] = None
            pc[who] += 1
            continue
        op, bar = prog[who][pc[who]]
        if op in ("sync", "arrive"):
            count[bar] += n[who]
            assert count[bar] <= threads, "a generation overran (arrivals of two tiles mixed)"
            g = gen[bar]
            if count[bar] == threads:
                count[bar] = 0
                gen[bar] += 1
            if op == "sync" and gen[bar] == g:
                waiting[who] = (bar, g)
                continue
        elif op == "write":
            assert all(r == written for r in read.values()), f"tile {written} written over unread rows"
            written += 1
        else:
            assert read[who] == written - 1, f"{who} read tile {read[who]} before it was written"
            read[who] += 1
        pc[who] += 1
    assert written == tiles and all(r == tiles for r in read.values())
    assert count == {"full": 0, "empty": 32 * writers}


def test_protocol_model_catches_planted_errors():
    """The model fails on a writer without its first EMPTY arrive (deadlock) and on a writer that hands sdQ back before
    its copies (the consumers may then overwrite rows not yet read)."""
    cons = [("sync", "empty"), ("write", None), ("arrive", "full")]
    tile = [("sync", "full"), ("read", None), ("arrive", "empty")]
    for writers in (1, 2):
        threads = 256 + 32 * writers
        with pytest.raises(AssertionError, match="deadlock"):
            _simulate(cons, [], tile, threads, 0, writers)
        early = [("sync", "full"), ("arrive", "empty"), ("read", None)]
        fails = 0
        for seed in range(50):
            try:
                _simulate(cons, [("arrive", "empty")], early, threads, seed, writers)
            except AssertionError:
                fails += 1
        assert fails > 0
    # a barrier count that leaves out the second writer warp (256 consumers + 32): a generation overruns
    with pytest.raises(AssertionError, match="overran"):
        _simulate(cons, [("arrive", "empty")], tile, 288, 3, writers=2, consumers=256)


def test_every_backward_experiment_changes_the_kernel_it_copies():
    """An experiment copy renders differently from its base (outside PARAMS and the name), or — a flag the runtime
    reads, not the kernel (bwd_head_section: how the unit list orders the heads) — in that PARAMS key: a tag whose flag
    is already the default there would time one kernel twice."""
    from flamia_gen.bench import bwd_experiments as bx
    from flamia_gen.bench.fwd_experiments import experiment_variants

    def body(src: str, name: str) -> str:
        src = src.replace(name, "NAME")
        return src[src.index("# Runtime call signature"):]

    bwd = bx.base_variants()[0] + bx.base_variants(head_dim=64)[0]
    base = {v.name: v for v in bwd}
    seen = set()
    for tag, v in experiment_variants(bx.DEFAULT_EXPERIMENTS, base_variants=bwd, experiments=bx.EXPERIMENTS):
        if not tag:
            continue
        b = base[bx.split_name(v.name, bx.EXPERIMENTS)[0]]
        sv, sb = render_variant(v), render_variant(b)
        if body(sv, v.name) == body(sb, b.name):
            pv, pb = rendered_params(sv), rendered_params(sb)
            assert pv.get("bwd_head_section") != pb.get("bwd_head_section"), (tag, b.name)
        seen.add(tag)
    assert {"nodqwarp", "noqperm", "r12", "dqw1", "s3", "pers", "hs0", "hs1", "stsm", "nostsm", "nodqfirst"} <= seen


def test_two_writer_warps_where_one_was_the_limit():
    """bwd_dq_writers: 2 with the writer warp at D = 64 (every route that has it) and, since round 32, at D = 128 on the
    bf16 tile and fp8_token's, since round 36 on fp8_pv's, mxfp8_exact's and fp8_token_bf16qk's; else 1 (no key
    rendered: mxfp8, nvfp4_mixed); a count other than 1 or 2 refuses to render."""
    two_at_128 = ("bf16", "fp8_token", "fp8_pv", "mxfp8_exact", "fp8_token_bf16qk")
    for v in BWD:
        p = rendered_params(render_variant(v))
        want = 2 if (p.get("bwd_dq_warp") and (p["head_dim"] == 64 or v.route in two_at_128)) else None
        assert p.get("bwd_dq_writers") == want, v.name
    v = next(x for x in BWD if x.route == "fp8_token" and not dict(x.params).get("deterministic"))
    with pytest.raises(Exception, match="bwd_dq_writers_must_be_1_or_2"):
        render_with_flags(v, bwd_dq_writers=3)
    # a tile the writer warps cannot split into whole 32-row shares refuses to render (its rows would not be copied)
    with pytest.raises(Exception, match="tile_m_must_be_a_multiple_of_32_per_dq_writer_warp"):
        render_with_flags(v, bwd_dq_writers=2, tile_m=32)
    assert '"bwd_dq_writers": 2' in render_with_flags(v, bwd_dq_writers=2)


@pytest.mark.compile
def test_compile_dq_warp(compile_sm90):
    """Cross-compiles for sm_90a: the writer's bulk reduce-adds and the two named barriers are in the PTX (256 consumer
    threads and two writer warps: fp8_token's D = 128 default since round 32)."""
    v = next(x for x in BWD if x.route == "fp8_token" and x.param("head_dim") == 128 and x.param("causal")
             and not dict(x.params).get("deterministic"))
    ptx = compile_sm90(v)
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert re.search(r"bar\.sync\s+7, 320", ptx) or re.search(r"barrier\.sync(\.aligned)?\s+7, 320", ptx)
    assert re.search(r"bar(rier\.cta)?\.arrive(\.aligned)?\s+8, 320", ptx)

