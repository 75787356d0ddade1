"""Leakage probe (DESIGN.md §5) on the emulated routes."""

import math

import pytest
import torch

from flamia_gen.numerics import leakage_probe
from flamia_gen.numerics.probe import ProbeResult, default_positions
from flamia_gen.numerics.reference import attention

LENS = [96, 64]
# doc 0: mid first block, mid second block, last token; doc 1: mid of its second block
POSITIONS = [17, 40, 95, 96 + 45]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Small tensors: one intra-op thread is much faster on a shared 2-core machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _inputs(hq=2, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    q, k, v = (torch.randn(T, h, d, generator=g).to(torch.bfloat16).float() for h in (hq, hkv, hkv))
    cu = torch.tensor([0, LENS[0], T], dtype=torch.int32)
    return q, k, v, cu


def _fn(route, tile_m=64, tile_n=32):
    return lambda q, k, v, cu: attention(q, k, v, cu, route=route, tile_m=tile_m, tile_n=tile_n)


@pytest.mark.parametrize("route,hkv", [("bf16", 2), ("fp8_token", 1), ("mxfp8_exact", 2), ("mxfp8_exact", 1)])
def test_exact_routes_show_exactly_zero(route, hkv):
    q, k, v, cu = _inputs(hkv=hkv)
    res = leakage_probe(_fn(route), q, k, v, cu, positions=POSITIONS)
    assert isinstance(res, ProbeResult) and res.positions == POSITIONS
    assert len(res.records) == 4 * len(POSITIONS)
    for op in ("q", "k", "v", "do"):
        assert res.o_leak[op] == 0.0 and res.dq_leak[op] == 0.0, (op, res.o_leak, res.dq_leak)
    assert res.exact and res.max_leak == 0.0


def test_mxfp8_exact_with_square_tiles_and_large_factor():
    q, k, v, cu = _inputs()
    res = leakage_probe(_fn("mxfp8_exact", 32, 32), q, k, v, cu, positions=[33, 70], factor=1e6)
    assert res.exact, res.to_dict()


def test_mxfp8_leaks_only_inside_its_32_token_block():
    q, k, v, cu = _inputs()
    res = leakage_probe(_fn("mxfp8"), q, k, v, cu, positions=POSITIONS)
    assert res.max_leak_outside_block == 0.0, res.to_dict()
    assert all(x == 0.0 for x in res.o_leak_outside_block.values())
    assert all(x == 0.0 for x in res.dq_leak_outside_block.values())
    # ... and it does leak within the block (the token-block Q exponent moves earlier codes)
    assert res.o_leak["q"] > 0 and res.dq_leak["q"] > 0 and not res.exact


def test_fp8_tensor_leaks():
    q, k, v, cu = _inputs()
    res = leakage_probe(_fn("fp8_tensor"), q, k, v, cu, positions=[40, 95], operands=("q", "k", "v"))
    assert set(res.o_leak) == {"q", "k", "v"}
    assert res.o_leak["k"] > 0 and res.o_leak["v"] > 0 and res.dq_leak["q"] > 0
    assert res.max_leak_outside_block > 0 and not res.exact


def test_exact_reference_is_exact_and_probe_sees_a_planted_leak():
    q, k, v, cu = _inputs(d=32)
    assert leakage_probe(lambda *a: attention(*a), q, k, v, cu, positions=[50]).exact

    def leaky(q, k, v, cu):  # a tensor-wide rescale: every row moves
        return attention(q, k, v, cu) * (1 + 1e-3 * k.detach().abs().amax())

    res = leakage_probe(leaky, q, k, v, cu, positions=[50], operands=("k",))
    assert res.o_leak["k"] > 0 and math.isfinite(res.o_leak["k"]) and not res.exact


def test_default_positions_and_bad_operand():
    cu = torch.tensor([0, 10, 200, 210], dtype=torch.int32)
    pos = default_positions(cu)
    assert all(10 <= p < 200 for p in pos) and 199 in pos
    q, k, v, cu2 = _inputs(d=32)
    with pytest.raises(ValueError, match="allowed values"):
        leakage_probe(_fn("bf16"), q, k, v, cu2, operands=("x",))


@pytest.mark.parametrize("route", ["mxfp8_exact", "fp8_token"])
def test_exactness_sweep_over_positions_with_small_tokens(route):
    # tokens 1e-3 smaller than their neighbours make every underflow channel visible
    q, k, v, cu = _inputs(seed=5)
    for x in (q, k, v):
        x[3::5] *= 1e-3
    positions = list(range(1, 96, 7)) + [97, 130, 159]
    res = leakage_probe(_fn(route, 64, 32), q, k, v, cu, positions=positions)
    assert res.exact, {r.operand: (r.position, r.o_leak, r.dq_leak) for r in res.records if r.o_leak or r.dq_leak}


def test_mxfp8_block_leak_sweep():
    q, k, v, cu = _inputs(seed=5)
    for x in (q, k, v):
        x[3::5] *= 1e-3
    res = leakage_probe(_fn("mxfp8", 64, 32), q, k, v, cu, positions=list(range(1, 96, 7)) + [130])
    assert res.max_leak_outside_block == 0.0 and res.max_leak > 0
