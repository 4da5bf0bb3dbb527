"""Core attention as the fused production path composes it (``CompressedSparseAttention.forward`` /
``_forward_thd`` with ``use_fused_kernels``): compressor, ``kv_full``, index lists, and one of three paths.

* **Path A** — no indexer, or no compressed key anywhere: window (+ every causal compressed key for r = 128 and
  dense mode) as flat-global ids, no compaction (the kernel skips ``-1`` itself).
* **Path B** — indexer, training: :class:`fused.indexer_loss.IndexerSparseAttnFunc`.
* **Path C** — indexer, eval: indexer top-k (no loss), ids ``[window | compressed]`` compacted, ``topk_length``.

BSHD public tensors run in production's SBHD layout internally (``[S, B, ...]``, FlashMLA rows ``s*B + b``); THD
tensors run packed, ``kv_full`` being the per-segment concatenation with capacity tail slots (spec §6.2-§6.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from cases.config import ModelConfig
from cases.errors import CaseError
from cases.layout import PackedSeqParams
from cases.outputs import AttentionOutput
from cases.selection import check_topk_selection

from . import ops
from .compressor import compress_sbhd, compress_thd
from .index_maps import cat_per_segment, cu_seqlens_kv_full
from .indexer import fold_indexer_scale, indexer_inputs, mask_split_topk, public_topk, select_topk
from .indexer_loss import IndexerSparseAttnFunc, LossSpec
from .rows import RowSpace
from .sparse_attention import SparseAttnFunc, compact
from .thd import ThdMeta

Tensor = torch.Tensor
ATTENTION_COMPRESSOR = "core_attention.compressor"


@dataclass
class CoreResult:
    """``out`` SBHD ``(S,B,n,D)`` / THD ``(T,n,D)``; ``lse`` flat ``(rows, n)`` in the kernel convention (``+inf`` for
    a row without keys); ``loss`` 0-d or None; ``topk`` ``(B,S,K)`` / ``(T,K)`` int32 and ``scores`` (indexer
    layers)."""

    out: Tensor
    lse: Tensor
    loss: Optional[Tensor] = None
    topk: Optional[Tensor] = None
    scores: Optional[Tensor] = None


class _ZeroIndexerLoss(torch.autograd.Function):
    """The loss of an indexer layer in training when no row can see a compressed key: exactly 0, and (like the fused
    path's precomputed indexer gradients) exactly-zero gradients for the indexer inputs it is given."""

    @staticmethod
    def forward(ctx, dtype_like, *inputs):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return torch.zeros((), dtype=dtype_like.dtype, device=dtype_like.device)

    @staticmethod
    def backward(ctx, _grad):
        return (None,) + tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes)


def indexer_branch_inputs(x: Tensor, qr: Tensor) -> tuple[Tensor, Tensor]:
    """The indexer's inputs, cut from the attention graph: only the KL loss trains the indexer, and its gradient
    never reaches the attention branch (spec §5)."""
    return x.detach(), qr.detach()


def run_core(q: Tensor, kv: Tensor, x: Tensor, qr: Tensor, params: Mapping[str, Tensor], config: ModelConfig,
             rows: RowSpace, training: bool, split_topk: Optional[Tensor], positions: Tensor) -> CoreResult:
    """Core attention on SBHD ``q (S,B,n,D)``, ``kv (S,B,D)``, ``x (S,B,Hd)``, ``qr (S,B,Rq)`` or THD ``(T, ...)``,
    whose flat query rows are ``rows``.

    ``positions`` broadcasts against the indexer query's leading dims (``(S,1,1)`` / ``(T,1)``).
    """
    c = config
    r, window, scale = c.compress_ratio, c.csa_window_size, c.softmax_scale
    sink = params["core_attention.attn_sink"]
    thd, padding = rows.thd, rows.padding
    n, d = q.shape[-2:]
    if thd is None:
        comp = compress_sbhd(x, params, ATTENTION_COMPRESSOR, c, r, rotate=False) if r > 1 else None
        kv_full = kv if comp is None else torch.cat([kv, comp], dim=0)
        max_comp = 0 if comp is None else comp.shape[0]
        cu_comp = cu_full = None
        q_flat, kv_flat = q.reshape(rows.rows, n, d), kv_full.reshape(-1, d)
    else:
        if r > 1:
            comp, cu_comp = compress_thd(x, params, ATTENTION_COMPRESSOR, c, r, thd.compressor_boundaries(),
                                         thd.capacity, rotate=False)
        else:
            comp, cu_comp = None, torch.zeros_like(thd.cu)
        cu_full = cu_seqlens_kv_full(thd.cu, cu_comp)
        kv_full = cat_per_segment(kv, comp, thd.cu, cu_comp, cu_full, rows.segment)
        max_comp = thd.max_seqlen // r if (r > 1 and comp is not None) else 0
        q_flat, kv_flat = q, kv_full
    window_ids = rows.window_ids(window)

    def to_global(local: Tensor) -> Tensor:
        return rows.to_global(local, cu_full)

    def unflatten(out_flat: Tensor) -> Tensor:
        return out_flat.view(q.shape)

    has_keys = comp is not None and max_comp > 0
    if c.has_indexer and (has_keys or training):
        q_i, k_i, w_i, cu_comp_i = indexer_inputs(*indexer_branch_inputs(x, qr), params, c, positions, thd)

    if not (c.has_indexer and has_keys):  # ---- Path A ----------------------------------------------------------
        parts = [window_ids]
        if has_keys:
            parts.append(rows.compressed_ids(r, cu_comp, max_comp))
        out_flat, lse = SparseAttnFunc.apply(q_flat, kv_flat, sink, to_global(torch.cat(parts, -1)), None, scale,
                                             padding)
        res = CoreResult(unflatten(out_flat), lse)
        if c.has_indexer:
            res.topk, res.scores = _empty_indexer(q, thd, c, max_comp)
            if training:
                inputs = [t for t in (q_i, w_i, k_i) if t is not None and t.requires_grad]
                res.loss = _ZeroIndexerLoss.apply(res.scores, *inputs)
        return res

    if training:  # ---- Path B ----------------------------------------------------------------------------------
        spec = LossSpec(topk=c.dsa_indexer_topk, ratio=r, scale=scale, indexer_scale=c.indexer_softmax_scale,
                        coeff=float(c.dsa_indexer_loss_coeff), sparse=c.dsa_indexer_use_sparse_loss,
                        per_token=c.calculate_per_token_loss,
                        real_rows=rows.rows if thd is None else thd.real_row_count(), rows=rows,
                        cu_kv_full=cu_full, cu_comp=cu_comp_i, max_comp=max_comp)
        out, loss, lse, topk, scores = IndexerSparseAttnFunc.apply(q, kv_full, sink, window_ids, q_i, k_i, w_i,
                                                                   comp if thd is not None else None, spec, split_topk)
        return CoreResult(out, lse, loss, topk, scores)

    # ---- Path C ---------------------------------------------------------------------------------------------------
    if thd is None:
        q_i, k_i, w_i = q_i.permute(1, 0, 2, 3).contiguous(), k_i.permute(1, 0, 2).contiguous(), \
            w_i.permute(1, 0, 2).contiguous()
    topk, scores, visible = select_topk(q_i, k_i, fold_indexer_scale(w_i, c.indexer_softmax_scale), c.dsa_indexer_topk,
                                        r, rows, cu_comp_i, max_comp)
    used = topk if split_topk is None else mask_split_topk(split_topk, visible, c.dsa_indexer_topk)
    comp_ids = torch.where(used >= 0, used + rows.compressed_offset(), -1).int()
    idx, length = compact(to_global(torch.cat([window_ids, comp_ids], -1)))
    out_flat, lse = SparseAttnFunc.apply(q_flat, kv_flat, sink, idx, length, scale, padding)
    return CoreResult(unflatten(out_flat), lse, None, topk, scores)


def _empty_indexer(q: Tensor, thd: Optional[ThdMeta], config: ModelConfig, width: int) -> tuple[Tensor, Tensor]:
    lead = (q.shape[1], q.shape[0]) if thd is None else (q.shape[0],)
    scores = torch.full(lead + (width,), float("-inf"), dtype=ops.compute_dtype(q.dtype), device=q.device)
    return torch.full(lead + (config.dsa_indexer_topk,), -1, dtype=torch.int32, device=q.device), scores


def public_lse(lse_flat: Tensor, q: Tensor, thd: Optional[ThdMeta]) -> Tensor:
    """Kernel LSE ``(rows, n)`` -> public ``[B,S,n]`` / ``[T,n]`` with ``-inf`` (not ``+inf``) on rows without keys."""
    lse = lse_flat.masked_fill(torch.isposinf(lse_flat), float("-inf"))
    if thd is None:
        seqlen, batch, n = q.shape[:3]
        lse = lse.view(seqlen, batch, n).transpose(0, 1)
    return lse


def public_output(res: CoreResult, out: Tensor, q: Tensor, thd: Optional[ThdMeta]) -> AttentionOutput:
    return AttentionOutput(out=out, lse=public_lse(res.lse, q, thd), indexer_loss=res.loss,
                           topk_indices=None if res.topk is None else public_topk(res.topk),
                           index_scores=res.scores)


def _check_core_inputs(query, kv, hidden, q_latent, config: ModelConfig, packed: bool) -> tuple:
    c = config
    lead = tuple(query.shape[:1] if packed else query.shape[:2])
    layout = "THD [T, ...]" if packed else "BSHD [B, S, ...]"
    for name, t, tail in (("query", query, (c.num_attention_heads, c.v_head_dim)), ("kv", kv, (c.v_head_dim,)),
                          ("hidden", hidden, (c.hidden_size,)), ("q_latent", q_latent, (c.q_lora_rank,))):
        if tuple(t.shape) != lead + tail:
            raise CaseError(name, f"has shape {tuple(t.shape)}, expected {lead + tail} ({layout})")
    return lead


# ---- public API -----------------------------------------------------------------------------------------------
def core_attention(query: torch.Tensor, kv: torch.Tensor, hidden: torch.Tensor, q_latent: torch.Tensor,
                   params: Mapping[str, torch.Tensor], config: ModelConfig,
                   packed_seq_params: Optional[PackedSeqParams] = None, *, training: bool = True,
                   topk_indices: Optional[torch.Tensor] = None) -> AttentionOutput:
    """Core attention (spec §1.5) on roped, normalised ``query [.., n, D]`` and ``kv [.., D]`` plus ``hidden`` and
    ``q_latent``; BSHD ``[B, S, ...]`` or THD ``[T, ...]``. Returns ``out [.., n, D]`` (before inverse RoPE)."""
    packed = packed_seq_params is not None
    lead = _check_core_inputs(query, kv, hidden, q_latent, config, packed)
    check_topk_selection(topk_indices, config, lead, packed_seq_params)
    if packed:
        thd = ThdMeta.from_params(packed_seq_params, query.shape[0])
        q, k, x, qr = query, kv, hidden, q_latent
        positions = thd.positions().view(-1, 1)
        rows = RowSpace.packed(thd)
    else:
        thd = None
        q, k, x, qr = (t.transpose(0, 1) for t in (query, kv, hidden, q_latent))
        positions = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1)
        rows = RowSpace.sbhd(q.shape[0], q.shape[1], q.device)
    res = run_core(q, k, x, qr, params, config, rows, training, topk_indices, positions)
    out = res.out if packed else res.out.transpose(0, 1)
    return public_output(res, out, q, thd)


def compressor(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], prefix: str, config: ModelConfig,
               packed_seq_params: Optional[PackedSeqParams] = None, *, rotate: bool = False) -> torch.Tensor:
    """The compressor ``prefix`` on ``hidden``: BSHD ``[B, S//r, d]``; THD ``[rows, d]`` (rows = the capacity if set,
    else the true count; rows past the true count are unspecified)."""
    if prefix not in ("core_attention.compressor", "core_attention.indexer.compressor"):
        raise CaseError("prefix", f"must be 'core_attention.compressor' or 'core_attention.indexer.compressor', "
                                  f"got {prefix!r}")
    ratio = 4 if prefix == "core_attention.indexer.compressor" else config.compress_ratio
    if ratio <= 1:
        raise CaseError("config.compress_ratio", f"a compressor needs ratio 4 or 128, got {config.compress_ratio}")
    head_dim = params[f"{prefix}.norm.weight"].shape[0]
    if packed_seq_params is not None:
        thd = ThdMeta.from_params(packed_seq_params, hidden.shape[0])
        out, _ = compress_thd(hidden, params, prefix, config, ratio, thd.compressor_boundaries(), thd.capacity,
                              rotate=rotate)
        return out if out is not None else hidden.new_zeros((0, head_dim))
    out = compress_sbhd(hidden.transpose(0, 1), params, prefix, config, ratio, rotate=rotate)
    if out is None:
        return hidden.new_zeros((hidden.shape[0], 0, head_dim))
    return out.transpose(0, 1)
