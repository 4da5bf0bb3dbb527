"""`dsv4-parity report RUN --format markdown`: golden snippets on passing, failing, budget-stopped and drift-regressed
runs, outcomes this version does not know, stand-ins, and the 64 KiB cap (with its negative control)."""

from __future__ import annotations

import pytest

from cli.main import main as cli_main
from reports.markdown import MAX_BYTES, REPRO_CHARS, render_markdown, short_repro
from reports.render import render_run

from .conftest import rows_of, write_rows


def summary(run_dir, *, baseline=None, top=10, limit=MAX_BYTES, edit=None):
    rendered = render_run(run_dir, baseline=baseline, console=None, html=False, csv=False)
    data = rendered.data
    if edit is not None:
        edit(data)
    return render_markdown(data, rendered.table, drift=rendered.drift, top=top, limit=limit,
                           baseline_name=rendered.baseline.name if rendered.baseline else None)


def test_passing_run(tmp_path):
    run_dir = write_rows(rows_of(n_cases=40, fail_every=0, error_every=0, run_id="green"), tmp_path / "green")
    text = summary(run_dir)
    assert text.startswith("## dsv4-parity: **PASS**\n\nrun `green`: suite `smoke` · `fused` vs `reference` · "
                           "provider `auto` · 40 cases · 20.0 s · torch 2.13.0+cpu · git 0000000\n")
    assert "| outcome | cases |\n|---|---:|\n| pass | 39 |\n| fail | 0 |\n| error | 0 |\n| unsupported | 1 |\n" in text
    assert "Drift" not in text and "Incomplete" not in text
    # no failure: the offenders are the passing cases closest to a threshold, each with its repro
    assert "### Top offenders (10: failing first, then errors, then closest to a threshold)" in text
    assert text.count("\n# ") == 10 and text.count("dsv4-parity run --case '{") == 10


def test_failing_run_lists_offenders_with_repros(runs):
    text = summary(runs["base"], top=3)
    assert text.startswith("## dsv4-parity: **FAIL** (3 failed, 1 errored)\n")
    assert "| pass | 35 |\n| fail | 3 |\n| error | 1 |\n| unsupported | 1 |" in text
    assert ("| 1 | `ada9266fa8dc` | fail | grad/core_attention.attn_sink | noise_floor_ratio | 37.4 | 6 | 6.23 | "
            "grad/core_attention.attn_sink failed noise_floor_ratio |") in text
    assert "```sh\n# 1 ada9266fa8dc\ndsv4-parity run --case '{\"config\":" in text
    assert "| attention | reference | 40 |" in text and "Stand-ins: none listed by the run." in text


def test_budget_stopped_run_is_incomplete(tmp_path):
    rows = rows_of(n_cases=20, fail_every=0, error_every=0, unsupported_every=0, complete=False, run_id="boxed")
    rows.append({"type": "end", "counts": {"pass": 20, "fail": 0, "error": 0, "unsupported": 0}, "duration_s": 61.0,
                 "stopped": "budget", "budget_s": 60.0, "not_run": ["a1", "b2", "c3", "d4", "e5"]})
    text = summary(write_rows(rows, tmp_path / "boxed"))
    assert text.startswith("## dsv4-parity: **FAIL** (incomplete)\n")
    assert ("**Incomplete:** 5 selected case(s) not run: the time budget (60 s) ran out. Continue it with "
            "`dsv4-parity run --out RUN --resume`.") in text
    cut = write_rows(rows[:-1], tmp_path / "cut")  # no end row at all: still going, or died
    assert "**Incomplete:** no `end` row" in summary(cut)


def test_drift_regressed_run_names_the_class_and_an_unchanged_run_passes(runs):
    text = summary(runs["regressed"], baseline=str(runs["base"]))
    assert "FAIL** (3 failed, 1 errored, drift regression)" in text
    assert f"### Drift vs baseline `{runs['base']}`" in text
    assert "| grad_param | 339 | 3.00x | 3.00x | 3.00x | 3.00x | 2x | **regression** |" in text
    assert "| out | 38 | 1.00x | 1.00x | 1.00x | 1.00x | 2x | steady |" in text
    assert "**Drift gate: FAIL** — regressed: grad_param" in text
    same = summary(runs["same"], baseline=str(runs["base"]))  # negative control: identical numbers
    assert "**Drift gate: PASS**" in same and "**regression**" not in same and "drift regression" not in same


def test_outcomes_this_version_does_not_know_are_counted_not_fatal(runs):
    def mark(data):
        data.cases.loc[data.cases.index[:2], "outcome"] = "known"
        data.cases.loc[data.cases.index[2], "outcome"] = "weird"

    text = summary(runs["base"], edit=mark)
    assert "| unsupported | 1 |\n| known | 2 |\n| weird | 1 |\n" in text


def test_stand_ins_of_the_run_row_are_listed(tmp_path):
    rows = rows_of(n_cases=4, run_id="shim")
    rows[0]["stand_ins"] = {"hadamard": "fast_hadamard_transform absent", "plain-linear": ""}
    rows[0]["env"] = {**rows[0]["env"], "stand_ins": ["cpu-device"]}
    text = summary(write_rows(rows, tmp_path / "shim"))
    assert "Stand-ins: hadamard: fast_hadamard_transform absent, plain-linear, cpu-device" in text


def test_a_long_repro_is_replaced_by_its_case_id_form():
    long = "dsv4-parity run --case '" + "x" * REPRO_CHARS + "'"
    assert short_repro(long, "abc123", "gate") == "dsv4-parity run --suite gate --case-id abc123"
    assert short_repro("dsv4-parity run --case '{}'", "abc123", "gate") == "dsv4-parity run --case '{}'"


@pytest.fixture(scope="module")
def huge_run(tmp_path_factory):
    """Every case fails: 200 offenders with their repros are far more than 64 KiB."""
    directory = tmp_path_factory.mktemp("huge") / "huge"
    return write_rows(rows_of(n_cases=200, fail_every=1, error_every=0, unsupported_every=0, run_id="huge"),
                      directory)


def test_a_huge_run_stays_under_64_kib_by_dropping_offenders(huge_run):
    text = summary(huge_run, top=200)
    assert len(text.encode()) <= MAX_BYTES
    assert "**FAIL** (200 failed)" in text and "more offender(s) left out to keep this summary under 65536" in text
    assert text.count("```") == 2  # the repro block is closed
    untruncated = summary(huge_run, top=200, limit=None)  # negative control: the cap is what keeps it small
    assert len(untruncated.encode()) > MAX_BYTES and "left out" not in untruncated


def test_when_nothing_else_fits_the_text_is_cut_at_a_line_with_a_note(huge_run):
    text = summary(huge_run, top=200, limit=600)
    assert len(text.encode()) <= 600
    assert text.endswith("_Summary cut at 600 bytes; the full report is index.html / results.csv of this run._\n")
    assert text.startswith("## dsv4-parity: **FAIL**")


def test_cli_prints_markdown_only(copy_run, capsys, tmp_path):
    run_dir = copy_run("base")
    code = cli_main(["report", str(run_dir), "--format", "markdown", "--no-html", "--no-csv",
                          "--baselines-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("## dsv4-parity: **FAIL** (3 failed, 1 errored)\n") and "Worst offenders" not in out
    assert not (run_dir / "index.html").exists()
