"""Padding rows pass no gradient at every scope: the layer fix, the ``padding-dout`` oracle, the ``contract`` rule of
``run`` and the ``padding_dout`` case field — each with a negative control (a planted leak must fail it)."""

from __future__ import annotations

import pytest
import torch

import fused
import reference
from cases.case import Case
from cases.coverage import features
from cases.errors import CaseError
from cases.generator import sample_case
from cases.layout import BshdLayout, ThdLayout
from cases.profiles import get_profile
from cases.rng import Rng
from cases.tensors import DOUT_POISON, materialize
from parity import impls
from parity.engine import RunOptions, run_case
from parity.judge.snapshot import take_snapshot
from parity.mutation.mutants import activate
from parity.oracles.metamorphic import applicable, run_oracle
from tests.parity.helpers import pick

REF = impls.load("reference")
LEAKY_WEIGHTS = ("grad/linear_proj.weight", "grad/linear_o_group_proj")


def _repro_case(padding_dout: str = "poison") -> Case:
    """Issue 16's repro: window-only tiny layer, one segment of 1 real token in 2 physical rows."""
    layout = ThdLayout(cu_seqlens=(0, 1), cu_seqlens_padded=(0, 2), total_tokens=2, compressed_capacity=None)
    return Case(config=get_profile("tiny").config(0), layout=layout, dtype="float64", scope="layer", seed=3,
                padding_dout=padding_dout)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_layer_weight_gradients_ignore_padding_row_dout():
    case = _repro_case()
    t = materialize(case)
    assert t.packed_seq_params.max_seqlen_q == 2 and bool((t.grad_output[1] != 0).all())  # random dO on both rows
    got, want = take_snapshot(fused, case, t), take_snapshot(reference, case, t)
    for name in LEAKY_WEIGHTS:
        assert _rel(got[name], want[name]) < 1e-12, name
    with activate("layer_padding_dout_leaks"):  # negative control: today's bug, planted back
        leaked = take_snapshot(fused, case, t)
    for name in LEAKY_WEIGHTS:
        assert _rel(leaked[name], want[name]) > 1e-2, name


@pytest.mark.parametrize("features", [dict(scope="layer", padding_dout="poison"),
                                      dict(scope="core", layout="thd", alignment_padding=True),
                                      dict(scope="layer", layout="thd", dummy_tail=True),
                                      dict(scope="layer", layout="thd", slack=True)])
def test_padding_dout_oracle_holds_for_both_and_catches_a_leak(features):
    case = pick(**features)
    assert applicable("padding-dout", case)
    for name in ("reference", "fused"):
        result = run_oracle("padding-dout", case, impls.load(name), RunOptions(impl=name))
        assert result.outcome == "pass", (name, result.message)
        assert result.tensors and all(t.rule == "exact" for t in result.tensors)
    leak = run_oracle("padding-dout", case, impls.load("tests.parity.fakes:reference_pad_dout_leak"), RunOptions())
    assert leak.outcome == "fail" and leak.first_failure["tensor"].startswith("grad/"), leak.message


def test_padding_dout_oracle_fails_on_the_planted_layer_bug():
    case = _repro_case("default")
    assert applicable("padding-dout", case)
    assert run_oracle("padding-dout", case, impls.load("fused"), RunOptions()).outcome == "pass"
    with activate("layer_padding_dout_leaks"):
        result = run_oracle("padding-dout", case, impls.load("fused"), RunOptions())
    assert result.outcome == "fail" and result.first_failure["tensor"] in LEAKY_WEIGHTS, result.message
    assert not applicable("padding-dout", case.replace(layout=BshdLayout(1, 4), padding_dout="default"))


def test_run_reports_a_leak_as_a_contract_violation_not_a_numerics_difference():
    case = _repro_case()
    options = RunOptions()
    clean = run_case(case, impls.load("fused"), REF, options)
    assert clean.outcome == "pass", clean.message
    contract = next(t for t in clean.tensors if t.name == "contract/padding_dout")
    assert contract.verdict == "pass" and contract.rule == "contract" and contract.tensor_class == "contract"
    with activate("layer_padding_dout_leaks"):
        leaked = run_case(case, impls.load("fused"), REF, options)
    assert leaked.outcome == "fail" and leaked.decided_by == "contract", leaked.message
    assert leaked.first_failure["tensor"] == "contract/padding_dout"
    assert "linear_o_group_proj" in leaked.message or "linear_proj" in leaked.message
    # a numerics difference without a leak is decided by a numeric rule, and the contract holds
    biased = run_case(case, impls.load("tests.parity.fakes:fused_bias"), REF, RunOptions(impl="fused_bias"))
    assert biased.outcome == "fail" and biased.decided_by != "contract"
    assert next(t for t in biased.tensors if t.name == "contract/padding_dout").verdict == "pass"


def test_the_contract_check_runs_only_where_padding_rows_have_a_nonzero_dout():
    layer = pick(scope="layer", layout="thd", alignment_padding=True, padding_dout="zero")
    result = run_case(layer, impls.load("fused"), REF, RunOptions())
    assert result.outcome == "pass" and all(t.name != "contract/padding_dout" for t in result.tensors)
    core = pick(scope="core", layout="thd", alignment_padding=True)
    result = run_case(core, impls.load("fused"), REF, RunOptions())
    assert result.outcome == "pass" and any(t.name == "contract/padding_dout" for t in result.tensors)


def test_padding_dout_field_materialises_validates_and_keeps_old_ids():
    case = _repro_case()
    t = materialize(case)
    assert float(t.grad_output[1].abs().max()) > DOUT_POISON / 100  # huge on the padding row
    default = case.replace(padding_dout="default")
    assert bool((materialize(default).grad_output[1] == 0).all())  # layer scope: zero there
    assert "padding_dout" not in default.to_dict() and case.to_dict()["padding_dout"] == "poison"
    assert Case.from_json(case.to_json()) == case and case.id != default.id
    assert features(case)["padding_dout"] == "poison" and features(default)["padding_dout"] == "zero"
    with pytest.raises(CaseError, match="padding_dout"):
        default.replace(layout=BshdLayout(1, 4), padding_dout="poison")
    with pytest.raises(CaseError, match="padding_dout"):
        case.replace(padding_dout="huge")


def test_generator_gives_a_poisoned_case_only_when_pinned():
    profile = get_profile("tiny")
    pinned = sample_case(Rng(1, "t", "pin"), profile, {"padding_dout": "poison", "scope": "core"})
    assert pinned.padding_dout == "poison" and pinned.has_padding_rows and pinned.scope == "core"
    free = sample_case(Rng(1, "t", "free"), profile, {"layout": "thd"})
    assert free.padding_dout == "default"


class _NoisyGradients:
    """The reference with ``out`` scaled per row by a fresh ``1 + 1e-6 · rand`` on every call: gradients differ
    run to run (as a non-deterministic GPU accumulation's do), yet padding rows still pass none."""

    def __init__(self):
        self.base = reference

    def __getattr__(self, name):
        return getattr(self.base, name)

    def attention_layer(self, *args, **kwargs):
        res = reference.attention_layer(*args, **kwargs)
        res.out = res.out * (1 + 1e-6 * torch.rand(res.out.shape[:-1] + (1,), dtype=res.out.dtype))
        return res


def test_the_contract_holds_for_non_deterministic_gradients_and_catches_a_leak():
    case = _repro_case()
    noisy = impls.Implementation("noisy", _NoisyGradients())
    t = materialize(case)
    first, second = take_snapshot(noisy.api, case, t), take_snapshot(noisy.api, case, t)
    assert not torch.equal(first["grad/linear_proj.weight"], second["grad/linear_proj.weight"])  # not bitwise
    result = run_case(case, noisy, REF, RunOptions(impl="noisy"))
    contract = next(t for t in result.tensors if t.name == "contract/padding_dout")
    assert contract.verdict == "pass", contract.message
    leak = impls.load("tests.parity.fakes:reference_pad_dout_leak")
    result = run_case(case, leak, REF, RunOptions(impl="leak"))
    contract = next(t for t in result.tensors if t.name == "contract/padding_dout")
    assert result.outcome == "fail" and contract.verdict == "fail" and "grad/hidden" in contract.message
