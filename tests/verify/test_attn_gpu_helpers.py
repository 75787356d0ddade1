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
