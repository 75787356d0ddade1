"""The backward's unit list with KV heads in sections (`bwd_head_section`; CPU only).

`runtime.attn_bwd.head_units` turns the (NUM_WORK, 3) longest-first work list into (NUM_WORK·HKV, 4) units
(doc, n_block, window, KV head): heads in sections of k, a section's units item-major with its heads inner, padding
after every real unit. The kernel (template flag `bwd_head_section`) reads unit u as row u. What must hold: every
(item, head) pair exactly once; the padding exit of the persistent loops (padding last); each head's items in the
work list's order (the deterministic mode's ordering argument, per head); section ≥ HKV is today's item-major order
(unit = item·HKV + hkv).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from flamia_gen.runtime.attn_bwd import (bwd_schedule, head_units, make_work_list, num_units, num_window_items, num_work,
                                         run_attn_bwd)
from flamia_gen.runtime.attn_fwd import merge_windows

try:  # `python -m pytest` from the repository root: tests/ is a namespace package
    from tests.runtime import bwd_standins as bs
except ImportError:  # plain `pytest` (rootdir not on sys.path): load the sibling module by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_flamia_bwd_standins", Path(__file__).with_name("bwd_standins.py"))
    bs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(bs)


def _random_work(seed: int, causal: bool = True):
    rng = random.Random(seed)
    lens = [rng.choice([1, 7, 64, 129, 300, 1000, 2048]) for _ in range(rng.randint(1, 7))]
    cu = bs.cu_seqlens(lens)
    return make_work_list(cu, 64, 128, causal, key_align=16, T=int(cu[-1])), lens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hkv, section", [(1, 1), (4, 1), (4, 2), (6, 4), (16, 2), (3, 8)])
def test_every_item_and_head_once_padding_last_heads_in_sections(seed, hkv, section):
    work, _ = _random_work(seed, causal=seed % 2 == 0)
    nw = work.shape[0]
    units = head_units(work, hkv, section)
    assert units.shape == (nw * hkv, 4) and units.dtype == torch.int32 and units.is_contiguous()
    real = units[:, 0] >= 0
    n_real = int(real.sum())
    assert n_real == int((work[:, 0] >= 0).sum()) * hkv
    assert bool(real[:n_real].all()) and not bool(real[n_real:].any()), "padding must come after every real unit"
    # each real (item row, head) exactly once: rows are work rows plus a head column
    seen = {}
    for u, (d, n, w, h) in enumerate(units.tolist()):
        if d < 0:
            assert (n, w) == (-1, -1)
            continue
        assert 0 <= h < hkv
        key = (d, n, h)
        assert key not in seen
        seen[key] = u
    items = [tuple(r) for r in work.tolist() if r[0] >= 0]
    assert len(seen) == len(items) * hkv
    # sections: all units of section s come before those of section s + 1; inside a section, item-major with the
    # section's heads inner (head order ascending)
    s = min(section, hkv)
    order = [(h // s, i, h % s) for i, (d, n, w) in enumerate(items) for h in range(hkv)]
    want = sorted(order)
    got = [(h // s, items.index((d, n, w)), h % s) for d, n, w, h in units[:n_real].tolist()]
    assert got == want


@pytest.mark.parametrize("seed", range(4))
def test_each_head_keeps_the_work_lists_order(seed):
    """The deterministic mode waits on key tiles of smaller n of the same head: they must sit at smaller unit indices."""
    work, _ = _random_work(seed)
    units = head_units(work, 5, 2)
    items = [tuple(r) for r in work.tolist() if r[0] >= 0]
    for h in range(5):
        mine = [tuple(r[:3]) for r in units.tolist() if r[0] >= 0 and r[3] == h]
        assert mine == items
        # a document's key tiles in increasing n within the head
        for d in {r[0] for r in mine}:
            ns = [r[1] for r in mine if r[0] == d]
            assert ns == sorted(ns)


def test_one_section_of_all_heads_is_the_item_major_order():
    """section ≥ HKV: unit u is (item u // HKV, head u % HKV), the kernel's decode without the flag."""
    work, _ = _random_work(1)
    hkv = 4
    for section in (4, 64):
        units = head_units(work, hkv, section)
        n_real = int((units[:, 0] >= 0).sum())
        for u in range(n_real):
            assert units[u, :3].tolist() == work[u // hkv].tolist() and int(units[u, 3]) == u % hkv


def test_bad_arguments_are_named():
    work, _ = _random_work(0)
    with pytest.raises(ValueError, match="work: expected"):
        head_units(work[:, :2], 4, 1)
    with pytest.raises(ValueError, match="hkv, section"):
        head_units(work, 0, 1)
    with pytest.raises(ValueError, match="hkv, section"):
        head_units(work, 4, 0)


def _doc_sets():
    rng = random.Random(7)
    yield [1] * 1000  # one-token documents: num_work ≈ 2000 rows, the windows leave 8 chunks
    yield [127] * 40 + [128] * 3 + [1] * 50
    yield [16] * 64 + [129, 255, 256, 257]
    for _ in range(40):
        n = rng.randint(1, 60)
        yield [rng.choice([1, 2, 15, 16, 17, 63, 64, 100, 127, 128, 129, 200, 255, 256, 300, 1000]) for _ in range(n)]


@pytest.mark.parametrize("tile_n, key_align", [(128, 16), (128, 1), (64, 16), (192, 16)])
def test_window_bound_cuts_only_padding(tile_n, key_align):
    """With windows the real work items never exceed num_window_items(T, tile_n): cutting the longest-first list there
    drops padding only (a dropped real item would be a key tile whose dK, dV and dQ share nobody computes)."""
    for lens in _doc_sets():
        cu = bs.cu_seqlens(lens)
        T = int(cu[-1])
        w = merge_windows(cu, tile_n, T)
        for causal in (True, False):
            work = make_work_list(w.cu, 64, tile_n, causal, key_align=key_align, T=T)
            real = int((work[:, 0] >= 0).sum())
            assert real <= num_window_items(T, tile_n), (lens[:8], tile_n, real)
            assert bool((work[real:, 0] < 0).all())


def test_many_one_token_documents_get_a_short_unit_list():
    lens = [1] * 4096
    cu = bs.cu_seqlens(lens)
    sch = bwd_schedule(cu, 64, 128, True, key_align=16, T=4096, hkv=4, head_section=2)
    assert sch.work.shape == (num_units(4096, 4096, 128, 4), 4) == (5 * 32 * 4, 4)
    assert num_work(4096, 4096, 128) * 4 > 40 * sch.work.shape[0]  # without the cut: 8224 rows per head
    plain = bwd_schedule(cu, 64, 128, True, key_align=16, T=4096)
    assert torch.equal(sch.work, head_units(plain.work[:num_window_items(4096, 128)], 4, 2))
    real = int((plain.work[:, 0] >= 0).sum())
    assert int((sch.work[:, 0] >= 0).sum()) == real * 4


def test_schedule_carries_the_unit_list():
    cu = bs.cu_seqlens([300, 5, 1000])
    plain = bwd_schedule(cu, 64, 128, True, key_align=16, T=1305)
    sec = bwd_schedule(cu, 64, 128, True, key_align=16, T=1305, hkv=4, head_section=2)
    assert torch.equal(sec.work, head_units(plain.work[:num_window_items(1305, 128)], 4, 2))
    assert sec.work.shape == (num_units(1305, 3, 128, 4), 4)
    # no windows (a 32×32-block dS): the whole list
    nowin = bwd_schedule(cu, 64, 128, True, key_align=16, T=1305, windows=False, hkv=4, head_section=2)
    assert nowin.work.shape == (num_units(1305, 3, 128, 4, windows=False), 4) == (num_work(1305, 3, 128) * 4, 4)
    assert torch.equal(sec.cu, plain.cu) and torch.equal(sec.row_doc, plain.row_doc)


# ---------------------------------------------------------------- run_attn_bwd


def _bf16_case(section: int):
    args, params = bs.generated("attn_bwd_sm90_bf16_d128_m64n128_s2_wg2_preg_longest_first")
    args = [dict(a, shape=["NUM_UNITS", "4"]) if a["name"] == "work" else a for a in args]
    return args, dict(params, bwd_head_section=section)


def test_run_attn_bwd_passes_the_unit_list():
    args, params = _bf16_case(2)
    q, k, v, do, cu = bs.bf16_inputs(with_o=False)
    T = q.shape[0]
    fn, seen = bs.recorder(args)
    lse, delta = torch.zeros(bs.HQ, T), torch.zeros(bs.HQ, T)
    run_attn_bwd(fn, args, q, k, v, do, lse, delta, cu_seqlens=cu, params=params)
    want = bwd_schedule(cu, 64, 128, True, T=T, hkv=bs.HKV, head_section=2).work
    assert seen["work"].shape == (num_units(T, cu.numel() - 1, 128, bs.HKV), 4)
    assert torch.equal(seen["work"], want)


def test_run_attn_bwd_refuses_a_schedule_without_the_heads():
    args, params = _bf16_case(1)
    q, k, v, do, cu = bs.bf16_inputs(with_o=False)
    T = q.shape[0]
    called = []
    plain = bwd_schedule(cu, 64, 128, True, T=T)  # (NUM_WORK, 3): built for a variant without the flag
    with pytest.raises(ValueError, match=r"^schedule: built for other documents or tiles.*work"):
        run_attn_bwd(lambda *a: called.append(a), args, q, k, v, do, torch.zeros(bs.HQ, T), torch.zeros(bs.HQ, T),
                     cu_seqlens=cu, params=params, schedule=plain)
    assert not called


def test_run_attn_bwd_gives_the_dynamic_scheduler_a_zeroed_counter_per_call():
    args, params = _bf16_case(2)
    i = [a["name"] for a in args].index("work")
    args = args[:i + 1] + [{"name": "unit_counter", "dtype": "int32", "shape": ["1"], "role": "inout"}] + args[i + 1:]
    params = dict(params, bwd_dynamic=True)
    q, k, v, do, cu = bs.bf16_inputs(with_o=False)
    T = q.shape[0]
    seen = []
    for _ in range(2):
        fn, got = bs.recorder(args)
        run_attn_bwd(fn, args, q, k, v, do, torch.zeros(bs.HQ, T), torch.zeros(bs.HQ, T), cu_seqlens=cu, params=params)
        c = got["unit_counter"]
        assert c.dtype == torch.int32 and c.shape == (1,) and int(c[0]) == 0
        c += 7  # what a launch leaves behind must not reach the next call
        seen.append(c)
    assert seen[0] is not seen[1]
