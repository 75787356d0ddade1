"""The interface every benchmarked implementation (peer or ours) implements.

An adapter never crashes the harness: ``available()`` and ``supports()``
answer with a reason, and anything that fails inside ``prepare`` or a call is
caught by the runner and reported on the row. An adapter that finds out only
at run time that it cannot do a workload (a cuDNN graph with no engine, say)
raises :class:`PeerSkip`, which is reported as "skipped" with its text.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
from typing import Any, Callable, Sequence

NOT_INSTALLED = "not installed"
NO_CUDA = "no CUDA device"
EQUAL_DOCS_REASON = "needs equal documents (padding would waste memory)"
MODES = ("fwd", "bwd", "train")  # forward call; backward call alone (after an untimed forward); both


class PeerSkip(Exception):
    """Raised by an adapter that cannot run this workload; reported as skipped."""


def status_of(reason: str) -> str:
    """The row status for an ``available()`` refusal: 'not installed' or 'unavailable'."""
    return NOT_INSTALLED if reason.startswith(NOT_INSTALLED) else "unavailable"


def no_cuda_reason() -> str | None:
    """None when a CUDA device is usable, else the reason to show."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        return f"{NOT_INSTALLED}: torch ({exc})"
    if not torch.cuda.is_available():
        return NO_CUDA
    return None


def try_import(module: str) -> tuple[Any | None, str]:
    """(module, "") or (None, "not installed: <module> (<error>)"); never raises."""
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # ImportError, or a broken install raising anything
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"{NOT_INSTALLED}: {module} ({msg[:160]})"


def dist_version(*names: str) -> str | None:
    """Installed version of the first distribution found among ``names``."""
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # pragma: no cover - odd metadata
            continue
    return None


class Adapter:
    """Base class. Subclasses set ``name``, ``precision`` and ``memory_note`` and
    implement ``available``, ``supports`` and either ``build`` (an autograd-able
    packed attention function; the base class then provides ``prepare`` and
    ``compute``) or ``prepare`` and ``compute`` themselves."""

    name: str = "base"
    precision: str = "bf16"  # 'bf16' or 'fp8': picks the TFLOP/s ceiling
    memory_note: str = ""
    is_peer: bool = True  # False for our own routes (speed-up is measured against peers)
    dtype_name: str = "bfloat16"  # dtype the harness feeds in

    # -- availability ---------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        reason = no_cuda_reason()
        return (reason is None), (reason or "")

    def supports(self, workload) -> tuple[bool, str]:
        return True, ""

    def versions(self) -> dict[str, str]:
        """Versions of the packages this adapter uses, for the report's metadata."""
        return {}

    # -- the work -------------------------------------------------------------
    def build(self, workload) -> Callable[[Any, Any, Any], Any]:
        """Return f(q, k, v) -> o on packed (T, H, D) tensors, differentiable."""
        raise NotImplementedError

    def prepare(self, workload, inputs: Sequence[Sequence[Any]], mode: str) -> Callable[[], Any]:
        """A zero-arg callable doing one call of ``mode`` ('fwd', 'bwd' or 'train'),
        rotating through ``inputs`` (a list of (q, k, v)) one set per call.

        'bwd' times the backward call alone: each set's forward runs once here, outside the
        timed calls, and every call differentiates its graph again (``retain_graph``), so
        what is timed is whatever the implementation's backward launches (for our routes
        the dO quantizer and the backward kernel, for FA4 its pre- and post-processing)."""
        import torch

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        f = self.build(workload)
        if mode == "fwd":
            sets = [tuple(s) for s in inputs]
            cyc = itertools.cycle(sets)

            def fwd_call():
                q, k, v = next(cyc)
                with torch.no_grad():
                    return f(q, k, v)

            return fwd_call

        # detach() shares storage: no copy, but a fresh leaf that wants grads,
        # so the caller's tensors are untouched and nothing accumulates in .grad.
        sets = [tuple(t.detach().requires_grad_(True) for t in s) for s in inputs]
        d_out = fixed_grad_output(sets[0][0])

        if mode == "bwd":
            graphs = itertools.cycle([(f(*s), s) for s in sets])  # the forwards, once, untimed

            def bwd_call():
                o, s = next(graphs)
                return torch.autograd.grad(o, s, d_out, retain_graph=True)

            return bwd_call

        cyc = itertools.cycle(sets)

        def train_call():
            q, k, v = next(cyc)
            o = f(q, k, v)
            return torch.autograd.grad(o, (q, k, v), d_out)

        return train_call

    def compute(self, workload, q, k, v, d_out, need_grad: bool = True):
        """(o, dq) as packed (T, H, D) tensors for the accuracy check (dq None if
        ``need_grad`` is False)."""
        import torch

        f = self.build(workload)
        if not need_grad:
            with torch.no_grad():
                return f(q, k, v), None
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        o = f(q, k, v)
        (dq,) = torch.autograd.grad(o, (q,), d_out)
        return o.detach(), dq

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.precision})>"


def fixed_grad_output(like, seed: int = 1234):
    """The fixed random dO of a training call: N(0,1), same shape/dtype/device as ``like``."""
    import torch

    gen = torch.Generator(device=like.device).manual_seed(seed)
    return torch.randn(like.shape, generator=gen, device=like.device,
                       dtype=torch.float32).to(like.dtype)


def first_output(result):
    """``out`` from ``out`` or ``(out, lse, ...)`` (varlen functions return either)."""
    if isinstance(result, (tuple, list)):
        return result[0]
    return result


def cu_seqlens_per_device(workload) -> Callable[[Any], Any]:
    """``get(device)`` -> the workload's int32 ``cu_seqlens`` on that device, made once per
    device (not per timed call)."""
    cache: dict = {}

    def get(device):
        cu = cache.get(device)
        if cu is None:
            cu = cache[device] = workload.cu_seqlens(device)
        return cu

    return get


def batched_view(x, workload):
    """Packed (T, H, D) of equal documents as a (B, H, L, D) view (no copy)."""
    b, length = workload.num_docs, workload.doc_lens[0]
    return x.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)


def packed_from_batched(o, workload):
    """(B, H, L, D) back to packed (T, H, D); free when o is BLHD-contiguous."""
    return o.transpose(1, 2).reshape(workload.total_tokens, o.shape[1], o.shape[3])
