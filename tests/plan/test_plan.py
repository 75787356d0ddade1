from pathlib import Path

import pytest

from flamia_gen.plan import check_quant, make_plan, procedural_name
from flamia_gen.spec import Arch, KernelKind, OperandQuant, SpecError, load_specs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def specs():
    return load_specs(REPO / "specs")


def test_procedural_name_spells_everything():
    p = dict(head_dim=128, tokens_per_cta=32, heads_per_cta=1)
    assert procedural_name(KernelKind.quant, Arch.sm90, "e4m3_tb32_ceil", p) == "quant_sm90_e4m3_tb32_ceil_d128_t32_h1"
    a = dict(head_dim=128, tile_m=128, tile_n=176, stages=2, compute_warpgroups=2, p_in_registers=True,
             intra_wg_overlap=False, scheduler="longest_first")
    assert (procedural_name(KernelKind.attn_fwd, Arch.sm90, "fp8_token", a)
            == "attn_fwd_sm90_fp8_token_d128_m128n176_s2_wg2_preg_longest_first")
    with pytest.raises(ValueError, match="not an identifier"):
        procedural_name(KernelKind.quant, Arch.sm90, "bad-name", p)


def test_plan_dedupes_by_representation_and_is_unique(specs):
    plan = make_plan(specs, arch="sm90")
    names = [v.name for v in plan.variants]
    assert len(names) == len(set(names)) and names == sorted(names)
    tb = plan.by_name("quant_sm90_e4m3_tb32_ceil_d128_t32_h1")
    # the q/k/v/dO of mxfp8 and mxfp8_exact share one kernel
    assert {"mxfp8.q", "mxfp8.v", "mxfp8_exact.k", "mxfp8_exact.do"} <= set(tb.uses)
    assert all(v.arch is Arch.sm90 for v in plan.variants)
    # bf16 has nothing to quantize: its only quantizer-family variants are the dO launches (D, dQ zeroing)
    bf16 = [v for v in plan.variants if any(u.startswith("bf16.") for u in v.uses)]
    assert bf16 and all(v.kind is KernelKind.quant and v.uses == ("bf16.do",) and v.param("with_delta")
                        and v.param("fmt") == "bf16" for v in bf16)
    # every quantized input operand of every route in the family is served at D=128
    fam = specs.families["quant_sm90"]
    served = {u for v in plan.variants if v.param("head_dim") == 128 for u in v.uses}
    for r in fam.routes:
        for op, oq in specs.routes[r].operands.items():
            if op.is_input and oq.quantized:
                assert f"{r}.{op.value}" in served


def test_plan_route_filter_and_unknown_route(specs):
    plan = make_plan(specs, arch="sm100", routes=["fp8_token"])
    assert plan.variants and all(any(u.startswith("fp8_token.") for u in v.uses) for v in plan.variants)
    with pytest.raises(SpecError, match="unknown route 'nope'"):
        make_plan(specs, routes=["nope"])


def test_pruning_keeps_reasons(specs):
    plan = make_plan(specs)
    assert plan.pruned, "the shipped families prune at least the tensor-granularity tile sizes"
    for p in plan.pruned:
        assert p.reason and p.name not in {v.name for v in plan.variants}


def _oq(**kw):
    base = dict(format="e4m3", granularity="token_block", exponent_rule="ceil")
    base.update(kw)
    return OperandQuant(**base)


def _params(**kw):
    base = dict(head_dim=128, tokens_per_cta=32, heads_per_cta=1, write_transposed=True)
    base.update(kw)
    return base


def test_feasibility_rules():
    assert check_quant(Arch.sm90, _oq(), _params()) == (True, "")
    ok, why = check_quant(Arch.sm90, _oq(), _params(tokens_per_cta=128, heads_per_cta=4))
    assert not ok and "rows" in why
    ok, why = check_quant(Arch.sm90, _oq(granularity="tensor"), _params(tokens_per_cta=64))
    assert not ok and "tensor" in why
    ok, why = check_quant(Arch.sm90, _oq(granularity="token", hadamard=True), _params(head_dim=96))
    assert not ok and "power of two" in why  # 96 is a multiple of 32, not a power of two
    ok, why = check_quant(Arch.sm90, _oq(granularity="token"), _params(head_dim=80))
    assert not ok and "multiple of 32" in why


def test_attention_family_expansion_and_pruning(tmp_path):
    import shutil

    import yaml

    shutil.copytree(REPO / "specs", tmp_path / "specs")
    fam = dict(name="attn_fwd_sm90", arch="sm90", kind="attn_fwd", template="sm90/attn_fwd.py.j2",
               routes=["bf16", "fp8_token"], head_dims=[128],
               tunables=dict(tile_m=[128, 192], tile_n=[128, 176], compute_warpgroups=[2],
                             intra_wg_overlap=[True], causal=[True]))
    (tmp_path / "specs/kernels/attn_fwd_sm90.yaml").write_text(yaml.safe_dump(fam))
    plan = make_plan(load_specs(tmp_path / "specs"), kinds=[KernelKind.attn_fwd])
    names = {v.name for v in plan.variants}
    assert "attn_fwd_sm90_fp8_token_d128_m128n128_s2_wg2_preg_ovl_longest_first" in names
    reasons = {p.name: p.reason for p in plan.pruned}
    assert "64 × compute_warpgroups" in reasons["attn_fwd_sm90_bf16_d128_m192n128_s2_wg2_preg_ovl_longest_first"]
    assert "k-steps of 32" in reasons["attn_fwd_sm90_fp8_token_d128_m128n176_s2_wg2_preg_ovl_longest_first"]
    assert "registers" in reasons["attn_fwd_sm90_bf16_d128_m128n176_s2_wg2_preg_ovl_longest_first"]
    v = plan.by_name("attn_fwd_sm90_fp8_token_d128_m128n128_s2_wg2_preg_ovl_longest_first")
    ctx = v.context
    assert ctx["q_fmt"] == "e4m3" and ctx["v_gran"] == "token" and ctx["p_static_exponent"] == 8
    assert ctx["causal"] is True and ctx["route"] == "fp8_token"


# ----------------------------------------------------------------------------- dO launch (with_delta)
def test_procedural_name_delta_part():
    p = dict(head_dim=128, tokens_per_cta=32, heads_per_cta=1)
    assert (procedural_name(KernelKind.quant, Arch.sm90, "e4m3_tok_ceil", dict(p, with_delta=True))
            == "quant_sm90_e4m3_tok_ceil_delta_d128_t32_h1")
    assert (procedural_name(KernelKind.quant, Arch.sm90, "e4m3_tok_ceil", dict(p, with_delta=False))
            == "quant_sm90_e4m3_tok_ceil_d128_t32_h1")


@pytest.mark.parametrize("arch, n_delta", [("sm90", 20), ("sm100", 14)])
def test_plan_delta_variants_serve_do_only(specs, arch, n_delta):
    plan = make_plan(specs, arch=arch)
    quant = [v for v in plan.variants if v.kind is KernelKind.quant]
    by_name = {v.name: v for v in quant}
    bf16 = [v for v in quant if v.param("fmt") == "bf16"]  # the bf16 route's dO launch: no plain twin
    assert len(bf16) == (6 if arch == "sm90" else 0)
    assert all(v.param("with_delta") and v.route == "bf16_delta" and v.uses == ("bf16.do",) for v in bf16)
    quant = [v for v in quant if v.param("fmt") != "bf16"]
    delta = [v for v in quant if v.param("with_delta")]
    assert len(delta) == n_delta
    assert all(isinstance(v.param("with_delta"), bool) for v in quant)  # every quant variant says it
    fam = specs.families[f"quant_{arch}"]
    want_do = {f"{r}.do" for r in fam.routes if specs.routes[r].operands.do.quantized}
    for v in delta:
        assert "_delta_d" in v.name and v.route == v.param("quant") + "_delta"
        assert v.uses and all(u.endswith(".do") for u in v.uses)
        assert v.param("fmt") in ("e4m3", "e5m2") and not v.param("hadamard") and v.param("write_transposed")
        # the plain twin exists (same point, same representation) and still lists the dO uses
        twin = by_name[v.name.replace("_delta_", "_")]
        assert dict(twin.params) == dict(v.params, with_delta=False)
        assert set(v.uses) <= set(twin.uses)
        assert v.spec_hash != twin.spec_hash
    for d in fam.head_dims:
        served = {u for v in delta if v.param("head_dim") == d for u in v.uses}
        assert served == want_do
    names = [v.name for v in quant if not v.param("with_delta")]
    assert not any("delta" in n for n in names)
    t = by_name[f"quant_{arch}_e4m3_tok_ceil_delta_d128_t32_h1"]
    # sm90 also serves the BF16-score routes' dO (their V and dO are fp8_token's)
    assert t.uses == (("fp8_pv.do", "fp8_token.do", "fp8_token_bf16qk.do", "fp8_token_hadamard.do") if arch == "sm90"
                      else ("fp8_token.do", "fp8_token_hadamard.do"))
    assert by_name[f"quant_{arch}_e5m2_tsr_ceil_delta_d64_t32_h1"].uses == ("fp8_tensor.do",)
    assert by_name[f"quant_{arch}_e4m3_tb32_ceil_delta_d128_t32_h1"].uses == (
        "mxfp8.do", "mxfp8_exact.do", "nvfp4_mixed.do")
    # representations only q/k use get no delta variant
    assert not any(v.param("quant") in ("e2m1_nvfp4", "e4m3_tok_ceil_had") for v in delta)


def test_delta_variants_are_their_own_tuning_groups(specs):
    from flamia_gen.dispatch.defaults import plan_groups

    groups = plan_groups(make_plan(specs, arch="sm90", kinds=[KernelKind.quant]), specs)
    g = groups["quant/e4m3_tok_ceil_delta/d128"]
    assert g.default == "quant_sm90_e4m3_tok_ceil_delta_d128_t32_h1"
    assert all("_delta_" in n for n in g.candidates)
    assert not any("_delta_" in n for n in groups["quant/e4m3_tok_ceil/d128"].candidates)


def test_delta_refused_for_hadamard_or_fp4_do():
    # the spec layer already forbids a Hadamard dO; the plan refuses both by itself too
    from flamia_gen.plan.variants import _delta_supported

    assert _delta_supported(_oq(granularity="token")) == (True, "")
    ok, why = _delta_supported(_oq(granularity="token", hadamard=True))
    assert not ok and "Hadamard" in why
    ok, why = _delta_supported(OperandQuant(format="e2m1", granularity="nvfp4", block=16))
    assert not ok and "E2M1" in why


def test_attn_fwd_smem_estimate_prunes_what_the_h200_refused():
    """H200, 2026-11-29: bf16 m192n128 s2 (3 consumer warpgroups) asked for 233472 B of shared
    memory (> 232448 B) and failed to launch; the estimate must prune it and keep fp8 m192."""
    from flamia_gen.plan.feasibility import attn_smem_bytes

    p = dict(head_dim=128, tile_m=192, tile_n=128, stages=2, p_in_registers=True)
    assert attn_smem_bytes(p, 2) == 233472
    plan = make_plan(load_specs(), arch="sm90", kinds=["attn_fwd"])
    pruned = {x.name: x.reason for x in plan.pruned}
    assert "shared memory 233472 B" in pruned["attn_fwd_sm90_bf16_d128_m192n128_s2_wg3_preg_longest_first"]
    names = {v.name for v in plan.variants}
    assert "attn_fwd_sm90_fp8_token_d128_m192n128_s2_wg3_preg_longest_first" in names


def test_deterministic_backward_needs_a_persistent_scheduler():
    from flamia_gen.plan.feasibility import check_attn_bwd

    p = dict(head_dim=128, tile_m=64, tile_n=128, stages=2, compute_warpgroups=2, p_in_registers=True,
             intra_wg_overlap=False, causal=True, deterministic=True)
    ok, why = check_attn_bwd(Arch.sm90, 1, dict(p, scheduler="static"))
    assert not ok and "persistent" in why
    assert check_attn_bwd(Arch.sm90, 1, dict(p, scheduler="longest_first"))[0]
    plan = make_plan(load_specs(), arch="sm90", kinds=["attn_bwd"])
    det = [v.name for v in plan.variants if "_det" in v.name]
    routes = load_specs().families["attn_bwd_sm90"].routes
    assert len(routes) >= 7  # bf16, fp8_tensor, fp8_token, fp8_token_bf16qk, fp8_pv, mxfp8, mxfp8_exact, …
    assert len(det) == 4 * len(routes) and all("longest_first" in n for n in det)  # routes × causal × D = 64, 128


def test_backward_smem_counts_the_dq_staging_tile():
    """Non-deterministic backward variants stage the fp32 dQ tile (tile_m × (D + 8) words) for the bulk
    reduce-add; the estimate counts it, which keeps BF16 at 2 stages (3 stages: 239232 B > the H200's
    232448 B) and lets FP8 have 3."""
    from flamia_gen.plan.feasibility import SMEM_LIMIT, attn_bwd_smem_bytes, check_attn_bwd

    p = dict(head_dim=128, tile_m=64, tile_n=128, stages=2, compute_warpgroups=2, p_in_registers=True,
             intra_wg_overlap=False, causal=True, scheduler="longest_first")
    det = attn_bwd_smem_bytes(dict(p, deterministic=True), 2)
    plain = attn_bwd_smem_bytes(p, 2)
    assert plain - det == 64 * (128 + 8) * 4 + 128
    assert attn_bwd_smem_bytes(p, 1) < plain <= SMEM_LIMIT[Arch.sm90]
    ok, why = check_attn_bwd(Arch.sm90, 2, dict(p, stages=3))
    assert not ok and "239232" in why
    assert check_attn_bwd(Arch.sm90, 1, dict(p, stages=3))[0]


def test_token_block_routes_pair_forward_and_backward_tiles_and_bundle_their_copies():
    """Causal forwards with diagonal safeguards keep tile_n 128 (the sm90 backward repeats their diagonal decisions on
    its 128-key tiles); non-causal ones keep every tile_n. A route-filtered plan (flamia-gen bundle --route) holds the
    per-token quantizers the route's kernels read (the forward's diagonal copies, the exact route's rows)."""
    from flamia_gen.plan.feasibility import BWD_KEY_TILE_SM90

    specs = load_specs()
    plan = make_plan(specs, arch="sm90", routes=["mxfp8_exact"])
    fwd = [v for v in plan.variants if v.kind.value == "attn_fwd"]
    assert fwd and all(v.param("tile_n") == BWD_KEY_TILE_SM90 for v in fwd if v.param("causal"))
    assert any(v.param("tile_n") != BWD_KEY_TILE_SM90 for v in fwd if not v.param("causal"))
    assert any("pairs with the sm90 backward" in p.reason for p in plan.pruned)
    quant = {v.name for v in plan.variants if v.kind.value == "quant"}
    assert any("_e4m3_tok_ceil_d128" in n for n in quant)  # K, V diagonal copies; Q rows
    assert any("_e4m3_tok_ceil_delta_d128" in n for n in quant)  # the per-token dO launch (D from the rows' dO)
    # a per-token route needs no other route's quantizers; its own plan is unchanged by the rule
    tok = {v.name for v in make_plan(specs, arch="sm90", routes=["fp8_token"]).variants if v.kind.value == "quant"}
    assert all("_tok_ceil" in n for n in tok)
    assert not ({v.name for v in make_plan(specs, arch="sm90", routes=["bf16"]).variants
                 if v.kind.value == "quant"} & tok)
