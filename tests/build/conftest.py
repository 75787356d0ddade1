"""Hand-made bundles (files and manifests with real sha256s) for the bundle tests: no compiler needed."""

import json
from pathlib import Path

import pytest

from flamia_gen.build.cache import sha256_file


def _hand_bundle(root: Path, kernels: dict[str, bytes], runtime: bytes = b"runtime-xz", **over) -> Path:
    (root / "kernels").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "libcute_dsl_runtime.so.xz").write_bytes(runtime)
    entries = []
    for name, blob in kernels.items():
        (root / "kernels" / f"{name}.so").write_bytes(blob)
        entries.append(dict(name=name, file=f"kernels/{name}.so", sha256=sha256_file(root / "kernels" / f"{name}.so"),
                            kind="attn_bwd", params={"tile_m": 64}))
    m = dict(format=1, arch="sm90", dsl_version="4.8.1", tvm_ffi_version="0.1.15.post2", flamia_gen_version="0.1.0",
             executed_here=True, variants=entries,
             runtime=dict(file="lib/libcute_dsl_runtime.so.xz", sha256="ab" * 32,
                          sha256_xz=sha256_file(root / "lib" / "libcute_dsl_runtime.so.xz")))
    m.update(over)
    (root / "manifest.json").write_text(json.dumps(m))
    return root


@pytest.fixture
def hand_bundle():
    """hand_bundle(root, {name: kernel bytes}, runtime=b"…", **manifest overrides) → root"""
    return _hand_bundle
