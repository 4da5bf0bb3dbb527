"""Sharding one sweep over the devices of one machine: which case goes first.

How many workers there are and where each runs is :mod:`parity.run.placement`; the workers take the cases from one
shared queue in this module's order:

* **Order**: :func:`by_cost` — a shared queue, most expensive case first, every idle worker taking the next one.
  That is Graham's LPT list scheduling driven by the *measured* finish times, so a wrong estimate costs at most
  one case's imbalance at the end of the sweep instead of a whole static shard.

The cost estimate (:func:`estimate_cost`) only has to *rank* cases; its unit is "multiply-adds of one float32
run on the device", roughly::

    cost = Σ_runs dtype_factor(run) · 3 (forward + backward) · Σ_sequences L · per_row(L)

    per_row(L) = n·D·2·(win + cmp)                  sparse attention: QKᵀ and PV over the key set (spec §4.1)
               + nI·dI·vis                            indexer scores over every visible compressed key (r=4)
               + n·D·|St|                             teacher logits of the indexer KL loss (training, r=4)
               + compressors + indexer projections   per-token GEMMs of core attention (r>1)
               + [scope layer] Hd·Rq + Rq·n·D + Hd·D + n·D·Ro + G·Ro·Hd     q / kv / grouped output projections

with ``win`` = mean window keys per row, ``vis`` = mean causally visible compressed keys, ``cmp`` = ``min(K, vis)``
with an indexer else ``vis`` (0 for r=0), ``St`` = ``cmp`` (sparse loss) or ``vis`` (dense loss). The runs are
the engine's (:mod:`parity.engine`): the implementation in the case dtype, the float64 truth and, unless the case
is float64, the same-dtype noise run. ``dtype_factor`` is the relative cost of one multiply-add in that dtype on
the device (:data:`DTYPE_FACTOR`). The per-case fixed overhead (Python dispatch, first-call warm-up, comparison)
is left out: a constant does not change the order. It is what dominates the ``tiny`` CPU cases (a 2-token case can
take longer than a 300-token one: rank correlation of estimate and measured duration over the smoke suite ≈ 0.3),
so the estimate matters for the ``kernel`` / production cases of a GPU sweep, where the work is the FLOPs.
"""

from __future__ import annotations

from typing import Sequence

from cases.case import Case

#: Relative cost of one multiply-add per dtype, per device kind. CUDA: bf16 on tensor cores vs fp32 / fp64 on the
#: CUDA cores (H100/H200: ~990 vs ~67 dense TFLOP/s, fp64 half of fp32 outside tensor-core GEMMs). CPU: fp32 SIMD,
#: fp64 half the lanes, bf16 mostly emulated through fp32 conversions.
DTYPE_FACTOR = {
    "cuda": {"bfloat16": 1.0, "float32": 8.0, "float64": 16.0},
    "cpu": {"bfloat16": 3.0, "float32": 1.0, "float64": 2.0},
}


# ---- cost estimate and order ----------------------------------------------------------------------------------------
def _mean_capped(length: int, cap: float, ratio: int) -> float:
    """Mean over rows ``i < length`` of ``min(cap, (i+1)/ratio)`` (continuous approximation): the keys a row sees
    in a causal window of ``cap`` (ratio 1) or among ``ratio``-compressed keys capped at ``cap``."""
    if length <= 0:
        return 0.0
    top = length / ratio  # the last row's count
    if top <= cap:
        return (length + 1) / (2.0 * ratio)
    ramp = cap * ratio  # rows before the cap is reached
    return (ramp * cap / 2.0 + (length - ramp) * cap) / length


def _sequences(case: Case) -> list[int]:
    """Sequence lengths whose rows do the work: BSHD ``B × [S]``; THD the padded segments (slack rows: no keys)."""
    lay = case.layout
    if case.is_thd:
        return [L for L in lay.padded_lengths if L > 0]
    return [lay.seq_len] * lay.batch


def per_row_macs(case: Case, length: int) -> float:
    """Multiply-adds of one query row of a sequence of ``length`` rows, forward (see the module docstring)."""
    c = case.config
    n, D, Hd, Rq = c.num_attention_heads, c.v_head_dim, c.hidden_size, c.q_lora_rank
    r, K = c.compress_ratio, c.dsa_indexer_topk
    win = _mean_capped(length, c.csa_window_size, 1)
    vis = _mean_capped(length, float("inf"), r) if r > 1 else 0.0
    cmp = _mean_capped(length, K, r) if c.has_indexer else vis
    macs = n * D * 2.0 * (win + cmp)
    if r > 1:
        macs += 2.0 * c.coff * D * Hd  # compressor: wkv and wgate
    if c.has_indexer:
        nI, dI = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        macs += nI * dI * vis + Rq * nI * dI + Hd * nI + 2.0 * 2 * dI * Hd
    if case.computes_loss:
        macs += n * D * (cmp if c.dsa_indexer_use_sparse_loss else vis)
    if case.scope == "layer":
        macs += Hd * Rq + Rq * n * D + Hd * D + n * D * c.o_lora_rank + c.o_groups * c.o_lora_rank * Hd
    return macs


def estimate_cost(case: Case, device: str = "cpu") -> float:
    """Estimated work of one case on ``device`` (``cpu`` / ``cuda``), in float32 multiply-adds; ranks cases only."""
    factors = DTYPE_FACTOR["cuda" if device == "cuda" else "cpu"]
    run_dtypes = ["float64", "float64"] if case.dtype == "float64" else [case.dtype, "float64", case.dtype]
    work = sum(L * per_row_macs(case, L) for L in _sequences(case))
    return 3.0 * work * sum(factors[d] for d in run_dtypes)


def by_cost(cases: Sequence[Case], device: str = "cpu") -> list[Case]:
    """``cases`` most expensive first (ties: suite order), the dispatch order of a multi-worker run."""
    indexed = list(enumerate(cases))
    indexed.sort(key=lambda item: (-estimate_cost(item[1], device), item[0]))
    return [case for _, case in indexed]


__all__ = ["DTYPE_FACTOR", "by_cost", "estimate_cost", "per_row_macs"]
