"""Content-addressed build cache (FA4 `cache_utils` style).

Key = sha256(rendered source, DSL version, tvm-ffi version, target arch, Python tag,
cache format). Re-rendering a variant changes exactly its key. Each entry is
`<root>/<arch>/<name>-<key>.so` plus a `.json` record holding the `.so`'s own sha256:
an entry whose bytes do not match its record is corrupt, is deleted and rebuilt, never
trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .toolchain import dsl_version, python_tag, tvm_ffi_version

CACHE_FORMAT = 1


def cache_root() -> Path:
    env = os.environ.get("FLAMIA_GEN_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("flamia-gen"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, then rename: readers see the old file or
    the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def cache_key(source: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, dsl_version() or "no-dsl", tvm_ffi_version() or "no-tvm-ffi", arch, python_tag(),
                 str(CACHE_FORMAT)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


@dataclass
class CacheEntry:
    so: Path
    record: Path

    def read_record(self) -> dict:
        return json.loads(self.record.read_text())


class BuildCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else cache_root()

    def entry(self, name: str, arch: str, key: str) -> CacheEntry:
        d = self.root / arch
        return CacheEntry(d / f"{name}-{key}.so", d / f"{name}-{key}.json")

    def lookup(self, name: str, arch: str, key: str) -> tuple[CacheEntry | None, str]:
        """(entry, "") on a valid hit; (None, why) on a miss or a corrupt entry (removed)."""
        e = self.entry(name, arch, key)
        if not e.so.exists() and not e.record.exists():
            return None, "miss"
        try:
            rec = e.read_record()
            ok = (e.so.exists() and rec.get("key") == key and rec.get("name") == name
                  and rec.get("sha256") == sha256_file(e.so))
        except (OSError, ValueError):
            ok = False
        if ok:
            return e, ""
        for p in (e.so, e.record):
            p.unlink(missing_ok=True)
        return None, "corrupt entry removed"

    def store(self, name: str, arch: str, key: str, so_file: Path, meta: dict) -> CacheEntry:
        """Atomic: the `.so`, then its record (a record never names missing bytes)."""
        e = self.entry(name, arch, key)
        e.so.parent.mkdir(parents=True, exist_ok=True)
        data = Path(so_file).read_bytes()
        atomic_write(e.so, data)
        rec = dict(meta, name=name, arch=arch, key=key, sha256=hashlib.sha256(data).hexdigest(),
                   dsl_version=dsl_version(), tvm_ffi_version=tvm_ffi_version(), cache_format=CACHE_FORMAT)
        atomic_write(e.record, json.dumps(rec, indent=1, sort_keys=True).encode())
        return e
