"""verify_cpu: every route's emulator vs the exact reference, with the leakage probe."""

import json
import math

import pytest
import torch

from flamia_gen.spec import load_specs
from flamia_gen.verify.cpu import expected_o_cosine, make_inputs, render_table, to_json, verify_cpu

EXACT = {"bf16", "fp8_token", "mxfp8_exact"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def rows():
    return verify_cpu(None, docs=2, doc_len=256, heads=2, head_dim=128, tile_m=64, tile_n=64,
                      probe_positions=[40, 256 + 100, 511])


def test_every_route_has_a_row_with_finite_cosines(rows):
    assert {r["route"] for r in rows} == set(load_specs().routes)
    for r in rows:
        for key in ("o", "dq", "dk", "dv"):
            assert math.isfinite(r[f"{key}_cosine"]) and math.isfinite(r[f"{key}_rel_error"]), r
        assert r["o_cosine"] >= expected_o_cosine(r["route"]), r
        assert r["seconds"] > 0


def test_probe_flags(rows):
    by = {r["route"]: r for r in rows}
    for name in EXACT:
        assert by[name]["probe_exact"] and by[name]["o_leak"] == 0.0 and by[name]["dq_leak"] == 0.0
    assert by["fp8_tensor"]["o_leak"] > 0 and not by["fp8_tensor"]["probe_exact"]
    assert by["mxfp8"]["leak_outside_block"] == 0.0
    assert all(r["exact_ok"] for r in rows), [r["route"] for r in rows if not r["exact_ok"]]


def test_table_and_json(rows, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render_table(rows))
    text = console.export_text()
    assert "mxfp8_exact" in text and "O cos" in text
    p = to_json(rows, tmp_path / "out" / "verify.json")
    data = json.loads(p.read_text())
    assert data["device"] == "cpu" and len(data["rows"]) == len(rows)


def test_outlier_inputs_and_unknown_route():
    q, k, v, do, cu = make_inputs(docs=1, doc_len=64, heads=1, head_dim=64, outliers=True)
    assert q.abs().max() > 20 and cu.tolist() == [0, 64]
    out = verify_cpu(["mxfp8_exact"], docs=1, doc_len=64, heads=1, head_dim=64, outliers=True,
                     reference_dtype=torch.float64, probe_positions=[50])
    assert out[0]["probe_exact"] and out[0]["o_cosine"] > 0.99
    with pytest.raises(Exception, match="allowed values"):
        verify_cpu(["nope"], docs=1, doc_len=32, heads=1, head_dim=64, probe=False)
