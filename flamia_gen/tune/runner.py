"""Runners: what measures one variant on one workload.

    runner.measure(variant_name, workload) -> Measurement(ok, reason, median_ms, ...)
    runner.info() -> {"gpu", "torch", "cuda_driver", "dsl", "device", "runner"}

`ok=False` means the variant must never win: it failed verification, is missing from
the bundle, or crashed; `reason` says which, in one line.

- `FakeRunner`: deterministic synthetic times (a hash of variant and workload), a set of
  variants that "fail verification", an optional measurement log. No GPU, no torch: the
  study plumbing is tested with it.
- `BundleRunner`: kernels from a bundle (`flamia-gen bundle`, loaded with
  `flamia_gen.runtime.bundle.load_bundle`), verified and timed on the local GPU by a
  kind-specific hook (`flamia_gen.tune.gpu.KIND_HOOKS`: the quantizer today). All CUDA
  code lives in `flamia_gen.tune.gpu` and is imported when a BundleRunner is made, so
  this module imports on a CPU-only host.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..bench.timing import percentile  # re-exported (__all__): one percentile rule for bench and tune
from ..bench.timing import summarize as _summarize
from .space import Workload


@dataclass
class Measurement:
    ok: bool
    reason: str = ""
    median_ms: float | None = None
    min_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    repeats: int = 0
    extra: dict = field(default_factory=dict)

    def attrs(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        d.update({f"x_{k}": v for k, v in self.extra.items()})
        return d


def summarize(samples_ms: list[float]) -> Measurement:
    """The statistics of `flamia_gen.bench.timing.summarize` (median, min, p20, p80) as a Measurement."""
    if not samples_ms:
        return Measurement(False, "no timing samples")
    s = _summarize(samples_ms, warmup=0, timer="cuda-events")
    return Measurement(True, "", median_ms=s.median_ms, min_ms=s.min_ms, p20_ms=s.p20_ms, p80_ms=s.p80_ms,
                       repeats=s.repeats)


@runtime_checkable
class Runner(Protocol):
    def measure(self, variant: str, workload: Workload) -> Measurement: ...

    def info(self) -> dict: ...


class FakeRunner:
    """Deterministic stand-in for a GPU: `median_ms` = work × (1 + a hash of variant,
    workload and seed in [0, 1)). Variants matching a pattern of `fail` fail verification.
    `log` (a file) gets one line per measurement (`pid\\tvariant\\tworkload`), appended
    atomically, so tests can count measurements across processes."""

    def __init__(self, gpu: str = "Fake GPU", *, fail=(), delay_s: float = 0.0, log: str | Path | None = None,
                 seed: int = 0, crash=(), sources: dict | None = None):
        self.sources = dict(sources or {})  # variant → sha256 of the source "timed" (as a bundle entry records it)
        self.gpu = gpu
        self.fail = tuple(fail)
        self.crash = tuple(crash)
        self.delay_s = float(delay_s)
        self.log = Path(log) if log else None
        self.seed = int(seed)

    def info(self) -> dict:
        return {"gpu": self.gpu, "torch": None, "cuda_driver": None, "dsl": None, "device": "fake", "runner": "fake"}

    def time_ms(self, variant: str, workload: Workload) -> float:
        h = hashlib.sha256(f"{self.seed}|{variant}|{workload.label}|{workload.heads}".encode()).digest()
        frac = int.from_bytes(h[:8], "big") / 2.0 ** 64
        work = workload.tokens * workload.heads * 1e-6
        return round((0.01 + work) * (1.0 + frac), 9)

    def measure(self, variant: str, workload: Workload) -> Measurement:
        if self.log:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{os.getpid()}\t{variant}\t{workload.label}\n".encode())
            finally:
                os.close(fd)
        if self.delay_s:
            time.sleep(self.delay_s)
        if any(fnmatch.fnmatchcase(variant, p) for p in self.crash):
            raise RuntimeError(f"fake crash in {variant}")
        if any(fnmatch.fnmatchcase(variant, p) for p in self.fail):
            return Measurement(False, "verification failed: codes differ from the emulator (fake runner)")
        t = self.time_ms(variant, workload)
        m = Measurement(True, "", median_ms=t, min_ms=t * 0.98, p20_ms=t * 0.99, p80_ms=t * 1.01, repeats=20)
        if variant in self.sources:
            m.extra = {"source_sha256": self.sources[variant]}
        return m


class BundleRunner:
    """Kernels from a bundle, verified then timed on the local GPU (device 0 of what
    `CUDA_VISIBLE_DEVICES` shows: the worker launcher pins one GPU per worker)."""

    def __init__(self, bundle_dir: str | Path, *, device: int = 0, warmup: int = 5, repeats: int = 30,
                 hooks: dict | None = None, verify: bool = True, missing: dict | None = None):
        from ..runtime.bundle import load_bundle
        from . import gpu

        if repeats < 20:
            raise ValueError(f"repeats={repeats}: DESIGN §5 asks for a median of ≥ 20")
        self.bundle = load_bundle(bundle_dir)
        self.device = int(device)
        self.warmup, self.repeats, self.verify = int(warmup), int(repeats), bool(verify)
        self.hooks = hooks if hooks is not None else gpu.default_hooks()
        self._gpu = gpu
        self._verified: dict[str, tuple[bool, str]] = {}
        self._info: dict | None = None
        self.missing = dict(missing or {})  # variant → why it is not in the bundle (build failure)

    def info(self) -> dict:
        if self._info is None:
            d = self._gpu.gpu_info(self.device)
            d.update(dsl=self.bundle.manifest.get("dsl_version"), runner="bundle", bundle=str(self.bundle.root))
            self._info = d
        return self._info

    def measure(self, variant: str, workload: Workload) -> Measurement:
        entry = self.bundle.variants.get(variant)
        if entry is None and variant in self.missing:
            return Measurement(False, f"build failed: {self.missing[variant]}"[:300])
        if entry is None:
            return Measurement(False, f"not in bundle {self.bundle.root} (build failed or not bundled)")
        hook = self.hooks.get(entry["kind"])
        if hook is None:
            return Measurement(False, f"no timing hook for kind {entry['kind']!r} yet")
        if self.verify:
            if variant not in self._verified:
                self._verified[variant] = hook.verify(self.bundle, entry, self.device)
            ok, why = self._verified[variant]
            if not ok:
                return Measurement(False, f"verification failed: {why}")
        samples = hook.time(self.bundle, entry, workload, self.device, warmup=self.warmup, repeats=self.repeats)
        m = summarize(samples)
        m.extra = {"timer": "cuda-events", "warmup": self.warmup}
        if entry.get("source_sha256"):
            # which build of the kernel was timed: the table then says when the installed templates render another
            m.extra["source_sha256"] = entry["source_sha256"]
        return m


def make_runner(config: dict[str, Any]) -> Runner:
    """A runner from a JSON-able config (what travels to worker processes):
    `{"type": "fake", "gpu": ..., "fail": [...], "delay_s": ..., "log": ...}` or
    `{"type": "bundle", "bundle": DIR, "device": 0, "repeats": 30, "warmup": 5}`."""
    cfg = dict(config)
    kind = cfg.pop("type", None)
    if kind == "fake":
        return FakeRunner(**cfg)
    if kind == "bundle":
        return BundleRunner(cfg.pop("bundle"), **cfg)
    raise ValueError(f"unknown runner type {kind!r}; allowed values: ['bundle', 'fake']")


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


__all__ = ["Measurement", "Runner", "FakeRunner", "BundleRunner", "make_runner", "summarize", "percentile",
           "worker_id"]
