"""Shared by the kernel-template tests: compile one rendered variant for sm_90a in a
fresh process (the DSL reads CUTE_DSL_ARCH at import) and return its PTX."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flamia_gen.render.render import render_variant

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def compile_sm90(tmp_path):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

    def compile_(v, source: str | None = None) -> str:
        """`source` overrides the default rendering (template flags)."""
        src = tmp_path / f"{v.name}.py"
        src.write_text(render_variant(v) if source is None else source)
        dump = tmp_path / "dump"
        dump.mkdir(exist_ok=True)
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump))
        r = subprocess.run([sys.executable, "-m", "flamia_gen.build.worker", str(src), "sm_90a",
                            str(tmp_path / f"{v.name}.o"), v.name], capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        assert (tmp_path / f"{v.name}.o").stat().st_size > 0
        return "".join(Path(p).read_text() for p in glob.glob(str(dump / "*.ptx")))

    return compile_
