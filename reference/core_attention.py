"""Core attention (spec §1.5): everything between the roped, normalised q / kv and the inverse RoPE.

Per sequence: the attention compressor's entries ``c`` (r > 1), ``kv_full = [kv; c]``, the indexer and its top-k
(r = 4), the key sets ``window(i) ∪ Cmp(i)`` and the sink softmax (spec §4), and in training the indexer KL loss
(spec §5). BSHD runs the sequence math batched; THD runs it on each padded segment and places the rows back
(:mod:`reference.thd`), taking the compressed entries from the capacity-padded packed buffer as production does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from cases.config import INDEXER_RATIO, ModelConfig
from cases.errors import CaseError
from cases.layout import PackedSeqParams
from cases.outputs import AttentionOutput
from cases.selection import check_topk_selection

from . import activation, thd
from .compressor import ATTENTION_PREFIX, INDEXER_PREFIX, compress_with_params, compressor
from .indexer import indexer_sequence, pad_columns
from .indexer_loss import indexer_kl_rows, reduce_loss
from .numerics import compute_dtype
from .params import get_param
from .sparse_attention import (all_compressed_indices, selected_compressed_indices, sparse_attention,
                               window_indices)


@dataclass
class SequenceResult:
    """Core attention of BSHD sequences: ``out [B,S,n,D]``, ``lse [B,S,n]``, per-row ``kl [B,S]`` (or None),
    the indexer's own ``topk [B,S,K]`` and ``scores [B,S,n_comp]`` (or None)."""

    out: torch.Tensor
    lse: torch.Tensor
    kl: Optional[torch.Tensor]
    topk: Optional[torch.Tensor]
    scores: Optional[torch.Tensor]


def core_sequence(query: torch.Tensor, kv: torch.Tensor, hidden: torch.Tensor, q_latent: torch.Tensor,
                  params: Mapping[str, torch.Tensor], config: ModelConfig, *, compressed: Optional[torch.Tensor],
                  index_keys: Optional[torch.Tensor], training: bool,
                  topk_indices: Optional[torch.Tensor],
                  pattern: Optional[activation.ActivationPattern] = None) -> SequenceResult:
    """Core attention of ``B`` sequences of ``S`` tokens: ``query [B,S,n,D]``, ``kv [B,S,D]``, ``hidden [B,S,Hd]``,
    ``q_latent [B,S,Rq]``; ``compressed [B,n_comp,D]`` / ``index_keys [B,n_comp,dI]`` the compressors' entries
    (r > 1 / indexer layers); ``topk_indices [B,S,K]`` local ids overriding the indexer's selection (split mode);
    ``pattern`` the indexer ReLU's derivative pattern and the KL's scores (sign- and score-split,
    :mod:`reference.activation`)."""
    c = config
    B, S, n, _ = query.shape
    sink = get_param(params, "core_attention.attn_sink", (n,))
    indices = window_indices(S, c.csa_window_size, query.device).expand(B, S, c.csa_window_size)
    kv_full, scores, own_topk, used_topk = kv, None, None, None
    if c.has_compressor:
        n_comp = compressed.shape[1]
        kv_full = torch.cat((kv, compressed), dim=1)
        if c.has_indexer:
            scores, own_topk = indexer_sequence(hidden, q_latent, params, c, index_keys, pattern)
            used_topk = own_topk if topk_indices is None else topk_indices
            compressed_ids = selected_compressed_indices(used_topk, S, INDEXER_RATIO, n_comp)
        else:
            compressed_ids = all_compressed_indices(S, c.compress_ratio, n_comp, query.device).expand(B, S, n_comp)
        indices = torch.cat((indices, compressed_ids), dim=-1)
    out, lse = sparse_attention(query, kv_full, indices, sink, c.softmax_scale)
    kl = None
    if training and c.has_indexer:
        kl = indexer_kl_rows(scores, used_topk if c.dsa_indexer_use_sparse_loss else None, query, kv, compressed,
                             sink, c, None if pattern is None else pattern.scores)
    return SequenceResult(out, lse, kl, own_topk, scores)


def _check_inputs(query, kv, hidden, q_latent, config: ModelConfig, psp: Optional[PackedSeqParams], topk_indices
                  ) -> None:
    c = config
    packed = psp is not None
    lead = query.shape[:1] if packed else query.shape[:2]
    expect = {"query": (query, lead + (c.num_attention_heads, c.v_head_dim)), "kv": (kv, lead + (c.v_head_dim,)),
              "hidden": (hidden, lead + (c.hidden_size,)), "q_latent": (q_latent, lead + (c.q_lora_rank,))}
    layout = "THD [T, ...]" if packed else "BSHD [B, S, ...]"
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != tuple(shape):
            raise CaseError(name, f"has shape {tuple(tensor.shape)}, expected {tuple(shape)} ({layout})")
    check_topk_selection(topk_indices, c, tuple(lead), psp)


def core_attention(query: torch.Tensor, kv: torch.Tensor, hidden: torch.Tensor, q_latent: torch.Tensor,
                   params: Mapping[str, torch.Tensor], config: ModelConfig,
                   packed_seq_params: Optional[PackedSeqParams] = None, *, training: bool = True,
                   topk_indices: Optional[torch.Tensor] = None) -> AttentionOutput:
    """Public API (ARCHITECTURE.md). BSHD ``[B, S, ...]`` or THD ``[T, ...]`` inputs:
    ``query [.., n, D]`` (roped, normalised), ``kv [.., D]``, ``hidden [.., Hd]``, ``q_latent [.., Rq]``.

    Returns ``out [.., n, D]`` (before inverse RoPE), ``lse [.., n]`` without the sink, the indexer loss (r = 4 with
    indexer and ``training``; coefficient applied; 0 when no row sees a compressed entry), the indexer's own
    ``topk_indices`` and ``index_scores``. ``topk_indices`` given: the attention and the sparse loss use these ids.
    """
    packed = packed_seq_params is not None
    if packed:
        packed_seq_params = thd.on_host(packed_seq_params)  # before the checks, which read the offsets too
    _check_inputs(query, kv, hidden, q_latent, config, packed_seq_params, topk_indices)
    if packed:
        return _core_thd(query, kv, hidden, q_latent, params, config, packed_seq_params, training, topk_indices)
    compressed = index_keys = None
    if config.has_compressor:
        compressed = compress_with_params(hidden, params, ATTENTION_PREFIX, config, rotate=False)
    if config.has_indexer:
        index_keys = compress_with_params(hidden.detach(), params, INDEXER_PREFIX, config, rotate=True)
    res = core_sequence(query, kv, hidden, q_latent, params, config, compressed=compressed, index_keys=index_keys,
                        training=training, topk_indices=topk_indices, pattern=activation.current_pattern())
    loss = None
    if res.kl is not None:
        loss = reduce_loss(res.kl.sum(), res.kl.numel(), config)
    return AttentionOutput(out=res.out, lse=res.lse, indexer_loss=loss, topk_indices=res.topk,
                           index_scores=res.scores)


def _core_thd(query, kv, hidden, q_latent, params, config: ModelConfig, psp: PackedSeqParams, training: bool,
              topk_indices) -> AttentionOutput:
    """THD: each padded segment with rows is a B=1 sequence; rows are placed back, slack rows get out 0 / lse -inf.

    Padding rows keep their forward values but pass no gradient (their out / lse are detached) and are excluded
    from the loss, whose mean divides by the number of real rows.
    """
    c = config
    T, n, D = query.shape
    segs = thd.segments(psp, T)
    none = [None] * len(segs)
    compressed, index_keys = none, none
    if c.has_compressor:
        packed = compressor(hidden, params, ATTENTION_PREFIX, c, psp, rotate=False)
        compressed = thd.segment_compressed(packed, segs, c.compress_ratio)
    if c.has_indexer:
        packed = compressor(hidden.detach(), params, INDEXER_PREFIX, c, psp, rotate=True)
        index_keys = thd.segment_compressed(packed, segs, INDEXER_RATIO)

    def one(x):
        return None if x is None else x.unsqueeze(0)

    outs, lses, kl_sums, topks, scores = [], [], [], [], []
    width = max(psp.max_seqlen_q, max((s.length for s in segs), default=0)) // INDEXER_RATIO
    pattern = activation.current_pattern() if c.has_indexer else None
    work = compute_dtype(query.dtype)
    rows_of = [thd.segment_rows(x, segs) for x in (query, kv, hidden, q_latent)]
    any_rows = any(s.length for s in segs)  # a pack without rows runs its segments: zero gradients, not none
    for b, (s, query_b, kv_b, hidden_b, q_latent_b) in enumerate(zip(segs, *rows_of)):
        if s.length == 0 and any_rows:  # no rows to attend or score; its loss term is 0, kept in the sum
            if training and c.has_indexer:
                kl_sums.append(torch.zeros((), dtype=work, device=query.device))
            continue
        res = core_sequence(query_b[None], kv_b[None], hidden_b[None], q_latent_b[None],
                            params, c, compressed=one(compressed[b]), index_keys=one(index_keys[b]),
                            training=training,
                            topk_indices=None if topk_indices is None else topk_indices[s.rows][None],
                            pattern=None if pattern is None else pattern.rows(s.rows, index_keys[b].shape[0]))
        outs.append(res.out[0])
        lses.append(res.lse[0])
        if res.kl is not None:
            real = torch.arange(s.length, device=query.device) < s.real_length
            kl_sums.append(torch.where(real, res.kl[0], 0.0).sum())
        if res.scores is not None:
            topks.append(res.topk[0])
            scores.append(pad_columns(res.scores[0], width, float("-inf")))

    real = thd.real_row_mask(segs, T, query.device)
    out = thd.place_rows(outs, T, 0.0, like=query.new_empty((0, n, D)))
    lse = thd.place_rows(lses, T, float("-inf"), like=query.new_empty((0, n), dtype=work))
    out = torch.where(real.view(T, 1, 1), out, out.detach())
    lse = torch.where(real.view(T, 1), lse, lse.detach())
    loss = topk = index_scores = None
    if training and c.has_indexer:
        total = torch.stack(kl_sums).sum() if kl_sums else query.new_zeros((), dtype=work)
        loss = reduce_loss(total, thd.num_real_rows(segs), c)
    if c.has_indexer:
        topk = thd.place_rows(topks, T, -1, like=torch.empty((0, c.dsa_indexer_topk), dtype=torch.int64,
                                                             device=query.device))
        index_scores = thd.place_rows(scores, T, float("-inf"), like=query.new_empty((0, width), dtype=work))
    return AttentionOutput(out=out, lse=lse, indexer_loss=loss, topk_indices=topk, index_scores=index_scores)
