"""Analytic pruning (FA4 `sm90_config_search` / Triton `prune_configs_by` style): cheap
arithmetic removes impossible points before anything compiles, with a reason each."""

from __future__ import annotations

from ..spec import Arch, Granularity, OperandQuant

# Usable dynamic shared memory per CTA (bytes): 227 KiB on both Hopper and Blackwell.
SMEM_LIMIT = {Arch.sm90: 232448, Arch.sm100: 232448}
MAX_THREADS_PER_CTA = 1024
# One warp per (token, head) row of the head dim; a CTA holds at most this many rows.
MAX_ROWS_PER_CTA = 256


def quant_smem_bytes(params: dict) -> int:
    """Staging of the K-major copy: one byte per code of the CTA's rows, plus amax
    scratch (fp32 per row)."""
    rows = params["tokens_per_cta"] * params["heads_per_cta"]
    codes = rows * params["head_dim"] if params["write_transposed"] else 0
    return codes + 4 * rows


def check_quant(arch: Arch, oq: OperandQuant, params: dict) -> tuple[bool, str]:
    d = params["head_dim"]
    rows = params["tokens_per_cta"] * params["heads_per_cta"]
    if d % 32:
        return False, f"head_dim={d}: a warp reads 32 lanes × D/32 elements; D must be a multiple of 32"
    if oq.hadamard and d & (d - 1):
        return False, f"head_dim={d}: the Hadamard rotation needs a power of two"
    if rows > MAX_ROWS_PER_CTA:
        return False, (f"tokens_per_cta×heads_per_cta={rows} rows > {MAX_ROWS_PER_CTA}: more rows than "
                       "warps can stage")
    if oq.granularity is Granularity.token_block and params["tokens_per_cta"] % oq.block:
        return False, f"tokens_per_cta={params['tokens_per_cta']} is not a multiple of the {oq.block}-token block"
    if oq.granularity is Granularity.tensor and params["tokens_per_cta"] != 32:
        return False, "granularity=tensor is bandwidth-bound on its amax pass; only tokens_per_cta=32 is kept"
    smem = quant_smem_bytes(params)
    if smem > SMEM_LIMIT[arch]:
        return False, f"shared memory {smem} B > {SMEM_LIMIT[arch]} B"
    # 16-byte vector access of a row of codes (D bytes E4M3, D/2 E2M1) holds: D % 32 == 0 above.
    return True, ""


# Registers a consumer thread may hold after `setmaxnreg` (240 of 255, rest for addressing);
# three consumer warpgroups share the register file at 160 each (the template's 32/160 split).
CONSUMER_REGS = 240
CONSUMER_REGS_BY_WG = {1: 240, 2: 240, 3: 160}
WGMMA_M = 64  # each consumer warpgroup owns 64 query rows (FA3)


def qk_smem_bytes(arch: Arch, params: dict, elem_bytes: int) -> int:
    """Bytes per Q / K element in the forward's shared memory: sm90 has no FP4 MMA, so the
    NVFP4 Q, K of nvfp4_mixed arrive dequantized to BF16 (2 bytes) while V stays E4M3; a route with
    scores_bf16 takes its BF16 q, k themselves (any arch)."""
    if params.get("scores_bf16") or (arch is Arch.sm90 and params.get("q_fmt") == "e2m1"):
        return 2
    return elem_bytes


def attn_smem_bytes(params: dict, elem_bytes: int, qk_bytes: int | None = None) -> int:
    """`elem_bytes`: V (and P) element size; `qk_bytes`: Q and K's (default the same)."""
    d, m, n, st = params["head_dim"], params["tile_m"], params["tile_n"], params["stages"]
    qk_bytes = elem_bytes if qk_bytes is None else qk_bytes
    q = m * d * qk_bytes
    kv = st * n * d * (qk_bytes + elem_bytes)
    o = m * d * 2  # BF16 epilogue staging
    p = 0 if params["p_in_registers"] else m * n * elem_bytes
    barriers = 1024
    # per-key factors (fp8: 4 fp32 words per key per stage) and the 1024-byte alignment of the
    # Q, K, V buffers (measured: bf16 m192n128 s2 asked for 233472 B, this sum exactly)
    scales = 16 * n * st if elem_bytes == 1 else 0  # bf16: one word, inside the alignment slack
    align = 3072
    return q + kv + o + p + barriers + scales + align


BWD_KEY_TILE_SM90 = 128  # the sm90 backward's key tile (tile_n): a diag_v/diag_k backward pairs with this forward tile_n


def check_attn(arch: Arch, elem_bytes: int, params: dict) -> tuple[bool, str]:
    d, m, n = params["head_dim"], params["tile_m"], params["tile_n"]
    wg = params["compute_warpgroups"]
    if params.get("deterministic"):
        return False, "deterministic=true applies to the backward's dQ reduction; the forward is deterministic"
    blocked = [o for o in ("q", "k", "v", "do", "ds") if params.get(f"{o}_gran") in ("token_block", "square_32")]
    if blocked and (m % 32 or n % 32):
        # a 32-token scale block straddling two tiles breaks the diagonal-tile safeguards
        return False, f"tile {m}×{n}: {blocked} use 32-token blocks, so tiles must be multiples of 32"
    if m != WGMMA_M * wg:
        return False, f"tile_m={m} must be 64 × compute_warpgroups ({wg}): each warpgroup owns 64 rows"
    if arch is Arch.sm90 and elem_bytes == 1 and n % 32:
        return False, f"tile_n={n}: FP8 PV contracts over keys in k-steps of 32"
    if n % 16:
        return False, f"tile_n={n} is not a multiple of 16"
    if arch is Arch.sm90 and (params.get("diag_v") or params.get("diag_k")) and n != BWD_KEY_TILE_SM90:
        # the backward repeats the forward's diagonal decisions on its own 128-key tiles (runtime.ops.diag_v_inputs)
        return False, (f"tile_n={n}: a causal forward with diagonal safeguards pairs with the sm90 backward's "
                       f"{BWD_KEY_TILE_SM90}-key tiles")
    # fp32 accumulators per thread: O (64×D/128) + S (64×n/128), twice S when the softmax
    # of one tile overlaps the QKᵀ of the next, + ~24 for row state, scales and addresses
    # (m192 n128 at 3 warpgroups: 152 of 160, compiled with no spills: REG 128, STACK 8).
    # With the overlap the template holds one S tile plus the previous P (n/8 or n/4 registers), so "twice S"
    # over-counts; kept on purpose: what it prunes (m128n192 / m128n224 with the overlap) spills at 232
    # registers and ran 0.69× the table's FP8 kernel on the H200 (docs/perf-notes.md round 24).
    live = d // 2 + (n // 2) * (2 if params["intra_wg_overlap"] else 1) + 24
    budget = CONSUMER_REGS_BY_WG[wg]
    if live > budget:
        return False, f"~{live} live registers per consumer thread > {budget} ({wg} consumer warpgroups)"
    smem = attn_smem_bytes(params, elem_bytes, qk_smem_bytes(arch, params, elem_bytes))
    if smem > SMEM_LIMIT[arch]:
        return False, f"shared memory {smem} B > {SMEM_LIMIT[arch]} B"
    return True, ""


def bwd_dq_bf16(params: dict) -> bool:
    """Whether templates/sm90/attn_bwd.py.j2 renders these backward params with bwd_dq_bf16: default on for the
    per-token E4M3 dS tiles (fp8_token, fp8_token_bf16qk) unless the params turn it off; on mxfp8's 32×32-block dS tile
    (per-token V on diagonal pairs, no per-token K or Q rows) only when the params ask (an experiment). Also what
    bench.bwd_experiments' A/B tags select on."""
    e4m3 = (params.get("v_fmt") == "e4m3" and params.get("ds_fmt") == "e4m3" and params.get("q_fmt") == "e4m3"
            and params.get("do_fmt") == "e4m3" and not (params.get("diag_k") or params.get("rows_q")))
    if e4m3 and params.get("ds_gran") == "token" and not params.get("diag_v"):
        return bool(params.get("bwd_dq_bf16", True))
    return bool(e4m3 and params.get("ds_gran") == "square_32" and params.get("bwd_dq_bf16", False))


def bwd_dk_bf16(params: dict) -> bool:
    """Whether the template renders these backward params with bwd_dk_bf16 (an experiment, off unless asked): dK on
    BF16 dS' and Q̂ on the per-token E4M3 dS tile with the K̂ tile of bwd_dq_bf16 (not the BF16-score one)."""
    return bool(params.get("bwd_dk_bf16") and bwd_dq_bf16(params) and params.get("ds_gran") == "token"
                and not params.get("scores_bf16"))


def bwd_row_swz(params: dict) -> bool:
    """Whether the template renders bwd_row_swz: FP8 tiles only; default on for all of them but fp8_pv's (BF16 dS),
    unless the params ask for the padding (bwd_row_pad) without naming the swizzle."""
    if params.get("v_fmt") != "e4m3":
        return False
    if "bwd_row_swz" in params:
        return bool(params["bwd_row_swz"])
    return params.get("ds_fmt") != "bf16" and not params.get("bwd_row_pad")


def bwd_row_pad(params: dict) -> bool:
    """Whether the template renders bwd_row_pad: FP8 tiles only, not with bwd_row_swz; default on for fp8_pv's tile
    (BF16 dS) and, where the params turn the swizzle off, for the bwd_dq_bf16 tiles."""
    if params.get("v_fmt") != "e4m3" or bwd_row_swz(params):
        return False
    return bool(params.get("bwd_row_pad", bwd_dq_bf16(params) or params.get("ds_fmt") == "bf16"))


def attn_bwd_smem_bytes(params: dict, elem_bytes: int) -> int:
    """Backward (key tile outer): K and V (and, FP8, Kᵀ; diag_v: per-token V) once per unit; per stage Q and dO (FP8:
    also their K-major copies Qᵀ, dOᵀ; scores_bf16: K and Q in BF16); dS double-buffered for dQ = dS·K; row factors, amax; the
    fp32 dQ staging tile of the bulk reduce-add (rows of D + 8 words; non-deterministic variants); bwd_dq_bf16's BF16
    dS (and K̂ tile), bwd_dk_bf16's BF16 Q̂ stages (without Kᵀ), bwd_row_pad's padded per-query words."""
    d, m, n, st = params["head_dim"], params["tile_m"], params["tile_n"], params["stages"]
    kv = (3 if elem_bytes == 1 else 2) * n * d * elem_bytes
    per_stage = (4 if elem_bytes == 1 else 2) * m * d * elem_bytes + 8 * 4 * m
    ds = 2 * m * n * elem_bytes
    # K and Q as BF16 tiles for Sᵀ = K·Qᵀ (scores_bf16; nvfp4_mixed: NVFP4 dequantized to BF16)
    if elem_bytes == 1 and (params.get("scores_bf16") or params.get("q_fmt") == "e2m1"):
        kv += n * d
        per_stage += m * d
        if params.get("ds_fmt") == "bf16":  # fp8_pv: no Kᵀ, Qᵀ codes; dS in BF16
            kv -= n * d
            per_stage -= m * d
            ds *= 2
    if elem_bytes == 1 and bwd_dq_bf16(params):  # dS for dQ in BF16; fp8_token's tile: the BF16 K̂ tile (sK16)
        ds *= 2
        if not params.get("scores_bf16"):
            kv += 2 * n * d
        if params.get("ds_gran") == "square_32":  # mxfp8's: no Kᵀ tile (bwd_no_kt; its name aliases sK16)
            kv -= n * d
    if elem_bytes == 1 and bwd_dk_bf16(params):  # Q̂ BF16 in place of Qᵀ's codes; no Kᵀ tile (kt_alias)
        per_stage += m * d
        kv -= n * d
    if elem_bytes == 1 and bwd_row_pad(params):  # 4 more words per column pair of per-query words
        per_stage += 4 * 4 * (m // 2)
    dq = 0 if params.get("deterministic") else m * (d + 8) * 4
    if elem_bytes == 1 and params.get("diag_v"):  # the per-token V tile and dp_diag_v's fp32 stash (8 per thread)
        kv += n * d + 8 * 4 * 64 * params["compute_warpgroups"] * 2
    if elem_bytes == 1 and params.get("diag_k"):  # k_fold: the per-token K and Kᵀ tiles
        kv += 2 * n * d
    if elem_bytes == 1 and params.get("ds_gran") == "square_32":  # dK block maxima, one word per consumer warp
        kv += 4 * 8 * params["compute_warpgroups"]
        kv += 4 * (n + m)  # bwd_sq32_windows: each key row's max and each query's group key in a window tile
    return kv + st * per_stage + ds + 2 * 4 * m + dq + 1024 + (128 if dq else 0)


def check_attn_bwd(arch: Arch, elem_bytes: int, params: dict) -> tuple[bool, str]:
    """The backward splits the *key* tile over the consumer warpgroups (64 keys each) and runs
    64-row query tiles inside: accumulators per thread are dV, dK (D/2 each), Sᵀ, dPᵀ (tile_m/2
    each) and dQ (tile_m·D / (128·WG)), FA3's hdim-128 shape at 64×128 and 2 warpgroups."""
    d, m, n = params["head_dim"], params["tile_m"], params["tile_n"]
    wg = params["compute_warpgroups"]
    if params.get("deterministic") and params.get("scheduler") == "static":
        # units spin on units with smaller indices: safe only when every CTA is resident (persistent)
        return False, "deterministic=true needs a persistent scheduler (longest_first), not static"
    if n != WGMMA_M * wg:
        return False, f"tile_n={n} must be 64 × compute_warpgroups ({wg}): each warpgroup owns 64 keys"
    if m % 64:
        return False, f"tile_m={m}: query tiles are multiples of 64 (one wgmma N per 64 queries)"
    if elem_bytes == 1 and (m % 32 or n % 32):
        return False, f"tile {m}×{n}: FP8 dV/dK contract over queries and dQ over keys in k-steps of 32"
    if params["intra_wg_overlap"]:
        return False, "intra_wg_overlap is not implemented by the backward template"
    if d % (16 * wg):
        return False, f"head_dim={d}: dQ's N (= D) is split over {wg} warpgroups"
    # dQ's accumulator (tile_m·D / (128·WG)) lives after Sᵀ/dPᵀ are converted: it reuses them
    live = d + max(m, (m * d) // (128 * wg)) + 40
    if live > CONSUMER_REGS:
        return False, f"~{live} live registers per consumer thread > {CONSUMER_REGS}"
    smem = attn_bwd_smem_bytes(params, elem_bytes)
    if smem > SMEM_LIMIT[arch]:
        return False, f"shared memory {smem} B > {SMEM_LIMIT[arch]} B"
    return True, ""
