"""The drift statistic and the relative-regression gate (reports/SCHEMA.md, "Drift")."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from reports.drift import GateConfig, compare_tables, quantile
from reports.errors import ReportError
from reports.load import load_run
from reports.table import metrics_table


@pytest.fixture(scope="module")
def tables(runs):
    return {name: metrics_table(load_run(path)) for name, path in runs.items()}


def status(result, klass):
    return result.classes.set_index("tensor_class").loc[klass, "status"]


def test_an_unchanged_run_passes(tables):
    result = compare_tables(tables["same"], tables["base"])
    assert result.passed
    ratios = result.classes.dropna(subset=["statistic"])
    assert (ratios["statistic"] == 1.0).all() and set(ratios["status"]) == {"steady"}
    assert result.only_current == result.only_baseline == 0 and result.new_failures.empty


def test_planted_3x_growth_inside_tolerance_fails_the_gate(tables):
    current, baseline = tables["regressed"], tables["base"]
    # the growth is invisible to the absolute gate: the same tensors pass / fail as in the baseline
    assert (current["verdict"].fillna("") == baseline["verdict"].fillna("")).all()
    result = compare_tables(current, baseline)
    assert not result.passed and result.regressions == ["grad_param"]
    row = result.classes.set_index("tensor_class").loc["grad_param"]
    assert row["statistic"] == pytest.approx(3.0)
    assert all(status(result, c) == "steady" for c in ("out", "lse", "grad_input"))


@pytest.mark.parametrize("metric", ["max_rel", "rel_l2", "max_abs", "rmse"])
def test_the_gate_metric_is_selectable(tables, metric):
    result = compare_tables(tables["regressed"], tables["base"], GateConfig(metric=metric))
    assert result.regressions == ["grad_param"]


def test_the_reverse_direction_is_an_improvement_and_passes(tables):
    result = compare_tables(tables["base"], tables["regressed"])
    assert result.passed and status(result, "grad_param") == "improvement"


def test_per_class_factor_override(tables):
    config = GateConfig(factors={"grad_param": 4.0})
    assert compare_tables(tables["regressed"], tables["base"], config).passed
    # negative control: the same override on another class leaves grad_param gated
    assert not compare_tables(tables["regressed"], tables["base"], GateConfig(factors={"out": 4.0})).passed


def frame(values_base, values_cur, dtype="float64", klass="grad_input", metric="max_rel"):
    n = len(values_base)
    common = {"case_id": [f"c{i}" for i in range(n)], "tensor": "grad/hidden", "tensor_class": klass,
              "dtype": dtype, "verdict": "pass", "outcome": "pass"}
    return (pd.DataFrame({**common, metric: values_cur}), pd.DataFrame({**common, metric: values_base}))


def test_floor_absorbs_float64_rounding_noise_and_zero_over_zero():
    eps = 2.0 ** -52
    current, baseline = frame([eps, 0.0, 0.5 * eps], [3 * eps, 0.0, 1.5 * eps])
    result = compare_tables(current, baseline, GateConfig(metric="max_rel", floor_ulps=4))
    assert result.passed and np.isfinite(result.pairs["ratio"]).all()
    assert (result.pairs["ratio"] == 1.0).all()
    # negative control: without a meaningful floor the same noise reads as a 3x regression
    noisy = compare_tables(current, baseline, GateConfig(metric="max_rel", floor_ulps=1e-6))
    assert noisy.regressions == ["grad_input"]


def test_floor_scales_with_the_tensor_dtype():
    """1e-3 -> 3e-3 is rounding-level in bfloat16 (eps 2**-7) but a real growth in float32."""
    for dtype, expect in (("bfloat16", True), ("float32", False)):
        current, baseline = frame([1e-3] * 5, [3e-3] * 5, dtype=dtype)
        assert compare_tables(current, baseline, GateConfig(metric="max_rel")).passed is expect


def test_noise_floor_ratio_uses_its_own_floor():
    current, baseline = frame([0.01, 0.02], [0.05, 0.06], metric="noise_floor_ratio")
    assert compare_tables(current, baseline).passed  # all below ratio_floor 0.25
    current, baseline = frame([0.5, 0.6], [1.5, 1.8], metric="noise_floor_ratio")
    assert not compare_tables(current, baseline).passed


def test_p90_ignores_a_few_noisy_pairs_but_not_a_tenth_of_the_class():
    n = 100
    base = [1.0] * n
    few = [1.0] * (n - 5) + [10.0] * 5
    tenth = [1.0] * (n - 20) + [10.0] * 20
    config = GateConfig(metric="noise_floor_ratio")
    assert compare_tables(*frame(base, few, metric="noise_floor_ratio"), config).passed
    assert not compare_tables(*frame(base, tenth, metric="noise_floor_ratio"), config).passed
    # negative control: with the max statistic, even the few noisy pairs fail the gate
    assert not compare_tables(*frame(base, few, metric="noise_floor_ratio"), GateConfig(statistic="max")).passed


def test_a_new_failure_fails_the_gate_without_any_error_growth(tables):
    current = tables["same"].copy()
    index = current.index[(current["verdict"] == "pass") & (current["outcome"] == "pass")][0]
    current.loc[index, "verdict"] = "fail"
    result = compare_tables(current, tables["base"])
    assert result.regressions == [] and not result.passed
    assert result.new_failures[["case_id", "tensor"]].values.tolist() == \
        [[current.loc[index, "case_id"], current.loc[index, "tensor"]]]


def test_a_case_that_now_errors_is_a_new_failure(tables):
    current = tables["same"].copy()
    case_id = current.loc[current["outcome"] == "pass", "case_id"].iloc[0]
    current = current.loc[current["case_id"] != case_id]
    current = pd.concat([current, pd.DataFrame([{"case_id": case_id, "tensor": "", "outcome": "error"}])])
    result = compare_tables(current, tables["base"])
    assert not result.passed
    assert result.new_failures.to_dict("records") == [{"case_id": case_id, "tensor": "", "baseline": "pass",
                                                       "current": "error"}]


def test_a_passing_case_now_known_and_a_known_case_now_failing_are_new_failures(tables):
    """pass -> known: a registered deviation came back (or a new bug has its shape); known -> fail: the deviation
    exceeds its model. Both fail the drift gate (found by review: read as no change, and as an improvement).
    Control: known in both runs is no change."""
    base = tables["base"].copy()
    case_id = base.loc[base["outcome"] == "pass", "case_id"].iloc[0]
    now_known = tables["same"].copy()
    now_known.loc[now_known["case_id"] == case_id, "outcome"] = "known"
    result = compare_tables(now_known, base)
    assert not result.passed and result.new_failures.to_dict("records") == [
        {"case_id": case_id, "tensor": "", "baseline": "pass", "current": "known"}]
    known_base = base.copy()
    known_base.loc[known_base["case_id"] == case_id, "outcome"] = "known"
    failing = tables["same"].copy()
    failing.loc[failing["case_id"] == case_id, "outcome"] = "fail"
    result = compare_tables(failing, known_base)
    assert not result.passed and result.new_failures[["baseline", "current"]].values.tolist() == [["known", "fail"]]
    assert compare_tables(now_known, known_base).passed


def test_pairs_only_in_the_run_are_counted_not_gated_but_pairs_only_in_the_baseline_fail(tables):
    """Suites grow (cases only in the run pass); cases the run lost are lost coverage (reports/coverage_gate.py)."""
    current = tables["same"]
    dropped = current.loc[current["tensor_class"] == "out", "case_id"].iloc[:3]
    grown = compare_tables(current, tables["base"].loc[~tables["base"]["case_id"].isin(dropped)])
    assert grown.passed and grown.only_current > 0 and grown.only_baseline == 0
    shrunk = compare_tables(current.loc[~current["case_id"].isin(dropped)], tables["base"])
    assert not shrunk.passed and shrunk.only_baseline > 0 and shrunk.only_current == 0
    assert sorted(shrunk.coverage.absent) == sorted(dropped) and shrunk.regressions == []


@pytest.mark.parametrize("settings, field", [
    ({"metric": "cosine"}, "gate.metric"), ({"statistic": "p900"}, "gate.statistic"),
    ({"factor": 1.0}, "gate.factor"), ({"factors": {"grad_params": 3}}, "gate.factors.grad_params"),
    ({"floor_ulps": 0}, "gate.floor_ulps"), ({"speed": 1}, "gate.speed")])
def test_bad_gate_settings_name_the_field(settings, field):
    with pytest.raises(ReportError) as info:
        GateConfig.from_dict(settings)
    assert info.value.where == field


def test_statistic_names():
    assert quantile("median") == 0.5 and quantile("max") == 1.0 and quantile("p90") == 0.9
    assert quantile("p99.5") == pytest.approx(0.995)
