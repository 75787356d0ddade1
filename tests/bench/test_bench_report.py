"""Rows, speed-ups, table text, JSON round trip and the PNG chart."""

import json

import pytest

from flamia_gen.bench.report import (SCHEMA, BenchRow, collect_metadata, compute_speedups,
                                     fastest_peer, read_json, table_text, write_chart, write_json)


def _rows():
    return [
        BenchRow("fa4", "eq4x4096", "fwd", "bf16", median_ms=2.0, tflops=517.0, peak_mib=10.0),
        BenchRow("sdpa_cudnn", "eq4x4096", "fwd", "bf16", median_ms=4.0, tflops=258.0),
        BenchRow("flamia_mxfp8", "eq4x4096", "fwd", "fp8", is_peer=False, median_ms=1.0,
                 tflops=1034.0, o_cos=0.9988, dq_cos=0.9979),
        BenchRow("bogus", "eq4x4096", "fwd", "bf16", median_ms=0.1, tflops=9999.0, suspect=True,
                 note="suspect: too fast"),
        BenchRow("sdpa_cudnn", "skew8192+224x256", "fwd", "bf16", status="skipped",
                 note="needs equal documents (padding would waste memory)"),
        BenchRow("fa4", "skew8192+224x256", "fwd", "bf16", median_ms=3.0),
        BenchRow("cudnn_fp8_e2e", "skew8192+224x256", "fwd", "fp8", status="not installed",
                 note="not installed: cudnn (No module named 'cudnn')"),
    ]


def test_speedups_against_fastest_peer_only():
    rows = _rows()
    best = compute_speedups(rows)
    assert best == {"eq4x4096": 2.0, "skew8192+224x256": 3.0}  # ours and suspect rows excluded
    sp = {(r.impl, r.workload): r.speedup for r in rows}
    assert sp[("fa4", "eq4x4096")] == pytest.approx(1.0)
    assert sp[("sdpa_cudnn", "eq4x4096")] == pytest.approx(0.5)
    assert sp[("flamia_mxfp8", "eq4x4096")] == pytest.approx(2.0)
    assert sp[("sdpa_cudnn", "skew8192+224x256")] is None
    assert fastest_peer(rows, "eq4x4096", "fwd").impl == "fa4"
    assert fastest_peer(rows, "eq1x16384", "fwd") is None


def test_table_text_shows_values_and_reasons():
    rows = _rows()
    compute_speedups(rows)
    text = table_text(rows, width=220)
    assert "fa4" in text and "517" in text and "2.000" in text
    assert "2.00x" in text and "0.50x" in text
    assert "0.9988" in text and "0.9979" in text  # cosine columns appear when present
    assert "skipped: needs equal documents" in text
    assert "not installed: not installed: cudnn" not in text
    assert "not installed" in text and "suspect" in text
    no_cos = table_text([r for r in rows if r.o_cos is None], width=220)
    assert "O cos" not in no_cos
    assert "host ms" not in text  # no row has a host time


def test_table_marks_host_bound_rows():
    rows = [BenchRow("sdpa_cudnn", "eq1x2048", "train", "bf16", median_ms=0.624, tflops=96.0, host_ms=0.31),
            BenchRow("flamia_fp8_token", "eq1x2048", "train", "fp8", is_peer=False, median_ms=1.252, tflops=48.0,
                     host_ms=1.19),
            BenchRow("flamia_bf16", "eq1x2048", "train", "bf16", is_peer=False, status="error", note="boom")]
    compute_speedups(rows)
    text = table_text(rows, width=220)
    assert "host ms" in text and "0.310 " in text and "1.190*" in text  # 1.19 ≥ 0.9 × 1.252: host-bound
    assert "0.310*" not in text and "* host-bound" in text
    line = next(ln for ln in text.splitlines() if "flamia_bf16" in ln)
    assert line.count("-") >= 5  # an error row fills every number column, the host column too


def test_json_round_trip(tmp_path):
    rows = _rows()
    compute_speedups(rows)
    meta = collect_metadata([], extra={"mode": "fwd"})
    for key in ("gpu", "torch", "date", "peer_versions", "flamia_gen"):
        assert key in meta
    path = write_json(tmp_path / "sub" / "bench.json", rows, meta)
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA and raw["metadata"]["mode"] == "fwd"
    assert len(raw["rows"]) == len(rows)
    doc = read_json(path)
    assert doc["rows"] == rows  # dataclass equality: every field survived
    assert doc["metadata"]["torch"] == meta["torch"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="schema"):
        read_json(bad)


def test_metadata_reports_each_impl(fakes):
    meta = collect_metadata([fakes["cpu_exact"](), fakes["cpu_missing"]()])
    assert meta["impls"]["cpu_exact"]["available"] is True
    assert meta["impls"]["cpu_missing"]["reason"].startswith("not installed")
    assert meta["impls"]["cpu_exact"]["precision"] == "bf16"


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows()
    compute_speedups(rows)
    path = write_chart(tmp_path / "c.png", rows)
    assert path is not None and path.exists()
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert write_chart(tmp_path / "none.png", [r for r in rows if r.status != "ok"]) is None
    assert not (tmp_path / "none.png").exists()


def test_git_commit_marks_a_tree_that_differs_from_head(tmp_path):
    """A GPU host's copy of the tree can sit on an older commit with newer files over it: the recorded commit
    must say so rather than name code that did not run."""
    import shutil
    import subprocess

    from flamia_gen.bench.report import _git_commit

    if shutil.which("git") is None:
        pytest.skip("no git")
    env = ["-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run(["git", *env, "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run(["git", *env, "-C", str(tmp_path), "commit", "-qm", "c"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert _git_commit(tmp_path) == head
    (tmp_path / "b.py").write_text("untracked\n")  # untracked files (outputs, bundles) do not count
    assert _git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert _git_commit(tmp_path) == head + "-dirty"
    assert _git_commit(tmp_path / "nowhere") is None
