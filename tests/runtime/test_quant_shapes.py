"""`runtime.quant.shape_of`: the ARGS shape expressions (evaluated on every quantizer launch)."""

import pytest

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
