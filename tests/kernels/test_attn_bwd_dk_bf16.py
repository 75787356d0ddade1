"""`bwd_dk_bf16` (templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md "dK on BF16 dS'"): fp8_token's backward tile
takes dK = dS'ᵀ·Q̂ as a BF16 wgmma — A the BF16 dS' that dQ already takes, B Q̂ = Q's E4M3 codes·2^(eq+edo), a BF16
(tile_m, D) tile a stage loaded like Q (with its row permutation) in the place of Qᵀ — instead of quantizing dS per
(key, query tile) with a running exponent. The call's first launch (`q_hat_build`) writes Q̂ into a workspace the
runtime allocates (`runtime.attn_bwd.q_hat_workspace`); `numerics.q_hat.q_hat` is its bitwise reference.

CPU: the flagged render against the default (the dK scale chain gone, the BF16 operand in, no Kᵀ tile), its refusals,
the smem model, Q̂'s reference values, the wrapper's workspace and verify's bitwise check; `compile` tests
cross-compile the flagged tile for sm_90a. The kernel runs on the GPU through `python -m flamia_gen.bench.bwd_experiments
run` (tag `dk16`) and `flamia-gen verify --device cuda`, which hold dK to the emulator's `dk_bf16` and Q̂ to its
reference bit for bit.
"""

from __future__ import annotations

import jinja2
import pytest
import torch
from kernel_source import method_source

from flamia_gen.plan import make_plan
from flamia_gen.plan.feasibility import SMEM_LIMIT, attn_bwd_smem_bytes, bwd_dk_bf16
from flamia_gen.render.render import render_variant, render_with_flags, rendered_literals, rendered_params
from flamia_gen.numerics.q_hat import q_hat
from flamia_gen.runtime.attn_bwd import is_q_hat_spec, q_hat_workspace, run_attn_bwd
from flamia_gen.verify.attn_gpu import q_hat_bitwise
from flamia_gen.spec import Arch, load_specs

from test_attn_bwd_template import _fp8_inputs

PLAN = make_plan(load_specs(), arch="sm90")
BWD = [v for v in PLAN.variants if v.kind.value == "attn_bwd"]
TOKEN = [v for v in BWD if v.route == "fp8_token"]
D128 = [v for v in TOKEN if v.param("head_dim") == 128 and not dict(v.params).get("deterministic")]


def _lit(src):
    return rendered_literals(src, ("PARAMS", "ARGS"))


def test_off_by_default():
    for v in BWD:
        assert "bwd_dk_bf16" not in render_variant(v), v.name


@pytest.mark.parametrize("v", D128, ids=lambda v: v.name)
def test_flagged_tile(v):
    base, src = render_variant(v), render_with_flags(v, bwd_dk_bf16=True)
    p = rendered_params(src)
    assert p["bwd_dk_bf16"] is True and p["bwd_no_kt"] is True and p["bwd_q_row_perm"] is True
    args = _lit(src)["ARGS"]
    names = [a["name"] for a in args]
    assert names[:3] == ["q", "q_hat", "q_scale"] and "q_t" not in names
    assert next(a for a in args if a["name"] == "q_hat") == {"name": "q_hat", "dtype": "bfloat16",
                                                              "shape": ["T", "HQ", "D"], "role": "workspace"}
    # the call launches q_hat_build (every T_PAD row) before the tile kernel, on its stream
    call = method_source(src, "__call__")
    assert call.index("self.q_hat_build(mQ, mQs, mdOs, mQh") < call.index("self.kernel(")
    assert "qh_rows = mdOt.shape[2] * mQ.shape[1]" in call and "q_hat_build" not in base
    assert names[3:] == [a["name"] for a in _lit(base)["ARGS"]][3:]
    assert is_q_hat_spec(args) and not is_q_hat_spec(_lit(base)["ARGS"])
    tile, tile0 = method_source(src, "one_tile"), method_source(base, "one_tile")
    # dK's per-pair chain (y, row amax, running exponent and its rescale, 1/2^E) and its E4M3 codes are gone
    for step in ("y = acc_dP[i] * qf[cp]", "quad_max_nan(mx[rh])", "acc_dK[i] = acc_dK[i] * f",
                 "acc_S[i] = acc_S[i] * inv[(i // 2) % 2]", "self.convert_p(acc_S, tdKrdS)"):
        assert step in tile0 and step not in tile, step
    # the BF16 A fragment from dS' and dK's own (BF16) tiled MMA, still issued after dQ (bwd_dq_first)
    assert tile.count("self.convert_bf16(acc_dP, tdKrdS)") == 1
    assert tile.index("self.gemm(tiled_mma_dq, acc_dQ") < tile.index("self.gemm(tiled_mma_dk, acc_dK, tdKrdS, tdKrQ")
    assert "tiled_mma_dkv, acc_dK" not in tile
    assert "BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN" in \
        method_source(src, "_tiled_mmas").split("dk = ")[1]
    # Q̂ in the Qᵀ slot: a BF16 (m, d) tile, loaded through Q's row-permuting view, taken MN-major; no Kᵀ tile
    assert "self.sQt_layout = make_smem_layout(BFloat16, (m, d), st)" in src
    assert "mQtv = self.q_rows_view(mQh, mdOt.shape[2])" in src and "mQv = self.q_rows_view(mQ, mdOt.shape[2])" in src
    assert "sQt: cute.struct.Align[cute.struct.MemRange[BFloat16" in src
    assert "sKt: cute.struct" in base and "sKt: cute.struct" not in src
    assert "self.bytes_q += m * d" in src
    assert "sQb = cute.composition(sQt, cute.make_ordered_layout((d, m, self.stages), order=(1, 0, 2)))" in src
    # the epilogue: dK = acc·softmax_scale (no 2^E)
    epi, epi0 = method_source(src, "epilogue"), method_source(base, "epilogue")
    assert "fk[rh] = pow2i(run[rh]) * softmax_scale" in epi0 and "pow2i(run[rh])" not in epi
    assert "fk[rh] = softmax_scale  # bwd_dk_bf16" in epi
    # the dQ and dV side is untouched: the dS' store for dQ and the dV conversion stay
    for keep in ("self.store_ds(", "self.gemm(tiled_mma_dkv, acc_dV, tdVrP"):
        assert tile.count(keep) == tile0.count(keep) >= 1, keep


def test_other_tiles_refuse_it():
    for route in ("bf16", "mxfp8", "fp8_tensor", "fp8_pv", "fp8_token_bf16qk", "mxfp8_exact"):
        v = next(x for x in BWD if x.route == route)
        with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dk_bf16_is_built_for"):
            render_with_flags(v, bwd_dk_bf16=True)
    v = D128[0]
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_dk_bf16_is_built_for"):
        render_with_flags(v, bwd_dk_bf16=True, bwd_dq_bf16=False)  # no BF16 dS' without dQ on BF16
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_s_ahead_is_built_for"):
        render_with_flags(v, bwd_dk_bf16=True, bwd_s_ahead=True)
    with pytest.raises(jinja2.exceptions.UndefinedError, match="bwd_ablate_dk_quant_is_built_for"):
        render_with_flags(v, bwd_dk_bf16=True, bwd_ablate_dk_quant=True)


def test_other_fp8_token_tiles_render_it():
    """D = 64 and the deterministic tiles (no Kᵀ load by default there: the flag brings bwd_no_kt)."""
    for v in TOKEN:
        p = rendered_params(render_with_flags(v, bwd_dk_bf16=True))
        assert p["bwd_dk_bf16"] is True and p["bwd_no_kt"] is True, v.name


def test_smem_model():
    for v in TOKEN:
        p = dict(v.params)
        assert bwd_dk_bf16(dict(p, bwd_dk_bf16=True)) and not bwd_dk_bf16(p)
        # Q̂'s stages take 2·m·d bytes where Qᵀ's took m·d; the Kᵀ tile (n·d) goes: the same bytes at m64 n128
        got = attn_bwd_smem_bytes(dict(p, bwd_dk_bf16=True), 1)
        assert got == attn_bwd_smem_bytes(p, 1) + (p["stages"] * p["tile_m"] - p["tile_n"]) * p["head_dim"]
        assert got <= SMEM_LIMIT[Arch.sm90]
    assert not bwd_dk_bf16(dict(next(v for v in BWD if v.route == "fp8_token_bf16qk").params, bwd_dk_bf16=True))


def _pow2(code: torch.Tensor) -> torch.Tensor:
    """2^(code − 127) in float64, 0 for code 0 (the kernel's bits: code << 23 as fp32)."""
    c = code.to(torch.float64)
    return torch.where(code == 0, torch.zeros_like(c), torch.exp2(c - 127))


def _codes_and_scales(T=37, H=3, D=128, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (T, H, D), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0x3C  # no NaN codes (E4M3 0x7F / 0xFF)
    qs = torch.randint(100, 150, (T, H), dtype=torch.uint8, generator=g)
    ds = torch.randint(100, 150, (T, H), dtype=torch.uint8, generator=g)
    ds[0, 0], ds[1, 1], qs[2, 2] = 255, 0, 0  # dO's NaN code keeps factor 1; code 0 is a zero factor
    return q, qs, ds


def test_q_hat_reference_values():
    q, qs, ds = _codes_and_scales()
    got = q_hat(q, qs, ds)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    fdo = torch.where(ds == 255, torch.ones_like(_pow2(ds)), _pow2(ds))
    want = q.view(torch.float8_e4m3fn).to(torch.float64) * (_pow2(qs) * fdo).unsqueeze(-1)
    assert torch.equal(got.to(torch.float64), want)  # exact: a code's 4 significant bits times a power of two
    assert torch.equal(got[0, 0].double(), q[0, 0].view(torch.float8_e4m3fn).double() * 2.0 ** (int(qs[0, 0]) - 127))
    assert not got[1, 1].any() and not got[2, 2].any()
    assert torch.equal(q_hat(q.view(torch.float8_e4m3fn), qs, ds).view(torch.int16), got.view(torch.int16))
    with pytest.raises(ValueError, match="q_hat: codes"):
        q_hat(q, qs[:-1], ds)


def test_verify_holds_q_hat_to_its_reference_bitwise():
    q, qs, ds = _codes_and_scales()
    T, H, D = q.shape
    ws = q_hat_workspace(T, H, D, 48, "cpu")
    full = torch.as_strided(ws, (48, H, D), ws.stride())
    assert ws.shape == (T, H, D) and full.untyped_storage().nbytes() == 48 * H * D * 2
    full.zero_()
    ws.copy_(q_hat(q, qs, ds))  # what the call's q_hat_build writes
    keep = dict(q=q.view(torch.float8_e4m3fn), q_scale=qs, do_scale=ds, q_hat=ws)
    assert q_hat_bitwise(keep) is True and q_hat_bitwise({}) is None
    ws.view(torch.int16)[5, 1, 7] ^= 1  # one bit
    assert q_hat_bitwise(keep) is False
    ws.view(torch.int16)[5, 1, 7] ^= 1
    full[T + 2, 0, 0] = 1.0  # a padding row not zero
    assert q_hat_bitwise(keep) is False


@pytest.mark.parametrize("v", D128[:1], ids=lambda v: v.name)
def test_wrapper_passes_a_q_hat_workspace(v):
    lit = _lit(render_with_flags(v, bwd_dk_bf16=True))
    x = _fp8_inputs()
    with pytest.raises(ValueError, match="^q_t: this variant's dK takes Q̂"):
        run_attn_bwd(lambda *a: None, lit["ARGS"], **x, params=lit["PARAMS"])
    del x["q_t"]  # the op's Q launch skips the Qᵀ codes (skip_transposed)
    seen, keep = [], {}
    run_attn_bwd(lambda *a: seen.extend(a), lit["ARGS"], **x, params=lit["PARAMS"], keep=keep)
    by = dict(zip([a["name"] for a in lit["ARGS"]], seen))
    assert len(seen) == len(lit["ARGS"]) and "q_t" not in by and keep["q_hat"] is by["q_hat"]
    T, H, D = x["q"].shape
    tpad = x["do_t"].shape[2]
    assert by["q_hat"].dtype == torch.bfloat16 and by["q_hat"].shape == (T, H, D) and by["q_hat"].is_contiguous()
    assert by["q_hat"].untyped_storage().nbytes() == tpad * H * D * 2  # the row-permuting TMA reads T_PAD rows
    assert by["q"].dtype == torch.float8_e4m3fn  # S = K·Qᵀ keeps the codes


@pytest.mark.compile
def test_compile(compile_sm90, tmp_path):
    from flamia_gen.bench.sass import describe, missing_tools, serialised

    v = next(x for x in D128 if x.param("causal"))
    ptx = compile_sm90(v, render_with_flags(v, bwd_dk_bf16=True))
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx  # dK: A = dS'ᵀ from registers, B = Q̂
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # dV
    if missing_tools():
        pytest.skip(missing_tools())
    loops = describe(str(tmp_path / f"{v.name}.o"))["loops"]
    assert loops and not any(serialised(lp) for lp in loops), loops
