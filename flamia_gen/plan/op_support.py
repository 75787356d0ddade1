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
    """The forward and quantizer variants the op paths of `backwards` need (each once, in plan order per
    (route, head dim)): one forward per causality, a diag_v backward's paired forward, and every quantizer of the
    route's plan at that head dim (its own representations and the exact routes' copies)."""
    out: dict[str, Variant] = {}
    plans: dict[str, object] = {}
    keys = sorted({(v.route, v.param("head_dim")) for v in backwards})
    for route, d in keys:
        if route not in plans:
            plans[route] = make_plan(specs, arch=arch, routes=[route])
        at_d = [v for v in plans[route].variants if v.param("head_dim") == d]
        fwd = [v for v in at_d if v.kind.value == "attn_fwd"]
        seen = set()
        for v in fwd:
            if v.param("causal") not in seen:
                seen.add(v.param("causal"))
                out.setdefault(v.name, v)
        # diag_v backwards: a forward of their fwd_tile_n (the first per causality may have another tile_n); the
        # plan's params lack the template's fwd_tile_n, which it renders as the backward's tile_n
        # (runtime.attn_bwd.fwd_tile_n_of; not imported here: the plan stays torch-free)
        for b in backwards:
            bp = dict(b.params)
            if b.route != route or bp["head_dim"] != d or not bp.get("diag_v"):
                continue
            want = bp.get("fwd_tile_n", bp["tile_n"])
            pair = [v for v in fwd if v.param("causal") == bp["causal"] and dict(v.params).get("tile_n") == want]
            if pair and not any(n in out for n in (v.name for v in pair)):
                out[pair[0].name] = pair[0]
        for v in at_d:
            if v.kind.value == "quant":
                out.setdefault(v.name, v)
    return list(out.values())


__all__ = ["backward_support"]
