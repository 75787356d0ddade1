"""The `bench` click command: usage errors and the no-CUDA exit."""

import pytest
import torch
from click.testing import CliRunner

from flamia_gen.bench.cli import NO_CUDA_MESSAGE, bench_command


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _all_output(result):
    out = result.output
    try:
        out += result.stderr
    except (ValueError, AttributeError):
        pass
    return out


def test_exits_2_without_cuda(no_cuda, tmp_path):
    r = CliRunner().invoke(bench_command, ["--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert NO_CUDA_MESSAGE in _all_output(r)
    assert NO_CUDA_MESSAGE == "no CUDA device: flamia-gen bench needs a GPU"
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not (tmp_path / "o").exists()


def test_unknown_workload_is_a_one_line_usage_error(no_cuda):
    r = CliRunner().invoke(bench_command, ["--workloads", "eq4x4096,eq3"])
    assert r.exit_code == 2
    out = _all_output(r)
    assert "Invalid value for '--workloads'" in out and "unknown workload 'eq3'" in out
    assert "Traceback" not in out


def test_unknown_impl_and_mode(no_cuda):
    r = CliRunner().invoke(bench_command, ["--impls", "fa4,fa5"])
    assert r.exit_code == 2 and "unknown implementation 'fa5'" in _all_output(r)
    r = CliRunner().invoke(bench_command, ["--mode", "infer"])
    assert r.exit_code == 2 and "--mode" in _all_output(r)
    r = CliRunner().invoke(bench_command, ["--repeats", "0"])
    assert r.exit_code == 2 and "--repeats" in _all_output(r)


def test_bwd_mode_is_accepted(no_cuda):
    """--mode bwd parses (it then stops at the missing GPU, like the other modes)."""
    r = CliRunner().invoke(bench_command, ["--mode", "bwd"])
    assert r.exit_code == 2 and NO_CUDA_MESSAGE in _all_output(r)


def test_help_lists_options():
    r = CliRunner().invoke(bench_command, ["--help"])
    assert r.exit_code == 0
    assert "bwd: the backward call alone" in " ".join(r.output.split())
    for opt in ("--workloads", "--impls", "--mode", "--out", "--repeats", "--accuracy",
                "--no-accuracy"):
        assert opt in r.output
