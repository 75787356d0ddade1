"""Registry of benchmarked implementations: the peers, and our routes.

Peers are registered here; our own routes plug in through ``register_impl``
(as ``flamia_<route>`` adapters) or, automatically, through ``our_impls()``
once ``flamia_gen.runtime`` exposes its attention entry points. Building the
registry imports no optional package: each adapter imports its library only
when asked whether it is available.
"""

from __future__ import annotations

from typing import Callable

from .adapter import NO_CUDA, Adapter, cu_seqlens_per_device, no_cuda_reason
from .peer_cudnn_fp8 import CudnnFp8Adapter
from .peer_fa4 import Fa4Adapter
from .peer_flex import FlexAdapter
from .peer_sdpa import SdpaAdapter
from .peer_torch_varlen import TorchVarlenAdapter


def builtin_peers() -> list[Adapter]:
    """Fresh instances of every peer, in report order."""
    return [
        SdpaAdapter("sdpa_cudnn", "CUDNN_ATTENTION"),
        SdpaAdapter("sdpa_flash", "FLASH_ATTENTION"),
        FlexAdapter(),
        Fa4Adapter(),
        TorchVarlenAdapter(),
        CudnnFp8Adapter("kernel"),
        CudnnFp8Adapter("quant"),
        CudnnFp8Adapter("e2e"),
    ]


_REGISTRY: dict[str, Adapter] = {}


def _ensure_builtins() -> None:
    if not _REGISTRY:
        for a in builtin_peers():
            _REGISTRY[a.name] = a


def register_impl(adapter: Adapter, replace: bool = False) -> Adapter:
    """Add an implementation (e.g. a ``flamia_<route>`` adapter) to the registry."""
    _ensure_builtins()
    for attr in ("name", "precision", "available", "supports", "prepare"):
        if not hasattr(adapter, attr):
            raise TypeError(f"{adapter!r} is not an adapter: it has no {attr!r}")
    if adapter.precision not in ("bf16", "fp8"):
        raise ValueError(f"{adapter.name}: precision must be 'bf16' or 'fp8', "
                         f"got {adapter.precision!r}")
    if adapter.name in _REGISTRY and not replace:
        raise ValueError(f"an implementation named {adapter.name!r} is already registered")
    _REGISTRY[adapter.name] = adapter
    return adapter


def unregister_impl(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_impls() -> dict[str, Adapter]:
    _ensure_builtins()
    return dict(_REGISTRY)


# ----------------------------------------------------------------- our routes

# The runtime entry points the bench looks for (the runtime package is written
# by others; until they exist, our_impls() returns [] and says why):
#   flamia_gen.runtime.bench_adapters() -> list[Adapter]          (preferred), or
#   flamia_gen.runtime.available_routes() -> list[str] and
#   flamia_gen.runtime.packed_attention(q, k, v, cu_seqlens, max_seqlen, *,
#                                       route: str, causal: bool) -> Tensor (T,H,D)
RUNTIME_MODULE = "flamia_gen.runtime"


class FlamiaRouteAdapter(Adapter):
    """One of our routes, through the runtime's attention op (`flamia_gen.attention`: forward and
    backward kernels of the bundle, autograd)."""

    is_peer = False
    memory_note = "packed (T,H,D), no padding; counts quantized copies and scales"

    def __init__(self, route: str, attention_fn: Callable, precision: str | None = None):
        self.route = route
        self.name = f"flamia_{route}"
        self.precision = precision or ("bf16" if route == "bf16" else "fp8")
        self._attn = attention_fn

    def available(self) -> tuple[bool, str]:
        reason = no_cuda_reason()
        return (reason is None), (reason or "")

    def build(self, workload):
        if no_cuda_reason():
            raise RuntimeError(NO_CUDA)
        cu_of = cu_seqlens_per_device(workload)
        max_len = int(workload.max_seqlen)

        def f(q, k, v):
            return self._attn(q, k, v, cu_of(q.device), max_len, route=self.route, causal=workload.causal)

        return f


def our_impls() -> tuple[list[Adapter], str]:
    """Adapters for our routes from ``flamia_gen.runtime``, or ([], why not)."""
    try:
        import importlib

        rt = importlib.import_module(RUNTIME_MODULE)
    except Exception as exc:
        return [], f"{RUNTIME_MODULE} not importable ({str(exc).splitlines()[0][:120]})"
    hook = getattr(rt, "bench_adapters", None)
    if callable(hook):
        try:
            adapters = list(hook())
        except Exception as exc:
            return [], f"{RUNTIME_MODULE}.bench_adapters() failed: {str(exc)[:160]}"
        for a in adapters:
            a.is_peer = False
        return adapters, "" if adapters else f"{RUNTIME_MODULE}.bench_adapters() returned none"
    attn = getattr(rt, "packed_attention", None)
    routes_fn = getattr(rt, "available_routes", None)
    if not callable(attn) or not callable(routes_fn):
        missing = [n for n, f in (("packed_attention", attn), ("available_routes", routes_fn))
                   if not callable(f)]
        return [], f"{RUNTIME_MODULE} has no attention entry points yet ({', '.join(missing)})"
    try:
        routes = list(routes_fn())
    except Exception as exc:
        return [], f"{RUNTIME_MODULE}.available_routes() failed: {str(exc)[:160]}"
    if not routes:
        return [], f"{RUNTIME_MODULE}.available_routes() returned no route"
    # the torch.library op has autograd (train mode needs it); the same kernels forward
    attn = getattr(rt, "autograd_attention", None) or attn
    return [FlamiaRouteAdapter(r, attn) for r in routes], ""


# ----------------------------------------------------------------- selection

GROUPS = ("all", "peers", "ours")


def resolve_impls(spec: str | list[str] | tuple[str, ...] = "all") -> tuple[list[Adapter], list[str]]:
    """Names (comma string or list; 'all', 'peers', 'ours' expand) to adapters.

    Returns (adapters, notes); notes explain why 'ours' added nothing. An
    unknown name is a ValueError that lists the known ones.
    """
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    if not names:
        raise ValueError("no implementation given (known: " + ", ".join(
            [*GROUPS, *registered_impls()]) + ")")
    reg = registered_impls()
    ours_cache: tuple[list[Adapter], str] | None = None
    out: list[Adapter] = []
    notes: list[str] = []

    def ours() -> list[Adapter]:
        nonlocal ours_cache
        if ours_cache is None:
            ours_cache = our_impls()
            if ours_cache[1]:
                notes.append(f"our routes: {ours_cache[1]}")
        registered_ours = [a for a in reg.values() if not getattr(a, "is_peer", True)]
        return registered_ours + [a for a in ours_cache[0] if a.name not in reg]

    for n in names:
        if n == "all":
            out += [a for a in reg.values() if getattr(a, "is_peer", True)] + ours()
        elif n == "peers":
            out += [a for a in reg.values() if getattr(a, "is_peer", True)]
        elif n == "ours":
            out += ours()
        elif n in reg:
            out.append(reg[n])
        else:
            found = [a for a in ours() if a.name == n]
            if not found:
                raise ValueError(f"unknown implementation {n!r} (known: "
                                 + ", ".join([*GROUPS, *reg]) + ")")
            out += found
    seen: set[str] = set()
    uniq = [a for a in out if not (a.name in seen or seen.add(a.name))]
    return uniq, notes
