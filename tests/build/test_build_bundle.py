"""Build → cache → bundle → load, on the CPU, with the fixture template (a scaled copy),
so this stage is tested apart from the real kernels."""

import hashlib
import json
from pathlib import Path

import pytest

from flamia_gen.build.builder import build_all, build_variant
from flamia_gen.build.bundle import write_bundle
from flamia_gen.build.cache import BuildCache, sha256_file
from flamia_gen.build.toolchain import dsl_runtime_lib
from flamia_gen.plan import make_plan
from flamia_gen.render import render_variant
from flamia_gen.runtime.bundle import BundleError, load_bundle
from flamia_gen.spec import load_specs

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
pytestmark = pytest.mark.compile


@pytest.fixture
def fixture_templates(monkeypatch):
    monkeypatch.setenv("FLAMIA_GEN_TEMPLATES", str(FIXTURES))


def _pick(arch, n=1):
    from flamia_gen.spec import KernelKind

    # the fixture templates provide quant.py.j2 only
    plan = make_plan(load_specs(REPO / "specs"), arch=arch, routes=["fp8_token"], kinds=[KernelKind.quant])
    return plan.variants[:n]


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_compile_one_variant_per_arch_and_cache(fixture_templates, tmp_path, arch):
    cache = BuildCache(tmp_path / "cache")
    (v,) = _pick(arch)
    r = build_variant(v, cache)
    assert r.status == "built", r.message
    assert r.so.exists() and r.so.stat().st_size > 1000
    assert (v.arch.cute_arch in str(r.so.parent))
    r2 = build_variant(v, cache)
    assert r2.status == "cached" and r2.so == r.so and r2.key == r.key
    # a corrupt entry is detected, removed and rebuilt, never trusted
    r.so.write_bytes(b"garbage")
    entry, why = cache.lookup(v.name, v.arch.cute_arch, r.key)
    assert entry is None and "corrupt" in why
    r3 = build_variant(v, cache)
    assert r3.status == "built"


def test_source_change_changes_key(fixture_templates, tmp_path):
    cache = BuildCache(tmp_path / "cache")
    (v,) = _pick("sm90")
    src = render_variant(v)
    r1 = build_variant(v, cache, source=src)
    r2 = build_variant(v, cache, source=src + "\n# changed\n")
    assert r1.key != r2.key and r2.status == "built"


def test_failed_variant_is_reported_and_build_continues(fixture_templates, tmp_path, monkeypatch):
    cache = BuildCache(tmp_path / "cache")
    good, bad = _pick("sm90", 2)
    import flamia_gen.build.builder as b

    real, rendered = b.render_variant, []

    def render(v):
        rendered.append(v.name)
        return real(v).replace("def compile_args", "def compile_args_gone") if v is bad else real(v)

    monkeypatch.setattr(b, "render_variant", render)
    res = build_all([bad, good], jobs=2, cache=cache, use_generated=False)
    assert [r.status for r in res] == ["failed", "built"]
    assert res[0].name == bad.name and "compile_args" in res[0].message
    assert sorted(rendered) == sorted([bad.name, good.name])  # each variant rendered once
    assert res[1].source == real(good)  # the result carries what was compiled


def test_bundle_manifest_and_load(fixture_templates, tmp_path):
    cache = BuildCache(tmp_path / "cache")
    vs = _pick("sm90", 2)
    results = build_all(vs, jobs=1, cache=cache)
    out = tmp_path / "bundle"
    m = write_bundle(out, "sm90", vs, results, cache)
    disk = json.loads((out / "manifest.json").read_text())
    assert disk == m
    assert m["arch"] == "sm90" and m["dsl_version"] == "4.8.1" and m["format"] == 1
    assert [v["name"] for v in m["variants"]] == sorted(v.name for v in vs)
    by_name = {v.name: v for v in vs}
    for e in m["variants"]:
        assert (out / e["file"]).exists() and e["spec_hash"] and e["uses"]
        assert e["args"][0]["name"] == "x"  # ARGS read from the source without importing it
        assert e["source_sha256"] == hashlib.sha256(render_variant(by_name[e["name"]]).encode()).hexdigest()
    assert m["runtime"]["sha256"] == sha256_file(dsl_runtime_lib())
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json", "lib/libcute_dsl_runtime.so.xz"] + [e["file"] for e in m["variants"]])
    b = load_bundle(out)
    assert b.for_use("fp8_token", "q", head_dim=m["variants"][0]["params"]["head_dim"])
    fn = b.get(vs[0].name)  # loads runtime + module on a CPU host (calling needs a GPU)
    assert fn is not None
    # tampering is detected
    (out / m["variants"][1]["file"]).write_bytes(b"x")
    with pytest.raises(BundleError, match="sha256"):
        load_bundle(out).get(vs[1].name)
    with pytest.raises(BundleError, match="not in bundle"):
        b.get("nope")
    (out / "manifest.json").unlink()
    with pytest.raises(BundleError, match="no manifest"):
        load_bundle(out)


def test_manifest_params_carry_the_templates_defaults():
    """A manifest entry's params are the plan's plus the rendered PARAMS' keys (the template defaults the runtime reads:
    k_row_perm, bwd_q_row_perm, bwd_head_section, ...), never a key on which the two disagree, and not the variant's
    identity (name, route, hashes)."""
    from flamia_gen.build.bundle import _IDENTITY_PARAMS, kernel_params
    from flamia_gen.plan import make_plan
    from flamia_gen.render import render_variant, rendered_literal
    from flamia_gen.spec import load_specs

    seen = set()
    for v in make_plan(load_specs(), arch="sm90").variants:
        src = render_variant(v)
        rendered, plan = rendered_literal(src, "PARAMS"), dict(v.params)
        got = kernel_params(v, src)
        for k, x in plan.items():
            assert got[k] == x and (k not in rendered or rendered[k] == x), (v.name, k)
        for k, x in rendered.items():
            assert (k in _IDENTITY_PARAMS) == (k not in got), (v.name, k)
            if k not in _IDENTITY_PARAMS:
                assert got[k] == x
        seen |= set(got) - set(plan)
    # (bwd_persistent left this set on 2026-12-02: with the atomic-counter scheduler every backward is persistent again,
    # so no default render writes it; bwd_dynamic and bwd_sq32_win_copy are such defaults now)
    assert {"k_row_perm", "bwd_q_row_perm", "bwd_head_section", "bwd_dynamic", "bwd_dq_warp", "bwd_sq32_win_copy",
            "fwd_dynamic"} <= seen
