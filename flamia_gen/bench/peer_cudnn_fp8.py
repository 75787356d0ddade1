"""cuDNN FP8 SDPA (``nvidia-cudnn-frontend``, module ``cudnn``), batched, equal docs.

Per-tensor power-of-two scales, computed per call from the data (DESIGN §6:
the leaky per-tensor baseline). Scale of x = largest 2^k with amax(x)·2^k <= 448
(E4M3 max), so quantizing never saturates. Scales of what the kernel produces:
  P (softmax probs)  amax 1, so 256
  O                  the scale of V: O rows are convex combinations of V rows,
                     so amax(O) <= amax(V) and the bound holds per call
  dP, dQ, dK, dV     delayed, from the amaxes the previous call returned (what
                     Transformer Engine does); the first call calibrates them

Three flavours, because on Hopper every output is FP8:
  cudnn_fp8_kernel  the kernels alone: inputs quantized once, outside the timer
  cudnn_fp8_quant   + in-call quantization of q, k, v (and dO); outputs stay FP8
  cudnn_fp8_e2e     + the FP8 -> BF16 conversion of O (and dQ, dK, dV): a drop-in
                    for BF16 attention, the fair comparison for our routes
"""

from __future__ import annotations

import itertools
from typing import Any

from .adapter import (EQUAL_DOCS_REASON, MODES, NO_CUDA, Adapter, PeerSkip, dist_version,
                      fixed_grad_output, no_cuda_reason, try_import)

E4M3_MAX = 448.0
FLAVOURS = ("kernel", "quant", "e2e")
_TINY = 2.0**-60  # amax floor: an all-zero tensor gets a finite scale


def pow2_scale(amax):
    """Largest power of two s with amax·s <= 448, elementwise on a float32 tensor."""
    import torch

    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp_min(_TINY))))


def amax_of(x):
    """max |x| as a float32 0-dim tensor, one reduction, no |x| temporary."""
    import torch

    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def quantize_many(*xs):
    """Per-tensor E4M3 quantization of every x: ((x8, ...), scales (n,), descales (n,)).

    One function for all operands so that, compiled, it is one call: the
    amax reductions, the scale arithmetic and the scaled casts fuse, and the
    host issues a handful of kernels instead of a dozen (at 4x4096 the
    kernels run in 0.3 ms, so host overhead would otherwise be the cost)."""
    import torch

    amax = torch.stack([amax_of(x) for x in xs])
    scale = pow2_scale(amax)
    descale = 1.0 / scale
    # bf16 times a power of two is exact, so the scaling itself loses nothing.
    x8 = tuple((x * scale[i].to(x.dtype)).to(torch.float8_e4m3fn) for i, x in enumerate(xs))
    return x8, scale, descale


def dequant_many(x8s, descales, dtype):
    """FP8 tensors back to ``dtype`` with their 0-dim descales (the e2e outputs)."""
    return tuple(x.to(dtype) * d.reshape(()).to(dtype) for x, d in zip(x8s, descales))


def scales_from_amax(amax):
    """(scale, descale) for delayed scaling from last call's amaxes."""
    scale = pow2_scale(amax)
    return scale, 1.0 / scale


_FNS: dict[str, Any] = {}
_EAGER = {"quantize_many": quantize_many, "dequant_many": dequant_many,
          "scales_from_amax": scales_from_amax}


def _fn(name: str):
    """The torch.compile'd helper, or the eager one if compiling is impossible."""
    if name not in _FNS:
        try:
            import torch

            _FNS[name] = torch.compile(_EAGER[name], dynamic=False)
        except Exception:  # pragma: no cover - no inductor
            _FNS[name] = _EAGER[name]
    return _FNS[name]


def _call(name: str, *args):
    try:
        return _fn(name)(*args)
    except Exception:  # inductor could not build it here: eager from now on
        _FNS[name] = _EAGER[name]
        return _EAGER[name](*args)


def quant_backend() -> str:
    """'torch.compile' or 'eager': how the in-call quantization ran (for the report)."""
    return "eager" if any(_FNS.get(n) is f for n, f in _EAGER.items()) else "torch.compile"


class _Runner:
    """Buffers, graphs and per-call steps for one workload and mode."""

    def __init__(self, cudnn, workload, train: bool, device):
        import torch

        self.cudnn, self.torch, self.train = cudnn, torch, train
        self.b, self.length = workload.num_docs, workload.doc_lens[0]
        self.h, self.d = workload.heads, workload.head_dim
        self.causal = workload.causal
        self.device = device
        self.handle = cudnn.create_handle()
        cudnn.set_stream(self.handle, torch.cuda.current_stream(device).cuda_stream)
        from . import cudnn_fp8_graph as cg

        args = (cudnn, self.handle, self.b, self.h, self.length, self.d, self.causal)
        self.fwd = cg.build_fwd_any(*args, train=train)
        self.bwd = cg.build_bwd(*args) if train else None
        ws = max(self.fwd.workspace_size, self.bwd.workspace_size if self.bwd else 0)
        self.workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=device)
        shape = (self.b * self.length, self.h, self.d)  # packed == (B, L, H, D)
        f8 = torch.float8_e4m3fn
        self.o8 = torch.empty(shape, dtype=f8, device=device)
        self.stats = torch.empty((self.b, self.h, self.length, 1), dtype=torch.float32,
                                 device=device)
        # Scalars live in a few small buffers so updating all scales is a handful
        # of tiny kernels rather than one chain per scalar.
        self.amax_fwd = torch.zeros(2, dtype=torch.float32, device=device)  # amax_o, amax_s
        self.s_scale = torch.full((1, 1, 1, 1), 256.0, device=device)  # P in [0, 1]
        self.s_descale = 1.0 / self.s_scale
        if train:
            self.dq8, self.dk8, self.dv8 = (torch.empty(shape, dtype=f8, device=device)
                                           for _ in range(3))
            self.bwd_amax = torch.ones(4, dtype=torch.float32, device=device)  # dQ dK dV dP
            self.bwd_scale = torch.ones(4, dtype=torch.float32, device=device)
            self.bwd_descale = torch.ones(4, dtype=torch.float32, device=device)

    # -- scales ---------------------------------------------------------------
    def quantize(self, xs):
        """[(x8, scale(1,1,1,1), descale(1,1,1,1))] with scales from each x's amax."""
        x8, scale, descale = _call("quantize_many", *xs)
        return [(x8[i], scale[i].view(1, 1, 1, 1), descale[i].view(1, 1, 1, 1))
                for i in range(len(xs))]

    def update_bwd_scales(self):
        """Delayed scaling: this call's dQ/dK/dV/dP amaxes set the next call's scales."""
        scale, descale = _call("scales_from_amax", self.bwd_amax)
        self.bwd_scale.copy_(scale)
        self.bwd_descale.copy_(descale)

    # -- graph calls ----------------------------------------------------------
    def forward(self, qs, ks, vs):
        """qs = (q8, scale, descale) etc.; returns descale_o (O's scale is V's)."""
        buf = {
            "q": qs[0], "k": ks[0], "v": vs[0],
            "descale_q": qs[2], "descale_k": ks[2], "descale_v": vs[2],
            "descale_s": self.s_descale, "scale_s": self.s_scale, "scale_o": vs[1],
            "o": self.o8, "stats": self.stats,
            "amax_o": self.amax_fwd[0:1].view(1, 1, 1, 1),
            "amax_s": self.amax_fwd[1:2].view(1, 1, 1, 1),
        }
        self.fwd.graph.execute(self.fwd.pack(buf), self.workspace, handle=self.handle)
        return vs[2]

    def backward(self, qs, ks, vs, descale_o, dos, o8=None, stats=None):
        """``o8``/``stats``: a saved forward's (bwd mode keeps one per input set); default the
        last forward's."""
        sc, de, am = self.bwd_scale, self.bwd_descale, self.bwd_amax

        def s(t, i):
            return t[i:i + 1].view(1, 1, 1, 1)

        buf = {
            "q": qs[0], "k": ks[0], "v": vs[0], "o": self.o8 if o8 is None else o8, "dO": dos[0],
            "stats": self.stats if stats is None else stats,
            "descale_q": qs[2], "descale_k": ks[2], "descale_v": vs[2],
            "descale_o": descale_o, "descale_dO": dos[2],
            "descale_s": self.s_descale, "scale_s": self.s_scale,
            "descale_dP": s(de, 3), "scale_dP": s(sc, 3),
            "scale_dQ": s(sc, 0), "scale_dK": s(sc, 1), "scale_dV": s(sc, 2),
            "dQ": self.dq8, "dK": self.dk8, "dV": self.dv8,
            "amax_dQ": s(am, 0), "amax_dK": s(am, 1), "amax_dV": s(am, 2), "amax_dP": s(am, 3),
        }
        self.bwd.graph.execute(self.bwd.pack(buf), self.workspace, handle=self.handle)

    def calibrate(self, qs, ks, vs, dos):
        """One backward with unit scales to learn the dP/dQ/dK/dV amaxes (the
        amax outputs are taken before the output scale is applied)."""
        self.bwd_scale.fill_(1.0)
        self.bwd_descale.fill_(1.0)
        descale_o = self.forward(qs, ks, vs)
        self.backward(qs, ks, vs, descale_o, dos)
        self.update_bwd_scales()

    def dequant(self, x8s, descales, dtype):
        return _call("dequant_many", tuple(x8s), tuple(descales), dtype)

    def close(self):
        try:
            self.cudnn.destroy_handle(self.handle)
        except Exception:
            pass


def _quantized_sets(r: _Runner, inputs, d_out):
    """(FP8 (codes, scale, descale) triples of every input set, dO's triple or None): quantized once, outside the
    timed calls; with a dO, one backward with unit scales first sets the backward's scales (`calibrate`)."""
    sets = [tuple(r.quantize(list(s))) for s in inputs]
    dos = r.quantize([d_out])[0] if d_out is not None else None
    if dos is not None:
        r.calibrate(*sets[0], dos)
    return sets, dos


def _skip_from(exc: BaseException, what: str) -> PeerSkip:
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    return PeerSkip(f"cuDNN FP8 {what} failed: {type(exc).__name__}: {text}")


class CudnnFp8Adapter(Adapter):
    precision = "fp8"

    def __init__(self, flavour: str):
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
        self.flavour = flavour
        self.name = f"cudnn_fp8_{flavour}"
        self._runner: _Runner | None = None

    @property
    def memory_note(self) -> str:  # type: ignore[override]
        base = "batched (B,H,L,D) view, FP8 copies of q,k,v(,dO) and FP8 outputs counted"
        return base + ("; + BF16 outputs" if self.flavour == "e2e" else "")

    def available(self) -> tuple[bool, str]:
        cudnn, reason = try_import("cudnn")
        if cudnn is None:
            return False, reason
        reason = no_cuda_reason()
        if reason:
            return False, reason
        try:
            cudnn.backend_version()
        except Exception as exc:
            return False, f"not installed: cuDNN library not loadable ({str(exc)[:120]})"
        import torch

        major, minor = torch.cuda.get_device_capability()
        if major < 9:
            return False, f"FP8 SDPA needs sm90 or newer, this GPU is sm{major}{minor}"
        return True, ""

    def supports(self, workload) -> tuple[bool, str]:
        if not workload.equal_docs:
            return False, EQUAL_DOCS_REASON
        if workload.head_dim % 16 or workload.head_dim > 256:
            return False, f"head_dim {workload.head_dim} not supported by FP8 SDPA"
        return True, ""

    def versions(self) -> dict[str, str]:
        out = {}
        v = dist_version("nvidia-cudnn-frontend")
        if v:
            out["nvidia-cudnn-frontend"] = v
        if _FNS:
            out["in-call quantization"] = quant_backend()
        cudnn, _ = try_import("cudnn")
        if cudnn is not None:
            try:
                out["cudnn"] = str(cudnn.backend_version_string())
            except Exception:
                pass
        return out

    def _make_runner(self, workload, train: bool, device) -> _Runner:
        if no_cuda_reason():
            raise RuntimeError(NO_CUDA)
        cudnn, reason = try_import("cudnn")
        if cudnn is None:
            raise PeerSkip(reason)
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        try:
            self._runner = _Runner(cudnn, workload, train, device)
        except PeerSkip:
            raise
        except Exception as exc:
            raise _skip_from(exc, "graph build") from exc
        return self._runner

    def prepare(self, workload, inputs, mode):
        import torch

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        train = mode != "fwd"
        device = inputs[0][0].device
        r = self._make_runner(workload, train, device)
        d_out = fixed_grad_output(inputs[0][0]) if train else None
        out_dtype = inputs[0][0].dtype
        try:
            if mode == "bwd":
                call = self._bwd_call(r, inputs, d_out, out_dtype)
            elif self.flavour == "kernel":
                sets, dos = _quantized_sets(r, inputs, d_out)  # once, outside the timed region
                cyc = itertools.cycle(sets)

                def call():
                    qs, ks, vs = next(cyc)
                    descale_o = r.forward(qs, ks, vs)
                    if train:
                        r.backward(qs, ks, vs, descale_o, dos)
                    return r.o8
            else:
                raw = [tuple(s) for s in inputs]
                if train:
                    qs, ks, vs, dos = r.quantize([*raw[0], d_out])
                    r.calibrate(qs, ks, vs, dos)
                cyc = itertools.cycle(raw)
                e2e = self.flavour == "e2e"

                def call():
                    q, k, v = next(cyc)
                    if train:
                        qs, ks, vs, dos = r.quantize([q, k, v, d_out])
                    else:
                        qs, ks, vs = r.quantize([q, k, v])
                    descale_o = r.forward(qs, ks, vs)
                    if not train:
                        return r.dequant([r.o8], [descale_o], out_dtype) if e2e else r.o8
                    r.backward(qs, ks, vs, descale_o, dos)
                    outs = (r.o8, r.dq8, r.dk8, r.dv8)
                    if e2e:  # one fused conversion of all four outputs
                        outs = r.dequant(outs, (descale_o, *r.bwd_descale.unbind()[:3]),
                                         out_dtype)
                    r.update_bwd_scales()  # delayed scaling for the next call
                    return outs
            call()  # first execution inside the guard: an engine failure is a skip
            torch.cuda.synchronize()
        except PeerSkip:
            raise
        except Exception as exc:
            raise _skip_from(exc, "execution") from exc
        return call

    def _bwd_call(self, r: _Runner, inputs, d_out, out_dtype):
        """The backward call alone. Each set's forward runs once here (its O codes and
        statistics kept); a call runs what the flavour's train call runs after the forward:
        dO's quantization (quant, e2e), the backward graph, the conversion of dQ, dK, dV
        (e2e) and the delayed-scaling update (quant, e2e)."""
        sets, dos_fixed = _quantized_sets(r, inputs, d_out)
        saved = []
        for qs, ks, vs in sets:
            descale_o = r.forward(qs, ks, vs)
            saved.append((qs, ks, vs, descale_o, r.o8.clone(), r.stats.clone()))
        cyc = itertools.cycle(saved)
        kernel, e2e = self.flavour == "kernel", self.flavour == "e2e"

        def call():
            qs, ks, vs, descale_o, o8, stats = next(cyc)
            dos = dos_fixed if kernel else r.quantize([d_out])[0]
            r.backward(qs, ks, vs, descale_o, dos, o8=o8, stats=stats)
            outs = (r.dq8, r.dk8, r.dv8)
            if e2e:
                outs = r.dequant(outs, tuple(r.bwd_descale.unbind()[:3]), out_dtype)
            if not kernel:
                r.update_bwd_scales()
            return outs

        return call

    def compute(self, workload, q, k, v, d_out, need_grad: bool = True):
        """e2e numerics: (o, dq) in float32, dequantized from the FP8 outputs."""
        import torch

        r = self._make_runner(workload, need_grad, q.device)
        try:
            if need_grad:
                qs, ks, vs, dos = r.quantize([q, k, v, d_out])
                r.calibrate(qs, ks, vs, dos)  # sets dQ's scale from this data
                descale_o = r.forward(qs, ks, vs)
                r.backward(qs, ks, vs, descale_o, dos)
                dq = r.dq8.float() * r.bwd_descale[0]
            else:
                qs, ks, vs = r.quantize([q, k, v])
                descale_o = r.forward(qs, ks, vs)
                dq = None
            o = r.o8.float() * descale_o.view(())
            torch.cuda.synchronize()
        except Exception as exc:
            raise _skip_from(exc, "execution") from exc
        return o, dq
