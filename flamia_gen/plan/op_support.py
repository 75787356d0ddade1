"""What a kernel needs beside it in a bundle to run through the op's path on a GPU host.

A backward is verified and timed through `runtime.ops.backward_with`: the route's quantizer launches (Q, K, V and
dO, with the copies an exact route makes at other granularities), and O and LSE from a forward variant of the same
route, causality and head dim (`verify.attn_gpu.forward_entry_for`). A backward with diagonal decisions (`diag_v`)
pairs only with a forward of tile_n equal to its fwd_tile_n. Forwards are timed on inputs the emulator quantized, and
quantizers alone: they need nothing beside them.
"""

from __future__ import annotations

from .variants import Variant, make_plan


def backward_support(specs, arch: str, backwards) -> list[Variant]:
    """The forward and quantizer variants the op paths of `backwards` need, in plan order: per (route, head dim) one
    forward per causality and a diag_v backward's paired forward; per head dim every quantizer of the backwards'
    routes (their own representations and the exact routes' copies). The variants come from ONE plan of those routes
    together, so a quantizer that several of them share lists all of them in `uses` (the runtime picks a route's
    quantizer by it)."""
    backwards = list(backwards)
    if not backwards:
        return []
    plan = make_plan(specs, arch=arch, routes=sorted({v.route for v in backwards}))
    dims = {v.param("head_dim") for v in backwards}
    need: set[str] = set()
    for route, d in sorted({(v.route, v.param("head_dim")) for v in backwards}):
        fwd = [v for v in plan.variants if v.kind.value == "attn_fwd" and v.route == route
               and v.param("head_dim") == d]
        seen = set()
        for v in fwd:
            if v.param("causal") not in seen:
                seen.add(v.param("causal"))
                need.add(v.name)
        # diag_v backwards: a forward of their fwd_tile_n (the first per causality may have another tile_n); the
        # plan's params lack the template's fwd_tile_n, which it renders as the backward's tile_n
        # (runtime.attn_bwd.fwd_tile_n_of; not imported here: the plan stays torch-free)
        for b in backwards:
            bp = dict(b.params)
            if b.route != route or bp["head_dim"] != d or not bp.get("diag_v"):
                continue
            want = bp.get("fwd_tile_n", bp["tile_n"])
            pair = [v.name for v in fwd if v.param("causal") == bp["causal"] and dict(v.params).get("tile_n") == want]
            if pair and not need.intersection(pair):
                need.add(pair[0])
    return [v for v in plan.variants
            if v.name in need or (v.kind.value == "quant" and v.param("head_dim") in dims)]


__all__ = ["backward_support"]
