"""Sparse attention over window ∪ compressed set ∪ per-head sink (spec §4), and its key-index construction.

For one sequence with ``kv_full = [kv (S rows); compressed entries (n_comp rows)]`` and a row's key set ``U(i)``::

    l[h, k] = sigma * q[i, h] . kv_full[k]                    k in U(i)    (float32 / float64)
    P[h, k] = exp(l[h, k]) / (sum_k' exp(l[h, k']) + exp(a_h))             a_h = attn_sink[h], the sink has no value
    o[i, h] = sum_k P[h, k] kv_full[k]                                       (V = K, all D dims)
    lse[i, h] = logsumexp_k l[h, k]                                          (WITHOUT the sink, FlashMLA convention)

A row whose key set is empty gives ``o = 0`` and ``lse = -inf``. Keys are gathered per block of query rows, so memory
grows with ``rows x |U|``, never ``rows x rows``; with block recomputation (:mod:`.numerics`) the autograd graph keeps
only ``out`` and ``lse`` of a row, not its gathered keys.
"""

from __future__ import annotations

import torch

from .compressor import visible_compressed_count
from .numerics import compute_dtype, per_block, row_blocks, row_chunks


def window_indices(seq_len: int, window: int, device=None) -> torch.Tensor:
    """``[S, W]`` local key ids of the sliding window: row ``i`` holds ``max(0, i-W+1) + [0, W)``; ``-1`` past i."""
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    ids = torch.clamp(i - window + 1, min=0) + torch.arange(window, device=device)
    return torch.where(ids > i, -1, ids)


def all_compressed_indices(seq_len: int, ratio: int, n_comp: int, device=None) -> torch.Tensor:
    """``[S, n_comp]`` ids ``S + g`` of every visible entry (:func:`.compressor.visible_compressed_count`), else
    ``-1`` (r=128, dense)."""
    visible = visible_compressed_count(seq_len, ratio, n_comp, device).unsqueeze(1)
    g = torch.arange(n_comp, device=device)
    return torch.where(g < visible, seq_len + g, -1)


def selected_compressed_indices(topk: torch.Tensor, seq_len: int, ratio: int, n_comp: int) -> torch.Tensor:
    """``[B, S, K]`` kv_full ids ``S + g`` of the selected local ids ``g`` that pass the causal rule, else ``-1``."""
    visible = visible_compressed_count(seq_len, ratio, n_comp, topk.device).unsqueeze(1)
    keep = (topk >= 0) & (topk < visible)
    return torch.where(keep, topk + seq_len, -1)


def gather_rows(kv_full: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``kv_full [B, N, D]``, ``ids [B, s, k]`` (``-1`` allowed) -> ``[B, s, k, D]`` (``-1`` slots read row 0 and send
    it no gradient: every caller masks them). The gradient is :func:`sum_rows_in_order` (:class:`_GatherRows`)."""
    return _GatherRows.apply(kv_full, ids)


def sum_rows_in_order(values: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """``out [rows, D]``: ``out[r]`` is the sum of the rows ``values[m]`` (``values [M, D]``) with ``ids[m] == r``
    (``ids [M]`` int64 or int32; entries with ``ids < 0`` are dropped), added one at a time in increasing ``m``, each
    addition rounded to ``values.dtype``.

    That is exactly what autograd's deterministic ``index_put_(accumulate=True)`` computes for the gradient of a row
    gather ``x[ids]`` (its CPU loop and its CUDA kernel both add a row's duplicates in index order), so the result
    is bit-identical to it. Only the schedule differs: the CUDA kernel adds each row's duplicates one after another
    in one warp, which is slow when rows repeat hundreds of times (a window key is read by ``W`` query rows, a
    compressed key by every row that selects it). Both schedules here sort the entries by row, stably (duplicates
    keep their order), and give the same bits:

    * on CUDA, :func:`sum_runs_by_segments`: one kernel whatever the duplicates, nothing read back from the device;
    * on the CPU, :func:`sum_runs_by_rank`: one vectorised add per duplicate rank (no launches to save there, and
      torch's CPU ``segment_reduce`` is a scalar loop: smoke ran 5 % slower with it).
    """
    if ids.numel() == 0 or rows == 0:
        return values.new_zeros((rows, values.shape[-1]))
    schedule = sum_runs_by_segments if values.is_cuda else sum_runs_by_rank
    return schedule(values, *row_runs(ids, rows))


def row_runs(ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_rows [M], perm [M], bounds [rows + 2])`` of ``ids [M]`` (non-empty, ``rows >= 1``): the entries
    sorted by row, stably (``perm``), the dropped ones (``ids < 0``) as a bin ``rows`` after every row; row ``r``'s
    run is ``[bounds[r], bounds[r+1])``, the bin's ``[bounds[rows], M)``."""
    row_of = torch.where(ids < 0, rows, ids).to(torch.int64)
    sorted_rows, perm = torch.sort(row_of, stable=True)
    # where each run begins, and the end: no scatter, so no deterministic-mode detour
    bounds = torch.searchsorted(sorted_rows, torch.arange(rows + 2, device=ids.device))
    return sorted_rows, perm, bounds


def sum_runs_by_segments(values: torch.Tensor, sorted_rows: torch.Tensor, perm: torch.Tensor,
                         bounds: torch.Tensor) -> torch.Tensor:
    """:func:`sum_rows_in_order`'s sums with ``torch.segment_reduce`` over :func:`row_runs` (``values [M, D]`` taken
    in ``perm`` order; the dropped bin after the rows is not read). For 2-D data its kernel (CPU and CUDA) keeps one
    running value per output element in ``values.dtype``, starting at ``+0.0`` as ``index_put_`` adds into zeros (a
    row of only ``-0.0`` entries sums to ``+0.0``), and adds the run's entries to it in order."""
    ordered = values.index_select(0, perm)
    return torch.segment_reduce(ordered, "sum", offsets=bounds[:-1], axis=0, unsafe=True)


def sum_runs_by_rank(values: torch.Tensor, sorted_rows: torch.Tensor, perm: torch.Tensor,
                     bounds: torch.Tensor) -> torch.Tensor:
    """:func:`sum_rows_in_order`'s sums rank by rank over :func:`row_runs`: the ``j``-th duplicates of all rows are
    added together, one vector add per rank ``j``. The schedule (how many rows have a ``j``-th duplicate) is read
    from the device once."""
    rows, M, D = len(bounds) - 2, values.shape[0], values.shape[-1]
    device = sorted_rows.device
    out = values.new_zeros((rows, D))
    starts, binned = bounds[:-1], bounds[1:] - bounds[:-1]           # entries per row, and the bin's
    rank = torch.arange(M, device=device) - starts[sorted_rows]      # an entry's place in its run
    by_count = torch.sort(binned[:rows], descending=True, stable=True)  # rows, most duplicates first
    place = torch.empty_like(by_count.indices)
    place[by_count.indices] = torch.arange(rows, device=device)
    # entries laid out rank by rank, each rank in by_count order: the rows that have a j-th entry are a prefix;
    # the dropped entries (bin ``rows``) go after every kept one
    key = rank * rows + place[sorted_rows.clamp(max=rows - 1)]
    key = torch.where(sorted_rows == rows, M * (rows + 1), key)
    layout = torch.argsort(key)
    ordered = values.index_select(0, perm.index_select(0, layout))
    # the one read from the device: each row's duplicate count, most first (rank j is added to the first
    # per_rank[j] rows)
    desc = by_count.values.cpu()
    kept = int((desc > 0).sum())
    if kept == 0:
        return out
    per_rank = torch.bincount(desc[:kept], minlength=int(desc[0]) + 1).flip(0).cumsum(0).flip(0)[1:].tolist()
    acc = ordered[:per_rank[0]] + 0.0  # rank 0 added into zeros, as index_put_ does (-0.0 becomes +0.0)
    at = per_rank[0]
    for n in per_rank[1:]:
        acc[:n].add_(ordered[at:at + n])  # in place on the view: one op (``acc[:n] += ...`` copies it back too)
        at += n
    out[by_count.indices[:kept]] = acc
    return out


class _GatherRows(torch.autograd.Function):
    """``kv_full[b, ids[b]]`` per batch ``b``; backward: :func:`sum_rows_in_order` over the flattened rows."""

    @staticmethod
    def forward(ctx, kv_full: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        B, N = kv_full.shape[:2]
        batch = torch.arange(B, device=kv_full.device).view(B, 1, 1)
        ctx.save_for_backward(ids)
        ctx.rows = (B, N)
        return kv_full[batch, ids.clamp(min=0)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        B, N = ctx.rows
        flat = torch.where(ids >= 0, ids + N * torch.arange(B, device=ids.device).view(B, 1, 1), -1)
        summed = sum_rows_in_order(grad.reshape(-1, grad.shape[-1]), flat.reshape(-1), B * N)
        return summed.view(B, N, grad.shape[-1]), None


def attend_rows(query: torch.Tensor, kv_full: torch.Tensor, ids: torch.Tensor, sink: torch.Tensor,
                softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row block of :func:`sparse_attention`: ``query [B, s, n, D]``, ``ids [B, s, k]``, ``sink [1, 1, n, 1]``
    (compute dtype) -> ``(out [B, s, n, D], lse [B, s, n])``."""
    B, s, n, _ = query.shape
    work = sink.dtype
    keys = gather_rows(kv_full, ids).to(work)                        # [B, s, k, D]
    logits = (query.to(work) @ keys.transpose(-1, -2)) * softmax_scale  # [B, s, n, k]
    present = (ids >= 0).unsqueeze(2)                                # [B, s, 1, k]
    logits = logits.masked_fill(~present, float("-inf"))
    # the full normaliser includes the sink, so it is finite even for a row without keys
    normaliser = torch.logsumexp(torch.cat((logits, sink.expand(B, s, n, 1)), dim=-1), dim=-1)
    probs = torch.exp(logits - normaliser.unsqueeze(-1))
    out = (probs @ keys).to(query.dtype)
    has_key = present.any(dim=-1)                                    # [B, s, 1]
    safe = torch.where(has_key.unsqueeze(-1), logits, 0.0)           # no -inf-only rows inside logsumexp
    return out, torch.where(has_key, torch.logsumexp(safe, dim=-1), float("-inf"))


def sparse_attention(query: torch.Tensor, kv_full: torch.Tensor, indices: torch.Tensor, attn_sink: torch.Tensor,
                     softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, S, n, D] in query.dtype, lse [B, S, n] float32/64)`` of the sink softmax (module docstring).

    ``query [B, S, n, D]``; ``kv_full [B, N, D]``; ``indices [B, S, width]`` ids into ``kv_full``, ``-1`` = no key
    (duplicates are not expected); ``attn_sink [n]``. Row blocks run through :func:`numerics.per_block`, so the
    graph keeps no gathered keys or logits (they are recomputed block by block in backward).
    """
    B, S, n, D = query.shape
    work = compute_dtype(query.dtype)
    sink = attn_sink.to(work).view(1, 1, n, 1)
    outs, lses = [], []
    for rows, query_rows in zip(row_chunks(S), row_blocks(query)):
        out, lse = per_block(attend_rows, query_rows, kv_full, indices[:, rows], sink, softmax_scale)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return query.new_zeros((B, 0, n, D)), query.new_zeros((B, 0, n), dtype=work)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)
