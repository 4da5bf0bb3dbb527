"""An exception inside the code under test is its behaviour on the case — a ``fail`` with rule ``raised`` — when the
implementation's ``raised_in_own_code`` hook places it there; else it stays an ``error``. A registry entry that
expects an error explains both."""

from __future__ import annotations

import torch

from parity import impls
from parity.deviations import known
from parity.engine import RunOptions, run_case
from parity.run.results import CaseResult
from tests.parity.fakes import Raises
from tests.parity.helpers import pick

REF = impls.load("reference")


class RaisesInOwnCode(Raises):
    """Raises in the forward, and says the exception arose in its own code."""

    def raised_in_own_code(self, exc):
        return "megatron/core/x.py:7" if "illegal memory access" in str(exc) else None


own = RaisesInOwnCode("fused")


class RunsOutOfMemoryInOwnCode(RaisesInOwnCode):
    def after(self, res, hidden, psp):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.97 GiB (planted)")

    def raised_in_own_code(self, exc):
        return "megatron/core/x.py:7"


oom = RunsOutOfMemoryInOwnCode("fused")


class CublasCannotAllocateInOwnCode(RunsOutOfMemoryInOwnCode):
    def after(self, res, hidden, psp):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` (planted)")


cublas_alloc = CublasCannotAllocateInOwnCode("fused")


def test_an_exception_in_the_code_under_test_is_a_failure_and_elsewhere_an_error():
    case = pick(dtype="float32", layout="bshd", ratio="0")
    result = run_case(case, impls.load("tests.parity.test_raised:own"), REF, RunOptions())
    assert (result.outcome, result.decided_by) == ("fail", "raised")
    assert "raised in its own code" in result.message and "[megatron/core/x.py:7]" in result.message
    assert result.first_failure["rule"] == "raised"
    # negative control: the same exception from an implementation without the hook is an error
    plain = run_case(case, impls.load("tests.parity.fakes:fused_raises"), REF, RunOptions())
    assert plain.outcome == "error"


def test_out_of_memory_in_the_code_under_test_stays_an_error_that_a_shared_gpu_retries():
    """Running out of device memory is the machine's condition (several workers share one GPU), not the revision's
    behaviour: an ``error``, which the worker pool re-runs alone (:func:`parity.run.worker.is_out_of_memory`); the
    control above shows the same hook making another exception a ``fail``."""
    from parity.run.worker import is_out_of_memory

    case = pick(dtype="float32", layout="bshd", ratio="0")
    result = run_case(case, impls.load("tests.parity.test_raised:oom"), REF, RunOptions())
    assert result.outcome == "error" and "out of memory" in result.message
    row = next(r for r in result.rows() if r["type"] == "case")
    assert is_out_of_memory(row)
    # cuBLAS failing to allocate its handle's workspace is the same condition (a RuntimeError, not torch's type)
    result = run_case(case, impls.load("tests.parity.test_raised:cublas_alloc"), REF, RunOptions())
    assert result.outcome == "error" and "CUBLAS_STATUS_ALLOC_FAILED" in result.message
    assert is_out_of_memory(next(r for r in result.rows() if r["type"] == "case"))


def test_a_broken_hook_leaves_the_exception_an_error():
    class Broken:
        def raised_in_own_code(self, exc):
            raise KeyError("broken")

    assert impls.Implementation("x", Broken()).raised_in_own_code(RuntimeError()) is None
    assert impls.Implementation("x", object()).raised_in_own_code(RuntimeError()) is None


def test_a_crash_entry_explains_a_raised_failure_by_type_and_frame_but_not_a_numeric_one():
    case = pick(dtype="float32", layout="bshd", ratio="0")
    entry = {"id": "e", "upstream": "x", "reason": "r", "evidence": "e", "providers": ["*"], "architectures": ["*"],
             "revisions": {"verified": ["d48bd6be0a"], "introduced": None, "fixed": None}, "match": {},
             "expect": {"raises": {"type": "RuntimeError", "file": "megatron/core/x.py", "function": "f",
                                   "lines": [5, 9]}}}
    crash = {"type": "RuntimeError", "types": ["RuntimeError", "Exception", "BaseException", "object"],
             "file": "/src/megatron/core/x.py", "function": "f", "line": 7}
    raised = CaseResult(case=case, outcome="fail", decided_by="raised", message="expected scalar type Float")
    known.apply(raised, [entry], "unfused", "cpu", "d48bd6be0a", raised=crash)
    assert raised.outcome == "known" and raised.known["was"] == "fail"
    # controls: the same failure raised from another line; a numeric failure with the same message
    elsewhere = CaseResult(case=case, outcome="fail", decided_by="raised", message="expected scalar type Float")
    known.apply(elsewhere, [entry], "unfused", "cpu", "d48bd6be0a", raised=dict(crash, line=12))
    assert elsewhere.outcome == "fail" and "not the registered crash" in elsewhere.message
    numeric = CaseResult(case=case, outcome="fail", decided_by="noise_floor", message="expected scalar type Float")
    known.apply(numeric, [entry], "unfused", "cpu", "d48bd6be0a")
    assert numeric.outcome == "fail"  # an error entry never explains a numeric failure
