"""Re-timing a table's untrusted entries (`flamia_gen.tune.retime`; `flamia-gen tune --retime TABLE`, `flamia-gen
bundle --retime TABLE`): exactly the entries timed on another build of their winner or on none recorded are measured
again, each with its group's winners as the only candidates, on the rows the table timed them on; `freeze --carry`
keeps every other entry as it was."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from flamia_gen.dispatch.defaults import plan_groups
from flamia_gen.plan import make_plan
from flamia_gen.spec import load_specs
from flamia_gen.tune.retime import retime_groups, retime_variants, retime_workloads, untrusted_entries

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "tuning_db" / "sm90-h100-80gb-hbm3.json"
GPU = "NVIDIA H100 80GB HBM3"
SPECS = load_specs()
PLAN = make_plan(SPECS, arch="sm90")
STALE = "attn_fwd/fp8_token/d128/causal/max_len=4096,doc_len=4096"
UNHASHED = "quant/e4m3_tok_ceil/d128/tokens=16384"
BWD = "attn_bwd/fp8_token/d128/causal/max_len=16384,doc_len=16384"


def _current() -> dict:
    """The H100 table with every winner stamped with the build the installed templates render (so the tests do not
    depend on whether the committed table has been re-timed since the last template change)."""
    from flamia_gen.dispatch.table import installed_source_sha256

    t = json.loads(H100.read_text())
    now = installed_source_sha256("sm90", {e["winner"]["variant"] for e in t["entries"].values()}, plan=PLAN)
    for e in t["entries"].values():
        e["winner"]["source_sha256"] = now[e["winner"]["variant"]]
    return t


CURRENT = _current()


def _table(*, stale=(STALE,), unhashed=(UNHASHED,)) -> dict:
    """The current table with some entries made untrusted: a winner timed on another build (a hash the installed
    template does not render) or with no build recorded."""
    t = json.loads(json.dumps(CURRENT))
    for k in stale:
        t["entries"][k]["winner"]["source_sha256"] = "0" * 64
    for k in unhashed:
        del t["entries"][k]["winner"]["source_sha256"]
    return t


def test_a_current_table_has_nothing_to_retime():
    """The premise of the synthetic tables below: every entry timed on the build the templates render now."""
    assert STALE in CURRENT["entries"] and UNHASHED in CURRENT["entries"] and BWD in CURRENT["entries"]
    assert untrusted_entries(CURRENT, PLAN) == {}


def test_untrusted_entries_are_the_stale_and_unhashed_ones():
    t = _table()
    assert untrusted_entries(t, PLAN) == {STALE: t["entries"][STALE]["winner"]["variant"],
                                          UNHASHED: t["entries"][UNHASHED]["winner"]["variant"]}


def test_groups_keep_only_the_untrusted_winners():
    t = _table()
    groups, notes = retime_groups(list(plan_groups(PLAN, SPECS).values()), t, untrusted_entries(t, PLAN))
    assert notes == [] and sorted(g.key for g in groups) == sorted(t["entries"][k]["group"] for k in (STALE, UNHASHED))
    full = plan_groups(PLAN, SPECS)
    for g in groups:
        key = STALE if g.key == t["entries"][STALE]["group"] else UNHASHED
        assert g.candidates == (t["entries"][key]["winner"]["variant"],)
        assert len(full[g.key].candidates) >= len(g.candidates)
    assert retime_workloads(t, [STALE, UNHASHED]) == "4x4096,1x16384"


def test_a_winner_the_group_no_longer_offers_is_reported():
    t = _table(stale=(), unhashed=(STALE,))
    t["entries"][STALE]["winner"]["variant"] = "attn_fwd_sm90_fp8_token_d128_m999n128_gone"
    groups, notes = retime_groups(list(plan_groups(PLAN, SPECS).values()), t, untrusted_entries(t, PLAN))
    assert groups == [] and len(notes) == 1 and "m999n128_gone no longer among the group's candidates" in notes[0]


def test_bundle_holds_the_winners_and_a_backwards_op_path():
    t = _table(stale=(BWD,), unhashed=())
    vs, notes = retime_variants(SPECS, "sm90", t, PLAN)
    names = {v.name for v in vs}
    bwd = t["entries"][BWD]["winner"]["variant"]
    assert notes == [] and bwd in names
    fwd = [v for v in vs if v.kind.value == "attn_fwd"]
    quant = [v for v in vs if v.kind.value == "quant"]
    # a forward per causality of the route at D = 128 (O and LSE), and the route's quantizers (Q, K, V, dO)
    assert {(v.route, v.param("head_dim"), v.param("causal")) for v in fwd} == {("fp8_token", 128, True),
                                                                               ("fp8_token", 128, False)}
    assert quant and all(v.param("head_dim") == 128 for v in quant)
    assert {"quant_sm90_e4m3_tok_ceil_d128_t32_h1", "quant_sm90_e4m3_tok_ceil_delta_d128_t32_h1"} <= names
    assert [v.name for v in vs] == [v.name for v in PLAN.variants if v.name in names]  # plan order


def test_tune_retime_then_freeze_carry(run, tmp_path):
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(_table()))
    url = f"sqlite:///{tmp_path / 't.db'}"
    fake = ("--arch", "sm90", "--runner", "fake", "--fake-gpu", GPU, "--retime", str(path), "--storage", url)
    res = run("tune", *fake, "--dry-run")
    assert res.exit_code == 0, res.output
    assert "2 studies, 2 trials" in res.output  # on the rows the table timed them on (no --workloads)
    res = run("tune", *fake)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out.json"
    res = run("freeze", "--arch", "sm90", "--storage", url, "--carry", str(path), "-o", str(out))
    assert res.exit_code == 0, res.output
    old, new = json.loads(path.read_text())["entries"], json.loads(out.read_text())["entries"]
    assert old.keys() == new.keys()
    moved = {k for k in old if old[k]["winner"] != new[k]["winner"]}
    assert moved == {STALE, UNHASHED}
    for k in moved:  # measured again: the same winner, a new time (the fake runner's)
        assert new[k]["winner"]["variant"] == old[k]["winner"]["variant"] and not new[k].get("carried")
        # the entry keeps its group's candidate count (so a later --carry keeps it) and says what was measured
        assert new[k]["retimed"] == 1 and new[k]["candidates"] == old[k]["candidates"]
    assert old[STALE]["candidates"] > 1  # the forward group: the re-time measured 1 of its candidates
    assert all(new[k].get("carried") for k in old if k not in moved)
    # the re-timed table carries whole into the next freeze (no study in a fresh storage)
    res = run("tune", "--arch", "sm90", "--runner", "fake", "--fake-gpu", GPU, "--route", "e4m3_tb32_ceil",
              "--head-dim", "128", "--workloads", "4x1024", "--storage", f"sqlite:///{tmp_path / 'u.db'}")
    assert res.exit_code == 0, res.output
    again = tmp_path / "again.json"
    res = run("freeze", "--arch", "sm90", "--storage", f"sqlite:///{tmp_path / 'u.db'}", "--carry", str(out),
              "-o", str(again))
    assert res.exit_code == 0, res.output
    assert all(json.loads(again.read_text())["entries"][k]["winner"] == new[k]["winner"] for k in moved)


def test_tune_retime_refusals(run, tmp_path):
    fake = ("--arch", "sm90", "--runner", "fake", "--fake-gpu", GPU, "--storage", f"sqlite:///{tmp_path / 't.db'}")
    current = tmp_path / "current.json"
    current.write_text(json.dumps(CURRENT))
    res = run("tune", *fake, "--retime", str(current), "--dry-run")
    assert res.exit_code == 2 and "nothing to re-time" in res.output
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table()))
    res = run("tune", *fake, "--retime", str(path), "--workloads", "1x65536", "--dry-run")
    assert res.exit_code == 2 and "no workload given lands in an untrusted bucket" in res.output
    assert "not re-timed" in res.output and STALE in res.output
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    res = run("tune", *fake, "--retime", str(bad), "--dry-run")
    assert res.exit_code == 2 and "corrupt JSON" in res.output
    res = run("tune", *(a if a != "sm90" else "sm100" for a in fake), "--retime", str(path), "--dry-run")
    assert res.exit_code == 2 and "not sm100" in res.output


def test_bundle_retime_refusals(tmp_path):
    from flamia_gen.cli import main

    r = CliRunner()
    current = tmp_path / "current.json"
    current.write_text(json.dumps(CURRENT))
    res = r.invoke(main, ["bundle", "--arch", "sm90", "--retime", str(current), "-o", str(tmp_path / "b")])
    assert res.exit_code == 2 and "nothing to re-time" in res.output
    res = r.invoke(main, ["bundle", "--arch", "sm90", "--retime", str(current), "--route", "bf16", "-o",
                          str(tmp_path)])
    assert res.exit_code == 2 and "leave out --route and --variant" in res.output
    res = r.invoke(main, ["bundle", "--arch", "sm90", "--variant", "attn_fwd_sm90_nope", "-o", str(tmp_path / "b")])
    assert res.exit_code == 2 and "attn_fwd_sm90_nope: no such variant" in res.output


def test_backward_support_lists_every_route_in_a_shared_quantizers_uses():
    """Two routes' backwards that share a quantizer (fp8_token, fp8_token_bf16qk: E4M3 per token): the bundle's copy
    lists both routes' operands in `uses`, which the runtime picks a route's quantizer by (a plan per route would keep
    only the first route's: caught by CI on 2026-12-05)."""
    from flamia_gen.plan.op_support import backward_support

    bwd = [v for v in PLAN.variants if v.kind.value == "attn_bwd" and v.param("head_dim") == 128
           and v.route in ("fp8_token", "fp8_token_bf16qk") and v.param("causal")]
    sup = {v.name: v for v in backward_support(SPECS, "sm90", bwd)}
    uses = set(sup["quant_sm90_e4m3_tok_ceil_d128_t32_h1"].uses)
    assert {f"{r}.{o}" for r in ("fp8_token", "fp8_token_bf16qk") for o in ("q", "k", "v", "do")} <= uses
    assert {(v.route, v.param("causal")) for v in sup.values() if v.kind.value == "attn_fwd"} == {
        (r, c) for r in ("fp8_token", "fp8_token_bf16qk") for c in (True, False)}
    assert backward_support(SPECS, "sm90", []) == []
