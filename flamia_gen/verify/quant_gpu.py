"""Run a built quantizer on the local GPU and compare it BITWISE with the emulator.

`verify_quantizer(fn, ARGS, oq)` builds inputs of several kinds on CUDA, poisons the
outputs (0xAB), runs the kernel and compares codes, scales, codes_t and tensor_scale with
`flamia_gen.numerics.quantize(x, oq, cu_seqlens)`, bit for bit. A dO launch
(`with_delta`, ARGS takes `o`) also gets an O input (`make_o`) and its `delta` is compared
bit for bit with `flamia_gen.numerics.delta_from_quantized` (NaN payloads aside), its
`dq_accum` must be all +0.0 (it starts poisoned). Needs torch and a GPU, never the CuTe DSL.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..runtime.quant import run_quantizer, takes_o

__all__ = ["KINDS", "O_OUTLIER_KINDS", "make_input", "make_o", "compare_bitwise", "check_zero", "verify_quantizer"]

KINDS = ("random", "outlier", "all_equal", "tiny_docs", "nan_inf", "zeros_block")
# input kinds whose O (dO launch) has outlier tokens: with outlier dO, and with constant dO
O_OUTLIER_KINDS = ("outlier", "all_equal")


def _doc_lengths(T: int, g: torch.Generator, lo: int = 1, hi: int = 300) -> list[int]:
    lens: list[int] = []
    left = T
    while left > 0:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        n = min(n, left)
        lens.append(n)
        left -= n
    return lens


def _cu(lens: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def make_input(kind: str, T: int, H: int, D: int, seed: int = 0, device: str = "cuda"):
    """(x bf16 (T, H, D), cu_seqlens int32) for one input kind; deterministic in seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D, generator=g, dtype=torch.float32)
    if kind == "random":
        # varied documents: one aligned long one, odd lengths, an empty document
        lens = [64] + _doc_lengths(T - 64, g) if T > 64 else [T]
        lens.insert(1, 0)
    elif kind == "outlier":
        lens = _doc_lengths(T, g, 20, 200)
        idx = torch.randint(0, T, (max(1, T // 50),), generator=g)
        mult = torch.tensor([100.0, 1e3, 1e4])[torch.randint(0, 3, (idx.numel(),), generator=g)]
        x[idx] *= mult.view(-1, 1, 1)
        x[idx[:1], 0, :1] = 3.0e5  # beyond E4M3 range in one block
    elif kind == "all_equal":
        lens = _doc_lengths(T, g, 30, 100)
        x.fill_(0.7)
    elif kind == "tiny_docs":
        lens = _doc_lengths(T, g, 1, 3)
    elif kind == "nan_inf":
        lens = _doc_lengths(T, g, 20, 120)
        t = min(T - 1, 5)
        x[t, 0, 3] = float("nan")
        x[min(T - 1, t + 1), 0, 7] = float("inf")
        x[min(T - 1, t + 40), H - 1, D - 1] = float("-inf")
    elif kind == "zeros_block":
        lens = [min(T, 40)] + _doc_lengths(T - min(T, 40), g) if T > 40 else [T]
        x[: min(T, 40)] = 0.0  # a whole first document of zeros (every granularity's block)
        x[min(T - 1, 50), 0, :] = 0.0
        x[min(T - 1, 60), :, :] = -0.0
        x[min(T - 1, 61), 0, 5] = 1e-40  # fp32 subnormal (bf16 keeps it)
    else:
        raise ValueError(f"unknown input kind {kind!r}; allowed values: {list(KINDS)}")
    return x.to(torch.bfloat16).to(device).contiguous(), _cu(lens, device)


def make_o(kind: str, T: int, H: int, D: int, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    """The forward output O (bf16 (T, H, D)) paired with dO input `kind` in a dO launch:
    standard normal, with outlier tokens (x100 .. x1e4, one element 3e5) for O_OUTLIER_KINDS."""
    if kind not in KINDS:
        raise ValueError(f"unknown input kind {kind!r}; allowed values: {list(KINDS)}")
    g = torch.Generator().manual_seed(10_000 + seed)
    o = torch.randn(T, H, D, generator=g, dtype=torch.float32)
    if kind in O_OUTLIER_KINDS:
        idx = torch.randint(0, T, (max(1, T // 40),), generator=g)
        mult = torch.tensor([100.0, 1e3, 1e4])[torch.randint(0, 3, (idx.numel(),), generator=g)]
        o[idx] *= mult.view(-1, 1, 1)
        o[idx[:1], H - 1, D - 1] = -3.0e5
    return o.to(torch.bfloat16).to(device).contiguous()


def check_zero(name: str, got: torch.Tensor) -> dict[str, Any]:
    """Every element's bits are 0 (+0.0): the kernel's zero fill of a poisoned buffer."""
    return compare_bitwise(name, got, torch.zeros_like(got))


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def compare_bitwise(name: str, got: torch.Tensor, ref: torch.Tensor, nan_equal: bool = False) -> dict[str, Any]:
    """Mismatch count and first mismatching index of two tensors compared as raw bytes.

    nan_equal=True (floating tensors): any NaN equals any NaN (payload and sign ignored)."""
    res: dict[str, Any] = {"field": name, "shape": tuple(got.shape)}
    if tuple(got.shape) != tuple(ref.shape):
        res.update(ok=False, mismatches=-1, error=f"shape {tuple(got.shape)} != emulator {tuple(ref.shape)}")
        return res
    ref = ref.detach().to(got.dtype)
    if nan_equal:
        got, ref = _canonical_nan(got.detach()), _canonical_nan(ref)
    a = got.detach().contiguous().view(torch.uint8).cpu().reshape(*got.shape, -1)
    b = ref.contiguous().view(torch.uint8).cpu().reshape(*got.shape, -1)
    bad = (a != b).any(-1)
    n = int(bad.sum())
    res.update(ok=n == 0, mismatches=n)
    if n:
        first = tuple(int(i) for i in bad.nonzero()[0])
        res.update(first=first, got=got.detach().cpu()[first].item(), want=ref.detach().cpu()[first].item())
    return res


def verify_quantizer(fn: Callable[..., Any], args_spec: Sequence[Mapping[str, Any]], oq, *,
                     kinds: Iterable[str] = KINDS, T: int = 1000, H: int = 3, D: int = 128,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Run `fn` on every input kind and compare with the emulator bit for bit.

    Returns one dict per (kind, field): ok, mismatches, first mismatch (index, got, want).
    A dO launch (ARGS takes `o`) adds the fields `delta` (bitwise, NaN payloads aside) and
    `dq_accum` (all +0.0).
    """
    from ..numerics.delta import delta_bf16, delta_from_quantized
    from ..numerics.quantize import quantize

    with_delta = takes_o(args_spec)
    results: list[dict[str, Any]] = []
    for i, kind in enumerate(kinds):
        x, cu = make_input(kind, T, H, D, seed=seed + i)
        o = make_o(kind, T, H, D, seed=seed + i) if with_delta else None
        outs = run_quantizer(fn, args_spec, x, cu, poison=True, o=o)
        torch.cuda.synchronize()
        if not oq.quantized:
            # the bf16 route's dO launch: no codes, D from BF16 dO itself (numerics.delta.delta_bf16)
            for r in (compare_bitwise("delta", outs["delta"], delta_bf16(x, o), nan_equal=True),
                      check_zero("dq_accum", outs["dq_accum"])):
                r["kind"] = kind
                results.append(r)
            continue
        ref = quantize(x, oq, cu)
        pairs = [("codes", outs["codes"], ref.codes), ("scales", outs["scales"], ref.scales)]
        if "codes_t" in outs:
            pairs.append(("codes_t", outs["codes_t"], ref.codes_t))
        if "tensor_scale" in outs:
            pairs.append(("tensor_scale", outs["tensor_scale"], ref.tensor_scale))
        for name, got, want in pairs:
            r = compare_bitwise(name, got, want) if want is not None else {
                "field": name, "ok": False, "mismatches": -1, "error": "emulator produced no such field"}
            r["kind"] = kind
            results.append(r)
        if with_delta:
            r = compare_bitwise("delta", outs["delta"], delta_from_quantized(ref, o), nan_equal=True)
            r["kind"] = kind
            results.append(r)
            r = check_zero("dq_accum", outs["dq_accum"])
            r["kind"] = kind
            results.append(r)
    return results
