"""Where the DSL compiler and its runtime live, and their versions. Imports nothing from
the DSL at module level: a GPU host without the compiler still imports this file."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import sys
from functools import lru_cache
from pathlib import Path


def dsl_version() -> str | None:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_available() -> bool:
    return dsl_version() is not None and importlib.util.find_spec("nvidia_cutlass_dsl") is not None


def tvm_ffi_version() -> str | None:
    try:
        return importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def dsl_runtime_lib() -> Path:
    """libcute_dsl_runtime.so that exported kernels link against (cu12 build: it runs on
    CUDA 12 and 13 drivers)."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-cutlass-dsl is not installed: building kernels needs the DSL "
                           "(pip install 'nvidia-cutlass-dsl==4.8.1')")
    root = Path(list(spec.submodule_search_locations)[0])
    lib = root / "cu12" / "lib" / "libcute_dsl_runtime.so"
    if not lib.exists():
        raise RuntimeError(f"DSL runtime library not found at {lib}")
    return lib


@lru_cache(maxsize=1)
def tvm_ffi_lib() -> Path:
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("apache-tvm-ffi is not installed (pip install apache-tvm-ffi)")
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib" / "libtvm_ffi.so"
    if not lib.exists():
        raise RuntimeError(f"libtvm_ffi.so not found at {lib}")
    return lib


def linker() -> str:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ linker (g++/c++/clang++) on PATH: needed to link exported kernels")
    return cxx


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"
