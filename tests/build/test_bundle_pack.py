"""`flamia-gen bundle-pack`: a bundle as one reproducible .tar.xz that the loader, merge and --bundle options take as
they take a folder; a damaged archive, a damaged unpacked copy or a corrupt source is detected, never trusted."""

import io
import json
import tarfile

import pytest
from click.testing import CliRunner

from flamia_gen.build.bundle import merge_bundles
from flamia_gen.build.cache import sha256_file
from flamia_gen.cli import main
from flamia_gen.runtime.bundle import BundleError, load_bundle, read_manifest
from flamia_gen.runtime.bundle_archive import pack_bundle, unpacked_bundle


@pytest.fixture(autouse=True)
def _runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAMIA_GEN_RUNTIME_DIR", str(tmp_path / "rt"))


def _packed(tmp_path, hand_bundle, kernels=None, name="b.tar.xz"):
    src = hand_bundle(tmp_path / "src", kernels or {"k1": b"one" * 100, "k2": b"two" * 100})
    out = tmp_path / name
    pack_bundle(src, out)
    return src, out


def test_pack_is_reproducible_and_holds_only_the_listed_files(tmp_path, hand_bundle):
    src, out = _packed(tmp_path, hand_bundle)
    (src / "kernels" / "stray.so").write_bytes(b"not in the manifest")
    pack_bundle(src, tmp_path / "again.tar.xz")
    assert out.read_bytes() == (tmp_path / "again.tar.xz").read_bytes()
    with tarfile.open(out, "r:xz") as tf:
        assert tf.getnames() == ["manifest.json", "kernels/k1.so", "kernels/k2.so", "lib/libcute_dsl_runtime.so.xz"]
        assert {m.mtime for m in tf.getmembers()} == {0}


def test_loader_takes_a_packed_bundle_as_a_folder(tmp_path, hand_bundle, monkeypatch):
    src, out = _packed(tmp_path, hand_bundle)
    b = load_bundle(out)
    assert b.root != src and b.root.is_dir()
    assert sorted(b.variants) == ["k1", "k2"]
    assert b.manifest == read_manifest(src) == read_manifest(out)
    for e in b.manifest["variants"]:
        assert (b.root / e["file"]).read_bytes() == (src / e["file"]).read_bytes()
    assert load_bundle(out).root == b.root  # unpacked once per archive digest
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", str(out))
    assert load_bundle().root == b.root


def test_a_damaged_unpacked_copy_is_unpacked_again(tmp_path, hand_bundle):
    _, out = _packed(tmp_path, hand_bundle)
    root = unpacked_bundle(out)
    (root / "kernels" / "k1.so").write_bytes(b"tampered")
    assert unpacked_bundle(out) == root
    assert (root / "kernels" / "k1.so").read_bytes() == b"one" * 100
    (root / "manifest.json").write_text("{not json")
    assert read_manifest(unpacked_bundle(out))["variants"][0]["name"] == "k1"
    (root / "lib" / "libcute_dsl_runtime.so.xz").unlink()
    assert (unpacked_bundle(out) / "lib" / "libcute_dsl_runtime.so.xz").read_bytes() == b"runtime-xz"


def test_a_corrupt_archive_is_refused(tmp_path, hand_bundle):
    _, out = _packed(tmp_path, hand_bundle)
    blob = bytearray(out.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    bad = tmp_path / "bad.tar.xz"
    bad.write_bytes(bytes(blob))
    with pytest.raises(BundleError, match="corrupt packed bundle"):
        load_bundle(bad)
    trunc = tmp_path / "trunc.tar.xz"
    trunc.write_bytes(out.read_bytes()[:200])
    with pytest.raises(BundleError, match="corrupt packed bundle"):
        read_manifest(trunc)
    assert not list((tmp_path / "rt" / "bundles").glob(".tmp-*"))  # no half-unpacked folder left behind


def test_an_archive_whose_files_do_not_match_its_manifest_is_refused(tmp_path, hand_bundle):
    src = hand_bundle(tmp_path / "src", {"k1": b"one"})
    m = (src / "manifest.json").read_bytes()
    bad = tmp_path / "evil.tar.xz"
    with tarfile.open(bad, "w:xz") as tf:  # made by hand: the packer refuses to write such an archive
        for name, data in [("manifest.json", m), ("kernels/k1.so", b"swapped"),
                           ("lib/libcute_dsl_runtime.so.xz", b"runtime-xz")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="kernels/k1.so: sha256 does not match"):
        load_bundle(bad)
    outside = tmp_path / "escape.tar.xz"
    with tarfile.open(outside, "w:xz") as tf:
        info = tarfile.TarInfo("../escaped.so")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(BundleError, match="corrupt packed bundle"):
        load_bundle(outside)
    assert not (tmp_path / "rt" / "escaped.so").exists()


def test_pack_refuses_a_corrupt_source_and_a_wrong_name(tmp_path, hand_bundle):
    src = hand_bundle(tmp_path / "src", {"k1": b"one"})
    with pytest.raises(BundleError, match="ends in .tar.xz"):
        pack_bundle(src, tmp_path / "b.zip")
    (src / "kernels" / "k1.so").write_bytes(b"tampered")
    with pytest.raises(BundleError, match="sha256 does not match"):
        pack_bundle(src, tmp_path / "b.tar.xz")
    assert not (tmp_path / "b.tar.xz").exists() and not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(BundleError, match="not a bundle"):
        load_bundle(tmp_path / "src" / "manifest.json")


def test_merge_takes_packed_sources(tmp_path, hand_bundle):
    _, a = _packed(tmp_path, hand_bundle, {"k1": b"one"}, "a.tar.xz")
    b = hand_bundle(tmp_path / "b", {"k2": b"two"})
    m = merge_bundles(tmp_path / "out", [a, b])
    assert [e["name"] for e in m["variants"]] == ["k1", "k2"]
    for e in m["variants"]:
        assert sha256_file(tmp_path / "out" / e["file"]) == e["sha256"]


def test_cli_bundle_pack(tmp_path, hand_bundle):
    src = hand_bundle(tmp_path / "src", {"k1": b"one"})
    r = CliRunner().invoke(main, ["bundle-pack", str(src), "-o", str(tmp_path / "b.tar.xz")])
    assert r.exit_code == 0, r.output
    assert "1 variants" in r.output
    assert json.loads((unpacked_bundle(tmp_path / "b.tar.xz") / "manifest.json").read_text())["variants"][0]["name"] == "k1"
    (src / "lib" / "libcute_dsl_runtime.so.xz").write_bytes(b"x")
    r = CliRunner().invoke(main, ["bundle-pack", str(src), "-o", str(tmp_path / "c.tar.xz")])
    assert r.exit_code != 0 and "sha256 does not match" in r.output


def test_cli_bundle_merge_takes_a_packed_source(tmp_path, hand_bundle):
    _, a = _packed(tmp_path, hand_bundle, {"k1": b"one"}, "a.tar.xz")
    b = hand_bundle(tmp_path / "b", {"k2": b"two"})
    r = CliRunner().invoke(main, ["bundle-merge", str(a), str(b), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "out" / "kernels").iterdir()) == ["k1.so", "k2.so"]
