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

import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from .. import __version__
from ..plan import Variant
from ..render import rendered_literal, source_sha256
from .builder import BuildResult
from .cache import BuildCache, atomic_write, sha256_file
from .toolchain import dsl_runtime_lib, dsl_version, tvm_ffi_version

BUNDLE_FORMAT = 1
RUNTIME_NAME = "libcute_dsl_runtime.so"


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
    rendered = rendered_literal(source, "PARAMS")
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
            "args": rendered_literal(r.source, "ARGS"),
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


# manifest fields every merged bundle must share: the loader unpacks one runtime and calls every kernel the same way
_MERGE_SAME = ("format", "arch", "dsl_version", "tvm_ffi_version")


def merge_bundles(out_dir: Path, sources: list[Path]) -> dict:
    """One bundle holding the variants of several built by the same toolchain (format, arch, DSL, tvm-ffi and runtime
    equal): e.g. an A/B build and the table's kernels carried to the GPU host in one folder. Every kernel file is
    checked against its own manifest's sha256 before it is copied; a variant in two sources must be the same file
    (the same sha256), else the merge fails naming it. The manifest is written last, atomically, as write_bundle's."""
    from ..runtime.bundle import BundleError, read_manifest
    from ..runtime.bundle_archive import bundle_root

    if not sources:
        raise BundleError("merge: no source bundles given")
    out_dir = Path(out_dir)
    srcs = [bundle_root(s) for s in sources]  # packed sources merge from their unpacked folders
    if any(s.resolve() == out_dir.resolve() for s in srcs):
        raise BundleError(f"merge: the output {out_dir} is one of the sources; write to a new folder")
    manifests = [read_manifest(s) for s in srcs]
    first = manifests[0]
    for s, m in zip(srcs[1:], manifests[1:]):
        for key in _MERGE_SAME:
            if m.get(key) != first.get(key):
                raise BundleError(f"merge: {s} has {key} {m.get(key)!r}, {srcs[0]} has {first.get(key)!r}; "
                                  "rebuild one of them with the other's toolchain")
        if m["runtime"]["sha256"] != first["runtime"]["sha256"]:
            raise BundleError(f"merge: {s} carries another DSL runtime (sha256 {m['runtime']['sha256'][:16]}…) than "
                              f"{srcs[0]} ({first['runtime']['sha256'][:16]}…)")
    entries: dict[str, tuple[dict, Path]] = {}
    for s, m in zip(srcs, manifests):
        for e in m["variants"]:
            path = s / e["file"]
            if not path.exists() or sha256_file(path) != e["sha256"]:
                raise BundleError(f"merge: {path}: missing or its sha256 does not match {s}'s manifest (corrupt bundle)")
            if e["name"] in entries:
                if entries[e["name"]][0]["sha256"] != e["sha256"]:
                    raise BundleError(f"merge: variant {e['name']!r} is in {entries[e['name']][1]} and {s} with "
                                      "different kernels (built from different sources); keep one")
                continue
            entries[e["name"]] = (e, s)
    rt_src = srcs[0] / first["runtime"]["file"]
    if not rt_src.exists() or sha256_file(rt_src) != first["runtime"]["sha256_xz"]:
        raise BundleError(f"merge: {rt_src}: missing or its sha256 does not match the manifest")
    (out_dir / "kernels").mkdir(parents=True, exist_ok=True)
    (out_dir / "lib").mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    manifest_path.unlink(missing_ok=True)
    for e, s in entries.values():
        shutil.copyfile(s / e["file"], out_dir / e["file"])
    shutil.copyfile(rt_src, out_dir / first["runtime"]["file"])
    keep = {e["file"] for e, _ in entries.values()}
    for f in (out_dir / "kernels").glob("*.so"):
        if f"kernels/{f.name}" not in keep:
            f.unlink()
    manifest = {**{k: first[k] for k in first if k != "variants"},
                "variants": sorted((e for e, _ in entries.values()), key=lambda e: e["name"])}
    atomic_write(manifest_path, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest
