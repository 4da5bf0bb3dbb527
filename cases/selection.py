"""The split-mode ``topk_indices`` contract, one validation for both implementations (ARCHITECTURE.md).

A caller-supplied selection (``attention_layer`` / ``core_attention`` with ``topk_indices=``) must be:

* an **int64** tensor ``[*lead, K]`` — ``lead`` the rows of the call (``[B, S]`` or ``[T]``), width exactly
  ``K = dsa_indexer_topk`` (pad with ``-1``);
* in **range**: every id is ``-1`` or a local compressed id ``0 <= g < n_comp`` of the row's sequence (BSHD:
  ``S // 4``; THD: the padded segment length ``// 4``; slack rows have none);
* **padded at the end**: the real ids form a prefix, ``-1`` after them;
* **sorted**: the real ids strictly ascending (no duplicates).

Ids past the row's causal limit (``g >= floor((i+1)/4)``) are in range and ignored by both implementations (they
attend only to causally valid entries). A bad selection raises :class:`~cases.errors.CaseError` on
``topk_indices`` naming the row and the offending value.
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import ModelConfig
from .errors import CaseError
from .layout import PackedSeqParams

ARGUMENT = "topk_indices"


def _row_name(flat_row: int, lead: tuple) -> str:
    if len(lead) == 2:
        return f"row [{flat_row // lead[1]}, {flat_row % lead[1]}]"
    return f"row {flat_row}"


def compressed_columns(lead: tuple, packed_seq_params: Optional[PackedSeqParams], ratio: int = 4
                       ) -> Optional[torch.Tensor]:
    """int64 ``[rows]``: the number of local compressed ids of each row's sequence (flattened ``lead``); None when
    the THD metadata is not usable (its own validation reports that)."""
    if packed_seq_params is None:
        return torch.full((lead[0] * lead[1],), lead[1] // ratio, dtype=torch.int64)
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
        return None
    bounds = cu.detach().cpu().long()
    per_segment = torch.cat([(bounds[1:] - bounds[:-1]) // ratio, torch.zeros(1, dtype=torch.int64)])
    rows = torch.arange(lead[0])
    segment = (torch.searchsorted(bounds, rows, right=True) - 1).clamp(0, per_segment.numel() - 1)
    segment = torch.where(rows < bounds[-1], segment, per_segment.numel() - 1)  # slack rows: no columns
    return per_segment[segment]


def check_topk_selection(topk_indices: Optional[torch.Tensor], config: ModelConfig, lead: tuple,
                         packed_seq_params: Optional[PackedSeqParams] = None) -> None:
    """Raise :class:`CaseError` if ``topk_indices`` breaks the split-mode contract (module docstring)."""
    if topk_indices is None:
        return
    if not config.has_indexer:
        raise CaseError(ARGUMENT, "given, but this layer has no indexer")
    k = config.dsa_indexer_topk
    want = f"int64 [{', '.join(map(str, lead))}, {k}]"
    if not isinstance(topk_indices, torch.Tensor):
        raise CaseError(ARGUMENT, f"must be a tensor {want}, got {type(topk_indices).__name__}")
    shape, dtype = tuple(topk_indices.shape), str(topk_indices.dtype).removeprefix("torch.")
    if topk_indices.dim() != len(lead) + 1 or shape[:-1] != tuple(lead):
        raise CaseError(ARGUMENT, f"must be {want}, got {dtype} {shape}")
    if topk_indices.dtype != torch.int64:
        raise CaseError(ARGUMENT, f"must be {want}, got dtype {dtype}")
    if shape[-1] != k:
        raise CaseError(ARGUMENT, f"has width {shape[-1]}, expected K = {k} (pad with -1)")
    ids = topk_indices.detach().reshape(-1, k).cpu()
    if ids.numel() == 0:
        return
    columns = compressed_columns(tuple(lead), packed_seq_params)
    real = ids >= 0

    def fail(bad: torch.Tensor, what) -> None:
        rows = bad.nonzero()
        if rows.numel():
            row, slot = int(rows[0, 0]), int(rows[0, 1])
            raise CaseError(ARGUMENT, f"{_row_name(row, tuple(lead))}: {what(row, slot)}; got {ids[row].tolist()}")

    fail(ids < -1, lambda row, slot: f"id {int(ids[row, slot])} is below -1 (the padding id)")
    if columns is not None:
        fail(ids >= columns.unsqueeze(-1),
             lambda row, slot: f"id {int(ids[row, slot])} is out of range: the row's sequence has "
                               f"{int(columns[row])} compressed entries (ids 0..{int(columns[row]) - 1}, or -1)")
    fail(real[:, 1:] & ~real[:, :-1],
         lambda row, slot: f"id {int(ids[row, slot + 1])} follows -1 padding (-1 goes after the real ids)")
    fail(real[:, 1:] & (ids[:, 1:] <= ids[:, :-1]),
         lambda row, slot: f"id {int(ids[row, slot + 1])} after {int(ids[row, slot])}: real ids must be strictly "
                           "ascending")


__all__ = ["check_topk_selection", "compressed_columns"]
