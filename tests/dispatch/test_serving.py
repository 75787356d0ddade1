"""`flamia-gen bundle --table TABLE`: a deployment bundle holds exactly what the table dispatches to
(`dispatch.serving.table_served_variants`), and a table the runtime would refuse is refused here too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flamia_gen.dispatch.defaults import plan_groups
from flamia_gen.dispatch.serving import table_served_variants
from flamia_gen.plan import make_plan
from flamia_gen.spec import load_specs

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "tuning_db" / "sm90-h100-80gb-hbm3.json"
SPECS = load_specs()
PLAN = make_plan(SPECS, arch="sm90")
GROUPS = plan_groups(PLAN, SPECS)
TABLE = json.loads(H100.read_text())


def _served(table=TABLE, **kw):
    vs, notes = table_served_variants(SPECS, "sm90", table, PLAN, **kw)
    return {v.name: v for v in vs}, notes


def test_every_entrys_winner_and_nothing_else_of_a_tuned_group():
    names, notes = _served(routes=("fp8_token",), head_dims=(128,))
    assert notes == []
    tok = [e for e in TABLE["entries"].values() if e["group"].split("/")[1] in ("fp8_token", "fp8_token_det")
           and e["group"].split("/")[2] == "d128"]
    assert tok and {e["winner"]["variant"] for e in tok} <= set(names)
    for g in {e["group"] for e in tok}:
        if g.startswith("attn_bwd/"):  # the forwards the op paths need may add other forwards; backwards only winners
            held = {n for n in names if n in GROUPS[g].candidates}
            assert held == {e["winner"]["variant"] for e in tok if e["group"] == g}
    # nothing of another route or head dim but the shared quantizers
    for n, v in names.items():
        assert v.param("head_dim") == 128
        if v.kind.value != "quant":
            assert v.route == "fp8_token", n
        else:
            assert any(u.startswith("fp8_token.") for u in v.uses), n
    # the op path: both causalities' forwards, Q/K/V and dO quantizers
    assert {v.param("causal") for v in names.values() if v.kind.value == "attn_fwd"} == {True, False}
    assert "quant_sm90_e4m3_tok_ceil_delta_d128_t32_h1" in names


def test_a_group_without_entries_is_served_by_its_default():
    t = json.loads(json.dumps(TABLE))
    gone = [k for k, e in t["entries"].items() if e["group"] == "attn_fwd/fp8_pv/d128/causal"]
    assert gone
    for k in gone:
        del t["entries"][k]
    names, _ = _served(t, routes=("fp8_pv",), head_dims=(128,))
    fwd = {n for n, v in names.items() if v.kind.value == "attn_fwd" and v.param("causal")}
    assert GROUPS["attn_fwd/fp8_pv/d128/causal"].default in fwd
    t["defaults"]["attn_fwd/fp8_pv/d128/causal"] = GROUPS["attn_fwd/fp8_pv/d128/causal"].candidates[1]
    names, _ = _served(t, routes=("fp8_pv",), head_dims=(128,))
    assert GROUPS["attn_fwd/fp8_pv/d128/causal"].candidates[1] in names  # the table's own default wins


def test_a_winner_the_specs_no_longer_offer_is_reported_and_its_default_bundled():
    t = json.loads(json.dumps(TABLE))
    k = next(k for k, e in t["entries"].items() if e["group"] == "attn_bwd/fp8_token/d128/causal")
    t["entries"][k]["winner"]["variant"] = "attn_bwd_sm90_fp8_token_d128_m999_gone"
    names, notes = _served(t, routes=("fp8_token",), head_dims=(128,))
    assert len(notes) == 1 and "m999_gone is not a variant" in notes[0]
    assert "attn_bwd_sm90_fp8_token_d128_m999_gone" not in names
    assert GROUPS["attn_bwd/fp8_token/d128/causal"].default in names


def test_narrowing_by_route_and_head_dim():
    all_names, _ = _served()
    pv, _ = _served(routes=("fp8_pv",))
    d64, _ = _served(head_dims=(64,))
    assert set(pv) < set(all_names) and set(d64) < set(all_names)
    assert {v.param("head_dim") for v in d64.values()} == {64}
    assert all(v.route == "fp8_pv" for v in pv.values() if v.kind.value != "quant")
    assert [n for n in all_names] == [v.name for v in PLAN.variants if v.name in all_names]  # plan order


@pytest.mark.parametrize("args,msg", [
    (["--retime", "{t}"], "leave out --retime and --variant"),
    (["--variant", "x"], "leave out --retime and --variant"),
    (["--route", "nope"], "unknown route 'nope'"),
    (["--head-dim", "96"], "head dim 96 has no variant"),
])
def test_bundle_table_refusals(tmp_path, args, msg):
    from flamia_gen.cli import main

    t = tmp_path / "t.json"
    t.write_text(json.dumps(TABLE))
    args = [a.format(t=t) for a in args]
    res = CliRunner().invoke(main, ["bundle", "--arch", "sm90", "--table", str(t), *args, "-o", str(tmp_path / "b")])
    assert res.exit_code != 0 and msg in res.output, res.output


def test_bundle_table_refuses_a_table_the_runtime_would_ignore(tmp_path):
    from flamia_gen.cli import main

    t = json.loads(json.dumps(TABLE))
    fam = next(iter(t["_metadata"]["spec_hashes"]["families"]))
    t["_metadata"]["spec_hashes"]["families"][fam] = "0" * 16
    p = tmp_path / "stale.json"
    p.write_text(json.dumps(t))
    r = CliRunner()
    res = r.invoke(main, ["bundle", "--arch", "sm90", "--table", str(p), "-o", str(tmp_path / "b")])
    assert res.exit_code == 2 and "the runtime would not use this table" in res.output and "spec hash" in res.output
    res = r.invoke(main, ["bundle", "--arch", "sm100", "--table", str(H100), "-o", str(tmp_path / "b")])
    assert res.exit_code == 2 and "arch" in res.output
    res = r.invoke(main, ["bundle", "--arch", "sm90", "--head-dim", "128", "-o", str(tmp_path / "b")])
    assert res.exit_code == 2 and "--head-dim narrows --table" in res.output


def test_bundle_table_builds_the_served_variants(tmp_path, monkeypatch):
    """The CLI builds exactly `table_served_variants` (the build itself stubbed: it is the builder's tests' job)."""
    import flamia_gen.cli as cli

    seen = {}

    def fake_build(specs_dir, arch, routes, jobs, force, names=None, plan=None):
        seen.update(routes=routes, names=names)
        raise cli.Fail("stop here")

    monkeypatch.setattr(cli, "_build", fake_build)
    res = CliRunner().invoke(cli.main, ["bundle", "--arch", "sm90", "--table", str(H100), "--route", "fp8_pv",
                                        "--head-dim", "128", "-o", str(tmp_path / "b")])
    assert "stop here" in res.output
    want, _ = _served(routes=("fp8_pv",), head_dims=(128,))
    assert seen["routes"] == () and seen["names"] == tuple(want)
    assert "variants serve its" in res.output


def test_bundle_table_says_when_its_choices_were_timed_on_another_build(tmp_path, monkeypatch):
    import flamia_gen.cli as cli
    from flamia_gen.dispatch.table import installed_source_sha256

    t = json.loads(json.dumps(TABLE))
    now = installed_source_sha256("sm90", {e["winner"]["variant"] for e in t["entries"].values()}, plan=PLAN)
    for e in t["entries"].values():  # current builds everywhere (whatever the committed table's state), then one not
        e["winner"]["source_sha256"] = now[e["winner"]["variant"]]
    keys = [k for k, e in t["entries"].items() if e["group"].startswith("attn_bwd/fp8_pv/d128/")]
    p = tmp_path / "t.json"
    monkeypatch.setattr(cli, "_build", lambda *a, **k: (_ for _ in ()).throw(cli.Fail("stop here")))
    args = ["bundle", "--arch", "sm90", "--table", str(p), "--route", "fp8_pv", "--head-dim", "128", "-o",
            str(tmp_path / "b")]
    p.write_text(json.dumps(t))
    res = CliRunner().invoke(cli.main, args)
    assert "stop here" in res.output and "timed on another build" not in res.output
    t["entries"][keys[0]]["winner"]["source_sha256"] = "0" * 64
    p.write_text(json.dumps(t))
    res = CliRunner().invoke(cli.main, args)
    assert "1 of the bundled choices' entries were timed on another build" in " ".join(res.output.split())
