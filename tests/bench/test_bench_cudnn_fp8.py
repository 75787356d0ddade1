"""cuDNN FP8 peer without cuDNN: graph construction against a recording fake
frontend, and the power-of-two scale arithmetic."""

import types

import pytest
import torch

from flamia_gen.bench import cudnn_fp8_graph as cg
from flamia_gen.bench.peer_cudnn_fp8 import (CudnnFp8Adapter, amax_of, dequant_many, pow2_scale,
                                             quantize_many, scales_from_amax)


class FakeTensor:
    def __init__(self, **kw):
        self.attrs = dict(kw)
        self.output = False

    def set_output(self, v):
        self.output = v
        return self

    def set_dim(self, d):
        self.attrs["dim"] = tuple(d)
        return self

    def set_stride(self, s):
        self.attrs["stride"] = tuple(s)
        return self

    def set_data_type(self, t):
        self.attrs["data_type"] = t
        return self


class FakeGraph:
    def __init__(self, owner, **kw):
        self.owner, self.kw, self.calls, self.ops = owner, kw, [], []

    def tensor(self, **kw):
        return FakeTensor(**kw)

    def sdpa_fp8(self, **kw):
        if self.owner.old_api and "generate_stats" in kw:
            raise TypeError("sdpa_fp8() got an unexpected keyword argument 'generate_stats'")
        self.ops.append(("sdpa_fp8", kw))
        return [FakeTensor(), FakeTensor() if not kw.get("is_inference") else None,
                FakeTensor(), FakeTensor()]

    def sdpa_fp8_backward(self, **kw):
        self.ops.append(("sdpa_fp8_backward", kw))
        return [FakeTensor() for _ in range(7)]

    def __getattr__(self, name):
        if name in ("validate", "build_operation_graph", "create_execution_plans",
                    "check_support", "build_plans"):
            def record(*a, **k):
                if name == "build_plans" and self.owner.refuse_without_amax_s:
                    amax_s_bound = any(o[0] == "sdpa_fp8" for o in self.ops) and \
                        self.owner.last_declare
                    if not amax_s_bound:
                        raise RuntimeError("engine wants Amax_S")
                self.calls.append(name)
            return record
        raise AttributeError(name)

    def get_workspace_size(self):
        return 4096


def fake_cudnn(old_api=False, refuse_without_amax_s=False):
    owner = types.SimpleNamespace(old_api=old_api, refuse_without_amax_s=refuse_without_amax_s,
                                  last_declare=False, graphs=[])

    def pygraph(**kw):
        g = FakeGraph(owner, **kw)
        owner.graphs.append(g)
        return g

    return types.SimpleNamespace(
        data_type=types.SimpleNamespace(FP8_E4M3="fp8_e4m3", FLOAT="float"),
        heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"),
        pygraph=pygraph, _owner=owner)


def test_fwd_graph_training_layout_and_finalize_order():
    cudnn = fake_cudnn()
    built = cg.build_fwd(cudnn, None, 2, 3, 5, 16, causal=True, train=True)
    g = cudnn._owner.graphs[0]
    assert g.kw["io_data_type"] == "fp8_e4m3" and g.kw["compute_data_type"] == "float"
    op, kw = g.ops[0]
    assert op == "sdpa_fp8"
    assert kw["generate_stats"] is True and kw["use_causal_mask"] is True
    assert kw["attn_scale"] == pytest.approx(0.25)
    assert kw["q"].attrs["dim"] == (2, 3, 5, 16)
    assert kw["q"].attrs["stride"] == (5 * 3 * 16, 16, 3 * 16, 1)  # BSHD memory, no copy
    o, stats = built.tensors["o"], built.tensors["stats"]
    assert o.output and o.attrs["dim"] == (2, 3, 5, 16) and o.attrs["data_type"] == "fp8_e4m3"
    assert stats.output and stats.attrs["dim"] == (2, 3, 5, 1)
    assert stats.attrs["stride"] == (15, 5, 1, 1) and stats.attrs["data_type"] == "float"
    assert "amax_s" not in built.tensors  # newer engines decline a bound Amax_S
    assert g.calls == ["validate", "build_operation_graph", "create_execution_plans",
                       "check_support", "build_plans"]
    assert built.workspace_size == 4096
    buffers = {n: f"buf_{n}" for n in built.tensors}
    pack = built.pack(buffers)
    assert pack[built.tensors["q"]] == "buf_q" and len(pack) == len(built.tensors)
    with pytest.raises(KeyError):
        built.pack({})


def test_fwd_graph_inference_with_old_frontend_api():
    cudnn = fake_cudnn(old_api=True)
    built = cg.build_fwd(cudnn, None, 1, 2, 8, 64, causal=True, train=False)
    op, kw = cudnn._owner.graphs[0].ops[-1]
    assert kw["is_inference"] is True and "generate_stats" not in kw
    assert "stats" not in built.tensors


def test_fwd_any_retries_with_amax_s():
    cudnn = fake_cudnn(refuse_without_amax_s=True)
    orig = cg.build_fwd

    def tracking(*a, declare_amax_s=False, **k):
        cudnn._owner.last_declare = declare_amax_s
        return orig(*a, declare_amax_s=declare_amax_s, **k)

    cg_build = cg.build_fwd
    try:
        cg.build_fwd = tracking
        built = cg.build_fwd_any(cudnn, None, 1, 2, 8, 64, True, True)
    finally:
        cg.build_fwd = cg_build
    assert "amax_s" in built.tensors and built.tensors["amax_s"].output


def test_bwd_graph():
    cudnn = fake_cudnn()
    built = cg.build_bwd(cudnn, None, 2, 3, 5, 16, causal=True)
    op, kw = cudnn._owner.graphs[0].ops[0]
    assert op == "sdpa_fp8_backward"
    for name in cg.BWD_SCALARS:
        assert kw[name] is built.tensors[name]
    assert kw["use_causal_mask"] is True
    for name in ("dQ", "dK", "dV"):
        t = built.tensors[name]
        assert t.output and t.attrs["dim"] == (2, 3, 5, 16) and t.attrs["data_type"] == "fp8_e4m3"
    for name in cg.BWD_AMAX:
        assert built.tensors[name].attrs["dim"] == (1, 1, 1, 1)


def test_pow2_scales():
    amax = torch.tensor([1.0, 448.0, 449.0, 3.0, 0.0, 1e-3])
    s = pow2_scale(amax)
    assert s[:4].tolist() == [256.0, 1.0, 0.5, 128.0]
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))  # powers of two
    assert torch.isfinite(s).all() and s[4] > 0
    assert torch.all(amax * s <= 448.0)
    x = torch.tensor([[-3.0, 2.0], [0.5, 1.0]], dtype=torch.bfloat16)
    assert amax_of(x).item() == 3.0 and amax_of(x).dtype == torch.float32


def test_quantize_round_trip_is_exact_for_representable_values():
    x = torch.tensor([-3.0, 2.0, 0.5, 1.25, 0.0], dtype=torch.bfloat16)
    y = torch.tensor([[960.0, -0.125]], dtype=torch.bfloat16)  # 960 * 0.25 = 240, an E4M3 value
    (x8, y8), scale, descale = quantize_many(x, y)
    assert scale.tolist() == [128.0, 0.25] and descale.tolist() == [1 / 128, 4.0]
    assert x8.dtype == torch.float8_e4m3fn and y8.shape == y.shape
    assert x8.float().abs().max() == 384.0  # 3 * 128: no saturation
    back_x, back_y = dequant_many((x8, y8), descale.unbind(), torch.bfloat16)
    assert back_x.dtype == torch.bfloat16 and back_x.shape == x.shape
    assert torch.equal(back_x, x) and torch.equal(back_y, y)
    s, d = scales_from_amax(torch.tensor([1.0, 100.0]))
    assert s.tolist() == [256.0, 4.0] and d.tolist() == [1 / 256, 0.25]


def test_flavours_and_names():
    assert [CudnnFp8Adapter(f).name for f in ("kernel", "quant", "e2e")] == [
        "cudnn_fp8_kernel", "cudnn_fp8_quant", "cudnn_fp8_e2e"]
    assert "BF16 outputs" in CudnnFp8Adapter("e2e").memory_note
    with pytest.raises(ValueError):
        CudnnFp8Adapter("fast")


class _RecordingRunner:
    """Duck-typed _Runner: records what a bwd-mode call runs."""

    def __init__(self):
        self.log, self.o8, self.stats = [], torch.zeros(1), torch.zeros(1)
        self.dq8 = self.dk8 = self.dv8 = torch.zeros(1)
        self.bwd_descale = torch.ones(4)
        self.n_fwd = 0

    def quantize(self, xs):
        self.log.append(("quantize", len(xs)))
        return [(x, 1.0, 1.0) for x in xs]

    def calibrate(self, qs, ks, vs, dos):
        self.log.append(("calibrate",))
        self.forward(qs, ks, vs)

    def forward(self, qs, ks, vs):
        self.n_fwd += 1
        self.o8 = torch.full((1,), float(self.n_fwd))  # a forward's own O codes
        self.log.append(("forward",))
        return 1.0

    def backward(self, qs, ks, vs, descale_o, dos, o8=None, stats=None):
        self.log.append(("backward", float(o8[0]), qs[0]))

    def dequant(self, xs, descales, dtype):
        self.log.append(("dequant", len(xs)))
        return xs

    def update_bwd_scales(self):
        self.log.append(("update",))


@pytest.mark.parametrize("flavour", ["kernel", "quant", "e2e"])
def test_bwd_call_runs_only_the_backward_with_each_sets_saved_forward(flavour):
    ad, r = CudnnFp8Adapter(flavour), _RecordingRunner()
    sets = [(torch.tensor([float(i)]),) * 3 for i in (10, 20)]
    call = ad._bwd_call(r, sets, torch.zeros(1), torch.bfloat16)
    assert [e[0] for e in r.log].count("forward") == 3  # calibration + one per set
    r.log.clear()
    for _ in range(3):
        call()
    backs = [e for e in r.log if e[0] == "backward"]
    # set i keeps the O of its own forward (forwards 2 and 3; 1 was the calibration's)
    assert [(b[1], float(b[2][0])) for b in backs] == [(2.0, 10.0), (3.0, 20.0), (2.0, 10.0)]
    assert ("forward",) not in r.log
    kinds = [e[0] for e in r.log]
    assert kinds.count("quantize") == (0 if flavour == "kernel" else 3)  # dO only, in the call
    assert kinds.count("dequant") == (3 if flavour == "e2e" else 0)
    assert kinds.count("update") == (0 if flavour == "kernel" else 3)
