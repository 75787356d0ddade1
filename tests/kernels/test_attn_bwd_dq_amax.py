"""The FP8 backward's dQ-scale amax (templates/sm90/attn_bwd.py.j2, one_tile; docs/kernels/attn_bwd.md
"dQ amax by reduce-scatter").

CPU only. The rendered module's own helpers run on Python ints with stand-ins for the DSL scalar
types: `dq_amax_owned` must name, for every lane and batch, exactly the column whose whole-warp
maximum the reduce-scatter leaves in that lane (simulated over 32 lanes with the template's round
rule), every column of the warp must be owned, and the order-key exponents (`ds_key`,
`pow2i_neg_ds_key`, `pow2i_ds_key`) must equal the quantizer contract's `ceil` exponent
(numerics.quantize.pow2_exponent) and the kernel's previous ds_exponent on every finite amax.
On the H200 the kernels are compared with the old path bit for bit (`bench.bwd_experiments`).
"""

from __future__ import annotations

import ast
import struct

import pytest
import torch

from flamia_gen.numerics.quantize import pow2_exponent
from flamia_gen.plan import make_plan
from flamia_gen.render.render import render_variant, render_with_flags, rendered_params
from flamia_gen.spec import ExponentRule, Format, load_specs


@pytest.fixture(scope="module")
def fp8_variant():
    """fp8_token_bf16qk's tile (rendered with the FP8 dQ, see _render_fp8_dq)."""
    plan = make_plan(load_specs(), arch="sm90")
    return next(v for v in plan.variants if v.kind.value == "attn_bwd" and v.route == "fp8_token_bf16qk"
                and v.param("head_dim") == 128 and v.param("causal") and not dict(v.params).get("deterministic"))


def _render_fp8_dq(v, **over) -> str:
    """render_with_flags with the FP8 dQ (bwd_dq_bf16 off) unless asked: since 2026-12-04 every per-token dS tile takes
    dQ on BF16 by default, and the dQ amax lives on as the `nodq16` A/B copy's."""
    return render_with_flags(v, **{"bwd_dq_bf16": False, **over})


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _float(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


class _C:  # cutlass.min / cutlass.max on ints
    min = staticmethod(min)
    max = staticmethod(max)


def _helpers(src: str, names=("dq_amax_owned", "ds_key", "pow2i_neg_ds_key", "pow2i_ds_key", "ds_exponent",
                              "pow2i")):
    """The named module-level functions and constants of a rendered backward, runnable on Python ints."""
    tree = ast.parse(src)
    consts, fns = {}, []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("DQ_AMAX_CG", "DQ_AMAX_SCATTER"):
            consts[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            fns.append(node)
    ns = dict(consts, cutlass=_C, Int32=int, Uint32=lambda x: int(x) & 0xFFFFFFFF, f32_bits=_bits, bits_f32=_float)
    exec(compile(ast.Module(body=fns, type_ignores=[]), "attn_bwd_helpers", "exec"), ns)
    return ns


def _simulate(ns, vals: torch.Tensor) -> dict:
    """The template's batches over 32 lanes: vals[lane, cg, cp] (the thread's max over its 2 key rows).
    Round r (xor 4·2^r, r < SCATTER) keeps the upper half iff bit 2 + r of the lane is set; the
    remaining rounds (up to xor 16) are plain butterflies. → {(lane, b): value left in am[0]}."""
    cg_per, scatter = ns["DQ_AMAX_CG"], ns["DQ_AMAX_SCATTER"]
    out = {}
    for b in range(8 // cg_per):
        am = [[float(vals[l, cg_per * b + cl, cp]) for cl in range(cg_per) for cp in range(2)] for l in range(32)]
        half = cg_per
        for rnd in range(scatter):
            new = []
            for l in range(32):
                p = l ^ (4 << rnd)
                up_l, up_p = (l >> (2 + rnd)) & 1, (p >> (2 + rnd)) & 1
                row = list(am[l])
                for v in range(half):
                    keep = am[l][v + half] if up_l else am[l][v]
                    send_p = am[p][v] if up_p else am[p][v + half]
                    row[v] = max(keep, send_p)
                new.append(row)
            am, half = new, half // 2
        for rnd in range(scatter, 3):
            am = [[max(am[l][0], am[l ^ (4 << rnd)][0])] + am[l][1:] for l in range(32)]
        for l in range(32):
            out[(l, b)] = am[l][0]
    return out


@pytest.mark.parametrize("cg", [1, 2, 4])
def test_reduce_scatter_owner_is_the_column_it_holds(fp8_variant, cg):
    src = _render_fp8_dq(fp8_variant, bwd_alu_trim=True, bwd_dq_amax_cg=cg)
    ns = _helpers(src)
    assert ns["DQ_AMAX_CG"] == cg and ns["DQ_AMAX_SCATTER"] == {1: 1, 2: 2, 4: 3}[cg]
    # the round rule the simulation restates, as the kernel has it
    assert "upper = ((lane >> Int32(2 + rnd)) & Int32(1)) != Int32(0)" in src
    assert "send = Float32(cutlass.select_(upper, am[v], am[v + half]))" in src
    assert "keep = Float32(cutlass.select_(upper, am[v + half], am[v]))" in src
    g = torch.Generator().manual_seed(cg)
    for trial in range(3):
        vals = torch.rand((32, 8, 2), generator=g)  # distinct values: a wrong column cannot pass by luck
        got = _simulate(ns, vals)
        owned = {}
        for (lane, b), value in got.items():
            cg_own, cp_own = ns["dq_amax_owned"](lane, b)
            assert cg * b <= cg_own < cg * (b + 1) and cp_own in (0, 1)
            col = 8 * cg_own + 2 * (lane % 4) + cp_own  # wgmma C layout
            # the whole-warp maximum of that column: the 8 lanes with the same lane % 4
            want = max(float(vals[l, cg_own, cp_own]) for l in range(32) if l % 4 == lane % 4)
            assert value == want, (lane, b, cg_own, cp_own)
            owned.setdefault(col, set()).add(value)
        assert sorted(owned) == list(range(64))  # every column of the 64-query tile, once or with one value
        assert all(len(s) == 1 for s in owned.values())


def test_on_by_default_and_the_untrimmed_kernel_renders(fp8_variant):
    """On by default since its H200 run (2026-12-01: bitwise the untrimmed kernel's values): batches of 2
    column groups, no per-column branch. Off (bwd_alu_trim=False): none of the trim, the kernel verified
    before it; bwd_dq_amax_cg=0 keeps the per-column butterfly and its lane < 4 atomics."""
    off = _render_fp8_dq(fp8_variant, bwd_alu_trim=False)
    assert "bwd_alu_trim" not in off and "DQ_AMAX_CG" not in off and "ds_key" not in off
    assert "if lane < 4:" in off and "sRow[rbase + row_word(c, 5)] = Float32(dcs[j] - 127)" in off
    on = _render_fp8_dq(fp8_variant)
    assert on == _render_fp8_dq(fp8_variant, bwd_alu_trim=True, bwd_dq_amax_cg=2)
    assert '"bwd_alu_trim": True' in on and "DQ_AMAX_CG = 2" in on and "if lane < 4:" not in on
    assert "sRow[rbase + row_word(c, 5)] = bits_f32(Uint32(dcs[j]))" in on and "Int32(ed[cp])" not in on
    old = _render_fp8_dq(fp8_variant, bwd_alu_trim=True, bwd_dq_amax_cg=0)
    assert "DQ_AMAX_CG = 0" in old and "if lane < 4:" in old and "cg_own, cp_own = dq_amax_owned(lane, b)" not in old
    with pytest.raises(Exception, match="bwd_dq_amax_cg"):
        _render_fp8_dq(fp8_variant, bwd_alu_trim=True, bwd_dq_amax_cg=3)


def _amax_samples() -> list[float]:
    g = torch.Generator().manual_seed(0)
    edges = [0.0, 2.0 ** -149, 2.0 ** -127, 2.0 ** -126, 1.0, 1.75, 1.75 + 2.0 ** -22, 448.0, 448.0 * (1 + 2.0 ** -23),
             3.4e38, 2.0 ** 120, 2.0 ** 127 * 1.9]
    rnd = (torch.randn(20000, generator=g).abs() * torch.exp2(torch.randint(-140, 128, (20000,), generator=g).float()))
    return edges + [x for x in rnd.tolist() if x < 3.4e38]


def test_order_keys_give_the_contract_exponent(fp8_variant):
    ns = _helpers(_render_fp8_dq(fp8_variant, bwd_alu_trim=True))
    amax = _amax_samples()
    ref, _, _ = pow2_exponent(torch.tensor(amax, dtype=torch.float32), Format.e4m3, ExponentRule.ceil)
    for a, e in zip(amax, ref.tolist()):
        k = ns["ds_key"](_float(_bits(a)))
        assert 0 <= k <= 256
        assert ns["ds_exponent"](_float(_bits(a))) == e, a  # the kernel's previous exponent
        assert ns["pow2i_neg_ds_key"](k) == ns["pow2i"](-e), a
        assert ns["pow2i_ds_key"](k) == ns["pow2i"](e), a
    # the max of keys is the key of the max (keys are monotone in the amax), NaN above everything
    keys = [ns["ds_key"](_float(_bits(a))) for a in sorted(amax)]
    assert keys == sorted(keys)
    assert ns["ds_key"](_float(0x7FFFFFFF)) == 256 > ns["ds_key"](float("inf")) == 255


def _ptx_counts(ptx: str) -> dict:
    return {"shfl": ptx.count("shfl.sync"), "atom_max": ptx.count("atom.shared.max"),
            "cvt_rzi": ptx.count("cvt.rzi.s32.f32"), "ex2": ptx.count("ex2.approx.ftz.f32")}


@pytest.mark.compile
@pytest.mark.parametrize("det", [False, True])
def test_compile_trim_variant(fp8_variant, compile_sm90, tmp_path, det):
    """The trim cross-compiles for sm_90a (both tile copies, deterministic too): per tile copy 8 / 2 =
    4 shared atomics (one per batch and lane) instead of 16 behind a branch, fewer shuffles, and no
    float → int conversion of dO's exponent; the softmax (ex2) is untouched."""
    plan = make_plan(load_specs(), arch="sm90")
    v = fp8_variant if not det else next(
        x for x in plan.variants if x.kind.value == "attn_bwd" and x.route == fp8_variant.route and x.param("head_dim") == 128
        and x.param("causal") and dict(x.params).get("deterministic"))
    off = _ptx_counts(compile_sm90(v, source=_render_fp8_dq(v, bwd_alu_trim=False)))
    for p in (tmp_path / "dump").glob("*.ptx"):
        p.unlink()
    on = _ptx_counts(compile_sm90(v, source=_render_fp8_dq(v, bwd_alu_trim=True)))
    assert on["ex2"] == off["ex2"] == 64
    assert off["atom_max"] == 32 and on["atom_max"] == 8, (off, on)
    assert on["shfl"] <= off["shfl"] - 60, (off, on)
    assert off["cvt_rzi"] > 0 and on["cvt_rzi"] < off["cvt_rzi"], (off, on)


# ----------------------------------------------------------------------------- bench.bwd_experiments
def test_bwd_experiments_bf16_split_tags_at_d64():
    """At D = 64 the bf16 tiles without the split default (the deterministic ones, round 44) take the split tags, each
    with its flags; the non-deterministic ones take nosplit, which renders neither flag."""
    from flamia_gen.bench import bwd_experiments as bx
    from flamia_gen.bench.fwd_experiments import experiment_variants

    bwd, _ = bx.base_variants(routes=("bf16",), head_dim=64)
    tags = ("dqfirst", "dqfsl", "split", "splitdqf", "splitsl", "nosplit")
    tagged = experiment_variants(tags, base_variants=bwd, experiments=bx.EXPERIMENTS)
    want = {"dqfirst": {"bwd_dq_first"}, "dqfsl": {"bwd_dq_first", "bwd_dq_scale_late"}, "split": {"bwd_sdp_split"},
            "splitdqf": {"bwd_sdp_split", "bwd_dq_first"}, "splitsl": {"bwd_sdp_split", "bwd_dq_scale_late"},
            "nosplit": set()}
    seen = {}
    for tag, v in tagged:
        if not tag:
            continue
        seen[tag] = seen.get(tag, 0) + 1
        p = rendered_params(render_variant(v))
        flags = {f for f in ("bwd_sdp_split", "bwd_dq_first", "bwd_dq_scale_late") if p.get(f) is True}
        assert flags == want[tag], (tag, v.name)
        assert bool(dict(v.params).get("deterministic")) is (tag != "nosplit"), (tag, v.name)
    assert seen == {t: 2 for t in tags}  # causal or not


def test_bwd_experiments_variants_names_and_support():
    """One bundle: every default backward of the routes at D = 128, the trim copies of the fp8 ones
    (render-context overrides in their params), and one forward per (route, causality) plus the
    quantizers their op path needs. Names are unique and split back into (base, tag)."""
    from flamia_gen.bench import bwd_experiments as bx
    from flamia_gen.bench.fwd_experiments import experiment_variants

    bwd, support = bx.base_variants()
    assert {v.route for v in bwd} == {"fp8_token", "bf16"} and len(bwd) == 8
    tagged = experiment_variants(bx.DEFAULT_EXPERIMENTS, base_variants=bwd, experiments=bx.EXPERIMENTS)
    names = [v.name for _, v in tagged]
    # 4 fp8 backward variants × 4 trims, 4 non-deterministic variants × (nodqwarp, dqw1, pers, onecta, hs0, hs1, dhs1),
    # 4 deterministic × dyndet, 4 fp8 × (noqperm, nodq16, norowswz, nokt, dqfirst, nodoffold), 2 × s3 (the
    # deterministic ones: a third Q stage no longer fits beside dQ on BF16's K̂ tile and the dQ staging tile), 2 × r12
    # (dqw2 copies none of them: since round 32 bf16's and fp8_token's D = 128 tiles have two writers, as every D = 64
    # tile; norowpad and rowswz only fp8_pv's tile, dq16sq only mxfp8's)
    # round 32's dS by stmatrix: stsm on bf16's 2 deterministic tiles (its other 2 take it by default since round 39:
    # nostsm there); fp8_token's 4 take it and dK after dQ by default since round 35, so nostsm on those 4, no
    # stsmdqf (and nodqfirst on the 4, dqfirst on none: the 4 of the 4 × 6)
    # (and dqtile on the 4 with a writer warp); the unit boundary's kvearly on fp8_token's 4, qahead on all 8; round
    # 37's rwe (per-query words while Sᵀ and dPᵀ run) on fp8_token's 4 — since round 38 the default of its 2
    # non-deterministic tiles, where norwe (and kt, for nokt) undo it: still 4 of each pair; round 40's dqsl (dQ's row
    # factor left to the conversion) on bf16's 4, and since round 41 on fp8_token's 4 (its bwd_dof_fold tiles); round
    # 41's dqfirst (FA4's order; fp8_token's have it by default), dqfsl (both), split and splitdqf (the Sᵀ wait split
    # from dPᵀ's) and splitsl (split + dqsl) build on bf16's tiles without the split default — since round 44 only the
    # D = 64 deterministic ones, none of them at D = 128 here — and nosplit undoes the default on bf16's 4 (round 43: the
    # 2 non-deterministic, round 44: the 2 deterministic); since round 42 split and splitsl on fp8_token's 2
    # non-deterministic tiles (those with bwd_rw_early): 2 each of split and splitsl (fp8_token), 4 nosplit; the
    # forty-fourth session's splitint on bf16's 4 split tiles and fp8_token's 2; the call's own dQ conversion: dqc and
    # dqcsl on the 4 non-deterministic of those. Round 45 made split + dqsl + the conversion fp8_token's 2
    # non-deterministic tiles' default: no split, splitsl (none of bf16's at D = 128), splitslint, splitslc,
    # splitslintc; dqsl, dqc, dqcsl leave those 2 (dqsl on 6, dqc and dqcsl on bf16's 2); nosplitslc and splitnosl
    # undo it there (2 each); round 46's sahead and saheadlate (the next tile's Sᵀ under the dQ epilogue) on those 2;
    # round 47's ablations nodqred on those 2 and bf16's 2 non-deterministic D = 128 tiles, nodkq on fp8_token's 2;
    # the forty-eighth session's dk16 (bwd_dk_bf16) on fp8_token's 2
    split_family = ("split", "splitsl", "dqsl", "splitint", "nosplit", "dqc", "dqcsl", "nosplitslc", "splitnosl")
    assert {t: sum(1 for x, _ in tagged if x == t) for t in split_family} == dict(
        split=0, splitsl=0, dqsl=6, splitint=6, nosplit=4, dqc=2, dqcsl=2, nosplitslc=2, splitnosl=2)
    assert len(names) == len(set(names)) == (8 + 4 * 4 + 4 * 7 + 4 + 4 * 6 + 2 + 2 + 4 + 4 + 4 + 4 + 8 + 4
                                             + 6 + 6 + 4 + 2 + 2 + 2 + 2 + 2 + 2 + 4 + 2 + 2)
    assert not {t for t, _ in tagged} & {"dqfirst", "dqfsl", "splitdqf"}
    for tag, v in tagged:
        assert bx.split_name(v.name, bx.EXPERIMENTS) == ((v.name[:-len(tag) - 2], tag) if tag else (v.name, ""))
        if tag == "dqw1":
            assert "deterministic" not in dict(v.params) and '"bwd_dq_writers"' not in _render_fp8_dq(v)
            b = next(x for x in bwd if x.name == bx.split_name(v.name, bx.EXPERIMENTS)[0])
            assert '"bwd_dq_writers": 2' in render_variant(b)
        elif tag in ("dhs1", "dyndet"):
            src = _render_fp8_dq(v)
            assert bool(dict(v.params).get("deterministic")) is (tag == "dyndet")
            assert "class DynamicScheduler:" in src and '"bwd_dynamic": True' in src
            assert ('"bwd_head_section": 1' in src) is (tag == "dhs1")
        elif tag in ("pers", "onecta", "hs0", "hs1"):
            src = _render_fp8_dq(v)
            assert "deterministic" not in dict(v.params) and "class DynamicScheduler:" not in src
            assert ("class LongestFirstScheduler:" in src) is (tag == "pers")
            assert ('"bwd_head_section": 1' in src) is (tag == "hs1")
            assert ('"bwd_head_section": 2' in src) is (tag == "onecta")
        elif tag == "s3":
            assert v.route == "fp8_token" and dict(v.params)["stages"] == 3 and "STAGES = 3" in _render_fp8_dq(v)
        elif tag in ("nodqwarp", "noqperm", "r12"):
            src = _render_fp8_dq(v)
            assert ('"bwd_dq_warp": True' in src) is (tag == "noqperm" and "deterministic" not in dict(v.params))
            assert ('"bwd_q_row_perm": True' in src) is (tag == "nodqwarp" and v.route == "fp8_token")
        elif tag == "norowswz":  # the kernel before round 30: padded per-query words
            src = render_variant(v)
            assert v.route == "fp8_token" and "PAIR_WORDS = 20" in src and '"bwd_row_swz"' not in src
        elif tag in ("nokt", "kt"):  # since round 38 the non-deterministic tile's default: kt undoes it there
            src = _render_fp8_dq(v, bwd_dq_bf16=True)
            assert v.route == "fp8_token" and ('"bwd_no_kt": True' in src) is (tag == "nokt")
            assert bool(dict(v.params).get("deterministic")) is (tag == "nokt")
        elif tag in ("dqc", "dqcsl"):  # tests/kernels/test_attn_bwd_dq_convert.py
            p = rendered_params(render_variant(v))
            assert p.get("bwd_dq_convert") is True and (p.get("bwd_dq_scale_late") is True) is (tag == "dqcsl")
            assert "deterministic" not in dict(v.params) and v.route == "bf16"
        elif tag in ("nosplitslc", "splitnosl"):  # round 45's fp8_token default undone (test_attn_bwd_sdp_split.py)
            p = rendered_params(render_variant(v))
            assert v.route == "fp8_token" and p.get("bwd_rw_early") is True and "deterministic" not in dict(v.params)
            assert (p.get("bwd_sdp_split") is True) is (tag == "splitnosl")
            assert "bwd_dq_scale_late" not in p and "bwd_dq_convert" not in p
        elif tag in ("sahead", "saheadlate"):  # tests/kernels/test_attn_bwd_s_ahead.py
            p = rendered_params(render_variant(v))
            assert v.route == "fp8_token" and p.get("bwd_s_ahead") is True and p.get("bwd_sdp_split") is True
            assert "deterministic" not in dict(v.params)
        elif tag == "nodqred":  # tests/kernels/test_attn_bwd_ablations.py
            p = rendered_params(render_variant(v))
            assert p.get("bwd_ablate_dq_reduce") is True and dict(v.params)["head_dim"] == 128
            assert v.route in ("fp8_token", "bf16") and "deterministic" not in dict(v.params)
        elif tag == "nodkq":  # tests/kernels/test_attn_bwd_ablations.py
            p = rendered_params(render_variant(v))
            assert p.get("bwd_ablate_dk_quant") is True and dict(v.params)["head_dim"] == 128
            assert v.route == "fp8_token" and "deterministic" not in dict(v.params)
        elif tag == "dk16":  # tests/kernels/test_attn_bwd_dk_bf16.py
            p = rendered_params(render_variant(v))
            assert p.get("bwd_dk_bf16") is True and dict(v.params)["head_dim"] == 128
            assert v.route == "fp8_token" and "deterministic" not in dict(v.params)
        elif tag == "splitint":  # tests/kernels/test_attn_bwd_sdp_split.py
            p = rendered_params(render_variant(v))
            assert p.get("bwd_sdp_split") is True and p.get("bwd_sdp_split_interior") is True
            # fp8_token's with its default late scale and conversion (round 45)
            assert (p.get("bwd_dq_scale_late") is True) is (p.get("bwd_dq_convert") is True) is (v.route == "fp8_token")
            assert v.route == "bf16" or p.get("bwd_rw_early") is True
        elif tag == "nosplit":  # rounds 43–44's bf16 default undone: the fused pass, dK issued before dQ
            p = rendered_params(render_variant(v))
            assert v.route == "bf16"
            assert "bwd_sdp_split" not in p and "bwd_dq_first" not in p
            b = next(x for x in bwd if x.name == bx.split_name(v.name, bx.EXPERIMENTS)[0])
            pb = rendered_params(render_variant(b))
            assert pb.get("bwd_sdp_split") is True and pb.get("bwd_dq_first") is True
        elif tag == "nodoffold":
            src = render_variant(v)
            assert v.route == "fp8_token" and '"bwd_dof_fold"' not in src and '"bwd_row_swz": True' in src
        elif tag == "nodq16":
            assert v.route == "fp8_token" and dict(v.params)["bwd_dq_bf16"] is False
            assert '"bwd_dq_bf16"' not in _render_fp8_dq(v)
        elif tag == "dqtile":
            assert "deterministic" not in dict(v.params) and '"bwd_dq_tile_copy": True' in render_variant(v)
        elif tag in ("stsm", "stsmdqf", "nostsm", "nodqfirst"):
            p = rendered_params(render_variant(v))
            assert (p.get("bwd_ds_stsm") is True) is (tag != "nostsm")
            if v.route == "bf16":  # stmatrix on its non-deterministic tiles since round 39 (nostsm), off on the _det
                assert (tag == "nostsm") is not bool(dict(v.params).get("deterministic"))
                # (FA4's order with the split: the non-deterministic tiles' default since round 43, the _det's since 44)
                assert tag in ("stsm", "nostsm") and p.get("bwd_dq_first") is True and p.get("bwd_sdp_split") is True
            else:  # fp8_token's D = 128 tiles, deterministic or not: both flags on by default since round 35
                assert (p.get("bwd_dq_first") is True) is (tag in ("stsmdqf", "nostsm"))
                assert v.route == "fp8_token" and tag in ("nostsm", "nodqfirst")
        elif tag in ("rwe", "norwe"):  # tests/kernels/test_attn_bwd_rw_early.py (norwe: the default's undo, round 38)
            assert v.route == "fp8_token"
            assert (rendered_params(render_variant(v)).get("bwd_rw_early") is True) is (tag == "rwe")
            assert bool(dict(v.params).get("deterministic")) is (tag == "rwe")
        elif tag in ("kvearly", "qahead"):  # the unit boundary (tests/kernels/test_attn_bwd_unit_boundary.py)
            p = rendered_params(render_variant(v))
            assert p.get("bwd_kv_early" if tag == "kvearly" else "bwd_q_ahead") is True
            assert v.route == "fp8_token" or tag == "qahead"
        elif tag == "dqsl":  # dQ's scale left to the conversion (tests/kernels/test_attn_bwd_dq_scale_late.py)
            p = rendered_params(render_variant(v))
            assert p.get("bwd_dq_scale_late") is True
            assert v.route == "bf16" or (v.route == "fp8_token" and p.get("bwd_dof_fold") is True)
            assert v.route == "bf16" or dict(v.params).get("deterministic")  # fp8_token's other 2 have it (round 45)
        elif tag:
            assert v.route == "fp8_token" and dict(v.params)["bwd_alu_trim"] is (tag != "notrim")
            src = _render_fp8_dq(v)
            if tag == "notrim":
                assert "bwd_alu_trim" not in src
            else:
                assert f"DQ_AMAX_CG = {dict(v.params)['bwd_dq_amax_cg']}" in src
    fwd = {v.route for v in support if v.kind.value == "attn_fwd"}
    uses = {u for v in support if v.kind.value == "quant" for u in v.uses}
    assert fwd == {"fp8_token", "bf16"} and {"fp8_token.q", "fp8_token.k", "fp8_token.v", "fp8_token.do", "bf16.do"} <= uses
    assert len([v for v in support if v.kind.value == "attn_fwd"]) == 4  # one per route and causality


def test_bwd_experiments_table_reports_ratios_and_bitwise():
    from flamia_gen.bench import bwd_experiments as bx

    wl = ((4096,) * 4,)
    rows = [dict(variant="attn_bwd_sm90_fp8_token_x", tag="default", ok=True, cos_emu=0.9999979, cos_fp32=0.9978,
                 **{"4x4096": 3.0}),
            dict(variant="attn_bwd_sm90_fp8_token_x", tag="trim1", ok=True, cos_emu=0.9999979, cos_fp32=0.9978,
                 dq_bitwise=False,
                 dk_bitwise=True, dv_bitwise=True, dq_max_abs_diff=1e-7, **{"4x4096": 2.7})]
    t = bx.table(rows, wl)
    assert "2.700 (0.900×)" in t and "≠/=/=" in t
    assert "bitwise dq/dk/dv ≠/=/=" in bx._fmt_row(rows[1], wl)


def test_bwd_experiments_candidate_routes():
    """A candidate route (no family lists it yet) gets its backward, forward and quantizer variants (the
    quantizers keyed by representation, so only their `uses` grow); the loaded specs are not changed."""
    from flamia_gen.bench import bwd_experiments as bx

    specs = load_specs()
    before = {n: list(f.routes) for n, f in specs.families.items()}
    cand = bx.with_candidates(specs, ["fp8_token_bf16qk"])
    assert {n: list(f.routes) for n, f in specs.families.items()} == before
    assert all("fp8_token_bf16qk" in f.routes for f in cand.families.values()
               if f.arch.value == "sm90" and f.kind.value in ("quant", "attn_fwd", "attn_bwd"))
    bwd, support = bx.base_variants(candidates=["fp8_token_bf16qk"])
    assert len([v for v in bwd if v.route == "fp8_token_bf16qk"]) == 4
    assert len([v for v in support if v.kind.value == "attn_fwd" and v.route == "fp8_token_bf16qk"]) == 2
    uses = {u for v in support if v.kind.value == "quant" for u in v.uses}
    assert {f"fp8_token_bf16qk.{o}" for o in ("q", "k", "v", "do")} <= uses
    plain_bwd, plain_support = bx.base_variants()
    assert {v.name for v in plain_bwd} < {v.name for v in bwd}


def test_bwd_experiments_trim_the_tiles_with_a_ds_amax():
    """The trim A/B copies go to the routes whose tile has the dS amax (fp8_token, fp8_token_bf16qk), not to
    fp8_pv (BF16 dS) or bf16."""
    from flamia_gen.bench import bwd_experiments as bx
    from flamia_gen.bench.fwd_experiments import experiment_variants

    bwd, _ = bx.base_variants(candidates=["fp8_token_bf16qk", "fp8_pv"])
    tagged = experiment_variants(bx.DEFAULT_EXPERIMENTS, base_variants=bwd, experiments=bx.EXPERIMENTS)
    trim_tags = {"notrim", "trim0", "trim1", "trim4"}
    trims = [v for t, v in tagged if t in trim_tags]
    assert {v.route for v in trims} == {"fp8_token", "fp8_token_bf16qk"}
    assert len([v for t, v in tagged if not t]) == 8 + 4 + 4
    assert len(trims) == 2 * 4 * len(trim_tags)
    # nodqwarp: every non-deterministic variant (the dQ bulk path), whatever the route
    assert {v.route for t, v in tagged if t == "nodqwarp"} == {"fp8_token", "bf16", "fp8_token_bf16qk", "fp8_pv"}
    # noqperm, r12: fp8_token's tile only
    assert {v.route for t, v in tagged if t in ("noqperm", "r12")} == {"fp8_token"}
    assert len([v for t, v in tagged if t == "nodqwarp"]) == 4 * 2


def test_experiment_copies_past_the_shared_memory_limit_are_left_out(capsys):
    """An experiment copy goes through the planner's feasibility check: bf16 D = 128 with 4 Q/dO stages needs more
    shared memory than an SM gives one CTA (a two-stage dQ staging copy once failed only at launch, 2026-12-03)."""
    from flamia_gen.bench.fwd_experiments import experiment_variants

    base = [v for v in make_plan(load_specs(), arch="sm90", routes=["bf16"]).variants
            if v.kind.value == "attn_bwd" and v.param("head_dim") == 128]
    ex = {"big": dict(over={"stages": 4}, when=lambda p: True, note=""),
          "ok": dict(over={"bwd_dq_warp": False}, when=lambda p: True, note="")}
    out = experiment_variants(["big", "ok"], base_variants=base, experiments=ex)
    assert base and [t for t, _ in out].count("big") == 0 and [t for t, _ in out].count("ok") == len(base)
    assert "shared memory" in capsys.readouterr().err


def test_experiment_runs_share_one_loop(monkeypatch, tmp_path, capsys):
    """run_entries (both experiment modules): a failing entry becomes an `error` row and the run goes on
    while the CUDA context lives; a lost context stops it; the JSON holds every row."""
    import json

    from flamia_gen.bench import bwd_experiments as bx
    from flamia_gen.bench import fwd_experiments as fx

    lost = {"attn_bwd_sm90_c": True}
    monkeypatch.setattr(fx, "cuda_context_lost", lambda e, tag: lost.get(e["name"], False))
    entries = [{"name": n, "params": {"causal": True}} for n in
               ("attn_bwd_sm90_a", "attn_bwd_sm90_a_xtrim1", "attn_bwd_sm90_b", "attn_bwd_sm90_c", "attn_bwd_sm90_d")]

    def measure(e, base, tag, row):
        if e["name"].endswith(("_b", "_c")):
            raise RuntimeError("boom")
        row.update(ok=True, cos_emu=1.0, cos_fp32=1.0, **{"4x4096": 2.0 if tag else 4.0})

    rows = fx.run_entries(entries, measure, bx._fmt_row, bx.table, ((4096,) * 4,), tmp_path / "r.json", bx.EXPERIMENTS)
    assert [r["variant"] for r in rows] == ["attn_bwd_sm90_a", "attn_bwd_sm90_a", "attn_bwd_sm90_b", "attn_bwd_sm90_c"]
    assert rows[1]["tag"] == "trim1" and "error" in rows[2] and "error" in rows[3]  # d never ran
    assert json.loads((tmp_path / "r.json").read_text()) == rows
    assert "2.000 (0.500×)" in capsys.readouterr().out


def test_experiment_run_abandons_a_hung_entry(tmp_path):
    """run_entries' watchdog: an entry past its timeout (a kernel that never completes) gets an error row,
    the rows so far go to the JSON, and the process exits with HUNG_EXIT_CODE at once instead of hanging."""
    import json
    import subprocess
    import sys
    import time
    from pathlib import Path

    from flamia_gen.bench.fwd_experiments import HUNG_EXIT_CODE

    out = tmp_path / "r.json"
    code = f"""
import time
from flamia_gen.bench import bwd_experiments as bx
from flamia_gen.bench import fwd_experiments as fx
entries = [{{"name": n, "params": {{"causal": True}}}} for n in ("attn_bwd_sm90_a", "attn_bwd_sm90_b", "attn_bwd_sm90_c")]
def measure(e, base, tag, row):
    if e["name"].endswith("_b"):
        time.sleep(60)  # the hung kernel
    row.update(ok=True, cos_emu=1.0, cos_fp32=1.0, **{{"4x4096": 2.0}})
fx.run_entries(entries, measure, bx._fmt_row, bx.table, ((4096,) * 4,), {str(out)!r}, bx.EXPERIMENTS, entry_timeout=1.0)
print("not reached")
"""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                       cwd=Path(__file__).resolve().parents[2])
    assert time.perf_counter() - t0 < 30
    assert r.returncode == HUNG_EXIT_CODE, r.stderr[-2000:]
    assert "not reached" not in r.stdout and "timeout: still running after 1 s" in r.stdout
    rows = json.loads(out.read_text())
    assert [x["variant"] for x in rows] == ["attn_bwd_sm90_a", "attn_bwd_sm90_b"]  # c never ran
    assert "error" not in rows[0] and rows[1]["error"].startswith("timeout")


def test_experiment_run_cancels_the_watchdog_of_finished_entries(tmp_path):
    from flamia_gen.bench import bwd_experiments as bx
    from flamia_gen.bench import fwd_experiments as fx

    entries = [{"name": "attn_bwd_sm90_a", "params": {"causal": True}}]
    rows = fx.run_entries(entries, lambda e, b, t, row: row.update(ok=True, cos_emu=1.0, cos_fp32=1.0), bx._fmt_row,
                          bx.table, ((4096,) * 4,), None, bx.EXPERIMENTS, entry_timeout=0.2)
    import time

    time.sleep(0.5)  # a watchdog left running would end this process here
    assert rows[0]["variant"] == "attn_bwd_sm90_a" and "error" not in rows[0]


def test_experiment_run_writes_every_row_and_resumes(tmp_path, monkeypatch):
    """The JSON is rewritten after every row (a call cut off by its time limit keeps its rows), and `resume` keeps
    an earlier run's error-free rows, skips their entries and reruns the failed ones."""
    import json

    import pytest

    from flamia_gen.bench import bwd_experiments as bx
    from flamia_gen.bench import fwd_experiments as fx

    monkeypatch.setattr(fx, "cuda_context_lost", lambda e, tag: False)
    out = tmp_path / "r.json"
    names = ("attn_bwd_sm90_a", "attn_bwd_sm90_a_xtrim1", "attn_bwd_sm90_b", "attn_bwd_sm90_c")
    entries = [{"name": n, "params": {"causal": True}} for n in names]
    seen, measured = [], []

    def first(e, base, tag, row):
        seen.append(len(json.loads(out.read_text())) if out.exists() else 0)  # rows on disk before this entry
        if e["name"].endswith("_b"):
            raise RuntimeError("boom")
        if e["name"].endswith("_c"):
            raise KeyboardInterrupt  # the time limit's kill, mid-run
        row.update(ok=True, cos_emu=1.0, cos_fp32=1.0, **{"4x4096": 1.0})

    with pytest.raises(KeyboardInterrupt):
        fx.run_entries(entries, first, bx._fmt_row, bx.table, ((4096,) * 4,), out, bx.EXPERIMENTS)
    assert seen == [0, 1, 2, 3]
    kept = json.loads(out.read_text())
    assert [(r["variant"], r["tag"]) for r in kept] == [("attn_bwd_sm90_a", "default"), ("attn_bwd_sm90_a", "trim1"),
                                                       ("attn_bwd_sm90_b", "default")]
    assert "error" in kept[2] and all(r["run"] for r in kept)

    def second(e, base, tag, row):
        measured.append(e["name"])
        row.update(ok=True, cos_emu=1.0, cos_fp32=1.0, **{"4x4096": 3.0})

    rows = fx.run_entries(entries, second, bx._fmt_row, bx.table, ((4096,) * 4,), out, bx.EXPERIMENTS, resume=True)
    assert measured == ["attn_bwd_sm90_b", "attn_bwd_sm90_c"]  # a and its A/B copy kept, b's error row rerun
    assert [(r["variant"], r["tag"], r["4x4096"]) for r in rows] == [
        ("attn_bwd_sm90_a", "default", 1.0), ("attn_bwd_sm90_a", "trim1", 1.0), ("attn_bwd_sm90_b", "default", 3.0),
        ("attn_bwd_sm90_c", "default", 3.0)]
    assert json.loads(out.read_text()) == rows
    out.write_text("{not json")
    with pytest.raises(SystemExit, match="not JSON"):
        fx.run_entries(entries, second, bx._fmt_row, bx.table, ((4096,) * 4,), out, bx.EXPERIMENTS, resume=True)
    with pytest.raises(SystemExit, match="needs --json"):
        fx.run_entries(entries, second, bx._fmt_row, bx.table, ((4096,) * 4,), None, bx.EXPERIMENTS, resume=True)
