"""Build variants for a target arch: render → compile (fresh process each) → link `.so`
→ cache. `--jobs N` runs N compiles at once; a variant that fails is reported with its
name and the compiler's message, and the build goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..plan import Variant
from ..render import render_variant
from .cache import BuildCache, cache_key
from .toolchain import dsl_runtime_lib, linker, tvm_ffi_lib

COMPILE_TIMEOUT_S = 600


@dataclass
class BuildResult:
    name: str
    arch: str
    status: str  # "built" | "cached" | "failed"
    seconds: float = 0.0
    so: Path | None = None
    message: str = ""
    key: str = ""
    uses: tuple = field(default_factory=tuple)
    source: str = field(default="", repr=False)  # the rendered text compiled (the bundle reads it)


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:400]
    return (lines[-1] if lines else "no output")[:400]


def link_shared(obj: Path, out: Path) -> None:
    rt, ffi = dsl_runtime_lib(), tvm_ffi_lib()
    cmd = [linker(), "-shared", "-o", str(out), str(obj), f"-L{rt.parent}", "-lcute_dsl_runtime",
           f"-L{ffi.parent}", "-ltvm_ffi", "-Wl,-rpath,$ORIGIN"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"link failed: {_last_error_line(r.stderr or r.stdout)}")


def build_variant(variant: Variant, cache: BuildCache, *, source: str | None = None,
                  force: bool = False) -> BuildResult:
    arch = variant.arch.cute_arch
    source = source if source is not None else render_variant(variant)
    key = cache_key(source, arch)
    res = BuildResult(variant.name, variant.arch.value, "failed", key=key, uses=variant.uses, source=source)
    if not force:
        hit, _ = cache.lookup(variant.name, arch, key)
        if hit:
            res.status, res.so = "cached", hit.so
            return res
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"flamia-{variant.name}-") as tmp:
        src = Path(tmp) / f"{variant.name}.py"
        src.write_text(source)
        obj, so = Path(tmp) / f"{variant.name}.o", Path(tmp) / f"{variant.name}.so"
        env = dict(os.environ, CUTE_DSL_ARCH=arch)
        try:
            r = subprocess.run([sys.executable, "-m", "flamia_gen.build.worker", str(src), arch, str(obj),
                                variant.name], capture_output=True, text=True, env=env,
                               timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            res.message, res.seconds = f"compile timed out after {COMPILE_TIMEOUT_S}s", time.perf_counter() - t0
            return res
        if r.returncode != 0 or not obj.exists():
            res.message = _last_error_line(r.stderr + "\n" + r.stdout)
            res.seconds = time.perf_counter() - t0
            return res
        try:
            link_shared(obj, so)
        except RuntimeError as e:
            res.message, res.seconds = str(e), time.perf_counter() - t0
            return res
        entry = cache.store(variant.name, arch, key, so, {"uses": list(variant.uses),
                                                          "spec_hash": variant.spec_hash,
                                                          "family": variant.family})
    res.status, res.so, res.seconds = "built", entry.so, time.perf_counter() - t0
    return res


def build_all(variants: list[Variant], *, jobs: int = 1, cache: BuildCache | None = None, force: bool = False,
              use_generated: bool = True,
              progress: Callable[[BuildResult], None] | None = None) -> list[BuildResult]:
    """Build every variant; results in the input order. What is compiled is the variant
    rendered from its template: byte for byte the committed `generated/` file, which a test
    keeps fresh (`flamia-gen render --check`). `use_generated` has no effect; it is kept
    for callers that still pass it."""
    cache = cache or BuildCache()

    def one(v: Variant) -> BuildResult:
        source = render_variant(v)  # outside the try: a template error stops the build
        try:
            r = build_variant(v, cache, source=source, force=force)
        except Exception as e:  # a variant never stops the build
            r = BuildResult(v.name, v.arch.value, "failed", message=f"{type(e).__name__}: {e}", uses=v.uses)
        if progress:
            progress(r)
        return r

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, variants))
