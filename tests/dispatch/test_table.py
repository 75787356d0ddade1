import json
import os
import shutil
from pathlib import Path

import pytest

from flamia_gen.dispatch import defaults as dd
from flamia_gen.dispatch import table as tb
from flamia_gen.dispatch.buckets import DocProfile
from flamia_gen.plan import make_plan
from flamia_gen.spec import load_specs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sm90():
    specs = load_specs()
    plan = make_plan(specs, arch="sm90")
    return specs, plan


def _entry(group, route, d, bucket, winner, ms, runner_up=None, kind="quant", causal=None):
    from flamia_gen.dispatch.buckets import bucket_label

    return f"{group}/{bucket_label(bucket)}", {
        "group": group, "kind": kind, "route": route, "head_dim": d, "causal": causal, "bucket": bucket,
        "winner": {"variant": winner, "median_ms": ms}, "runner_up": runner_up, "trials": 3, "pruned": {},
        "workload": "x", "heads": 16, "study": "s"}


@pytest.fixture
def tuned(sm90):
    """A small valid sm90 table for 'Test GPU' with two buckets of one quantizer group."""
    specs, plan = sm90
    g = "quant/e4m3_tb32_ceil/d128"
    entries = dict([
        _entry(g, "e4m3_tb32_ceil", 128, {"tokens": 4096}, "quant_sm90_e4m3_tb32_ceil_d128_t64_h1", 0.01),
        _entry(g, "e4m3_tb32_ceil", 128, {"tokens": 65536}, "quant_sm90_e4m3_tb32_ceil_d128_t128_h1", 0.05),
    ])
    meta = tb.make_metadata("sm90", gpu="Test GPU", spec_hashes=dd.spec_hashes(specs, plan, "sm90"), untuned=False,
                            dsl="4.8.1", torch="2.9", cuda_driver="12.8")
    return {"_metadata": meta, "entries": entries, "defaults": dd.default_variants(plan, specs)}


def _expect(sm90, gpu="Test GPU"):
    specs, plan = sm90
    return tb.installed_expectation("sm90", gpu, specs=specs, plan=plan)


# ---------------------------------------------------------------- defaults
def test_default_is_first_feasible_in_spec_order(sm90):
    specs, plan = sm90
    groups = dd.plan_groups(plan, specs)
    g = groups["quant/e4m3_tb32_ceil/d128"]
    assert g.candidates == ("quant_sm90_e4m3_tb32_ceil_d128_t32_h1", "quant_sm90_e4m3_tb32_ceil_d128_t64_h1",
                            "quant_sm90_e4m3_tb32_ceil_d128_t128_h1")
    assert g.default.endswith("_t32_h1")
    pruned = {p.name for p in plan.pruned}
    for grp in groups.values():
        assert not pruned & set(grp.candidates)  # a pruned point is never a candidate


def test_default_follows_the_yaml_order_and_skips_pruned(tmp_path):
    shutil.copytree(REPO / "specs", tmp_path / "specs")
    f = tmp_path / "specs" / "kernels" / "quant_sm90.yaml"
    f.write_text(f.read_text().replace("tokens_per_cta: [32, 64, 128]", "tokens_per_cta: [64, 128, 32]"))
    specs = load_specs(tmp_path / "specs")
    d = dd.default_variants(make_plan(specs, arch="sm90"), specs)
    assert d["quant/e4m3_tb32_ceil/d128"].endswith("_t64_h1")
    # tensor granularity keeps only t32 (t64 and t128 are pruned): the next feasible point wins
    assert d["quant/e4m3_tsr_ceil/d128"].endswith("_t32_h1")


def test_group_key_needs_causal_for_attention():
    assert dd.group_key("quant", "e4m3_tok_ceil", 64) == "quant/e4m3_tok_ceil/d64"
    assert dd.group_key("attn_fwd", "mxfp8", 128, False) == "attn_fwd/mxfp8/d128/noncausal"
    with pytest.raises(ValueError, match="causal"):
        dd.group_key("attn_fwd", "mxfp8", 128)


# ---------------------------------------------------------------- atomic writes
def test_write_then_load_roundtrip(tmp_path, tuned, sm90):
    p = tb.write_table(tmp_path / "sm90-test-gpu.json", tuned)
    t, why = tb.load_table(p, _expect(sm90))
    assert why is None and t["entries"] == json.loads(json.dumps(tuned["entries"]))
    assert [x.name for x in tmp_path.iterdir()] == ["sm90-test-gpu.json"]


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_crash_mid_write_keeps_the_old_table(tmp_path, tuned, monkeypatch, where):
    p = tb.write_table(tmp_path / "t.json", tuned)
    before = p.read_bytes()
    new = json.loads(json.dumps(tuned))
    new["entries"] = {}

    def crash(*a, **k):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(tb.os, where, crash)
    with pytest.raises(KeyboardInterrupt):
        tb.write_table(p, new)
    monkeypatch.undo()
    assert p.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir()] == ["t.json"]  # no temp file left behind


def test_invalid_table_is_not_written(tmp_path, tuned):
    bad = json.loads(json.dumps(tuned))
    key = next(iter(bad["entries"]))
    bad["entries"][key]["winner"]["median_ms"] = -1
    with pytest.raises(tb.TableError, match="positive median_ms"):
        tb.write_table(tmp_path / "t.json", bad)
    assert not (tmp_path / "t.json").exists()


# ---------------------------------------------------------------- refusal
def _write_raw(path, obj):
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_missing_table(tmp_path):
    t, why = tb.load_table(tmp_path / "none.json")
    assert t is None and "no such table" in why


def test_corrupt_json_is_refused(tmp_path, tuned):
    text = tb.dumps_table(tuned)
    p = _write_raw(tmp_path / "t.json", text[: len(text) // 2])  # truncated
    t, why = tb.load_table(p)
    assert t is None and "corrupt JSON" in why and str(p) in why


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t.pop("_metadata"), "no '_metadata' header"),
    (lambda t: t["_metadata"].update(format=99), "table format 99, this flamia-gen reads format 1"),
    (lambda t: t["_metadata"].pop("spec_hashes"), "lacks ['spec_hashes']"),
    (lambda t: t.update(entries=[]), "no 'entries' object"),
    (lambda t: next(iter(t["entries"].values())).update(bucket={"tokens": 3000}), "powers of two"),
    (lambda t: next(iter(t["entries"].values())).update(head_dim=64), "key does not match"),
    (lambda t: next(iter(t["entries"].values())).update(
        pruned={"quant_sm90_e4m3_tb32_ceil_d128_t64_h1": "bitwise mismatch"}), "failed verification"),
])
def test_malformed_tables_are_refused(tmp_path, tuned, mutate, msg):
    mutate(tuned)
    t, why = tb.load_table(_write_raw(tmp_path / "t.json", tuned))
    assert t is None and msg in why and "not a valid dispatch table" in why


def test_gpu_mismatch_is_stale(tmp_path, tuned, sm90):
    p = tb.write_table(tmp_path / "t.json", tuned)
    t, why = tb.load_table(p, _expect(sm90, gpu="NVIDIA H100 80GB HBM3"))
    assert t is None and "stale" in why and "tuned on 'Test GPU', this GPU is 'NVIDIA H100 80GB HBM3'" in why
    assert tb.load_table(p, _expect(sm90, gpu="test gpu"))[0] is not None  # names compare by slug


def test_spec_hash_mismatch_is_stale(tmp_path, tuned, sm90):
    tuned["_metadata"]["spec_hashes"]["families"]["quant_sm90"] = "0" * 16
    p = tb.write_table(tmp_path / "t.json", tuned)
    t, why = tb.load_table(p, _expect(sm90))
    assert t is None and "spec hash of family 'quant_sm90' differs: table 0000000000000000" in why
    assert "flamia-gen tune --arch sm90" in why


def test_changed_spec_makes_the_table_stale(tmp_path, tuned):
    shutil.copytree(REPO / "specs", tmp_path / "specs")
    f = tmp_path / "specs" / "kernels" / "quant_sm90.yaml"
    f.write_text(f.read_text().replace("tokens_per_cta: [32, 64, 128]", "tokens_per_cta: [32, 64]"))
    specs = load_specs(tmp_path / "specs")
    p = tb.write_table(tmp_path / "t.json", tuned)
    t, why = tb.load_table(p, tb.installed_expectation("sm90", None, specs=specs))
    assert t is None and "quant_sm90" in why


def test_arch_mismatch_is_stale(tmp_path, tuned, sm90):
    p = tb.write_table(tmp_path / "t.json", tuned)
    specs, _ = sm90
    t, why = tb.load_table(p, tb.installed_expectation("sm100", None, specs=specs))
    assert t is None and "made for arch 'sm90', this is 'sm100'" in why


# ---------------------------------------------------------------- lookup
def test_lookup_exact_nearest_default(tuned, sm90):
    specs, plan = sm90
    g = dict(arch="sm90", kind="quant", route="e4m3_tb32_ceil", head_dim=128)
    d = tb.decide(tuned, **g, cu_seqlens=[0, 1000, 3000])  # T = 3000 → tokens 4096
    assert (d.variant, d.source) == ("quant_sm90_e4m3_tb32_ceil_d128_t64_h1", "exact")
    d = tb.decide(tuned, **g, profile=DocProfile.from_lengths([40000]))  # 65536 exists
    assert d.source == "exact" and d.variant.endswith("_t128_h1")
    d = tb.decide(tuned, **g, profile=DocProfile.from_lengths([131072]))  # no such bucket: nearest
    assert d.source == "nearest" and d.entry.endswith("tokens=65536")
    d = tb.decide(tuned, **g, profile=DocProfile.from_lengths([131072]), nearest=False)
    assert (d.variant, d.source) == ("quant_sm90_e4m3_tb32_ceil_d128_t32_h1", "default")
    # a group with no entry at all: its analytic default
    assert tb.lookup(tuned, "sm90", "quant", "e4m3_tok_ceil", 64, cu_seqlens=[0, 5]) == \
        "quant_sm90_e4m3_tok_ceil_d64_t32_h1"


def test_missing_or_stale_table_falls_back_to_defaults(tmp_path, tuned, sm90):
    assert tb.lookup(None, "sm90", "quant", "e4m3_tb32_ceil", 128, cu_seqlens=[0, 3000]) == \
        "quant_sm90_e4m3_tb32_ceil_d128_t32_h1"
    tuned["_metadata"]["spec_hashes"]["routes"]["mxfp8"] = "f" * 16
    p = tb.write_table(tmp_path / "sm90-test-gpu.json", tuned)
    with pytest.warns(RuntimeWarning, match="stale"):
        disp = tb.Dispatcher("sm90", "Test GPU", path=p)
    assert disp.table is None and "route 'mxfp8'" in disp.refused
    d = disp.decide("quant", "e4m3_tb32_ceil", 128, cu_seqlens=[0, 3000])
    assert (d.variant, d.source) == ("quant_sm90_e4m3_tb32_ceil_d128_t32_h1", "default")
    assert disp.quantizer("mxfp8_exact", "k", 128, cu_seqlens=[0, 3000]).variant == d.variant


def test_dispatcher_uses_a_valid_table(tmp_path, tuned, sm90):
    p = tb.write_table(tmp_path / "sm90-test-gpu.json", tuned)
    disp = tb.Dispatcher("sm90", "Test GPU", path=p, expected=_expect(sm90))
    assert disp.refused is None
    d = disp.quantizer("mxfp8", "q", 128, profile=DocProfile.from_lengths([1024] * 4))
    assert (d.variant, d.source) == ("quant_sm90_e4m3_tb32_ceil_d128_t64_h1", "exact")


def test_lookup_refuses_unknown_group_and_other_arch(tuned):
    with pytest.raises(KeyError, match="no variant for group"):
        tb.lookup(tuned, "sm90", "quant", "nope", 128, cu_seqlens=[0, 3])
    with pytest.raises(tb.TableError, match="arch"):
        tb.lookup(tuned, "sm100", "quant", "e4m3_tb32_ceil", 128, cu_seqlens=[0, 3])


def test_table_path_falls_back_to_the_untuned_file(tmp_path):
    (tmp_path / "sm100-untuned.json").write_text("{}")
    assert tb.table_path("sm100", "NVIDIA B200", root=tmp_path).name == "sm100-untuned.json"
    assert tb.table_filename("sm90", "NVIDIA H200") == "sm90-h200.json"
    assert tb.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


# ---------------------------------------------------------------- the shipped untuned sm100 table
def test_shipped_sm100_table_is_untuned_current_and_regenerates():
    p = REPO / "tuning_db" / "sm100-untuned.json"
    t, why = tb.load_table(p, tb.installed_expectation("sm100", "NVIDIA B200"))
    assert why is None, f"{why} — regenerate with: flamia-gen table untuned --arch sm100"
    m = t["_metadata"]
    assert m["untuned"] is True and m["gpu"] is None and "compiled, not executed" in m["status"]
    assert t["entries"] == {}
    fresh = tb.untuned_table("sm100")
    assert t["defaults"] == fresh["defaults"] and m["spec_hashes"] == fresh["_metadata"]["spec_hashes"]
    assert all(v.endswith("_t32_h1") for v in t["defaults"].values())
    # every lookup answers the analytic default
    assert tb.lookup(t, "sm100", "quant", "e4m3_tb32_ceil", 128, cu_seqlens=[0, 4096]) == \
        "quant_sm100_e4m3_tb32_ceil_d128_t32_h1"


def test_dispatch_imports_without_optuna_or_torch():
    import subprocess
    import sys

    code = ("import sys, flamia_gen.dispatch, flamia_gen.dispatch.table; "
            "bad = [m for m in ('optuna', 'torch') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr


def test_shipped_h200_table_is_current_and_answers_lookups():
    """The GPU-tuned table must match the installed specs: a spec change that makes it
    stale has to come with a re-tune on the H200 (`flamia-gen tune` + `freeze`)."""
    p = REPO / "tuning_db" / "sm90-h200.json"
    table, why = tb.load_table(p, tb.installed_expectation("sm90", "NVIDIA H200"))
    assert why is None, why
    assert table["_metadata"]["gpu"] == "NVIDIA H200" and not table["_metadata"]["untuned"]
    d = tb.decide(table, "sm90", "quant", "e4m3_tok_ceil", 128, None, [0, 16384, 32768, 49152, 65536])
    assert d.source == "exact" and d.variant.startswith("quant_sm90_e4m3_tok_ceil_d128_")
    # a bucket that was not tuned answers from the nearest tuned one, never from nothing
    d = tb.decide(table, "sm90", "quant", "e4m3_tok_ceil", 128, None, [0, 100])
    assert d.source in ("nearest", "default") and d.variant.startswith("quant_sm90_e4m3_tok_ceil_d128_")


def test_shipped_h100_table_is_current_and_covers_fp8_token():
    """The H100 table (thirtieth session: the D = 64 / 128 groups of fp8_token and the D = 128 groups of bf16 and
    fp8_tensor, the H200 being unavailable; thirty-sixth: fp8_pv, fp8_token_bf16qk and mxfp8_exact at D = 128, the
    H200's winners timed on the H100) must match the installed specs; its tuned buckets answer exactly, every other
    group from the plan's defaults."""
    p = REPO / "tuning_db" / "sm90-h100-80gb-hbm3.json"
    table, why = tb.load_table(p, tb.installed_expectation("sm90", "NVIDIA H100 80GB HBM3"))
    assert why is None, why
    assert table["_metadata"]["gpu"] == "NVIDIA H100 80GB HBM3" and not table["_metadata"]["untuned"]
    assert tb.table_path("sm90", "NVIDIA H100 80GB HBM3", root=REPO / "tuning_db") == p
    assert {e["route"] for e in table["entries"].values() if e["kind"] != "quant"} == {
        "bf16", "bf16_det", "fp8_tensor", "fp8_tensor_det", "fp8_token", "fp8_token_det", "fp8_pv",
        "fp8_token_bf16qk", "mxfp8_exact"}
    d = tb.decide(table, "sm90", "attn_bwd", "fp8_pv", 128, False, [0, 4096, 8192])
    assert d.source == "exact" and d.variant == "attn_bwd_sm90_fp8_pv_d128_m64n128_s2_wg2_preg_longest_first_noncausal"
    d = tb.decide(table, "sm90", "attn_bwd", "fp8_token", 128, True, [0, 16384])
    assert d.source == "exact" and d.variant == "attn_bwd_sm90_fp8_token_d128_m64n128_s2_wg2_preg_longest_first"
    d = tb.decide(table, "sm90", "attn_fwd", "mxfp8", 128, True, [0, 16384])  # not tuned on the H100
    assert d.source == "default" and d.variant == table["defaults"]["attn_fwd/mxfp8/d128/causal"]
