"""Host side of the fused quantizer: input checks, output allocation, the call.

A built quantizer is a tvm-ffi function exported ahead of time from a rendered
`generated/<arch>/quant_*.py` module; its module-level `ARGS` list describes the call
signature (name, dtype, shape expression, role). This module needs torch only: it never
imports the CuTe DSL, so it runs on the GPU host that has no DSL.

    fn = load_quantizer("quant_sm90_....so", "quant_sm90_...")
    out = run_quantizer(fn, ARGS, x, cu_seqlens)      # {"codes": ..., "scales": ..., ...}

The dO launch (`with_delta` variants, ARGS has an input `o`) also takes the forward output
O and returns `delta` fp32 (H, T) = rowsum(dequant(dO) * O) and `dq_accum` fp32 (T, H, D),
zeroed by the kernel (docs/quantizer-contract.md, "dO launch"):

    out = run_quantizer(fn, ARGS, do, cu_seqlens, o=o)  # + {"delta": ..., "dq_accum": ...}
"""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["check_quant_inputs", "check_delta_input", "takes_o", "shape_of", "allocate_outputs", "run_quantizer",
           "load_quantizer", "QUANT_DTYPES"]

QUANT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int32": torch.int32,
    "uint8": torch.uint8,
}

_SHAPE_NAMES = ("T", "H", "D", "T_pad", "NUM_DOCS")


def check_quant_inputs(x: torch.Tensor, cu_seqlens: torch.Tensor,
                       head_dim_allowed: Iterable[int] = (64, 128)) -> tuple[int, int, int, int]:
    """Validate the quantizer's inputs; returns (T, H, D, num_docs).

    Raises ValueError naming the offending argument. Checking the values of cu_seqlens
    (first 0, last T) reads two elements back from the device: a host sync, so call it
    in debug paths and tests, not inside a captured CUDA graph.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D (T, H, D), got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    t, h, d = (int(s) for s in x.shape)
    allowed = tuple(head_dim_allowed)
    if d not in allowed:
        raise ValueError(f"x: head dim D={d} is not supported; allowed values: {list(allowed)}")
    if h < 1:
        raise ValueError(f"x: H={h} must be at least 1")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries (one document), got {cu_seqlens.numel()}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but x is on {x.device}")
    if not cu_seqlens.is_contiguous():
        raise ValueError("cu_seqlens must be contiguous")
    ends = cu_seqlens[[0, -1]].tolist()
    if ends[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {ends[0]}")
    if ends[1] != t:
        raise ValueError(f"cu_seqlens[-1] must equal T = x.shape[0] = {t}, got {ends[1]}")
    return t, h, d, cu_seqlens.numel() - 1


def takes_o(args_spec: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the quantizer is a dO launch (`with_delta`): its ARGS take the forward output `o`."""
    return any(a.get("name") == "o" and a.get("role") == "in" for a in args_spec)


def check_delta_input(o: torch.Tensor, x: torch.Tensor) -> None:
    """Validate the dO launch's `o` (the forward output) against `x` (dO): a contiguous BF16
    tensor of the same shape, on the same device. Raises ValueError naming the problem."""
    if not isinstance(o, torch.Tensor):
        raise ValueError(f"o must be a torch.Tensor, got {type(o).__name__}")
    if o.dtype != torch.bfloat16:
        raise ValueError(f"o must be bfloat16, got {o.dtype}")
    if tuple(o.shape) != tuple(x.shape):
        raise ValueError(f"o has shape {tuple(o.shape)} but x (dO) has shape {tuple(x.shape)}; they must match")
    if o.device != x.device:
        raise ValueError(f"o is on {o.device} but x is on {x.device}")
    if not o.is_contiguous():
        raise ValueError("o must be contiguous")


@lru_cache(maxsize=256)
def _parse_expr(expr: str) -> ast.Expression:
    """The parsed shape expression (ARGS strings repeat on every launch: parse each once)."""
    return ast.parse(expr, mode="eval")


def _eval_expr(expr: Any, env: Mapping[str, int]) -> int:
    """Evaluate a shape entry: an int, or an expression over T, H, D, T_pad, NUM_DOCS with
    + - * // (and / on exact divisions). No names or calls beyond those."""
    if isinstance(expr, bool):
        raise ValueError(f"bad shape entry {expr!r}")
    if isinstance(expr, int):
        return expr
    if not isinstance(expr, str):
        raise ValueError(f"bad shape entry {expr!r}")
    if expr in env:  # a bare name, the common entry
        return int(env[expr])

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name) and node.id in env:
            return int(env[node.id])
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, (ast.FloorDiv, ast.Div)):
                if isinstance(node.op, ast.Div) and a % b:
                    raise ValueError(f"shape expression {expr!r}: {a}/{b} is not exact")
                return a // b
        raise ValueError(f"shape expression {expr!r} uses something other than "
                         f"{list(_SHAPE_NAMES)}, integers and + - * //")

    return ev(_parse_expr(expr))


def shape_of(shape: Sequence[Any], T: int, H: int, D: int, num_docs: int) -> tuple[int, ...]:
    env = {"T": T, "H": H, "D": D, "T_pad": -(-T // 16) * 16, "NUM_DOCS": num_docs}
    return tuple(_eval_expr(s, env) for s in shape)


TRANSPOSED_STUB = 16  # tokens of a skipped codes_t: the kernel's T_PAD divisibility (16), never 0 (no null pointer)
CODES_STUB = 16  # tokens of skipped row-major codes (a quantizer with PARAMS["codes_stub"]): never 0


def allocate_outputs(args_spec: Sequence[Mapping[str, Any]], T: int, H: int, D: int, num_docs: int,
                     device: torch.device | str, poison: bool = False,
                     skip_transposed: bool = False, skip_codes: bool = False) -> dict[str, torch.Tensor]:
    """Allocate every "out" and "workspace" entry of ARGS with torch.empty.

    skip_transposed=True allocates `codes_t` (H, D, T_PAD) as (H, D, TRANSPOSED_STUB): the kernel
    then writes the transposed codes of its first 16 tokens only (the caller reads none of them).
    skip_codes=True allocates `codes` (T, H, D) as (CODES_STUB, H, D) likewise (only for a kernel whose
    PARAMS say `codes_stub`: `run_quantizer` checks; the caller reads only codes_t and the scales).

    poison=True fills outputs with the byte 0xAB, so an element the kernel never writes
    shows up in a bitwise comparison. Workspaces are zeroed (the kernel re-zeroes them).
    The dO launch's `delta` (H, T) and `dq_accum` (T, H, D) are fp32 outputs like any other:
    the kernel writes every element (dq_accum with +0.0), so they are never zeroed here.
    """
    out: dict[str, torch.Tensor] = {}
    for name, role, dt, shape, padded in _output_plan(args_spec, T, H, D, num_docs):
        if skip_transposed and name == "codes_t":
            shape = (*shape[:-1], TRANSPOSED_STUB)
        if skip_codes and name == "codes":
            shape = (min(CODES_STUB, shape[0]), *shape[1:])
        t = padded_token_rows(shape, dt, device) if padded else torch.empty(shape, dtype=dt, device=device)
        if role == "workspace":
            t.zero_()
        elif poison:
            t.view(torch.uint8).fill_(0xAB)
        out[name] = t
    return out


_PLANS: dict = {}  # (id(args_spec), T, H, D, num_docs) → (args_spec, plan): a launch's outputs, worked out once


def _output_plan(args_spec: Sequence[Mapping[str, Any]], T: int, H: int, D: int, num_docs: int) -> tuple:
    """(name, role, dtype, shape, padded) of every "out" / "workspace" entry of ARGS for these sizes. Cached on
    the ARGS object (a bundle's entries live as long as the bundle; the object is kept in the value, so its id is
    not reused while cached) and the sizes: the shape expressions cost ~40 µs of host time per launch otherwise."""
    key = (id(args_spec), T, H, D, num_docs)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is args_spec:
        return hit[1]
    plan = []
    for a in args_spec:
        role = a.get("role")
        if role not in ("out", "workspace"):
            continue
        dt = QUANT_DTYPES.get(a["dtype"])
        if dt is None:
            raise ValueError(f"ARGS entry {a['name']!r}: unknown dtype {a['dtype']!r}")
        shape = shape_of(a["shape"], T, H, D, num_docs)
        padded = a["name"] == "codes" and list(a["shape"][:1]) == ["T"] and shape[0] % 16 != 0
        plan.append((a["name"], role, dt, shape, padded))
    if len(_PLANS) > 256:
        _PLANS.clear()
    _PLANS[key] = (args_spec, tuple(plan))
    return tuple(plan)


def padded_token_rows(shape: Sequence[int], dtype: torch.dtype, device, t_pad: int | None = None) -> torch.Tensor:
    """A (T, …) tensor whose storage holds t_pad (default T_pad = ceil(T / 16)·16) rows, the rows past T zero.

    The forward's row-permuting K TMA (k_row_perm) and fp8_token's backward Q and dO TMAs (bwd_q_row_perm) read
    whole 16-token groups, so up to T_pad rows (masked in the kernel); with this storage `attn_fwd.k_rows_for_tma`
    needs no padded copy of K, Q or dO."""
    if t_pad is None:
        t_pad = -(-shape[0] // 16) * 16
    full = torch.empty((t_pad, *shape[1:]), dtype=dtype, device=device)
    full[shape[0]:].zero_()
    return full[: shape[0]]


def run_quantizer(fn: Callable[..., Any], args_spec: Sequence[Mapping[str, Any]], x: torch.Tensor,
                  cu_seqlens: torch.Tensor, poison: bool = False, check: bool = True,
                  o: torch.Tensor | None = None, skip_transposed: bool = False, skip_codes: bool = False,
                  params: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Call a loaded quantizer `fn(*tensors)` in ARGS order on the current torch stream.

    Returns {name: tensor} for every "out" (and "workspace") entry. check=False skips the
    input checks (and their host sync on cu_seqlens). `o` (BF16, shaped like x): the
    forward output, required by a dO launch (`with_delta`, ARGS takes `o`) and refused
    by every other quantizer. `skip_transposed`: the caller reads no `codes_t` (a forward-only
    call's Q and K), so it gets a stub of TRANSPOSED_STUB tokens: the kernel stores only the
    tokens t < T_PAD of codes_t (its last mode), so a quarter of the launch's bytes are not written.
    `skip_codes`: the caller reads no row-major `codes`, only codes_t and the scales (a forward-only call's V):
    a stub of CODES_STUB tokens, for a kernel whose `params` (its PARAMS) say `codes_stub` — one built before
    that predicate would write every token past the stub, so any other is refused.
    """
    if skip_codes and not (params or {}).get("codes_stub"):
        raise ValueError("skip_codes: this quantizer stores every token's codes (no PARAMS['codes_stub']: built "
                         "before 2026-12-04 or without codes_t); rebuild the bundle or pass skip_codes=False")
    if skip_codes and skip_transposed:
        raise ValueError("skip_codes and skip_transposed together leave nothing but the scales: not a launch "
                         "any caller needs")
    if takes_o(args_spec):
        if o is None:
            raise ValueError("this quantizer is a dO launch (with_delta): pass o, the forward output "
                             "(T, H, D) bfloat16, to compute delta = rowsum(dequant(dO) * O)")
        if check:
            check_delta_input(o, x)
    elif o is not None:
        raise ValueError("o was given but this quantizer does not take it (not a with_delta variant)")
    if check:
        T, H, D, nd = check_quant_inputs(x, cu_seqlens)
    else:
        T, H, D = (int(s) for s in x.shape)
        nd = cu_seqlens.numel() - 1
    outs = allocate_outputs(args_spec, T, H, D, nd, x.device, poison=poison, skip_transposed=skip_transposed,
                            skip_codes=skip_codes)
    inputs = {"x": x, "cu_seqlens": cu_seqlens}
    if o is not None:
        inputs["o"] = o
    call = []
    for a in args_spec:
        if a.get("role") == "in":
            if a["name"] not in inputs:
                raise ValueError(f"ARGS input {a['name']!r} is not one the quantizer runtime provides")
            call.append(inputs[a["name"]])
        else:
            call.append(outs[a["name"]])
    fn(*call)
    return outs


def load_quantizer(path: str, function_name: str) -> Callable[..., Any]:
    """Load an exported quantizer from a shared object (tvm-ffi); needs `tvm_ffi` and the
    CuTe DSL runtime library on the loader path, not the DSL itself."""
    import tvm_ffi  # local import: this module must import without it

    mod = tvm_ffi.load_module(path)
    return getattr(mod, function_name)
