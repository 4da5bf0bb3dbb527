"""Model FLOPs of DSv4 hybrid attention, per kernel stage and end to end: the yardstick of ``dsv4-parity bench``.

The count is the *useful* work of the math (spec §1-§5), the same for every implementation, so that achieved
TFLOP/s compare directly (a kernel that computes masked blocks does not get credit for them). A multiply-add is
2 FLOPs. Per query row ``i`` of a segment (0-based local position), with ``r`` the compress ratio::

    w_i = min(i + 1, W)                  sliding-window keys
    v_i = floor((i + 1) / r)             visible compressed entries (r > 1; 0 for r = 0)
    c_i = min(K, v_i)  (r = 4, indexer)  selected compressed entries;  c_i = v_i otherwise (r = 128, dense mode)
    keys_i = w_i + c_i                   keys of the sparse attention

Kernel stages (names of :data:`fused.kernels.base.STAGES`), summed over the rows (V = K: ``d_qk = d_v = D``)::

    sparse_attn_fwd                 4 n D keys          (QK^T and PV, FlashMLA's 2 s_q h_q topk (d_qk + d_v))
    sparse_attn_bwd                10 n D keys          (recompute S, dP, dQ, dK, dV: 2.5x the forward)
    indexer_forward                 2 nI dI v           (every visible entry is scored)
    indexer_top_k, compactify       0                   (selection / compaction, no arithmetic)
    sparse_attn_score_recompute     2 n D c             (teacher logits of the selected entries)
    sparse_indexer_score_recompute  2 nI dI c
    csa_teacher_lse                 2 n D (w + v)       (dense loss: the full CSA denominator)
    dense_attn_score_recompute      2 n D v
    dense_indexer_score_recompute   2 nI dI v
    indexer_backward                6 nI dI c           (recompute, dq, dk)
    dense_indexer_backward          6 nI dI v

Eager parts (per token, forward; backward = 2x forward): a compressor ``2 * 2 * Hd * coff * d`` (its two
projections); the indexer projections ``2 Rq nI dI + 2 Hd nI``; at layer scope the q / kv / output projections
``2 (Hd Rq + Rq n D + Hd D + n D Ro + G Ro Hd)``. Element-wise work (norms, RoPE, softmax) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from cases.config import ModelConfig

#: Measured bf16 dense matmul peak of one H200 (TFLOP/s), the yardstick for "achieved / peak".
H200_BF16_PEAK_TFLOPS = 790.0


@dataclass(frozen=True)
class KeyCounts:
    """Sums over the query rows of a layout: ``rows``, window keys ``w``, visible entries ``v``, selected ``c``."""

    rows: int
    w: int
    v: int
    c: int

    @property
    def keys(self) -> int:
        return self.w + self.c


def key_counts(config: ModelConfig, segment_lengths: Iterable[int]) -> KeyCounts:
    """:class:`KeyCounts` of segments of the given lengths (a BSHD batch is ``B`` segments of ``S``)."""
    r, W, K = config.compress_ratio, config.csa_window_size, config.dsa_indexer_topk
    rows = w = v = c = 0
    for L in segment_lengths:
        if L <= 0:
            continue
        m = torch.arange(1, L + 1, dtype=torch.int64)
        rows += L
        w += int(m.clamp(max=W).sum())
        if r > 1:
            vis = m // r
            v += int(vis.sum())
            c += int((vis.clamp(max=K) if config.has_indexer else vis).sum())
    return KeyCounts(rows, w, v, c)


def kernel_flops(config: ModelConfig, counts: KeyCounts, *, loss: str) -> dict[str, float]:
    """Model FLOPs of each kernel stage of one forward + backward (``loss``: ``none`` / ``sparse`` / ``dense``)."""
    c = config
    n, D, nI, dI = c.num_attention_heads, c.v_head_dim, c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
    out = {"sparse_attn_fwd": 4.0 * n * D * counts.keys, "sparse_attn_bwd": 10.0 * n * D * counts.keys}
    if c.has_indexer and counts.v:
        out["indexer_forward"] = 2.0 * nI * dI * counts.v
        out["indexer_top_k"] = 0.0
        out["compactify"] = 0.0
        if loss == "sparse":
            out["sparse_attn_score_recompute"] = 2.0 * n * D * counts.c
            out["sparse_indexer_score_recompute"] = 2.0 * nI * dI * counts.c
            out["indexer_backward"] = 6.0 * nI * dI * counts.c
        elif loss == "dense":
            out["csa_teacher_lse"] = 2.0 * n * D * (counts.w + counts.v)
            out["dense_attn_score_recompute"] = 2.0 * n * D * counts.v
            out["dense_indexer_score_recompute"] = 2.0 * nI * dI * counts.v
            out["dense_indexer_backward"] = 6.0 * nI * dI * counts.v
    return out


def compressor_flops(config: ModelConfig, tokens: int, *, indexer: bool = False, backward: bool = True) -> float:
    """The attention compressor (or the indexer's, ``indexer=True``): its two projections, forward (+ backward)."""
    c = config
    d = c.dsa_indexer_head_dim if indexer else c.v_head_dim
    coff = 2 if (indexer or c.compress_ratio == 4) else 1
    fwd = 2.0 * 2 * c.hidden_size * coff * d * tokens
    return fwd * (3.0 if backward else 1.0)


def core_flops(config: ModelConfig, counts: KeyCounts, *, loss: str) -> float:
    """Core attention, forward + backward: kernels, compressors and the indexer projections."""
    c = config
    total = sum(kernel_flops(c, counts, loss=loss).values())
    if c.has_compressor:
        total += compressor_flops(c, counts.rows)
    if c.has_indexer:
        total += compressor_flops(c, counts.rows, indexer=True)
        proj = 2.0 * (c.q_lora_rank * c.dsa_indexer_n_heads * c.dsa_indexer_head_dim
                      + c.hidden_size * c.dsa_indexer_n_heads) * counts.rows
        total += proj * (3.0 if loss != "none" else 1.0)
    return total


def projection_flops(config: ModelConfig, tokens: int) -> float:
    """The layer's q / kv / output projections, forward + backward."""
    c = config
    n, D, Hd, Rq, G, Ro = (c.num_attention_heads, c.v_head_dim, c.hidden_size, c.q_lora_rank, c.o_groups,
                           c.o_lora_rank)
    fwd = 2.0 * (Hd * Rq + Rq * n * D + Hd * D + n * D * Ro + G * Ro * Hd) * tokens
    return 3.0 * fwd


def total_flops(config: ModelConfig, counts: KeyCounts, *, scope: str, loss: str) -> float:
    """Forward + backward model FLOPs of ``scope`` (``core`` or ``layer``)."""
    core = core_flops(config, counts, loss=loss)
    return core + (projection_flops(config, counts.rows) if scope == "layer" else 0.0)


def tflops(flops: Optional[float], seconds: Optional[float]) -> Optional[float]:
    """Achieved TFLOP/s, or None when either is unknown or zero."""
    if not flops or not seconds:
        return None
    return flops / seconds / 1e12
