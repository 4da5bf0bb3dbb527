"""Indexer KL loss of ratio-4 layers (spec §5.3): teach the indexer the attention's distribution over compressed keys.

Per query row ``t`` of one sequence (teacher logits ``l[h, s] = sigma q[t, h] . c[s]``)::

    Vt        = { s : s < min(floor((t+1)/4), n_comp) }                  causally valid entries
    St        = topk(t) ∩ Vt  (sparse loss)   |   Vt  (dense loss)
    LSE_nc[h] = logaddexp( logsumexp_{j in window(t)} sigma q[t, h] . kv[j],  a_h )        window + sink mass
    LSE[h]    = logaddexp( LSE_nc[h], logsumexp_{s in St} l[h, s] )                        full CSA denominator
    T[s]      = sum_h exp(l[h, s] - LSE[h])  /  max( sum_{s' in St} sum_h exp(l[h, s'] - LSE[h]), tiny )
    logQ[s]   = log_softmax_{s in St}( I[t, s] )                          I = indexer scores (spec §3)
    KL_t      = sum_{s in St} T[s] (log max(T[s], tiny) - logQ[s])        0 for a row with St empty

``tiny = finfo(float32).tiny``. The sum runs over ``St`` only (never ``0 * -inf``). The teacher is evaluated without
gradient from detached inputs, so the loss trains only the indexer (through ``I``). Reduction (:func:`reduce_loss`):
``coeff * sum_t KL_t`` (``calculate_per_token_loss``) or ``coeff * sum_t KL_t / N`` with ``N`` the real rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from cases.config import INDEXER_RATIO, ModelConfig

from .activation import log_softmax_at
from .compressor import visible_compressed_count
from .numerics import FP32_TINY, compute_dtype, per_block, row_blocks, row_chunks
from .sparse_attention import gather_rows, window_indices


@torch.no_grad()
def window_sink_lse(query: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, window: int,
                    softmax_scale: float) -> torch.Tensor:
    """``LSE_nc [B, S, n]``: log-sum-exp over the sliding-window logits and the sink logit (no gradient)."""
    B, S, n, _ = query.shape
    work = compute_dtype(query.dtype)
    sink = attn_sink.to(work).view(1, 1, n, 1)
    win = window_indices(S, window, query.device).expand(B, S, window)
    blocks = []
    for rows in row_chunks(S):
        ids = win[:, rows]
        keys = gather_rows(kv, ids).to(work)
        logits = (query[:, rows].to(work) @ keys.transpose(-1, -2)) * softmax_scale
        logits = logits.masked_fill((ids < 0).unsqueeze(2), float("-inf"))
        blocks.append(torch.logsumexp(torch.cat((logits, sink.expand(B, logits.shape[1], n, 1)), dim=-1), dim=-1))
    if not blocks:
        return query.new_zeros((B, 0, n), dtype=work)
    return torch.cat(blocks, dim=1)


@torch.no_grad()
def teacher_target(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, lse_nc: torch.Tensor,
                   softmax_scale: float) -> torch.Tensor:
    """``T [B, s, C]``: head-summed teacher probabilities over the candidates, L1-normalised over the valid ones.

    ``query [B, s, n, D]``; ``keys [B, s or 1, C, D]`` the candidates' compressed KV; ``valid [B, s, C]`` marks
    ``St``; ``lse_nc [B, s, n]``. Invalid candidates get ``T = 0``.
    """
    work = lse_nc.dtype
    logits = (query.to(work) @ keys.to(work).transpose(-1, -2)) * softmax_scale   # [B, s, n, C]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse_full = torch.logaddexp(lse_nc, torch.logsumexp(logits, dim=-1))           # [B, s, n]
    head_sum = torch.exp(logits - lse_full.unsqueeze(-1)).sum(dim=2)             # [B, s, C]
    return head_sum / head_sum.sum(dim=-1, keepdim=True).clamp_min(FP32_TINY)


@torch.no_grad()
def block_teacher(topk: Optional[torch.Tensor], query: torch.Tensor, compressed: torch.Tensor, lse_nc: torch.Tensor,
                  visible: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher of one row block: ``(T [B, s, C], valid [B, s, C])`` over the block's candidates ``C`` (``K``
    selected ids, or every compressed entry for the dense loss), from ``topk [B, s, K]`` (``None``: dense),
    ``query [B, s, n, D]``, ``compressed [B, n_comp, D]``, ``lse_nc [B, s, n]`` and the visible entry counts
    ``visible [s]``. The candidates' keys are gathered here, inside the block. No gradient."""
    B, n_comp = compressed.shape[0], compressed.shape[1]
    if topk is None:  # dense: every valid entry, keys shared by the rows of the block
        ids = torch.arange(n_comp, device=query.device).expand(B, query.shape[1], n_comp)
        keys = compressed.unsqueeze(1)
    else:
        ids = topk
        keys = gather_rows(compressed, ids.clamp(max=n_comp - 1))
    valid = (ids >= 0) & (ids < visible.unsqueeze(-1))
    return teacher_target(query, keys, valid, lse_nc, softmax_scale), valid


def kl_rows(index_scores: torch.Tensor, topk: Optional[torch.Tensor], target: torch.Tensor, valid: torch.Tensor,
            at_scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One row block of :func:`indexer_kl_rows`: ``KL_t [B, s]`` from ``index_scores [B, s, n_comp]``, ``topk
    [B, s, K]`` (``None``: dense) and the block's teacher ``target`` / ``valid`` (:func:`block_teacher`).
    ``at_scores [B, s, n_comp]``: score-split, the student's derivative taken at these scores
    (:func:`reference.activation.log_softmax_at`)."""
    n_comp = index_scores.shape[-1]
    at = None if at_scores is None else at_scores.detach()
    if topk is None:
        predict = index_scores
    else:
        slots = topk.clamp(min=0, max=n_comp - 1)
        predict = torch.gather(index_scores, -1, slots)
        at = None if at is None else torch.gather(at, -1, slots)
    row_valid = valid.any(dim=-1, keepdim=True)
    predict = predict.masked_fill(~valid, float("-inf"))
    at = None if at is None else torch.where(row_valid, at.masked_fill(~valid, float("-inf")), 0.0)
    log_q = log_softmax_at(torch.where(row_valid, predict, 0.0), at)
    log_t = torch.log(target.clamp_min(FP32_TINY))
    terms = torch.where(valid, target * (log_t - torch.where(valid, log_q, 0.0)), 0.0)
    return terms.sum(dim=-1)


def dense_kl_rows(index_scores: torch.Tensor, query: torch.Tensor, compressed: torch.Tensor, lse_nc: torch.Tensor,
                  visible: torch.Tensor, softmax_scale: float, at_scores: Optional[torch.Tensor] = None
                  ) -> torch.Tensor:
    """One row block of the dense loss: :func:`kl_rows` with its teacher made inside the block. The dense target is
    ``[B, s, n_comp]``, rows x entries over a sequence, so it is not kept for backward but made again there."""
    target, valid = block_teacher(None, query, compressed, lse_nc, visible, softmax_scale)
    return kl_rows(index_scores, None, target, valid, at_scores)


def indexer_kl_rows(index_scores: torch.Tensor, topk: Optional[torch.Tensor], query: torch.Tensor, kv: torch.Tensor,
                    compressed: torch.Tensor, attn_sink: torch.Tensor, config: ModelConfig,
                    at_scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``KL_t [B, S]`` per query row of BSHD sequences (module docstring).

    ``index_scores [B, S, n_comp]`` (with gradient: the student); ``topk [B, S, K]`` local ids for the sparse loss,
    ``None`` for the dense loss; ``query [B, S, n, D]``, ``kv [B, S, D]``, ``compressed [B, n_comp, D]``,
    ``attn_sink [n]``: the teacher, detached here. Row blocks run through :func:`numerics.per_block`: the graph keeps
    no per-block log-probabilities (rebuilt in backward). The sparse loss makes each block's teacher once, outside the
    recomputation, and keeps its target (``[B, s, K]``, linear in the rows); the dense loss makes it again in backward
    (:func:`dense_kl_rows`).
    ``at_scores [B, S, n_comp]``: score-split (:mod:`reference.activation`), the implementation's index scores.
    """
    B, S, n_comp = index_scores.shape
    if n_comp == 0:
        return index_scores.sum(dim=-1)  # exact zeros that keep the graph (indexer grads 0, not None)
    query, kv, compressed, attn_sink = query.detach(), kv.detach(), compressed.detach(), attn_sink.detach()
    scale = config.softmax_scale
    lse_nc = window_sink_lse(query, kv, attn_sink, config.csa_window_size, scale)
    visible = visible_compressed_count(S, INDEXER_RATIO, n_comp, query.device)
    blocks = []
    for rows, scores in zip(row_chunks(S), row_blocks(index_scores)):
        at = None if at_scores is None else at_scores[:, rows]
        if topk is None:
            blocks.append(per_block(dense_kl_rows, scores, query[:, rows], compressed, lse_nc[:, rows],
                                    visible[rows], scale, at))
            continue
        target, valid = block_teacher(topk[:, rows], query[:, rows], compressed, lse_nc[:, rows], visible[rows], scale)
        blocks.append(per_block(kl_rows, scores, topk[:, rows], target, valid, at))
    return torch.cat(blocks, dim=1)


def reduce_loss(kl_sum: torch.Tensor, num_rows: int, config: ModelConfig) -> torch.Tensor:
    """``coeff * sum`` (per-token loss) or ``coeff * sum / num_rows`` (mean over the real rows)."""
    if config.calculate_per_token_loss or num_rows == 0:
        return kl_sum * config.dsa_indexer_loss_coeff
    return kl_sum / num_rows * config.dsa_indexer_loss_coeff
