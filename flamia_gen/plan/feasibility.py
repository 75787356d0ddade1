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
    # 16-byte vector access: a row of D BF16 is 2·D bytes, of E4M3 D bytes.
    if (d * 1) % 16:
        return False, f"head_dim={d}: a row of codes is not a multiple of 16 bytes"
    return True, ""
