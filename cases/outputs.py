"""What an implementation returns: the same record for ``reference`` and ``fused`` so ``parity`` can diff them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionOutput:
    """Result of ``attention_layer`` or ``core_attention``.

    Shapes use BSHD ``[B, S, ...]`` or THD ``[T, ...]`` leading dims ("rows"):

    * ``out``: layer ``[rows, Hd]`` (after the output projection) or core ``[rows, n, D]`` (before inverse RoPE).
      Rows with no key (THD slack rows) give 0. Padding rows carry values but no gradient.
    * ``lse``: ``[rows, n]`` fp32, natural-log sum-exp of the attention logits over window ∪ compressed keys,
      **without** the sink (FlashMLA convention); ``-inf`` for a row with no key.
    * ``indexer_loss``: 0-d fp32, coefficient applied; None when no loss is computed (no indexer, or eval).
    * ``topk_indices``: ``[rows, K]`` int64 *local* compressed ids (``g`` of the segment), sorted ascending, ``-1``
      padding at the end; None for layers without an indexer.
    * ``index_scores``: ``[B, S, n_comp]`` / ``[T, max_seqlen // 4]`` fp32 indexer scores ``I[t, g]`` by local
      compressed id, ``-inf`` where not causally valid; None without an indexer.
    """

    out: torch.Tensor
    lse: torch.Tensor
    indexer_loss: Optional[torch.Tensor] = None
    topk_indices: Optional[torch.Tensor] = None
    index_scores: Optional[torch.Tensor] = None

    def objective(self, grad_output: torch.Tensor) -> torch.Tensor:
        """The scalar whose gradients are compared: ``sum(out · dO) + indexer_loss`` (in float64 for accuracy)."""
        total = (self.out.double() * grad_output.double()).sum()
        if self.indexer_loss is not None:
            total = total + self.indexer_loss.double()
        return total
