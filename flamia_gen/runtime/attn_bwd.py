"""Host side of the sm90 attention backward (`templates/sm90/attn_bwd.py.j2`); runs on the H200
since 2026-11-29 (docs/kernels/attn_bwd.md).

Needs only torch (no CuTe DSL): builds the longest-first work list of key tiles on the device
with torch ops (no host synchronisation, so a call is CUDA-graph capturable), checks inputs
cheaply, allocates dK, dV, calls the ahead-of-time compiled tvm-ffi function and converts the
fp32 dQ accumulator (reduce-added by the kernel) to BF16 dQ with one torch op.

Work list: one row (doc, n_block, window) per document key tile, sorted by descending work (query
tiles the key tile visits), padded with (-1, -1, -1) to NUM_WORK = ceil(T / tile_n) + 2·NUM_DOCS
(FP8 tiles start at doc_start rounded down to 16, which can add one key tile per document).
Windows (`bwd_schedule`): documents shorter than a key tile that start in the same tile_n chunk are
merged into one pseudo-document whose query tiles are all masked and where a key is seen only by
queries of its own document (`row_doc`), as in the forward (runtime.attn_fwd.merge_windows); a
persistent CTA leaves its loop at the first padding unit.
Unit lists (`head_units`, variants whose PARAMS carry `bwd_head_section`: the atomic-counter scheduler's default and
one CTA per unit): the work list × KV heads as (NUM_UNITS, 4) rows (doc, n_block, window, KV head), the heads in sections
(few heads' Q, dO, dQ rows in L2 at once), padding last; with windows cut first to `num_window_items` rows.
A kernel unit is (work item, KV head): it loops over the KV head's query heads, so dK and dV are
summed over the GQA group in registers and written once (deterministic); dQ partials are
reduce-added in fp32 (bulk reduce-adds from shared memory, in no fixed order: not deterministic in
the last bits; see the design doc).

Deterministic variants (`deterministic: true` in the spec, `_det` in the name, ARGS with `dq_sem`)
add the partials of each (query head, query tile) in increasing key-tile order behind an int32
semaphore: run_attn_bwd zeroes `dq_sem` (HQ, num_dq_tiles); `bwd_schedule` builds `dq_tile_off` (the per-document
prefix of query-tile counts, `dq_tile_offsets`) on the device, both without a host sync. The
ordering argument is in the template and in docs/kernels/attn_bwd.md ("Deterministic mode"); it needs
the work list's order (a document's key tiles in increasing n) and a GPU with ≥ sm_count SMs.
Bitwise reproducible on the H200 (runs and CUDA-graph replay, 2026-11-29).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from .attn_fwd import (_FP8_CODE_DTYPES, _as_e4m3, _check_common, _check_tensor, _need, flag_windows, k_rows_for_tma,
                       kernel_key_align, longest_first, merge_windows, unit_counter_arg)

_E5M2_CODE_DTYPES = (torch.uint8, torch.float8_e5m2)

SUPPORTED_HEAD_DIMS = (64, 128)


def num_work(T: int, num_docs: int, tile_n: int) -> int:
    """Static upper bound on the number of (document, key tile) items (any key alignment ≤ tile_n)."""
    return -(-T // tile_n) + 2 * num_docs


def bwd_tiles(cu_seqlens: torch.Tensor, tile_m: int, tile_n: int, key_align: int):
    """Per document (on the device, int64): (lengths, delta, key tiles, query tiles) exactly as the kernel's
    `bwd_tiling`: tiles start at doc_start − delta, delta = doc_start mod key_align."""
    cu = cu_seqlens.to(torch.int64)
    lens = (cu[1:] - cu[:-1]).clamp(min=0)
    delta = cu[:-1] % key_align
    nkt = torch.where(lens > 0, (lens + delta + tile_n - 1) // tile_n, torch.zeros_like(lens))
    nqt = (lens + delta + tile_m - 1) // tile_m
    return lens, delta, nkt, nqt


def num_dq_tiles(T: int, num_docs: int, tile_m: int, key_align: int = 16) -> int:
    """Static upper bound on Σ_d (query tiles of document d) = the width of `dq_sem`.

    Document d has ceil((len_d + delta_d) / tile_m) query tiles (delta_d = doc_start mod key_align <
    key_align); Σ_d ceil(len_d / tile_m) ≤ ceil(T / tile_m) + num_docs − 1 and ceil((L + delta) / M) ≤
    ceil(L / M) + ceil((key_align − 1) / M). For key_align = 16 ≤ tile_m: ceil(T / tile_m) + 2·num_docs."""
    return -(-T // tile_m) + num_docs * (1 + -(-(key_align - 1) // tile_m))


def dq_tile_offsets(cu_seqlens: torch.Tensor, tile_m: int, key_align: int) -> torch.Tensor:
    """int32 (NUM_DOCS + 1) on cu_seqlens' device: entry d is the `dq_sem` column of document d's query
    tile 0 (the prefix sum of the documents' query-tile counts, empty documents count 0; the last entry
    is the total). One column per (document, query tile): FP8 tiles of neighbouring documents may start
    at the same token (doc_start rounded down to 16), their semaphores never do. No host sync."""
    lens, _, _, nqt = bwd_tiles(cu_seqlens, tile_m, 1, key_align)
    nqt = torch.where(lens > 0, nqt, torch.zeros_like(nqt))
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=nqt.device), torch.cumsum(nqt, 0)]).to(torch.int32)


def is_deterministic_spec(args_spec: Sequence[dict]) -> bool:
    """A deterministic variant (ordered dQ reduction): its ARGS take the `dq_sem` semaphore."""
    return any(a["name"] == "dq_sem" for a in args_spec)


def make_work_list(cu_seqlens: torch.Tensor, tile_m: int, tile_n: int, causal: bool, *, key_align: int = 1,
                   T: int | None = None) -> torch.Tensor:
    """int32 (NUM_WORK, 3) work list (doc, n_block, 0), longest first, on cu_seqlens' device.

    Work of an item = query tiles m_lo … m_hi − 1 its key tile visits (causal: from the tile of the
    key tile's first key; non-causal: all). Ties keep (doc, n_block) order; padding (-1, -1, -1)
    last. `T` sizes the list without reading cu_seqlens back (left out: a host sync on a GPU)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens: must be 1-D with at least 2 entries (num_docs + 1)")
    if tile_m <= 0 or tile_n <= 0:
        raise ValueError(f"tile_m, tile_n: must be positive, got {tile_m}, {tile_n}")
    if key_align not in (1, 16):
        raise ValueError(f"key_align: 1 (bf16) or 16 (fp8 K-major TMA), got {key_align}")
    if T is None:
        T = int(cu_seqlens[-1].item())
    _, delta, nkt, nqt = bwd_tiles(cu_seqlens, tile_m, tile_n, key_align)

    def cost(doc, n_block):  # query tiles m_lo … nqt − 1 of the key tile
        if not causal:
            return nqt[doc]
        return nqt[doc] - torch.maximum(n_block * tile_n, delta[doc]) // tile_m

    return longest_first(nkt, num_work(T, nkt.numel(), tile_n), cost)


def num_window_items(T: int, tile_n: int) -> int:
    """Static upper bound on the work items of a schedule WITH windows, whatever the document count: every pseudo-
    document (a window, < 2·tile_n tokens, at most one per tile_n chunk; or a document of ≥ tile_n tokens, at most
    T // tile_n) has ceil((len + delta) / tile_n) < len / tile_n + 2 key tiles (delta < 16 ≤ tile_n), and the lengths
    sum to T: fewer than T / tile_n + 2·(ceil(T / tile_n) + T // tile_n) ≤ 5·ceil(T / tile_n) items. (`num_work`
    grows with the document count: 131072 one-token documents give ~2.6·10⁵ rows, almost all padding.)"""
    return 5 * -(-T // tile_n)


def num_units(T: int, num_docs: int, tile_n: int, hkv: int, windows: bool = True) -> int:
    """Rows of a `bwd_head_section` variant's unit list: (work rows kept) × hkv. With windows the work list is cut to
    `num_window_items` rows first (only padding goes: the real items never exceed it), so a one-CTA-per-unit launch
    does not start a CTA per padding row of a many-document row."""
    nw = num_work(T, num_docs, tile_n)
    return (min(nw, num_window_items(T, tile_n)) if windows else nw) * hkv


def head_units(work: torch.Tensor, hkv: int, section: int) -> torch.Tensor:
    """int32 (NUM_WORK·HKV, 4) unit list (doc, n_block, window, KV head) of a `bwd_head_section` variant, on work's
    device, no host sync: the KV heads in sections of `section` heads, a section's units item-major in `work`'s
    (longest-first) order with its heads inner, padding rows (doc < 0) after every real one. The CTAs that run at
    once then share the Q, dO and dQ rows of few heads in L2 (FA3's backward swizzles heads by its L2 size for the
    same reason); section ≥ HKV is `work`'s item-major order. Each head's items keep `work`'s order: the
    deterministic mode's ordering argument (key tiles of a document in increasing n) holds per head."""
    if work.dim() != 2 or work.shape[1] != 3:
        raise ValueError(f"work: expected (NUM_WORK, 3), got {tuple(work.shape)}")
    if hkv < 1 or section < 1:
        raise ValueError(f"hkv, section: must be ≥ 1, got {hkv}, {section}")
    nw, dev = work.shape[0], work.device
    s = min(section, hkv)
    h = torch.arange(hkv, device=dev, dtype=torch.int64)
    item = torch.arange(nw, device=dev, dtype=torch.int64)
    key = ((h // s)[:, None] * nw + item[None, :]) * s + (h % s)[:, None]  # (hkv, nw), distinct
    key = key + (work[:, 0] < 0).to(torch.int64)[None, :] * (hkv * nw * s)  # padding last
    rows = torch.cat([work.unsqueeze(0).expand(hkv, nw, 3),
                      h.to(work.dtype)[:, None, None].expand(hkv, nw, 1)], dim=2).reshape(hkv * nw, 4)
    return rows[torch.argsort(key.reshape(-1))].contiguous()


class BwdSchedule(NamedTuple):
    """What the backward kernel is launched over: `cu` int32 (NUM_DOCS + 1) the work list's documents
    (real documents and windows, unused entries T), `work` int32 (NUM_WORK, 3) (doc of `cu`, n_block,
    window flag), `row_doc` int32 (T, 2) every token's real document [start, end), `dq_tile_off` int32
    (NUM_DOCS + 1) the deterministic mode's per-document query-tile columns (`dq_tile_offsets` of `cu`)."""
    cu: torch.Tensor
    work: torch.Tensor
    row_doc: torch.Tensor
    dq_tile_off: torch.Tensor


def bwd_windows(params: dict) -> bool:
    """Whether a backward variant (PARAMS `params`) runs short documents merged into windows
    (`bwd_schedule`): every variant but a 32×32-block dS (`ds_gran: square_32`) kernel built without the
    template's `bwd_sq32_windows` (its blocks would mix the window's documents; a kernel with the flag cuts
    each block to one document in window tiles)."""
    return params.get("ds_gran") != "square_32" or bool(params.get("bwd_sq32_windows"))


def bwd_schedule(cu_seqlens: torch.Tensor, tile_m: int, tile_n: int, causal: bool, *, key_align: int = 1,
                 T: int | None = None, windows: bool = True, hkv: int = 1, head_section: int = 0) -> BwdSchedule:
    """The backward's documents (short ones merged into windows per tile_n chunk: `merge_windows`),
    longest-first work list, per-token document bounds and dQ tile offsets, on cu_seqlens' device
    without a host synchronisation once T is given.

    `windows=False`: every document keeps its own key tiles (no windows; every work item's window flag
    is 0; `cu` is cu_seqlens itself as int32). Routes whose dS is scaled per 32×32 block (`ds_gran:
    square_32`) need it unless their kernel has `bwd_sq32_windows` (`bwd_windows`): a block of a window would
    otherwise share one amax across documents. The shapes and
    dtypes are those of `windows=True` (NUM_WORK bounds both).

    `head_section` > 0 (a `bwd_head_section` variant's PARAMS): `work` is the (NUM_WORK·hkv, 4) unit list of
    `head_units`, the KV head in its last column."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens: must be 1-D with at least 2 entries (num_docs + 1)")
    if T is None:
        T = int(cu_seqlens[-1].item())
    if windows:
        w = merge_windows(cu_seqlens, tile_n, T)
        cu, flag, row_doc = w.cu, w.flag, w.row_doc
    else:
        cu = cu_seqlens.to(torch.int32).contiguous()
        flag = torch.zeros(cu.numel(), dtype=torch.int64, device=cu.device)
        # row_doc does not depend on the chunk: merge_windows' own per-token bounds (one place computes them)
        row_doc = merge_windows(cu_seqlens, 1, T).row_doc
    work = flag_windows(make_work_list(cu, tile_m, tile_n, causal, key_align=key_align, T=T), flag)
    if head_section > 0:
        if windows:  # padding is last: the rows past the bound are padding (num_window_items)
            work = work[:num_window_items(T, tile_n)]
        work = head_units(work, hkv, head_section)
    return BwdSchedule(cu, work, row_doc, dq_tile_offsets(cu, tile_m, key_align))


def check_bwd_inputs(q, k, v, do, lse, delta, *, cu_seqlens, fp8: bool, q_t=None, k_t=None, do_t=None,
                     q_scale=None, k_scale=None, v_scale=None, do_scale=None, dq_accum=None,
                     head_dim: int | None = None, scores_bf16: bool = False,
                     ds16: bool = False, do_e5m2: bool = False, q_hat: bool = False) -> tuple[int, int, int, int]:
    """Validate the backward's inputs; returns (T, HQ, HKV, D). Raises ValueError naming the
    argument. fp8: q, k, v, do codes (T, H, D) uint8/float8_e4m3fn, q_t, k_t, do_t codes (H, D, T_PAD),
    four uint8 scale tensors (T, H); with `scores_bf16` q and k are the BF16 inputs instead (Sᵀ = K·Qᵀ
    in BF16; q_t, k_t and the scales still serve dK, dQ), with `ds16` too (dK, dQ in BF16 on q, k: route
    fp8_pv) there are no q_t, k_t, q_scale, k_scale; with `do_e5m2` (route fp8_tensor) do and do_t are E5M2
    codes (uint8/float8_e5m2); with `q_hat` (bwd_dk_bf16: dK takes Q̂, which the call builds from q and the scale
    codes) there is no q_t; bf16: q, k, v, do BF16 (T, H, D). lse, delta
    fp32 (HQ, T); dq_accum, when given, fp32 (T, HQ, D). cu_seqlens values are checked only on the CPU."""
    dev = q.device if isinstance(q, torch.Tensor) else None
    code = _FP8_CODE_DTYPES if fp8 else (torch.bfloat16,)
    qk_code = (torch.bfloat16,) if scores_bf16 else code
    _need(fp8 or not scores_bf16, "q", "scores_bf16 (BF16 q, k with FP8 dP, dV, dK, dQ) needs fp8=True")
    _need(scores_bf16 or not ds16, "q", "ds16 (BF16 dK, dQ on BF16 q, k) needs scores_bf16=True")
    _need(fp8 or not do_e5m2, "do", "do_e5m2 (E5M2 dO codes) needs fp8=True")
    do_code = _E5M2_CODE_DTYPES if do_e5m2 else code
    _check_tensor(q, "q", qk_code, (None, None, None), dev)
    T, HQ, D = q.shape
    # (messages as f-strings only where a check failed: the op's backward runs this on every call)
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: unsupported head dim for the sm90 backward: D={D} (supported: {SUPPORTED_HEAD_DIMS})")
    if head_dim is not None and D != head_dim:
        raise ValueError(f"q: head dim {D} != {head_dim}, the head dim this kernel was compiled for")
    _check_tensor(k, "k", qk_code, (T, None, D), dev)
    HKV = k.shape[1]
    if not (HKV > 0 and HQ % HKV == 0):
        raise ValueError(f"k: HQ={HQ} is not a multiple of HKV={HKV}")
    _check_tensor(v, "v", code, (T, HKV, D), dev)
    _check_tensor(do, "do", do_code, (T, HQ, D), dev)
    if fp8:
        tpad = None
        qk = () if ds16 else ((k_t, "k_t", HKV),) if q_hat else ((q_t, "q_t", HQ), (k_t, "k_t", HKV))
        if q_hat:
            _need(q_t is None, "q_t", "this variant's dK takes Q̂ (bwd_dk_bf16), which its call builds from q and "
                  "the scale codes: it takes no Qᵀ codes")
        if ds16:
            for t, name in ((q_t, "q_t"), (k_t, "k_t"), (q_scale, "q_scale"), (k_scale, "k_scale")):
                _need(t is None, name, "this variant's dK and dQ are BF16 on q, k (ds16): it takes no Q/K codes "
                      "or scales")
        for t, name, h in qk + ((do_t, "do_t", HQ),):
            _check_tensor(t, name, do_code if name == "do_t" else code, (h, D, None), dev)
            if not (t.shape[2] >= T and t.shape[2] % 16 == 0):
                raise ValueError(f"{name}: T_PAD={t.shape[2]} must be ≥ T={T} and a multiple of 16 (TMA strides)")
            tpad = t.shape[2] if tpad is None else tpad
            if t.shape[2] != tpad:
                raise ValueError(f"{name}: T_PAD={t.shape[2]} differs from {qk[0][1] if qk else 'do_t'}'s {tpad}")
        qks = () if ds16 else ((q_scale, "q_scale", HQ), (k_scale, "k_scale", HKV))
        for t, name, h in qks + ((v_scale, "v_scale", HKV), (do_scale, "do_scale", HQ)):
            _check_tensor(t, name, (torch.uint8,), (T, h), dev)
    else:
        for t, name in ((q_t, "q_t"), (k_t, "k_t"), (do_t, "do_t"), (q_scale, "q_scale"), (k_scale, "k_scale"),
                        (v_scale, "v_scale"), (do_scale, "do_scale")):
            _need(t is None, name, "the bf16 route takes no transposed codes or scales")
    _check_tensor(lse, "lse", (torch.float32,), (HQ, T), dev)
    _check_tensor(delta, "delta", (torch.float32,), (HQ, T), dev)
    if dq_accum is not None:
        _check_tensor(dq_accum, "dq_accum", (torch.float32,), (T, HQ, D), dev)
    _check_common(cu_seqlens, T, HQ, D, dev)
    return T, HQ, HKV, D


def _is_fp8_spec(args_spec: Sequence[dict]) -> bool:
    """An 8-bit backward (V, dO codes: dP, dV in FP8): its ARGS carry dOᵀ."""
    return any(a["name"] == "do_t" for a in args_spec)


def is_ds16_spec(args_spec: Sequence[dict]) -> bool:
    """An 8-bit backward whose dK, dQ are BF16 on the BF16 q, k (route fp8_pv): no Q/K codes in its ARGS."""
    return _is_fp8_spec(args_spec) and not any(a["name"] == "k_t" for a in args_spec)


def is_q_hat_spec(args_spec: Sequence[dict]) -> bool:
    """`bwd_dk_bf16`: dK takes Q̂ (ARGS `q_hat`, a workspace the call's first launch fills) and no Qᵀ codes (q_t)."""
    return any(a["name"] == "q_hat" for a in args_spec)


def is_do_e5m2_spec(args_spec: Sequence[dict]) -> bool:
    """An FP8 backward whose dO codes are E5M2 (route fp8_tensor)."""
    return any(a["name"] == "do" and a["dtype"] == "float8_e5m2" for a in args_spec)


def is_ds_tensor_spec(args_spec: Sequence[dict]) -> bool:
    """A backward with a tensor-scaled dS (route fp8_tensor): two launches, `amax_pass` 1 then 0, around a
    zeroed `ds_amax` (the call's two dS fold maxima; see the template's amax_sweep)."""
    return any(a["name"] == "ds_amax" for a in args_spec)


def _as_e5m2(t: torch.Tensor) -> torch.Tensor:
    """uint8 E5M2 codes viewed (no copy) as float8_e5m2, the dtype the kernel was compiled for."""
    return t.view(torch.float8_e5m2) if t.dtype == torch.uint8 else t


def is_scores_bf16_spec(args_spec: Sequence[dict]) -> bool:
    """An FP8 backward whose Sᵀ = K·Qᵀ takes BF16 q, k: the BF16 inputs themselves (route field scores_bf16) or NVFP4
    Q, K dequantized to BF16 (route nvfp4_mixed: `is_qk_nvfp4_spec`, whose ARGS add `qk_tensor_scale`). Either way
    their E4M3 codes_t and scales (q_t, k_t, q_scale, k_scale) serve dK, dQ (`check_bwd_inputs(scores_bf16=True)`)."""
    return _is_fp8_spec(args_spec) and any(a["name"] == "q" and a["dtype"] == "bfloat16" for a in args_spec)


def check_deterministic(args_spec: Sequence[dict], params: dict, *, T: int, HQ: int, cu_seqlens: torch.Tensor,
                        key_align: int, dq_sem=None) -> bool:
    """Validate the deterministic-mode arguments; returns whether the variant is deterministic.
    A non-deterministic variant takes no `dq_sem`. A deterministic one takes, optionally, `dq_sem`
    int32 (HQ, ≥ num_dq_tiles(T, NUM_DOCS, tile_m, key_align)) (run_attn_bwd zeroes it on every
    call); its `dq_tile_off` comes with the schedule. On a CUDA device the GPU must have at least
    PARAMS["sm_count"] SMs: every CTA of the persistent grid must be resident at once."""
    det = is_deterministic_spec(args_spec)
    if not det:
        _need(dq_sem is None, "dq_sem", "only a deterministic variant (ARGS with dq_sem, name …_det) takes it")
        return False
    dev = cu_seqlens.device
    _need(params.get("scheduler", "longest_first") != "static", "params",
          "a deterministic backward needs the persistent scheduler (a unit waits on earlier units)")
    if dq_sem is not None:
        _check_tensor(dq_sem, "dq_sem", (torch.int32,), (HQ, None), dev)
        need = num_dq_tiles(T, cu_seqlens.numel() - 1, params["tile_m"], key_align)
        _need(dq_sem.shape[1] >= need, "dq_sem", f"{dq_sem.shape[1]} columns, need ≥ {need} "
              f"(num_dq_tiles(T={T}, num_docs={cu_seqlens.numel() - 1}, tile_m={params['tile_m']}))")
    if dev.type == "cuda":
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        want = int(params.get("sm_count", 0))
        _need(sms >= want, "params", f"the deterministic backward launches {want} persistent CTAs that must all be "
              f"resident (they wait on each other); this GPU has {sms} SMs: use a variant built with "
              f"sm_count ≤ {sms} or a non-deterministic one")
    return True


DIAG_V_ARGS = ("v_diag", "v_diag_scale", "fwd_tile_m")  # what a `diag_v` backward takes besides the fp8 ones


def is_diag_v_spec(args_spec: Sequence[dict]) -> bool:
    """A backward whose dP = dO·Vᵀ reads the per-token V copy on the forward's diagonal key tiles (route
    `diagonal: per_key_v`, PARAMS `diag_v`): its ARGS take `v_diag`."""
    return any(a["name"] == "v_diag" for a in args_spec)


def fwd_tile_n_of(params: dict) -> int:
    """The key tile (tile_n) of the forward a `diag_v` (or `diag_k`) backward pairs with: PARAMS["fwd_tile_n"] of the rendered
    module, else the backward's own tile_n, which is what the template renders it as (a bundle manifest's
    `params` are the plan's, without the template's fwd_tile_n)."""
    return int(params.get("fwd_tile_n", params["tile_n"]))


def check_diag_v(args_spec: Sequence[dict], *, T: int, HKV: int, D: int, dev, v_diag=None, v_diag_scale=None,
                 fwd_tile_m=None) -> bool:
    """Validate the per-token V copy a `diag_v` backward reads where the forward did (its diagonal key
    tiles); returns whether the variant takes it. Each of `v_diag`, `v_diag_scale`, `fwd_tile_m` is required
    exactly when the ARGS name it, and refused otherwise. `v_diag`: per-token E4M3 codes (T, HKV, D)
    uint8/float8_e4m3fn, laid out like v; `v_diag_scale`: their UE8M0 codes uint8 (T, HKV); both contiguous
    on q's device. `fwd_tile_m`: the forward variant's tile_m (its query tiles decide the diagonal), a
    positive int multiple of 64."""
    names = {a["name"] for a in args_spec}
    given = dict(v_diag=v_diag, v_diag_scale=v_diag_scale, fwd_tile_m=fwd_tile_m)
    for name in DIAG_V_ARGS:
        if name in names:
            _need(given[name] is not None, name, "required: this variant's dP uses the per-token V copy on the "
                  "forward's diagonal key tiles (ARGS name v_diag, v_diag_scale, fwd_tile_m; ops.backward_with "
                  "passes them)")
        else:
            _need(given[name] is None, name, "only a backward whose ARGS name it (a diag_v variant: route diagonal "
                  "per_key_v) takes it")
    if "v_diag" in names:
        _check_tensor(v_diag, "v_diag", _FP8_CODE_DTYPES, (T, HKV, D), dev)
    if "v_diag_scale" in names:
        _check_tensor(v_diag_scale, "v_diag_scale", (torch.uint8,), (T, HKV), dev)
    if "fwd_tile_m" in names:
        ok = isinstance(fwd_tile_m, int) and not isinstance(fwd_tile_m, bool)
        _need(ok, "fwd_tile_m", f"expected an int (the forward variant's tile_m), got {type(fwd_tile_m).__name__}")
        _need(fwd_tile_m > 0 and fwd_tile_m % 64 == 0, "fwd_tile_m",
              f"{fwd_tile_m} is not a positive multiple of 64 (the forward's tile_m: 128 or 192)")
    return "v_diag" in names


ROWS_ARGS = ("q_t_scale", "do_t_scale")  # an exact route's split Q, dO (per-token copy in S, dP; own codes_t in dK, dV)
DIAG_K_ARGS = ("k_diag", "k_t_diag", "k_diag_scale")  # a `diag_k` backward's per-token K (k_fold)


def is_rows_spec(args_spec: Sequence[dict]) -> bool:
    """A backward of an exact token-block route (PARAMS `rows_q`, `rows_do`): S = Q·Kᵀ and dP = dO·Vᵀ (and D) read
    the per-token Q and dO copies (`q`, `q_scale`, `do`, `do_scale`), dK = dSᵀ·Q and dV = Pᵀ·dO the route's own
    token-block codes_t (`q_t`, `do_t`) with their own scales: its ARGS take `q_t_scale` (and `do_t_scale`)."""
    return any(a["name"] in ROWS_ARGS for a in args_spec)


def is_diag_k_spec(args_spec: Sequence[dict]) -> bool:
    """A backward whose S = Q·Kᵀ and dQ = dS·K read the per-token K copy on the forward's diagonal key tiles (route
    `k_fold`, PARAMS `diag_k`): its ARGS take `k_diag`."""
    return any(a["name"] == "k_diag" for a in args_spec)


def _check_named(names: set, given: dict, required: str, refused: str) -> None:
    """Each argument of `given` is required exactly when the ARGS (`names`) name it, refused otherwise."""
    for name, t in given.items():
        if name in names:
            _need(t is not None, name, f"required: {required}")
        else:
            _need(t is None, name, f"only a backward whose ARGS name it ({refused}) takes it")


def _check_t_pad(t: torch.Tensor, name: str, T: int, tpad: int | None) -> None:
    _need(t.shape[2] >= T and t.shape[2] % 16 == 0, name,
          f"T_PAD={t.shape[2]} must be ≥ T={T} and a multiple of 16 (TMA strides)")
    if tpad is not None:
        _need(t.shape[2] == tpad, name, f"T_PAD={t.shape[2]} differs from k_t's {tpad}")


def check_rows(args_spec: Sequence[dict], *, T: int, HQ: int, dev, q_t_scale=None, do_t_scale=None) -> bool:
    """Validate the token-block scales of an exact route's dK, dV operands; returns whether the variant takes any.
    Each of `q_t_scale`, `do_t_scale` is required exactly when the ARGS name it and refused otherwise: the UE8M0
    codes (T, HQ) uint8, contiguous on q's device, of the route's own token-block Q (whose codes_t are `q_t`) and
    dO (`do_t`); `q_scale`, `do_scale` are then the per-token copies' (those of `q`, `do`)."""
    names = {a["name"] for a in args_spec}
    given = dict(q_t_scale=q_t_scale, do_t_scale=do_t_scale)
    _check_named(names, given, "this variant's dK and dV read the route's own token-block Q and dO codes_t (q_t, "
                 "do_t) while S, dP read their per-token copies (q, do): ARGS name q_t_scale, do_t_scale; "
                 "ops.backward_with passes them", "an exact token-block route's rows_q / rows_do variant")
    for name, t in given.items():
        if name in names:
            _check_tensor(t, name, (torch.uint8,), (T, HQ), dev)
    return any(n in names for n in ROWS_ARGS)


def check_diag_k(args_spec: Sequence[dict], *, T: int, HKV: int, D: int, dev, k_t=None, k_diag=None,
                 k_t_diag=None, k_diag_scale=None) -> bool:
    """Validate the per-token K copy a `diag_k` backward reads where the forward did (its diagonal key tiles: S =
    Q·Kᵀ and dQ = dS·K); returns whether the variant takes it. Each of `k_diag`, `k_t_diag`, `k_diag_scale` is
    required exactly when the ARGS name it and refused otherwise. `k_diag`: per-token E4M3 codes (T, HKV, D)
    uint8/float8_e4m3fn, laid out like k; `k_t_diag`: their K-major copy (HKV, D, T_PAD), T_PAD that of `k_t`;
    `k_diag_scale`: their UE8M0 codes uint8 (T, HKV); all contiguous on q's device. One launch of the route's
    per-token K quantizer writes the three (`attention.token_copy_use`)."""
    names = {a["name"] for a in args_spec}
    given = dict(k_diag=k_diag, k_t_diag=k_t_diag, k_diag_scale=k_diag_scale)
    _check_named(names, given, "this variant's S and dQ use the per-token K copy on the forward's diagonal key "
                 "tiles (ARGS name k_diag, k_t_diag, k_diag_scale; ops.backward_with passes them)",
                 "a diag_k variant: route k_fold")
    if "k_diag" in names:
        _check_tensor(k_diag, "k_diag", _FP8_CODE_DTYPES, (T, HKV, D), dev)
    if "k_t_diag" in names:
        _check_tensor(k_t_diag, "k_t_diag", _FP8_CODE_DTYPES, (HKV, D, None), dev)
        _check_t_pad(k_t_diag, "k_t_diag", T, k_t.shape[2] if isinstance(k_t, torch.Tensor) else None)
    if "k_diag_scale" in names:
        _check_tensor(k_diag_scale, "k_diag_scale", (torch.uint8,), (T, HKV), dev)
    return is_diag_k_spec(args_spec)


QK_NVFP4_ARGS = ("qk_tensor_scale",)  # an NVFP4 route's Q, K tensor scales (ts_q·ts_k) in Sᵀ = K·Qᵀ


def is_qk_nvfp4_spec(args_spec: Sequence[dict]) -> bool:
    """A backward whose Sᵀ = K·Qᵀ recomputes the forward's NVFP4 scores (route nvfp4_mixed, PARAMS `qk_nvfp4`): `q`,
    `k` are NVFP4 Q, K dequantized to BF16 (code·block scale: runtime.nvfp4), their fp32 tensor scales come as one
    device scalar: its ARGS take `qk_tensor_scale`. Such a variant is also `is_scores_bf16_spec` (BF16 q, k), and
    its q_t, k_t, q_scale, k_scale are the E4M3 token-block copies of Q, K that dK, dQ read."""
    return any(a["name"] in QK_NVFP4_ARGS for a in args_spec)


def check_qk_tensor_scale(args_spec: Sequence[dict], *, dev, qk_tensor_scale=None) -> bool:
    """Validate the NVFP4 tensor scales of an nvfp4 backward's Sᵀ = K·Qᵀ; returns whether the variant takes them.
    `qk_tensor_scale` is required exactly when the ARGS name it and refused otherwise: ts_q·ts_k, float32 (1,),
    contiguous on q's device (no host sync: the product of the two NVFP4 launches' tensor scales,
    `runtime.nvfp4.mixed_qk_inputs`). Its variant's q, k must be BF16 (`is_scores_bf16_spec`)."""
    names = {a["name"] for a in args_spec}
    _check_named(names, dict(qk_tensor_scale=qk_tensor_scale),
                 "this variant's Sᵀ = K·Qᵀ reads NVFP4 Q, K dequantized to BF16 without their tensor scales: pass "
                 "ts_q·ts_k as qk_tensor_scale (ARGS name it; ops.backward_with passes it)",
                 "an NVFP4 route's qk_nvfp4 variant")
    if "qk_tensor_scale" not in names:
        return False
    _need(is_scores_bf16_spec(args_spec), "args_spec", "names qk_tensor_scale but not BF16 q, k: an NVFP4 "
          "backward's Sᵀ = K·Qᵀ takes the dequantized BF16 Q, K (ARGS q, k bfloat16)")
    _check_tensor(qk_tensor_scale, "qk_tensor_scale", (torch.float32,), (1,), dev)
    return True


def run_attn_bwd(fn, args_spec: Sequence[dict], q, k, v, do, lse, delta, *, cu_seqlens, params: dict,
                 q_t=None, k_t=None, do_t=None, q_scale=None, k_scale=None, v_scale=None, do_scale=None,
                 dq_accum=None, softmax_scale: float | None = None, poison: bool = False,
                 schedule: BwdSchedule | None = None, dq_sem: torch.Tensor | None = None,
                 v_diag: torch.Tensor | None = None, v_diag_scale: torch.Tensor | None = None,
                 fwd_tile_m: int | None = None, q_t_scale: torch.Tensor | None = None,
                 do_t_scale: torch.Tensor | None = None, k_diag: torch.Tensor | None = None,
                 k_t_diag: torch.Tensor | None = None, k_diag_scale: torch.Tensor | None = None,
                 qk_tensor_scale: torch.Tensor | None = None, trusted: bool = False, keep: dict | None = None):
    """Call a compiled attention backward; returns (dq BF16 (T, HQ, D) — the kernel call's own when its ARGS name
    `dq` (bwd_dq_convert), else `dq_from_accum` of the accumulator —, dk, dv BF16 (T, HKV, D),
    dq_accum fp32 (T, HQ, D): the kernel's accumulator storage — head-major and chunk-swizzled for a
    `bwd_dq_tile_copy` kernel, whose natural fp32 dQ is `dq_accum_natural(dq_accum)`).

    `fn`: the tvm-ffi function; `args_spec`: the module's ARGS; `params`: its PARAMS. `lse`: the
    forward's (HQ, T) natural-log LSE; `delta`: (HQ, T) from the dO quantizer launch (fp8) or
    rowsum(dO∘O) (bf16). `dq_accum`: the zeroed fp32 accumulator from the dO launch; None → a
    zeroed one is allocated here. `poison` fills dK, dV with NaN first (rows never written show).

    `schedule`: `bwd_schedule` of these cu_seqlens and the variant's tiles (None → built here; the op
    caches it per cu_seqlens tensor). Checked cheaply, without a host sync: its shapes (for these
    documents and tiles), dtypes and device; its values are trusted (build it with `bwd_schedule` from
    the same cu_seqlens and the variant's PARAMS).
    Deterministic variants only (ARGS name `dq_sem`; see `check_deterministic`): `dq_sem`, an int32
    (HQ, ≥ num_dq_tiles(T, NUM_DOCS, tile_m, key_align)) buffer to reuse (zeroed here on every call;
    None → allocated with torch.zeros). Everything stays on the device (no host sync: CUDA-graph
    capturable).
    `diag_v` variants only (ARGS name `v_diag`; see `check_diag_v`): `v_diag` (T, HKV, D) and
    `v_diag_scale` (T, HKV), V quantized per token (the copy the forward read on its diagonal key tiles),
    and `fwd_tile_m`, the forward variant's tile_m; such a variant's schedule has no windows
    (`bwd_windows`: its dS is scaled per 32×32 block).
    Exact token-block routes (ARGS name `q_t_scale`, `do_t_scale`; see `check_rows`): `q`, `q_scale` and `do`,
    `do_scale` are the PER-TOKEN copies of Q and dO (S and dP, D = rowsum(dO∘O) from that dO), `q_t` and `do_t`
    the route's own token-block codes_t (dK, dV) with their scales `q_t_scale`, `do_t_scale` (T, HQ).
    `diag_k` variants (ARGS name `k_diag`; see `check_diag_k`): the per-token K copy `k_diag` (T, HKV, D),
    `k_t_diag` (HKV, D, T_PAD), `k_diag_scale` (T, HKV), read on the forward's diagonal key tiles.
    NVFP4 variants (route nvfp4_mixed, ARGS name `qk_tensor_scale`; see `check_qk_tensor_scale`): `q`, `k` are the
    NVFP4 Q, K dequantized to BF16 (code·block scale) that Sᵀ = K·Qᵀ reads, `qk_tensor_scale` fp32 (1,) their tensor
    scales ts_q·ts_k on the device; `q_t`, `q_scale`, `k_t`, `k_scale` the E4M3 token-block copies of Q, K (dK, dQ).
    `trusted`: the caller made every tensor itself (the op's eager path: its own quantizers' outputs, the saved
    forward outputs, a schedule from `bwd_schedule`): `check_bwd_inputs` and the schedule's checks are skipped.
    `keep`: a dict that receives the kernel call's arguments by name after the call (`verify` reads the call-made
    workspace `q_hat` of a `bwd_dk_bf16` variant and the codes it came from)."""
    fp8 = _is_fp8_spec(args_spec)
    sbf16 = is_scores_bf16_spec(args_spec)
    ds16 = is_ds16_spec(args_spec)
    do5 = is_do_e5m2_spec(args_spec)
    qh = is_q_hat_spec(args_spec)
    if trusted:
        (T, HQ, D), HKV = q.shape, k.shape[1]
    else:
        T, HQ, HKV, D = check_bwd_inputs(q, k, v, do, lse, delta, cu_seqlens=cu_seqlens, fp8=fp8, q_t=q_t, k_t=k_t,
                                         do_t=do_t, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                         do_scale=do_scale, dq_accum=dq_accum, head_dim=params.get("head_dim"),
                                         scores_bf16=sbf16, ds16=ds16, do_e5m2=do5, q_hat=qh)
    align = kernel_key_align(fp8)
    det = check_deterministic(args_spec, params, T=T, HQ=HQ, cu_seqlens=cu_seqlens, key_align=align,
                              dq_sem=dq_sem)
    diag = check_diag_v(args_spec, T=T, HKV=HKV, D=D, dev=q.device, v_diag=v_diag, v_diag_scale=v_diag_scale,
                        fwd_tile_m=fwd_tile_m)
    check_rows(args_spec, T=T, HQ=HQ, dev=q.device, q_t_scale=q_t_scale, do_t_scale=do_t_scale)
    check_diag_k(args_spec, T=T, HKV=HKV, D=D, dev=q.device, k_t=k_t, k_diag=k_diag, k_t_diag=k_t_diag,
                 k_diag_scale=k_diag_scale)
    nvfp4 = check_qk_tensor_scale(args_spec, dev=q.device, qk_tensor_scale=qk_tensor_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    dev = q.device
    # the kernel writes every row of dK and dV (every key of every document: tests/kernels/
    # test_attn_bwd_windows.py replays it), so they start uninitialised; `poison` fills them with NaN
    if poison:
        dk = torch.full((T, HKV, D), float("nan"), dtype=torch.bfloat16, device=dev)
        dv = torch.full((T, HKV, D), float("nan"), dtype=torch.bfloat16, device=dev)
    else:
        dk = torch.empty((T, HKV, D), dtype=torch.bfloat16, device=dev)
        dv = torch.empty((T, HKV, D), dtype=torch.bfloat16, device=dev)
    if dq_accum is None:
        dq_accum = torch.zeros((T, HQ, D), dtype=torch.float32, device=dev)
    if T == 0:
        return dq_accum.to(torch.bfloat16), dk, dv, dq_accum
    tile_m, tile_n = params["tile_m"], params["tile_n"]
    hsec = int(params.get("bwd_head_section", 0))
    if schedule is None:
        schedule = bwd_schedule(cu_seqlens, tile_m, tile_n, params["causal"], key_align=align, T=T,
                                windows=bwd_windows(params), hkv=HKV, head_section=hsec)
    elif not trusted:
        nd = cu_seqlens.numel() - 1
        nw, ncol = ((num_units(T, nd, tile_n, HKV, bwd_windows(params)), 4) if hsec
                    else (num_work(T, nd, tile_n), 3))
        for t, name in zip(schedule, BwdSchedule._fields):
            _need(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device == dev and t.is_contiguous(),
                  "schedule", f"{name}: expected a contiguous int32 tensor on {dev}, got "
                  f"{getattr(t, 'dtype', type(t).__name__)} on {getattr(t, 'device', '?')}")
        _need(tuple(schedule.cu.shape) == tuple(cu_seqlens.shape) and tuple(schedule.row_doc.shape) == (T, 2)
              and tuple(schedule.work.shape) == (nw, ncol)
              and tuple(schedule.dq_tile_off.shape) == tuple(cu_seqlens.shape), "schedule",
              f"built for other documents or tiles (cu {tuple(schedule.cu.shape)}, row_doc "
              f"{tuple(schedule.row_doc.shape)}, work {tuple(schedule.work.shape)}; expected "
              f"{tuple(cu_seqlens.shape)}, ({T}, 2), ({nw}, {ncol}))")
    by_name = {"lse": lse, "delta": delta, "cu_seqlens": schedule.cu, "row_doc": schedule.row_doc,
               "work": schedule.work,
               "softmax_scale": float(softmax_scale), "dq_accum": dq_accum, "dk": dk, "dv": dv}
    dq = None
    if any(a["name"] == "dq" for a in args_spec):
        # bwd_dq_convert: the call's second launch writes BF16 dQ (every element: poisoned like dK, dV)
        dq = (torch.full((T, HQ, D), float("nan"), dtype=torch.bfloat16, device=dev) if poison
              else torch.empty((T, HQ, D), dtype=torch.bfloat16, device=dev))
        by_name["dq"] = dq
    if det:
        if dq_sem is None:
            dq_sem = torch.zeros((HQ, num_dq_tiles(T, cu_seqlens.numel() - 1, tile_m, align)),
                                 dtype=torch.int32, device=dev)
        else:
            dq_sem.zero_()  # the kernel leaves the counts behind: every call starts from 0
        by_name.update(dq_sem=dq_sem, dq_tile_off=schedule.dq_tile_off)
    by_name.update(unit_counter_arg(args_spec, dev))  # bwd_dynamic
    if params.get("bwd_q_row_perm"):
        # the row-permuting Q and dO TMAs read whole 16-token groups: rows T … T_PAD − 1 of the codes' storage
        # (masked queries). The quantizers' padded storage has them; other codes (a caller's own) cost a zero-padded
        # copy per call here. A caller of the kernel without this wrapper must pass such storage itself: ARGS says
        # (T, HQ, D) for q and do, the kernel reads T_PAD rows.
        q, do = k_rows_for_tma(q, do_t.shape[2]), k_rows_for_tma(do, do_t.shape[2])
    if fp8:
        as_do = _as_e5m2 if do5 else _as_e4m3
        by_name.update(q=q if sbf16 else _as_e4m3(q), k=k if sbf16 else _as_e4m3(k), v=_as_e4m3(v),
                       v_scale=v_scale, do=as_do(do), do_t=as_do(do_t), do_scale=do_scale)
        if not ds16:
            by_name.update(q_scale=q_scale, k_t=_as_e4m3(k_t), k_scale=k_scale)
            if not qh:
                by_name["q_t"] = _as_e4m3(q_t)
    else:
        by_name.update(q=q, k=k, v=v, do=do)
    if diag:
        by_name.update(v_diag=_as_e4m3(v_diag), v_diag_scale=v_diag_scale, fwd_tile_m=int(fwd_tile_m))
    # exact routes' split Q, dO and diag_k's per-token K: given exactly when the ARGS name them (check_rows,
    # check_diag_k)
    split = dict(q_t_scale=q_t_scale, do_t_scale=do_t_scale, k_diag=k_diag, k_t_diag=k_t_diag,
                 k_diag_scale=k_diag_scale)
    by_name.update({n: t if n.endswith("_scale") else _as_e4m3(t) for n, t in split.items() if t is not None})
    if nvfp4:
        by_name["qk_tensor_scale"] = qk_tensor_scale
    if qh:
        # bwd_dk_bf16: dK's B, Q̂ = Q codes·2^(eq+edo) in BF16, written by the call's own first launch
        by_name["q_hat"] = q_hat_workspace(T, HQ, D, do_t.shape[2], dev)
    two_pass = is_ds_tensor_spec(args_spec)
    if two_pass:
        # tensor-scaled dS: launch 1 max-reduces the call's two dS fold maxima into ds_amax, launch 2 reads them
        by_name.update(ds_amax=torch.zeros(2, dtype=torch.float32, device=dev), amax_pass=1)
    missing = [a["name"] for a in args_spec if a["name"] not in by_name]
    if missing:
        raise ValueError(f"args_spec: names arguments this wrapper does not know: {missing}")
    fn(*[by_name[a["name"]] for a in args_spec])
    if keep is not None:
        keep.update(by_name)
    if two_pass:
        by_name["amax_pass"] = 0
        fn(*[by_name[a["name"]] for a in args_spec])
    if dq is None:
        dq = dq_from_accum(dq_accum, params, softmax_scale, do_scale if fp8 else None)
    return dq, dk, dv, dq_accum


def dq_from_accum(dq_accum, params: dict, softmax_scale: float, do_scale=None):
    """The dQ "convert kernel": BF16 dQ of the kernel's fp32 accumulator, in one pass. The partials carry
    softmax_scale and the dS scales, except where the kernel leaves the row factor to this pass
    (`bwd_dq_scale_late`): then the pass multiplies by it, computed in fp32 and rounded once to BF16 — the softmax
    scale on the bf16 route; on the per-token FP8 tiles (`bwd_dof_fold`) softmax_scale·2^edo per (token, query head),
    2^edo built from dO's scale code `do_scale` (T, HQ) uint8 with the kernel's bits: code << 23 as fp32 (code 0 → 0),
    and 1 for the NaN code 255. A `bwd_dq_tile_copy` accumulator is head-major and chunk-swizzled: put back in
    natural order first."""
    if not params.get("bwd_dq_scale_late"):
        if params.get("bwd_dq_tile_copy"):
            return dq_accum_natural(dq_accum, torch.bfloat16)
        return dq_accum.to(torch.bfloat16)
    acc = dq_accum_natural(dq_accum) if params.get("bwd_dq_tile_copy") else dq_accum
    out = torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device)
    if params.get("do_fmt", "bf16") != "bf16":  # FP8 dO: the row factor has dO's exponent
        if do_scale is None:
            raise ValueError("dq_from_accum: a bwd_dq_scale_late FP8 kernel leaves softmax_scale·2^edo to the dQ "
                             "conversion, which needs do_scale (T, HQ) uint8; none was given")
        return torch.mul(acc, dq_row_factor(do_scale, softmax_scale).unsqueeze(-1), out=out)
    return torch.mul(acc, float(softmax_scale), out=out)


def q_hat_workspace(T: int, HQ: int, D: int, t_pad: int, device) -> torch.Tensor:
    """`bwd_dk_bf16`'s Q̂ buffer: (T, HQ, D) BF16 over storage of max(t_pad, T) rows. The call's `q_hat_build` launch
    writes every row of it (rows past T zero: the row-permuting TMA reads whole 16-query groups), so it starts
    uninitialised; its values are `numerics.q_hat.q_hat` of the call's Q codes and scale codes, bit for bit."""
    full = torch.empty((max(int(t_pad), T), HQ, D), dtype=torch.bfloat16, device=device)
    return full[:T]


def dq_row_factor(do_scale, softmax_scale: float):
    """softmax_scale·2^edo per (token, query head) as the FP8 tile's producer builds it (bwd_dof_fold's word 4): the
    code's bits shifted into an fp32 exponent, 1 for the NaN code 255 (a NaN dO row keeps factor 1), times the scale
    in fp32 (exact: a power of two, unless it leaves fp32's normal range)."""
    # Python scalars only: no host-to-device copy, so the op stays capturable in a CUDA graph
    c = do_scale.to(torch.int32)
    return torch.where(c == 255, 1.0, (c << 23).view(torch.float32)) * float(softmax_scale)


def dq_accum_natural(acc, dtype=None):
    """The dQ accumulator of a `bwd_dq_tile_copy` kernel in natural order. The kernel reads the (T, HQ, D) fp32 storage
    as head-major (HQ, T, D) rows and writes the 16-byte chunk k of token t's row at chunk k XOR (t & 7) (the swizzle
    of its staging tile, which one bulk copy per query tile carries over). → a new (T, HQ, D) tensor of `dtype` (default
    the storage's) with element (t, h, c) = storage[h, t, chunk (c // 4) XOR (t & 7), c % 4]. D must be a multiple of
    32 (whole groups of 8 chunks)."""
    T, H, D = acc.shape
    if D % 32:
        raise ValueError(f"dq_accum: head dim {D} is not a multiple of 32 (the chunk swizzle works on 8 chunks of 4)")
    # the chunk index k = 4·b2 + 2·b1 + b0 as three axes of 2: XOR with s flips the axes of s's set bits (no index
    # tensor, so no host-to-device copy per call and nothing that stops a CUDA-graph capture)
    src = acc.reshape(-1).view(H, T, D // 32, 2, 2, 2, 4)
    out = torch.empty((T, H, D), dtype=dtype or acc.dtype, device=acc.device)
    dst = out.view(T, H, D // 32, 2, 2, 2, 4)
    for s in range(8):  # tokens t ≡ s (mod 8): chunk k of the natural row is chunk k ^ s of the stored one
        part = src[:, s::8]
        flips = [5 - b for b in range(3) if s >> b & 1]  # bit b of k is axis 5 − b
        dst[s::8] = (part.flip(flips) if flips else part).transpose(0, 1)
    return out


__all__ = ["is_diag_v_spec", "check_diag_v", "DIAG_V_ARGS", "bwd_windows", "fwd_tile_n_of",
           "ROWS_ARGS", "DIAG_K_ARGS", "is_rows_spec", "is_diag_k_spec", "check_rows", "check_diag_k",
           "QK_NVFP4_ARGS", "is_qk_nvfp4_spec", "check_qk_tensor_scale",
           "is_ds16_spec", "is_q_hat_spec", "is_do_e5m2_spec", "is_ds_tensor_spec", "is_scores_bf16_spec", "make_work_list", "head_units", "num_units", "num_window_items", "bwd_schedule", "BwdSchedule", "num_work", "bwd_tiles", "check_bwd_inputs", "run_attn_bwd", "SUPPORTED_HEAD_DIMS",
           "num_dq_tiles", "dq_tile_offsets", "dq_from_accum", "dq_row_factor", "q_hat_workspace", "is_deterministic_spec", "check_deterministic"]
