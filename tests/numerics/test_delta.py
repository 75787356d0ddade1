"""D = rowsum(dÔ∘O) of the dO launch (flamia_gen.numerics.delta) against docs/quantizer-contract.md.

An independent slow reference (numpy float32 scalars, the documented order spelled out) checks
the vectorized emulator bit for bit; a float64 rowsum checks the value."""

import numpy as np
import pytest
import torch

from flamia_gen.numerics import delta_from_quantized, quantize
from flamia_gen.spec.route import OperandQuant

DO_SPECS = {
    "e4m3_tok_ceil": OperandQuant(format="e4m3", granularity="token", exponent_rule="ceil"),
    "e4m3_tb32_ceil": OperandQuant(format="e4m3", granularity="token_block", exponent_rule="ceil"),
    "e4m3_b1d32_floor": OperandQuant(format="e4m3", granularity="block1d_32", exponent_rule="floor"),
    "e5m2_tsr_ceil": OperandQuant(format="e5m2", granularity="tensor", exponent_rule="ceil"),
}


def _inputs(T=61, H=3, D=128, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(T, H, D, generator=g)
    o = torch.randn(T, H, D, generator=g)
    if outliers:
        idx = torch.randint(0, T, (max(1, T // 10),), generator=g)
        do[idx] *= 1e3
        o[idx.flip(0)] *= 1e4
        do[0, 0, :5] = 1e-38  # tiny values: subnormal dequantized products
    lens = [T // 3, 0, T // 3, T - 2 * (T // 3)]  # odd lengths, an empty document
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    return do.to(torch.bfloat16), o.to(torch.bfloat16), cu


def _slow_delta(do_q, o):
    """The documented order with numpy float32 scalars (IEEE single, RNE, no FMA)."""
    dq = do_q.dequantize().numpy()
    of = o.to(torch.float32).numpy()
    T, H, D = dq.shape
    out = np.zeros((H, T), dtype=np.float32)
    with np.errstate(all="ignore"):
        for t in range(T):
            for h in range(H):
                lanes = []
                for k in range(D // 16):
                    acc = np.float32(dq[t, h, 16 * k] * of[t, h, 16 * k])
                    for i in range(16 * k + 1, 16 * k + 16):
                        acc = np.float32(acc + np.float32(dq[t, h, i] * of[t, h, i]))
                    lanes.append(acc)
                while len(lanes) > 1:
                    lanes = [np.float32(lanes[j] + lanes[j + 1]) for j in range(0, len(lanes), 2)]
                out[h, t] = lanes[0]
    return torch.from_numpy(out)


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("tag", list(DO_SPECS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("outliers", [False, True])
def test_delta_matches_float64_rowsum(tag, D, outliers):
    do, o, cu = _inputs(D=D, seed=D, outliers=outliers)
    q = quantize(do, DO_SPECS[tag], cu)
    d = delta_from_quantized(q, o)
    assert d.shape == (do.shape[1], do.shape[0]) and d.dtype == torch.float32 and d.is_contiguous()
    p64 = q.dequantize().double() * o.double()
    ref = p64.sum(-1).transpose(0, 1)
    absum = p64.abs().sum(-1).transpose(0, 1)
    # 15 in-lane adds + log2(D/16) tree adds: |err| <= gamma_18 * sum|p| (products are exact)
    err = (d.double() - ref).abs()
    assert (err <= 1.2e-6 * absum).all()
    rel = err / ref.abs().clamp_min(1e-30)
    assert rel.median() < 1e-6


@pytest.mark.parametrize("tag", list(DO_SPECS))
@pytest.mark.parametrize("D", [64, 128])
def test_delta_bitwise_order_and_determinism(tag, D):
    do, o, cu = _inputs(T=23, H=2, D=D, seed=3 + D, outliers=True)
    q = quantize(do, DO_SPECS[tag], cu)
    a, b = delta_from_quantized(q, o), delta_from_quantized(q, o.clone())
    assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(a), _bits(_slow_delta(q, o)))


def test_delta_order_is_not_torch_sum():
    """The fixed order matters: a row where sequential lane sums and the tree differ from a
    plain left-to-right sum (so an implementation that ignores the order would be caught)."""
    D = 128
    do = torch.zeros(1, 1, D)
    do[0, 0, :32] = 1.0  # dequantizes to exactly 1: the products are o
    o = torch.zeros(1, 1, D)
    o[0, 0, 0] = 2.0 ** 24
    o[0, 0, 1:32] = 1.0  # lane 0 loses each of its 15 ones against 2^24; lane 1 keeps its 16
    q = quantize(do.to(torch.bfloat16), DO_SPECS["e4m3_tok_ceil"])
    d = delta_from_quantized(q, o.to(torch.bfloat16))
    p = (q.dequantize() * o).view(-1)
    seq = torch.zeros((), dtype=torch.float32)
    for v in p:
        seq = seq + v  # plain left to right: every one is lost
    assert float(seq) == 2.0 ** 24 and float(p.double().sum()) == 2.0 ** 24 + 31
    assert float(d) == 2.0 ** 24 + 16


def test_delta_nan_and_zero_rows():
    do, o, cu = _inputs(T=10, H=2, D=64, seed=1)
    do[4, 1, 7] = float("nan")
    do[6] = 0.0
    q = quantize(do, DO_SPECS["e4m3_tok_ceil"], cu)
    d = delta_from_quantized(q, o)
    nan = torch.isnan(d)
    assert nan[1, 4] and int(nan.sum()) == 1
    assert (d[:, 6] == 0).all()


def test_delta_refuses_what_the_kernel_does_not_compute():
    do, o, _ = _inputs(T=4, H=1, D=64)
    q = quantize(do, DO_SPECS["e4m3_tok_ceil"])
    with pytest.raises(ValueError, match="shape"):
        delta_from_quantized(q, o[:, :, :32])
    with pytest.raises(ValueError, match="floating-point"):
        delta_from_quantized(q, o.view(torch.int16))
    with pytest.raises(ValueError, match="Hadamard"):
        delta_from_quantized(quantize(do, OperandQuant(format="e4m3", granularity="token", exponent_rule="ceil",
                                                       hadamard=True)), o)
    with pytest.raises(ValueError, match="8-bit"):
        delta_from_quantized(quantize(do, OperandQuant(format="e2m1", granularity="nvfp4", block=16)), o)
    with pytest.raises(ValueError, match="16 times a power of two"):
        delta_from_quantized(quantize(do[:, :, :48], DO_SPECS["e4m3_tok_ceil"]), o[:, :, :48])


@pytest.mark.gpu
@pytest.mark.parametrize("tag", list(DO_SPECS))
def test_delta_cpu_cuda_bitwise(tag):
    do, o, cu = _inputs(T=300, H=4, D=128, seed=7, outliers=True)
    a = delta_from_quantized(quantize(do, DO_SPECS[tag], cu), o)
    b = delta_from_quantized(quantize(do.cuda(), DO_SPECS[tag], cu.cuda()), o.cuda())
    assert torch.equal(_bits(a), _bits(b.cpu()))
