"""Dispatch tables: `tuning_db/<arch>-<gpu>.json` (docs/tuning.md has the format).

    {
      "_metadata": {"format": 1, "flamia_gen": "0.1.0", "dsl": "4.8.1", "torch": "2.9.0",
                    "cuda_driver": "12.8", "gpu": "NVIDIA H200", "arch": "sm90",
                    "untuned": false, "status": "...", "spec_hashes": {"routes": {...}, "families": {...}},
                    "bucket_fields": {"quant": ["tokens"], ...}, "frozen_at": "..."},
      "entries": {"quant/e4m3_tb32_ceil/d128/tokens=65536": {
                    "group": "quant/e4m3_tb32_ceil/d128", "kind": "quant", "route": "e4m3_tb32_ceil",
                    "head_dim": 128, "causal": null, "bucket": {"tokens": 65536},
                    "winner": {"variant": "...", "median_ms": 0.051},
                    "runner_up": {"variant": "...", "median_ms": 0.055},
                    "trials": 3, "pruned": {"variant": "reason"}, "workload": "8x8192", "heads": 16,
                    "study": "..."}},
      "defaults": {"quant/e4m3_tb32_ceil/d128": "quant_sm90_e4m3_tb32_ceil_d128_t32_h1", ...}
    }

Provenance rules (FlashInfer style): a table whose header does not match the installed
specs (spec hashes), the arch or the GPU is *stale* and ignored whole, never trusted; a
corrupt file likewise. Writes are atomic (temp file in the same folder + `os.replace`),
so a crash mid-write leaves the old table intact.

Lookup: exact bucket → nearest tuned bucket of the same group (log2 distance, ties to
the larger) → the group's analytic default (`flamia_gen.dispatch.defaults`).

No torch, no optuna: the runtime imports this.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import __version__
from .buckets import BUCKET_FIELDS, LENGTHS, DocProfile, bucket_label, bucket_of, fields_of, nearest_bucket
from .defaults import group_key

TABLE_FORMAT = 1
UNTUNED_STATUS = ("untuned: analytic defaults of the plan (first feasible variant in spec order); "
                  "compiled, not executed (no GPU of this arch available)")
META_KEYS = ("format", "flamia_gen", "dsl", "torch", "cuda_driver", "gpu", "arch", "untuned", "spec_hashes")


class TableError(ValueError):
    """A table that cannot be trusted; `str()` is one line saying why."""


# ---------------------------------------------------------------- names and places
def gpu_slug(name: str | None) -> str:
    """`NVIDIA H200` → `h200`; `NVIDIA H100 80GB HBM3` → `h100-80gb-hbm3`."""
    if not name:
        return "untuned"
    s = name.strip().lower()
    s = re.sub(r"^nvidia\s+", "", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "unknown"


def table_filename(arch: str, gpu: str | None) -> str:
    return f"{arch}-{gpu_slug(gpu)}.json"


def tuning_db_dir() -> Path:
    """`$FLAMIA_GEN_TUNING_DB`, else the repository's `tuning_db/`."""
    env = os.environ.get("FLAMIA_GEN_TUNING_DB")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "tuning_db"


def table_path(arch: str, gpu: str | None = None, root: Path | None = None) -> Path:
    """The table for this arch and GPU; the arch's untuned table when there is none."""
    root = Path(root) if root else tuning_db_dir()
    p = root / table_filename(arch, gpu)
    if gpu and not p.exists():
        return root / table_filename(arch, None)
    return p


# ---------------------------------------------------------------- metadata
def installed_expectation(arch: str, gpu: str | None = None, specs=None, plan=None) -> dict:
    """What a table must match on this machine: arch, GPU (None: not checked) and the
    spec hashes of the installed specs."""
    from ..plan import make_plan
    from ..spec import load_specs
    from .defaults import spec_hashes

    specs = specs or load_specs()
    plan = plan or make_plan(specs, arch=arch)
    return {"arch": arch, "gpu": gpu, "spec_hashes": spec_hashes(specs, plan, arch)}


def make_metadata(arch: str, *, gpu: str | None, spec_hashes: dict, untuned: bool, dsl: str | None = None,
                  torch: str | None = None, cuda_driver: str | None = None, status: str | None = None,
                  extra: dict | None = None) -> dict:
    meta = {
        "format": TABLE_FORMAT,
        "flamia_gen": __version__,
        "dsl": dsl,
        "torch": torch,
        "cuda_driver": cuda_driver,
        "gpu": gpu,
        "arch": arch,
        "untuned": bool(untuned),
        "status": status or (UNTUNED_STATUS if untuned else f"tuned on {gpu}"),
        "spec_hashes": spec_hashes,
        "bucket_fields": {k: list(v) for k, v in BUCKET_FIELDS.items()},
        "frozen_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    meta.update(extra or {})
    return meta


def untuned_table(arch: str, specs=None, plan=None) -> dict:
    """A table with no measured entry: every group answers its analytic default. Shipped
    for arches we cannot execute (sm100: compiled, not executed)."""
    from ..build.toolchain import dsl_version
    from ..plan import make_plan
    from ..spec import load_specs
    from .defaults import default_variants, spec_hashes

    specs = specs or load_specs()
    plan = plan or make_plan(specs, arch=arch)
    meta = make_metadata(arch, gpu=None, spec_hashes=spec_hashes(specs, plan, arch), untuned=True,
                         dsl=dsl_version())
    meta.pop("frozen_at")  # nothing was measured: keep the file reproducible byte for byte
    return {"_metadata": meta, "entries": {}, "defaults": default_variants(plan, specs)}


# ---------------------------------------------------------------- write / read
def dumps_table(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def write_table(path: Path | str, table: dict) -> Path:
    """Atomic: validate, write a temp file in the same folder, fsync, `os.replace`. A crash
    at any point leaves the previous file as it was (and no temp file behind)."""
    path = Path(path)
    problem = validate_structure(table)
    if problem:
        raise TableError(f"refusing to write an invalid table to {path}: {problem}")
    text = dumps_table(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _is_pow2_len(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x in LENGTHS


def validate_structure(table: Any) -> str | None:
    """None when `table` has the shape of a dispatch table, else one line saying what is wrong."""
    if not isinstance(table, dict):
        return "top level is not a JSON object"
    meta = table.get("_metadata")
    if not isinstance(meta, dict):
        return "no '_metadata' header"
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        return f"'_metadata' lacks {missing}"
    if meta["format"] != TABLE_FORMAT:
        return f"table format {meta['format']!r}, this flamia-gen reads format {TABLE_FORMAT}"
    sh = meta["spec_hashes"]
    if not (isinstance(sh, dict) and isinstance(sh.get("routes"), dict) and isinstance(sh.get("families"), dict)):
        return "'_metadata.spec_hashes' must hold 'routes' and 'families' objects"
    entries, defaults = table.get("entries"), table.get("defaults")
    if not isinstance(entries, dict):
        return "no 'entries' object"
    if not isinstance(defaults, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in defaults.items()):
        return "'defaults' must map group keys to variant names"
    for key, e in entries.items():
        if not isinstance(e, dict):
            return f"entry {key!r} is not an object"
        for f in ("group", "kind", "route", "head_dim", "bucket", "winner", "trials"):
            if f not in e:
                return f"entry {key!r} lacks {f!r}"
        if e["kind"] not in BUCKET_FIELDS:
            return f"entry {key!r}: unknown kind {e['kind']!r}"
        b = e["bucket"]
        if (not isinstance(b, dict) or set(b) != set(BUCKET_FIELDS[e["kind"]])
                or not all(map(_is_pow2_len, b.values()))):
            return (f"entry {key!r}: bucket {b!r} must have the fields {list(BUCKET_FIELDS[e['kind']])} "
                    f"with powers of two from 1 to {LENGTHS[-1]}")
        try:
            g = group_key(e["kind"], e["route"], e["head_dim"], e.get("causal"))
        except (TypeError, ValueError) as err:
            return f"entry {key!r}: {err}"
        if g != e["group"] or key != f"{g}/{bucket_label(b)}":
            return f"entry {key!r}: key does not match its group and bucket ({g}/{bucket_label(b)})"
        w = e["winner"]
        if not (isinstance(w, dict) and isinstance(w.get("variant"), str)
                and isinstance(w.get("median_ms"), (int, float)) and w["median_ms"] > 0):
            return f"entry {key!r}: winner needs a variant name and a positive median_ms"
        if w["variant"] in (e.get("pruned") or {}):
            return f"entry {key!r}: winner {w['variant']!r} failed verification"
    return None


def installed_source_sha256(arch: str, names, plan=None) -> dict[str, str]:
    """sha256 of each named variant's source as the installed templates render it (what a bundle built now
    records as `source_sha256`); names the plan does not have are left out."""
    from ..render import render_variant, source_sha256

    if plan is None:
        plan = _installed_plan(arch)[1]
    want = set(names)
    return {v.name: source_sha256(render_variant(v)) for v in plan.variants if v.name in want}


def stale_builds(table: dict, arch: str | None = None, plan=None) -> list[tuple[str, str]]:
    """(entry key, winner) of the entries whose winner was timed on a build of the kernel that the installed
    templates no longer render (a template change since tuning: the spec hashes stay, so the table is still
    used, but its times, and perhaps its choice, describe another kernel: re-tune those groups). Entries frozen
    before builds were recorded (no `source_sha256`) are not judged."""
    arch = arch or table["_metadata"]["arch"]
    timed = {k: e["winner"] for k, e in table["entries"].items() if e["winner"].get("source_sha256")}
    if not timed:
        return []
    now = installed_source_sha256(arch, {w["variant"] for w in timed.values()}, plan=plan)
    return sorted((k, w["variant"]) for k, w in timed.items()
                  if w["variant"] in now and now[w["variant"]] != w["source_sha256"])


def check_against(table: dict, expected: dict | None) -> str | None:
    """None when the table matches `expected` (see `installed_expectation`), else why it
    is stale."""
    if not expected:
        return None
    meta = table["_metadata"]
    if expected.get("arch") and meta["arch"] != expected["arch"]:
        return f"made for arch {meta['arch']!r}, this is {expected['arch']!r}"
    gpu = expected.get("gpu")
    if gpu:
        if meta["gpu"] is None:
            if not meta["untuned"]:
                return "tuned table without a GPU name"
        elif gpu_slug(meta["gpu"]) != gpu_slug(gpu):
            return f"tuned on {meta['gpu']!r}, this GPU is {gpu!r}"
    want = expected.get("spec_hashes")
    if want:
        have = meta["spec_hashes"]
        for part, noun in (("families", "family"), ("routes", "route")):
            a, b = have.get(part, {}), want.get(part, {})
            diff = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            if diff:
                n = diff[0]
                more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
                what = ("not in the table" if n not in a else "no longer installed" if n not in b
                        else f"table {a[n]}, installed {b[n]}")
                return f"spec hash of {noun} {n!r} differs: {what}{more}"
    return None


def load_table(path: Path | str, expected: dict | None = None) -> tuple[dict | None, str | None]:
    """(table, None) when the file is a valid table matching `expected`, else
    (None, reason): missing, corrupt JSON, bad structure, other format, other arch or GPU,
    other specs. A refused table is never partly used."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, f"{path}: no such table"
    except OSError as e:
        return None, f"{path}: unreadable ({e.strerror or e})"
    try:
        table = json.loads(text)
    except ValueError as e:
        return None, f"{path}: corrupt JSON ({e}); ignored"
    problem = validate_structure(table)
    if problem:
        return None, f"{path}: not a valid dispatch table: {problem}; ignored"
    stale = check_against(table, expected)
    if stale:
        return None, (f"{path}: stale: {stale}; ignored (re-tune: flamia-gen tune --arch {table['_metadata']['arch']}"
                      f" && flamia-gen freeze --arch {table['_metadata']['arch']})")
    return table, None


# ---------------------------------------------------------------- lookup
@dataclass(frozen=True)
class Decision:
    variant: str
    source: str  # "exact" | "nearest" | "default"
    group: str
    bucket: dict
    entry: str | None = None  # the table entry used, if any


@lru_cache(maxsize=8)
def _installed_plan(arch: str):
    from ..plan import make_plan
    from ..spec import load_specs

    specs = load_specs()
    return specs, make_plan(specs, arch=arch)


@lru_cache(maxsize=8)
def _installed_defaults(arch: str) -> dict[str, str]:
    from .defaults import default_variants

    specs, plan = _installed_plan(arch)
    return default_variants(plan, specs)


def decide(table: dict | None, arch: str, kind: str, route: str, head_dim: int, causal: bool | None = None,
           cu_seqlens=None, *, profile: DocProfile | None = None, defaults: dict[str, str] | None = None,
           nearest: bool = True) -> Decision:
    """Which variant serves this call, and why. `table` is a loaded (trusted) table or
    None (missing or stale: the analytic defaults answer). Give the row as `cu_seqlens`
    (list or tensor; a device tensor costs a host sync) or as a precomputed `profile`."""
    kind = str(getattr(kind, "value", kind))
    arch = str(getattr(arch, "value", arch))
    fields_of(kind)
    if table is not None and table["_metadata"]["arch"] != arch:
        raise TableError(f"table is for arch {table['_metadata']['arch']!r}, lookup asked for {arch!r}")
    g = group_key(kind, route, head_dim, None if kind == "quant" else causal)
    if profile is None:
        if cu_seqlens is None:
            raise ValueError("give cu_seqlens or a DocProfile")
        profile = DocProfile.from_cu_seqlens(cu_seqlens)
    b = bucket_of(kind, profile)
    if table is not None:
        key = f"{g}/{bucket_label(b)}"
        e = table["entries"].get(key)
        if e is not None:
            return Decision(e["winner"]["variant"], "exact", g, b, key)
        if nearest:
            same = [x for x in table["entries"].values() if x["group"] == g]
            nb = nearest_bucket(b, [x["bucket"] for x in same])
            if nb is not None:
                key = f"{g}/{bucket_label(nb)}"
                return Decision(table["entries"][key]["winner"]["variant"], "nearest", g, b, key)
    if defaults is None:
        defaults = table["defaults"] if table is not None and g in table["defaults"] else _installed_defaults(arch)
    if g not in defaults:
        raise KeyError(f"no variant for group {g!r} on {arch}; known groups: {sorted(defaults)[:6]}…")
    return Decision(defaults[g], "default", g, b)


def lookup(table: dict | None, arch: str, kind: str, route: str, head_dim: int, causal: bool | None = None,
           cu_seqlens=None, **kw) -> str:
    """The variant name for this call (see `decide`)."""
    return decide(table, arch, kind, route, head_dim, causal, cu_seqlens, **kw).variant


class Dispatcher:
    """The runtime's handle: the installed table for (arch, GPU) if it is valid, else the
    analytic defaults, with the reason kept in `.refused`."""

    def __init__(self, arch: str, gpu: str | None = None, path: Path | str | None = None, expected: dict | None = None):
        self.arch = arch
        self.path = Path(path) if path else table_path(arch, gpu)
        if expected is None:  # the cached installed specs and plan: loaded once, not once more here
            specs, plan = _installed_plan(arch)
            expected = installed_expectation(arch, gpu, specs=specs, plan=plan)
        self.table, self.refused = load_table(self.path, expected)
        if self.refused:
            import warnings

            warnings.warn(f"flamia-gen dispatch: {self.refused}", RuntimeWarning, stacklevel=2)
        self.defaults = _installed_defaults(arch)

    def decide(self, kind, route, head_dim, causal=None, cu_seqlens=None, **kw) -> Decision:
        return decide(self.table, self.arch, kind, route, head_dim, causal, cu_seqlens, defaults=self.defaults, **kw)

    def __call__(self, kind, route, head_dim, causal=None, cu_seqlens=None, **kw) -> str:
        return self.decide(kind, route, head_dim, causal, cu_seqlens, **kw).variant

    def quantizer(self, route: str, operand: str, head_dim: int, cu_seqlens=None, **kw) -> Decision:
        """The quantizer for `route.operand` (e.g. `mxfp8`, `q`): its representation tag
        is the group's route."""
        from .defaults import quant_tag

        tag = quant_tag(_installed_plan(self.arch)[1], route, operand, head_dim)
        return self.decide("quant", tag, head_dim, None, cu_seqlens, **kw)


__all__ = ["TABLE_FORMAT", "UNTUNED_STATUS", "TableError", "gpu_slug", "table_filename", "tuning_db_dir", "table_path",
           "installed_expectation", "make_metadata", "untuned_table", "dumps_table", "write_table",
           "validate_structure", "check_against", "load_table", "Decision", "decide", "lookup", "Dispatcher"]
