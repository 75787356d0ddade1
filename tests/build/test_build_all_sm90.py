"""Every sm90 variant of the plan cross-compiles for sm_90a, and no attention kernel's tile loop has its wgmmas
serialised by ptxas (issues #6 and #9: "CI (CPU) renders and cross-compiles every forward / backward variant").

One run of the project's own `flamia-gen build --arch sm90 --sass-check` (2 jobs: CI's cores; ≈ 13 minutes from an
empty cache on the build machine, 2026-12-04). The SASS guard reads each attention kernel's cubin with nvdisasm (the
pinned `nvidia-cuda-nvdisasm` / `-cuobjdump` wheels of the test extras): ptxas serialises every wgmma of a kernel when
registers an in-flight wgmma owns are touched or the consumers run out of them (C7512) — a silent 2× on the tensor
cores that no CPU test would see otherwise (fp8_pv's backward with dK after dQ did, 2026-12-04)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from flamia_gen.cli import main
from flamia_gen.plan import make_plan
from flamia_gen.spec import load_specs

pytestmark = pytest.mark.compile


@pytest.mark.timeout(5400)
def test_every_sm90_variant_cross_compiles_and_no_wgmma_is_serialised(tmp_path):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from flamia_gen.bench.sass import missing_tools

    if missing_tools():
        pytest.skip(missing_tools())
    out = tmp_path / "build.json"
    jobs = str(min(2, os.cpu_count() or 1))
    r = CliRunner().invoke(main, ["build", "--arch", "sm90", "-j", jobs, "--sass-check", "--json", str(out)])
    assert r.exit_code == 0, r.output[-4000:]
    rows = json.loads(out.read_text())
    plan = make_plan(load_specs(), arch="sm90")
    assert sorted(x["name"] for x in rows) == sorted(v.name for v in plan.variants)
    assert all(x["status"] in ("built", "cached") for x in rows), [x["name"] for x in rows if x["status"] == "failed"]
    attn = [x for x in rows if x["name"].startswith("attn_")]
    assert len(attn) == sum(v.kind.value in ("attn_fwd", "attn_bwd") for v in plan.variants) > 150
    for x in attn:
        s = x["sass"]
        assert s["loops"], x["name"]  # every attention kernel has a tile loop with wgmmas
        assert not s["serialised"], (x["name"], [(lp["wgmma"], lp["waited"]) for lp in s["loops"]])
        assert all(lp["waited"] >= 1 for lp in s["loops"]), x["name"]
