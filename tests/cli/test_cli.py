from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flamia_gen.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(monkeypatch):
    from rich.console import Console

    import flamia_gen.cli as cli

    monkeypatch.setattr(cli, "console", Console(width=250))  # rich would fold at 80 columns
    r = CliRunner()
    return lambda *a: r.invoke(main, list(a), catch_exceptions=False)


@pytest.mark.parametrize("cmd", [[], ["specs"], ["specs", "list"], ["specs", "validate"], ["specs", "show"],
                                 ["plan"], ["render"], ["build"], ["bundle"], ["verify"], ["probe"],
                                 ["tune"], ["freeze"], ["table"], ["bench"]])
def test_help_everywhere(run, cmd):
    res = run(*cmd, "--help")
    assert res.exit_code == 0 and "Usage:" in res.output


def test_specs_list_and_show(run):
    res = run("specs", "list")
    assert res.exit_code == 0
    for r in ("mxfp8_exact", "nvfp4_mixed", "fp8_token", "compiled, not executed"):
        assert r in res.output
    res = run("specs", "show", "mxfp8")
    assert res.exit_code == 0 and '"spec_hash"' in res.output and '"token_block"' in res.output
    res = run("specs", "show", "nope")
    assert res.exit_code == 2 and "no route or family named 'nope'" in res.output


def _bad_specs(tmp_path, mutate):
    import shutil

    shutil.copytree(REPO / "specs", tmp_path / "specs")
    p = tmp_path / "specs/routes/mxfp8.yaml"
    d = yaml.safe_load(p.read_text())
    mutate(d)
    p.write_text(yaml.safe_dump(d))
    return tmp_path / "specs"


def test_validate_exits_2_naming_the_problem(run, tmp_path):
    assert run("specs", "validate").exit_code == 0
    d = _bad_specs(tmp_path, lambda d: d["operands"]["q"].update(exponent_rul="ceil"))
    res = run("specs", "validate", "--specs", str(d))
    assert res.exit_code == 2
    assert "mxfp8.yaml" in res.output and "operands.q.exponent_rul" in res.output
    d2 = _bad_specs(tmp_path / "b", lambda d: d["operands"]["v"].update(granularity="square_32"))
    res = run("specs", "validate", "--specs", str(d2))
    assert res.exit_code == 2 and "square_32" in res.output and "allowed values" in res.output


def test_bad_choices_exit_2(run):
    assert run("build", "--arch", "sm80").exit_code == 2
    res = run("build", "--arch", "sm90", "--route", "mxfp9")
    assert res.exit_code == 2 and "unknown route 'mxfp9'" in res.output
    res = run("verify", "--route", "mxfp9")
    assert res.exit_code == 2


def test_plan_lists_variants_and_pruned(run):
    res = run("plan", "--arch", "sm90")
    assert res.exit_code == 0 and "quant_sm90_e4m3_tb32_ceil_d128_t32_h1" in res.output
    assert "pruned:" not in res.output  # the title counts them; rows only with --pruned
    res = run("plan", "--arch", "sm90", "--pruned")
    assert res.exit_code == 0 and "pruned:" in res.output


def test_probe_cpu_reports_exact_and_leaky_routes(run, tmp_path):
    import json

    out = tmp_path / "p.json"
    res = run("probe", "--route", "fp8_token", "--route", "fp8_tensor", "--json", str(out))
    assert res.exit_code == 0, res.output
    rows = {r["route"]: r for r in json.loads(out.read_text())}
    assert rows["fp8_token"]["exact"] and rows["fp8_token"]["o_leak"] == 0.0 and rows["fp8_token"]["dq_leak"] == 0.0
    assert not rows["fp8_tensor"]["exact"] and rows["fp8_tensor"]["o_leak"] > 0
    assert run("probe", "--route", "nope").exit_code == 2
