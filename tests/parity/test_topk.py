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


def _report(rep) -> dict:
    return {f: getattr(rep, f) for f in ("rows", "clear", "tied", "mismatched_clear", "mismatched_tied",
                                         "worst_gap_ratio", "exact_tied", "mismatched_tie_rule", "first_failure")}


def test_a_passing_selection_reads_its_counts_back_once():
    """The protocol's counts and worst tied ratio come back in one transfer (on a GPU one wait per selection, the
    sorts staying there). Controls: the batch really has tied, clear and exactly tied rows; a failing selection
    reads its first failure's detail too, and the counts it reports are the per-row checks' own."""
    from bench.ops import HostReads

    truth, impl_scores, lowp, idx, k = _synthetic(3, problems=20)
    with HostReads() as reads:
        rep = compare(idx, truth, impl_scores, lowp, k, torch.float32, tie_rule="lower-index")
    assert reads.total == 1, dict(reads.by_op)
    assert rep.passed and rep.tied > 0 and rep.clear > 0 and rep.clear + rep.tied == rep.rows
    near = compare(idx, lowp, impl_scores, truth, k, torch.float32)  # judged against a noisy truth: gaps > 0
    assert near.passed and 0 < near.worst_gap_ratio <= 1
    lower = reference_topk(truth, k)  # quantised scores: exact ties at the K boundary, broken by the rule
    own = compare(lower, truth, truth, truth, k, torch.float32, tie_rule="lower-index")
    assert own.passed and own.exact_tied > 0 and own.mismatched_tie_rule == 0
    bad = idx.clone()
    bad[0] = torch.where(bad[0] >= 0, (bad[0] + 1) % truth.shape[1], bad[0])
    with HostReads() as reads:
        failed = compare(bad, truth, impl_scores, lowp, k, torch.float32)
    assert not failed.passed and reads.total > 1 and failed.first_failure.startswith("row 0")
    assert failed.mismatched_clear + failed.mismatched_tied == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule", ["arbitrary", "lower-index"])
def test_the_protocol_on_the_gpu_reports_what_it_reports_on_the_cpu(rule):
    """The same report, field for field, from CUDA tensors as from their CPU copies (sorts, gathers and float64
    elementwise arithmetic are exact on both), for a passing batch and for one with a wrong row (control)."""
    truth, impl_scores, lowp, idx, k = _synthetic(5, problems=50)
    bad = idx.clone()
    bad[7] = torch.where(bad[7] >= 0, (bad[7] + 3) % truth.shape[1], bad[7])
    for sel in (idx, bad):
        on_cpu = compare(sel, truth, impl_scores, lowp, k, torch.float32, tie_rule=rule)
        on_gpu = compare(sel.cuda(), truth.cuda(), impl_scores.cuda(), lowp.cuda(), k, torch.float32, tie_rule=rule)
        assert _report(on_gpu) == _report(on_cpu)
    assert on_cpu.first_failure is not None  # the control failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_conventions_on_the_gpu_read_as_on_the_cpu():
    """``topk_problems`` names the same problems from CUDA tensors as from CPU copies: a well-formed batch (none)
    and each convention break of a row (controls)."""
    truth, _, _, idx, k = _synthetic(2, problems=10)
    broken = [idx]
    for change in (lambda t: t.__setitem__((4, 0), truth.shape[1]),    # out of range
                   lambda t: t.__setitem__((5, 0), -1),                 # -1 before a real id / fewer entries
                   lambda t: t.__setitem__(6, t[6].flip(0))):           # not ascending
        bad = idx.clone()
        change(bad)
        broken.append(bad)
    for sel in broken:
        assert topk_problems(sel.cuda(), truth.cuda(), k) == topk_problems(sel, truth, k)
    assert all(topk_problems(sel, truth, k) for sel in broken[1:])
