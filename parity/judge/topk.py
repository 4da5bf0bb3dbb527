"""Tie-margin-aware comparison of top-k selections (spec parity-anchors §9.5, §12 "Top-k protocol").

Per query row, with the float64 reference scores ``r`` (``-inf`` where not causally valid) and ``K`` slots:

* ``n_valid ≤ K``: every valid column must be selected — the row is *clear* (no choice was made).
* otherwise the *margin* is ``r_(K) - r_(K+1)`` (K-th minus (K+1)-th largest score) and the *score noise* is

      δ = margin_factor · (max_j |a_j - r_j| ∨ max_j |p_j - r_j|  +  ulps · eps · max_j |r_j|)

  over the row's valid columns, ``a`` the implementation's scores and ``p`` the same-dtype reference's. An
  implementation that ranks ``r + e`` with ``|e| ≤ δ`` can only swap columns whose true scores lie within ``2δ``.
  - *clear* row (``margin > 2δ``): the selected **set** must equal the reference's.
  - *tied* row: the selection is compared by **gathered values** — the sorted reference scores of the selected
    columns must match the sorted top-K reference scores within ``2δ`` each.

* *exactly tied* row (the implementation's own scores ``a`` have ``a_(K) == a_(K+1)``): an implementation that
  **declares** the tie rule ``lower-index`` (:data:`TIE_RULES`; ``reference``, ``fused``'s torch provider) must
  select exactly what that rule gives on ``a``; one that declares ``arbitrary`` (production kernels: cuDNN top-k,
  ``torch.topk``) is held to the value-based rule above only.

:func:`compare` returns a :class:`TopkReport` with the row counts per regime (the ``topk`` field of the ``case``
row) and the first mismatch. It works on the device its tensors are on: on CUDA the sorts run there and the counts
come back in one transfer (a passing selection waits for the GPU once). Structure (width, ``-1`` padding, ascending
order, validity) is checked separately by :mod:`parity.judge.structure`; this module assumes a structurally valid
selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from parity.judge.metrics import eps

#: Declared top-k tie behaviour: ``lower-index`` = among equal scores the lower compressed index wins, always
#: (deterministic); ``arbitrary`` = any of the tied columns (production kernels).
TIE_RULES = ("lower-index", "arbitrary")


@dataclass
class TopkReport:
    rows: int = 0
    clear: int = 0
    tied: int = 0
    mismatched_clear: int = 0
    mismatched_tied: int = 0
    worst_gap_ratio: float = 0.0  # max over tied rows of (value gap / 2δ); ≤ 1 passes
    exact_tied: int = 0            # rows exactly tied at the K boundary in the implementation's own scores
    mismatched_tie_rule: int = 0   # of those, rows whose selection breaks the declared tie rule
    tie_rule: str = "arbitrary"
    first_failure: Optional[str] = None

    @property
    def passed(self) -> bool:
        return self.mismatched_clear == 0 and self.mismatched_tied == 0 and self.mismatched_tie_rule == 0

    def summary(self) -> dict:
        """The ``topk`` field of the results ``case`` row."""
        return {"clear": self.clear, "tied": self.tied, "rows": self.rows, "exact_tied": self.exact_tied,
                "tie_rule": self.tie_rule}


def reference_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The contract's selection: top ``k`` by score, ties to the lower column, ids ascending, ``-1`` padded.

    ``scores``: ``[R, C]`` with ``-inf`` for invalid columns. Returns ``[R, k]`` int64 on the device of ``scores``.
    """
    R, C = scores.shape
    out = torch.full((R, k), -1, dtype=torch.int64, device=scores.device)
    if C == 0 or k == 0:
        return out
    # stable descending sort keeps the lower column first among equal scores
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    valid = torch.isfinite(torch.gather(scores, 1, order))
    chosen = torch.where(valid, order, torch.full_like(order, C))
    chosen = torch.sort(chosen, dim=1).values
    chosen = chosen.masked_fill(chosen == C, -1)  # not chosen[chosen == C]: a boolean index reads the mask back
    out[:, :chosen.shape[1]] = chosen
    return out


def _descending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [R, C]`` sorted descending, padded with ``-inf`` so that column ``k`` (the (K+1)-th) exists."""
    R, C = scores.shape
    fill = torch.full((R, max(k + 1 - C, 1)), -math.inf, dtype=torch.float64, device=scores.device)
    return torch.cat([torch.sort(scores, dim=1, descending=True).values, fill], 1)


def tie_rule_mismatches(impl_idx: torch.Tensor, impl_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exactly tied rows, rows breaking the lower-index rule)``, bool ``[R]`` each: rows whose own scores
    ``impl_scores [R, C]`` (float64, ``-inf`` invalid) tie exactly at the K boundary, and those of them whose
    selection ``impl_idx`` is not :func:`reference_topk` of those scores."""
    scores = torch.where(torch.isnan(impl_scores), -math.inf, impl_scores)
    top = _descending(scores, k)
    exact = (torch.isfinite(scores).sum(1) > k) & (top[:, k - 1] == top[:, k])
    return exact, exact & (impl_idx != reference_topk(scores, k)).any(1)


def compare(impl_idx: torch.Tensor, ref_scores: torch.Tensor, impl_scores: Optional[torch.Tensor],
            noise_scores: Optional[torch.Tensor], k: int, score_dtype: torch.dtype, ulps: float = 2.0,
            margin_factor: float = 1.0, tie_rule: str = "arbitrary") -> TopkReport:
    """Compare the implementation's selection ``impl_idx [R, k]`` with the reference scores ``ref_scores [R, C]``.

    ``impl_scores`` / ``noise_scores``: the implementation's and the same-dtype reference's scores ``[R, C]``
    (either may be None). All score tensors float64, ``-inf`` where invalid. ``tie_rule``: the implementation's
    declared rule (:data:`TIE_RULES`), enforced on its exactly tied rows when ``impl_scores`` is given.
    """
    if tie_rule not in TIE_RULES:
        raise ValueError(f"unknown top-k tie rule {tie_rule!r} (known: {', '.join(TIE_RULES)})")
    rep = TopkReport(rows=int(ref_scores.shape[0]), tie_rule=tie_rule)
    if rep.rows == 0:
        return rep
    R, C = ref_scores.shape
    device = ref_scores.device
    impl_idx = impl_idx.to(device)
    ref_idx = reference_topk(ref_scores, k)
    valid = torch.isfinite(ref_scores)
    n_valid = valid.sum(1)
    zero = torch.zeros_like(ref_scores)
    r0 = torch.where(valid, ref_scores, zero)  # -inf → 0 for magnitudes and gathers

    def row_err(x: Optional[torch.Tensor]) -> torch.Tensor:
        if x is None:
            return torch.zeros(R, dtype=torch.float64, device=device)
        d = torch.where(valid & torch.isfinite(x), (x - ref_scores).abs(), zero)
        return d.amax(1) if C else torch.zeros(R, dtype=torch.float64, device=device)

    scale = r0.abs().amax(1) if C else torch.zeros(R, dtype=torch.float64, device=device)
    observed = torch.maximum(row_err(impl_scores), row_err(noise_scores))
    delta = margin_factor * (observed + ulps * eps(score_dtype) * scale)

    sorted_desc = _descending(ref_scores, k)
    margin = torch.where(n_valid > k, sorted_desc[:, k - 1] - sorted_desc[:, k],
                         torch.full((R,), math.inf, dtype=torch.float64, device=device))
    clear = margin > 2 * delta

    # clear rows: identical sets (both sorted ascending with -1 at the end)
    set_mismatch = clear & (impl_idx != ref_idx).any(1)

    # tied rows: sorted gathered reference values within 2δ of the true top-k values
    safe = impl_idx.clamp(0, max(C - 1, 0))
    gathered = torch.where(impl_idx >= 0, torch.gather(r0, 1, safe) if C else safe.double(),
                           torch.full(impl_idx.shape, -math.inf, dtype=torch.float64, device=device))
    gathered = torch.sort(gathered, dim=1, descending=True).values
    top = sorted_desc[:, :k]
    both_inf = torch.isinf(gathered) & (gathered == top)
    gap = torch.where(both_inf, torch.zeros_like(top), (gathered - top).abs()).amax(1)
    tol = 2 * delta
    ratio = torch.where(tol > 0, gap / tol, torch.where(gap > 0, math.inf, 0.0))
    tied_bad = (~clear) & (ratio > 1)
    exact = rule_bad = torch.zeros(R, dtype=torch.bool, device=device)
    if tie_rule == "lower-index" and impl_scores is not None and k > 0:
        exact, rule_bad = tie_rule_mismatches(impl_idx, impl_scores.to(device), k)
    # every count and the worst tied ratio in one read (float64 holds counts exactly)
    counts = [m.sum().double() for m in (clear, ~clear, set_mismatch, tied_bad, exact, rule_bad)]
    *counted, worst = torch.stack(counts + [torch.where(~clear, ratio, -math.inf).amax()]).tolist()
    (rep.clear, rep.tied, rep.mismatched_clear, rep.mismatched_tied, rep.exact_tied,
     rep.mismatched_tie_rule) = (int(n) for n in counted)
    if rep.tied:
        rep.worst_gap_ratio = worst

    if rep.mismatched_clear:
        row = int(set_mismatch.nonzero()[0, 0])
        rep.first_failure = (f"row {row}: selected {impl_idx[row].tolist()} but the reference selects "
                             f"{ref_idx[row].tolist()} (margin {float(margin[row]):.3g} > "
                             f"2·noise {float(tol[row]):.3g})")
    elif rep.mismatched_tied:
        row = int(tied_bad.nonzero()[0, 0])
        rep.first_failure = (f"row {row} (near-tie, margin {float(margin[row]):.3g}): selected values differ from the "
                             f"top-{k} by {float(gap[row]):.3g} > 2·noise {float(tol[row]):.3g}")
    elif rep.mismatched_tie_rule:
        row = int(rule_bad.nonzero()[0, 0])
        want = reference_topk(torch.where(torch.isnan(impl_scores[row:row + 1]), -math.inf,
                                          impl_scores[row:row + 1]), k)[0]
        rep.first_failure = (f"row {row} (exact tie at the K boundary in its own scores): selected "
                             f"{impl_idx[row].tolist()} but its declared tie rule (lower index wins) selects "
                             f"{want.tolist()}")
    return rep
