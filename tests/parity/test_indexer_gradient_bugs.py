"""Issue 17: the bf16 verdict sees indexer-gradient bugs with margin, and sign-split removes the ReLU-flip noise.

Each planted bug of :mod:`tests.parity.indexer_bugs` must fail every bf16 case it reaches at least ``MARGIN`` x past
the thresholds of the rule that decides it (:func:`~tests.parity.indexer_bugs.deciding_margin`), on smoke's bf16
cases and on the CPU gate subset (``gate-cpu``, ids unchanged), while the same cases pass clean. The fast set is the
smallest smoke case every bug reaches and the gate-cpu 8-row case with the smallest margin before score-split
(e7f61d0aa0bb: one row sees two compressed keys); ``SLOW=1`` runs every bf16 indexer case of both suites.
Negative controls: a wrong activation pattern (every product active) given to the reference moves the truth, so
sign-split cannot launder a difference; without sign-split the clean bf16 indexer gradients do fail the policy.
"""

from __future__ import annotations

import os

import pytest
import torch

import reference
from cases.suites import load_suite
from cases.tensors import materialize
from parity import engine
from parity.engine import RunOptions, run_case
from parity.impls import load
from parity.judge import sign_split
from parity.judge.snapshot import take_snapshot

from .indexer_bugs import BUGS, deciding_margin, kill_margin, reaches

MARGIN = 3.0
OPTIONS = RunOptions(provider="torch", device="cpu")
SLOW = os.environ.get("SLOW") == "1"


def bf16_indexer_cases(suite: str) -> list:
    return [c for c in load_suite(suite)
            if c.dtype == "bfloat16" and c.config.has_indexer and c.training and c.config.dsa_indexer_loss_coeff > 0]


def _smallest(suite: str, keep) -> object:
    return min([c for c in bf16_indexer_cases(suite) if keep(c)], key=lambda c: c.layout.num_tokens)


GATE_FEW_ROWS = "e7f61d0aa0bb"  # noise-floor kill of a 0.8x scale bug: 1.7x before score-split, 4.7x with it


def fast_cases() -> list:
    """The smallest smoke case that every bug reaches (a THD sparse loss, a later segment with 8 real rows)."""
    return [_smallest("smoke", lambda c: all(reaches(bug, c) for bug in BUGS))]


def gate_few_rows_case():
    return next(c for c in bf16_indexer_cases("gate-cpu") if c.id == GATE_FEW_ROWS)


def all_cases() -> list:
    return bf16_indexer_cases("smoke") + bf16_indexer_cases("gate-cpu")


CASES = all_cases() if SLOW else fast_cases() + [gate_few_rows_case()]


def _has_indexer_gradient(result) -> bool:
    """The truth's indexer gradients are not all 0 (some row sees two compressed keys), read off the clean run."""
    for t in result.tensors:
        if t.tensor_class == "grad_indexer":
            if any(m.metric == "max_abs" and m.value > 0 for m in t.metrics):
                return True
    return False


@pytest.fixture(scope="module")
def clean():
    fused, ref = load("fused"), load("reference")
    return {c.id: run_case(c, fused, ref, OPTIONS) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bf16_case_passes_clean_under_sign_split(clean, case):
    res = clean[case.id]
    assert res.outcome == "pass", res.message
    assert res.sign_split is not None and res.sign_split["rejected"] == 0 and res.sign_split["scores"]


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_indexer_bug_killed_with_margin(clean, bug):
    make_impl, planted = BUGS[bug]
    impl, ref = make_impl(), load("reference")
    margins = {}
    for case in CASES:
        if not reaches(bug, case) or not _has_indexer_gradient(clean[case.id]):
            continue
        with planted():
            res = run_case(case, impl, ref, OPTIONS)
        assert res.outcome == "fail", f"{bug} survives {case.id}"
        margins[case.id] = (deciding_margin(res), kill_margin(res))
    assert margins, f"no case reaches {bug}"
    weak = {cid: m for cid, m in margins.items() if any(x is None or not x[0] >= MARGIN for x in m)}
    assert not weak, f"{bug}: killed with a margin under {MARGIN}x (deciding rule, strongest metric): {weak}"


def test_without_sign_split_the_flips_fail_the_policy(monkeypatch):
    """Negative control of the mechanism: judged without sign-split, the clean implementation fails the strict
    grad_indexer policy on a smoke bf16 case whose indexer ReLU bf16 flips (the case of the old policy's
    measurement: one flipped product carried a 17% error of linear_wq_b). Whether a product lands within bf16
    rounding of 0 is the draw's: with :mod:`cases.draws` the case's seed + 28 is the first of its seeds where a flip
    moves a gradient past the policy (searched over offsets 0..28)."""
    case = _smallest("smoke", lambda c: c.is_thd and not c.config.dsa_indexer_use_sparse_loss
                     and c.layout.real_lengths[:3] == (7, 17, 17))
    case = case.replace(seed=case.seed + 28)
    fused, ref = load("fused"), load("reference")
    split = run_case(case, fused, ref, OPTIONS)
    assert split.outcome == "pass" and split.sign_split["adopted"] > 0, split.message
    monkeypatch.setattr(sign_split, "applies", lambda case: False)
    res = run_case(case, fused, ref, OPTIONS)
    assert res.outcome == "fail" and res.first_failure["tensor"].startswith("grad/core_attention.indexer.")


def _noise_scale_error(result) -> float:
    """The bf16 noise run's largest norm-scale error over the indexer gradients (metric ``ref_scale_error``)."""
    return max(m.value for t in result.tensors if t.tensor_class == "grad_indexer" for m in t.metrics
               if m.metric == "ref_scale_error")


def test_without_score_split_the_forward_draw_sets_the_noise_floor(monkeypatch):
    """Negative control of score-split: on the 8-row gate case (one row sees two compressed keys) the noise run's
    indexer gradients, judged without score-split, carry its bf16 forward draw of the scores, amplified by the
    cancellation in softmax(I) - T, as a whole-tensor scale error; with score-split it is arithmetic. How much the
    draw of the scores weighs is the draw's: with :mod:`cases.draws`, at the case's seed + 4, 0.41% without
    score-split against 0.062% with it (at its own seed 0.68% against 0.23%; under the old generator 3.4% / 0.58%)."""
    case = gate_few_rows_case()
    case = case.replace(seed=case.seed + 4)
    fused, ref = load("fused"), load("reference")
    split = run_case(case, fused, ref, OPTIONS)
    assert split.outcome == "pass" and split.sign_split["scores"], split.message
    with_split = _noise_scale_error(split)
    monkeypatch.setattr(sign_split, "split_scores", lambda active, scores: None)
    res = run_case(case, fused, ref, OPTIONS)
    assert res.outcome == "pass" and not res.sign_split["scores"]
    without = _noise_scale_error(res)
    assert with_split < 0.01 and without > 5 * with_split, (with_split, without)


def test_wrong_pattern_moves_the_truth():
    """Negative control: the reference given a wrong pattern (every product active) with a window that admits every
    product moves its indexer gradients a lot; with the policy's window it keeps its own sign outside the ambiguous
    products (counted as ``rejected``) and moves them at most a little."""
    case = fast_cases()[0]
    tensors = materialize(case, "cpu")
    plain = take_snapshot(reference, case, tensors, upcast=True)
    wrong = sign_split.observe(load("fused").api, case, tensors, load("fused").context("torch"))[0].clone().fill_(True)
    loose = take_snapshot(reference, case, tensors, upcast=True,
                          context=lambda: reference.use_activation_pattern(wrong, 1e30))
    window = sign_split.window(case, sign_split.Settings())
    strict = take_snapshot(reference, case, tensors, upcast=True,
                           context=lambda: reference.use_activation_pattern(wrong, window))
    name = "grad/core_attention.indexer.linear_wq_b.weight"
    moved = float((loose[name] - plain[name]).norm() / plain[name].norm())
    kept = float((strict[name] - plain[name]).norm() / plain[name].norm())
    assert moved > 0.05
    assert strict.record["relu_rejected"] > 0
    assert kept < moved / 5


def test_observed_pattern_has_a_head_axis_and_both_signs():
    case = fast_cases()[0]
    tensors = materialize(case, "cpu")
    fused = load("fused")
    active, _ = sign_split.observe(fused.api, case, tensors, fused.context("torch"))
    assert active.dtype == torch.bool and active.shape[-2] == case.config.dsa_indexer_n_heads
    assert 0 < int(active.sum()) < active.numel()


def test_sign_split_skips_float64_and_eval():
    case = fast_cases()[0]
    assert sign_split.applies(case)
    assert not sign_split.applies(case.replace(dtype="float64"))
    assert not sign_split.applies(case.replace(training=False))
    assert engine.observe_pattern(case.replace(dtype="float64"), load("fused"), None, "torch", OPTIONS,
                                  None) is None
