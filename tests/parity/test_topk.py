"""The top-k tie-margin protocol (parity/judge/topk.py) and the selection conventions (parity/judge/structure.py)."""

import pytest
import torch

from parity.judge.structure import topk_problems
from parity.judge.topk import compare, reference_topk

NEG = float("-inf")


def test_reference_topk_contract():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, NEG],      # tie at 3: both; then 2
                           [NEG, NEG, NEG, NEG, NEG],      # no valid column
                           [5.0, 5.0, 5.0, 5.0, NEG],      # all tied: lowest ids win
                           [0.0, NEG, NEG, NEG, NEG]], dtype=torch.float64)
    got = reference_topk(scores, 3)
    assert got.tolist() == [[1, 2, 3], [-1, -1, -1], [0, 1, 2], [0, -1, -1]]


def test_structure_catches_each_convention_break():
    scores = torch.tensor([[1.0, 2.0, 3.0, NEG]] * 2, dtype=torch.float64)
    good = torch.tensor([[1, 2], [1, 2]])
    assert topk_problems(good, scores, 2) == []
    assert topk_problems(torch.tensor([[2, 1], [1, 2]]), scores, 2)            # not ascending
    assert topk_problems(torch.tensor([[-1, 2], [1, 2]]), scores, 2)           # -1 not at the end
    assert topk_problems(torch.tensor([[1, -1], [1, 2]]), scores, 2)           # too few real entries
    assert topk_problems(torch.tensor([[2, 3], [1, 2]]), scores, 2)            # column 3 is causally invalid
    assert topk_problems(torch.tensor([[1, 7], [1, 2]]), scores, 2)            # out of range
    assert topk_problems(torch.tensor([[1, 2, -1], [1, 2, -1]]), scores, 2)    # wrong width
    assert topk_problems(good.int(), scores, 2)                                # int32, not int64


def _synthetic(seed: int, problems: int = 1, rows: int = 24, cols: int = 40, k: int = 8):
    """Quantised scores with many exact ties and near-ties, and a noisy "implementation" that ranks its own scores
    and breaks ties its own way (a random column order per row). ``problems`` independent draws are stacked."""
    g = torch.Generator().manual_seed(seed)
    n = rows * problems
    truth = torch.round(torch.randn(n, cols, generator=g, dtype=torch.float64) * 4) / 4
    visible = torch.randint(0, cols + 1, (n, 1), generator=g)
    truth = torch.where(torch.arange(cols) < visible, truth, torch.full_like(truth, NEG))
    noise = 1e-3
    impl_scores = truth + noise * (2 * torch.rand(n, cols, generator=g, dtype=torch.float64) - 1)
    lowp_scores = truth + noise * (2 * torch.rand(n, cols, generator=g, dtype=torch.float64) - 1)
    perm = torch.argsort(torch.rand(n, cols, generator=g), dim=1)
    picked = reference_topk(torch.gather(impl_scores, 1, perm), k)
    impl_idx = torch.where(picked >= 0, torch.gather(perm, 1, picked.clamp_min(0)), torch.full_like(picked, cols))
    impl_idx = torch.sort(impl_idx, 1).values
    impl_idx[impl_idx == cols] = -1
    return truth, impl_scores, lowp_scores, impl_idx, k


def test_tie_protocol_never_fails_spuriously_over_1000_seeds():
    """1,000 seeds, each 24 tie-heavy rows (rows are independent, so each seed's draw is judged in one batch)."""
    tied = clear = 0
    for seed in range(1000):
        truth, impl_scores, lowp, idx, k = _synthetic(seed)
        rep = compare(idx, truth, impl_scores, lowp, k, torch.float32)
        assert rep.passed, (seed, rep.first_failure)
        tied, clear = tied + rep.tied, clear + rep.clear
    assert tied > 1000 and clear > 1000  # both regimes are really exercised


def test_synthetic_selections_are_well_formed():
    truth, _, _, idx, k = _synthetic(0, problems=200)
    assert topk_problems(idx, truth, k) == []


def test_tie_protocol_rejects_a_wrong_selection():
    """Negative control: replacing the best selected column by the worst valid one fails, clear or tied."""
    caught = 0
    for seed in range(200):
        truth, impl_scores, lowp, idx, k = _synthetic(seed)
        bad = idx.clone()
        row = int(torch.isfinite(truth).sum(1).argmax())
        if torch.isfinite(truth[row]).sum() <= k:
            continue
        chosen = set(bad[row].tolist())
        worst = min((c for c in range(truth.shape[1]) if torch.isfinite(truth[row, c]) and c not in chosen),
                    key=lambda c: float(truth[row, c]))
        if float(truth[row].max()) - float(truth[row, worst]) < 0.5:
            continue  # the row is (nearly) flat: swapping changes nothing measurable
        best = max(chosen, key=lambda c: float(truth[row, c]))
        bad[row] = torch.tensor(sorted((chosen - {best}) | {worst}))
        rep = compare(bad, truth, impl_scores, lowp, k, torch.float32)
        assert not rep.passed, seed
        assert rep.first_failure.startswith(f"row {row}")
        caught += 1
    assert caught > 150


def test_clear_row_requires_the_exact_set_even_if_values_are_close():
    truth = torch.tensor([[1.0, 0.9, 0.1]], dtype=torch.float64)  # margin 0.8 ≫ noise
    rep = compare(torch.tensor([[0, 2]]), truth, truth, truth, 2, torch.float64)
    assert rep.clear == 1 and rep.mismatched_clear == 1 and not rep.passed
    ok = compare(torch.tensor([[0, 1]]), truth, truth, truth, 2, torch.float64)
    assert ok.passed and ok.summary() == {"clear": 1, "tied": 0, "rows": 1, "exact_tied": 0, "tie_rule": "arbitrary"}


def test_exact_tie_is_tied_and_either_choice_passes():
    truth = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    for choice in ([0, 1], [0, 2]):
        rep = compare(torch.tensor([choice]), truth, truth, truth, 2, torch.float64)
        assert rep.tied == 1 and rep.passed, choice
    bad = compare(torch.tensor([[0, 3]]), truth, truth, truth, 2, torch.float64)
    assert not bad.passed and bad.mismatched_tied == 1


def test_declared_lower_index_rule_is_enforced_on_exactly_tied_rows_only():
    own = torch.tensor([[2.0, 1.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    lower = torch.tensor([[0, 1], [0, 1]])
    higher = torch.tensor([[0, 2], [0, 1]])  # row 0 takes the higher of the tied columns
    for rule in ("arbitrary", "lower-index"):
        assert compare(lower, own, own, own, 2, torch.float64, tie_rule=rule).passed, rule
    loose = compare(higher, own, own, own, 2, torch.float64, tie_rule="arbitrary")
    assert loose.passed and loose.exact_tied == 0  # the value-based protocol alone accepts either tied column
    strict = compare(higher, own, own, own, 2, torch.float64, tie_rule="lower-index")
    assert not strict.passed and strict.exact_tied == 1 and strict.mismatched_tie_rule == 1
    assert "row 0" in strict.first_failure and "[0, 1]" in strict.first_failure
    assert strict.summary()["tie_rule"] == "lower-index"


def test_the_tie_rule_reads_the_implementations_own_scores():
    """Ties in the implementation's scores (e.g. made by rounding) bind it even where the reference has none."""
    truth = torch.tensor([[2.0, 1.0, 1.0 - 1e-12, 0.0]], dtype=torch.float64)
    own = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    rep = compare(torch.tensor([[0, 2]]), truth, own, None, 2, torch.float64, tie_rule="lower-index")
    assert rep.exact_tied == 1 and rep.mismatched_tie_rule == 1
    assert compare(torch.tensor([[0, 1]]), truth, own, None, 2, torch.float64, tie_rule="lower-index").passed
    with pytest.raises(ValueError, match="tie rule"):
        compare(torch.tensor([[0, 1]]), truth, own, None, 2, torch.float64, tie_rule="highest")
