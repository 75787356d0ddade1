"""torch SDPA pinned to one backend (cuDNN or Flash), batched layout.

SDPA has no packed-document mode: equal documents are viewed as a batch
(B, H, L, D) of the packed buffer (no copy); unequal ones would need padding
to the longest document, O(num_docs x max_len) memory, which is what DESIGN §4
avoids, so they are skipped rather than padded.
"""

from __future__ import annotations

from .adapter import (EQUAL_DOCS_REASON, NO_CUDA, Adapter, batched_view, no_cuda_reason,
                      packed_from_batched)


class SdpaAdapter(Adapter):
    precision = "bf16"
    memory_note = ("batched (B,H,L,D) view of the packed buffer: no copy for equal "
                   "documents; unequal ones would need a padded copy (skipped)")

    def __init__(self, name: str, backend: str):
        self.name = name
        self.backend = backend  # SDPBackend member name, e.g. "CUDNN_ATTENTION"

    def _backend(self):
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, self.backend, None)

    def available(self) -> tuple[bool, str]:
        try:
            from torch.nn.attention import sdpa_kernel  # noqa: F401
        except ImportError as exc:
            return False, f"not installed: torch.nn.attention.sdpa_kernel ({exc})"
        if self._backend() is None:
            return False, f"not installed: this torch has no SDPBackend.{self.backend}"
        reason = no_cuda_reason()
        if reason:
            return False, reason
        import torch

        if self.backend == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
            return False, "not installed: torch was built without cuDNN"
        return True, ""

    def supports(self, workload) -> tuple[bool, str]:
        if not workload.equal_docs:
            return False, EQUAL_DOCS_REASON
        return True, ""

    def versions(self) -> dict[str, str]:
        import torch

        out = {"torch": torch.__version__}
        if self.backend == "CUDNN_ATTENTION" and torch.backends.cudnn.is_available():
            out["cudnn"] = str(torch.backends.cudnn.version())
        return out

    def build(self, workload):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        if no_cuda_reason():
            raise RuntimeError(NO_CUDA)
        backend = self._backend()
        causal = workload.causal

        def f(q, k, v):
            # Pinning one backend: SDPA raises instead of silently falling back
            # to the math kernel, so a row is always the backend it names.
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(
                    batched_view(q, workload), batched_view(k, workload),
                    batched_view(v, workload), is_causal=causal)
            return packed_from_batched(o, workload)

        return f
