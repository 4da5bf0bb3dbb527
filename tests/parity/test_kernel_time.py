"""The implementation's kernel time in a case row (parity/run/kernel_time.py, the engine's ``impl`` phase)."""

from __future__ import annotations

import pytest

from cases.suites import load_suite
from parity.engine import RunOptions, run_case
from parity.impls import load
from parity.run.kernel_time import KernelTime
from parity.run.results import CaseResult


def test_outermost_calls_only_and_a_raised_call_left_out():
    timer = KernelTime("cpu")
    with timer.observe("indexer_fwd", "torch"):
        with timer.observe("indexer_top_k", "torch"):  # inside another call: not counted again
            pass
    with pytest.raises(RuntimeError):
        with timer.observe("sparse_attn_fwd", "torch"):
            raise RuntimeError("refused")
    with timer.observe("sparse_attn_bwd", "torch"):
        pass
    assert timer.calls == 2
    record = timer.record()
    assert record["calls"] == 2 and record["seconds"] >= 0.0


def _smallest_training_case():
    cases = [c for c in load_suite("smoke") if c.training and c.config.has_indexer and c.dtype == "float32"]
    return cases[0]


def test_the_case_row_carries_the_implementations_kernel_calls():
    case = _smallest_training_case()
    options = RunOptions(provider="torch", device="cpu")
    result = run_case(case, load("fused"), load("reference"), options)
    assert result.outcome == "pass", result.message
    kernels = result.impl_kernels
    assert kernels["calls"] > 0 and kernels["seconds"] > 0.0
    assert kernels["seconds"] <= result.phases_s["impl"]  # the calls are inside the implementation's run
    row = result.case_row()
    assert row["impl_kernels"] == kernels
    assert CaseResult.from_rows(result.rows()).impl_kernels == kernels


def test_an_implementation_without_the_hook_times_nothing():
    """Negative control: the reference against itself has no ``observe_kernels``: no ``impl_kernels`` in its row."""
    case = _smallest_training_case()
    result = run_case(case, load("reference"), load("reference"), RunOptions(device="cpu"))
    assert result.impl_kernels is None and "impl_kernels" not in result.case_row()
