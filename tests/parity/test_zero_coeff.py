"""At indexer-loss coefficient 0 every indexer parameter keeps a gradient, exactly 0 (production's contract, its CP
test ``test_thd_cp_zero_indexer_loss_keeps_indexer_grads``: data-parallel training waits for every parameter)."""

import torch

from cases.suites import load_suite
from parity import impls
from parity.engine import RunOptions, run_case
from parity.judge.structure import zero_coeff_problems

ZERO_COEFF = "51ed1802b744"  # smoke: THD layer, r = 4 sparse loss, dsa_indexer_loss_coeff = 0


def test_a_missing_or_non_zero_indexer_gradient_is_a_problem():
    assert zero_coeff_problems(torch.zeros(3, 2)) == []
    assert "no gradient" in zero_coeff_problems(None)[0]
    assert zero_coeff_problems(torch.tensor([0.0, 1e-30])) == ["1 non-zero elements at indexer loss coefficient 0"]


def test_the_zero_coefficient_case_compares_present_zero_indexer_gradients():
    case = next(c for c in load_suite("smoke") if c.id == ZERO_COEFF)
    assert case.config.dsa_indexer_loss_coeff == 0 and case.computes_loss
    ref = impls.load("reference")
    ok = run_case(case, impls.load("fused"), ref, RunOptions(impl="fused", provider="torch"))
    assert ok.outcome == "pass", ok.message
    assert [t.verdict for t in ok.tensors if t.name.startswith("grad/core_attention.indexer.")] == ["pass"] * 6
    # negative control: a loss without its graph leaves the indexer without gradients (None) -> structure fails
    broken = run_case(case, impls.load("tests.parity.fakes:reference_detached_indexer_loss"), ref,
                      RunOptions(impl="tests.parity.fakes:reference_detached_indexer_loss"))
    assert broken.outcome == "fail" and broken.first_failure["tensor"].startswith("grad/core_attention.indexer.")
    assert "no gradient at indexer loss coefficient 0" in broken.message
