"""FLOP convention (DESIGN §5): causal fwd 4·D·L(L+1)/2, bwd 2.5x, train 3.5x."""

import pytest

from flamia_gen.bench.flops import attention_flops, fwd_flops_doc, tflops, workload_flops
from flamia_gen.bench.workloads import get_workload


def test_hand_computed_tiny_case():
    # L=3, D=2, causal: 6 visible pairs x (2 matmuls x 2 FLOPs x D=2) = 48
    assert fwd_flops_doc(3, 2, causal=True) == 48
    # non-causal: 9 pairs x 8 = 72
    assert fwd_flops_doc(3, 2, causal=False) == 72
    assert fwd_flops_doc(1, 128, causal=True) == 512
    assert fwd_flops_doc(0, 128) == 0


def test_sum_over_documents_and_heads():
    # docs 3 and 1, D=2, 2 heads: (48 + 8) * 2 = 112
    assert attention_flops([3, 1], heads=2, head_dim=2, causal=True, mode="fwd") == 112
    assert attention_flops([3, 1], heads=2, head_dim=2, causal=False, mode="fwd") == (72 + 8) * 2


def test_modes_are_exact_multiples():
    fwd = attention_flops([5, 7], 3, 4, mode="fwd")
    assert attention_flops([5, 7], 3, 4, mode="bwd") * 2 == fwd * 5
    assert attention_flops([5, 7], 3, 4, mode="train") * 2 == fwd * 7
    with pytest.raises(ValueError, match="mode"):
        attention_flops([5], 1, 1, mode="inference")


def test_packing_counts_no_cross_document_work():
    # 4 docs of 4096 are 4x one doc, far less than one 16384 doc.
    four = workload_flops(get_workload("eq4x4096"))
    one = workload_flops(get_workload("eq1x16384"))
    assert four == 4 * 16 * 2 * 128 * 4096 * 4097
    assert one == 16 * 2 * 128 * 16384 * 16385
    assert one / four == pytest.approx(16385 / 4097, rel=1e-12)


def test_paper_numbers_give_reference_rates():
    # FA4 varlen 1x16384 fwd at 698 TFLOP/s -> the time it implies, and back.
    f = workload_flops(get_workload("eq1x16384"), "fwd")
    assert f == 1_099_578_736_640
    ms = f / 698e12 * 1e3
    assert tflops(f, ms) == pytest.approx(698.0)
    assert tflops(f, 0) is None and tflops(f, None) is None
