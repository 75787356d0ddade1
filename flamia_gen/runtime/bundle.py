"""Load a bundle made by `flamia-gen bundle` on a host without the DSL compiler.

Needs only torch, apache-tvm-ffi and the standard library. Every file is checked
against the manifest's sha256 before it is loaded; a mismatch is an error naming the
file, never a silent load.
"""

from __future__ import annotations

import ctypes
import json
import lzma
import os
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..build.cache import sha256_file  # standard library only, no DSL

SUPPORTED_FORMATS = (1,)


class BundleError(RuntimeError):
    pass


def read_manifest(bundle_dir: Path | str) -> dict:
    """The checked manifest of a bundle folder, or of a packed bundle (`*.tar.xz`, unpacked once: bundle_archive)."""
    from .bundle_archive import bundle_root  # late: bundle_archive imports this module

    d = bundle_root(bundle_dir)
    p = d / "manifest.json"
    if not p.exists():
        raise BundleError(f"{d}: no manifest.json (not a bundle, or a bundle that was never finished)")
    try:
        m = json.loads(p.read_text())
    except ValueError as e:
        raise BundleError(f"{p}: corrupt manifest ({e})") from None
    if m.get("format") not in SUPPORTED_FORMATS:
        raise BundleError(f"{p}: bundle format {m.get('format')!r} is not supported "
                          f"(this flamia-gen reads {SUPPORTED_FORMATS})")
    return m


def runtime_dir() -> Path:
    """Where bundles' runtimes (and packed bundles) are unpacked: $FLAMIA_GEN_RUNTIME_DIR, else the temp dir."""
    return Path(os.environ.get("FLAMIA_GEN_RUNTIME_DIR", Path(tempfile.gettempdir()) / "flamia-gen-runtime"))


def _unpack_runtime(d: Path, rt: dict) -> Path:
    """Unpack the xz once into a per-digest folder; verify the raw bytes too."""
    xz = d / rt["file"]
    if not xz.exists() or sha256_file(xz) != rt["sha256_xz"]:
        raise BundleError(f"{xz}: missing or its sha256 does not match the manifest")
    out = runtime_dir() / rt["sha256"][:16] / "libcute_dsl_runtime.so"
    if out.exists() and sha256_file(out) == rt["sha256"]:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f, lzma.open(xz, "rb") as src:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            f.write(chunk)
    os.replace(tmp, out)
    if sha256_file(out) != rt["sha256"]:
        out.unlink()
        raise BundleError(f"{xz}: unpacked runtime does not match the manifest's sha256")
    return out


@dataclass
class Bundle:
    root: Path
    manifest: dict
    _modules: dict = field(default_factory=dict)
    _runtime_loaded: bool = False

    @property
    def arch(self) -> str:
        return self.manifest["arch"]

    @cached_property
    def variants(self) -> dict[str, dict]:
        # built once: the runtime asks on every call
        return {v["name"]: v for v in self.manifest["variants"]}

    def for_use(self, route: str, operand: str, kind: str = "quant", **params) -> list[dict]:
        """Variants that serve `route.operand`, filtered by params (e.g. head_dim=128)."""
        tag = f"{route}.{operand}"
        out = []
        for v in self.manifest["variants"]:
            if v["kind"] == kind and tag in v["uses"] and all(v["params"].get(k) == x for k, x in params.items()):
                out.append(v)
        return out

    def _load_runtime(self) -> None:
        if self._runtime_loaded:
            return
        lib = _unpack_runtime(self.root, self.manifest["runtime"])
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # kernels resolve their runtime symbols here
        self._runtime_loaded = True

    def function(self, name: str):
        """The tvm-ffi function of a variant (loaded once)."""
        if name in self._modules:
            return self._modules[name]
        entry = self.variants.get(name)
        if entry is None:
            raise BundleError(f"variant {name!r} is not in bundle {self.root}; it has {len(self.variants)} "
                              f"variants, e.g. {sorted(self.variants)[:3]}")
        path = self.root / entry["file"]
        if not path.exists() or sha256_file(path) != entry["sha256"]:
            raise BundleError(f"{path}: missing or its sha256 does not match the manifest (corrupt bundle)")
        self._load_runtime()
        import tvm_ffi

        mod = tvm_ffi.load_module(str(path))
        fn = mod[name]
        self._modules[name] = (mod, fn)
        return self._modules[name]

    def get(self, name: str):
        return self.function(name)[1]


def load_bundle(bundle_dir: Path | str | None = None) -> Bundle:
    """`bundle_dir`, else `$FLAMIA_GEN_BUNDLE`: a bundle folder or a packed bundle (`flamia-gen bundle-pack`)."""
    d = bundle_dir or os.environ.get("FLAMIA_GEN_BUNDLE")
    if not d:
        raise BundleError("no bundle given: pass a folder or set FLAMIA_GEN_BUNDLE")
    from .bundle_archive import bundle_root

    root = bundle_root(d)  # a packed bundle's unpacked folder
    return Bundle(root, read_manifest(root))
