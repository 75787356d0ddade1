"""`flamia-gen bundle`: a self-contained folder of ahead-of-time kernels for GPU hosts
that have torch and apache-tvm-ffi but not the DSL compiler.

    DIR/manifest.json              variants, spec hashes, arch, versions, sha256 of every file
    DIR/kernels/<name>.so          one tvm-ffi module per variant
    DIR/lib/libcute_dsl_runtime.so.xz   the DSL runtime the kernels link against (xz: it
                                   is 43 MB raw, 14 MB packed; the loader unpacks it once)

Nothing else goes in: the loader (`flamia_gen.runtime.bundle`) trusts a file only when
its sha256 matches the manifest.
"""

from __future__ import annotations

import ast
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from .. import __version__
from ..plan import Variant
from ..render import source_sha256
from .builder import BuildResult
from .cache import BuildCache, atomic_write, sha256_file
from .toolchain import dsl_runtime_lib, dsl_version, tvm_ffi_version

BUNDLE_FORMAT = 1
RUNTIME_NAME = "libcute_dsl_runtime.so"


def _module_literal(source: str, name: str):
    """Read a literal assignment (`ARGS = [...]`) from a generated source without
    importing it (importing needs the DSL)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def packed_runtime(cache: BuildCache) -> tuple[Path, str]:
    """(the xz of the DSL runtime, the raw runtime's sha256): packed once per runtime build
    and kept in the cache."""
    lib = dsl_runtime_lib()
    digest = sha256_file(lib)
    out = cache.root / "runtime" / f"{RUNTIME_NAME}.{digest[:16]}.xz"
    if out.exists():
        return out, digest
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f, open(lib, "rb") as src:
        comp = lzma.LZMACompressor(preset=6)
        for chunk in iter(lambda: src.read(1 << 20), b""):
            f.write(comp.compress(chunk))
        f.write(comp.flush())
    os.replace(tmp, out)
    return out, digest


# PARAMS keys that name the variant rather than describe its kernel (the manifest entry has them already)
_IDENTITY_PARAMS = frozenset({"name", "arch", "cute_arch", "kind", "route", "spec_hash", "flamia_version"})


def kernel_params(v: Variant, source: str) -> dict:
    """A manifest entry's params: the plan's, plus what the compiled module's PARAMS add — the template's defaults
    (flags such as k_row_perm, bwd_q_row_perm, bwd_head_section) that the runtime reads to call the kernel as it was
    built. The plan's values win; the two never disagree on a key both have (tests/build/test_build_bundle.py)."""
    rendered = _module_literal(source, "PARAMS")
    return {**{k: x for k, x in rendered.items() if k not in _IDENTITY_PARAMS}, **dict(v.params)}


def write_bundle(out_dir: Path, arch: str, variants: list[Variant], results: list[BuildResult],
                 cache: BuildCache) -> dict:
    """Copy the built variants and the packed runtime into `out_dir`; write the manifest
    last, atomically, so a half-written bundle has no manifest and is refused."""
    out_dir = Path(out_dir)
    (out_dir / "kernels").mkdir(parents=True, exist_ok=True)
    (out_dir / "lib").mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    manifest_path.unlink(missing_ok=True)
    by_name = {v.name: v for v in variants}
    entries = []
    for r in results:
        if r.status == "failed" or r.so is None:
            continue
        v = by_name[r.name]
        dst = out_dir / "kernels" / f"{v.name}.so"
        shutil.copyfile(r.so, dst)
        entries.append({
            "name": v.name,
            "file": f"kernels/{v.name}.so",
            "sha256": sha256_file(dst),
            "kind": v.kind.value,
            "family": v.family,
            "spec_hash": v.spec_hash,
            "source_sha256": source_sha256(r.source),  # what was compiled
            "uses": list(v.uses),
            "params": kernel_params(v, r.source),
            "args": _module_literal(r.source, "ARGS"),
        })
    rt_xz, rt_sha256 = packed_runtime(cache)
    shutil.copyfile(rt_xz, out_dir / "lib" / f"{RUNTIME_NAME}.xz")
    keep = {e["file"] for e in entries}
    for f in (out_dir / "kernels").glob("*.so"):
        if f"kernels/{f.name}" not in keep:
            f.unlink()  # a bundle holds what its manifest lists and nothing else
    manifest = {
        "format": BUNDLE_FORMAT,
        "flamia_gen_version": __version__,
        "arch": arch,
        "dsl_version": dsl_version(),
        "tvm_ffi_version": tvm_ffi_version(),
        "executed_here": arch == "sm90",
        "runtime": {"file": f"lib/{RUNTIME_NAME}.xz", "sha256_xz": sha256_file(out_dir / "lib" / f"{RUNTIME_NAME}.xz"),
                    "sha256": rt_sha256},
        "variants": sorted(entries, key=lambda e: e["name"]),
    }
    atomic_write(manifest_path, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest
