"""Compile one rendered variant in a fresh process.

`python -m flamia_gen.build.worker SOURCE ARCH OUT.o SYMBOL` sets `CUTE_DSL_ARCH` before
the DSL is imported (the DSL reads it at import), compiles with fake tensors and exports
the tvm-ffi entry point to an object file. A crash here is one failed variant, never a
failed build.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time


def compile_to_object(source: str, arch: str, out_obj: str, symbol: str) -> float:
    os.environ["CUTE_DSL_ARCH"] = arch
    import cutlass.cute as cute  # noqa: E402  (after the arch is set)

    spec = importlib.util.spec_from_file_location(f"flamia_generated_{symbol}", source)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    if getattr(mod, "ARCH", arch) != arch:
        raise RuntimeError(f"{source} was rendered for {mod.ARCH}, asked to build for {arch}")
    t0 = time.perf_counter()
    launcher, args = mod.compile_args()
    compiled = cute.compile(launcher, *args, options="--enable-tvm-ffi")
    compiled.export_to_c(out_obj, function_name=symbol)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python -m flamia_gen.build.worker SOURCE ARCH OUT.o SYMBOL", file=sys.stderr)
        return 2
    source, arch, out_obj, symbol = argv
    secs = compile_to_object(source, arch, out_obj, symbol)
    print(f"compiled {symbol} for {arch} in {secs:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
