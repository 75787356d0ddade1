import json
from pathlib import Path

import pytest

from flamia_gen.tune import cli as tcli

REPO = Path(__file__).resolve().parents[2]


# one group: the representation tag (the route name mxfp8 also selects its dO launch, e4m3_tb32_ceil_delta)
FAKE = ("--arch", "sm90", "--runner", "fake", "--route", "e4m3_tb32_ceil", "--head-dim", "128",
        "--workloads", "4x1024,1x65536")


@pytest.mark.parametrize("cmd", [["tune"], ["freeze"], ["table"], ["table", "show"], ["table", "check"],
                                 ["table", "untuned"]])
def test_help(run, cmd):
    res = run(*cmd, "--help")
    assert res.exit_code == 0 and "Usage:" in res.output


def test_tune_resume_freeze_show(run, tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    res = run("tune", *FAKE, "--storage", url, "--trials", "2", "--fake-fail", "*_t32_*")
    assert res.exit_code == 0, res.output
    assert "0/4 trials already done" in res.output and "freeze with" in res.output
    res = run("tune", *FAKE, "--storage", url)  # resume: budget 3 counts the 2 done
    assert res.exit_code == 0 and "4/6 trials already done" in res.output
    res = run("freeze", "--arch", "sm90", "--storage", url)
    assert res.exit_code == 0, res.output
    out = tmp_path / "db" / "sm90-fake-gpu.json"
    assert out.exists() and "2 entries, 6 trials" in res.output
    t = json.loads(out.read_text())
    for e in t["entries"].values():
        assert not e["winner"]["variant"].endswith("_t32_h1")  # failed verification never wins
        assert e["trials"] == 3 and len(e["pruned"]) == 1
    res = run("table", "show", str(out), "--gpu", "Fake GPU")
    assert res.exit_code == 0 and "current" in res.output and "2 tuned buckets" in res.output
    res = run("table", "show", str(out), "--gpu", "NVIDIA H200")
    assert res.exit_code == 1 and "STALE" in res.output and "this GPU is 'NVIDIA H200'" in res.output
    res = run("table", "check", str(out))
    assert res.exit_code == 0 and "ok" in res.output


def test_tune_with_two_worker_processes(run, tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    log = tmp_path / "m.log"
    res = run("tune", *FAKE, "--storage", url, "--workers", "2", "--fake-log", str(log))
    assert res.exit_code == 0, res.output
    rows = log.read_text().splitlines()
    assert len(rows) == 6 and len({r.split("\t", 1)[1] for r in rows}) == 6


def test_corrupt_table_is_refused(run, tmp_path):
    p = tmp_path / "sm90-x.json"
    p.write_text('{"_metadata": {"format": 1')
    res = run("table", "check", str(p))
    assert res.exit_code == 1 and "corrupt JSON" in res.output
    res = run("table", "show", str(p))
    assert res.exit_code == 1 and "refused" in res.output


def test_shipped_untuned_table_says_so(run, monkeypatch):
    monkeypatch.setenv("FLAMIA_GEN_TUNING_DB", str(REPO / "tuning_db"))
    res = run("table", "show", "--arch", "sm100", "--gpu", "NVIDIA B200")
    assert res.exit_code == 0, res.output
    assert "UNTUNED" in res.output and "compiled, not executed" in res.output and "sm100-untuned.json" in res.output


def test_untuned_generation_matches_the_shipped_file(run, tmp_path):
    out = tmp_path / "u.json"
    res = run("table", "untuned", "--arch", "sm100", "-o", str(out))
    assert res.exit_code == 0 and "compiled, not executed" in res.output
    shipped = json.loads((REPO / "tuning_db" / "sm100-untuned.json").read_text())
    fresh = json.loads(out.read_text())
    shipped["_metadata"].pop("dsl"), fresh["_metadata"].pop("dsl")
    assert fresh == shipped, "regenerate: flamia-gen table untuned --arch sm100"


@pytest.mark.parametrize("args,msg", [
    (("--device-ids", "a,b"), "expected comma-separated GPU ids"),
    (("--workloads", "4y4096"), "is not N or COUNTxLEN"),
    (("--route", "nope"), "match no variant"),
    (("--storage", "nosuchdb://x"), "cannot open storage"),
])
def test_bad_input_exits_2_with_one_line(run, args, msg):
    res = run("tune", "--arch", "sm90", "--runner", "fake", *args)
    assert res.exit_code == 2 and msg in res.output


def test_empty_selection_is_nothing_to_tune(run, tmp_path):
    """A kind/head-dim pair the specs do not build (here a specs copy whose backward has D = 128 only)."""
    import shutil

    specs = tmp_path / "specs"
    shutil.copytree(REPO / "specs", specs)
    p = specs / "kernels" / "attn_bwd_sm90.yaml"
    p.write_text(p.read_text().replace("head_dims: [128, 64]", "head_dims: [128]"))
    res = run("tune", "--arch", "sm90", "--runner", "fake", "--specs", str(specs), "--kind", "attn_bwd",
              "--head-dim", "64")
    assert res.exit_code == 2 and "nothing to tune" in res.output


def test_gpu_runner_without_a_gpu_says_what_to_do(run, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = run("tune", "--arch", "sm90", "--route", "mxfp8")
    assert res.exit_code == 2 and "no CUDA device here" in res.output and "--bundle DIR" in res.output
    res = run("tune", "--arch", "sm90", "--kind", "attn_bwd")  # every kind has a hook: the GPU is missing
    assert res.exit_code == 2 and "no CUDA device here" in res.output


def test_freeze_without_studies_is_a_clear_error(run, tmp_path):
    res = run("freeze", "--arch", "sm90", "--storage", f"sqlite:///{tmp_path / 'empty.db'}")
    assert res.exit_code == 2 and "no flamia-gen study for arch sm90" in res.output


def test_dry_run_lists_studies(run):
    res = run("tune", *FAKE, "--dry-run")
    assert res.exit_code == 0 and "2 studies, 6 trials" in res.output and "tokens=65536" in res.output


def test_table_check_and_show_warn_about_entries_timed_on_another_build(run, tmp_path):
    """The shipped H200 table with one winner marked as timed on another build of its kernel: still valid and
    used (exit 0), but `table check` and `table show` name the group to re-tune; the same winner with the
    installed build's hash is not reported."""
    from flamia_gen.dispatch.table import installed_source_sha256

    table = json.loads((REPO / "tuning_db" / "sm90-h200.json").read_text())
    key = "attn_fwd/fp8_tensor/d128/causal/max_len=16384,doc_len=16384"
    e = table["entries"][key]
    p = tmp_path / "sm90-h200.json"
    e["winner"]["source_sha256"] = "0" * 64
    p.write_text(json.dumps(table))
    for cmd in ("check", "show"):
        res = run("table", cmd, str(p))
        assert res.exit_code == 0, res.output
        assert "timed on another build" in res.output and "attn_fwd/fp8_tensor/d128/causal" in res.output
    e["winner"]["source_sha256"] = installed_source_sha256("sm90", [e["winner"]["variant"]])[e["winner"]["variant"]]
    p.write_text(json.dumps(table))
    res = run("table", "check", str(p))
    # (the shipped table may itself hold entries awaiting a re-tune — round 30's backward defaults — but not this one)
    assert res.exit_code == 0 and "attn_fwd/fp8_tensor/d128/causal" not in res.output, res.output


def test_gpu_runner_builds_a_backwards_op_path(monkeypatch, tmp_path):
    """Tuning backwards on a GPU host that has the DSL (no --bundle): the local bundle holds, besides the candidates,
    the forward (O, LSE) and the quantizers their op path runs (plan.op_support); without them every backward
    candidate failed verification with "bundle has no attn_fwd variant" (fixed 2026-12-05)."""
    torch = pytest.importorskip("torch")
    from flamia_gen.build import builder, bundle, cache, toolchain
    from flamia_gen.plan import make_plan
    from flamia_gen.spec import load_specs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(toolchain, "dsl_available", lambda: True)
    monkeypatch.setattr(cache, "cache_root", lambda: tmp_path)
    seen = {}

    def fake_build_all(variants, jobs=1, **kw):
        seen["names"] = [v.name for v in variants]
        return []

    monkeypatch.setattr(builder, "build_all", fake_build_all)
    monkeypatch.setattr(bundle, "write_bundle", lambda *a, **k: {})
    specs = load_specs()
    plan = make_plan(specs, arch="sm90")
    cands = ["attn_bwd_sm90_fp8_token_d128_m64n128_s2_wg2_preg_longest_first"]
    cfg, gpu, ids = tcli._gpu_runner("sm90", None, 1, 30, cands, None, 1, plan, specs)
    names = seen["names"]
    assert gpu == "NVIDIA H200" and cands[0] in names and len(names) == len(set(names))
    kinds = {plan.by_name(n).kind.value for n in names}
    assert kinds == {"attn_bwd", "attn_fwd", "quant"}
    assert {(plan.by_name(n).route, plan.by_name(n).param("causal")) for n in names
            if plan.by_name(n).kind.value == "attn_fwd"} == {("fp8_token", True), ("fp8_token", False)}
    assert "quant_sm90_e4m3_tok_ceil_delta_d128_t32_h1" in names  # the dO launch
