"""GPU tuning path (skips without a CUDA GPU, and without a bundle or the DSL).

On the H200: `FLAMIA_GEN_BUNDLE=DIR python -m pytest -q -m gpu tests/tune` with a bundle
made by `flamia-gen bundle --arch sm90 --route mxfp8 -o DIR`."""

import json
import os
from collections import Counter

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bundle_dir():
    d = os.environ.get("FLAMIA_GEN_BUNDLE")
    if not d:
        pytest.skip("set FLAMIA_GEN_BUNDLE to a bundle holding the sm90 mxfp8 quantizers")
    return d


def test_bundle_runner_verifies_and_times_a_quantizer(bundle_dir):
    from flamia_gen.tune.runner import BundleRunner
    from flamia_gen.tune.space import parse_workload

    r = BundleRunner(bundle_dir)
    info = r.info()
    assert info["gpu"] and info["torch"] and info["dsl"]
    m = r.measure("quant_sm90_e4m3_tb32_ceil_d128_t32_h1", parse_workload("4x1024", heads=16))
    assert m.ok, m.reason
    assert m.repeats >= 20 and 0 < m.min_ms <= m.median_ms <= m.p80_ms
    miss = r.measure("quant_sm90_nope", parse_workload("4x1024"))
    assert not miss.ok and "not in bundle" in miss.reason


def test_two_workers_on_one_gpu_share_one_study(bundle_dir, tmp_path):
    import click
    import optuna
    from click.testing import CliRunner

    from flamia_gen.tune import cli as tcli
    from flamia_gen.tune.study import open_storage

    @click.group()
    def main():
        pass

    for c in (tcli.tune_command, tcli.freeze_command):
        main.add_command(c)
    url = f"sqlite:///{tmp_path / 'gpu.db'}"
    out = tmp_path / "table.json"
    args = ["tune", "--arch", "sm90", "--bundle", bundle_dir, "--route", "e4m3_tb32_ceil", "--head-dim", "128",
            "--workloads", "4x4096,1x65536", "--storage", url, "--workers", "2", "--device-ids", "0,0"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["freeze", "--arch", "sm90", "--storage", url, "-o", str(out)])
    assert res.exit_code == 0, res.output
    table = json.loads(out.read_text())
    assert len(table["entries"]) == 2
    st = open_storage(url)
    for s in optuna.get_all_study_summaries(st):
        vs = Counter(t.user_attrs["variant"] for t in st.get_all_trials(s._study_id) if "variant" in t.user_attrs)
        assert vs and max(vs.values()) == 1
