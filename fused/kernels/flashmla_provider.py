"""``flashmla`` provider: the sparse attention forward, ``flash_mla.flash_mla_sparse_fwd`` (sgl-flash-mla 1.0.0).

On sm90 the Hopper kernels live in the package's *legacy* op namespace (``use_legacy=True``, ``_C_legacy``); on
sm100 the current kernels run. Around the call, as Megatron's ``_csa_fwd_flash_mla`` / ``_flash_mla_head_padding``:

* heads: the kernel takes ``h_q`` in {64, 128}. sm90 pads a head count below 64 that divides 64 up to 64 (a
  multiple of 64 up to 128 runs as is); sm100 pads to 64 or 128 when the count divides it. Padded heads get zero
  queries and a ``-inf`` sink; their rows are sliced off ``out`` / ``max_logits`` / ``lse``.
* index width: padded with ``-1`` to a multiple of :attr:`FlashMLAKernels.topk_alignment` (128 on sm90, 64 on
  sm100; the kernel's ``B_TOPK`` tile is 64).

sgl-flash-mla has no ``indexer_topk`` argument (Megatron's ``nv_dev`` build does); a call with ``indexer_topk != 0``
is declined. The wheel declares ``torch>=2.14.1`` but loads on torch 2.11 through torch's stable ABI.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import KernelSet
from .device_support import (cuda_unavailable_reason, device_major, dtype_reason, first_reason, on_device,
                             pad_dim, placement_reason, round_up)

HEAD_DIMS_QK = (512, 576)
HEAD_DIM_V = 512
TOPK_ALIGNMENT = {9: 128, 10: 64}


def _flash_mla():
    import flash_mla  # noqa: PLC0415 - optional dependency, imported on first use
    return flash_mla


def padded_heads(heads: int, major: int) -> Optional[int]:
    """Query-head count the kernel runs for ``heads`` on this architecture, or None (unsupported)."""
    if major >= 10:
        for target in (64, 128):
            if heads == target or (heads < target and target % heads == 0):
                return target
        return None
    if heads % 64 == 0:
        return heads if heads <= 128 else None
    return 64 if heads < 64 and 64 % heads == 0 else None


class FlashMLAKernels(KernelSet):
    """FlashMLA sparse prefill forward with the production head / index padding."""

    name = "flashmla"
    stages = frozenset({"sparse_attn_fwd"})

    def __init__(self):
        major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
        self.topk_alignment = TOPK_ALIGNMENT.get(major, 128)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        reason = cuda_unavailable_reason()
        if reason is not None:
            return reason
        try:
            fm = _flash_mla()
            fm.flash_mla_sparse_fwd  # noqa: B018
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
            return f"flash_mla cannot be imported: {type(exc).__name__}: {exc}"
        if torch.cuda.get_device_capability()[0] == 9 and not fm.has_legacy():
            return "flash_mla has no legacy (sm90) kernels in this build (flash_mla.has_legacy() is False)"
        return None

    @staticmethod
    def versions() -> dict[str, Any]:
        fm = _flash_mla()
        return {"flash_mla": getattr(fm, "__version__", None), "flash_mla_legacy": bool(fm.has_legacy())}

    def support_sparse_attn_fwd(self, a: dict) -> Optional[str]:
        q, kv, indices = a["q"], a["kv"], a["indices"]
        reason = first_reason(placement_reason(q, kv, indices, a["attn_sink"], a["topk_length"]),
                              dtype_reason("q", q, (torch.bfloat16,)), dtype_reason("kv", kv, (torch.bfloat16,)),
                              dtype_reason("attn_sink", a["attn_sink"], (torch.float32,)))
        if reason:
            return reason
        if q.shape[-1] not in HEAD_DIMS_QK or a["d_v"] != HEAD_DIM_V:
            return f"d_qk must be one of {HEAD_DIMS_QK} and d_v {HEAD_DIM_V}, got {q.shape[-1]} / {a['d_v']}"
        if kv.shape[1] != 1:
            return f"h_kv must be 1, got {kv.shape[1]}"
        if padded_heads(q.shape[1], device_major(q)) is None:
            return f"no FlashMLA head padding for h_q = {q.shape[1]} on sm{device_major(q)}x"
        if a["indexer_topk"]:
            return "sgl-flash-mla has no indexer_topk argument (nv_dev-only)"
        if q.shape[0] == 0 or kv.shape[0] == 0 or indices.shape[-1] == 0:
            return "empty query, key or index buffer"
        return None

    def sparse_attn_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, indexer_topk=0):
        if indexer_topk:
            raise NotImplementedError("sgl-flash-mla has no indexer_topk argument")
        major = device_major(q)
        heads = q.shape[1]
        padded = padded_heads(heads, major)
        if padded is None:
            raise NotImplementedError(f"FlashMLA sparse forward has no head padding for h_q = {heads}")
        if padded != heads:
            q = pad_dim(q, 1, padded)
            if attn_sink is not None:
                attn_sink = pad_dim(attn_sink, 0, padded, float("-inf"))
        width = round_up(max(indices.shape[-1], 1), self.topk_alignment)
        indices = pad_dim(indices, 2, width, -1)
        with on_device(q):
            out, max_logits, lse = _flash_mla().flash_mla_sparse_fwd(
                q.contiguous(), kv.contiguous(), indices.contiguous(), sm_scale, d_v=d_v, attn_sink=attn_sink,
                topk_length=topk_length, use_legacy=major == 9)
        if padded != heads:
            out, max_logits, lse = (t[:, :heads].contiguous() for t in (out, max_logits, lse))
        return out, max_logits, lse
