"""The torch.compile peer of the quantizer bandwidth benchmark computes what the
contract's emulator computes (on one document, where its token blocks agree)."""

import pytest
import torch

from flamia_gen.bench.quant_bw import quant_bytes, torch_quantizer
from flamia_gen.numerics.quantize import quantize
from flamia_gen.spec.route import OperandQuant


@pytest.mark.parametrize("granularity", ["token", "token_block", "tensor"])
def test_torch_peer_matches_the_emulator(granularity):
    g = torch.Generator().manual_seed(0)
    T, H, D = 96, 2, 32
    x = torch.randn(T, H, D, generator=g)
    x[5] *= 1000.0  # a loud token: per-token / per-block exponents differ from their neighbours
    x[40:72] *= 1e-30  # a quiet block: subnormal-range amax
    x = x.to(torch.bfloat16)
    codes, codes_t, scales = torch_quantizer(granularity)(x)
    want = quantize(x, OperandQuant(format="e4m3", granularity=granularity, exponent_rule="ceil"),
                    torch.tensor([0, T], dtype=torch.int32))
    assert torch.equal(codes.view(torch.uint8), want.codes)
    assert torch.equal(codes_t.view(torch.uint8), want.codes_t[..., :T])
    assert torch.equal(scales.reshape(want.scales.shape), want.scales)


def test_torch_peer_refuses_other_granularities():
    with pytest.raises(ValueError, match="no torch peer"):
        torch_quantizer("nvfp4")(torch.zeros(4, 1, 32, dtype=torch.bfloat16))


def test_quant_bytes():
    # BF16 read (2 B) + codes (1 B) + K-major copy (1 B) per element, plus the scales
    assert quant_bytes(8, 2, 4, transposed=True, scale_bytes=16) == 8 * 2 * 4 * 4 + 16
    assert quant_bytes(8, 2, 4, transposed=False, scale_bytes=0) == 8 * 2 * 4 * 3
