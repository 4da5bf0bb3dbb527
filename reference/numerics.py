"""Precision policy and row chunking shared by every reference stage.

Precision (ARCHITECTURE.md "Conventions"):
    * float64 inputs: every step runs in float64.
    * float32 / bfloat16 inputs: activations (projections, RoPE, norms outputs, compressed KV) stay in their dtype;
      softmax weights, log-sum-exps, indexer scores and the loss run in float32, as production does.

Chunking: the sparse attention, the indexer scores and the loss teacher work on blocks of ``ROW_CHUNK`` query rows,
so the memory of one block is ``ROW_CHUNK x (keys of a row)`` and never ``rows x rows``. Tests lower ``ROW_CHUNK``
to check that the result does not depend on it.

Recomputation: each block runs through :func:`per_block`, which wraps it in ``torch.utils.checkpoint`` (autograd's
own recomputation, non-reentrant). The graph then keeps only each block's inputs (views of tensors that exist
anyway); the block's intermediates (gathered keys ``[B, s, keys, D]``, logits and probabilities
``[B, s, n, keys]``, the indexer's ``ReLU(dots) [B, s, nI, n_comp]``) are rebuilt from them during backward, one
block at a time. Every gradient still comes from autograd, and the numbers are bit-identical with or without it.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

ROW_CHUNK = 256
"""Query rows per block in the chunked stages (any value >= 1 gives the same numbers)."""

CHECKPOINT_BLOCKS = True
"""Recompute each block's intermediates in backward instead of saving them (:func:`per_block`). Same numbers either
way; ``False`` keeps every intermediate in the graph (tests use it as the memory probe's negative control)."""

FP32_TINY = torch.finfo(torch.float32).tiny
"""Clamp of the teacher's L1 normaliser and of log(target) (spec §5.3, non-legacy path)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of softmax / LSE / score / loss arithmetic for activations of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_chunks(rows: int) -> Iterator[slice]:
    """Consecutive slices of at most ``ROW_CHUNK`` rows covering ``range(rows)`` (none when ``rows == 0``)."""
    step = max(1, int(ROW_CHUNK))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def row_blocks(tensor: torch.Tensor, dim: int = 1) -> list[torch.Tensor]:
    """``tensor`` cut along ``dim`` into the blocks of :func:`row_chunks` (views). For a tensor that carries a
    gradient: backward joins the blocks' gradients in one ``cat``, where a slice per block (``tensor[:, rows]``)
    makes each block's gradient a zero-filled copy of the whole tensor and adds them up (with the per-segment slices
    that ``thd.segment_rows`` replaced: ~1,100 fills a 4k-row case's reference run, the largest fills of its GPU
    time). Same values."""
    return list(tensor.split(max(1, int(ROW_CHUNK)), dim=dim))


def per_block(block: Callable, *args):
    """``block(*args)`` for one row block. Under autograd with :data:`CHECKPOINT_BLOCKS`, the graph saves only
    ``args`` and the outputs; ``block`` runs again during backward to rebuild what its own backward needs."""
    if CHECKPOINT_BLOCKS and torch.is_grad_enabled():
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)
