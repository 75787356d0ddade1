"""FlexAttention with a document-causal BlockMask, packed as batch 1.

The mask is built from the document id of every token, so FlexAttention skips
whole blocks across documents and above the diagonal. flex_attention only runs
fast when compiled, so the compiled function is used for timing (the first
call per shape compiles; the harness's warm-up absorbs it).
"""

from __future__ import annotations

import inspect

from .adapter import NO_CUDA, Adapter, PeerSkip, no_cuda_reason

BLOCK_SIZE = 128
# The BlockMask keeps, per (query block, kv block), int32 indices in both
# orientations plus full-block copies: about 4 tables of (T/128)^2 int32.
# Above this the mask alone costs more than the attention's inputs.
DEFAULT_MAX_BLOCK_MASK_BYTES = 2 * 1024**3

_COMPILED = {}


def block_mask_bytes(total_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    n = -(-total_tokens // block_size)
    return 4 * n * n * 4


def _compiled_flex():
    if "flex" not in _COMPILED:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


class FlexAdapter(Adapter):
    name = "flex"
    precision = "bf16"

    memory_note = ("packed (1,H,T,D) view, no padding; counts the document-causal "
                   "BlockMask (~16*(T/128)^2 bytes)")

    def __init__(self, max_block_mask_bytes: int = DEFAULT_MAX_BLOCK_MASK_BYTES):
        self.max_block_mask_bytes = max_block_mask_bytes
        self._mask_cache: dict = {}

    def available(self) -> tuple[bool, str]:
        try:
            from torch.nn.attention.flex_attention import (create_block_mask,  # noqa: F401
                                                           flex_attention)
        except ImportError as exc:
            return False, f"not installed: torch.nn.attention.flex_attention ({exc})"
        reason = no_cuda_reason()
        return (reason is None), (reason or "")

    def supports(self, workload) -> tuple[bool, str]:
        need = block_mask_bytes(workload.total_tokens)
        if need > self.max_block_mask_bytes:
            return False, (f"block mask too big: ~{need / 2**20:.0f} MiB for T={workload.total_tokens} "
                           f"(limit {self.max_block_mask_bytes / 2**20:.0f} MiB)")
        return True, ""

    def versions(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__}

    def block_mask(self, workload, device):
        key = (workload.name, tuple(workload.doc_lens) if workload.num_docs < 4096 else
               (workload.num_docs, workload.total_tokens), str(device))
        if key in self._mask_cache:
            return self._mask_cache[key]
        from torch.nn.attention.flex_attention import create_block_mask

        doc = workload.doc_ids(device)
        causal = workload.causal

        def doc_causal(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return (same & (q_idx >= kv_idx)) if causal else same

        kwargs = {}
        # _compile=True builds the mask without materialising the T x T grid
        # (T = 131072 would be 17 GB of bools otherwise).
        if "_compile" in inspect.signature(create_block_mask).parameters:
            kwargs["_compile"] = True
        t = workload.total_tokens
        try:
            mask = create_block_mask(doc_causal, B=None, H=None, Q_LEN=t, KV_LEN=t,
                                     device=device, BLOCK_SIZE=BLOCK_SIZE, **kwargs)
        except Exception as exc:  # report, don't crash (e.g. out of memory)
            raise PeerSkip(f"create_block_mask failed: {str(exc).splitlines()[0][:200]}") from exc
        self._mask_cache = {key: mask}  # keep one: masks of long rows are large
        return mask

    def build(self, workload):
        if no_cuda_reason():
            raise RuntimeError(NO_CUDA)
        flex = _compiled_flex()
        mask = None

        def f(q, k, v):
            nonlocal mask
            if mask is None:
                mask = self.block_mask(workload, q.device)
            t, h, d = q.shape
            # (T, H, D) -> (1, H, T, D) view: packed documents as one batch row.
            qb, kb, vb = (x.view(1, t, h, d).transpose(1, 2) for x in (q, k, v))
            o = flex(qb, kb, vb, block_mask=mask)
            return o.transpose(1, 2).reshape(t, h, d)

        return f

    def prepare(self, workload, inputs, mode):
        # Build the mask here so its memory counts as the adapter's and its
        # construction time stays out of the timed calls.
        call = super().prepare(workload, inputs, mode)
        self.block_mask(workload, inputs[0][0].device)
        return call
