"""CPU-testable pieces of the attention GPU verifier (flamia_gen.verify.attn_gpu)."""

import torch

from flamia_gen.verify.attn_gpu import dump_case, emulator_options


def test_emulator_options_follow_the_kernel():
    fp8 = emulator_options({"q_fmt": "e4m3", "tile_m": 128, "tile_n": 192})
    assert fp8 == dict(tile_m=128, tile_n=192, key_align=16, mma="sm90_fp8")
    bf16 = emulator_options({"q_fmt": "bf16", "tile_m": 128, "tile_n": 128})
    assert bf16 == dict(tile_m=128, tile_n=128, key_align=1, mma="exact")
    # fp8_pv: BF16 Q, K but an E4M3 PV side (Vᵀ TMA alignment, FP8 products under the model)
    pv = emulator_options({"q_fmt": "bf16", "v_fmt": "e4m3", "tile_m": 128, "tile_n": 128})
    assert pv == dict(tile_m=128, tile_n=128, key_align=16, mma="sm90_fp8")
    assert emulator_options({"q_fmt": "bf16", "v_fmt": "bf16", "tile_m": 64, "tile_n": 128})["key_align"] == 1


def test_dump_case_saves_a_loadable_case(tmp_path):
    entry = {"name": "attn_fwd_sm90_x", "uses": ["fp8_token"], "params": {"tile_m": 128, "causal": True}}
    q = torch.randn(5, 2, 4).to(torch.bfloat16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    path = dump_case(tmp_path / "d", entry, "outlier", q=q, cu_seqlens=cu, o=q.float())
    case = torch.load(path)
    assert path.endswith("attn_fwd_sm90_x-outlier.pt")
    assert case["route"] == "fp8_token" and case["kind"] == "outlier" and case["params"]["causal"] is True
    assert torch.equal(case["q"], q) and torch.equal(case["cu_seqlens"], cu) and case["o"].dtype == torch.float32


def test_gradient_floor_is_the_routes_own_only_where_its_emulator_needs_it():
    """fp8_tensor's floor (0.995) sits below the 8-bit 0.997 because its emulator does: E5M2 dS under one
    tensor-wide scale. The emulator (exact sums) must land between the two floors on Gaussian inputs, else
    the exception is stale (too lax) or wrong (the kernel could not pass)."""
    from flamia_gen.numerics.metrics import cosine
    from flamia_gen.numerics.reference import attention, attention_backward
    from flamia_gen.verify.attn_gpu import BWD_FP32_COSINE_8BIT, expected_grad_cosine

    assert expected_grad_cosine("fp8_token") == BWD_FP32_COSINE_8BIT == 0.997
    assert expected_grad_cosine("fp8_pv") == 0.997 and expected_grad_cosine("fp8_tensor") == 0.995
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 512, 1024], dtype=torch.int32)
    q, k, v, do = (torch.randn(1024, 2, 128, generator=g).to(torch.bfloat16).float() for _ in range(4))
    o, lse = attention(q, k, v, cu, causal=True, route="fp8_tensor", return_lse=True)
    emu = attention_backward(q, k, v, o, lse, do, cu, True, "fp8_tensor", tile_m=64, tile_n=128)
    exact = attention_backward(q, k, v, None, None, do, cu, True)
    worst = min(float(cosine(a, b)) for a, b in zip(emu, exact))
    assert expected_grad_cosine("fp8_tensor") <= worst < BWD_FP32_COSINE_8BIT, worst


def test_flip_one_p_flips_the_heaviest_near_midpoint_code_of_each_row():
    """A P̂ whose value before rounding lies within `rel` of an E4M3 midpoint may be rounded the other way by
    the kernel (its scores differ from the model's by ~5e-5 relative): the alternative P̂ flips, per row, the
    heaviest such code only; rows without one are unchanged."""
    from flamia_gen.numerics.reference_route import flip_one_p, quant_p
    from flamia_gen.spec import get_route

    spec = get_route("fp8_token").operands.p  # E4M3, static exponent 8: codes = P·256
    e = torch.tensor([[[184.0088, 98.0, 0.3, 20.0],      # 184.0088: 4.8e-5 relative above the 176 | 192 midpoint
                       [150.0, 98.0, 0.3, 20.0],         # no value near a midpoint
                       [184.0088, 62.003, 0.3, 20.0]]]) / 256  # 62.003: above the 60 | 64 midpoint, lighter
    p_t = quant_p(e, spec)
    assert p_t[0, 0, 0] * 256 == 192 and p_t[0, 2, 1] * 256 == 64
    alt = flip_one_p(e, p_t, torch.zeros_like(e), spec, 2.0 ** -12)
    assert alt[0, 0, 0] * 256 == 176 and torch.equal(alt[0, 0, 1:], p_t[0, 0, 1:])
    assert torch.equal(alt[0, 1], p_t[0, 1])
    assert alt[0, 2, 0] * 256 == 176 and alt[0, 2, 1] * 256 == 64  # one code per row: the heavier
    # a window too narrow for 4.8e-5 flips nothing; the carry (a running reference) sets the weights
    assert torch.equal(flip_one_p(e, p_t, torch.zeros_like(e), spec, 2.0 ** -16), p_t)
    # a window per value (the verifier's scales with the score): wide enough at the 62.003 only
    rel = torch.full_like(e, 2.0 ** -16)
    rel[0, 2, 1] = 2.0 ** -12
    alt = flip_one_p(e, p_t, torch.zeros_like(e), spec, rel)
    assert alt[0, 2, 0] * 256 == 192 and alt[0, 2, 1] * 256 == 60 and torch.equal(alt[0, :2], p_t[0, :2])
    carry = torch.tensor([[[-4.0, 0.0, 0.0, 0.0]] * 3])  # the 184 code was rounded under a lower max
    assert flip_one_p(e, p_t, carry, spec, 2.0 ** -12)[0, 2, 1] * 256 == 60


def test_route_forward_flip_output_differs_only_where_a_code_may_flip():
    from flamia_gen.numerics.reference_route import route_forward
    from flamia_gen.spec import get_route

    g = torch.Generator().manual_seed(3)
    docs = [1, 2, 3, 40, 70]
    cu = torch.tensor([0] + list(torch.tensor(docs).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, 2, 64, generator=g).to(torch.bfloat16).float() for _ in range(3))
    r = get_route("fp8_token")
    o, lse = route_forward(r, q, k, v, cu, tile_m=32, tile_n=32)
    o2, lse2, o_flip = route_forward(r, q, k, v, cu, tile_m=32, tile_n=32, p_flip_rel=2.0 ** -8)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)  # the emulator itself unchanged
    moved = (o_flip - o).abs().amax(-1) > 0
    assert 0 < int(moved.sum()) < moved.numel()  # a wide window finds codes in some rows, not all
    assert torch.equal(o_flip[~moved], o[~moved])
    assert float((o_flip - o).abs().max()) < 0.1 * float(o.abs().max())  # one code's worth, not a new answer
    # BF16 P (no rounding of P̂): nothing to flip
    b = get_route("bf16")
    ob, _, ob_flip = route_forward(b, q, k, v, cu, tile_m=32, tile_n=32, p_flip_rel=2.0 ** -8)
    assert torch.equal(ob, ob_flip)


def test_flip_aware_emulator_excuses_flipped_rows_only():
    from flamia_gen.numerics.metrics import cosine
    from flamia_gen.verify.attn_gpu import EMULATOR_COSINE, flip_aware_emulator

    g = torch.Generator().manual_seed(4)
    emu = torch.randn(50, 4, 16, generator=g)
    emu_flip = emu.clone()
    emu_flip[7, 1] += 0.3 * torch.randn(16, generator=g)  # the one row with a code that may flip
    kernel = emu_flip.clone()  # the kernel rounded it the other way
    best, n = flip_aware_emulator(kernel, emu, emu_flip)
    assert n == 1 and torch.equal(best, kernel)
    assert cosine(kernel, emu) < 1.0
    bad = kernel.clone()
    bad[20, 2] = 0.0  # a row the kernel got wrong: no flip explains it
    best, n = flip_aware_emulator(bad, emu, emu_flip)
    assert n == 1 and torch.equal(best[20, 2], emu[20, 2]) and cosine(bad, best) < EMULATOR_COSINE
