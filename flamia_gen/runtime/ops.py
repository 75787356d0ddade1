"""`flamia_gen.attention`: the training op users call (issue #9), as `torch.library` custom ops.

    o = flamia_gen.attention(q, k, v, cu_seqlens, max_seqlen, causal=True, route="fp8_token")

Packed BF16 q (T, HQ, D), k, v (T, HKV, D), int32 cu_seqlens (num_docs + 1) → BF16 o (T, HQ, D).

Two opaque ops (docs/ops.md):
- `flamia::attention_fwd(q, k, v, cu_seqlens, max_seqlen, causal, route, softmax_scale, deterministic, forward_only)
  -> (o, lse, *codes)`: the route's fused quantizer launches for Q, K, V, then the forward kernel, from
  the bundle (`packed_attention`, kernels chosen by the dispatch table). lse: fp32 (HQ, T), natural
  log. codes: on routes where `attention.saves_codes` (the sm90 backward's per-token E4M3 routes:
  fp8_token), the forward's Q, K, V codes, K-major copies and scales (8 uint8 tensors: no Vᵀ), kept for
  the backward; else 8 empty ones. `forward_only` (set by `attention` when no gradient can be asked for):
  no codes kept; Q's and K's launches skip their K-major copies, V's its row-major codes (packed_attention).
- `flamia::attention_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, route, softmax_scale,
  codes, deterministic) -> (dq, dk, dv)`: reads the forward's codes when given, else RECOMPUTES the
  quantization of Q, K, V (three memory-bound launches, bit for bit what the forward used: the
  quantizers are deterministic and document-local), the dO launch
  (`with_delta`: dO codes, scales, codes_t, delta = rowsum(dO∘O) and the zeroed dq_accum; the bf16
  route's dO launch writes only delta and dq_accum), then the `attn_bwd` kernel of the bundle. No kernel for (route, head dim, causal) → NoKernelError:
  never a silent fallback to another route or to the emulator.

The forward saves o, lse and either its BF16 inputs or, where `saves_codes`, the FP8 codes of Q, K, V
instead (≈ 5 bytes per element of q, k, v against their 6 when HQ = HKV; the backward then skips three quantizer
launches).

`attention` itself, on plain CUDA tensors outside torch.compile and any dispatch mode, runs the two ops'
implementations under an autograd.Function (`_EagerAttention`, same launches, same bits) and skips the ops'
dispatch, a host cost of its own (docs/ops.md "Host time"); tracing, fake tensors and subclasses get the ops.

No host synchronisation inside either op (the dispatch profile comes from T, cu_seqlens.numel()
and max_seqlen; work lists are built on the device), so both are CUDA-graph capturable; the fake
(meta) implementations make them traceable by torch.compile(fullgraph=True) and make_fx.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .attention import (ARCH, SAVED_FIELDS, SAVED_OPERANDS, NoKernelError, _current_bundle, _pick_cached, _quantize,
                        bwd_schedule_cached, doc_profile, packed_attention, per_token_scales, pick_bwd, pick_do_delta,
                        saves_codes, token_copy_do_delta, token_copy_use)
from .attn_bwd import (_is_fp8_spec, fwd_tile_n_of, is_ds16_spec, is_q_hat_spec, is_qk_nvfp4_spec, is_scores_bf16_spec,
                       run_attn_bwd)
from .nvfp4 import mixed_qk_inputs
from .attn_fwd import SUPPORTED_HEAD_DIMS

__all__ = ["attention", "known_routes", "NoKernelError"]


# ---------------------------------------------------------------- validation


@torch.compiler.assume_constant_result
def known_routes() -> tuple[str, ...]:
    """Route names the specs define (`specs/routes/*.yaml`); () when this host has no specs
    (an installed wheel with a bundle only): then the bundle lookup alone refuses unknown routes.
    A constant to torch.compile (read once, at trace time)."""
    global _KNOWN
    if _KNOWN is None:
        try:
            from ..spec import default_specs_dir
            from ..spec.loader import _cached_routes

            _KNOWN = tuple(sorted(_cached_routes(str(default_specs_dir()))))
        except Exception:
            _KNOWN = ()
    return _KNOWN


_KNOWN: tuple[str, ...] | None = None


def _bad(name: str, msg: str) -> ValueError:
    return ValueError(f"{name}: {msg}")


def _is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def check_inputs(q, k, v, cu_seqlens, max_seqlen, causal, route, softmax_scale) -> None:
    """ValueError naming the argument. Metadata only (dtype, shape, device): no host sync, and
    traceable by dynamo on fake tensors with symbolic sizes (messages are built only on failure).
    Contiguity is not required here (`attention` makes inputs contiguous)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise _bad(name, f"expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise _bad(name, f"dtype {t.dtype}, expected torch.bfloat16")
        if t.dim() != 3:
            raise _bad(name, f"expected 3 dims (T, H, D), got shape {tuple(t.shape)}")
    T, HQ, D = q.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise _bad("q", f"unsupported head dim on {ARCH}: D={D} (supported: {SUPPORTED_HEAD_DIMS})")
    if HQ < 1:
        raise _bad("q", f"HQ={HQ} must be at least 1")
    HKV = k.shape[1]
    if k.shape[0] != T or k.shape[2] != D:
        raise _bad("k", f"shape {tuple(k.shape)} does not match q (T={T}, D={D})")
    if HKV < 1 or HQ % HKV != 0:
        raise _bad("k", f"HQ={HQ} is not a multiple of HKV={HKV}")
    if v.shape != k.shape:
        raise _bad("v", f"shape {tuple(v.shape)}, expected {tuple(k.shape)} (like k)")
    for t, name in ((k, "k"), (v, "v")):
        if t.device != q.device:
            raise _bad(name, f"on {t.device}, expected {q.device} (the device of q)")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise _bad("cu_seqlens", f"expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise _bad("cu_seqlens", f"dtype {cu_seqlens.dtype}, expected torch.int32")
    if cu_seqlens.dim() != 1:
        raise _bad("cu_seqlens", f"expected 1 dim (num_docs + 1), got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise _bad("cu_seqlens", f"needs num_docs + 1 >= 2 entries, got {cu_seqlens.numel()}")
    if cu_seqlens.device != q.device:
        raise _bad("cu_seqlens", f"on {cu_seqlens.device}, expected {q.device} (the device of q)")
    if not _is_int(max_seqlen):
        raise _bad("max_seqlen", f"expected an int, got {type(max_seqlen).__name__}")
    if max_seqlen <= 0:
        raise _bad("max_seqlen", f"must be a positive int, got {max_seqlen}")
    if not isinstance(causal, bool):
        raise _bad("causal", f"expected a bool, got {type(causal).__name__}")
    if not isinstance(route, str):
        raise _bad("route", f"expected a str, got {type(route).__name__}")
    routes = known_routes()
    if routes and route not in routes:
        raise _bad("route", f"unknown route {route!r}; allowed values: {list(routes)}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, (int, float, torch.SymFloat))):
        raise _bad("softmax_scale", f"expected a float or None, got {type(softmax_scale).__name__}")


# ---------------------------------------------------------------- forward op


NUM_SAVED = sum(len(SAVED_FIELDS[op]) for op in SAVED_OPERANDS)  # attention_fwd's code outputs (8; empty when not kept)
FwdOutputs = tuple[(torch.Tensor,) * (2 + NUM_SAVED)]  # o, lse, *codes (the schema needs a fixed arity)


def _attention_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int, causal: bool, route: str, softmax_scale: Optional[float],
                        deterministic: bool = False, forward_only: bool = False) -> FwdOutputs:
    """(o BF16 (T, HQ, D), lse fp32 (HQ, T), *codes) from the bundle's quantizers + forward kernel.
    `codes` (NUM_SAVED tensors): on routes where `saves_codes`, the forward's Q, K, V quantizer outputs
    the backward reads (SAVED_FIELDS: Q and K codes (T, H, D), codes_t (H, D, T_PAD), scales (T, H); V codes
    and scales; uint8), so the backward does not recompute them; else empty uint8 tensors. `deterministic` is
    for the backward (the forward is deterministic): autograd passes it on. `forward_only` (no gradient will be
    asked for: `attention` under no_grad or without inputs that require grad): no codes kept, and the quantizer
    launches skip what the forward does not read (packed_attention); a backward after it still works (it
    re-quantizes)."""
    check_inputs(q, k, v, cu_seqlens, max_seqlen, causal, route, softmax_scale)
    if saves_codes(route) and not forward_only:
        o, lse, codes = packed_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.contiguous(),
                                         int(max_seqlen), route=route, causal=causal, softmax_scale=softmax_scale,
                                         return_lse=True, keep_codes=True, inputs_checked=True)
        return (o, lse, *codes)
    o, lse = packed_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.contiguous(),
                              int(max_seqlen), route=route, causal=causal, softmax_scale=softmax_scale,
                              return_lse=True, inputs_checked=True)
    return (o, lse, *(q.new_empty((0,), dtype=torch.uint8) for _ in range(NUM_SAVED)))



def _saved_shapes(q, k) -> list[tuple]:
    """Shapes of `attention_fwd`'s codes (SAVED_FIELDS of SAVED_OPERANDS, flat) for q (T, HQ, D), k (T, HKV, D)."""
    T, HQ, D = q.shape
    HKV = k.shape[1]
    t_pad = (T + 15) // 16 * 16
    shape = {"codes": lambda h: (T, h, D), "codes_t": lambda h: (h, D, t_pad), "scales": lambda h: (T, h)}
    return [shape[f](h) for op, h in zip(SAVED_OPERANDS, (HQ, HKV, HKV)) for f in SAVED_FIELDS[op]]


def _saved_names() -> list[str]:
    return [f"{op} {f}" for op in SAVED_OPERANDS for f in SAVED_FIELDS[op]]


attention_fwd = torch.library.custom_op("flamia::attention_fwd", mutates_args=())(_attention_fwd_impl)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, cu_seqlens, max_seqlen, causal, route, softmax_scale, deterministic=False,
                        forward_only=False):
    check_inputs(q, k, v, cu_seqlens, max_seqlen, causal, route, softmax_scale)
    T, HQ, D = q.shape
    o = q.new_empty((T, HQ, D), dtype=torch.bfloat16)
    lse = q.new_empty((HQ, T), dtype=torch.float32)
    shapes = _saved_shapes(q, k) if saves_codes(route) and not forward_only else [(0,)] * NUM_SAVED
    return (o, lse, *(q.new_empty(s, dtype=torch.uint8) for s in shapes))


# ---------------------------------------------------------------- backward op


def _require_cuda(q: torch.Tensor) -> None:
    if not q.is_cuda:
        raise ValueError("q: must be a CUDA tensor (the kernels run on sm90)")


def _run_backward(do, q, k, v, o, lse, cu, max_seqlen: int, causal: bool, route: str,
                  softmax_scale: float | None, deterministic: bool = False, codes=None, trusted: bool = False):
    T, HQ, D = q.shape
    b = _current_bundle(route)
    profile = doc_profile(T, cu, max_seqlen)
    # the kernel first: no backward kernel → NoKernelError before any launch
    bwd = pick_bwd(b, route, D, bool(causal), profile, deterministic=bool(deterministic))
    _require_cuda(q)
    dq, dk, dv, _ = backward_with(b, bwd, do, q, k, v, o, lse, cu, profile, softmax_scale, codes=codes, trusted=trusted)
    return dq, dk, dv


def forward_choice(b, bwd: dict, d: int, profile) -> dict:
    """The bundle's forward entry the op's forward ran for this call (route, head dim, causality of backward
    entry `bwd`, dispatch profile `profile`): `packed_attention`'s own pick.

    `_pick` never raises for a route the dispatch table and the installed plan do not know (a candidate route
    under test, `bench.bwd_experiments --candidates`): the dispatcher's KeyError is caught and the bundle's
    first forward of the route (by name) answers, as it did for the forward; only a bundle with no forward of
    the route raises NoKernelError (then there is no forward to pair with either). No other fallback here: a
    forward of another tile_n than the one the forward actually used would give other diagonal decisions."""
    return _pick_cached(str(b.root), "attn_fwd", bwd["uses"][0], d, bool(bwd["params"]["causal"]), profile)


def paired_forward_params(b, bwd: dict, D: int, profile, fwd_params: dict | None = None) -> dict:
    """PARAMS of the forward a backward entry with diagonal decisions (PARAMS `diag_v` or `diag_k`) repeats:
    `fwd_params` (the forward variant that produced O and LSE) or, None, `forward_choice` (the op's forward for
    this call). ValueError when that forward's tile_n is not the backward's fwd_tile_n (`attn_bwd.fwd_tile_n_of`:
    its diagonal key tiles would not be the ones the kernel assumes), or its causality or head dim differ."""
    params = bwd["params"]
    want = fwd_tile_n_of(params)
    if fwd_params is None:
        fe = forward_choice(b, bwd, D, profile)
        fwd_params, what = fe["params"], f"forward variant {fe['name']} (the dispatcher's choice for this call)"
    else:
        if not isinstance(fwd_params, dict) or "tile_m" not in fwd_params or "tile_n" not in fwd_params:
            raise _bad("fwd_params", f"expected the forward variant's PARAMS (a dict with tile_m, tile_n), got "
                                     f"{fwd_params!r}")
        what = "the forward variant given as fwd_params" + (f" ({fwd_params['name']})" if "name" in fwd_params else "")
    if fwd_params["tile_n"] != want:
        raise _bad("fwd_params", f"{what} has tile_n={fwd_params['tile_n']}, but backward {bwd['name']} repeats the "
                                 f"diagonal decisions of a forward with tile_n={want} (its fwd_tile_n) only: pair "
                                 f"it with a forward variant of tile_n={want}")
    for key in ("causal", "head_dim"):
        if key in fwd_params and fwd_params[key] != params[key]:
            raise _bad("fwd_params", f"{what} has {key}={fwd_params[key]}, backward {bwd['name']} {key}={params[key]}")
    return fwd_params


def diag_v_inputs(b, bwd: dict, v, cu, profile, fwd_params: dict | None = None) -> dict:
    """run_attn_bwd's `v_diag`, `v_diag_scale`, `fwd_tile_m` for a backward entry with PARAMS `diag_v`: V
    quantized per token by the bundle's quantizer of the route's per-token copy (`token_copy_use`, as
    `attention.fp8_forward_inputs` launches it for the forward's diagonal tiles: the same codes bit for bit),
    and the forward's tile_m. `fwd_params`: PARAMS of the forward variant that produced O and LSE (None →
    `forward_choice`, the op's forward for this call); refused as `paired_forward_params` says."""
    D, root, route = v.shape[2], str(b.root), bwd["uses"][0]
    fwd_params = paired_forward_params(b, bwd, D, profile, fwd_params)
    r, op = token_copy_use(root, route, "v", D)
    vt = _quantize(b, _pick_cached(root, "quant", r, D, None, profile, op), v, cu)
    return dict(v_diag=vt["codes"], v_diag_scale=per_token_scales(vt["scales"], v),
                fwd_tile_m=int(fwd_params["tile_m"]))


SPLIT_FLAGS = (("rows_q", "q_t_scale"), ("rows_do", "do_t_scale"), ("diag_k", "k_diag"))


def split_operands(bwd: dict) -> tuple[bool, bool, bool]:
    """(Q split, dO split, per-token K) of a backward entry, from its ARGS (the kernel's interface): an exact
    token-block route's variant reads Q (PARAMS `rows_q`: ARGS `q_t_scale`) and dO (`rows_do`: `do_t_scale`) per
    token in S, dP and D and their token-block codes_t in dK, dV; a `diag_k` variant (route k_fold: ARGS
    `k_diag`) the per-token K copy on the forward's diagonal key tiles. ValueError when a PARAMS flag present in
    the entry contradicts its ARGS (a stale or mismatched bundle entry)."""
    names = {a["name"] for a in bwd["args"]}
    params = bwd["params"]
    for flag, arg in SPLIT_FLAGS:
        if flag in params and bool(params[flag]) != (arg in names):
            raise _bad("bwd", f"backward {bwd['name']} has PARAMS {flag}={params[flag]} but its ARGS "
                              f"{'do not name' if params[flag] else 'name'} {arg}: the bundle entry's params and "
                              f"kernel disagree (rebuild the bundle)")
    return tuple(arg in names for _, arg in SPLIT_FLAGS)


def qk_nvfp4_operands(bwd: dict) -> bool:
    """Whether a backward entry recomputes Sᵀ = K·Qᵀ from NVFP4 Q, K (route nvfp4_mixed), from its ARGS (the kernel's
    interface: `qk_tensor_scale`, `attn_bwd.is_qk_nvfp4_spec`). ValueError when its PARAMS say otherwise: the rendered
    module's `qk_nvfp4`, or the plan's `q_fmt` (e2m1: NVFP4 Q) when that flag is absent (a bundle manifest's params
    are the plan's) — an entry rendered before the template knew the route would read FP8 Q, K codes the NVFP4
    quantizers do not write."""
    nv = is_qk_nvfp4_spec(bwd["args"])
    params = bwd["params"]
    if "qk_nvfp4" in params:
        flag, what = bool(params["qk_nvfp4"]), f"qk_nvfp4={params['qk_nvfp4']}"
    elif "q_fmt" in params:
        flag, what = params["q_fmt"] == "e2m1", f"q_fmt={params['q_fmt']}"
    else:
        return nv
    if flag != nv:
        raise _bad("bwd", f"backward {bwd['name']} has PARAMS {what} but its ARGS {'do not name' if flag else 'name'} "
                          f"qk_tensor_scale: the bundle entry's params and kernel disagree (rebuild the bundle)")
    return nv


def backward_with(b, bwd: dict, do, q, k, v, o, lse, cu, profile, softmax_scale: float | None = None,
                  poison: bool = False, codes=None, fwd_params: dict | None = None, trusted: bool = False,
                  keep: dict | None = None):
    """One backward through bundle entry `bwd` (no dispatch): the route's quantizer launches
    (Q, K, V recomputed bit for bit as the forward had them, unless `codes`, the forward's own
    quantizer outputs (attention_fwd's code outputs), are given; dO with D = rowsum(dO∘O) and the
    zeroed dQ accumulator), then the kernel. → (dq, dk, dv, dq_accum). `verify` calls it with
    `poison=True` (dK, dV start as NaN: rows never written show).
    `fwd_params`: PARAMS of the forward variant that produced `o`, `lse`; read only by a variant with diagonal
    decisions (`diag_v`: route diagonal per_key_v, `diag_k`: route k_fold): such a forward of another tile_n
    than its fwd_tile_n is refused (`paired_forward_params`); None → the forward the op runs for this call
    (`forward_choice`).
    Exact token-block routes (`split_operands`; Route.forward_safeguards, the emulator's prepare_backward):
    Q is launched twice, per token (`token_copy_use`: codes, scales → q, q_scale: S = Q·Kᵀ) and token-block
    (codes_t, scales → q_t, q_t_scale: dK = dSᵀ·Q); dO twice, the per-token copy's with_delta launch
    (`attention.token_copy_do_delta`: codes, scales → do, do_scale: dP; delta, dq_accum) and the route's own plain
    one (codes_t, scales → do_t, do_t_scale: dV = Pᵀ·dO); with `diag_k` K once more per token (codes, codes_t,
    scales → k_diag, k_t_diag, k_diag_scale: S and dQ on the forward's diagonal key tiles).
    NVFP4 routes (`qk_nvfp4_operands`: nvfp4_mixed; the emulator's `_product_spec`): Q and K are launched twice, by
    the route's NVFP4 quantizers (→ `runtime.nvfp4.mixed_qk_inputs`: q, k dequantized to BF16 and qk_tensor_scale =
    ts_q·ts_k, as the forward had them: Sᵀ = K·Qᵀ) and by the bundle's E4M3 token-block (ceil) quantizer
    (`attention.token_copy_use(granularity="token_block")`: codes_t, scales → q_t, q_scale, k_t, k_scale: dK = dSᵀ·Q,
    dQ = dS·K); V, dO (and the diagonal V copy) as mxfp8.
    `trusted`: every tensor is the op's own (the eager path's saved forward outputs and autograd's gradient), so
    `run_attn_bwd` does not re-validate them. `keep`: passed to `run_attn_bwd` (receives the kernel's arguments)."""
    T, HQ, D = q.shape
    route = bwd["uses"][0]
    fn, args, params = b.get(bwd["name"]), bwd["args"], bwd["params"]
    fp8 = _is_fp8_spec(args)
    root = str(b.root)
    split_q, split_do, diag_k = split_operands(bwd)
    nv = qk_nvfp4_operands(bwd)
    if codes and nv:
        # then q, k are the forward's code tensors standing in for the BF16 inputs: nothing to quantize to NVFP4
        raise _bad("codes", f"backward {bwd['name']} quantizes Q and K twice (NVFP4 for Sᵀ, E4M3 token-block for dK, "
                            f"dQ) itself: it needs the BF16 q, k, v, not the forward's codes (an NVFP4 route keeps "
                            f"none: attention.saves_codes)")
    if codes and (split_q or split_do or diag_k):
        # then q, k, v are the forward's code tensors standing in for the BF16 inputs: no copy can be made
        raise _bad("codes", f"backward {bwd['name']} quantizes "
                            f"{', '.join(n for n, f in (('Q', split_q), ('dO', split_do), ('K', diag_k)) if f)} twice "
                            f"(per token and token-block) itself: it needs the BF16 q, k, v, not the forward's codes "
                            f"(saves_codes routes have no per-token copies)")
    # the forward pairing first: a refused forward raises before any launch
    diag = {}
    if params.get("diag_v") or diag_k:
        if codes:  # then v is the V code tensor standing in for the BF16 v (attention_bwd): no copy can be made
            raise _bad("codes", f"backward {bwd['name']} (diag_v) quantizes V per token itself: it needs the BF16 v, "
                                f"not the forward's codes (saves_codes routes have no diagonal copies)")
        fwd_params = paired_forward_params(b, bwd, D, profile, fwd_params)
    # every quantizer picked before any launch (a bundle without one raises NoKernelError first). The dO launch
    # (with_delta): an exact route's comes from the per-token copy of dO (dP and D read it)
    do_entry = token_copy_do_delta(root, route, D, profile) if split_do else pick_do_delta(root, route, D, profile)
    if not fp8:
        sched = bwd_schedule_cached(cu, T, params, fp8, k.shape[1])
        # bf16 route: nothing to quantize; its dO launch writes delta = rowsum(dO∘O) (HQ, T) fp32 and the
        # zeroed dq_accum in one pass (templates/common/do_delta_body.py.j2)
        dl = _quantize(b, do_entry, do, cu, o=o)
        return run_attn_bwd(fn, args, q, k, v, do, lse, dl["delta"], cu_seqlens=cu, params=params,
                            dq_accum=dl["dq_accum"], softmax_scale=softmax_scale, schedule=sched, poison=poison,
                            trusted=trusted, keep=keep)

    def pick(op, copy=None):
        # the route's quantizer of `op`, or the bundled copy of it at granularity `copy`: per token ("token", what
        # the forward launched for its diagonal tiles and rows) or E4M3 token-block ("token_block": NVFP4 Q, K in
        # dK, dQ)
        r, o_ = token_copy_use(root, route, op, D, copy) if copy else (route, op)
        return _pick_cached(root, "quant", r, D, None, profile, o_)

    # a ds16 variant (fp8_pv: dK, dQ in BF16) reads no Q, K codes
    qk = not is_ds16_spec(args)
    qh = is_q_hat_spec(args)  # bwd_dk_bf16: dK takes Q̂, which the call builds; no Qᵀ codes anywhere
    ent = {}
    if not codes:
        if qk:
            ent["q"] = pick("q", "token" if split_q else None)  # S = Q·Kᵀ: per token on an exact route (rows_q)
            if split_q:
                ent["q_t"] = pick("q")  # dK = dSᵀ·Q: the route's own token-block Q
            elif nv:
                ent["q_t"] = pick("q", "token_block")  # dK = dSᵀ·Q: NVFP4 Q's E4M3 token-block copy
            ent["k"] = pick("k")
            if nv:
                ent["k_t"] = pick("k", "token_block")  # dQ = dS·K: NVFP4 K's E4M3 token-block copy
            if diag_k:
                ent["k_diag"] = pick("k", "token")  # S and dQ on the forward's diagonal key tiles
        ent["v"] = pick("v")
    if split_do:
        ent["do_t"] = pick("do")  # dV = Pᵀ·dO: the route's own token-block dO (a plain launch)
    if params.get("diag_v"):
        diag = diag_v_inputs(b, bwd, v, cu, profile, fwd_params)
    sched = bwd_schedule_cached(cu, T, params, fp8, k.shape[1])
    extra = {}
    if codes:
        # the forward's own codes (attention_fwd kept them: saves_codes)
        it = iter(codes)
        qq, kq, vq = ({f: next(it) for f in SAVED_FIELDS[op]} for op in SAVED_OPERANDS)
        qt = qq
    else:
        # recompute the forward's quantization (deterministic: the same codes and scales, bit for bit)
        # a q_hat variant (bwd_dk_bf16) reads no Qᵀ codes: the Q launch skips them (its call builds Q̂ from q)
        qq = _quantize(b, ent["q"], q, cu, skip_transposed=qh) if qk else None
        qt = _quantize(b, ent["q_t"], q, cu) if "q_t" in ent else qq
        kq = _quantize(b, ent["k"], k, cu) if qk else None
        if nv:
            # Sᵀ = K·Qᵀ on the NVFP4 Q, K as the forward had them (BF16 code·block scale, ts_q·ts_k on the device);
            # q_t, q_scale, k_t, k_scale from the E4M3 token-block copies
            mixed = mixed_qk_inputs(qq, kq)
            extra["qk_tensor_scale"] = mixed["qk_tensor_scale"]
            qq, kq = qt, _quantize(b, ent["k_t"], k, cu)
        if "k_diag" in ent:
            kd = _quantize(b, ent["k_diag"], k, cu)
            extra.update(k_diag=kd["codes"], k_t_diag=kd["codes_t"], k_diag_scale=per_token_scales(kd["scales"], k))
        vq = _quantize(b, ent["v"], v, cu)
        if split_q:
            extra["q_t_scale"] = per_token_scales(qt["scales"], q)
    dq_ = _quantize(b, do_entry, do, cu, o=o)  # the dO launch (with_delta): do, do_scale, delta, dq_accum
    dt = dq_
    if split_do:
        # dP = dO·Vᵀ and D = rowsum(dO∘O) read the per-token copy (dq_), dV = Pᵀ·dO the route's own dO
        dt = _quantize(b, ent["do_t"], do, cu)
        extra["do_t_scale"] = per_token_scales(dt["scales"], do)
    # scores_bf16: Sᵀ = K·Qᵀ takes the BF16 q, k; their codes_t and scales (if any) serve dK, dQ
    sbf16 = is_scores_bf16_spec(args)
    qkc = {} if qq is None else dict(k_t=kq["codes_t"], q_scale=per_token_scales(qq["scales"], q),
                                     k_scale=per_token_scales(kq["scales"], k), **({} if qh else dict(q_t=qt["codes_t"])))
    if nv:
        q_in, k_in = mixed["q"], mixed["k"]
    else:
        q_in, k_in = (q.contiguous(), k.contiguous()) if sbf16 else (qq["codes"], kq["codes"])
    return run_attn_bwd(
        fn, args, q_in, k_in, vq["codes"],
        dq_["codes"], lse, dq_["delta"], cu_seqlens=cu, params=params, do_t=dt["codes_t"], **qkc,
        v_scale=per_token_scales(vq["scales"], v), do_scale=per_token_scales(dq_["scales"], do),
        dq_accum=dq_["dq_accum"], softmax_scale=softmax_scale, schedule=sched, poison=poison, trusted=trusted,
        keep=keep, **diag, **extra)


def _attention_bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool, route: str,
                        softmax_scale: Optional[float], codes: list[torch.Tensor],
                        deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq BF16 shaped like q, dk, dv BF16 shaped like k, v): dO launch + the bundle's attn_bwd kernel, or
    NoKernelError. `deterministic`: a variant whose dQ partials are added in a fixed order (bitwise
    reproducible). `codes`: attention_fwd's code outputs (the forward's Q, K, V codes) or [] (recomputed
    from q, k, v). With codes, only q, k, v's shapes are read: autograd passes the Q, K, V code tensors
    in their place (it does not keep the BF16 inputs then)."""
    _check_do(do, q)
    if codes:
        if not saves_codes(route):
            raise _bad("codes", f"route {route!r} keeps no forward codes (attention.saves_codes): pass []")
        _check_codes(codes, q, k)
    return _run_backward(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                         lse.contiguous(), cu_seqlens.contiguous(), int(max_seqlen), causal, route, softmax_scale,
                         deterministic, codes=list(codes) if codes else None)


attention_bwd = torch.library.custom_op("flamia::attention_bwd", mutates_args=())(_attention_bwd_impl)


def _check_do(do, q) -> None:
    """dO, the gradient of o: BF16 shaped like q (or like the Q codes standing in for it) on q's device."""
    if not isinstance(do, torch.Tensor) or do.dtype != torch.bfloat16 or do.shape != q.shape or do.device != q.device:
        got = f"{do.dtype} {tuple(do.shape)} on {do.device}" if isinstance(do, torch.Tensor) else type(do).__name__
        raise _bad("do", f"expected the gradient of o: bfloat16 {tuple(q.shape)} on {q.device}, got {got}")


def _eager_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, route, softmax_scale, codes, deterministic):
    """`_attention_bwd_impl` for the eager path's backward: the tensors are the forward's own (saved by
    `_setup_context`, validated or made by the forward) and autograd's gradient (shape checked by autograd, BF16 by
    `_backward_with`), so nothing is re-validated (the checks took ≈ 0.06 ms a call in perf-notes round 37's
    timed-wrapper run; the A/B itself was below the host's noise)."""
    return _run_backward(do, q, k, v, o, lse, cu_seqlens, int(max_seqlen), causal, route,  # (do: contiguous BF16)
                         softmax_scale, deterministic, codes=list(codes) if codes else None, trusted=True)


def _check_codes(codes, q, k) -> None:
    """`codes` as attention_fwd returns them: uint8, contiguous, SAVED_OPERANDS × SAVED_FIELDS shapes."""
    want = _saved_shapes(q, k)
    if len(codes) != len(want):
        raise _bad("codes", f"{len(codes)} tensors, expected {len(want)} (attention_fwd's code outputs)")
    for i, (t, s, what) in enumerate(zip(codes, want, _saved_names())):
        name = f"codes[{i}] ({what})"
        if t.dtype != torch.uint8 or tuple(t.shape) != s or t.device != q.device:
            raise _bad(name, f"{t.dtype} {tuple(t.shape)} on {t.device}, expected uint8 {s} on {q.device}")
        if not t.is_contiguous():
            raise _bad(name, "must be contiguous")


@attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, route, softmax_scale, codes,
                        deterministic=False):
    return (q.new_empty(q.shape, dtype=torch.bfloat16), k.new_empty(k.shape, dtype=torch.bfloat16),
            v.new_empty(v.shape, dtype=torch.bfloat16))


# ---------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, causal, route, softmax_scale, deterministic, forward_only = inputs
    o, lse, *codes = output
    ctx.mark_non_differentiable(lse, *codes)
    # no zero-filled gradients for lse and the nine code outputs (autograd would materialise them on
    # every step: 9 fills and ~200 MiB at 4x4096); _backward handles None
    ctx.set_materialize_grads(False)
    ctx.kept = saves_codes(route) and not forward_only  # else the codes are empty placeholders
    if ctx.kept:
        # the backward reads only the codes (and q, k, v's shapes, which the code tensors share): the
        # BF16 q, k, v are not saved, so keeping ~5 B per element saves memory against their 6
        ctx.save_for_backward(o, lse, cu_seqlens, *codes)
    else:
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.max_seqlen, ctx.causal, ctx.route, ctx.softmax_scale = max_seqlen, causal, route, softmax_scale
    ctx.deterministic = deterministic


def _backward(ctx, grad_o, grad_lse, *grad_codes):
    # lse and the codes are non-differentiable (marked in setup_context): their grads are ignored
    return _backward_with(torch.ops.flamia.attention_bwd, ctx, grad_o)


def _backward_with(bwd, ctx, grad_o):
    """The backward of attention_fwd's autograd: `bwd` is the attention_bwd op or (eager path) its implementation."""
    if ctx.kept:
        o, lse, cu_seqlens, *codes = ctx.saved_tensors
        q, k, v = codes[0], codes[3], codes[6]  # Q, K, V codes: stand-ins of q, k, v's shapes
    else:
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        codes = []
    if grad_o is None:
        return (None,) * 10
    if grad_o.dtype != torch.bfloat16:  # autograd passes a gradient of another dtype as given (o.backward(fp32))
        grad_o = grad_o.to(torch.bfloat16)
    dq, dk, dv = bwd(grad_o.contiguous(), q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.causal, ctx.route,
                     ctx.softmax_scale, codes, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 7


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- the eager path

# Devices whose plain tensors take the eager path (the kernels' device; tests add "cpu" with stand-in kernels).
EAGER_DEVICES = frozenset({"cuda"})


def eager_path_ok(*tensors: torch.Tensor) -> bool:
    """True when `attention` may run the two ops' implementations under `_EagerAttention` instead of dispatching
    the torch.library ops: plain tensors on a kernel device, no compiler or jit tracing, no Python dispatch or
    torch-function mode (fake tensors, make_fx, FlopCounterMode), no functorch transform. Same implementations, so
    the same launches and bits; what the path saves is the ops' dispatch (0.17–0.29 ms of host time a train call on
    H100 hosts, docs/ops.md "Host time"). Everything else goes through the ops, whose fake implementations trace."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # (a jit trace would not see the launches)
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.device.type not in EAGER_DEVICES:
            return False
    return (_get_current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None)


class _EagerAttention(torch.autograd.Function):
    """attention_fwd's implementation with the op's own setup_context and backward, as a plain autograd.Function.
    forward(ctx, ...) rather than a separate setup_context: that style binds the arguments to forward's signature
    (inspect) on every call, ≈ 0.08 ms of host time on an H100 host (perf-notes round 37)."""

    @staticmethod
    def forward(ctx, *args):
        out = _attention_fwd_impl(*args)
        _setup_context(ctx, args, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a double backward raises by name (the op's has no formula either)
    def backward(ctx, grad_o, grad_lse, *grad_codes):
        # a backward traced or run under a mode (compiled autograd, a dispatch mode around .backward()) takes the op
        bwd = _eager_bwd if grad_o is None or eager_path_ok(grad_o) else torch.ops.flamia.attention_bwd
        return _backward_with(bwd, ctx, grad_o)


# ---------------------------------------------------------------- the public function


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
              causal: bool = True, route: str = "fp8_token", softmax_scale: float | None = None,
              deterministic: bool = False) -> torch.Tensor:
    """Packed low-precision attention with autograd: BF16 o (T, HQ, D).

    q (T, HQ, D), k, v (T, HKV, D) BF16 on one CUDA device (non-contiguous inputs are copied),
    HQ a multiple of HKV, D 64 or 128 (sm90 kernels for both since 2026-11-29);
    cu_seqlens int32 (num_docs + 1) on the same device, cu_seqlens[0] = 0, cu_seqlens[-1] = T,
    non-decreasing (values are not checked: that would sync); max_seqlen ≥ the longest document
    (a dispatch hint: it picks the kernel, never changes the result's masking).
    `deterministic=True`: the backward adds dQ partials in a fixed order, so gradients are bitwise
    reproducible run to run (a `_det` backward variant; NoKernelError when the bundle has none).
    Raises ValueError naming a bad argument and NoKernelError when the bundle has no kernel
    for the route (docs/ops.md)."""
    check_inputs(q, k, v, cu_seqlens, max_seqlen, causal, route, softmax_scale)
    if not isinstance(deterministic, bool):
        raise _bad("deterministic", f"expected a bool, got {type(deterministic).__name__}")
    if isinstance(softmax_scale, int):
        softmax_scale = float(softmax_scale)
    # no gradient can be asked for (no_grad / inference, or no input requires one): keep no codes for a backward
    forward_only = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    args = (q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.contiguous(), max_seqlen, causal, route,
            softmax_scale, deterministic, forward_only)
    if eager_path_ok(q, k, v, cu_seqlens):
        # no gradient to come: nothing for autograd to record
        return _attention_fwd_impl(*args)[0] if forward_only else _EagerAttention.apply(*args)[0]
    return torch.ops.flamia.attention_fwd(*args)[0]
