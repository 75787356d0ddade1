"""Bit-exactness of the element formats against torch's casts and the format definitions."""

import math

import pytest
import torch

from flamia_gen.numerics import formats as F
from flamia_gen.spec.enums import Format

TORCH_FP8 = {Format.e4m3: torch.float8_e4m3fn, Format.e5m2: torch.float8_e5m2}
ENC = {Format.e4m3: F.encode_e4m3, Format.e5m2: F.encode_e5m2}
DEC = {Format.e4m3: F.decode_e4m3, Format.e5m2: F.decode_e5m2}
# smallest |x| whose RNE result is beyond the largest finite value
OVERFLOW_AT = {Format.e4m3: 464.0, Format.e5m2: 61440.0}
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _torch_codes(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    return x.to(TORCH_FP8[fmt]).view(torch.uint8)


def _random_inputs(n: int, seed: int) -> torch.Tensor:
    """Full-range fp32 bit patterns plus values concentrated on the fp8 ranges, ties,
    subnormals and the neighbourhood of the max."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    scaled = torch.randn(n, generator=g) * torch.exp2(torch.randint(-28, 18, (n,), generator=g).float())
    # exact midpoints between neighbouring E4M3 / E5M2 values (ties) and their fp32 neighbours
    mids = []
    for fmt in (Format.e4m3, Format.e5m2):
        v = DEC[fmt](torch.arange(256, dtype=torch.uint8))
        v = v[torch.isfinite(v) & (v >= 0)].sort().values
        m = (v[1:].double() + v[:-1].double()) / 2
        m = m.float()
        mids += [m, torch.nextafter(m, torch.tensor(math.inf)), torch.nextafter(m, torch.tensor(0.0))]
    mids = torch.cat(mids)
    mids = torch.cat([mids, -mids])
    sub = torch.randint(-0x7FFFFF, 0x7FFFFF, (n // 8,), generator=g, dtype=torch.int32).view(torch.float32)  # fp32 subnormals
    return torch.cat([raw, scaled, mids, sub])


@pytest.mark.parametrize("fmt", [Format.e4m3, Format.e5m2])
def test_decode_all_codes_match_torch(fmt):
    c = torch.arange(256, dtype=torch.uint8)
    ref = c.view(TORCH_FP8[fmt]).float()
    got = DEC[fmt](c)
    assert torch.equal(got.isnan(), ref.isnan())
    fin = ~ref.isnan()
    assert torch.equal(_bits(got[fin]), _bits(ref[fin]))  # signed zeros and infinities included
    assert got.dtype == torch.float32
    assert torch.equal(_bits(F.decode(c, fmt)[fin]), _bits(ref[fin]))


def test_decode_specials_and_extremes():
    d4 = F.decode_e4m3(torch.tensor([0x7E, 0xFE, 0x7F, 0xFF, 0x01, 0x08, 0x80], dtype=torch.uint8))
    assert d4[0] == 448 and d4[1] == -448 and d4[2].isnan() and d4[3].isnan()
    assert d4[4] == 2.0 ** -9 and d4[5] == 2.0 ** -6
    assert _bits(d4[6:7]).item() == _bits(torch.tensor([-0.0])).item()
    d5 = F.decode_e5m2(torch.tensor([0x7B, 0x7C, 0xFC, 0x7D, 0x01], dtype=torch.uint8))
    assert d5[0] == 57344 and d5[1] == math.inf and d5[2] == -math.inf and d5[3].isnan()
    assert d5[4] == 2.0 ** -16


@pytest.mark.parametrize("fmt", [Format.e4m3, Format.e5m2])
def test_encode_matches_torch_in_range(fmt):
    x = _random_inputs(1 << 20, seed=1 if fmt is Format.e4m3 else 2)
    assert x.numel() >= 1_000_000
    ref = _torch_codes(x, fmt)
    sat, nonsat = ENC[fmt](x), ENC[fmt](x, saturate=False)
    in_range = ~x.isnan() & (x.abs() <= OVERFLOW_AT[fmt]) if fmt is Format.e4m3 else \
        ~x.isnan() & (x.abs() < OVERFLOW_AT[fmt])
    assert int(in_range.sum()) > 500_000
    mism = (sat != ref) & in_range
    assert int(mism.sum()) == 0, (x[mism][:5], sat[mism][:5], ref[mism][:5])
    assert torch.equal(nonsat[in_range], sat[in_range])
    # ties, subnormals and signed zeros are in there
    assert int((x[in_range].abs() < 2.0 ** -6).sum()) > 1000
    assert bool((sat == 0x80).any()) and bool((sat == 0x00).any())


@pytest.mark.parametrize("fmt", [Format.e4m3, Format.e5m2])
def test_encode_out_of_range_and_specials(fmt):
    fi = F.format_info(fmt)
    big = torch.tensor([OVERFLOW_AT[fmt] * 1.0001, 1e6, 3e38, math.inf])
    big = torch.cat([big, -big])
    sat = ENC[fmt](big)
    assert sat.tolist() == [fi.max_code] * 4 + [fi.max_code | 0x80] * 4
    nonsat = ENC[fmt](big, saturate=False)
    assert nonsat.tolist() == [fi.overflow_code] * 4 + [fi.overflow_code | 0x80] * 4
    dec = DEC[fmt](nonsat)
    if fmt is Format.e4m3:
        assert bool(dec.isnan().all())
    else:
        assert dec.tolist() == [math.inf] * 4 + [-math.inf] * 4
    # torch's cast of out-of-range values is either saturating or not, version dependent: it
    # must agree with one of the two modes on every finite input.
    ref = _torch_codes(big[torch.isfinite(big)], fmt)
    assert torch.equal(ref, sat[torch.isfinite(big)]) or torch.equal(ref, nonsat[torch.isfinite(big)])
    # NaN → canonical positive NaN, either sign, both modes
    nan = torch.tensor([math.nan, -math.nan, torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32).item()])
    assert ENC[fmt](nan).tolist() == [0x7F] * 3
    assert ENC[fmt](nan, saturate=False).tolist() == [0x7F] * 3


def test_near_max_rounding_e4m3():
    x = torch.tensor([448.0, 456.0, 463.99997, 464.0, 464.00003, 479.0, 480.0])
    assert F.encode_e4m3(x).tolist() == [0x7E] * 7
    assert F.encode_e4m3(x, saturate=False).tolist() == [0x7E] * 4 + [0x7F] * 3
    # 416 is 0x7D; the tie 432 between 416 and 448 goes to even (448 = mantissa 110)
    assert F.encode_e4m3(torch.tensor([416.0, 432.0, 431.99997])).tolist() == [0x7D, 0x7E, 0x7D]


def test_near_max_rounding_e5m2():
    x = torch.tensor([57344.0, 61439.996, 61440.0, 65536.0])
    assert F.encode_e5m2(x).tolist() == [0x7B] * 4
    assert F.encode_e5m2(x, saturate=False).tolist() == [0x7B, 0x7B, 0x7C, 0x7C]


@pytest.mark.parametrize("fmt", [Format.e4m3, Format.e5m2])
def test_ties_round_to_even(fmt):
    v = DEC[fmt](torch.arange(256, dtype=torch.uint8))
    pos = torch.isfinite(v) & (v >= 0) & ~((torch.arange(256) == 0x80))
    codes = torch.arange(256)[pos]
    vals = v[pos]
    order = vals.argsort()
    codes, vals = codes[order], vals[order]
    mid = ((vals[1:].double() + vals[:-1].double()) / 2).float()
    assert torch.equal(mid.double(), (vals[1:].double() + vals[:-1].double()) / 2)  # exact ties
    even = torch.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:]).to(torch.uint8)
    assert torch.equal(ENC[fmt](mid), even)
    assert torch.equal(ENC[fmt](-mid), even | 0x80)


@pytest.mark.parametrize("fmt", [Format.e4m3, Format.e5m2])
def test_subnormals_exact(fmt):
    fi = F.format_info(fmt)
    step = 2.0 ** (1 - fi.bias - fi.man_bits)
    k = torch.arange(0, 1 << fi.man_bits)
    assert torch.equal(ENC[fmt](k.float() * step), k.to(torch.uint8))
    assert torch.equal(DEC[fmt](k.to(torch.uint8)), k.float() * step)
    # half the smallest subnormal ties to 0; just above goes to 1; fp32 subnormals go to ±0
    tiny = torch.tensor([step / 2, step / 2 * (1 + 2 ** -20), 1e-45, -1e-45, -0.0, 0.0])
    assert ENC[fmt](tiny).tolist() == [0, 1, 0, 0x80, 0x80, 0]


@pytest.mark.parametrize("fmt", [Format.e4m3, Format.e5m2])
def test_roundtrip_all_finite_codes(fmt):
    c = torch.arange(256, dtype=torch.uint8)
    v = DEC[fmt](c)
    fin = torch.isfinite(v)
    assert torch.equal(ENC[fmt](v[fin]), c[fin])
    assert torch.equal(ENC[fmt](v[fin], saturate=False), c[fin])


def _e2m1_reference(x: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest grid value, ties to the even code, saturating, sign kept."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    a = x.double().abs().clamp(max=6.0)
    dist = (a[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    cand = dist == best
    code_ids = torch.arange(8)
    # among equally near codes pick the even one
    score = torch.where(cand, code_ids % 2, torch.full_like(dist, 99, dtype=torch.int64))
    code = score.argmin(dim=1)
    sign = (x.view(torch.int32) < 0).to(torch.int64) * 8
    return (code + sign).to(torch.uint8)


def test_e2m1_decode_grid():
    c = torch.arange(16, dtype=torch.uint8)
    assert F.decode_e2m1(c).tolist() == E2M1_GRID + [-v for v in E2M1_GRID]
    assert F.decode_e2m1(c)[8].item() == 0.0 and math.copysign(1, F.decode_e2m1(c)[8].item()) == -1


def test_e2m1_encode_matches_reference():
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor(E2M1_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.randn(200_000, generator=g) * 3, grid, -grid, mids, -mids,
                   torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(9.0)),
                   torch.tensor([6.5, 7.0, 1e30, -1e30, math.inf, -math.inf, 0.2, 0.25, 0.2500001])])
    got = F.encode_e2m1(x)
    ref = _e2m1_reference(torch.nan_to_num(x, posinf=1e30, neginf=-1e30))
    assert torch.equal(got, ref)
    assert F.encode_e2m1(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]  # ties to even codes
    assert F.encode_e2m1(torch.tensor([math.nan])).tolist() == [0x7]
    assert torch.equal(F.encode(x, Format.e2m1), got)


def test_e2m1_torch_layout_if_available():
    codes = torch.tensor([[1, 2, 3, 15, 0, 7]], dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3, 0x70]]
    assert torch.equal(F.unpack_e2m1(packed), codes)
    dt = getattr(torch, "float4_e2m1fn_x2", None)
    if dt is None:
        pytest.skip("torch has no float4_e2m1fn_x2")
    try:
        ref = packed.view(dt).to(torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch cannot convert float4_e2m1fn_x2 here: {exc}")
    assert torch.equal(ref.reshape(-1), F.decode_e2m1(codes).reshape(-1))


def test_ue8m0():
    c = torch.arange(256, dtype=torch.uint8)
    d = F.decode_ue8m0(c)
    assert d[255].isnan()
    want = torch.tensor([math.ldexp(1.0, i - 127) for i in range(255)], dtype=torch.float32)
    assert torch.equal(d[:255], want)  # 2^-127 (subnormal) and 2^127 included
    assert torch.equal(F.encode_ue8m0(torch.tensor([-127, 0, 127, -300, 300])),
                       torch.tensor([0, 127, 254, 0, 254], dtype=torch.uint8))
    with pytest.raises(ValueError):
        F.encode_ue8m0(torch.tensor([1.0]))


def test_input_validation():
    with pytest.raises(ValueError, match="x must be a floating-point"):
        F.encode_e4m3(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="codes must be a uint8"):
        F.decode_e4m3(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="bf16"):
        F.encode(torch.tensor([1.0]), Format.bf16)
    with pytest.raises(ValueError):
        F.encode_e2m1(torch.tensor([1.0]), saturate=False)
    with pytest.raises(ValueError, match="even"):
        F.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_bf16_input_and_shapes():
    x = torch.randn(4, 5, 6).to(torch.bfloat16)
    c = F.encode_e4m3(x)
    assert c.shape == (4, 5, 6) and c.dtype == torch.uint8
    assert torch.equal(c, _torch_codes(x.float(), Format.e4m3))
    assert F.decode_e4m3(c).shape == (4, 5, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [Format.e4m3, Format.e5m2, Format.e2m1])
def test_cuda_matches_cpu(fmt):
    x = _random_inputs(1 << 16, seed=5)
    cpu = F.encode(x, fmt)
    gpu = F.encode(x.cuda(), fmt).cpu()
    assert torch.equal(cpu, gpu)
    c = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(_bits(F.decode(c, fmt)), _bits(F.decode(c.cuda(), fmt).cpu()))
