"""`flamia-gen bundle-merge`: bundles built by one toolchain merge into one folder the loader accepts; a corrupt file,
another toolchain or two different kernels under one name are refused with the reason. Hand-made bundles (files and
manifests with real sha256s), so no compiler is needed."""

import json

import pytest
from click.testing import CliRunner

from flamia_gen.build.bundle import merge_bundles
from flamia_gen.build.cache import sha256_file
from flamia_gen.cli import main
from flamia_gen.runtime.bundle import BundleError, read_manifest


def test_merge_keeps_every_variant_once_and_checks_out(tmp_path, hand_bundle):
    a = hand_bundle(tmp_path / "a", {"k1": b"one", "k2": b"two"})
    b = hand_bundle(tmp_path / "b", {"k2": b"two", "k3": b"three"})
    out = tmp_path / "out"
    m = merge_bundles(out, [a, b])
    assert [e["name"] for e in m["variants"]] == ["k1", "k2", "k3"]
    back = read_manifest(out)
    assert back == m
    for e in back["variants"]:  # every file the manifest lists is there with its sha256, nothing else
        assert sha256_file(out / e["file"]) == e["sha256"]
    assert sorted(p.name for p in (out / "kernels").iterdir()) == ["k1.so", "k2.so", "k3.so"]
    assert (out / "lib" / "libcute_dsl_runtime.so.xz").read_bytes() == b"runtime-xz"


def test_merge_refuses_a_corrupt_kernel(tmp_path, hand_bundle):
    a = hand_bundle(tmp_path / "a", {"k1": b"one"})
    b = hand_bundle(tmp_path / "b", {"k3": b"three"})
    (b / "kernels" / "k3.so").write_bytes(b"tampered")
    with pytest.raises(BundleError, match="k3.so: missing or its sha256"):
        merge_bundles(tmp_path / "out", [a, b])
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_merge_refuses_one_name_with_two_kernels(tmp_path, hand_bundle):
    a = hand_bundle(tmp_path / "a", {"k1": b"one"})
    b = hand_bundle(tmp_path / "b", {"k1": b"another build"})
    with pytest.raises(BundleError, match="'k1' is in .* with different kernels"):
        merge_bundles(tmp_path / "out", [a, b])


@pytest.mark.parametrize("over, what", [(dict(dsl_version="4.9.0"), "dsl_version"), (dict(arch="sm100"), "arch"),
                                        (dict(format=2), "format")])
def test_merge_refuses_another_toolchain(tmp_path, over, what, hand_bundle):
    a = hand_bundle(tmp_path / "a", {"k1": b"one"})
    b = hand_bundle(tmp_path / "b", {"k2": b"two"}, **over)
    with pytest.raises(BundleError, match=what):
        merge_bundles(tmp_path / "out", [a, b])


def test_merge_refuses_another_runtime_and_its_own_source(tmp_path, hand_bundle):
    a = hand_bundle(tmp_path / "a", {"k1": b"one"})
    b = hand_bundle(tmp_path / "b", {"k2": b"two"})
    m = json.loads((b / "manifest.json").read_text())
    m["runtime"]["sha256"] = "cd" * 32
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="another DSL runtime"):
        merge_bundles(tmp_path / "out", [a, b])
    with pytest.raises(BundleError, match="is one of the sources"):
        merge_bundles(a, [a])


def test_cli_bundle_merge(tmp_path, hand_bundle):
    a = hand_bundle(tmp_path / "a", {"k1": b"one"})
    b = hand_bundle(tmp_path / "b", {"k2": b"two"})
    r = CliRunner().invoke(main, ["bundle-merge", str(a), str(b), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "2 variants from 2 bundles" in " ".join(r.output.split())  # rich wraps long lines
    (b / "kernels" / "k2.so").write_bytes(b"x")
    r = CliRunner().invoke(main, ["bundle-merge", str(a), str(b), "-o", str(tmp_path / "out2")])
    assert r.exit_code != 0 and "sha256 does not match" in r.output
