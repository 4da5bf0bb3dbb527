"""Sparse attention with sink on flat tensors: FlashMLA-convention forward, cuDNN-convention backward.

``flash_mla_forward`` is Megatron's ``_csa_fwd_flash_mla`` adapter (pad the index width to the kernel alignment with
``-1``, add the ``h_kv = 1`` axis); :class:`SparseAttnFunc` is ``CSASparseAttnFunc`` (Paths A and C), with the
padding-row handling of Path B applied in every path: a padding row's ``dO`` and ``lse`` are masked before the
backward kernel, so it sends no gradient anywhere, and under compaction it keeps one placeholder slot.

The mask is ``dO = 0`` and ``lse = +inf``: ``+inf`` is the kernels' own "no probability mass" value (the FlashMLA
forward returns it for a row without keys; the cuDNN backward maps it to ``P = 0`` and ``p_sink = 0``), so the row's
logits never reach an ``exp`` unbounded. A finite mask value (0) leaves ``exp(logit - 0)``, which overflows on large
padding rows (core scope: their q / kv are arbitrary), and ``0 · inf = NaN`` reaches the real gradients.
"""

from __future__ import annotations

from typing import Optional

import torch

from .plan import current_plan, kernels

Tensor = torch.Tensor


def flash_mla_forward(q: Tensor, kv: Tensor, indices: Tensor, scale: float, sink: Tensor,
                      topk_length: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``q (rows, n, D)``, ``kv (n_kv, D)``, int32 global ``indices (rows, K)`` -> ``(out (rows, n, D),
    lse (rows, n))``.

    ``lse`` is KV-only (no sink) and ``+inf`` on rows without a valid key.
    """
    align = current_plan().topk_alignment()
    width = indices.shape[-1]
    padded = -(-max(width, 1) // align) * align
    if padded != width:
        indices = torch.nn.functional.pad(indices, (0, padded - width), value=-1)
    out, _max_logits, lse = kernels.sparse_attn_fwd(q, kv.unsqueeze(1), indices.unsqueeze(1), scale, d_v=q.shape[-1],
                                                    attn_sink=sink, topk_length=topk_length, indexer_topk=0)
    return out, lse


def sparse_attention_backward(q: Tensor, kv: Tensor, out: Tensor, d_out: Tensor, lse: Tensor, sink: Tensor,
                              indices: Tensor, scale: float, topk_length: Optional[Tensor],
                              padding_rows: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dkv, d_sink`` from the backward kernel; padding rows' ``dO`` zeroed and ``lse`` set to ``+inf`` first
    (module docstring): they then contribute exactly 0 to every gradient."""
    d_out, lse = mask_padding_rows(d_out.contiguous(), lse, padding_rows)
    res = kernels.sparse_attn_bwd(q, kv, out, d_out, lse, sink, indices, softmax_scale=scale, topk_length=topk_length)
    return res["dq"], res["dkv"], res["d_sink"].to(sink.dtype)


def mask_padding_rows(d_out: Tensor, lse: Tensor, padding_rows: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``dO (rows, n, D)`` zeroed and ``lse (rows, n)`` set to ``+inf`` on padding rows (module docstring): the
    backward kernel then sends no gradient from them."""
    if padding_rows is None:
        return d_out, lse
    return (d_out.masked_fill(padding_rows.view(-1, 1, 1), 0),
            lse.masked_fill(padding_rows.view(-1, 1), float("inf")))


def compact(indices: Tensor) -> tuple[Tensor, Tensor]:
    """Valid ids to a per-row prefix and ``topk_length`` (``compactify``)."""
    res = kernels.compactify(indices.int().contiguous())
    return res["indices"], res["topk_length"]


def backward_index_state(indices: Tensor, topk_length: Optional[Tensor],
                         padding_rows: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """What the backward kernel gets after the forward consumed the compact ids: the ignored ``-1`` suffix made
    non-negative, and padding rows reduced to one placeholder slot (the kernel needs a non-empty row; their masked
    ``dO`` / ``lse`` make it contribute nothing)."""
    if topk_length is None:
        return indices, None
    if padding_rows is not None:
        topk_length = topk_length.masked_fill(padding_rows, 1)
    return indices.clamp_min(0), topk_length


class SparseAttnFunc(torch.autograd.Function):
    """Sparse attention over flat-global ``indices`` (Paths A and C).

    Forward ``(q (rows,n,D), kv (n_kv,D), sink (n,), indices (rows,K) int32, topk_length or None, scale,
    padding_rows or None)`` -> ``(out (rows,n,D), lse (rows,n))``; ``lse`` carries no gradient.
    """

    @staticmethod
    def forward(ctx, q, kv, sink, indices, topk_length, scale, padding_rows):
        out, lse = flash_mla_forward(q, kv, indices, scale, sink, topk_length)
        indices, topk_length = backward_index_state(indices, topk_length, padding_rows)
        ctx.save_for_backward(q, kv, sink, indices, out, lse)
        ctx.topk_length, ctx.scale, ctx.padding_rows = topk_length, scale, padding_rows
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, kv, sink, indices, out, lse = ctx.saved_tensors
        dq, dkv, d_sink = sparse_attention_backward(q, kv, out, d_out, lse, sink, indices, ctx.scale,
                                                    ctx.topk_length, ctx.padding_rows)
        return dq, dkv, d_sink, None, None, None, None
