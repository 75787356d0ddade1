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


@pytest.mark.parametrize("argv", [[], ["--variant", "attn_fwd_x", "--peer", "fa4"]])
def test_exactly_one_of_variant_and_peer(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "exactly one of --variant and --peer" in capsys.readouterr().err


def test_peer_without_fa4_installed_says_so(monkeypatch):
    import flamia_gen.bench.peer_fa4 as p

    monkeypatch.setattr(p, "try_import", lambda mod: (None, f"not installed: {mod}"))
    with pytest.raises(SystemExit, match="--peer fa4: not installed: flash_attn.cute"):
        main(["--peer", "fa4"])
