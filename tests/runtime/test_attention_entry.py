import pytest
import torch

from flamia_gen.runtime import NoKernelError, available_routes, packed_attention


def _qkv(T=64, H=2, D=128):
    q = torch.randn(T, H, D, dtype=torch.bfloat16)
    cu = torch.tensor([0, 30, T], dtype=torch.int32)
    return q, q.clone(), q.clone(), cu


def test_no_bundle_is_a_clear_error(monkeypatch):
    import flamia_gen.build.toolchain as tc

    monkeypatch.delenv("FLAMIA_GEN_BUNDLE", raising=False)
    monkeypatch.setattr(tc, "dsl_available", lambda: False)
    with pytest.raises(NoKernelError, match="FLAMIA_GEN_BUNDLE.*no JIT"):
        available_routes()


def test_without_bundle_the_dsl_serves_every_planned_route(monkeypatch):
    monkeypatch.delenv("FLAMIA_GEN_BUNDLE", raising=False)
    assert {"bf16", "fp8_token"} <= set(available_routes())


def test_cpu_tensors_are_refused():
    q, k, v, cu = _qkv()
    with pytest.raises(ValueError, match="CUDA"):
        packed_attention(q, k, v, cu, 34)


def test_verify_maps_variant_to_its_representation():
    from flamia_gen.spec import get_route
    from flamia_gen.verify.gpu import _operand_quant_of

    oq = _operand_quant_of({"name": "x", "uses": ["mxfp8.q", "mxfp8_exact.do"]})
    assert oq == get_route("mxfp8").operands.q
    with pytest.raises(ValueError, match="differs"):
        _operand_quant_of({"name": "x", "uses": ["mxfp8.q", "fp8_token.q"]})


def test_per_token_scales_layouts():
    from flamia_gen.runtime.attention import per_token_scales

    x = torch.zeros(5, 3, 128)
    s = torch.arange(15, dtype=torch.uint8).reshape(5, 3)
    assert torch.equal(per_token_scales(s, x), s)
    t = per_token_scales(torch.tensor([130], dtype=torch.uint8), x)
    assert t.shape == (5, 3) and t.is_contiguous() and bool((t == 130).all())
    with pytest.raises(ValueError, match="per-token or tensor"):
        per_token_scales(torch.zeros(5, 3, 4, dtype=torch.uint8), x)


def test_forward_schedule_cache_follows_the_tensor_not_its_memory():
    from flamia_gen.runtime.attention import _fwd_schedule

    params = {"tile_m": 128, "tile_n": 128, "causal": True}
    cu = torch.tensor([0, 300, 1000], dtype=torch.int32)
    s1 = _fwd_schedule(cu, 1000, params)
    assert _fwd_schedule(cu, 1000, params) is s1  # same live, unmodified tensor: reused
    cu[1] = 500  # in-place change bumps the version: rebuilt
    s2 = _fwd_schedule(cu, 1000, params)
    assert s2 is not s1 and not torch.equal(s1.work, s2.work) and not torch.equal(s1.row_doc, s2.row_doc)
    other = torch.tensor([0, 500, 1000], dtype=torch.int32)
    s3 = _fwd_schedule(other, 1000, params)
    assert all(torch.equal(a, b) for a, b in zip(s3, s2))


@pytest.mark.compile
def test_jit_bundle_builds_a_routes_kernels_once(monkeypatch, tmp_path):
    """No bundle + the DSL installed: the route's kernels are compiled, packed and loaded
    (fixture templates keep this fast); a second call reuses the packed bundle."""
    from pathlib import Path

    from flamia_gen.runtime.jit import jit_bundle

    monkeypatch.setenv("FLAMIA_GEN_TEMPLATES", str(Path(__file__).resolve().parents[1] / "fixtures" / "templates"))
    monkeypatch.setenv("FLAMIA_GEN_CACHE", str(tmp_path / "cache"))
    b = jit_bundle("bf16")
    names = sorted(b.variants)
    # the bf16 route's forward kernels and its dO launches (the only quantizer-family kernels it has)
    assert names and all(n.startswith(("attn_fwd_sm90_bf16_", "quant_sm90_bf16_delta_")) for n in names)
    assert any(n.startswith("attn_fwd_sm90_bf16_") for n in names)
    assert b.get(names[0]) is not None
    again = jit_bundle("bf16")
    assert again.root == b.root and sorted(again.variants) == names


def _empty_bundle(d):
    import json

    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm90", "variants": []}))
    return d


def test_jit_bundle_is_planned_once_per_route(monkeypatch, tmp_path):
    """Without FLAMIA_GEN_BUNDLE the route's JIT bundle is made (planned, rendered, looked up)
    once; later calls reuse it instead of paying that on every forward."""
    import flamia_gen.build.toolchain as tc
    import flamia_gen.runtime.attention as A
    import flamia_gen.runtime.jit as jit
    from flamia_gen.runtime.bundle import load_bundle

    roots = {r: _empty_bundle(tmp_path / r) for r in ("bf16", "fp8_token")}
    calls = []

    def fake_jit(route, arch):
        calls.append(route)
        return load_bundle(roots[route])

    monkeypatch.delenv("FLAMIA_GEN_BUNDLE", raising=False)
    monkeypatch.setattr(tc, "dsl_available", lambda: True)
    monkeypatch.setattr(jit, "jit_bundle", fake_jit)
    monkeypatch.setattr(A, "_JIT_ROOTS", {})
    b = A._current_bundle("bf16")
    assert A._current_bundle("bf16") is b and calls == ["bf16"]
    assert A._current_bundle("fp8_token").root.resolve() == roots["fp8_token"].resolve()
    assert calls == ["bf16", "fp8_token"]
    with pytest.raises(NoKernelError, match="FLAMIA_GEN_BUNDLE"):
        A._current_bundle()  # no route: nothing to JIT


def test_relative_bundle_path_follows_the_working_directory(monkeypatch, tmp_path):
    import flamia_gen.runtime.attention as A

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        _empty_bundle(tmp_path / d / "bundle")
    monkeypatch.setenv("FLAMIA_GEN_BUNDLE", "bundle")
    monkeypatch.chdir(tmp_path / "a")
    ra = A._current_bundle().root.resolve()
    monkeypatch.chdir(tmp_path / "b")
    rb = A._current_bundle().root.resolve()
    assert ra == (tmp_path / "a" / "bundle").resolve() and rb == (tmp_path / "b" / "bundle").resolve()


def test_a_table_choice_missing_from_the_bundle_runs_the_groups_default_and_warns_once(monkeypatch, tmp_path):
    """The table names a kernel the bundle lacks (a bundle of one route's defaults, say): the runtime runs the group's
    default when bundled (not the alphabetically first member) and says so once — the user is not running the tuned
    choice. A group with nothing bundled stays a NoKernelError."""
    import json
    import warnings

    import flamia_gen.runtime.attention as A
    from flamia_gen.dispatch import Decision, DocProfile
    from flamia_gen.runtime.bundle import load_bundle

    def entry(name):
        return {"name": name, "file": f"kernels/{name}.so", "sha256": "0" * 64, "kind": "attn_fwd", "family": "x",
                "spec_hash": "0", "source_sha256": "0", "uses": ["fp8_token"], "params": {"head_dim": 128,
                "causal": True}, "args": []}

    d = tmp_path / "b"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": 1, "arch": "sm90",
                                                 "variants": [entry("attn_fwd_a_first"), entry("attn_fwd_z_default")]}))
    group = "attn_fwd/fp8_token/d128/causal"

    class Disp:
        defaults = {group: "attn_fwd_z_default"}

        def decide(self, kind, route, d, causal, profile=None):
            return Decision("attn_fwd_tuned_winner", "exact", group, {})

    monkeypatch.setattr(A, "_local_dispatcher", lambda: Disp())
    monkeypatch.setattr(A, "_WARNED_MISSING", set())
    b = load_bundle(d)
    prof = DocProfile.from_lengths([4096])
    with pytest.warns(RuntimeWarning, match="the dispatch table's choice attn_fwd_tuned_winner is not in bundle .*; "
                                            "running attn_fwd_z_default instead"):
        assert A._pick(b, "attn_fwd", "fp8_token", 128, True, prof)["name"] == "attn_fwd_z_default"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert A._pick(b, "attn_fwd", "fp8_token", 128, True, prof)["name"] == "attn_fwd_z_default"
    Disp.defaults = {}  # no default bundled: the first member, still a kernel of the group
    assert A._pick(b, "attn_fwd", "fp8_token", 128, True, prof)["name"] == "attn_fwd_a_first"
    # no table entry: the analytic default was chosen, and the warning says so rather than blaming a table
    Disp.decide = lambda self, *a, **k: Decision("attn_fwd_untuned_default", "default", group, {})
    with pytest.warns(RuntimeWarning, match="analytic default \\(no table entry\\) attn_fwd_untuned_default"):
        assert A._pick(b, "attn_fwd", "fp8_token", 128, True, prof)["name"] == "attn_fwd_a_first"
    with pytest.raises(NoKernelError, match="no attn_fwd kernel for route='fp8_token'"):
        A._pick(b, "attn_fwd", "fp8_token", 128, False, prof)
    # recorded where asked (the bench's rows): (chosen, ran), the choice cache cleared on entry, nothing outside
    Disp.decide = lambda self, *a, **k: Decision("attn_fwd_tuned_winner", "exact", group, {})
    Disp.defaults = {group: "attn_fwd_z_default"}
    A._pick_cached.cache_clear()
    monkeypatch.setattr(A, "_bundle", lambda root: b)
    A._pick_cached(str(b.root), "attn_fwd", "fp8_token", 128, True, prof)
    assert A._pick_cached.cache_info().currsize == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with A.substitutions() as rec:
            assert A._pick_cached.cache_info().currsize == 0
            A._pick_cached(str(b.root), "attn_fwd", "fp8_token", 128, True, prof)
            A._pick_cached(str(b.root), "attn_fwd", "fp8_token", 128, True, prof)  # cached: recorded once
        A._pick(b, "attn_fwd", "fp8_token", 128, True, prof)
    assert rec == [("attn_fwd_tuned_winner", "attn_fwd_z_default")]
    A._pick_cached.cache_clear()
