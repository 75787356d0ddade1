"""One bulk reduce-add per writer warp and query tile (flag `bwd_dq_tile_copy`; experiment, off; templates/sm90/
attn_bwd.py.j2; runtime.attn_bwd.dq_accum_natural).

CPU: the flag renders only with the dQ writer warp; the staging tile loses its padding, the consumers' 8-byte stores
take the chunk swizzle, the writer issues one copy per warp (lane 0) over the document's rows of its share, at the
head-major row; a model of the wgmma C fragment shows the swizzled stores conflict-free (2 wavefronts per 256-byte
warp store, as the padded tile) where the unpadded tile without the swizzle takes 8; the runtime's conversion inverts
the kernel's placement for any token alignment and both head dims.
"""

from __future__ import annotations

import jinja2
import pytest
import torch

from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_with_flags, rendered_params
from flamia_gen.runtime.attn_bwd import dq_accum_natural
from flamia_gen.spec import load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]


def _pick(route, det=False, hd=128):
    return next(v for v in BWD if v.route == route and v.param("head_dim") == hd and v.param("causal")
                and bool(dict(v.params).get("deterministic")) == det)


@pytest.mark.parametrize("route", ["bf16", "fp8_token"])
def test_renders_with_the_writer_warp(route):
    v = _pick(route)
    on, off = render_with_flags(v, bwd_dq_tile_copy=True), render_with_flags(v, bwd_dq_tile_copy=False)
    assert rendered_params(on)["bwd_dq_tile_copy"] is True and "bwd_dq_tile_copy" not in rendered_params(off)
    assert "DQ_LD = HEAD_DIM  # bwd_dq_tile_copy" in on and "DQ_LD = HEAD_DIM + 8" in off
    writer = on[on.index("    def dq_writer("):on.index("    def mma(")]
    assert writer.count("bulk_reduce_add_f32(") == 1 and "if (lane == 0) & (hi > lo):" in writer
    assert "off = (head * mdQacc.shape[0] + q_tok0 + lo) * self.head_dim" in writer
    assert "col = tdQcdQ[2 * j][1] ^ swz[j % 2]" in on
    assert "swz[rh] = ((q_tok0 + tdQcdQ[2 * rh][0]) & Int32(7)) << Int32(2)" in on


def test_refused_without_the_writer_warp():
    for v in (_pick("fp8_token", det=True), _pick("fp8_tensor")):  # deterministic; tensor-scaled dS (no writer)
        with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_tile_copy"):
            render_with_flags(v, bwd_dq_tile_copy=True)


def _fragment(lane, warp, rh, j, wgcol):
    """(row, col) of the first element of pair j of a thread in the dQ wgmma's C fragment (64 × 64 per warpgroup):
    row 16·warp + lane // 4 + 8·rh, col wgcol + 8·j + 2·(lane % 4)."""
    return 16 * warp + lane // 4 + 8 * rh, wgcol + 8 * j + 2 * (lane % 4)


def _wavefronts(words):
    """Shared-memory wavefronts of one warp's 8-byte stores: the largest number of distinct 4-byte words one bank gets,
    and at least 2 (256 bytes)."""
    banks = {}
    for w0 in words:
        for w in (w0, w0 + 1):
            banks.setdefault(w % 32, set()).add(w)
    return max(2, max(len(s) for s in banks.values()))


@pytest.mark.parametrize("tok0", [0, 16, 5])
def test_swizzled_stores_are_conflict_free(tok0):
    D = 128
    for warp in range(4):
        for rh in range(2):
            for j in range(8):
                frag = [_fragment(lane, warp, rh, j, 64) for lane in range(32)]
                assert _wavefronts([r * D + (c ^ (((tok0 + r) & 7) << 2)) for r, c in frag]) == 2
                assert _wavefronts([r * D + c for r, c in frag]) == 8  # unpadded, unswizzled
                assert _wavefronts([r * (D + 8) + c for r, c in frag]) == 2  # the default's padded rows


@pytest.mark.parametrize("T,H,D,tok0s", [(37, 3, 64, (0, 16, 21)), (200, 2, 128, (5, 64, 131))])
def test_the_kernels_placement_and_the_conversion_invert_each_other(T, H, D, tok0s):
    """Model of the kernel: the consumers put element (r, c) of a tile whose row 0 is token tok0 at staging word
    r·D + (c XOR 4·((tok0 + r) & 7)); the writer copies rows [lo, hi) verbatim to head-major row h·T + tok0 + r. The
    conversion must return every element at (token, head, c)."""
    g = torch.Generator().manual_seed(0)
    nat = torch.randn(T, H, D, generator=g)
    store = torch.zeros(T * H * D)
    for h in range(H):
        for tok0 in tok0s:
            for r in range(64):
                t = tok0 + r
                if not 0 <= t < T:
                    continue
                staged = torch.empty(D)
                for c in range(D):
                    staged[c ^ (((tok0 + r) & 7) << 2)] = nat[t, h, c]
                store[(h * T + t) * D:(h * T + t + 1) * D] += staged
    want = torch.zeros(T, H, D)
    for tok0 in tok0s:
        for t in range(max(tok0, 0), min(tok0 + 64, T)):
            want[t] += nat[t]
    assert torch.equal(dq_accum_natural(store.view(T, H, D)), want)
    assert torch.equal(dq_accum_natural(store.view(T, H, D), torch.bfloat16), want.to(torch.bfloat16))


def test_conversion_refuses_a_head_dim_off_the_chunk_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        dq_accum_natural(torch.zeros(4, 2, 48))
