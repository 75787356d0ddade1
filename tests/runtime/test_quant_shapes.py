"""`runtime.quant.shape_of`: the ARGS shape expressions (evaluated on every quantizer launch)."""

import pytest
import torch

from flamia_gen.runtime.quant import shape_of


def test_shape_expressions():
    assert shape_of(["T", "H", "D"], 70, 3, 128, 2) == (70, 3, 128)
    assert shape_of(["H", "D", "T_pad"], 70, 3, 128, 2) == (3, 128, 80)
    assert shape_of(["NUM_DOCS+1", "D//32", "D/16", 4, "T*H-1"], 70, 3, 128, 2) == (3, 4, 8, 4, 209)
    # the same expression under another size: nothing of the previous call is reused
    assert shape_of(["NUM_DOCS+1", "T_pad"], 17, 1, 64, 5) == (6, 32)


@pytest.mark.parametrize("entry, match", [
    ("T**2", "uses something other than"),
    ("len(T)", "uses something other than"),
    ("X", "uses something other than"),
    ("D/3", "not exact"),
    (True, "bad shape entry"),
    (1.5, "bad shape entry"),
])
def test_bad_shape_entries_are_refused(entry, match):
    for _ in range(2):  # a cached parse still refuses
        with pytest.raises(ValueError, match=match):
            shape_of([entry], 8, 1, 64, 1)


def test_skip_transposed_allocates_a_16_token_stub():
    """A caller that reads no codes_t (a forward-only call's Q, K) gets (H, D, 16): the kernel stores only
    the tokens t < T_PAD of its K-major copy; every other output keeps its shape."""
    from flamia_gen.runtime.quant import TRANSPOSED_STUB, allocate_outputs

    args = [{"name": "x", "dtype": "bfloat16", "shape": ["T", "H", "D"], "role": "in"},
            {"name": "codes", "dtype": "uint8", "shape": ["T", "H", "D"], "role": "out"},
            {"name": "scales", "dtype": "uint8", "shape": ["T", "H"], "role": "out"},
            {"name": "codes_t", "dtype": "uint8", "shape": ["H", "D", "T_pad"], "role": "out"}]
    full = allocate_outputs(args, 70, 3, 128, 2, "cpu")
    stub = allocate_outputs(args, 70, 3, 128, 2, "cpu", skip_transposed=True)
    assert TRANSPOSED_STUB == 16 and full["codes_t"].shape == (3, 128, 80)
    assert stub["codes_t"].shape == (3, 128, 16) and stub["codes_t"].is_contiguous()
    assert {n: t.shape for n, t in stub.items() if n != "codes_t"} == {n: t.shape for n, t in full.items()
                                                                       if n != "codes_t"}
    no_t = [a for a in args if a["name"] != "codes_t"]  # a launch without codes_t: nothing to skip
    assert allocate_outputs(no_t, 70, 3, 128, 2, "cpu", skip_transposed=True).keys() == {"codes", "scales"}


def test_skip_codes_allocates_a_16_token_stub_for_kernels_that_take_one():
    """A caller that reads no row-major codes (a forward-only call's V: the forward reads codes_t and the scales)
    gets codes (16, H, D), only from a quantizer whose PARAMS say codes_stub (its kernel stores tokens t < the
    codes' first mode); an older kernel would write past the stub, so run_quantizer refuses it, before any launch."""
    from flamia_gen.runtime.quant import CODES_STUB, allocate_outputs, run_quantizer

    args = [{"name": "x", "dtype": "bfloat16", "shape": ["T", "H", "D"], "role": "in"},
            {"name": "cu_seqlens", "dtype": "int32", "shape": ["NUM_DOCS+1"], "role": "in"},
            {"name": "codes", "dtype": "uint8", "shape": ["T", "H", "D"], "role": "out"},
            {"name": "scales", "dtype": "uint8", "shape": ["T", "H"], "role": "out"},
            {"name": "codes_t", "dtype": "uint8", "shape": ["H", "D", "T_pad"], "role": "out"}]
    full = allocate_outputs(args, 70, 3, 128, 2, "cpu")
    stub = allocate_outputs(args, 70, 3, 128, 2, "cpu", skip_codes=True)
    assert CODES_STUB == 16 and stub["codes"].shape == (16, 3, 128) and stub["codes"].is_contiguous()
    assert stub["codes_t"].shape == full["codes_t"].shape == (3, 128, 80)
    assert stub["scales"].shape == full["scales"].shape == (70, 3)
    assert allocate_outputs(args, 9, 3, 128, 1, "cpu", skip_codes=True)["codes"].shape == (9, 3, 128)
    x = torch.zeros(70, 3, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    calls = []
    for params in (None, {}, {"codes_stub": False}):
        with pytest.raises(ValueError, match="skip_codes: this quantizer stores every token's codes"):
            run_quantizer(lambda *a: calls.append(a), args, x, cu, skip_codes=True, params=params)
    with pytest.raises(ValueError, match="skip_codes and skip_transposed together"):
        run_quantizer(lambda *a: calls.append(a), args, x, cu, skip_codes=True, skip_transposed=True,
                      params={"codes_stub": True})
    assert not calls
    outs = run_quantizer(lambda *a: calls.append(a), args, x, cu, skip_codes=True, params={"codes_stub": True})
    assert len(calls) == 1 and calls[0][2] is outs["codes"] and outs["codes"].shape == (16, 3, 128)
