"""Host side of the sm90 attention forward (`templates/sm90/attn_fwd.py.j2`).

Needs only torch (no CuTe DSL): builds the longest-first work list on the device with torch
ops (no host synchronisation, so a call is CUDA-graph capturable), checks inputs cheaply,
allocates the outputs and calls the ahead-of-time compiled tvm-ffi function.

Work list: one row (doc, m_block, window) per document-local query tile, sorted by descending
work (key tiles the tile visits), padded with (-1, -1, -1) to the static bound
NUM_WORK = ceil(T / tile_m) + NUM_DOCS (Σ_d ceil(len_d / tile_m) never exceeds it).

Windows (`fwd_schedule`): documents shorter than a query tile that start in the same tile_m-token
chunk of the packed row are merged into one *window* (a contiguous run of whole documents), which
the kernel runs as one pseudo-document whose tiles are all masked and whose rows see only their own
document (`row_doc`: each token's document [start, end)). 131072 one-token documents then take 1024
query tiles instead of 131072.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from .quant import padded_token_rows

SUPPORTED_HEAD_DIMS = (64, 128)
_FP8_CODE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def num_work(T: int, num_docs: int, tile_m: int) -> int:
    """Static upper bound on the number of (document, query tile) items."""
    return -(-T // tile_m) + num_docs


def kernel_key_align(fp8: bool) -> int:
    """Where the kernels' key tiles start: FP8 kernels at the document start rounded down to 16
    keys (their Vᵀ / K-major TMA loads need 16-byte-aligned key coordinates; the template's
    KEY_ALIGN), BF16 kernels at the document start."""
    return 16 if fp8 else 1


def make_work_list(cu_seqlens: torch.Tensor, tile_m: int, causal: bool, *, T: int | None = None,
                   tile_n: int | None = None) -> torch.Tensor:
    """int32 (NUM_WORK, 3) work list (doc, m_block, 0), longest first, on cu_seqlens' device.

    `T` (the total token count, known from the tensors' shapes) sizes the list without reading
    cu_seqlens back; left out, it is read from cu_seqlens[-1] (a host sync on a GPU).
    Work of an item = key tiles of `tile_n` (default tile_m) it visits; ties keep (doc, m_block)
    order. Padding entries (-1, -1, -1) come last."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be 1-D with at least 2 entries (num_docs + 1)")
    if tile_m <= 0:
        raise ValueError(f"tile_m must be positive, got {tile_m}")
    tile_n = tile_m if tile_n is None else tile_n
    cu = cu_seqlens.to(torch.int64)
    if T is None:
        T = int(cu[-1].item())
    lens = (cu[1:] - cu[:-1]).clamp(min=0)

    def cost(doc, m_block):
        dlen = lens[doc]
        keys = torch.minimum(dlen, (m_block + 1) * tile_m) if causal else dlen
        return (keys + tile_n - 1) // tile_n

    return longest_first((lens + tile_m - 1) // tile_m, num_work(T, lens.numel(), tile_m), cost)


def longest_first(tiles: torch.Tensor, nw: int, cost) -> torch.Tensor:
    """The work list both directions share: one item (doc, block, 0) per tile of each document
    (`tiles`: int64 tiles per document), sorted by descending `cost(doc, block)` (int64, one
    per item; ties keep (doc, block) order), padded with (-1, -1, -1) to `nw` rows. int32."""
    nd = tiles.numel()
    ends = torch.cumsum(tiles, 0)
    idx = torch.arange(nw, device=tiles.device, dtype=torch.int64)
    doc = torch.searchsorted(ends, idx, right=True)
    valid = doc < nd
    docc = doc.clamp(max=nd - 1)
    block = idx - (ends - tiles)[docc]
    neg = torch.full_like(idx, -1)
    order = torch.sort(torch.where(valid, cost(docc, block), neg), descending=True, stable=True).indices
    work = torch.stack([torch.where(valid, doc, neg), torch.where(valid, block, neg),
                        torch.where(valid, torch.zeros_like(idx), neg)], dim=1)
    return work[order].to(torch.int32).contiguous()


class FwdSchedule(NamedTuple):
    """What the forward kernel is launched over: `cu` int32 (NUM_DOCS + 1) the work list's documents
    (real documents and windows, padded with T), `work` int32 (NUM_WORK, 3) (doc of `cu`, m_block,
    window flag), `row_doc` int32 (T, 2) every token's real document [start, end)."""
    cu: torch.Tensor
    work: torch.Tensor
    row_doc: torch.Tensor


class Windows(NamedTuple):
    """Documents with the short ones merged (`merge_windows`): `cu` int32 (NUM_DOCS + 1) pseudo-documents
    (real documents and windows, unused entries T), `flag` int64 (NUM_DOCS + 1) 1 for a window of ≥ 2
    documents, `row_doc` int32 (T, 2) every token's real document [start, end)."""
    cu: torch.Tensor
    flag: torch.Tensor
    row_doc: torch.Tensor


def merge_windows(cu_seqlens: torch.Tensor, chunk: int, T: int) -> Windows:
    """Merge documents shorter than `chunk` into windows, on cu_seqlens' device with torch ops of static
    shapes (no host synchronisation). Both directions use it (forward: chunk = tile_m, backward: tile_n).

    A document shorter than `chunk` joins the window of the chunk its start falls in (start // chunk);
    consecutive such documents of one chunk are contiguous (a longer document that starts in the chunk
    ends past it), so a window is a run of whole documents, shorter than 2·chunk. A window of one
    document is that document (flag 0)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be 1-D with at least 2 entries (num_docs + 1)")
    cu = cu_seqlens.to(torch.int64)
    starts, ends = cu[:-1], cu[1:]
    lens = (ends - starts).clamp(min=0)
    nd = lens.numel()
    row_doc = torch.repeat_interleave(torch.stack([starts, ends], dim=1), lens, dim=0, output_size=T)
    row_doc = row_doc.to(torch.int32).contiguous()
    short = lens < chunk
    group_key = torch.where(short, starts // chunk, -1 - torch.arange(nd, device=cu.device))  # long: own group
    new = torch.ones(nd, dtype=torch.bool, device=cu.device)
    new[1:] = group_key[1:] != group_key[:-1]
    group = torch.cumsum(new.to(torch.int64), 0) - 1  # pseudo-document of each document
    pcu = torch.full((nd + 1,), T, dtype=torch.int64, device=cu.device)
    pcu.scatter_reduce_(0, group, starts, reduce="amin")  # first start of each group; unused entries stay T
    members = torch.zeros(nd + 1, dtype=torch.int64, device=cu.device).scatter_add_(0, group, torch.ones_like(group))
    flag = (members > 1).to(torch.int64)  # per pseudo-document: a window of ≥ 2 documents
    return Windows(pcu.to(torch.int32).contiguous(), flag, row_doc)


def flag_windows(work: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Column 2 of a work list (doc, block, 0) set to its pseudo-document's window flag; padding stays -1."""
    work = work.to(torch.int64)
    valid = work[:, 0] >= 0
    work[:, 2] = torch.where(valid, flag[work[:, 0].clamp(min=0)], work[:, 2])
    return work.to(torch.int32).contiguous()


def fwd_schedule(cu_seqlens: torch.Tensor, tile_m: int, causal: bool, *, T: int | None = None,
                 tile_n: int | None = None) -> FwdSchedule:
    """The forward's documents, work list and per-token document bounds, on cu_seqlens' device with
    torch ops of static shapes (no host synchronisation once T is given). Documents shorter than
    tile_m are merged into windows per tile_m chunk (`merge_windows`)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be 1-D with at least 2 entries (num_docs + 1)")
    if T is None:
        T = int(cu_seqlens[-1].item())
    w = merge_windows(cu_seqlens, tile_m, T)
    work = make_work_list(w.cu, tile_m, causal, T=T, tile_n=tile_n)
    return FwdSchedule(w.cu, flag_windows(work, w.flag), w.row_doc)


def _as_e4m3(t: torch.Tensor) -> torch.Tensor:
    """uint8 codes are viewed (no copy) as float8_e4m3fn, the dtype the kernel was compiled for."""
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def fwd_mode(args_spec: Sequence[dict]) -> str:
    """What a forward variant takes, from its ARGS: "fp8" (Q, K, Vᵀ E4M3 codes + per-token
    exponents), "qk_bf16" (nvfp4_mixed on sm90: Q, K BF16 NVFP4 code·block-scale, their tensor
    scales as `qk_tensor_scale`, Vᵀ E4M3 as fp8) or "bf16"."""
    names = {a["name"] for a in args_spec}
    if "v_t" not in names:
        return "bf16"
    return "qk_bf16" if "qk_tensor_scale" in names else "fp8"


def _is_fp8_spec(args_spec: Sequence[dict]) -> bool:
    """The variant's PV side is FP8 (Vᵀ codes, per-key V exponents): fp8 and qk_bf16 modes."""
    return fwd_mode(args_spec) != "bf16"


def k_rows_for_tma(k: torch.Tensor, t_pad: int) -> torch.Tensor:
    """k (T, HKV, D) whose storage holds `t_pad` rows from its first element.

    The fp8 K_ROW_PERM variants (PARAMS["k_row_perm"]) load K through a rank-5 TMA whose token
    dims are (2, 4, 2, T_PAD/16): per-dimension bounds cannot stop a read at T inside the last
    16-token group, so rows T … T_PAD−1 are read (and masked: key ≥ document length). When k's
    storage already extends that far (a padded quantizer buffer) k is returned as is; otherwise
    a zero-padded copy (T_PAD rows) is made and its first T rows returned."""
    T = k.shape[0]
    if t_pad <= T:
        return k
    need = (k.storage_offset() + t_pad * k.shape[1] * k.shape[2]) * k.element_size()
    if k.untyped_storage().nbytes() >= need:
        return k
    kp = padded_token_rows(k.shape, k.dtype, k.device, t_pad)
    kp.copy_(k)
    return kp


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def _check_tensor(t, name: str, dtypes, shape, device) -> None:
    """`shape`: the number of dims, or a tuple of sizes with None for any size.

    A passing tensor takes the first branch alone: the messages below cost more to build than the checks
    themselves (the op's backward checks ~15 tensors per call: 2026-12-06's host profile)."""
    if isinstance(t, torch.Tensor) and t.dtype in dtypes and t.device == device and t.is_contiguous():
        got = t.shape
        if isinstance(shape, int):
            if len(got) == shape:
                return
        elif len(got) == len(shape):
            for g, w in zip(got, shape):
                if w is not None and g != w:
                    break
            else:
                return
    # something is wrong: the checks in order, each with its message
    if isinstance(shape, int):
        shape = (None,) * shape
    _need(isinstance(t, torch.Tensor), name, f"expected a torch.Tensor, got {type(t).__name__}")
    _need(t.dtype in dtypes, name, f"dtype {t.dtype} not in {tuple(str(d) for d in dtypes)}")
    _need(t.dim() == len(shape), name, f"expected {len(shape)} dims, got shape {tuple(t.shape)}")
    if any(w is not None and g != w for g, w in zip(t.shape, shape)):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple('*' if w is None else w for w in shape)}")
    _need(t.is_contiguous(), name, "must be contiguous")
    _need(t.device == device, name, f"on {t.device}, expected {device} (the device of q)")


def _check_common(cu_seqlens, T: int, HQ: int, D: int, dev) -> None:
    """cu_seqlens (int32, 1-D, ≥ 2 entries; values only on the CPU: on a GPU that would
    synchronise) and the int32 element-offset bound, for both directions."""
    _check_tensor(cu_seqlens, "cu_seqlens", (torch.int32,), 1, dev)
    _need(cu_seqlens.numel() >= 2, "cu_seqlens", "needs num_docs + 1 ≥ 2 entries")
    _need(T * max(HQ, 1) * D < 2 ** 31, "q", "T·HQ·D must fit in int32 element offsets")
    if cu_seqlens.device.type == "cpu":
        c = cu_seqlens
        _need(int(c[0]) == 0, "cu_seqlens", f"cu_seqlens[0] = {int(c[0])}, expected 0")
        _need(int(c[-1]) == T, "cu_seqlens", f"cu_seqlens[-1] = {int(c[-1])}, expected T = {T}")
        _need(bool((c[1:] >= c[:-1]).all()), "cu_seqlens", "must be non-decreasing")


def check_fwd_inputs(q, k, v, q_scale=None, k_scale=None, v_scale=None, *, cu_seqlens,
                     fp8: bool, head_dim: int | None = None, qk_bf16: bool = False,
                     qk_tensor_scale=None) -> tuple[int, int, int, int]:
    """Validate the forward's inputs; returns (T, HQ, HKV, D). Raises ValueError naming the
    argument. fp8: q, k codes (T, H, D) uint8/float8_e4m3fn, v = v_t codes (HKV, D, T_PAD),
    scales uint8 (T, H); fp8 with qk_bf16 (nvfp4_mixed): q, k BF16 (T, H, D), no q/k scales,
    `qk_tensor_scale` fp32 (1,), v_t and v_scale as fp8; bf16: q, k, v BF16 (T, H, D).
    cu_seqlens values are checked only on the CPU (checking them on a GPU would synchronise)."""
    dev = q.device if isinstance(q, torch.Tensor) else None
    _need(fp8 or not qk_bf16, "q", "qk_bf16 (BF16 Q, K with an FP8 PV side) needs fp8=True")
    code = _FP8_CODE_DTYPES if fp8 else (torch.bfloat16,)
    qk_code = (torch.bfloat16,) if qk_bf16 else code
    _check_tensor(q, "q", qk_code, 3, dev)
    T, HQ, D = q.shape
    _need(D in SUPPORTED_HEAD_DIMS, "q", f"unsupported head dim on sm90: D={D} (supported: {SUPPORTED_HEAD_DIMS})")
    if head_dim is not None:
        _need(D == head_dim, "q", f"head dim {D} != {head_dim}, the head dim this kernel was compiled for")
    _check_tensor(k, "k", qk_code, 3, dev)
    _need(k.shape[0] == T and k.shape[2] == D, "k", f"shape {tuple(k.shape)} does not match q (T={T}, D={D})")
    HKV = k.shape[1]
    _need(HKV > 0 and HQ % HKV == 0, "k", f"HQ={HQ} is not a multiple of HKV={HKV}")
    if fp8:
        _check_tensor(v, "v_t", code, 3, dev)
        _need(v.shape[0] == HKV and v.shape[1] == D, "v_t", f"shape {tuple(v.shape)}, expected (HKV={HKV}, D={D}, T_PAD)")
        _need(v.shape[2] >= T and v.shape[2] % 16 == 0, "v_t",
              f"T_PAD={v.shape[2]} must be ≥ T={T} and a multiple of 16 (TMA strides)")
        scales = ((v_scale, "v_scale", HKV),) if qk_bf16 else \
            ((q_scale, "q_scale", HQ), (k_scale, "k_scale", HKV), (v_scale, "v_scale", HKV))
        for t, name, h in scales:
            _check_tensor(t, name, (torch.uint8,), 2, dev)
            _need(tuple(t.shape) == (T, h), name, f"shape {tuple(t.shape)}, expected (T={T}, {h})")
        if qk_bf16:
            for t, name in ((q_scale, "q_scale"), (k_scale, "k_scale")):
                _need(t is None, name, "nvfp4_mixed takes no per-token Q/K scales (its block scales are in the BF16 "
                                       "values, its tensor scales in qk_tensor_scale)")
            _check_tensor(qk_tensor_scale, "qk_tensor_scale", (torch.float32,), (1,), dev)
    else:
        _check_tensor(v, "v", code, 3, dev)
        _need(tuple(v.shape) == (T, HKV, D), "v", f"shape {tuple(v.shape)}, expected {(T, HKV, D)}")
        for t, name in ((q_scale, "q_scale"), (k_scale, "k_scale"), (v_scale, "v_scale")):
            _need(t is None, name, "the bf16 route takes no scales")
    if not qk_bf16:
        _need(qk_tensor_scale is None, "qk_tensor_scale", "only the nvfp4_mixed (qk_bf16) variants take it")
    _check_common(cu_seqlens, T, HQ, D, dev)
    return T, HQ, HKV, D


DIAG_INPUTS = ("k_diag", "k_diag_scale", "v_t_diag", "v_diag_scale")


def diag_inputs_needed(params: dict) -> tuple[str, ...]:
    """The per-token copies a variant reads on its diagonal (masked) key tiles: K and its scales
    when PARAMS["diag_k"], Vᵀ and its scales when PARAMS["diag_v"] (Route.forward_safeguards)."""
    return (("k_diag", "k_diag_scale") if params.get("diag_k") else ()) + \
        (("v_t_diag", "v_diag_scale") if params.get("diag_v") else ())


def check_diag_inputs(diag: dict, params: dict, T: int, HKV: int, D: int, t_pad: int, dev) -> None:
    """The diagonal-tile copies: exactly those the variant needs, shaped like k, its scales and v_t."""
    need = diag_inputs_needed(params)
    extra = sorted(set(diag) - set(need))
    _need(not extra, extra[0] if extra else "", "this variant takes no such input (no diagonal safeguard for it)")
    for name in need:
        t = diag.get(name)
        _need(t is not None, name, "required by this variant's diagonal-tile safeguard (Route.forward_safeguards)")
        if name.endswith("_scale"):
            _check_tensor(t, name, (torch.uint8,), (T, HKV), dev)
        elif name == "k_diag":
            _check_tensor(t, name, _FP8_CODE_DTYPES, (T, HKV, D), dev)
        else:
            _check_tensor(t, name, _FP8_CODE_DTYPES, (HKV, D, t_pad), dev)


def unit_counter_arg(args_spec: Sequence[dict], dev) -> dict:
    """{"unit_counter": a zeroed int32 word} when the kernel's ARGS name one (the atomic-counter scheduler of the
    forward and the backward: fwd_dynamic, bwd_dynamic), else {}. Zero at every launch: the kernel leaves it at the
    number of units it handed out. A fresh word per call (one memset launch), no host sync."""
    if any(a["name"] == "unit_counter" for a in args_spec):
        return {"unit_counter": torch.zeros(1, dtype=torch.int32, device=dev)}
    return {}


def run_attn_fwd(fn, args_spec: Sequence[dict], q, k, v, q_scale=None, k_scale=None, v_scale=None, *,
                 cu_seqlens, params: dict, softmax_scale: float | None = None, poison: bool = False,
                 schedule: FwdSchedule | None = None, diag: dict | None = None,
                 qk_tensor_scale: torch.Tensor | None = None, check: bool = True):
    """Call a compiled attention forward; returns (o BF16 (T, HQ, D), lse fp32 (HQ, T)).

    `fn`: the tvm-ffi function; `args_spec`: the module's ARGS; `params`: its PARAMS (tile_m,
    tile_n, causal, head_dim). fp8 routes: q, k codes, v = v_t codes (HKV, D, T_PAD) and the
    three uint8 scale tensors; nvfp4_mixed (`fwd_mode` "qk_bf16"): q, k BF16 code·block-scale
    (runtime.nvfp4), v = v_t codes, v_scale and `qk_tensor_scale` (fp32 (1,) = ts_q·ts_k, on the
    device: the kernel folds it into the softmax scale); bf16: q, k, v. `diag`: the per-token
    copies the token-block routes' diagonal tiles read (`diag_inputs_needed`: k_diag, k_diag_scale,
    v_t_diag, v_diag_scale). `poison` fills the outputs with NaN first, so a row the kernel never
    writes shows up. `schedule` (`fwd_schedule` of these cu_seqlens and the variant's tiles) is built
    here when not given (callers cache it per cu_seqlens). `check=False` skips the input checks (≈ 0.1 ms of host
    time per call on the H200 host, 2026-12-03): only for callers whose q, k, v were validated and whose codes and
    scales come from the bundle's own quantizers (the op, `runtime.attention.packed_attention`)."""
    mode = fwd_mode(args_spec)
    fp8 = mode != "bf16"
    diag = dict(diag or {})
    if check:
        T, HQ, HKV, D = check_fwd_inputs(q, k, v, q_scale, k_scale, v_scale, cu_seqlens=cu_seqlens, fp8=fp8,
                                         head_dim=params.get("head_dim"), qk_bf16=mode == "qk_bf16",
                                         qk_tensor_scale=qk_tensor_scale)
        if fp8:
            check_diag_inputs(diag, params, T, HKV, D, v.shape[2], q.device)
        elif diag:
            raise ValueError(f"{sorted(diag)[0]}: the bf16 route takes no diagonal-tile copies")
    else:  # the one check no caller's validation covers, and a pair of integer ops: int32 element offsets
        T, HQ, D = q.shape
        HKV = k.shape[1]
        _need(T * max(HQ, 1) * D < 2 ** 31, "q", "T·HQ·D must fit in int32 element offsets")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    dev = q.device
    if poison:
        o = torch.full((T, HQ, D), float("nan"), dtype=torch.bfloat16, device=dev)
        lse = torch.full((HQ, T), float("nan"), dtype=torch.float32, device=dev)
    else:
        o = torch.empty((T, HQ, D), dtype=torch.bfloat16, device=dev)
        lse = torch.empty((HQ, T), dtype=torch.float32, device=dev)
    if T == 0:
        return o, lse
    if schedule is None:
        schedule = fwd_schedule(cu_seqlens, params["tile_m"], params["causal"], T=T, tile_n=params.get("tile_n"))
    else:  # a schedule built for other rows or another tile_m would be read out of bounds or miss rows
        nw = num_work(T, cu_seqlens.numel() - 1, params["tile_m"])
        _need(tuple(schedule.cu.shape) == tuple(cu_seqlens.shape) and tuple(schedule.row_doc.shape) == (T, 2)
              and tuple(schedule.work.shape) == (nw, 3), "schedule",
              f"built for other documents or tiles (cu {tuple(schedule.cu.shape)}, row_doc "
              f"{tuple(schedule.row_doc.shape)}, work {tuple(schedule.work.shape)}; expected "
              f"{tuple(cu_seqlens.shape)}, {(T, 2)}, {(nw, 3)} for tile_m={params['tile_m']})")
    by_name = {"cu_seqlens": schedule.cu, "row_doc": schedule.row_doc, "work": schedule.work,
               "softmax_scale": float(softmax_scale), "o": o, "lse": lse}
    if fp8:  # both 8-bit modes: the diagonal-tile copies (codes viewed as E4M3)
        by_name.update({n: (t if n.endswith("_scale") else _as_e4m3(t)) for n, t in diag.items()})
    if mode == "qk_bf16":
        by_name.update(q=q, k=k, v_t=_as_e4m3(v), v_scale=v_scale, qk_tensor_scale=qk_tensor_scale)
    elif fp8:
        if params.get("k_row_perm"):
            k = k_rows_for_tma(k, v.shape[2])
        by_name.update(q=_as_e4m3(q), q_scale=q_scale, k=_as_e4m3(k), k_scale=k_scale, v_t=_as_e4m3(v),
                       v_scale=v_scale)
        if params.get("k_row_perm") and "k_diag" in diag:
            by_name["k_diag"] = _as_e4m3(k_rows_for_tma(diag["k_diag"], v.shape[2]))
    else:
        by_name.update(q=q, k=k, v=v)
    by_name.update(unit_counter_arg(args_spec, dev))
    missing = [a["name"] for a in args_spec if a["name"] not in by_name]
    if missing:
        raise ValueError(f"args_spec names arguments this wrapper does not know: {missing}")
    fn(*[by_name[a["name"]] for a in args_spec])
    return o, lse


__all__ = ["unit_counter_arg", "make_work_list", "fwd_schedule", "FwdSchedule", "merge_windows", "Windows", "flag_windows", "longest_first", "num_work", "check_fwd_inputs", "run_attn_fwd", "k_rows_for_tma",
           "fwd_mode",
           "SUPPORTED_HEAD_DIMS", "DIAG_INPUTS", "diag_inputs_needed", "check_diag_inputs"]
