"""Terminal view, mutation kill matrix and the synthetic generator itself."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from reports.drift import compare_tables
from reports.errors import ReportError
from reports.load import load_run
from reports.mutants import load_mutants
from reports.summary import class_summary, offenders
from tests.reports.synthetic import main as synthetic_main, synthetic_rows
from reports.table import metrics_table
from reports.terminal import render_terminal

from .conftest import PLANTED, read_rows


def terminal(data, table, **kwargs) -> str:
    console = Console(record=True, width=220, color_system=None)
    render_terminal(data, table, console, **kwargs)
    return console.export_text()


def test_terminal_summary_counts_classes_and_repro_of_worst_offender(runs):
    data = load_run(runs["base"])
    table = metrics_table(data)
    text = terminal(data, table, top=5)
    counts = data.counts
    assert f"pass={counts['pass']} fail={counts['fail']} error={counts['error']}" in text
    for klass in ("out", "lse", "grad_input", "grad_param"):
        assert f"│ {klass} " in text
    worst = offenders(data, table, 5)
    assert worst["outcome"].iloc[0] == "fail"
    assert worst.iloc[0]["repro"] in text.replace("\n", "")
    assert "#1 dsv4-parity run --case" in text


def test_offenders_rank_failures_first_then_by_usage(runs):
    data = load_run(runs["base"])
    worst = offenders(data, metrics_table(data), 50)
    severity = worst["outcome"].map({"fail": 0, "error": 1, "pass": 2}).tolist()
    assert severity == sorted(severity)
    fails = worst.loc[worst["outcome"] == "fail", "worst_usage"].tolist()
    assert fails == sorted(fails, reverse=True) and all(u > 1 for u in fails)


def test_class_summary_counts_verdicts(runs):
    data = load_run(runs["base"])
    summary = class_summary(metrics_table(data)).set_index("tensor_class")
    tensors = [r for r in read_rows(runs["base"]) if r["type"] == "tensor"]
    for klass, row in summary.iterrows():
        mine = [t for t in tensors if t["tensor_class"] == klass]
        assert row["tensors"] == len(mine)
        assert row["fail"] == sum(t["verdict"] == "fail" for t in mine)


def test_terminal_drift_table_marks_the_regression(runs):
    data = load_run(runs["regressed"])
    table = metrics_table(data)
    drift = compare_tables(table, metrics_table(load_run(runs["base"])))
    text = terminal(data, table, drift=drift, baseline_name="base")
    line = next(l for l in text.splitlines() if l.startswith("│ grad_param") and "regression" in l)
    assert "3.00x" in line and "drift gate: FAIL regressed: grad_param" in text


def test_kill_matrix(runs):
    report = load_mutants(runs["mutated"])
    rows = [json.loads(l) for l in (runs["mutated"] / "mutants.jsonl").read_text().splitlines()]
    assert report.counts == {"killed": 6, "survived": 1, "unreachable": 1}
    assert report.mutants["status"].iloc[0] == "survived"  # survivors listed first
    assert int(report.matrix.values.sum()) == sum(r["status"] == "killed" for r in rows)
    assert load_mutants(runs["base"]) is None


def test_a_malformed_mutant_row_names_line_and_field(copy_run):
    run_dir = copy_run("mutated")
    path = run_dir / "mutants.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), "status": "dead"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"mutants.jsonl:3 field 'status': must be one of killed"):
        load_mutants(run_dir)


def test_synthetic_streams_are_deterministic_and_scale_is_exact():
    a, b = list(synthetic_rows(12)), list(synthetic_rows(12))
    assert a == b
    scaled = list(synthetic_rows(12, scale=PLANTED))
    for x, y in zip(a, scaled):
        if x["type"] == "metric" and x["tensor_class"] == "grad_param" and x["metric"] == "max_rel":
            assert y["value"] == pytest.approx(3 * x["value"])
        elif x["type"] == "metric" and x["tensor_class"] != "grad_param":
            assert x == y


def test_synthetic_cli(tmp_path, capsys):
    assert synthetic_main([str(tmp_path / "r"), "--cases", "5", "--scale", "out=2", "--mutants"]) == 0
    assert (tmp_path / "r" / "results.jsonl").is_file() and (tmp_path / "r" / "mutants.jsonl").is_file()
    with pytest.raises(SystemExit):
        synthetic_main([str(tmp_path / "s"), "--scale", "out"])
