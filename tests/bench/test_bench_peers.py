"""Peer adapters on a machine without CUDA or optional packages: clean reasons, no crash."""

import inspect

import pytest
import torch

from flamia_gen.bench import peers
from flamia_gen.bench.adapter import (EQUAL_DOCS_REASON, NO_CUDA, Adapter, batched_view,
                                      packed_from_batched, try_import)
from flamia_gen.bench.peer_fa4 import first_output, missing_kwargs
from flamia_gen.bench.peer_flex import FlexAdapter, block_mask_bytes
from flamia_gen.bench.peer_torch_varlen import causal_kwargs
from flamia_gen.bench.workloads import get_workload

BUILTIN = ["sdpa_cudnn", "sdpa_flash", "flex", "fa4", "torch_varlen",
           "cudnn_fp8_kernel", "cudnn_fp8_quant", "cudnn_fp8_e2e"]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_builtin_peers_in_report_order():
    assert [a.name for a in peers.builtin_peers()] == BUILTIN
    precisions = {a.name: a.precision for a in peers.builtin_peers()}
    assert precisions["fa4"] == "bf16" and precisions["cudnn_fp8_e2e"] == "fp8"
    assert all(a.memory_note for a in peers.builtin_peers())


def test_every_peer_reports_not_installed_or_no_cuda(no_cuda):
    for a in peers.builtin_peers():
        ok, reason = a.available()
        assert ok is False, a.name
        assert reason == NO_CUDA or reason.startswith("not installed"), (a.name, reason)
    # torch's own peers exist in this torch: without CUDA they say so
    by_name = {a.name: a for a in peers.builtin_peers()}
    assert by_name["sdpa_cudnn"].available() == (False, NO_CUDA)
    assert by_name["flex"].available() == (False, NO_CUDA)
    assert by_name["torch_varlen"].available() == (False, NO_CUDA)


def test_missing_packages_are_not_installed(monkeypatch):
    mod, msg = try_import("flamia_gen_no_such_module_xyz")
    assert mod is None and msg.startswith("not installed: flamia_gen_no_such_module_xyz")
    # None in sys.modules makes the import fail even where the package exists.
    for name in ("cudnn", "flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(__import__("sys").modules, name, None)
    ok, reason = peers.Fa4Adapter().available()
    assert not ok and reason.startswith("not installed: flash_attn.cute")
    for flavour in ("kernel", "quant", "e2e"):
        ok, reason = peers.CudnnFp8Adapter(flavour).available()
        assert not ok and reason.startswith("not installed: cudnn")
    assert peers.CudnnFp8Adapter("e2e").versions().get("cudnn") is None


def test_batched_peers_skip_unequal_documents():
    skew, eq = get_workload("skew8192+224x256"), get_workload("eq4x4096")
    for name in ("sdpa_cudnn", "sdpa_flash", "cudnn_fp8_kernel", "cudnn_fp8_e2e"):
        a = peers.registered_impls()[name]
        assert a.supports(skew) == (False, EQUAL_DOCS_REASON)
        assert a.supports(eq) == (True, "")
    for name in ("fa4", "torch_varlen", "flex"):
        assert peers.registered_impls()[name].supports(skew)[0]


def test_flex_skips_when_block_mask_too_big():
    assert block_mask_bytes(131072) == 16 * 1024 * 1024
    small = FlexAdapter(max_block_mask_bytes=1024)
    ok, reason = small.supports(get_workload("eq1x16384"))
    assert not ok and reason.startswith("block mask too big")
    assert FlexAdapter().supports(get_workload("long131072")) == (True, "")


def test_batched_view_round_trip():
    w = get_workload("eq3x5", heads=2, head_dim=4)
    x = torch.arange(15 * 2 * 4, dtype=torch.float32).view(15, 2, 4)
    b = batched_view(x, w)
    assert b.shape == (3, 2, 5, 4)
    assert b.data_ptr() == x.data_ptr()  # a view, no padding copy
    assert torch.equal(b[1, 0, 2], x[1 * 5 + 2, 0])
    assert torch.equal(packed_from_batched(b, w), x)


def test_fa4_interface_checks():
    def new_style(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                  max_seqlen_k=None, causal=False, return_lse=False):
        return q, None

    def old_style(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False):
        return q

    assert missing_kwargs(new_style) == []
    assert missing_kwargs(old_style) == ["causal"]
    assert missing_kwargs(lambda *a, **kw: None) == []
    t = torch.ones(1)
    assert first_output((t, None)) is t and first_output(t) is t


def test_torch_varlen_causal_kwargs():
    from torch.nn.attention import varlen

    assert causal_kwargs(varlen.varlen_attn, True) == {"window_size": (-1, 0)}
    assert causal_kwargs(varlen.varlen_attn, False) == {"window_size": (-1, -1)}
    assert causal_kwargs(lambda q, k, v, cu, cu2, a, b, is_causal=False: q, True) == {"is_causal": True}
    assert causal_kwargs(lambda q, k, v: q, True) is None


class _Dummy(Adapter):
    name = "flamia_dummy_test"
    precision = "fp8"
    is_peer = False


def test_register_impl_and_resolve(monkeypatch):
    # our routes from the runtime depend on the host (bundle / DSL); keep them out here
    monkeypatch.setattr(peers, "our_impls", lambda: ([], "not under test"))
    a = _Dummy()
    peers.register_impl(a)
    try:
        with pytest.raises(ValueError, match="already registered"):
            peers.register_impl(_Dummy())
        got, _ = peers.resolve_impls("fa4,flamia_dummy_test")
        assert [x.name for x in got] == ["fa4", "flamia_dummy_test"]
        ours, _ = peers.resolve_impls("ours")
        assert "flamia_dummy_test" in [x.name for x in ours]
        only_peers, _ = peers.resolve_impls("peers")
        assert [x.name for x in only_peers] == BUILTIN
        everything, _ = peers.resolve_impls("all")
        assert [x.name for x in everything] == BUILTIN + ["flamia_dummy_test"]
    finally:
        peers.unregister_impl("flamia_dummy_test")
    bad = _Dummy()
    bad.precision = "int4"
    with pytest.raises(ValueError, match="precision"):
        peers.register_impl(bad)
    with pytest.raises(TypeError):
        peers.register_impl(object())


def test_unknown_impl_lists_known():
    with pytest.raises(ValueError) as ei:
        peers.resolve_impls("fa4,fa5")
    assert "'fa5'" in str(ei.value) and "sdpa_cudnn" in str(ei.value)


def test_our_impls_without_runtime_entry_points(monkeypatch):
    # The runtime has its entry points now: take them away so this path is tested, not skipped.
    import flamia_gen.runtime as rt

    for name in ("bench_adapters", "packed_attention", "available_routes"):
        monkeypatch.delattr(rt, name, raising=False)
    adapters, reason = peers.our_impls()
    assert adapters == []
    assert "flamia_gen.runtime" in reason and "packed_attention" in reason and "available_routes" in reason
    everything, notes = peers.resolve_impls("all")
    assert [a.name for a in everything] == BUILTIN
    assert any(n.startswith("our routes: ") and "packed_attention" in n for n in notes)


def test_our_impls_with_runtime_entry_points(monkeypatch):
    import flamia_gen.runtime as rt

    calls = []

    def packed_attention(q, k, v, cu, max_seqlen, *, route, causal):
        calls.append((route, max_seqlen, causal, cu.tolist()))
        return q

    monkeypatch.setattr(rt, "packed_attention", packed_attention, raising=False)
    monkeypatch.setattr(rt, "autograd_attention", None, raising=False)  # forward-only runtime
    monkeypatch.setattr(rt, "available_routes", lambda: ["bf16", "mxfp8"], raising=False)
    adapters, reason = peers.our_impls()
    assert reason == ""
    assert [(a.name, a.precision, a.is_peer) for a in adapters] == [
        ("flamia_bf16", "bf16", False), ("flamia_mxfp8", "fp8", False)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    f = adapters[1].build(get_workload("skew3+2x2", heads=1, head_dim=2))
    q = torch.zeros(7, 1, 2)
    assert f(q, q, q) is q
    assert calls == [("mxfp8", 3, True, [0, 3, 5, 7])]
    assert inspect.isfunction(peers.our_impls)
    # a runtime with the autograd op: the bench uses it (train mode differentiates through it)
    monkeypatch.setattr(rt, "autograd_attention", lambda q, k, v, cu, m, *, route, causal: ("op", q), raising=False)
    adapters, _ = peers.our_impls()
    assert adapters[0].build(get_workload("skew3+2x2", heads=1, head_dim=2))(q, q, q) == ("op", q)


def test_cu_seqlens_made_once_per_device_and_status_of_reasons():
    from flamia_gen.bench.adapter import cu_seqlens_per_device, status_of

    w = get_workload("skew3+2x2", heads=1, head_dim=2)
    made = []
    orig = w.cu_seqlens
    w.cu_seqlens = lambda device="cpu": made.append(device) or orig(device)
    get = cu_seqlens_per_device(w)
    first = get(torch.device("cpu"))
    assert get(torch.device("cpu")) is first and made == [torch.device("cpu")]  # cached, not rebuilt per call
    assert first.tolist() == [0, 3, 5, 7] and first.dtype == torch.int32
    assert status_of("not installed: cudnn (No module named 'cudnn')") == "not installed"
    assert status_of(NO_CUDA) == "unavailable"
