"""dQ on BF16 dS in the backward (flag `bwd_dq_bf16`, on for fp8_token's and fp8_token_bf16qk's tiles since 2026-12-04;
templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md "dQ on BF16 dS"). fp8_token's tile takes dQ = dS·K̂ as a BF16 wgmma on the unquantized dS and a BF16 K̂ = K codes·2^ek
the consumers write once per unit, so the tile has no dQ scale group: no dQ amax exchange, its shared-memory atomics or
its barrier. The emulator follows (`route_backward(dq_bf16=True)`); dK and dV do not change. CPU: the default renders, refusals,
the A/B tag and the emulator; `-m compile` cross-compiles. H200 (2026-12-04): verify ok, dK, dV bitwise equal
to the FP8 dQ kernel, fp8_token D = 128 causal 4×4096 / 1×16384 / skewed 0.953 / 0.932 / 0.987× its time."""

from __future__ import annotations

import ast

import jinja2
import pytest
import torch

from flamia_gen.numerics.metrics import cosine
from flamia_gen.numerics.reference import attention_backward
from flamia_gen.numerics.reference_route import route_backward, route_forward
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import get_route, load_specs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
TILE = [v for v in BWD if v.route == "fp8_token"]  # the deterministic tile too
BQK = [v for v in BWD if v.route == "fp8_token_bf16qk"]


def test_on_by_default_for_the_per_token_e4m3_ds_tiles_only():
    on = {v.name for v in TILE + BQK}
    assert len(on) == 16  # fp8_token, fp8_token_bf16qk × D 64, 128 × causal or not × deterministic or not (m64n128)
    for v in BWD:
        src = render_variant(v)
        assert (rendered_params(src).get("bwd_dq_bf16") is True) is (v.name in on), v.name
        assert ("def k_to_bf16(" in src) is (v.route == "fp8_token"), v.name


@pytest.mark.parametrize("v", TILE, ids=lambda v: v.name)
def test_flag_drops_the_dq_amax_and_takes_a_bf16_k_tile(v):
    on, off = render_variant(v), render_with_flags(v, bwd_dq_bf16=False)
    assert rendered_params(on)["bwd_dq_bf16"] is True and "bwd_dq_bf16" not in rendered_params(off)
    for s, want in ((on, True), (off, False)):
        assert ("def k_to_bf16(" in s) is want
        assert ("sK16: cute.struct.Align[cute.struct.MemRange[BFloat16" in s) is want
        # the dQ amax reduce-scatter's atomic, and the re-zeroing of its buffer
        assert ("ds_key(am[0])" in s) is not want
        assert ("sAmax[buf * m + tidx] = Uint32(0)" in s) is not want
    ast.parse(on)
    # one 256-thread barrier per tile fewer (the dQ amax one): count the consumer barriers in one_tile
    tile = lambda s: s[s.index("    def one_tile("):s.index("    def ", s.index("    def one_tile(") + 10)]  # noqa: E731
    n_on = tile(on).count("cute.arch.barrier(barrier_id=1,")
    n_off = tile(off).count("cute.arch.barrier(barrier_id=1,")
    assert n_on == n_off - 1, (n_on, n_off)  # the masked and interior copies share one text


def _refused():
    """One variant of every route without a per-token E4M3 dS tile (fp8_token's, fp8_token_bf16qk's) or mxfp8's."""
    seen, out = set(), []
    for x in BWD:
        if x.route not in ("fp8_token", "fp8_token_bf16qk", "mxfp8") and x.route not in seen:
            seen.add(x.route)
            out.append(x)
    return out


@pytest.mark.parametrize("v", _refused(), ids=lambda v: v.name)
def test_flag_refused_outside_the_plain_fp8_token_tile(v):
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dq_bf16"):
        render_with_flags(v, bwd_dq_bf16=True)


def test_ab_tag_applies_to_the_fp8_token_tile_only():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("fp8_token", "bf16"))
    tagged = [v for t, v in experiment_variants(("nodq16",), base_variants=bwd, experiments=EXPERIMENTS)
              if t == "nodq16"]
    assert len(tagged) == 4 and all(v.route == "fp8_token" and dict(v.params)["bwd_dq_bf16"] is False for v in tagged)
    bqk, _ = base_variants(routes=("fp8_token_bf16qk",))
    tagged = [v for t, v in experiment_variants(("nodq16",), base_variants=bqk, experiments=EXPERIMENTS) if t == "nodq16"]
    assert len(tagged) == 4 and all(dict(v.params)["bwd_dq_bf16"] is False and "ds_key(am[0])" in render_variant(v)
                                    for v in tagged)
    assert all("def k_to_bf16(" not in render_variant(v) for v in tagged)


@pytest.mark.parametrize("v", BQK, ids=lambda v: v.name)
def test_bf16qk_flag_takes_the_bf16_k_of_the_scores(v):
    """fp8_token_bf16qk (on since 2026-12-04): dQ = dS·K on the BF16 sK the tile holds for Sᵀ; no K̂ tile, no dQ amax."""
    on, off = render_variant(v), render_with_flags(v, bwd_dq_bf16=False)
    assert rendered_params(on)["bwd_dq_bf16"] is True and "bwd_dq_bf16" not in rendered_params(off)
    ast.parse(on)
    assert "def k_to_bf16(" not in on and "sK16" not in on
    assert "sKb = cute.composition(sK, cute.make_ordered_layout((d, n), order=(1, 0)))" in on
    assert "sKb = sKt" in off and "sKb = sKt" not in on
    assert "ds_key(am[0])" in off and "ds_key(am[0])" not in on
    tile = lambda s: s[s.index("    def one_tile("):s.index("    def ", s.index("    def one_tile(") + 10)]  # noqa: E731
    assert tile(on).count("cute.arch.barrier(barrier_id=1,") == tile(off).count("cute.arch.barrier(barrier_id=1,") - 1


def _case(seed=0, causal=True):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 150, 190, 400], dtype=torch.int32)
    q, k, v, do = (torch.randn(400, h, 64, generator=g).to(torch.bfloat16) for h in (2, 1, 1, 2))
    r = get_route("fp8_token")
    o, lse = route_forward(r, q, k, v, cu, causal, tile_m=64, tile_n=64, key_align=16)
    return r, q, k, v, o, lse, do, cu


@pytest.mark.parametrize("mma", ["exact", "sm90_fp8"])
def test_emulator_dq_bf16_changes_dq_only_and_moves_it_towards_fp32(mma):
    r, q, k, v, o, lse, do, cu = _case()
    kw = dict(tile_m=64, tile_n=64, key_align=16, mma=mma)
    dq0, dk0, dv0 = route_backward(r, q, k, v, o, lse, do, cu, True, **kw)
    dq1, dk1, dv1 = route_backward(r, q, k, v, o, lse, do, cu, True, dq_bf16=True, **kw)
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    assert not torch.equal(dq0, dq1) and torch.isfinite(dq1).all()
    ref = attention_backward(q, k, v, o, lse, do, cu, True, None)[0]
    assert float(cosine(dq1, ref)) > float(cosine(dq0, ref))
    # the unquantized dS: dQ(dq_bf16) under either product model is the same fp32 product of dS and K̂
    if mma == "sm90_fp8":
        dq_exact = route_backward(r, q, k, v, o, lse, do, cu, True, tile_m=64, tile_n=64, key_align=16,
                                  dq_bf16=True)[0]
        assert float(cosine(dq1, dq_exact)) > 0.99999


@pytest.mark.parametrize("mma", ["exact", "sm90_fp8"])
def test_emulator_bf16qk_dq_bf16_is_fp8_pv_dq(mma):
    """On fp8_token_bf16qk dq_bf16 takes dS unquantized and the BF16 k: the very dQ of fp8_pv (BF16 dS and K, the same
    forward and dS), bit for bit; dK, dV stay the route's own."""
    _, q, k, v, _, _, do, cu = _case()
    kw = dict(tile_m=64, tile_n=64, key_align=16)
    r, pv = get_route("fp8_token_bf16qk"), get_route("fp8_pv")
    o, lse = route_forward(r, q, k, v, cu, True, **kw)
    dq, dk, dv = route_backward(r, q, k, v, o, lse, do, cu, True, mma=mma, dq_bf16=True, **kw)
    dq0, dk0, dv0 = route_backward(r, q, k, v, o, lse, do, cu, True, mma=mma, **kw)
    assert torch.equal(dq, route_backward(pv, q, k, v, o, lse, do, cu, True, mma=mma, **kw)[0])
    assert torch.equal(dk, dk0) and torch.equal(dv, dv0) and not torch.equal(dq, dq0)
    ref = attention_backward(q, k, v, o, lse, do, cu, True, None)[0]
    assert float(cosine(dq, ref)) > float(cosine(dq0, ref))


def test_emulator_refuses_dq_bf16_without_an_fp8_ds_k_product():
    r, q, k, v, o, lse, do, cu = _case()
    with pytest.raises(ValueError, match="dq_bf16"):
        route_backward(get_route("bf16"), q, k, v, o, lse, do, cu, True, dq_bf16=True)
    with pytest.raises(ValueError, match="e2m1"):  # nvfp4_mixed: no BF16 K of its own for dQ
        route_backward(get_route("nvfp4_mixed"), q, k, v, o, lse, do, cu, True, dq_bf16=True)


@pytest.mark.compile
def test_compile_dq_bf16(compile_sm90):
    """Cross-compiles for sm_90a: no shared-memory max atomics (the dQ amax), BF16 wgmmas for dQ."""
    v = next(x for x in TILE if x.param("head_dim") == 128 and x.param("causal"))
    ptx = compile_sm90(v, source=render_variant(v))
    assert "atom.shared.max" not in ptx and "red.shared.max" not in ptx
    assert ".bf16.bf16" in ptx


@pytest.mark.parametrize("v", [next(v for v in TILE if v.param("causal")), next(v for v in BQK if v.param("causal"))],
                         ids=lambda v: v.name)
def test_no_kt_drops_the_kt_load_and_its_bytes(v):
    """bwd_no_kt: the producer issues no Kᵀ copy and the K/V stage expects n·d bytes fewer."""
    on, off = render_with_flags(v, bwd_no_kt=True), render_with_flags(v, bwd_no_kt=False)
    ast.parse(on)
    assert rendered_params(on)["bwd_no_kt"] is True and "bwd_no_kt" not in rendered_params(off)
    assert "cute.copy(tma_atom_kt, tKtgKt, tKtsKt, tma_bar_ptr=bar)" in off
    assert "tma_atom_kt, tKtgKt" not in on
    assert "self.bytes_kv -= n * d" in on and "self.bytes_kv -= n * d" not in off
    # only that line differs in the stage's byte count (the rest of the template is the default's)
    base = [ln for ln in off.splitlines() if "self.bytes_kv" in ln]
    assert [ln for ln in on.splitlines() if "self.bytes_kv" in ln and "-=" not in ln] == base


def test_no_kt_is_the_default_of_fp8_tokens_d128_tile_only():
    """Round 38 (H100, two runs 0.988–1.003×): on by default where it was measured, fp8_token's D = 128 tile not
    deterministic; every other tile that takes dQ on BF16 renders the Kᵀ load unless asked (mxfp8's 32×32-block tile has
    no Kᵀ tile with dQ on BF16 either way)."""
    for x in BWD:
        on = rendered_params(render_variant(x)).get("bwd_no_kt") is True
        want = x.route == "fp8_token" and x.param("head_dim") == 128 and not dict(x.params).get("deterministic")
        assert on is want, x.name


@pytest.mark.parametrize("v", _refused()[:3] + [next(x for x in TILE if x.param("causal"))], ids=lambda v: v.name)
def test_no_kt_refused_without_dq_bf16(v):
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_no_kt"):
        render_with_flags(v, bwd_no_kt=True, **({"bwd_dq_bf16": False} if v.route == "fp8_token" else {}))


# mxfp8's 32×32-block dS tile (experiment, off; twenty-seventh session): dQ on BF16 dS and K̂, no Kᵀ tile
MX = [v for v in BWD if v.route == "mxfp8"]


def test_mxfp8_flag_is_off_by_default_and_the_smem_model_follows():
    from flamia_gen.plan.feasibility import SMEM_LIMIT, attn_bwd_smem_bytes, bwd_dq_bf16

    assert len(MX) == 8
    for v in MX:
        p = dict(v.params)
        assert not bwd_dq_bf16(p) and "bwd_dq_bf16" not in rendered_params(render_variant(v))
        on = dict(p, bwd_dq_bf16=True, bwd_row_pad=False)
        assert bwd_dq_bf16(on)
        # BF16 dS (+ m·n·2 bytes), the K̂ tile (+ 2·n·d), no Kᵀ tile (− n·d)
        m, n, d = p["tile_m"], p["tile_n"], p["head_dim"]
        assert attn_bwd_smem_bytes(on, 1) - attn_bwd_smem_bytes(p, 1) == 2 * m * n + n * d
        assert attn_bwd_smem_bytes(dict(on, bwd_row_pad=True), 1) <= SMEM_LIMIT[v.arch]  # the padding's 2 KB too
    for v in BWD:  # the other 32×32-block routes keep their FP8 dQ: their tiles refuse the flag
        if v.route in ("mxfp8_exact", "nvfp4_mixed"):
            assert not bwd_dq_bf16(dict(v.params, bwd_dq_bf16=True))


@pytest.mark.parametrize("v", MX, ids=lambda v: v.name)
def test_mxfp8_flag_drops_the_dq_block_exponent_and_the_kt_tile(v):
    on, off = render_with_flags(v, bwd_dq_bf16=True), render_variant(v)
    ast.parse(on)
    p = rendered_params(on)
    # the per-query words swizzled as every FP8 tile's but fp8_pv's (round 30); the padding where asked for
    assert p["bwd_dq_bf16"] is True and p["bwd_no_kt"] is True and p.get("bwd_row_swz") is True and "bwd_row_pad" not in p
    assert rendered_params(render_with_flags(v, bwd_dq_bf16=True, bwd_row_pad=True)).get("bwd_row_pad") is True
    assert "bwd_row_swz" not in rendered_params(render_with_flags(v, bwd_dq_bf16=True, bwd_row_pad=True))
    assert "def k_to_bf16(" in on and "def k_to_bf16(" not in off
    # the Kᵀ tile: neither allocated nor loaded (its name aliases sK16) and the stage expects n·d bytes fewer
    assert "sKt: cute.struct.Align" in off and "sKt: cute.struct.Align" not in on
    assert "sKt = storage.sK16.get_tensor(" in on
    assert "cute.copy(tma_atom_kt, tKtgKt, tKtsKt, tma_bar_ptr=bar)" in off and "tma_atom_kt, tKtgKt" not in on
    assert "self.bytes_kv -= n * d" in on
    # dQ's exponent (column amaxes, the 32-query block key, windows' block ∩ document keys) is gone ...
    for gone in ("ds_key(am[0])", "pow2i_neg_ds_key(bk[", "sAmax[buf * m + tidx] = Uint32(0)"):
        assert gone in off and gone not in on, gone
    assert "sBlk[SQW_Q0 + tidx] = Float32(gk)" in off and "sBlk[SQW_Q0 + tidx]" not in on  # windows: block ∩ document
    # ... dK's 32×32 blocks stay
    for kept in ("cute.arch.barrier(barrier_id=SQ32_BARRIER0 + warp // 2, number_of_threads=64)", "e_blk = ds_exponent(blk)"):
        assert kept in on and kept in off
    tile = lambda s: s[s.index("    def one_tile("):s.index("    def ", s.index("    def one_tile(") + 10)]  # noqa: E731
    barriers = lambda s: tile(s).count("cute.arch.barrier(barrier_id=1,")  # noqa: E731
    assert barriers(on) == barriers(off) - 2  # the dQ amax's and the windows' block key


def test_mxfp8_ab_tag():
    from flamia_gen.bench.bwd_experiments import EXPERIMENTS, base_variants, experiment_variants

    bwd, _ = base_variants(routes=("mxfp8", "mxfp8_exact", "nvfp4_mixed", "fp8_token"))
    tagged = [v for t, v in experiment_variants(("dq16sq",), base_variants=bwd, experiments=EXPERIMENTS) if t == "dq16sq"]
    assert len(tagged) == 4 and all(v.route == "mxfp8" for v in tagged)  # D = 128 × causal or not × det or not
    for v in tagged:
        p = rendered_params(render_variant(v))
        assert p["bwd_dq_bf16"] is True and p.get("bwd_row_swz") is True and "bwd_row_pad" not in p


def test_emulator_mxfp8_dq_bf16_changes_dq_only_and_moves_it_towards_fp32():
    _, q, k, v, _, _, do, cu = _case()
    r = get_route("mxfp8")
    o, lse = route_forward(r, q, k, v, cu, True, tile_m=128, tile_n=128, key_align=16)
    kw = dict(tile_m=64, tile_n=128, key_align=16, fwd_tile_m=128, fwd_tile_n=128, mma="sm90_fp8")
    dq0, dk0, dv0 = route_backward(r, q, k, v, o, lse, do, cu, True, **kw)
    dq1, dk1, dv1 = route_backward(r, q, k, v, o, lse, do, cu, True, dq_bf16=True, **kw)
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1) and not torch.equal(dq0, dq1)
    ref = attention_backward(q, k, v, o, lse, do, cu, True, None)[0]
    assert float(cosine(dq1, ref)) > float(cosine(dq0, ref)) > 0.99


@pytest.mark.compile
def test_compile_mxfp8_dq_bf16_not_serialised(compile_sm90, tmp_path):
    """mxfp8's flagged D = 128 causal tile (the tightest shared memory) compiles for sm_90a with BF16 dQ wgmmas and
    ptxas keeps every wgmma asynchronous (the SASS)."""
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    v = next(x for x in MX if x.param("head_dim") == 128 and x.param("causal") and not dict(x.params).get("deterministic"))
    ptx = compile_sm90(v, source=render_with_flags(v, bwd_dq_bf16=True, bwd_row_pad=False))
    assert ".bf16.bf16" in ptx and "atom.shared.max" not in ptx
    if missing_tools():
        pytest.skip(missing_tools())
    loops = describe(str(tmp_path / f"{v.name}.o"))["loops"]
    assert loops and not any(serialised(lp) for lp in loops), loops
