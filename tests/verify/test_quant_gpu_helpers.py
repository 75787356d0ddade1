"""CPU checks of the bitwise-comparison helpers and input builders of `verify.quant_gpu`
(the GPU run itself needs a kernel: tests/kernels, `-m gpu`)."""

import pytest
import torch

from flamia_gen.verify.quant_gpu import KINDS, check_zero, compare_bitwise, make_input, make_o


@pytest.mark.parametrize("kind", KINDS)
def test_make_input_is_deterministic_and_its_documents_tile_t(kind):
    x, cu = make_input(kind, 300, 2, 64, seed=3, device="cpu")
    x2, cu2 = make_input(kind, 300, 2, 64, seed=3, device="cpu")
    assert x.dtype == torch.bfloat16 and x.shape == (300, 2, 64) and cu.dtype == torch.int32
    assert torch.equal(x.view(torch.int16), x2.view(torch.int16)) and torch.equal(cu, cu2)
    c = cu.tolist()
    assert c[0] == 0 and c[-1] == 300 and all(b >= a for a, b in zip(c, c[1:]))
    o = make_o(kind, 300, 2, 64, seed=3, device="cpu")
    assert o.shape == x.shape and o.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="allowed values"):
        make_input("nope", 10, 1, 64, device="cpu")


def test_compare_bitwise_counts_and_locates_mismatches():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    r = compare_bitwise("f", a, a.clone())
    assert r == {"field": "f", "shape": (2, 2), "ok": True, "mismatches": 0}
    b = a.clone()
    b[1, 0] = -3.0
    b[1, 1] = 5.0
    r = compare_bitwise("f", b, a)
    assert not r["ok"] and r["mismatches"] == 2 and r["first"] == (1, 0) and (r["got"], r["want"]) == (-3.0, 3.0)
    assert compare_bitwise("f", a[:1], a)["mismatches"] == -1  # shape mismatch is reported, not raised
    # NaN: bitwise by default (payload and sign count), any-NaN-equals-any-NaN on request
    n1 = torch.tensor([float("nan"), 1.0])
    n2 = -n1
    n2[1] = 1.0
    assert not compare_bitwise("d", n1, n2)["ok"] and compare_bitwise("d", n1, n2, nan_equal=True)["ok"]


def test_check_zero_wants_positive_zero_bits():
    z = torch.zeros(3, 2, 4)
    assert check_zero("dq_accum", z) == {"field": "dq_accum", "shape": (3, 2, 4), "ok": True, "mismatches": 0}
    z[2, 1, 3] = -0.0
    r = check_zero("dq_accum", z)
    assert not r["ok"] and r["mismatches"] == 1 and r["first"] == (2, 1, 3) and r["want"] == 0.0
