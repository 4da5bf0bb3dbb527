"""The gate's closing summary (reports/gate.py): one row per run, the verdict, and last the one report to open —
never an oracle's folder (issue 32, item 6)."""

from __future__ import annotations

import io

from rich.console import Console

from reports.gate import judge, markdown_summary, parse_baselines, print_summary, verdict_text

from .conftest import rows_of, write_rows


def test_the_summary_ends_on_the_main_report_even_after_an_oracle(tmp_path):
    main_run = write_rows(rows_of(n_cases=6, run_id="main", fail_every=0, error_every=0), tmp_path / "main")
    oracle = write_rows(rows_of(n_cases=4, run_id="oracle", fail_every=0, error_every=0), tmp_path / "oracle")
    verdicts = [judge("path", "torch", main_run, None), judge("oracle", "padding-dout (fused, smoke)", oracle)]
    buffer = io.StringIO()
    print_summary(verdicts, Console(file=buffer, width=200), title="gate: fused on smoke", report=main_run / "index.html")
    lines = [line for line in buffer.getvalue().splitlines() if line.strip()]
    assert lines[-2:] == ["gate: PASS", f"report: {main_run / 'index.html'}"]
    assert (main_run / "index.html").is_file()  # the named report exists
    assert "not gated against a baseline (--baseline none)" in buffer.getvalue()


def test_a_failing_run_fails_the_gate_and_is_named(tmp_path):
    good = write_rows(rows_of(n_cases=6, run_id="good", fail_every=0, error_every=0), tmp_path / "good")
    bad = write_rows(rows_of(n_cases=14, run_id="bad", error_every=0), tmp_path / "bad")  # case 12 fails
    verdicts = [judge("path", "unfused", good, None), judge("path", "emulated", bad, None)]
    assert verdicts[0].passed and not verdicts[1].passed
    assert verdict_text(verdicts).startswith("FAIL — emulated: 1 case(s) failed: ")
    assert "unfused" not in verdict_text(verdicts)
    text = markdown_summary(verdicts, title="t")
    assert text.startswith("## dsv4-parity gate: **FAIL**") and "| path `emulated` |" in text
    # negative control: the passing run alone passes
    assert verdict_text(verdicts[:1]) == "PASS"


def test_an_incomplete_run_fails_its_path(tmp_path):
    cut = write_rows(rows_of(n_cases=6, run_id="cut", fail_every=0, error_every=0, complete=False), tmp_path / "c")
    assert judge("path", "p", cut, None).reasons == ["incomplete: no end row (killed or cut)"]


def test_baselines_per_path():
    assert parse_baselines("auto", ["a", "b"]) == {"a": "auto", "b": "auto"}
    assert parse_baselines("none", ["a", "b"]) == {"a": None, "b": None}
    assert parse_baselines("b=cpu/x", ["a", "b"]) == {"a": "auto", "b": "cpu/x"}
    assert parse_baselines("cpu/x", ["a"]) == {"a": "cpu/x"}
