"""The wrappers' tensor check (runtime.attn_fwd._check_tensor): a passing tensor returns from its fast path, and
every kind of bad tensor gets the message it got before the fast path existed, in the same order of precedence."""

import pytest
import torch

from flamia_gen.runtime.attn_fwd import _check_tensor

CPU = torch.device("cpu")
U8 = (torch.uint8, torch.float8_e4m3fn)


@pytest.mark.parametrize("t, shape", [
    (torch.zeros(4, 2, 8, dtype=torch.uint8), (4, None, 8)),
    (torch.zeros(4, 2, 8, dtype=torch.float8_e4m3fn), 3),
    (torch.zeros(4, 2, 8, dtype=torch.uint8), (None, None, None)),
])
def test_good_tensors_pass(t, shape):
    assert _check_tensor(t, "q", U8, shape, CPU) is None


@pytest.mark.parametrize("t, shape, device, match", [
    ([1, 2], 1, CPU, r"^q: expected a torch.Tensor, got list$"),
    (torch.zeros(4, 2, 8), (4, None, 8), CPU, r"^q: dtype torch.float32 not in \('torch.uint8', 'torch.float8_e4m3fn'\)$"),
    (torch.zeros(4, 8, dtype=torch.uint8), (4, None, 8), CPU, r"^q: expected 3 dims, got shape \(4, 8\)$"),
    (torch.zeros(4, 8, dtype=torch.uint8), 3, CPU, r"^q: expected 3 dims, got shape \(4, 8\)$"),
    (torch.zeros(4, 2, 9, dtype=torch.uint8), (4, None, 8), CPU, r"^q: shape \(4, 2, 9\), expected \(4, '\*', 8\)$"),
    (torch.zeros(8, 2, 4, dtype=torch.uint8).transpose(0, 2), (4, None, 8), CPU, r"^q: must be contiguous$"),
    (torch.zeros(4, 2, 8, dtype=torch.uint8), (4, None, 8), torch.device("meta"),
     r"^q: on cpu, expected meta \(the device of q\)$"),
    (torch.zeros(4, 2, 8, dtype=torch.uint8), (4, None, 8), None, r"^q: on cpu, expected None"),
    # precedence: the dtype before the shape, the shape before contiguity and the device
    (torch.zeros(8, 2, 4).transpose(0, 2), (5, None, 8), torch.device("meta"), r"^q: dtype torch.float32"),
    (torch.zeros(8, 2, 4, dtype=torch.uint8).transpose(0, 2), (5, None, 8), torch.device("meta"), r"^q: shape"),
])
def test_bad_tensors_get_their_message(t, shape, device, match):
    with pytest.raises(ValueError, match=match):
        _check_tensor(t, "q", U8, shape, device)
