"""The lightning indexer: eager projections (``CSAIndexer.forward_before_topk``) and the kernel pipeline of
``_indexer_topk_core`` (indexer-forward scores, radix top-k, ``-1`` padding to ``K``).

Layouts: SBHD inputs ``[S, B, ...]`` are permuted once to BSHD for the kernels (as production does); THD inputs
``[T, ...]`` go to the kernels' THD form with ``cu_seqlens`` and host ``max_seqlen``.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from cases.config import ModelConfig
from cases.errors import CaseError
from cases.layout import PackedSeqParams

from . import ops
from .compressor import compress_sbhd, compress_thd
from .plan import kernels
from .rows import RowSpace
from .thd import ThdMeta

Tensor = torch.Tensor
PREFIX = "core_attention.indexer"


def indexer_inputs(x: Tensor, qr: Tensor, params: Mapping[str, Tensor], config: ModelConfig, positions: Tensor,
                   thd: Optional[ThdMeta]) -> tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]:
    """``(q_I, k_I, w, cu_comp)`` from the **detached** layer input ``x`` and query latent ``qr``.

    SBHD: ``q_I (S,B,nI,dI)``, ``k_I (S//4,B,dI)`` or None, ``w (S,B,nI)``. THD: ``q_I (T,nI,dI)``,
    ``k_I (rows,dI)`` or None, ``w (T,nI)``, ``cu_comp``. ``positions`` broadcasts against ``q_I.shape[:-1]``.
    ``w`` carries ``nI**-0.5`` but not the indexer softmax scale.
    """
    c = config
    n_heads, head_dim = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
    q = ops.linear(qr, params[f"{PREFIX}.linear_wq_b.weight"])
    q = q.view(q.shape[:-1] + (n_heads, head_dim))
    q = ops.hadamard(ops.apply_rope(q, positions, c))
    if thd is None:
        k, cu_comp = compress_sbhd(x, params, f"{PREFIX}.compressor", c, 4, rotate=True), None
    else:
        k, cu_comp = compress_thd(x, params, f"{PREFIX}.compressor", c, 4, thd.compressor_boundaries(),
                                  thd.capacity, rotate=True)
    w = ops.linear(x, params[f"{PREFIX}.linear_weights_proj.weight"]) * n_heads ** -0.5
    return q, k, w, cu_comp


def fold_indexer_scale(w: Tensor, scale: float) -> Tensor:
    """``relu(c x) = c relu(x)``: production multiplies the indexer softmax scale into the (small) weights."""
    return (w.to(ops.compute_dtype(w.dtype)) * scale).to(w.dtype)


def select_topk(q: Tensor, k: Tensor, w_scaled: Tensor, topk: int, ratio: int, rows: RowSpace,
                cu_comp: Optional[Tensor], max_comp: int) -> tuple[Tensor, Tensor, Tensor]:
    """``_indexer_topk_core``: ``(topk_ids int32, scores, visible)``.

    BSHD (``q (B,S,nI,dI)``, ``k (B,n_comp,dI)``, ``w (B,S,nI)``): ids ``(B,S,K)``, scores ``(B,S,n_comp)``.
    THD (``q (T,nI,dI)``, ``k (rows,dI)``, ``w (T,nI)``): ids ``(T,K)``, scores ``(T,max_comp)``. Ids are local
    compressed ids, slot order as the top-k kernel returns them, ``-1`` padded to ``K``; ``visible`` (int32) is
    :meth:`RowSpace.visible`.
    """
    if not rows.is_thd:
        batch, seqlen = q.shape[:2]
        n_keys = k.shape[1]
        scores = kernels.indexer_forward(q, k.unsqueeze(2), w_scaled, ratio=ratio)["scores"]
        flat = scores.reshape(batch * seqlen, n_keys).contiguous()
    else:
        n_keys = max_comp
        scores = kernels.indexer_forward(q, k.unsqueeze(1), w_scaled, ratio=ratio,
                                         **rows.kernel_kwargs(cu_comp, max_comp))["scores"]
        flat = scores.contiguous()
    visible = rows.visible(ratio, n_keys, cu_comp).int()
    width = min(topk, n_keys)
    ids = kernels.indexer_top_k(flat, visible, top_k=width, next_n=1, return_val=False)["indices"]
    if width < topk:
        ids = pad_topk(ids, topk)
    if rows.is_thd:  # keep only in-range, finite selections (production's THD post-filter)
        ok = (ids >= 0) & (ids < visible.unsqueeze(-1))
        picked = torch.gather(flat, 1, ids.clamp(0, max(n_keys - 1, 0)).long()) if n_keys else flat.new_zeros(ids.shape)
        ids = ids.masked_fill(~(ok & torch.isfinite(picked)), -1)
    return (ids if rows.is_thd else ids.view(batch, seqlen, topk)).int(), scores, visible


def pad_topk(ids: Tensor, topk: int) -> Tensor:
    """``(rows, width)`` ids of a row set with fewer than ``K`` compressed keys, padded to width ``K`` with ``-1``
    (empty slots, never a key id)."""
    return torch.cat([ids, ids.new_full((ids.shape[0], topk - ids.shape[1]), -1)], dim=-1)


def mask_split_topk(given: Tensor, visible: Tensor, topk: int) -> Tensor:
    """Split mode: caller-supplied local ids, kept only where causally valid, ``-1`` padded to width ``K``."""
    ids = given.reshape(-1, given.shape[-1]).long()
    ids = torch.where((ids >= 0) & (ids < visible.long().unsqueeze(-1)), ids, -1)
    if ids.shape[-1] < topk:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], topk - ids.shape[-1]), -1)], dim=-1)
    return ids.view(given.shape[:-1] + (ids.shape[-1],)).int()


def public_topk(ids: Tensor) -> Tensor:
    """Public convention: int64, ascending, ``-1`` padding at the end (the top-k kernel's slot order is arbitrary).

    Sorted as int32 (ids are int32 kernel ids), half the bytes of an int64 sort, widened afterwards."""
    ids = ids.int()
    big = torch.iinfo(torch.int32).max
    ordered = torch.sort(ids.masked_fill(ids < 0, big), dim=-1).values
    return ordered.masked_fill(ordered == big, -1).long()


# ---- public API -----------------------------------------------------------------------------------------------------
def indexer(hidden: torch.Tensor, q_latent: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
            packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index_scores, topk_indices)``: BSHD ``[B,S,n_comp]`` / ``[B,S,K]``, THD ``[T, max_seqlen//4]`` / ``[T,K]``
    (scores fp32, float64 in float64 mode, ``-inf`` where not causally valid; ids int64 ascending, ``-1`` padded)."""
    if not config.has_indexer:
        raise CaseError("config", "this layer has no indexer (compress_ratio 4 outside dense mode only)")
    c = config
    thd = None if packed_seq_params is None else ThdMeta.from_params(packed_seq_params, hidden.shape[0])
    if thd is None:
        x, qr = hidden.detach().transpose(0, 1), q_latent.detach().transpose(0, 1)
        positions = torch.arange(x.shape[0], device=x.device).view(-1, 1, 1)
        rows = RowSpace.sbhd(x.shape[0], x.shape[1], x.device)
    else:
        x, qr = hidden.detach(), q_latent.detach()
        positions = thd.positions().view(-1, 1)
        rows = RowSpace.packed(thd)
    q, k, w, cu_comp = indexer_inputs(x, qr, params, c, positions, thd)
    w = fold_indexer_scale(w, c.indexer_softmax_scale)
    max_comp = thd.max_seqlen // 4 if thd is not None else (0 if k is None else k.shape[0])
    if k is None or max_comp == 0:
        return empty_indexer_outputs(x, c, thd, max_comp)
    if thd is None:
        q, k, w = (t.transpose(0, 1).contiguous() for t in (q, k, w))
    ids, scores, _ = select_topk(q, k, w, c.dsa_indexer_topk, 4, rows, cu_comp, max_comp)
    return scores, public_topk(ids)


def empty_indexer_outputs(x: Tensor, config: ModelConfig, thd: Optional[ThdMeta], width: int) -> tuple[Tensor, Tensor]:
    """No compressed key anywhere: scores with ``width`` (0) columns and all ``-1`` ids."""
    rows = (thd.total,) if thd is not None else (x.shape[1], x.shape[0])
    dtype = ops.compute_dtype(x.dtype)
    scores = torch.full(rows + (width,), float("-inf"), dtype=dtype, device=x.device)
    ids = torch.full(rows + (config.dsa_indexer_topk,), -1, dtype=torch.int64, device=x.device)
    return scores, ids
