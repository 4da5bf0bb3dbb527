"""Lightning indexer of ratio-4 layers (spec §3): scores over compressed entries and the top-k selection.

For one sequence, with ``x``, ``qr`` **detached** from the backbone::

    qI = (qr @ WqI^T).view(S, nI, dI); qI[..., dI-Dr:] = RoPE(qI[..., dI-Dr:], t); qI = Hadamard(qI)/sqrt(dI)
    kI = IndexerCompressor(x)                         [n_comp, dI]  (spec §2, rotate=True)
    wI = (x @ Wweights^T) * nI**-0.5                  [S, nI]
    I[t, s] = sum_h wI[t, h] * sigmaI * ReLU(qI[t, h] . kI[s])       (float32 / float64)
    valid(t, s) = s < min(floor((t+1)/4), n_comp); I = -inf elsewhere

Top-k: the ``min(K, #valid)`` largest valid scores of a row; among equal scores the lower index wins. Returned as
local ids sorted ascending, ``-1``-padded to width ``K``.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from cases.config import INDEXER_RATIO, ModelConfig
from cases.errors import CaseError
from cases.layout import PackedSeqParams

from . import activation, thd
from .compressor import INDEXER_PREFIX, compress_with_params, visible_compressed_count
from .hadamard import rotate_activation
from .numerics import compute_dtype, per_block, row_blocks, row_chunks
from .params import get_param
from .rope import apply_rope, layer_inv_freq


def indexer_query(q_latent: torch.Tensor, wq_b: torch.Tensor, n_heads: int, head_dim: int,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """``qI [B, S, nI, dI]`` from ``q_latent [B, S, Rq]``: projection, RoPE at ``t``, Hadamard rotation."""
    B, S, _ = q_latent.shape
    q = (q_latent @ wq_b.t()).view(B, S, n_heads, head_dim)
    positions = torch.arange(S, device=q.device).view(1, S, 1)
    return rotate_activation(apply_rope(q, positions, inv_freq))


def indexer_weights(hidden: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
    """``wI = (x @ Wweights^T) * nI**-0.5``: ``[B, S, nI]`` head weights of the score (``sigmaI`` not included)."""
    return (hidden @ w_proj.t()) * w_proj.shape[0] ** -0.5


def score_rows(q: torch.Tensor, kf: torch.Tensor, w: torch.Tensor, scale: float, visible: torch.Tensor,
               active: Optional[torch.Tensor] = None,
               pattern: Optional[activation.ActivationPattern] = None) -> torch.Tensor:
    """One row block of :func:`index_scores`: ``q [B, s, nI, dI]``, ``kf [B, 1, n_comp, dI]`` (compute dtype),
    ``w [B, s, nI]``, ``visible [s]`` visible entry counts -> ``I [B, s, n_comp]``. ``active [B, s, nI, n_comp]``:
    the ReLU's derivative pattern of sign-split (:mod:`reference.activation`; ``pattern`` holds its window)."""
    n_comp = kf.shape[2]
    qf = q.to(kf.dtype)
    dots = qf @ kf.transpose(-1, -2)  # [B, s, nI, n_comp]
    head_weights = (w.to(kf.dtype) * scale).unsqueeze(-1)
    valid = torch.arange(n_comp, device=q.device) < visible.unsqueeze(-1)
    relu = activation.relu(dots, qf, kf, active, pattern.window if pattern else 0.0,
                           pattern.record if pattern else None, counted=valid.unsqueeze(1))
    scores = (relu * head_weights).sum(dim=2)
    return scores.masked_fill(~valid, float("-inf"))


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float, ratio: int = INDEXER_RATIO,
                 pattern: Optional[activation.ActivationPattern] = None) -> torch.Tensor:
    """``I [B, S, n_comp]`` (float32 / float64) with ``-inf`` on causally invalid entries.

    ``q [B, S, nI, dI]``, ``k [B, n_comp, dI]``, ``w [B, S, nI]``; ``scale = sigmaI``. Computed over row blocks
    (:func:`numerics.per_block`: the graph keeps no ``ReLU(dots) [B, s, nI, n_comp]``, it is recomputed in backward).
    ``pattern``: sign-split, ``active [B, S, nI, n_comp]`` (:mod:`reference.activation`).
    """
    B, S, _, _ = q.shape
    n_comp = k.shape[1]
    work = compute_dtype(q.dtype)
    kf = k.to(work).unsqueeze(1)  # [B, 1, n_comp, dI]
    visible = visible_compressed_count(S, ratio, n_comp, q.device)
    blocks = [per_block(score_rows, q_rows, kf, w_rows, scale, visible[rows],
                        None if pattern is None else pattern.active[:, rows], pattern)
              for rows, q_rows, w_rows in zip(row_chunks(S), row_blocks(q), row_blocks(w))]
    if not blocks:
        return q.new_zeros((B, 0, n_comp), dtype=work)
    return torch.cat(blocks, dim=1)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Deterministic top-``k`` of ``scores [..., n_comp]`` (``-inf`` = not selectable) -> int64 ``[..., k]``.

    Among equal scores the lower index wins (stable descending sort). The selected ids are sorted ascending and
    padded with ``-1`` at the end; a row has ``min(k, #finite scores)`` real entries.
    """
    n_comp = scores.shape[-1]
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True)  # ids only: no graph
    take = min(k, n_comp)
    ids = torch.where(torch.isneginf(order.values[..., :take]), n_comp, order.indices[..., :take])
    ids = torch.sort(ids, dim=-1).values  # ascending, the n_comp sentinels last
    ids = torch.where(ids == n_comp, -1, ids)
    pad = ids.new_full(ids.shape[:-1] + (k - take,), -1)
    return torch.cat((ids, pad), dim=-1)


def indexer_sequence(hidden: torch.Tensor, q_latent: torch.Tensor, params: Mapping[str, torch.Tensor],
                     config: ModelConfig, index_keys: Optional[torch.Tensor] = None,
                     pattern: Optional[activation.ActivationPattern] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(I [B, S, n_comp], topk [B, S, K])`` for BSHD sequences. Inputs are detached here (spec §5.2).

    ``index_keys``: the indexer compressor's entries ``[B, n_comp, dI]`` if already computed, else computed here.
    ``pattern``: sign-split (:mod:`reference.activation`), ``active [B, S, nI, n_comp]``.
    """
    c = config
    nI, dI = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
    x, qr = hidden.detach(), q_latent.detach()
    q = indexer_query(qr, get_param(params, "core_attention.indexer.linear_wq_b.weight", (nI * dI, c.q_lora_rank)),
                      nI, dI, layer_inv_freq(c, qr.device))
    if index_keys is None:
        index_keys = compress_with_params(x, params, INDEXER_PREFIX, c, rotate=True)
    w = indexer_weights(x, get_param(params, "core_attention.indexer.linear_weights_proj.weight",
                                     (nI, c.hidden_size)))
    scores = index_scores(q, index_keys, w, c.indexer_softmax_scale, ratio=INDEXER_RATIO, pattern=pattern)
    return scores, select_topk(scores, c.dsa_indexer_topk)


def indexer(hidden: torch.Tensor, q_latent: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
            packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Public API: ``(index_scores, topk_indices)`` (ARCHITECTURE.md, ``cases/outputs.py``).

    BSHD: ``hidden [B, S, Hd]``, ``q_latent [B, S, Rq]`` -> ``[B, S, S // 4]`` fp32 scores, ``[B, S, K]`` int64 ids.
    THD: ``[T, ...]`` -> ``[T, max_seqlen_q // 4]`` scores by local compressed id (``-inf`` where not visible and on
    slack rows) and ``[T, K]`` local ids (``-1`` padded; all ``-1`` on slack rows).
    """
    if not config.has_indexer:
        raise CaseError("config.compress_ratio", "only ratio-4 layers outside dense mode have an indexer")
    if packed_seq_params is None:
        return indexer_sequence(hidden, q_latent, params, config)
    T = hidden.shape[0]
    packed_seq_params = thd.on_host(packed_seq_params)
    segs = thd.segments(packed_seq_params, T)
    width = max(packed_seq_params.max_seqlen_q, max((s.length for s in segs), default=0)) // INDEXER_RATIO
    segment_scores, segment_topk = [], []
    for s in (s for s in segs if s.length):  # an empty segment has no rows to score
        scores, topk = indexer_sequence(hidden[s.rows].unsqueeze(0), q_latent[s.rows].unsqueeze(0), params, config)
        segment_scores.append(pad_columns(scores[0], width, float("-inf")))
        segment_topk.append(topk[0])
    k = config.dsa_indexer_topk
    score_row = hidden.new_empty((0, width), dtype=compute_dtype(hidden.dtype))
    scores = thd.place_rows(segment_scores, T, float("-inf"), like=score_row)
    topk = thd.place_rows(segment_topk, T, -1, like=torch.empty((0, k), dtype=torch.int64, device=hidden.device))
    return scores, topk


def pad_columns(x: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """Right-pad the last dim of ``x`` to ``width`` with ``fill``."""
    extra = width - x.shape[-1]
    if extra <= 0:
        return x
    return torch.cat((x, x.new_full(x.shape[:-1] + (extra,), fill)), dim=-1)
