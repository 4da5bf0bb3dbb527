"""Reading results.jsonl: counts, repairs of a live / cut stream, one clear error per malformed row."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from reports.errors import ReportError
from reports.load import load_run, resolve_results
from reports.schema import usage, usage_array
from reports.terminal import fmt

from .conftest import N_CASES, read_rows, rows_of, write_rows


def test_counts_come_from_case_rows_and_agree_with_end_row(runs):
    data = load_run(runs["base"])
    assert data.complete and data.warnings == []
    assert sum(data.counts.values()) == N_CASES == len(data.cases)
    assert data.counts == data.end["counts"]
    assert data.counts["fail"] > 0 and data.counts["error"] > 0 and data.counts["unsupported"] > 0


def test_every_metric_row_is_kept(runs):
    rows = read_rows(runs["base"])
    data = load_run(runs["base"])
    assert len(data.metrics) == sum(r["type"] == "metric" for r in rows)
    assert len(data.tensors) == sum(r["type"] == "tensor" for r in rows)


def test_end_row_counts_disagreeing_with_case_rows_warns(tmp_path):
    rows = rows_of(n_cases=10)
    rows[-1]["counts"] = {"pass": 99, "fail": 0, "error": 0, "unsupported": 0}
    data = load_run(write_rows(rows, tmp_path))
    assert any("differ from the case rows" in w for w in data.warnings)


def test_torn_last_line_is_skipped_with_a_warning(tmp_path):
    text = "\n".join(json.dumps(r) for r in rows_of(n_cases=6, complete=False))
    (tmp_path / "results.jsonl").write_text(text + '\n{"type": "metric", "case_id": "ab')
    data = load_run(tmp_path)
    assert len(data.cases) == 6
    assert any("torn last line" in w for w in data.warnings)
    assert not data.complete and any("no 'end' row" in w for w in data.warnings)


def test_torn_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    lines = [json.dumps(r) for r in rows_of(n_cases=3)]
    lines[4] = lines[4][:20]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"results.jsonl:5: not valid JSON"):
        load_run(tmp_path)


def test_rows_of_a_case_without_case_row_are_dropped(tmp_path):
    """A stream read while a case is half written: its tensors / metrics go, with a warning."""
    rows = rows_of(n_cases=5, complete=False)
    last_case = max(i for i, r in enumerate(rows) if r["type"] == "case")
    cut = rows[:last_case]  # the synthetic engine writes a case's tensors before its case row
    data = load_run(write_rows(cut, tmp_path))
    assert len(data.cases) == 4
    assert set(data.tensors["case_id"]) <= set(data.cases["case_id"])
    assert set(data.metrics["case_id"]) <= set(data.cases["case_id"])
    assert any("without a 'case' row dropped" in w for w in data.warnings)


@pytest.mark.parametrize("field", ["case_id", "metric", "value"])
def test_missing_metric_field_names_field_and_line(tmp_path, field):
    rows = rows_of(n_cases=2)
    index = next(i for i, r in enumerate(rows) if r["type"] == "metric")
    del rows[index][field]
    with pytest.raises(ReportError, match=rf"results.jsonl:{index + 1} field '{field}'"):
        load_run(write_rows(rows, tmp_path))


def test_bad_outcome_and_non_numeric_value_are_rejected(tmp_path):
    rows = rows_of(n_cases=2)
    case = next(r for r in rows if r["type"] == "case")
    case["outcome"] = "passed"
    with pytest.raises(ReportError, match="field 'outcome'.*pass, fail, error, unsupported"):
        load_run(write_rows(rows, tmp_path))
    rows = rows_of(n_cases=2)
    next(r for r in rows if r["type"] == "metric")["value"] = "1e-3"
    with pytest.raises(ReportError, match="field 'value': must be a number or null"):
        load_run(write_rows(rows, tmp_path))


def test_a_stream_without_run_row_is_not_a_results_stream(tmp_path):
    rows = [r for r in rows_of(n_cases=2) if r["type"] != "run"]
    with pytest.raises(ReportError, match="no 'run' row"):
        load_run(write_rows(rows, tmp_path))


def test_unknown_row_types_are_ignored_with_a_warning(tmp_path):
    rows = rows_of(n_cases=2)
    rows.insert(1, {"type": "heartbeat", "t": 1})
    data = load_run(write_rows(rows, tmp_path))
    assert len(data.cases) == 2 and any("unknown type 'heartbeat'" in w for w in data.warnings)


def test_null_and_engine_inf_values(tmp_path):
    """The engine writes NaN as null and inf as ±1.797e308 (strict JSON): NaN uses an infinite tolerance share."""
    rows = rows_of(n_cases=1, fail_every=0, error_every=0, unsupported_every=0)
    metric = next(r for r in rows if r["type"] == "metric" and r["metric"] == "noise_floor_ratio")
    metric["value"] = None
    data = load_run(write_rows(rows, tmp_path))
    row = data.metrics.loc[(data.metrics["tensor"] == metric["tensor"]) &
                           (data.metrics["metric"] == "noise_floor_ratio")].iloc[0]
    assert math.isnan(row["value"]) and row["usage"] == math.inf
    assert fmt(1.7976931348623157e308) == "inf" and fmt(-1.7976931348623157e308) == "-inf"


def test_usage_direction_for_error_and_similarity_metrics():
    assert usage("noise_floor_ratio", 1.5, 3.0) == pytest.approx(0.5)
    assert usage("cosine", 0.9999, 0.999) == pytest.approx(0.1)
    # negative control: read as an error metric, a too-low cosine would look fine
    assert usage("cosine", 0.99, 0.999) == pytest.approx(10.0)
    assert usage("max_rel", 0.99, 0.999) < 1.0
    assert usage("nan", 0.0, 0.0) == 0.0 and usage("nan", 2.0, 0.0) == math.inf
    assert math.isnan(usage("rmse", 1.0, None))


def test_vectorised_usage_matches_the_scalar_rule():
    metrics = np.array(["max_rel", "cosine", "nan", "nan", "tensor_sim", "rmse", "max_rel"], dtype=object)
    values = np.array([0.5, 0.995, 0.0, 3.0, 1.0, 2.0, np.nan])
    thresholds = np.array([2.0, 0.999, 0.0, 0.0, 0.999, np.nan, 1.0])
    expected = [usage(m, v, None if math.isnan(t) else t) for m, v, t in zip(metrics, values, thresholds)]
    np.testing.assert_allclose(usage_array(metrics, values, thresholds), expected)


def test_engine_failed_flag_wins_over_inferred_direction(tmp_path):
    """A metric the engine marked failed uses at least its whole tolerance, whatever its name suggests."""
    rows = rows_of(n_cases=1, fail_every=0, error_every=0, unsupported_every=0)
    metric = next(r for r in rows if r["type"] == "metric" and r["metric"] == "max_rel")
    metric.update(metric="custom_floor_metric", value=0.5, threshold=0.9, passed=False)
    data = load_run(write_rows(rows, tmp_path))
    used = data.metrics.loc[data.metrics["metric"] == "custom_floor_metric", "usage"].iloc[0]
    assert used == 1.0


def test_resolve_results_accepts_dir_file_and_run_id(runs, tmp_path):
    base = runs["base"]
    assert resolve_results(base) == base / "results.jsonl"
    assert resolve_results(base / "results.jsonl") == base / "results.jsonl"
    assert resolve_results("base", base.parent) == base / "results.jsonl"
    with pytest.raises(ReportError, match="run: no results.jsonl found at"):
        resolve_results(tmp_path / "nope", tmp_path)
