"""The Hopper FP8 tensor-core accumulation model (flamia_gen.numerics.mma)."""

import pytest
import torch

from flamia_gen.numerics.mma import K_BLOCK, block_accumulate, check_model, fp8_matmul
from flamia_gen.numerics.reference_route import round_to_format
from flamia_gen.spec.enums import Format


def _codes(shape, gen, scale=64.0):
    return round_to_format(torch.randn(*shape, generator=gen) * scale, Format.e4m3)


def test_small_integer_products_are_exact():
    # |sum| < 2^11 → quantum ≤ 2^-2: integer products survive the truncation
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (3, 17, 128), generator=g).float()
    b = torch.randint(-4, 5, (3, 128, 9), generator=g).float()
    assert torch.equal(fp8_matmul(a, b), a @ b)


def test_small_product_truncated_below_a_large_one_toward_zero():
    # products 256·256 = 2^16 and ±0.1875: the block aligns to 2^16, keeps 13 fractional bits
    # (quantum 2^3), so ±0.1875 truncates to 0 (toward zero, both signs)
    for sign in (1.0, -1.0):
        a = torch.tensor([[256.0, sign]])
        b = torch.tensor([[256.0], [0.1875]])
        assert fp8_matmul(a, b).item() == 65536.0
        assert (a @ b).item() == 65536.0 + sign * 0.1875


def test_accumulator_is_truncated_when_a_later_block_is_larger():
    # block 1: 5 (exact alone); block 2: 2^16 → the carried 5 aligns to quantum 8 → 0
    a = torch.zeros(1, 2 * K_BLOCK)
    b = torch.zeros(2 * K_BLOCK, 1)
    a[0, 0], b[0, 0] = 5.0, 1.0
    a[0, K_BLOCK], b[K_BLOCK, 0] = 256.0, 256.0
    assert fp8_matmul(a, b).item() == 65536.0
    # the reverse order: 5 is added to an accumulator of 2^16 → also lost
    assert fp8_matmul(a.flip(1), b.flip(0)).item() == 65536.0
    # alone, the small block is exact
    assert block_accumulate(torch.zeros(1, 1), a[:, :K_BLOCK], b[:K_BLOCK]).item() == 5.0


def test_model_error_is_bounded_by_the_truncation_quanta():
    g = torch.Generator().manual_seed(1)
    a, b = _codes((2, 40, 128), g), _codes((2, 128, 33), g)
    exact = a.double() @ b.double()
    model = fp8_matmul(a, b).double()
    # each of 4 blocks drops < (K_BLOCK + 1) quanta of at most 2^(E-13), E ≤ log2(max partial)
    bound = 4 * (K_BLOCK + 1) * (a.abs().double() @ b.abs().double()) * 2.0 ** -12
    assert ((model - exact).abs() <= bound).all()
    assert not torch.equal(model, exact)  # the model does truncate on generic FP8 data


def test_row_steps_do_not_change_the_result(monkeypatch):
    import flamia_gen.numerics.mma as mma

    g = torch.Generator().manual_seed(2)
    a, b = _codes((2, 50, 64), g), _codes((2, 64, 20), g)
    full = fp8_matmul(a, b)
    monkeypatch.setattr(mma, "_STEP_BUDGET", 7 * 2 * 20 * K_BLOCK)  # 7 rows per step
    assert torch.equal(mma.fp8_matmul(a, b), full)


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="mma model"):
        check_model("sm100_fp8")


def test_backward_scores_under_the_model_stay_close_to_exact_sums():
    from flamia_gen.numerics.metrics import cosine
    from flamia_gen.numerics.reference import attention, attention_backward

    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(300, 2, 128, generator=g).to(torch.bfloat16) for _ in range(4))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    o, lse = attention(q, k, v, cu, True, "fp8_token", return_lse=True)
    a = attention_backward(q, k, v, o, lse, do, cu, True, "fp8_token")
    b = attention_backward(q, k, v, o, lse, do, cu, True, "fp8_token", mma="sm90_fp8")
    for x, y in zip(a, b):
        assert not torch.equal(x, y) and float(cosine(x, y)) > 0.9999
