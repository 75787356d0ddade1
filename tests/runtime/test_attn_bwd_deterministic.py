"""Deterministic mode of the sm90 attention backward (`deterministic: true`, `_det` variants): the dQ
partials of each (query head, document query tile) are added in increasing key-tile order behind an
int32 semaphore (templates/sm90/attn_bwd.py.j2, docs/kernels/attn_bwd.md "Deterministic mode").

CPU: the ordering claim the kernel relies on, checked against the real work list
(`runtime.attn_bwd.make_work_list`) and the rendered kernel's own `bwd_tiling` for random documents,
tile sizes and key alignments: a document's key tiles are listed in increasing n, the contributors of
a query tile are key tiles 0 … c − 1 so the kernel's wait turn (`n_block`) is the number of
contributors listed before it, semaphore columns never collide, and a simulation of the persistent
grid (CTA b takes units b, b + grid, …) neither deadlocks nor adds out of order. The host wrapper
allocates, zeroes and passes `dq_sem` / `dq_tile_off`, and refuses bad ones.
GPU (`-m gpu`, run later on an H200): a `_det` variant from the bundle twice → dQ bitwise equal, and
equal to the non-deterministic variant within the dQ tolerance (dK, dV bitwise).
"""

from __future__ import annotations

import ast
import random

import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, rendered_literals
from flamia_gen.runtime.attn_bwd import (bwd_schedule, dq_tile_offsets, is_deterministic_spec, make_work_list,
                                         num_dq_tiles, run_attn_bwd)
from flamia_gen.spec import load_specs

DQ_TOL = dict(rtol=1e-2, atol=1e-2)  # dQ of the non-deterministic variant (fp32 atomics), as test_train_gpu


@pytest.fixture(scope="module")
def bwd_variants():
    return [v for v in make_plan(load_specs()).variants if v.kind.value == "attn_bwd"]


def _literals(src: str) -> dict:
    return rendered_literals(src, ("PARAMS", "ARGS", "TILE_M", "TILE_N", "KEY_ALIGN"))


def _is_det(v) -> bool:
    return bool(dict(v.params).get("deterministic", False))  # only deterministic variants carry the key


def _det_variant(variants, route, causal):
    return next(v for v in variants if v.route == route and v.param("causal") == causal and _is_det(v))


def _kernel_tiling(src: str, tile_m: int, tile_n: int, key_align: int):
    """The rendered kernel's `bwd_tiling`, on Python ints, with other tile sizes / alignment."""
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "bwd_tiling")
    ns = dict(TILE_M=tile_m, TILE_N=tile_n, KEY_ALIGN=key_align,
              cutlass=type("C", (), {"min": staticmethod(min), "max": staticmethod(max)}))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "bwd_tiling", "exec"), ns)
    return ns["bwd_tiling"]


def _random_cu(rng: random.Random):
    nd = rng.randint(1, 9)
    lens = [rng.choice([0, 1, 2, 15, 16, 17, rng.randint(1, 500)]) for _ in range(nd)]
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    return torch.tensor(cu, dtype=torch.int32), lens


class Deadlock(AssertionError):
    pass


def _steps(work, cu, lens, tiling, HKV, group, off):
    """unit → [(query head, semaphore column, turn n)] in the kernel's order (heads, then query tiles)."""
    out = []
    for doc, n, _ in work.tolist():
        for hkv in range(HKV):
            st = []
            if doc >= 0:
                _, _, m_lo, m_hi = tiling(n, int(cu[doc]), lens[doc])
                for hh in range(group):
                    st += [(hkv * group + hh, off[doc] + m, n) for m in range(m_lo, m_hi)]
            out.append(st)
    return out


def _simulate(steps, grid: int):
    """The persistent grid under the semaphore protocol: CTA b runs units b, b + grid, … in order; a
    step waits until sem[col] == its turn, adds, increments. Returns the add order per column."""
    pos = [[b, 0] for b in range(grid)]  # (unit, step) per CTA
    sem, order = {}, {}
    while True:
        moved, done = False, True
        for p in pos:
            while p[0] < len(steps) and p[1] == len(steps[p[0]]):
                p[0], p[1] = p[0] + grid, 0
            if p[0] >= len(steps):
                continue
            done = False
            h, col, turn = steps[p[0]][p[1]]
            if sem.get((h, col), 0) == turn:
                order.setdefault((h, col), []).append(turn)
                sem[(h, col)] = turn + 1
                p[1] += 1
                moved = True
        if done:
            return order, sem
        if not moved:
            raise Deadlock("every CTA waits on a semaphore no unit will increment")


@pytest.mark.parametrize("seed", range(40))
def test_work_list_order_and_wait_turns(bwd_variants, seed):
    rng = random.Random(seed)
    causal = seed % 2 == 0
    key_align = (1, 16)[(seed // 2) % 2]
    tile_m = rng.choice([8, 16, 32, 64, 128])
    tile_n = rng.choice([16, 32, 64, 128, 192])
    route = "fp8_token" if key_align == 16 else "bf16"
    tiling = _kernel_tiling(render_variant(_det_variant(bwd_variants, route, causal)), tile_m, tile_n, key_align)
    cu_real, lens_real = _random_cu(rng)
    T = int(cu_real[-1])
    # the kernel runs over the schedule's documents: real ones, and windows of short ones (bwd_schedule)
    sched = bwd_schedule(cu_real, tile_m, tile_n, causal, key_align=key_align, T=T)
    cu, work = sched.cu, sched.work
    lens = (cu[1:] - cu[:-1]).tolist()
    nd = len(lens)
    assert nd == len(lens_real)
    items = [(d, n) for d, n, _ in work.tolist() if d >= 0]
    pos = {it: i for i, it in enumerate(items)}
    off = sched.dq_tile_off.tolist()
    assert off == dq_tile_offsets(cu, tile_m, key_align).tolist()
    assert len(off) == nd + 1 and off[0] == 0
    cols = set()
    for d in range(nd):
        listed = [n for dd, n in items if dd == d]
        # 1. a document's key tiles are listed in increasing n
        assert listed == sorted(listed) == list(range(len(listed)))
        if not listed:
            continue
        ranges = [tiling(n, int(cu[d]), lens[d])[2:] for n in listed]
        m_hi = ranges[0][1]
        assert all(hi == m_hi for _, hi in ranges) and off[d + 1] - off[d] == m_hi
        for m in range(m_hi):
            # 2. contributors of query tile m: a prefix 0 … c − 1; the kernel's turn for key tile n
            #    (n_block) is the number of contributors listed before it
            contrib = [n for n, (lo, hi) in zip(listed, ranges) if lo <= m < hi]
            assert contrib == list(range(len(contrib)))
            for n in contrib:
                before = [n2 for n2 in contrib if pos[(d, n2)] < pos[(d, n)]]
                assert len(before) == n
            # 3. one semaphore column per (document, query tile), inside the allocated width
            assert off[d] + m not in cols
            cols.add(off[d] + m)
    assert off[-1] <= num_dq_tiles(T, nd, tile_m, key_align)
    # 4. the persistent grid: no deadlock, adds in key-tile order, final count = contributors
    HKV, group = rng.randint(1, 3), rng.randint(1, 2)
    steps = _steps(work, cu, lens, tiling, HKV, group, off)
    order, sem = _simulate(steps, grid=rng.randint(1, 9))
    for key, seq in order.items():
        assert seq == list(range(len(seq))) and sem[key] == len(seq)


def test_simulator_catches_a_wrong_order(bwd_variants):
    """The checks above can fail: a work list with a document's key tiles in decreasing n deadlocks
    a one-CTA grid (its first unit waits for key tiles that come later)."""
    tiling = _kernel_tiling(render_variant(_det_variant(bwd_variants, "bf16", True)), 64, 128, 1)
    cu, lens = torch.tensor([0, 700], dtype=torch.int32), [700]
    work = make_work_list(cu, 64, 128, True, T=700)
    off = dq_tile_offsets(cu, 64, 1).tolist()
    _simulate(_steps(work, cu, lens, tiling, 1, 1, off), grid=1)
    real = work[work[:, 0] >= 0]
    with pytest.raises(Deadlock):
        _simulate(_steps(real.flip(0), cu, lens, tiling, 1, 1, off), grid=1)


def test_dq_tile_offsets_never_collide_where_fp8_tiles_share_a_start():
    # documents of 5 and 7 tokens: fp8 query tile 0 of both starts at token 0 (doc_start rounded down to 16)
    cu = torch.tensor([0, 5, 12, 12, 40], dtype=torch.int32)
    off = dq_tile_offsets(cu, 64, 16)
    assert off.dtype == torch.int32 and off.tolist() == [0, 1, 2, 2, 3]  # the empty document takes no column
    assert num_dq_tiles(40, 4, 64, 16) >= 3 and num_dq_tiles(40, 4, 64, 1) == 1 + 4


# ----------------------------------------------------------------------------- host wrapper
def _bf16_inputs(T=40, HQ=4, HKV=2, D=128):
    b = torch.bfloat16
    return dict(q=torch.zeros(T, HQ, D, dtype=b), k=torch.zeros(T, HKV, D, dtype=b),
                v=torch.zeros(T, HKV, D, dtype=b), do=torch.zeros(T, HQ, D, dtype=b),
                lse=torch.zeros(HQ, T), delta=torch.zeros(HQ, T),
                cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32))


def _fp8_inputs(T=40, HQ=4, HKV=2, D=128):
    tpad = -(-T // 16) * 16
    u8 = torch.uint8
    return dict(q=torch.zeros(T, HQ, D, dtype=u8), k=torch.zeros(T, HKV, D, dtype=u8),
                v=torch.zeros(T, HKV, D, dtype=u8), do=torch.zeros(T, HQ, D, dtype=u8),
                lse=torch.zeros(HQ, T), delta=torch.zeros(HQ, T),
                q_t=torch.zeros(HQ, D, tpad, dtype=u8), k_t=torch.zeros(HKV, D, tpad, dtype=u8),
                do_t=torch.zeros(HQ, D, tpad, dtype=u8), q_scale=torch.zeros(T, HQ, dtype=u8),
                k_scale=torch.zeros(T, HKV, dtype=u8), v_scale=torch.zeros(T, HKV, dtype=u8),
                do_scale=torch.zeros(T, HQ, dtype=u8), cu_seqlens=torch.tensor([0, 10, T], dtype=torch.int32))


def _recorder(args_spec):
    seen = {}

    def fn(*a):
        assert len(a) == len(args_spec)
        for spec, t in zip(args_spec, a):
            seen[spec["name"]] = (t, t.clone() if isinstance(t, torch.Tensor) else t)
    return fn, seen


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
def test_run_attn_bwd_allocates_and_passes_the_semaphore(bwd_variants, route):
    lit = _literals(render_variant(_det_variant(bwd_variants, route, True)))
    args, params = lit["ARGS"], lit["PARAMS"]
    assert is_deterministic_spec(args) and params["deterministic_dq"] is True
    names = [a["name"] for a in args]
    assert names[names.index("work") + 1: names.index("work") + 3] == ["dq_sem", "dq_tile_off"]
    x = _fp8_inputs() if route == "fp8_token" else _bf16_inputs()
    align = lit["KEY_ALIGN"]
    fn, seen = _recorder(args)
    run_attn_bwd(fn, args, **x, params=params)
    sem, sem_at_call = seen["dq_sem"]
    assert sem.dtype == torch.int32 and sem.shape == (4, num_dq_tiles(40, 2, 64, align))
    assert not sem_at_call.any()  # zeroed before the launch
    off = seen["dq_tile_off"][0]
    # documents [0, 10) and [10, 40) are both shorter than a key tile: one window [0, 40), one query tile
    assert off.dtype == torch.int32 and off.tolist() == [0, 1, 1]
    assert seen["cu_seqlens"][0].tolist() == [0, 40, 40] and seen["work"][0][0].tolist() == [0, 0, 1]
    # a caller's buffer (dirty from a previous call) is zeroed in place and passed as is
    dirty = torch.full((4, 9), 7, dtype=torch.int32)
    fn, seen = _recorder(args)
    run_attn_bwd(fn, args, **x, params=params, dq_sem=dirty)
    assert seen["dq_sem"][0] is dirty and not seen["dq_sem"][1].any()


def test_non_deterministic_run_passes_no_semaphore(bwd_variants):
    v = next(v for v in bwd_variants if v.route == "bf16" and v.param("causal") and not _is_det(v))
    lit = _literals(render_variant(v))
    assert not is_deterministic_spec(lit["ARGS"]) and lit["PARAMS"]["deterministic_dq"] is False
    fn, seen = _recorder(lit["ARGS"])
    run_attn_bwd(fn, lit["ARGS"], **_bf16_inputs(), params=lit["PARAMS"])
    assert "dq_sem" not in seen and "dq_tile_off" not in seen
    with pytest.raises(ValueError, match="dq_sem: only a deterministic variant"):
        run_attn_bwd(fn, lit["ARGS"], **_bf16_inputs(), params=lit["PARAMS"],
                     dq_sem=torch.zeros(4, 9, dtype=torch.int32))


@pytest.mark.parametrize("kw, match", [
    (dict(dq_sem=torch.zeros(4, 9, dtype=torch.int64)), "dq_sem: dtype"),
    (dict(dq_sem=torch.zeros(3, 9, dtype=torch.int32)), "dq_sem: shape"),
    (dict(dq_sem=torch.zeros(4, 2, dtype=torch.int32)), "dq_sem: 2 columns, need ≥ 3"),
    (dict(dq_sem=torch.zeros(9, 4, dtype=torch.int32).t()), "dq_sem: must be contiguous"),
    (dict(params_update={"scheduler": "static"}), "params: a deterministic backward needs the persistent"),
])
def test_run_attn_bwd_deterministic_input_errors(bwd_variants, kw, match):
    lit = _literals(render_variant(_det_variant(bwd_variants, "bf16", True)))
    kw = dict(kw)
    params = dict(lit["PARAMS"], **kw.pop("params_update", {}))
    with pytest.raises(ValueError, match=match):
        run_attn_bwd(lambda *a: None, lit["ARGS"], **_bf16_inputs(), params=params, **kw)


# ----------------------------------------------------------------------------- GPU
try:  # `python -m pytest` from the repository root: tests/ is a namespace package
    from tests.runtime.test_ops import D, GPU_CASES, _gpu_bundle, _gpu_inputs
except ImportError:  # plain `pytest` (rootdir not on sys.path): load the sibling module by path
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location("_flamia_test_ops", Path(__file__).with_name("test_ops.py"))
    _test_ops = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_test_ops)
    D, GPU_CASES, _gpu_bundle, _gpu_inputs = (
        _test_ops.D, _test_ops.GPU_CASES, _test_ops._gpu_bundle, _test_ops._gpu_inputs)


def _gpu_setup(route, causal):
    from flamia_gen.runtime.attention import bwd_candidates, doc_profile

    b = _gpu_bundle(route)
    cands = bwd_candidates(b, route, D, causal)
    det = sorted((c for c in cands if c["params"].get("deterministic")), key=lambda c: c["name"])
    plain = sorted((c for c in cands if not c["params"].get("deterministic")), key=lambda c: c["name"])
    if not det:
        pytest.skip(f"the bundle has no deterministic backward for route {route!r} (causal={causal})")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms < int(det[0]["params"].get("sm_count", 0)):
        pytest.skip(f"{det[0]['name']} needs ≥ {det[0]['params']['sm_count']} SMs, this GPU has {sms}")
    q, k, v, cu, m = _gpu_inputs()
    o, lse, *_ = torch.ops.flamia.attention_fwd(q, k, v, cu, m, causal, route, None)
    g = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(o.shape, device="cuda", generator=g).to(torch.bfloat16)
    args = (do, q, k, v, o, lse, cu, doc_profile(q.shape[0], cu, m))
    return b, det[0], (plain[0] if plain else None), args


@pytest.mark.gpu
@pytest.mark.parametrize("route, causal", GPU_CASES)
def test_gpu_deterministic_dq_is_bitwise_reproducible(route, causal):
    from flamia_gen.runtime.ops import backward_with

    b, det, plain, args = _gpu_setup(route, causal)
    runs = []
    for _ in range(3):
        runs.append([t.clone() for t in backward_with(b, det, *args)])
        torch.cuda.synchronize()
    dq0, dk0, dv0, acc0 = runs[0]
    assert bool(torch.isfinite(dq0.float()).all()) and bool(acc0.abs().sum() > 0)
    for dq, dk, dv, acc in runs[1:]:
        assert torch.equal(acc, acc0), "dq_accum (fp32) differs between two runs of the deterministic variant"
        assert torch.equal(dq, dq0) and torch.equal(dk, dk0) and torch.equal(dv, dv0)
    if plain is None:
        pytest.skip("no non-deterministic variant to compare with")
    dq, dk, dv, _ = backward_with(b, plain, *args)
    torch.testing.assert_close(dq0, dq, **DQ_TOL)  # same partials, another summation order
    assert torch.equal(dk0, dk) and torch.equal(dv0, dv)  # dK, dV: the same code in both variants


@pytest.mark.gpu
def test_gpu_deterministic_backward_in_a_cuda_graph():
    """dq_sem zeroing / dq_tile_off are device ops: the call captures, and the replay reproduces the
    eager dQ bitwise."""
    from flamia_gen.runtime.ops import backward_with

    b, det, _, args = _gpu_setup("fp8_token", True)
    eager = [t.clone() for t in backward_with(b, det, *args)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: bundle load, dispatch and work-list caches
        backward_with(b, det, *args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backward_with(b, det, *args)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, e) for a, e in zip(out, eager))


def test_op_path_reuses_the_schedule_of_a_cu_seqlens_tensor():
    """The op (`runtime.ops.backward_with`) takes the schedule (work list, windows, `dq_tile_off`) from
    the per-`cu_seqlens` cache: built once per tensor, equal to `bwd_schedule`, rebuilt when the tensor
    changes."""
    from flamia_gen.runtime.attention import bwd_schedule_cached

    cu = torch.tensor([0, 5, 70, 71, 300], dtype=torch.int32)
    p = {"tile_m": 64, "tile_n": 128, "causal": True}
    a = bwd_schedule_cached(cu, 300, p, fp8=True)
    assert bwd_schedule_cached(cu, 300, p, fp8=True) is a
    want = bwd_schedule(cu, 64, 128, True, key_align=16, T=300)
    assert all(torch.equal(x, y) for x, y in zip(a, want))
    assert torch.equal(bwd_schedule_cached(cu, 300, p, fp8=False).dq_tile_off,
                       bwd_schedule(cu, 64, 128, True, T=300).dq_tile_off)
    cu[3] = 200  # in-place edit: the version counter moves, the cache rebuilds
    b = bwd_schedule_cached(cu, 300, p, fp8=True)
    assert torch.equal(b.dq_tile_off, bwd_schedule(cu, 64, 128, True, key_align=16, T=300).dq_tile_off)
    assert torch.equal(b.cu, bwd_schedule(cu, 64, 128, True, key_align=16, T=300).cu) and not torch.equal(b.cu, a.cu)
