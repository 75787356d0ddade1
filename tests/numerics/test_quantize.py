"""The quantizer emulator against docs/quantizer-contract.md, and the Hadamard rotation.

An independent slow reference (Python loops over documents and blocks, math.frexp exponents,
torch's fp8 casts for the codes) checks the vectorized implementation bit for bit."""

import math
import time
import zlib

import pytest
import torch

from flamia_gen.numerics import formats as F
from flamia_gen.numerics.hadamard import fwht, hadamard_matrix
from flamia_gen.numerics.quantize import (Quantized, fake_quantize, pow2_exponent, quantize,
                                          token_block_ids)
from flamia_gen.spec.enums import ExponentRule, Format, Granularity
from flamia_gen.spec.route import OperandQuant

TORCH_FP8 = {Format.e4m3: torch.float8_e4m3fn, Format.e5m2: torch.float8_e5m2}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def oq(fmt="e4m3", gran="token_block", rule="ceil", **kw):
    if gran == "nvfp4":
        return OperandQuant(format="e2m1", granularity="nvfp4", block=16, **kw)
    return OperandQuant(format=fmt, granularity=gran, exponent_rule=rule, **kw)


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def rand_x(T, H=3, D=64, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D, generator=g)
    # per-token magnitudes over many octaves, plus outlier elements
    x = x * torch.exp2(torch.randint(-12, 12, (T, H, 1), generator=g).float())
    if outliers:
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 200),), generator=g)
        x.view(-1)[idx] *= 1000.0
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------- slow reference
def ref_exponent(amax: float, fmt: Format, rule: ExponentRule):
    """None for a NaN/Inf block."""
    fi = F.format_info(fmt)
    if math.isnan(amax) or math.isinf(amax):
        return None
    if amax == 0:
        return -127
    e0 = math.frexp(amax)[1] - 1
    e = e0 - fi.emax
    if rule is ExponentRule.ceil and amax > fi.max * 2.0 ** (e0 - fi.emax):
        e += 1
    return max(-127, min(127, e))


def ref_block_codes(y: torch.Tensor, e, fmt: Format) -> torch.Tensor:
    if e is None:
        return torch.full(y.shape, 0x7F, dtype=torch.uint8)
    if e == -127 and float(y.abs().max()) == 0:
        return torch.zeros(y.shape, dtype=torch.uint8)
    v = y * torch.tensor(2.0 ** -e, dtype=torch.float32)
    m = F.format_info(fmt).max
    return v.clamp(-m, m).to(TORCH_FP8[fmt]).view(torch.uint8)


def ref_blocks(T, cu, blk):
    """Document-local token blocks as (start, stop) pairs, by brute force."""
    bounds = [0, T] if cu is None else cu.tolist()
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        out += [(b, min(b + blk, e)) for b in range(s, e, blk)]
    return out


def ref_quantize(x, spec, cu=None, axis=-1):
    """(codes, scales) per the contract with loops; scales as in the module docstring."""
    y = x.float()
    if spec.hadamard:
        y = fwht(y)
    fmt, rule, g = spec.format, spec.exponent_rule, spec.granularity
    codes = torch.zeros(y.shape, dtype=torch.uint8)

    def do(sl, target_scale, sidx):
        blk = y[sl]
        e = ref_exponent(float(blk.abs().max()), fmt, rule)
        codes[sl] = ref_block_codes(blk, e, fmt)
        target_scale[sidx] = 255 if e is None else e + 127

    if g is Granularity.tensor:
        scales = torch.zeros(1, dtype=torch.uint8)
        do((...,), scales, 0)
    elif g is Granularity.token:
        T, H, _ = y.shape
        scales = torch.zeros(T, H, dtype=torch.uint8)
        for t in range(T):
            for h in range(H):
                do((t, h), scales, (t, h))
    elif g is Granularity.token_block:
        T, H, _ = y.shape
        scales = torch.zeros(T, H, dtype=torch.uint8)
        for s, e in ref_blocks(T, cu, 32):
            for h in range(H):
                do((slice(s, e), h), scales, (slice(s, e), h))
    elif g is Granularity.block1d_32 and axis == -1:
        T, H, D = y.shape
        scales = torch.zeros(T, H, D // 32, dtype=torch.uint8)
        for t in range(T):
            for h in range(H):
                for j in range(D // 32):
                    do((t, h, slice(32 * j, 32 * j + 32)), scales, (t, h, j))
    elif g is Granularity.block1d_32 and axis == 0:
        T, H, D = y.shape
        scales = torch.zeros(T, H, D, dtype=torch.uint8)
        for s, e in ref_blocks(T, cu, 32):
            for h in range(H):
                for d in range(D):
                    do((slice(s, e), h, d), scales, (slice(s, e), h, d))
    elif g is Granularity.square_32:
        *lead, M, N = y.shape
        yy = y.reshape(-1, M, N)
        cc = codes.view(-1, M, N)
        scales = torch.zeros(yy.shape[0], -(-M // 32), -(-N // 32), dtype=torch.uint8)
        for h in range(yy.shape[0]):
            for i in range(0, M, 32):
                for j in range(0, N, 32):
                    blk = yy[h, i:i + 32, j:j + 32]
                    e = ref_exponent(float(blk.abs().max()), fmt, rule)
                    cc[h, i:i + 32, j:j + 32] = ref_block_codes(blk, e, fmt)
                    scales[h, i // 32, j // 32] = 255 if e is None else e + 127
        scales = scales.reshape(*lead, scales.shape[-2], scales.shape[-1])
    else:
        raise AssertionError(g)
    return codes, scales


CASES = [
    ("token", "ceil", -1), ("token", "floor", -1), ("token_block", "ceil", -1), ("token_block", "floor", -1),
    ("block1d_32", "ceil", -1), ("block1d_32", "floor", -1), ("block1d_32", "ceil", 0), ("block1d_32", "floor", 0),
    ("tensor", "ceil", -1), ("tensor", "floor", -1),
]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("gran,rule,axis", CASES)
def test_matches_slow_reference(fmt, gran, rule, axis):
    lens = [5, 70, 1, 33] if axis == -1 else [37, 1, 40]
    T = sum(lens)
    x = rand_x(T, H=2, D=64, seed=zlib.crc32(f"{gran}{rule}{axis}{fmt}".encode()) % 1000)
    x[3, 1] = 0.0  # an all-zero token row
    x[3, 1, 5] = -0.0
    cu = cu_of(lens)
    spec = oq(fmt, gran, rule)
    got = quantize(x, spec, cu, axis=axis)
    codes, scales = ref_quantize(x, spec, cu, axis=axis)
    assert got.codes.dtype == torch.uint8 and got.scales.dtype == torch.uint8
    assert torch.equal(got.codes, codes)
    assert torch.equal(got.scales, scales)


@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_square_32_matches_slow_reference(rule):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 70, 45, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 70, 1), generator=g).float())
    x[1, 32:64, 32:45] = 0
    spec = oq("e4m3", "square_32", rule)
    got = quantize(x, spec)
    codes, scales = ref_quantize(x, spec)
    assert got.scales.shape == (2, 3, 2) and got.codes_t is None
    assert torch.equal(got.codes, codes) and torch.equal(got.scales, scales)
    assert got.scales[1, 1, 1] == 0
    got2 = quantize(x[0], spec)  # 2-D input
    assert torch.equal(got2.codes, codes[0]) and torch.equal(got2.scales, scales[0])
    deq = got.dequantize()
    assert deq.shape == x.shape
    e = got.exponents.repeat_interleave(32, 1).repeat_interleave(32, 2)[:, :70, :45]
    assert torch.equal(deq, F.decode_e4m3(got.codes) * torch.exp2(e.float()))


def test_pow2_exponent_against_frexp():
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(0, 0x7F800000, (20000,), generator=g, dtype=torch.int32)
    a = torch.cat([bits.view(torch.float32), torch.tensor([0.0, 448.0, 448.00003, 1.75, 1.7500001, 2.0 ** -149,
                                                           3 * 2.0 ** -140, 57344.0, 57344.004,
                                                           math.inf, math.nan, 3.4e38])])
    for fmt in (Format.e4m3, Format.e5m2):
        for rule in ExponentRule:
            e, zero, bad = pow2_exponent(a, fmt, rule)
            want = [ref_exponent(v, fmt, rule) for v in a.tolist()]
            assert bad.tolist() == [w is None for w in want]
            assert zero.tolist() == [v == 0 for v in a.tolist()]
            assert e.tolist() == [0 if w is None else w for w in want]


def test_ceil_exponent_minimal_and_exact_boundary():
    # 448·2^k is the largest amax of exponent k-8 under ceil; one ulp more needs k-7
    amax = torch.tensor([448.0, 448.00003, 1.75 * 2.0 ** -3, 256.0, 255.99998])
    e, _, _ = pow2_exponent(amax, Format.e4m3, ExponentRule.ceil)
    assert e.tolist() == [0, 1, -11, 0, 0]  # 255.99998 > 1.75·2^7: ceil goes up
    e, _, _ = pow2_exponent(amax, Format.e4m3, ExponentRule.floor)
    assert e.tolist() == [0, 0, -11, 0, -1]


@pytest.mark.parametrize("gran,axis", [("token", -1), ("token_block", -1), ("block1d_32", -1),
                                       ("block1d_32", 0), ("tensor", -1)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_ceil_never_saturates(gran, axis, fmt):
    fi = F.format_info(Format(fmt))
    for seed, outliers in ((0, False), (1, True), (2, True)):
        x = rand_x(150, H=3, D=64, seed=seed, outliers=outliers)
        x[17, 1, 3] = 1.9 * 2.0 ** 40  # just below the next power of two: floor would saturate
        cu = cu_of([20, 100, 30])
        q = quantize(x, oq(fmt, gran, "ceil"), cu, axis=axis)
        e = _expanded_exponents(q, x.shape).double()
        scaled = x.double() * torch.exp2(-e)
        assert float(scaled.abs().max()) <= fi.max  # amax·2^-e ≤ fmax for every block
        # ... and e is the smallest such exponent (except clamped blocks)
        amax_blocks = _expanded_block_amax(x.float().abs(), q, cu, axis)
        assert bool((amax_blocks * torch.exp2(-(e - 1)) > fi.max).all())
        # no code at ±max unless the scaled value itself rounds there (the tie below max)
        at_max = (q.codes & 0x7F) == fi.max_code
        assert bool((scaled.abs()[at_max] >= fi.max - 2.0 ** (fi.emax - fi.man_bits - 1)).all())


def _expanded_exponents(q: Quantized, shape):
    e = q.exponents
    g = q.spec.granularity
    if g is Granularity.tensor:
        return e.expand(shape)
    if g in (Granularity.token, Granularity.token_block):
        return e.unsqueeze(-1).expand(shape)
    if g is Granularity.block1d_32 and q.axis == -1:
        return e.repeat_interleave(32, -1)
    return e


def _expanded_block_amax(a, q, cu, axis):
    g = q.spec.granularity
    if g is Granularity.tensor:
        return a.max().double().expand(a.shape)
    if g is Granularity.token:
        return a.amax(-1, keepdim=True).double().expand(a.shape)
    if g is Granularity.block1d_32 and axis == -1:
        T, H, D = a.shape
        return a.view(T, H, D // 32, 32).amax(-1, keepdim=True).expand(T, H, D // 32, 32).reshape(a.shape).double()
    out = torch.empty_like(a, dtype=torch.float64)
    for s, e in ref_blocks(a.shape[0], cu, 32):
        m = a[s:e].amax(0, keepdim=True)
        if g is Granularity.token_block:
            m = m.amax(-1, keepdim=True)
        out[s:e] = m.double()
    return out


def test_floor_saturates_constructed_block():
    x = torch.ones(4, 1, 32) * 0.5
    x[1, 0, 7] = 1.9 * 2.0 ** 5  # amax = 1.9·2^5: floor exponent 5-8, scaled amax 486.4 > 448
    for gran in ("token", "token_block", "block1d_32"):
        qf = quantize(x, oq("e4m3", gran, "floor"))
        qc = quantize(x, oq("e4m3", gran, "ceil"))
        assert qf.codes[1, 0, 7] == 0x7E, gran  # clamped to 448
        assert float(qf.dequantize()[1, 0, 7]) == 448 * 2.0 ** -3 < float(x[1, 0, 7])
        assert _expanded_exponents(qf, x.shape)[1, 0, 7] == -3
        assert _expanded_exponents(qc, x.shape)[1, 0, 7] == -2
        assert qc.codes[1, 0, 7] != 0x7E
        assert abs(float(qc.dequantize()[1, 0, 7]) - 60.8) <= 60.8 * 2.0 ** -4


def test_token_block_layout_and_doc_starts():
    lens = [5, 65, 1, 29]
    cu = cu_of(lens)
    ids, nb = token_block_ids(cu, 100, 32, torch.device("cpu"))
    want = []
    for i, (s, e) in enumerate(ref_blocks(100, cu, 32)):
        want += [i] * (e - s)
    assert ids.tolist() == want and nb == 6
    x = rand_x(100, H=2, D=64, seed=3)
    q = quantize(x, oq("e4m3", "token_block"), cu)
    assert q.scales.shape == (100, 2)
    for s, e in ref_blocks(100, cu, 32):
        assert bool((q.scales[s:e] == q.scales[s]).all())
    # a huge value in the last token of doc 1 does not reach doc 2's first block
    x2 = x.clone()
    x2[4] *= 2 ** 20
    q2 = quantize(x2, oq("e4m3", "token_block"), cu)
    assert not torch.equal(q2.scales[:5], q.scales[:5])
    assert torch.equal(q2.scales[5:], q.scales[5:]) and torch.equal(q2.codes[5:], q.codes[5:])
    # without cu_seqlens, blocks are 32-aligned over the whole tensor
    q3 = quantize(x, oq("e4m3", "token_block"))
    assert bool((q3.scales[:32] == q3.scales[0]).all()) and bool((q3.scales[32:64] == q3.scales[32]).all())


DOC_LOCAL = [("token", -1), ("token_block", -1), ("block1d_32", -1), ("block1d_32", 0), ("static", -1)]


@pytest.mark.parametrize("gran,axis", DOC_LOCAL)
def test_document_local(gran, axis):
    lens = [45, 60, 23]
    cu = cu_of(lens)
    x = rand_x(sum(lens), H=2, D=64, seed=5)
    spec = OperandQuant(format="e4m3", granularity="static", static_exponent=-4) if gran == "static" else oq("e4m3", gran)
    q = quantize(x, spec, cu, axis=axis)
    x2 = x.clone()
    x2[45:105] = (x2[45:105].float() * 1e4 + 3).to(torch.bfloat16)  # change document 2 entirely
    q2 = quantize(x2, spec, cu, axis=axis)
    sel = [slice(0, 45), slice(105, 128)]  # documents 1 and 3
    for s in sel:
        assert torch.equal(q.codes[s], q2.codes[s])
        if q.scales.dim() > 1:
            assert torch.equal(q.scales[s], q2.scales[s])
    assert not torch.equal(q.codes[45:105], q2.codes[45:105])


@pytest.mark.parametrize("gran", ["tensor", "nvfp4"])
def test_tensor_wide_granularities_leak(gran):
    # the positive control of test_document_local: these DO move other documents
    lens = [45, 60]
    x = rand_x(105, H=2, D=64, seed=5, outliers=False)
    x2 = x.clone()
    x2[50] *= 2 ** 12
    q, q2 = quantize(x, oq("e4m3", gran), cu_of(lens)), quantize(x2, oq("e4m3", gran), cu_of(lens))
    assert not torch.equal(q.codes[:45], q2.codes[:45]) or not torch.equal(q.scales, q2.scales)


def test_square_32_tile_local():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=g)
    q = quantize(x, oq("e4m3", "square_32"))
    x2 = x.clone()
    x2[32:64, 32:64] *= 1e5
    q2 = quantize(x2, oq("e4m3", "square_32"))
    mask = torch.ones(64, 96, dtype=torch.bool)
    mask[32:64, 32:64] = False
    assert torch.equal(q.codes[mask], q2.codes[mask])
    smask = torch.ones(2, 3, dtype=torch.bool)
    smask[1, 1] = False
    assert torch.equal(q.scales[smask], q2.scales[smask]) and q.scales[1, 1] != q2.scales[1, 1]


@pytest.mark.parametrize("T", [1, 16, 37, 100])
def test_codes_t(T):
    x = rand_x(T, H=3, D=64, seed=T)
    q = quantize(x, oq("e4m3", "token"))
    t_pad = -(-T // 16) * 16
    assert q.codes_t.shape == (3, 64, t_pad) and q.codes_t.dtype == torch.uint8
    assert torch.equal(q.codes_t[:, :, :T], q.codes.permute(1, 2, 0))
    assert bool((q.codes_t[:, :, T:] == 0).all())
    assert quantize(x, oq("e4m3", "token"), transposed=False).codes_t is None
    assert quantize(x, oq(gran="nvfp4")).codes_t is None
    with pytest.raises(ValueError):
        quantize(x, oq(gran="nvfp4"), transposed=True)


@pytest.mark.parametrize("gran,axis", [("token", -1), ("token_block", -1), ("block1d_32", -1), ("block1d_32", 0)])
def test_nan_inf_zero_blocks(gran, axis):
    lens = [40, 40]
    cu = cu_of(lens)
    x = rand_x(80, H=2, D=64, seed=9, outliers=False).float()
    x[3, 0, 10] = math.nan
    x[50, 1, 40] = -math.inf
    x[70:80, 1] = 0.0
    x[75, 1, 3] = -0.0
    q = quantize(x, oq("e4m3", gran), cu, axis=axis)
    e = _expanded_exponents(q, x.shape)
    deq = q.dequantize()
    for (t, h, d) in ((3, 0, 10), (50, 1, 40)):
        assert e[t, h, d] == 128  # scale code 0xFF
        assert q.codes[t, h, d] == 0x7F
    bad = e == 128
    assert torch.equal(bad, q.codes == 0x7F)
    assert bool((q.codes[bad] == 0x7F).all()) and bool(deq[bad].isnan().all())
    assert bool(deq[~bad].isfinite().all())
    # blocks without NaN/Inf are untouched: compare with the clean input
    clean = x.clone()
    clean[3, 0, 10] = 0.0
    clean[50, 1, 40] = 0.0
    qc = quantize(clean, oq("e4m3", gran), cu, axis=axis)
    assert torch.equal(q.codes[~bad], qc.codes[~bad])
    # the zero blocks (every granularity's blocks covering tokens 72..79 of head 1 are all
    # zero): scale code 0 (e = -127), codes all 0x00, -0.0 included
    assert bool((e[72:80, 1] == -127).all())
    assert bool((q.codes[72:80, 1] == 0).all())
    assert bool((deq[72:80, 1] == 0).all())


def test_tensor_nan_poisons_everything():
    x = rand_x(20, seed=1).float()
    x[7, 1, 2] = math.nan
    q = quantize(x, oq("e4m3", "tensor"))
    assert q.scales.tolist() == [255] and bool((q.codes == 0x7F).all())
    assert bool(q.dequantize().isnan().all())
    qz = quantize(torch.zeros(4, 2, 32), oq("e4m3", "tensor"))
    assert qz.scales.tolist() == [0] and bool((qz.codes == 0).all()) and bool((qz.dequantize() == 0).all())


@pytest.mark.parametrize("gran", ["token", "token_block", "block1d_32", "tensor"])
def test_dequantize_error_bound(gran):
    x = rand_x(200, H=4, D=128, seed=13)
    q = quantize(x, oq("e4m3", gran), cu_of([120, 80]))
    deq = q.dequantize()
    e = _expanded_exponents(q, x.shape).double()
    xs = x.double()
    scaled = xs * torch.exp2(-e)
    err = (deq.double() - xs).abs()
    normal = scaled.abs() >= 2.0 ** -6
    assert int(normal.sum()) > x.numel() // 20  # the bound below is exercised
    assert bool((err[normal] <= 2.0 ** -4 * xs.abs()[normal]).all())
    # subnormal range: at most half a subnormal step (2^-10 · 2^e)
    assert bool((err[~normal] <= 2.0 ** -10 * torch.exp2(e[~normal])).all())
    # dequantize is exactly decode · 2^e
    assert torch.equal(deq, (F.decode_e4m3(q.codes).double() * torch.exp2(e)).float())


def test_static():
    x = torch.tensor([[0.25, 1.0, 1e-9, -3.0, 600.0, math.nan, -math.inf]])
    spec = OperandQuant(format="e4m3", granularity="static", static_exponent=-8)
    q = quantize(x, spec)
    assert q.scales.tolist() == [127 - 8] and q.exponents.tolist() == [-8]
    assert torch.equal(q.codes, F.encode_e4m3(x * 256.0))
    assert q.codes[0, 4] == 0x7E and q.codes[0, 5] == 0x7F and q.codes[0, 6] == 0xFE
    d = q.dequantize()
    assert d[0, :2].tolist() == [0.25, 1.0] and d[0, 4] == 448 / 256


# ---------------------------------------------------------------- NVFP4
def ref_nvfp4(x):
    """Step 4′ with scalar fp32 torch ops per block, torch's E4M3 cast, brute-force E2M1."""
    y = x.float()
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    amax_t = y.abs().max()
    enc = f32(2688.0) / amax_t
    if amax_t == 0 or not torch.isfinite(amax_t):
        enc = f32(1.0)
    ts = f32(1.0) / enc
    T, H, D = y.shape
    sb = torch.zeros(T, H, D // 16, dtype=torch.uint8)
    codes = torch.zeros(T, H, D, dtype=torch.uint8)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            for j in range(D // 16):
                blk = y[t, h, 16 * j:16 * j + 16]
                tb = (blk.abs().max() * enc) / f32(6.0)
                s = tb.clamp(max=448.0).to(torch.float8_e4m3fn)
                sb[t, h, j] = s.view(torch.uint8)
                sv = s.float()
                if sv == 0:
                    continue
                v = (blk * (enc / sv)).double()
                a = v.abs().clamp(max=6.0)
                dist = (a[:, None] - grid[None, :]).abs()
                best = dist == dist.min(1, keepdim=True).values
                c = torch.where(best, torch.arange(8) % 2, torch.full_like(best, 9, dtype=torch.int64)).argmin(1)
                codes[t, h, 16 * j:16 * j + 16] = (c + 8 * (v < 0)).to(torch.uint8)
    return F.pack_e2m1(codes), sb, ts.reshape(1)


def test_nvfp4_matches_reference_and_error():
    x = rand_x(24, H=2, D=64, seed=21, outliers=False)
    x[5, 1, 16:32] = 0.0
    q = quantize(x, oq(gran="nvfp4"))
    codes, sb, ts = ref_nvfp4(x)
    assert q.codes.shape == (24, 2, 32) and q.scales.shape == (24, 2, 4)
    assert torch.equal(q.codes, codes) and torch.equal(q.scales, sb)
    assert torch.equal(q.tensor_scale, ts)
    assert q.scales[5, 1, 1] == 0 and bool((q.codes[5, 1, 8:16] == 0).all())
    # round trip on Gaussian data (one magnitude)
    g = torch.Generator().manual_seed(1)
    xg = torch.randn(256, 4, 128, generator=g)
    d = quantize(xg, oq(gran="nvfp4")).dequantize()
    rel = float((d - xg).norm() / xg.norm())
    assert 0.03 < rel < 0.12
    with pytest.raises(ValueError, match="power-of-two"):
        _ = q.exponents


def test_nvfp4_grid_values_exact():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, 8, (8, 2, 64), generator=g)
    x = grid[idx] * torch.where(torch.rand(8, 2, 64, generator=g) < 0.5, -1.0, 1.0)
    x[..., 0::16] = 6.0  # every block max 6: enc = 448, sb = 448 (0x7E), r = 1
    x = x * 2.0 ** -3
    q = quantize(x, oq(gran="nvfp4"))
    assert bool((q.scales == 0x7E).all())
    assert torch.equal(q.codes, F.pack_e2m1(F.encode_e2m1(x * 8)))
    assert torch.equal(F.decode_e2m1(F.unpack_e2m1(q.codes)), x * 8)  # exactly on the grid
    d = q.dequantize()
    assert bool(((d - x).abs() <= 2.0 ** -23 * x.abs()).all())  # only tensor_scale rounds


def test_nvfp4_nan_block():
    x = rand_x(4, H=1, D=64, seed=2, outliers=False).float()
    x[1, 0, 20] = math.nan
    q = quantize(x, oq(gran="nvfp4"))
    d = q.dequantize()
    assert q.scales[1, 0, 1] == 0x7F
    assert bool(d[1, 0, 16:32].isnan().all())
    assert int(d.isnan().sum()) == 16
    assert q.tensor_scale.isfinite().all()


# ---------------------------------------------------------------- fake_quantize, hadamard, validation
def test_fake_quantize():
    x = rand_x(50, seed=3)
    cu = cu_of([20, 30])
    for spec in (oq("e4m3", "token_block"), oq("e5m2", "token"), oq(gran="nvfp4")):
        assert torch.equal(fake_quantize(x, spec, cu), quantize(x, spec, cu).dequantize())
    xf = torch.randn(10, 2, 64)
    bf = OperandQuant(format="bf16", granularity="none")
    assert torch.equal(fake_quantize(xf, bf), xf.to(torch.bfloat16).float())
    assert torch.equal(fake_quantize(x, oq("e4m3", "block1d_32"), cu, axis=0),
                       quantize(x, oq("e4m3", "block1d_32"), cu, axis=0).dequantize())


def _naive_fwht(y):
    y = y.clone()
    d, h = y.shape[-1], 1
    while h < d:
        for i in range(d):
            if i & h == 0:
                a, b = y[..., i].clone(), y[..., i + h].clone()
                y[..., i], y[..., i + h] = a + b, a - b
        h *= 2
    return y * torch.tensor(1 / math.sqrt(d), dtype=torch.float32)


@pytest.mark.parametrize("d", [1, 2, 64, 128])
def test_fwht_bitwise_contract_order(d):
    g = torch.Generator().manual_seed(d)
    y = torch.randn(300, 2, d, generator=g) * 100
    got = fwht(y)
    assert torch.equal(got, _naive_fwht(y))
    assert torch.equal(got, fwht(y.clone()))  # deterministic
    assert torch.equal(got[7:9], fwht(y[7:9]))  # independent of batching/chunking


def test_fwht_properties():
    for d in (64, 128):
        eye = torch.eye(d)
        h = fwht(eye)
        hm = hadamard_matrix(d)
        assert float((h.double() - hm).abs().max()) < 1e-7  # fwht(I) = H
        assert float((h.double() @ h.double().T - torch.eye(d, dtype=torch.float64)).abs().max()) < 1e-6
        y = torch.randn(100, d)
        ref = y.double() @ hm
        assert float((fwht(y).double() - ref).norm() / ref.norm()) < 1e-6
        assert float((fwht(fwht(y)) - y).abs().max()) < 1e-5  # involution
        q, k = torch.randn(50, d), torch.randn(60, d)
        s, sr = q.double() @ k.double().T, fwht(q).double() @ fwht(k).double().T
        assert float((s - sr).norm() / s.norm()) < 1e-6
    assert fwht(torch.ones(1, 64))[0, 0] == 8.0  # 64 / sqrt(64)
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.ones(3, 48))


def test_hadamard_quantize_is_rotated_quantize():
    x = rand_x(40, H=2, D=128, seed=8)
    cu = cu_of([10, 30])
    qh = quantize(x, oq("e4m3", "token_block", hadamard=True), cu)
    qp = quantize(fwht(x.float()), oq("e4m3", "token_block"), cu)
    assert torch.equal(qh.codes, qp.codes) and torch.equal(qh.scales, qp.scales)
    # rotated q and k, quantized, still give q·kᵀ (up to quantization error)
    q, k = rand_x(64, H=1, D=128, seed=1, outliers=False), rand_x(64, H=1, D=128, seed=2, outliers=False)
    sp = oq("e4m3", "token", hadamard=True)
    s = q.double()[:, 0] @ k.double()[:, 0].T
    sh = fake_quantize(q, sp).double()[:, 0] @ fake_quantize(k, sp).double()[:, 0].T
    assert float((s - sh).norm() / s.norm()) < 0.05


def test_validation_errors():
    x = torch.randn(10, 2, 64)
    with pytest.raises(ValueError, match=r"x must have shape \(T, H, D\)"):
        quantize(torch.randn(10, 64), oq("e4m3", "token"))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        quantize(torch.ones(10, 2, 64, dtype=torch.int32), oq("e4m3", "token"))
    with pytest.raises(ValueError, match="int32"):
        quantize(x, oq(), torch.tensor([0, 10], dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0"):
        quantize(x, oq(), torch.tensor([1, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens not monotonic at index 2"):
        quantize(x, oq(), torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal T"):
        quantize(x, oq(), torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        quantize(x, oq(), torch.tensor([[0, 10]], dtype=torch.int32))
    with pytest.raises(ValueError, match="same device"):
        quantize(x, oq(), torch.tensor([0, 10], dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="axis"):
        quantize(x, oq("e4m3", "token"), axis=0)
    with pytest.raises(ValueError, match="multiple"):
        quantize(torch.randn(4, 2, 48), oq("e4m3", "block1d_32"))
    with pytest.raises(ValueError, match="square_32"):
        quantize(torch.randn(2, 32, 32), oq("e4m3", "square_32"), torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="bf16"):
        quantize(x, OperandQuant(format="bf16", granularity="none"))
    # empty documents are fine
    q = quantize(x, oq(), torch.tensor([0, 0, 4, 4, 10], dtype=torch.int32))
    assert torch.equal(q.codes, quantize(x, oq(), torch.tensor([0, 4, 10], dtype=torch.int32)).codes)


def test_large_many_documents_fast():
    """T = 65536, H = 16, D = 128 with 2048 documents: the grouping must be vectorized."""
    T, H, D = 65536, 16, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, D, generator=g, dtype=torch.float32).to(torch.bfloat16)
    cu = torch.arange(0, T + 1, 32, dtype=torch.int32)
    cu = torch.cat([cu[:1], (cu[1:] - 7).clamp(min=0), torch.tensor([T], dtype=torch.int32)]).unique()
    t0 = time.perf_counter()
    q = quantize(x, oq("e4m3", "token_block"), cu.to(torch.int32))
    dt = time.perf_counter() - t0
    assert q.codes.shape == (T, H, D) and q.codes_t.shape == (H, D, T)
    assert dt < 30.0, f"quantize took {dt:.1f} s"
    # block boundaries follow the documents (spot check on the first two documents)
    assert bool((q.scales[0:25] == q.scales[0]).all()) and bool((q.scales[25:57] == q.scales[25]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("gran,axis", [("tensor", -1), ("token", -1), ("token_block", -1), ("block1d_32", -1),
                                       ("block1d_32", 0), ("nvfp4", -1), ("square_32", -1)])
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_cuda_matches_cpu(gran, axis, rule):
    lens = [5, 70, 1, 33, 200]
    cu = cu_of(lens)
    x = rand_x(sum(lens), H=3, D=128, seed=4).float()
    x[7, 1, 3] = math.nan
    x[100, 2, 64:96] = 0.0
    x[150:160, 0] = 0.0
    spec = oq("e4m3", gran, rule, hadamard=(gran == "token"))
    kw = {} if gran == "square_32" else {"cu_seqlens": cu}
    if gran == "square_32":
        x = x[:, :, :100].permute(1, 0, 2)
    cpu = quantize(x, spec, axis=axis, **kw)
    gkw = {k: v.cuda() for k, v in kw.items()}
    gpu = quantize(x.cuda(), spec, axis=axis, **gkw)
    for name in ("codes", "scales", "codes_t", "tensor_scale"):
        a, b = getattr(cpu, name), getattr(gpu, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert b.is_cuda
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                               (b.view(torch.uint8) if b.dtype != torch.uint8 else b).cpu()), name
    da, db = cpu.dequantize(), gpu.dequantize().cpu()
    assert torch.equal(da.isnan(), db.isnan()) and torch.equal(da.nan_to_num(), db.nan_to_num())
