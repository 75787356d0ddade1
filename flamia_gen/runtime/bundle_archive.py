"""A bundle as one file: `flamia-gen bundle-pack DIR -o NAME.tar.xz`, and its unpacking on the GPU host.

Why: a bundle folder is mostly kernel modules (≈ 95 KB each, ≈ 10× smaller under xz) beside the packed DSL runtime;
hosts that take uploads by size (a 64 MiB carry, a CI artifact) fit 145 kernels in ≈ 15 MB packed instead of ≈ 27.

Format: an xz tar of the folder's manifest.json, lib/ and kernels/ (sorted members, no owners, mtime 0: packing a
folder twice gives the same bytes). The loader unpacks an archive once per archive digest into
`$FLAMIA_GEN_RUNTIME_DIR/bundles/` (default: the temp dir) and checks every file the manifest lists against its
sha256 there; an unpacked copy that fails the check is unpacked again, never trusted. Standard library only.
"""

from __future__ import annotations

import io
import lzma
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from ..build.cache import sha256_file  # standard library only, no DSL
from .bundle import BundleError, read_manifest, runtime_dir

PACKED_SUFFIX = ".tar.xz"


class BundleArchiveError(BundleError):
    pass


def _listed_files(manifest: dict) -> list[str]:
    return [manifest["runtime"]["file"]] + [e["file"] for e in manifest["variants"]]


def _check_files(root: Path, manifest: dict) -> str | None:
    """None if every file the manifest lists is under root with its sha256, else what is wrong."""
    rt = manifest["runtime"]
    checks = [(rt["file"], rt["sha256_xz"])] + [(e["file"], e["sha256"]) for e in manifest["variants"]]
    for rel, digest in checks:
        p = root / rel
        if not p.is_file():
            return f"{rel} is missing"
        if sha256_file(p) != digest:
            return f"{rel}: sha256 does not match the manifest"
    return None


def pack_bundle(src_dir: Path | str, out_file: Path | str) -> dict:
    """Pack a finished bundle folder into one reproducible `.tar.xz`; every listed file is checked first and only the
    listed files go in (a stray file in the folder stays out). Written atomically. Returns the manifest."""
    src, out = Path(src_dir), Path(out_file)
    if not out.name.endswith(PACKED_SUFFIX):
        raise BundleArchiveError(f"{out}: a packed bundle's name ends in {PACKED_SUFFIX}")
    m = read_manifest(src)
    bad = _check_files(src, m)
    if bad:
        raise BundleArchiveError(f"{src}: {bad} (corrupt bundle: rebuild it before packing)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=PACKED_SUFFIX)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:xz", preset=6, format=tarfile.PAX_FORMAT) as tf:
            for rel in ["manifest.json"] + sorted(_listed_files(m)):
                data = (src / rel).read_bytes()
                info = tarfile.TarInfo(rel)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tf.addfile(info, io.BytesIO(data))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return m


def unpacked_bundle(archive: Path | str) -> Path:
    """The folder of a packed bundle, unpacked once per archive digest and checked file by file."""
    p = Path(archive)
    if not p.is_file():
        raise BundleArchiveError(f"{p}: no such packed bundle")
    if not p.name.endswith(PACKED_SUFFIX):
        raise BundleArchiveError(f"{p}: not a bundle (a folder, or a {PACKED_SUFFIX} from `flamia-gen bundle-pack`)")
    out = runtime_dir() / "bundles" / sha256_file(p)[:16]
    if out.is_dir():
        try:
            if _check_files(out, read_manifest(out)) is None:
                return out
        except (BundleError, KeyError, TypeError):
            pass
        shutil.rmtree(out, ignore_errors=True)  # a damaged or partial copy: unpack again
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        with tarfile.open(p, "r:xz") as tf:
            tf.extractall(tmp, filter="data")  # refuses absolute paths, '..', links out of the folder
        m = read_manifest(tmp)
        bad = _check_files(tmp, m)
        if bad:
            raise BundleArchiveError(f"{p}: {bad} (corrupt packed bundle)")
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BundleArchiveError(f"{p}: corrupt packed bundle ({type(e).__name__}: {e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, out)
    except OSError:  # another process unpacked the same archive first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def bundle_root(path: Path | str) -> Path:
    """The unpacked folder of a packed bundle (a file), else the path as given (a folder; read_manifest says what is
    wrong with one that is not a bundle)."""
    p = Path(path)
    return unpacked_bundle(p) if p.is_file() else p
