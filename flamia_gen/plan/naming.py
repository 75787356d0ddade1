"""The one function that names a variant (CUTLASS `procedural_name()` style).

`quant_sm90_e4m3_tb32_ceil_d128_t32_h1`: kind, arch, the operand's representation
(format, granularity, exponent rule, Hadamard), head dim, tokens and heads per CTA.
The dO launch (`with_delta=True`: also D = rowsum(dÔ∘O) and the zeroed dQ accumulator)
adds a `delta` part after the representation: `quant_sm90_e4m3_tok_ceil_delta_d128_t32_h1`.
Attention: `attn_fwd_sm90_fp8_token_d128_m128n128_s2_wg2_preg_ovl_longest_first`. Names are Python identifiers: they become module, file and symbol names.
"""

from __future__ import annotations

import re

from ..spec import Arch, KernelKind

_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")


def procedural_name(kind: KernelKind, arch: Arch, route: str, params: dict) -> str:
    """`route` is the route name for attention kernels and the operand tag for quantizers."""
    kind, arch = KernelKind(kind), Arch(arch)
    if kind is KernelKind.quant:
        parts = [kind.value, arch.value, route]
        if params.get("with_delta"):
            parts.append("delta")
        parts += [f"d{params['head_dim']}", f"t{params['tokens_per_cta']}", f"h{params['heads_per_cta']}"]
    else:
        parts = [kind.value, arch.value, route, f"d{params['head_dim']}",
                 f"m{params['tile_m']}n{params['tile_n']}", f"s{params['stages']}",
                 f"wg{params['compute_warpgroups']}"]
        if params.get("p_in_registers"):
            parts.append("preg")
        if params.get("intra_wg_overlap"):
            parts.append("ovl")
        parts.append(str(params["scheduler"]))
        if params.get("deterministic"):
            parts.append("det")
    name = "_".join(str(p) for p in parts)
    if not _IDENT.match(name):
        raise ValueError(f"procedural name {name!r} is not an identifier")
    return name
