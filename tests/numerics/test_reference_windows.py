"""The emulator's windows (`route_forward(windows=True)`): the sm90 forward runs documents shorter than tile_m inside
windows (runtime.attn_fwd.merge_windows), whose key tiles start at the window's start. Found on the H200 (2026-12-04):
fp8_pv's m128n128 non-causal forward missed the emulator at cosine 0.99998 on the tiny-document input, every bad row
in one 127-token document that starts 65 tokens into its window; with the window's tiles the dump matches at
0.99999999."""
import pytest
import torch

from flamia_gen.numerics.reference_route import route_forward, window_starts
from flamia_gen.spec import get_route


def _qkv(T, gen, hq=2, hkv=1, d=64):
    q = torch.randn(T, hq, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(T, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(T, hkv, d, generator=gen).to(torch.bfloat16)
    return q, k, v


def test_window_starts_are_the_kernel_schedules_windows():
    cu = torch.tensor([0, 5, 30, 70, 200, 210, 220], dtype=torch.int32)
    # chunk 64: 0, 5, 30 start in chunk 0 and are short (one window of three); 70 is long (130 tokens);
    # 200 and 210 are short and start in chunk 3 (a window of two)
    assert window_starts(cu, 64, 220) == {0: 0, 5: 0, 30: 0, 200: 200, 210: 200}
    # a short document alone in its chunk is no window
    assert window_starts(torch.tensor([0, 100, 110], dtype=torch.int32), 64, 110) == {}


@pytest.mark.parametrize("route,causal", [("fp8_pv", False), ("fp8_token", True), ("fp8_token", False)])
def test_a_window_document_takes_the_windows_key_tiles(route, causal):
    """Document 1 (40 tokens) starts 20 tokens into a window: its key tiles (tile_n 32) split at doc-local key 12,
    not at 28 as its own tiles from its start rounded down to 16 would. The same document placed alone where its own
    tiles split at 12 (start ≡ 20 mod 32, key_align 32) gives the emulator's windowed rows bit for bit, and the
    windowless emulator differs from them."""
    r = get_route(route)
    opts = dict(tile_m=64, tile_n=32, mma="sm90_fp8")
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(60, gen)
    cu = torch.tensor([0, 20, 60], dtype=torch.int32)
    o_win, lse_win = route_forward(r, q, k, v, cu, causal, key_align=16, windows=True, **opts)
    o_own, _ = route_forward(r, q, k, v, cu, causal, key_align=16, **opts)
    filler = _qkv(84, torch.Generator().manual_seed(4))
    q2, k2, v2 = (torch.cat([f, x[20:]]) for f, x in zip(filler, (q, k, v)))
    cu2 = torch.tensor([0, 84, 124], dtype=torch.int32)
    o_alone, lse_alone = route_forward(r, q2, k2, v2, cu2, causal, key_align=32, **opts)
    assert torch.equal(o_win[20:], o_alone[84:]) and torch.equal(lse_win[20:], lse_alone[84:])
    assert not torch.equal(o_win[20:], o_own[20:])
    assert torch.isfinite(o_win).all()


def test_windows_leave_long_documents_alone():
    r = get_route("fp8_token")
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(200, gen)
    cu = torch.tensor([0, 130, 200], dtype=torch.int32)  # the 70-token document is alone in its chunk: no window
    a, _ = route_forward(r, q, k, v, cu, True, tile_m=64, tile_n=32, key_align=16, windows=True)
    b, _ = route_forward(r, q, k, v, cu, True, tile_m=64, tile_n=32, key_align=16)
    assert torch.equal(a, b)
