"""flamia_gen.bench.one_call: the profiler target refuses bad arguments clearly."""

import pytest

from flamia_gen.bench.one_call import main


def test_needs_a_bundle(monkeypatch, capsys):
    monkeypatch.delenv("FLAMIA_GEN_BUNDLE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--variant", "attn_fwd_x"])
    assert e.value.code == 2 and "--bundle or $FLAMIA_GEN_BUNDLE is required" in capsys.readouterr().err


def test_missing_bundle_dir_is_named(tmp_path):
    from flamia_gen.runtime.bundle import BundleError

    with pytest.raises(BundleError):
        main(["--bundle", str(tmp_path / "nope"), "--variant", "attn_fwd_x"])
