"""Where a failing tensor is worst: the index of its greatest absolute difference, said in the case's own terms.

As ``torch.testing.assert_close`` does, a failure names the index of the worst element; here the row index is also
decoded: BSHD ``batch b, position s``; THD ``segment b, position s`` (``s`` counted from the segment's padded start,
``cu_seqlens_padded[b]``); and ``head h`` where the dimension after the rows is the attention head (``lse``, the
core-scope ``out`` and ``grad/query``). Only the compared elements count (real rows; causally valid indexer
scores); a NaN counts as the greatest difference.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from cases.case import Case
from cases.layout import BshdLayout

#: Tensors whose first dimension after the rows is the attention head.
_HEAD_TENSORS = ("lse", "grad/query")


def worst_index(a: torch.Tensor, r: torch.Tensor, compared: torch.Tensor) -> Optional[tuple[int, ...]]:
    """Index of the greatest ``|a - r|`` among the ``compared`` elements (bool, broadcastable to ``a``), or
    ``None`` if nothing is compared."""
    compared = compared.expand(a.shape)
    if a.numel() == 0 or not bool(compared.any()):
        return None
    err = (a.double() - r.double()).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, torch.inf), err)
    err = torch.where(compared.to(err.device), err, torch.full_like(err, -1.0))
    flat = int(err.reshape(-1).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))


def describe(case: Case, name: str, index: tuple[int, ...], row_tensor: bool) -> str:
    """``index (i, j, ...)`` and, for a row tensor, where that is in the case."""
    text = f"index {index}"
    if not row_tensor:
        return text
    layout = case.layout
    if isinstance(layout, BshdLayout):
        parts, rest = [f"batch {index[0]}", f"position {index[1]}"], index[2:]
    else:
        row, bounds = index[0], list(layout.cu_seqlens_padded)
        segment = bisect.bisect_right(bounds, row) - 1
        if 0 <= segment < layout.num_segments:
            parts = [f"segment {segment}", f"position {row - bounds[segment]}"]
        else:
            parts = [f"slack row {row}"]
        rest = index[1:]
    if rest and (name in _HEAD_TENSORS or (name == "out" and case.scope == "core")):
        parts.append(f"head {rest[0]}")
    return f"{text} ({', '.join(parts)})"


def where_worst(case: Case, name: str, a: torch.Tensor, r: torch.Tensor, real_rows: Optional[torch.Tensor]) -> str:
    """`` at index (...) (...)``: the greatest absolute difference of ``a`` from ``r`` (unrestricted tensors);
    ``real_rows`` (the case's bool row mask) for a row tensor, ``None`` otherwise. Empty if nothing is compared."""
    compared = torch.ones((), dtype=torch.bool, device=a.device) if real_rows is None else row_mask(real_rows, a)
    if name == "index_scores":
        compared = compared & torch.isfinite(r)
    index = worst_index(a, r, compared)
    if index is None:
        return ""
    return f"; greatest absolute difference at {describe(case, name, index, real_rows is not None)}"


def first_where(case: Case, name: str, bad: torch.Tensor, row_tensor: bool) -> str:
    """``, first at index (...) (...)``: the first ``True`` element of ``bad`` (empty if there is none)."""
    hits = bad.nonzero()
    if not len(hits):
        return ""
    return f", first at {describe(case, name, tuple(int(i) for i in hits[0]), row_tensor)}"


def row_mask(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The bool row mask ``rows`` (``[B, S]`` or ``[T]``) broadcast over the trailing dims of ``x``."""
    return rows.to(x.device).reshape(tuple(rows.shape) + (1,) * (x.dim() - rows.dim())).expand(x.shape)
