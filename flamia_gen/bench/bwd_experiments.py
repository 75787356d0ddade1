"""Flag-gated experiments of the sm90 attention backward (one GPU session), as `fwd_experiments`.

Build here (CPU, needs the DSL): one bundle with the default backward variants of the routes at
D = 128 (plus the forward and quantizer variants their op path needs) and, per experiment, the
backward variants rendered with that experiment's template flags (name suffix `_x<tag>`):

    python -m flamia_gen.bench.bwd_experiments build -o .dev/bundle-bexp [--only notrim,trim4] \
        [--candidates NEW_ROUTE]

On the GPU host (no DSL): per backward variant, verify (Gaussian + tiny documents, emulator and fp32
bounds, the leakage probe on causal exact routes), compare its dQ, dK, dV **bit for bit** with the
default variant of the same name on the same inputs (dK and dV are written once from registers;
dQ is bitwise reproducible only on `_det` variants, so elsewhere its largest difference is printed),
and time it through the op's backward path on each workload; print one table:

    python -m flamia_gen.bench.bwd_experiments run .dev/bundle-bexp [--json out.json]

Flags (templates/sm90/attn_bwd.py.j2; docs/kernels/attn_bwd.md): every flag has a template default
and a render-context override of the same name. This module imports without the DSL (and without
torch until `run`).
"""

from __future__ import annotations

import sys

from ..plan.feasibility import bwd_dq_bf16, bwd_row_pad, bwd_row_swz  # the template's defaults, as the smem model reads them
from .fwd_experiments import (ENTRY_TIMEOUT_S, _wl_keys, wl_key, build_variants_bundle, experiment_cli, experiment_table,
                              experiment_variants, matches_any, print_experiments, run_entries,  # noqa: F401
                              doc_rows, run_exit_code, select_entries, split_name, split_tags)

# the FP8 tile with a dS amax (fp8_token, fp8_token_bf16qk: the template's qk8), where bwd_alu_trim applies
_qk8 = lambda p: p.get("v_fmt") == "e4m3" and p.get("ds_fmt") != "bf16"  # noqa: E731

# fp8_token's tile (E4M3 per-token Q, K, dO, dS; no diagonal or exact-row copies): where bwd_q_row_perm applies
_fp8_token_tile = lambda p: (_qk8(p) and all(p.get(f) == "e4m3" for f in ("q_fmt", "k_fmt", "do_fmt", "ds_fmt"))  # noqa: E731
                             and p.get("q_gran") == "token" and p.get("ds_gran") == "token"
                             and not (p.get("diag_v") or p.get("diag_k") or p.get("rows_q") or p.get("scores_bf16")))

# variants with the dQ writer warp (templates/sm90/attn_bwd.py.j2: dq_warp), and those whose default has two of them
_dq_writer = lambda p: not p.get("deterministic") and p.get("ds_gran") != "tensor"  # noqa: E731
# (the template's BWD_DQ_WRITERS_DEFAULT: D = 64, and at D = 128 the bf16 tile and fp8_token's since round 32, fp8_pv's
# (BF16 dS), mxfp8_exact's (per-token Q rows) and fp8_token_bf16qk's since round 36)
_two_writers = lambda p: p.get("head_dim") == 64 or p.get("v_fmt") != "e4m3" or (  # noqa: E731
    bwd_dq_bf16(p) and p.get("ds_gran") == "token") or (p.get("ds_fmt") == "bf16") or bool(p.get("rows_q"))
# the template's BWD_DYNAMIC_DEFAULT: no ordered dQ, no tensor-scaled dS (two launches)
_dynamic_default = lambda p: not p.get("deterministic") and p.get("ds_gran") != "tensor"  # noqa: E731

# mxfp8's tile (32×32-block dS, no per-token K or Q rows), where bwd_dq_bf16 is an experiment (off by default)
_dq16_square_32 = lambda p: p.get("ds_gran") == "square_32" and bwd_dq_bf16({**p, "bwd_dq_bf16": True})  # noqa: E731

# the per-token dQ-on-BF16 tiles (fp8_token, fp8_token_bf16qk), where bwd_dof_fold applies
_dq16_per_token = lambda p: bwd_dq_bf16(p) and p.get("ds_gran") == "token"  # noqa: E731
# the E4M3-score one of them (fp8_token's: the template's dq16k), where bwd_rw_early applies (no diagonal copies, no split
# Q rows); its D = 128 non-deterministic tile takes it and bwd_no_kt by default since round 38 (BWD_RW_EARLY_DEFAULT,
# BWD_NO_KT_DEFAULT)
_rwe_tile = lambda p: (_dq16_per_token(p) and not p.get("scores_bf16") and not p.get("diag_v")  # noqa: E731
                       and not p.get("diag_k") and not p.get("rows_q"))
_fp8_token_d128 = lambda p: _rwe_tile(p) and p.get("head_dim") == 128 and not p.get("deterministic")  # noqa: E731

# the template's BWD_DQ_FIRST_DEFAULT: the per-token dQ-on-BF16 tiles at D = 64 not deterministic, at D = 128 all
# (deterministic since round 32, fp8_token's since round 35, fp8_token_bf16qk's since round 36)
_dq_first_default = lambda p: _dq16_per_token(p) and (  # noqa: E731
    p.get("head_dim") == 128 or not p.get("deterministic"))

# the template's BWD_DS_STSM_DEFAULT: the per-token dQ-on-BF16 tiles (at D = 64 and deterministic since round 32,
# fp8_token's D = 128 tile since round 35, fp8_token_bf16qk's since round 36), fp8_pv's non-deterministic D = 128
# tile (BF16 dS; round 36) and the bf16 route's (round 39)
_ds_stsm_default = lambda p: _dq16_per_token(p) or (  # noqa: E731
    (p.get("ds_fmt") == "bf16" or p.get("v_fmt") != "e4m3") and p.get("head_dim") == 128
    and not p.get("deterministic"))

# the template's BWD_BF16_SPLIT_DEFAULT: the bf16 route's tiles take bwd_sdp_split and bwd_dq_first (FA4's order) at
# D = 128 (non-deterministic since round 43, deterministic since round 44) and at D = 64 non-deterministic (round 44);
# the template also asks for mask-free interior tiles, which every base variant here has
_bf16_split_default = lambda p: (p.get("v_fmt") != "e4m3"  # noqa: E731
                                 and (p.get("head_dim") == 128 or not p.get("deterministic")))
# the bf16 tiles bwd_dq_convert builds for (the call has no second pass, no extra inputs): not deterministic (fp8_token's
# D = 128 tile, the other it builds for, has it by default since round 45)
_bf16_plain_bwd = lambda p: not p.get("deterministic") and _bf16_split_default(p)  # noqa: E731
# the bf16 tiles where the split and FA4's order are experiments still (the D = 64 `_det` copies)
_bf16_split_off = lambda p: p.get("v_fmt") != "e4m3" and not _bf16_split_default(p)  # noqa: E731

# the tiles whose sdS holds 16-bit dS (templates/sm90/attn_bwd.py.j2: ds_wide): the bf16 route, fp8_pv's BF16 dS, dQ on BF16
_ds_wide = lambda p: p.get("v_fmt") != "e4m3" or p.get("ds_fmt") == "bf16" or bwd_dq_bf16(p)  # noqa: E731

# tag → (render-context / params overrides, which default variants it applies to, note)
EXPERIMENTS: dict[str, dict] = {
    # bwd_alu_trim (templates/sm90/attn_bwd.py.j2; on since 2026-12-01 with cg 2): the untrimmed kernel and
    # the other batchings of the dQ-scale amax (per-column butterflies, or a reduce-scatter of 1 or 4 groups)
    "notrim": dict(over={"bwd_alu_trim": False}, when=_qk8, note="ALU trim off (the kernel before 2026-12-01)"),
    **{f"trim{cg}": dict(over={"bwd_alu_trim": True, "bwd_dq_amax_cg": cg}, when=_qk8,
                         note=f"ALU trim, dQ amax {'per-column butterflies' if cg == 0 else f'reduce-scatter, {2 * cg} columns a batch'}")
       for cg in (0, 1, 4)},
    # bwd_dq_warp and bwd_q_row_perm (on since 2026-12-02, eleventh session; H200: bitwise equal, fp8_token −9 … −10 %,
    # bf16 −3 … −5 %): the kernels without them, as A/B copies against the new defaults
    "nodqwarp": dict(over={"bwd_dq_warp": False}, when=_dq_writer,
                     note="dQ rows' bulk reduce-adds from two consumer warps (the kernel before the writer warp)"),
    "noqperm": dict(over={"bwd_q_row_perm": False}, when=_fp8_token_tile,
                    note="P̂ᵀ and dSᵀ to their wgmmas by shuffles (Q, dO rows in natural order)"),
    # bwd_dq_bf16 (built 2026-12-04 as tag dq16, the default since the twenty-fifth session; a numerics change of the dQ
    # product, emulator dq_bf16): the kernel without it (dQ = dS̃·K on FP8) as an A/B copy against the default
    # (fp8_token_bf16qk's BF16-score tile too since the twenty-fifth session: its dQ takes the BF16 k of Sᵀ)
    "nodq16": dict(over={"bwd_dq_bf16": False}, when=bwd_dq_bf16,
                   note="dQ = dS̃·K on E4M3 with its dQ scale group and amax exchange (the kernel before dQ on BF16)"),
    # bwd_row_pad (twenty-fifth session; since round 30 the default of fp8_pv's BF16-dS tile only): unpadded as an A/B
    "norowpad": dict(over={"bwd_row_pad": False}, when=bwd_row_pad,
                     note="per-query words 2·ROW_WORDS per column pair (two-way bank conflicts in the softmax loads)"),
    # bwd_row_swz (twenty-fifth session; the default of the other FP8 tiles since round 30): where it is off (fp8_pv)...
    "rowswz": dict(over={"bwd_row_swz": True}, when=lambda p: p.get("v_fmt") == "e4m3" and not bwd_row_swz(p),
                   note="per-query words XOR-swizzled (t = 2, 3 read offset ^ 8): no bank conflicts, no padding"),
    # ... and the kernels before it where it is on: padded on the dQ-on-BF16 tiles, plain (two-way conflicts) elsewhere
    "norowswz": dict(over={"bwd_row_swz": False}, when=bwd_row_swz,
                     note="per-query words without the swizzle (the default before round 30: padded where dQ is on BF16)"),
    # bwd_no_kt (twenty-fifth session; H200 round 30: 0.97–1.01×; H100 round 38 0.988–1.003×, fp8_token's D = 128 tile's
    # default since): the dQ-on-BF16 tiles stop loading the unread Kᵀ codes; where it is on, the kernel that loads them
    "nokt": dict(over={"bwd_no_kt": True}, when=lambda p: bwd_dq_bf16(p) and not _fp8_token_d128(p),
                 note="no Kᵀ tile load (dQ on BF16 reads K̂ / the BF16 k): one TMA of n·d bytes less per unit"),
    "kt": dict(over={"bwd_no_kt": False}, when=_fp8_token_d128,
               note="the Kᵀ tile loaded though nothing reads it (the kernel before round 38)"),
    # bwd_dq_first (twenty-sixth session; H200 round 30: D = 128 1.00–1.03×, off; D = 64 0.96–0.99× over the swizzle and
    # dO's fold, the default of the per-token tiles' non-deterministic D = 64 copies): dK issued after dQ, dQ waited alone
    # ... and (forty-first session) on the bf16 route's tiles, where it is FA4's order
    "dqfirst": dict(over={"bwd_dq_first": True},
                    when=lambda p: (bwd_dq_bf16(p) and not _dq_first_default(p)) or _bf16_split_off(p),
                    note="dK issued after dQ; the dQ epilogue overlaps dK (wait_group 1), the Q stage released after it"),
    "nodqfirst": dict(over={"bwd_dq_first": False}, when=_dq_first_default,
                      note="dK issued before the dS barrier, dQ waited with it (the kernel before round 30 at D = 64, "
                           "before round 32 on the `_det` D = 128 copies)"),
    # bwd_dq_bf16 on mxfp8's 32×32-block dS tile (twenty-seventh session, experiment; H200 round 30: D = 128 0.90–0.94×,
    # D = 64 0.83–0.88× the unswizzled default, but D = 128 slower than the swizzle alone): dQ on BF16 dS and K̂ instead of
    # the 32-query-block E4M3 dS (no column amaxes, their barrier, block or window maxima; the Kᵀ tile goes)
    "dq16sq": dict(over={"bwd_dq_bf16": True}, when=_dq16_square_32,
                   note="mxfp8: dQ on BF16 dS and K̂ (no dQ block exponent, no Kᵀ tile)"),
    # bwd_dof_fold (twenty-seventh session; default since round 30): the tiles with dO's factor in the softmax pass
    "nodoffold": dict(over={"bwd_dof_fold": False}, when=_dq16_per_token,
                      note="ds·2^−edo not folded: dO's factor multiplied in the softmax pass (the kernel before round 30)"),
    # bwd_ds_stsm (thirty-first session; H100 round 32: the default of the per-token dQ-on-BF16 tiles at D = 64 and of
    # their `_det` copies): where sdS holds 16-bit dS (the bf16 route, fp8_pv's BF16 dS, the dQ-on-BF16 tiles), dS goes
    # to shared memory by 4 stmatrix.trans a thread instead of 32 two-byte stores; where it is off...
    "stsm": dict(over={"bwd_ds_stsm": True}, when=lambda p: _ds_wide(p) and not _ds_stsm_default(p),
                 note="dS to sdS by stmatrix.trans (4 STSM a thread a tile instead of 32 STS.U16)"),
    # ... with bwd_dq_first where both are off (D = 128, not deterministic: fp8_token 0.98–1.00 in round 32) ...
    "stsmdqf": dict(over={"bwd_ds_stsm": True, "bwd_dq_first": True},
                    when=lambda p: bwd_dq_bf16(p) and not _dq_first_default(p) and not _ds_stsm_default(p),
                    note="stmatrix dS store and dK issued after dQ (bwd_dq_first)"),
    # (round 36's `w2stsm` / `w2stsmdqf`, the pair with two writers on fp8_token_bf16qk's D = 128 tile, became its
    # default and were removed: no shipped tile took them any more, nor `stsmdqf` now; `nostsm`, `nodqfirst`, `dqw1`
    # undo the defaults)
    # ... and the kernels before it where it is on
    "nostsm": dict(over={"bwd_ds_stsm": False}, when=_ds_stsm_default,
                   note="dS to sdS by 32 two-byte stores a thread (the kernel before round 32)"),
    # bwd_dq_writers (2026-12-02, twelfth session; default 2 at D = 64 since the thirteenth, else 1): the other count, as an
    # A/B copy against the default
    "dqw2": dict(over={"bwd_dq_writers": 2},
                 when=lambda p: _dq_writer(p) and not _two_writers(p),
                 note="two dQ writer warps (rows split between warps 1 and 2 of the producer warpgroup)"),
    "dqw1": dict(over={"bwd_dq_writers": 1}, when=lambda p: _dq_writer(p) and _two_writers(p),
                 note="one dQ writer warp (the kernel before 2026-12-02's second writer)"),
    # bwd_dq_tile_copy (thirty-first session; experiment, built, not run): head-major dq_accum, a swizzled unpadded staging
    # tile and one bulk reduce-add per writer warp and query tile instead of one per row
    "dqtile": dict(over={"bwd_dq_tile_copy": True}, when=_dq_writer,
                   note="one bulk reduce-add per writer warp and tile (head-major dq_accum, swizzled staging tile)"),
    # bwd_kv_early (thirty-second session; experiment, built, not run): fp8_token's tile releases the K/V stage after the
    # unit's last Sᵀ / dPᵀ instead of after its last tile, so the next unit's K, V and first Q tiles load under that tile
    "kvearly": dict(over={"bwd_kv_early": True}, when=lambda p: _dq16_per_token(p) and not p.get("scores_bf16"),
                    note="the K/V stage released after the unit's last Sᵀ / dPᵀ (the next unit's loads under its last tile)"),
    # bwd_q_ahead (thirty-second session; experiment, built, not run): every tile; the producer issues a unit's first
    # STAGES query tiles before it waits for the K/V stage
    # thirty-sixth session (H100 round 38: 0.985–0.997×, fp8_token's D = 128 tile's default since): column group 0's
    # per-query words loaded while Sᵀ and dPᵀ run; where it is on, the kernel that loads them after the wait
    "rwe": dict(over={"bwd_rw_early": True}, when=lambda p: _rwe_tile(p) and not _fp8_token_d128(p),
                note="column group 0's per-query words (LSE, D, Q factor) loaded between the Sᵀ/dPᵀ issue and their wait"),
    "norwe": dict(over={"bwd_rw_early": False}, when=_fp8_token_d128,
                  note="column group 0's per-query words loaded after the Sᵀ/dPᵀ wait (the kernel before round 38; "
                       "round 45's split, dqsl and conversion need them early: off with it)"),
    # bwd_dq_scale_late (fortieth session; FA4's SASS: its tile leaves dQ's scale to the post-processing): the bf16
    # route's dQ partial without its softmax-scale multiply, and since the forty-first the per-token dQ-on-BF16 tiles'
    # without softmax_scale·2^edo; the runtime's dQ conversion applies the row factor once (dQ to the last bits)
    # (round 45: fp8_token's D = 128 non-deterministic tile has it by default, with the split and the call's conversion)
    "dqsl": dict(over={"bwd_dq_scale_late": True},
                 when=lambda p: (p.get("v_fmt") != "e4m3" or _dq16_per_token(p)) and not _fp8_token_d128(p),
                 note="dQ partial reduce-added without its row factor; the dQ conversion multiplies by it"),
    # bwd_sdp_split (forty-first session; round 41's profile: our consumers wait on wgmma completion 2.4× as often as
    # FA4's): the Sᵀ wait split from dPᵀ's, P and dV's issue under dPᵀ, dS under dV; and with bwd_dq_first (FA4's order)
    # (fp8_token's D = 128 tile since the forty-second session: dV's operand scaled in its conversion)
    "split": dict(over={"bwd_sdp_split": True}, when=_bf16_split_off,
                  note="Sᵀ waited alone: P and dV's issue while dPᵀ runs, dS while dV runs"),
    "splitdqf": dict(over={"bwd_sdp_split": True, "bwd_dq_first": True}, when=_bf16_split_off,
                     note="bwd_sdp_split and bwd_dq_first on the bf16 tile (FA4's order)"),
    # the split with the dQ scale left to the conversion (forty-second session: on fp8_token's tile the split frees the
    # registers whose lack made round 41's dqsl spill; sm_90a interior path 852 → 800 instructions, spill loads 10 → 3)
    "splitsl": dict(over={"bwd_sdp_split": True, "bwd_dq_scale_late": True},
                    when=_bf16_split_off, note="bwd_sdp_split and bwd_dq_scale_late"),
    # the split on the interior copy of the tile only, the masked copy fused (forty-fourth session; fp8_token's split
    # paid on the masked path and in registers, round 43); on bf16's split tiles and fp8_token's, with dqsl on the latter
    "splitint": dict(over={"bwd_sdp_split": True, "bwd_sdp_split_interior": True},
                     when=lambda p: _bf16_split_default(p) or _fp8_token_d128(p),
                     note="bwd_sdp_split on interior tiles only (masked tiles fused)"),
    # the call converts dq_accum itself, in one vectorised launch after the backward (forty-fourth session: round 44
    # measured the runtime's torch conversion with dqsl's row factor at half the plain cast's bandwidth)
    "dqc": dict(over={"bwd_dq_convert": True}, when=_bf16_plain_bwd,
                note="BF16 dQ written by the call's own conversion launch"),
    "dqcsl": dict(over={"bwd_dq_convert": True, "bwd_dq_scale_late": True}, when=_bf16_plain_bwd,
                  note="bwd_dq_convert and bwd_dq_scale_late: the row factor in the call's conversion"),
    # round 45 (H100, two runs): split + dqsl + the call's conversion (splitslc) on fp8_token's D = 128 tile, causal
    # 0.93–0.96×, non-causal 0.97–1.00×: its default since; these undo it, wholly or in part
    "nosplitslc": dict(over={"bwd_sdp_split": False, "bwd_dq_scale_late": False, "bwd_dq_convert": False},
                       when=_fp8_token_d128,
                       note="the fused pass, dQ's row factor in the tile, the runtime's cast (fp8_token's tile before round 45)"),
    "splitnosl": dict(over={"bwd_dq_scale_late": False, "bwd_dq_convert": False}, when=_fp8_token_d128,
                      note="the split with dQ's row factor in the tile and the runtime's cast (round 43's split)"),
    # the next query tile's Sᵀ issued behind this tile's dK, so it runs under the dQ epilogue (forty-sixth session; the
    # bf16 tile serialises its wgmmas with it: the template refuses)
    "sahead": dict(over={"bwd_s_ahead": True}, when=_fp8_token_d128,
                   note="the next query tile's Sᵀ issued after this tile's dK (under its dQ epilogue)"),
    "saheadlate": dict(over={"bwd_s_ahead": True, "bwd_s_ahead_late": True}, when=_fp8_token_d128,
                       note="the next query tile's Sᵀ issued after this tile's dQ hand-off"),
    # an ablation (forty-seventh session): no dQ reduce-adds, dQ left zero (its verify fails on purpose): the time
    # the tile's L2 reduce traffic costs, the bound of a lever that cuts it
    "nodqred": dict(over={"bwd_ablate_dq_reduce": True},
                    when=lambda p: _fp8_token_d128(p) or (_bf16_plain_bwd(p) and p.get("head_dim") == 128),
                    note="ABLATION: the dQ writers issue no reduce-adds (dQ wrong on purpose; timing only)"),
    # an ablation (forty-seventh session): dK's codes cut from dS' with no per-pair quantization (dK wrong on purpose):
    # what the dK scale chain costs, the bound of dK on BF16 dS with the factors on the Q operand
    "nodkq": dict(over={"bwd_ablate_dk_quant": True}, when=_fp8_token_d128,
                  note="ABLATION: dK's codes from dS' without y, amax, rescale (dK wrong on purpose; timing only)"),
    # bwd_dk_bf16 (forty-eighth session; what nodkq bounded): dK = dS'ᵀ·Q̂ as a BF16 wgmma, Q̂ = Q codes·2^(eq+edo) written
    # by the call's own first launch, no per-pair dK quantization; dK changes (the emulator's dk_bf16), dQ and dV stay
    # bit for bit
    "dk16": dict(over={"bwd_dk_bf16": True}, when=_fp8_token_d128,
                 note="dK on BF16 dS' and Q̂ = Q codes·2^(eq+edo) (no dK scale chain)"),
    # the bf16 tiles' default before the split and FA4's order (rounds 43–44; the fused pass, dK issued first)
    "nosplit": dict(over={"bwd_sdp_split": False, "bwd_dq_first": False}, when=_bf16_split_default,
                    note="Sᵀ and dPᵀ waited together, dK issued before dQ (the bf16 tiles before rounds 43–44)"),
    # both on the bf16 tile (forty-first session): FA4's order and FA4's dQ scale
    "dqfsl": dict(over={"bwd_dq_first": True, "bwd_dq_scale_late": True}, when=_bf16_split_off,
                  note="bwd_dq_first and bwd_dq_scale_late on the bf16 tile"),
    "qahead": dict(over={"bwd_q_ahead": True}, when=lambda p: True,
                   note="a unit's first Q / dO tiles issued before its K, V (the producer's K/V wait after them)"),
    # three Q/dO stages instead of two (the producer sleeps in its empty-wait; a later wake-up then shows as the
    # consumers' wait for the next tile's Sᵀ, dPᵀ operands); the FP8 tiles (their stage is 32 KB)
    "s3": dict(over={"stages": 3}, when=lambda p: p.get("v_fmt") == "e4m3" and p.get("stages") == 2,
               note="3 Q/dO pipeline stages"),
    # the dynamic persistent scheduler over head sections of 2 (bwd_dynamic: the default since 2026-12-02, fourteenth
    # session, where the schedule allows; measured as tag dyn in docs/results/bwd_experiments_dyn*-h200-2026-12-02.*):
    # the kernels before it — the round-robin, one CTA per unit (the thirteenth session's default, as tags np, nph1,
    # nph2, ph2 in docs/results/bwd_experiments_sched-h200-2026-12-02.json), and that with other section sizes
    "pers": dict(over={"bwd_dynamic": False, "bwd_persistent": True, "bwd_head_section": 0}, when=_dynamic_default,
                 note="persistent CTAs, units b, b + grid, …, item-major (the kernel of the twelfth session)"),
    "onecta": dict(over={"bwd_persistent": False, "bwd_head_section": 2}, when=_dynamic_default,
                   note="one CTA per unit, KV heads in sections of 2 (the thirteenth session's default)"),
    "hs0": dict(over={"bwd_persistent": False, "bwd_head_section": 0}, when=_dynamic_default,
                note="one CTA per unit, item-major (every KV head of an item in turn)"),
    "hs1": dict(over={"bwd_persistent": False, "bwd_head_section": 1}, when=_dynamic_default,
                note="one CTA per unit, head-major (a KV head's units longest-first, then the next head's)"),
    "dhs1": dict(over={"bwd_head_section": 1}, when=_dynamic_default,
                 note="the dynamic scheduler, head-major (sections of 1 KV head)"),
    # bwd_sq32_windows (default since 2026-12-02, fourteenth session): the 32×32-block dS routes without windows (a
    # unit per short document and KV head: 102–110 ms on 131072 one-token documents, mxfp8 D = 128, before it)
    "sq32nowin": dict(over={"bwd_sq32_windows": False}, when=lambda p: p.get("ds_gran") == "square_32",
                      note="the 32×32-block dS without windows (the kernel before bwd_sq32_windows)"),
    # bwd_sq32_win_copy (default since 2026-12-03): without it, the window code sits in the masked copy of one_tile
    # (stack 232 → 264 B on mxfp8 D = 128; H200: +0.5 … +4 % on every row, 2026-12-03)
    "nosq3": dict(over={"bwd_sq32_win_copy": False},
                  when=lambda p: p.get("ds_gran") == "square_32" and p.get("bwd_interior_nomask", True),
                  note="a window's tiles in the masked copy of one_tile (the kernel before bwd_sq32_win_copy)"),
    # the deterministic dQ with the counter: 1.3 … 1.75× slower on the H200 (2026-12-02), not the default
    "dyndet": dict(over={"bwd_dynamic": True, "bwd_head_section": 2},
                   when=lambda p: bool(p.get("deterministic")) and p.get("ds_gran") != "tensor",
                   note="the deterministic dQ with the atomic-counter scheduler over head sections of 2"),
    "r12": dict(over={"bwd_dq_warp": False, "bwd_q_row_perm": False},
                when=lambda p: _fp8_token_tile(p) and not p.get("deterministic"),
                note="neither (the fp8_token backward of round 12)"),
}
DEFAULT_EXPERIMENTS = tuple(EXPERIMENTS)
ROUTES = ("fp8_token", "bf16")
HEAD_DIM = 128


def with_candidates(specs, candidates=()):
    """`specs` with candidate routes (routes no shipped family lists yet, e.g. one compiled but not yet
    verified on a GPU) added to every sm90 quantizer and attention family: bundles for a GPU session
    that verifies them before the families list them (changing a family makes the tuning tables stale)."""
    from dataclasses import replace as dc_replace

    fams = dict(specs.families)
    for n, f in fams.items():
        if f.arch.value == "sm90" and f.kind.value in ("quant", "attn_fwd", "attn_bwd"):
            fams[n] = f.model_copy(update={"routes": list(f.routes) + [r for r in candidates if r not in f.routes]})
    return dc_replace(specs, families=fams)


def base_variants(routes=ROUTES, head_dim: int = HEAD_DIM, candidates=()):
    """(backward variants, what their op path needs: forward and quantizer variants, `plan.op_support`) of the routes
    at `head_dim`. `candidates`: routes the families do not list yet (`with_candidates`), built and tested like the
    others."""
    from ..plan import make_plan
    from ..plan.op_support import backward_support
    from ..spec import KernelKind, load_specs

    specs = with_candidates(load_specs(), candidates)
    plan = make_plan(specs, arch="sm90", routes=list(routes) + [c for c in candidates if c not in routes])
    bwd = [v for v in plan.variants if v.param("head_dim") == head_dim and v.kind == KernelKind.attn_bwd]
    return bwd, backward_support(specs, "sm90", bwd)


def build(out_dir, flags=DEFAULT_EXPERIMENTS, *, jobs: int = 2, candidates=(), variant_globs=(), routes=ROUTES,
          head_dim: int = HEAD_DIM) -> dict:
    """`variant_globs` (none: all) narrows the backward variants the experiments copy, by base name; `routes` and
    `head_dim` pick the base variants (default: fp8_token and bf16 at D = 128)."""
    bwd, support = base_variants(routes=tuple(routes), head_dim=head_dim, candidates=candidates)
    if variant_globs:
        bwd = [v for v in bwd if matches_any(v.name, variant_globs)]
        if not bwd:
            raise SystemExit(f"no backward variant matches {list(variant_globs)}")
    tagged = experiment_variants(flags, base_variants=bwd, experiments=EXPERIMENTS)
    return build_variants_bundle(out_dir, [v for _, v in tagged] + support, jobs=jobs)


def _inputs(entry, doc_lens, heads, seed):
    import torch

    from ..verify.attn_gpu import make_qkv

    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = make_qkv(list(doc_lens), heads, heads, entry["params"]["head_dim"], "gauss", g, "cuda")
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16).cuda()
    return q, k, v, do, cu


def compare_bitwise(b, entry, ref_entry, doc_lens=(1000, 3000, 77, 1), heads=4, seed=3) -> dict:
    """dQ, dK, dV of `entry` against `ref_entry` on the same inputs (the same forward O and LSE):
    whether each is bitwise equal, and dQ's largest absolute difference."""
    from ..runtime.ops import backward_with
    from ..verify.attn_gpu import backward_setup

    q, k, v, do, cu = _inputs(entry, doc_lens, heads, seed)
    o, lse, prof, fwd = backward_setup(b, ref_entry, q, k, v, cu, with_forward=True)
    # both with the forward that made O, LSE (a diag_v backward repeats its diagonal decisions)
    got = backward_with(b, entry, do, q, k, v, o, lse, cu, prof, poison=True, fwd_params=fwd["params"])[:3]
    ref = backward_with(b, ref_entry, do, q, k, v, o, lse, cu, prof, poison=True, fwd_params=fwd["params"])[:3]
    out = {f"{n}_bitwise": bool(torch_equal(x, y)) for n, x, y in zip(("dq", "dk", "dv"), got, ref)}
    out["dq_max_abs_diff"] = float((got[0].float() - ref[0].float()).abs().max())
    return out


def torch_equal(a, b) -> bool:
    """Bit for bit, NaN included (a NaN in the same place with the same payload counts as equal)."""
    import torch

    return a.shape == b.shape and bool(torch.equal(a.contiguous().view(torch.int16 if a.element_size() == 2 else
                                                                        torch.int32),
                                                   b.contiguous().view(torch.int16 if b.element_size() == 2 else
                                                                       torch.int32)))


def time_entry(b, entry, doc_lens, heads=16, iters=20) -> float:
    """Median ms of the op's backward path (quantizer launches + dO launch + kernel), as the tuner times it."""
    from types import SimpleNamespace

    from ..tune.gpu import AttnBwdHook

    ms = AttnBwdHook().time(b, entry, SimpleNamespace(doc_lens=list(doc_lens), heads=heads), 0, repeats=iters)
    return sorted(ms)[len(ms) // 2]


def run(bundle_dir, *, only=None, workloads=((4096,) * 4, (16384,)), verify=True, iters=20, json_out=None,
        causal_only=False, entry_timeout: float | None = ENTRY_TIMEOUT_S, variant_globs=(), resume=False) -> list[dict]:
    from ..bench.flops import attention_flops
    from ..runtime.bundle import load_bundle
    from ..verify.attn_gpu import verify_bwd_entry

    b = load_bundle(bundle_dir)

    def measure(e, base, tag, row):
        if verify:
            vr = verify_bwd_entry(b, e, kinds=("gauss", "tiny_docs"))
            row["ok"] = all(r["ok"] for r in vr)
            row["cos_emu"] = min(r["cos_emulator"] for r in vr)
            row["cos_fp32"] = min(r["cos_fp32"] for r in vr)
        if tag:
            row.update(compare_bitwise(b, e, b.variants[base]))
        for docs in workloads:
            ms = time_entry(b, e, docs, iters=iters)
            fl = attention_flops(list(docs), 16, e["params"]["head_dim"], causal=e["params"]["causal"], mode="bwd")
            row[wl_key(docs)] = ms
            row[f"{wl_key(docs)}_tflops"] = fl / (ms * 1e-3) / 1e12

    return run_entries(select_entries(b, "attn_bwd", only, causal_only, EXPERIMENTS, variant_globs), measure, _fmt_row, table,
                       workloads, json_out, EXPERIMENTS, entry_timeout=entry_timeout, resume=resume)


def _fmt_row(row, workloads) -> str:
    short = row["variant"].replace("attn_bwd_sm90_", "").replace("_m64n128_s2_wg2_preg_longest_first", "")
    cells = [f"{short:32s}", f"{row['tag']:8s}"]
    if "ok" in row:
        cells.append(f"{'ok ' if row['ok'] else 'BAD'} emu {row['cos_emu']:.7f} fp32 {row['cos_fp32']:.5f}")
    if "dk_bitwise" in row:
        cells.append("bitwise dq/dk/dv " + "/".join("=" if row[f"{n}_bitwise"] else "≠" for n in ("dq", "dk", "dv"))
                     + f" (dq max {row['dq_max_abs_diff']:.1e})")
    for k in _wl_keys(workloads):
        cells.append(f"{k} {row[k]:7.3f} ms" if k in row else f"{k}       -")
    if "error" in row:
        cells.append("ERROR " + row["error"])
    return "  ".join(cells)


def table(rows, workloads) -> str:
    """One line per variant × experiment: verify, bitwise equality with the default, ms (× default)."""
    return experiment_table(
        rows, _wl_keys(workloads), ["variant", "experiment", "verify", "cos_emu", "bitwise dq/dk/dv vs default"],
        lambda r: [r["variant"].replace("attn_bwd_sm90_", ""), r["tag"],
                   ("ok" if r.get("ok") else "FAIL") if "ok" in r else "-",
                   f"{r['cos_emu']:.7f}" if "cos_emu" in r else "-",
                   "/".join("=" if r[f"{n}_bitwise"] else "≠" for n in ("dq", "dk", "dv")) if "dk_bitwise" in r else "-"],
        "ms", ".3f", ".3f")


def main(argv=None) -> int:
    ap, bp, rp = experiment_cli("python -m flamia_gen.bench.bwd_experiments", __doc__, ".dev/bundle-bexp",
                               DEFAULT_EXPERIMENTS, "GPU: verify, compare and time every backward variant of the bundle")
    rp.add_argument("--variants", default="", help="comma-separated name globs of the base variants to run")
    rp.add_argument("--workloads", default="4x4096,1x16384",
                    help="comma-separated rows of documents, e.g. 4x4096,1x16384,8192+224x256")
    bp.add_argument("--routes", default="", help="comma-separated routes of the base variants (default: "
                    + ",".join(ROUTES) + ")")
    bp.add_argument("--head-dim", type=int, default=HEAD_DIM, choices=(64, 128))
    bp.add_argument("--candidates", default="", help="comma-separated routes no family lists yet (built and run "
                    "like the others, e.g. fp8_token_bf16qk)")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        return print_experiments(EXPERIMENTS)
    if a.cmd == "build":
        m = build(a.out, split_tags(a.only), jobs=a.jobs, candidates=split_tags(a.candidates),
                  variant_globs=split_tags(a.variants), routes=split_tags(a.routes) or ROUTES, head_dim=a.head_dim)
        return 0 if m["variants"] else 1
    rows = run(a.bundle, only=split_tags(a.only, run=True), verify=not a.no_verify, iters=a.iters, json_out=a.json,
               causal_only=a.causal_only, entry_timeout=a.entry_timeout or None,
               workloads=doc_rows(a.workloads), variant_globs=split_tags(a.variants), resume=a.resume)
    return run_exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
