"""Just-in-time kernels on a host that has the DSL compiler and no bundle: build the
variants a route needs (cached, content-addressed) and pack them into a bundle under the
build cache, then load it like any other bundle. The first call of a route pays the
compile (seconds per variant); later calls and processes hit the cache."""

from __future__ import annotations

import hashlib


def jit_bundle(route: str, arch: str = "sm90", jobs: int = 2):
    from ..build.builder import build_all
    from ..build.bundle import write_bundle
    from ..build.cache import BuildCache
    from ..build.toolchain import dsl_available
    from ..plan import make_plan
    from ..render import render_variant
    from ..spec import KernelKind, load_specs
    from .bundle import load_bundle

    if not dsl_available():
        raise RuntimeError("no bundle given (FLAMIA_GEN_BUNDLE) and nvidia-cutlass-dsl is not installed: "
                           "build one elsewhere with `flamia-gen bundle --arch sm90` and point FLAMIA_GEN_BUNDLE at it")
    variants = make_plan(load_specs(), arch=arch, routes=[route],
                         kinds=[KernelKind.quant, KernelKind.attn_fwd]).variants
    digest = hashlib.sha256("".join(render_variant(v) for v in variants).encode()).hexdigest()[:16]
    cache = BuildCache()
    out = cache.root / "jit-bundles" / f"{arch}-{route}-{digest}"
    try:
        return load_bundle(out)  # reads and checks the manifest
    except Exception:
        pass  # none yet, or unreadable: build it
    results = build_all(variants, jobs=jobs, cache=cache)
    failed = [r.name for r in results if r.status == "failed"]
    if failed:
        raise RuntimeError(f"JIT build of route {route!r} failed for {failed[:3]} (see `flamia-gen build --arch {arch}`)")
    write_bundle(out, arch, variants, results, cache)
    return load_bundle(out)
