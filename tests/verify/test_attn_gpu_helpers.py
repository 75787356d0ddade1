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
