"""The `report` and `compare` subcommands: outputs, exit codes, one-line errors."""

from __future__ import annotations

import argparse

import pytest

from bench.startup import probe_command
from cli import report_command as commands
from cli.main import main as cli_main

from .conftest import rows_of, write_rows


def run(argv, capsys):
    code = cli_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_add_parsers_registers_report_and_compare_with_func():
    parser = argparse.ArgumentParser()
    commands.add_parsers(parser.add_subparsers(dest="command"))
    for argv in (["report", "x"], ["compare", "x", "--baseline", "b"]):
        args = parser.parse_args(argv)
        assert callable(args.func)


def test_report_writes_csv_and_html_and_prints_offenders_with_repro(copy_run, capsys, tmp_path):
    run_dir = copy_run("base")
    code, out, err = run(["report", str(run_dir), "--baseline", "none", "--baselines-dir", str(tmp_path)], capsys)
    assert code == 0, err
    assert (run_dir / "results.csv").is_file() and (run_dir / "index.html").is_file()
    assert "Worst offenders" in out and "dsv4-parity run --case '{" in out
    assert "drift gate" not in out


def test_compare_fails_on_planted_regression_and_passes_unchanged(runs, capsys, tmp_path):
    code, out, _ = run(["compare", str(runs["regressed"]), "--baseline", str(runs["base"])], capsys)
    assert code == 1 and "regressed: grad_param" in out
    code, out, _ = run(["compare", str(runs["same"]), "--baseline", str(runs["base"])], capsys)
    assert code == 0 and "drift gate: PASS" in out


def test_update_then_compare_against_the_named_baseline(runs, capsys, tmp_path):
    root = str(tmp_path / "baselines")
    code, out, _ = run(["compare", str(runs["base"]), "--baseline", "cpu/smoke", "--update",
                        "--baselines-dir", root], capsys)
    assert code == 0 and "baseline written" in out
    assert run(["compare", str(runs["same"]), "--baseline", "smoke", "--baselines-dir", root], capsys)[0] == 0
    # 'auto' = <arch>/<suite> of the run (the synthetic suite is "smoke")
    assert run(["compare", str(runs["regressed"]), "--baselines-dir", root], capsys)[0] == 1


def test_flags_override_the_gate(runs, capsys):
    argv = ["compare", str(runs["regressed"]), "--baseline", str(runs["base"])]
    assert run(argv + ["--factor", "4"], capsys)[0] == 0
    assert run(argv + ["--stat", "median", "--metric", "max_rel"], capsys)[0] == 1


def test_compare_render_writes_the_drift_into_the_html(copy_run, runs, capsys):
    run_dir = copy_run("regressed")
    code, _, _ = run(["compare", str(run_dir), "--baseline", str(runs["base"]), "--render"], capsys)
    assert code == 1
    assert 'class="drift-row regression" data-class="grad_param"' in (run_dir / "index.html").read_text()


@pytest.mark.parametrize("argv, message", [
    (["report", "/nonexistent/run"], "dsv4-parity report: error: run: no results.jsonl found"),
    (["compare", "/nonexistent/run", "--baseline", "x"], "dsv4-parity compare: error: run: no results.jsonl"),
    (["compare", "{base}", "--baseline", "nope/nothing"], "--baseline: no baseline 'nope/nothing'"),
    (["compare", "{base}", "--baseline", "{base}", "--stat", "p900"], "statistic: must be 'median'"),
])
def test_bad_input_is_one_line_and_exit_2(runs, capsys, tmp_path, argv, message):
    argv = [a.replace("{base}", str(runs["base"])) for a in argv] + ["--baselines-dir", str(tmp_path)]
    code, out, err = run(argv, capsys)
    assert code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_run_with_no_committed_baseline_needs_an_explicit_one(runs, capsys, tmp_path):
    code, _, err = run(["compare", str(runs["base"]), "--baselines-dir", str(tmp_path)], capsys)
    assert code == 2 and "no committed baseline" in err


def test_engine_entry_point_renders_with_the_default_baseline(tmp_path, capsys):
    """parity/cli.py calls cli.report_command.render_run(out_dir) after `run --make-default`."""
    run_dir = write_rows(rows_of(n_cases=8), tmp_path / "run")
    commands.render_run(run_dir)
    assert (run_dir / "index.html").is_file() and "Worst offenders" in capsys.readouterr().out


def test_a_baseline_sharing_no_pair_is_an_input_error(runs, capsys, tmp_path):
    other = write_rows(rows_of(n_cases=5, seed=99), tmp_path / "other")
    code, _, err = run(["compare", str(runs["base"]), "--baseline", str(other)], capsys)
    assert code == 2 and "have no (case, tensor) pair" in err


def test_report_and_the_drift_gate_do_their_work_without_loading_torch(copy_run, runs, tmp_path):
    """``report``, ``compare`` and ``compare --update`` read and write result files only: torch is never imported
    (``make report`` / ``make drift`` / ``make summary`` each paid its import, ~2.5 s on a 2-core CPU), and each did
    its work (its exit code; the files it writes exist). Control: ``run`` loads it
    (``tests/test_startup.py::test_the_probe_sees_torch_where_a_command_loads_it``)."""
    run = copy_run("base")
    assert probe_command(["report", str(run), "--baseline", "none", "--quiet"]) == (False, 0)
    assert (run / "index.html").exists() and (run / "results.csv").exists()
    # the planted regression still fails the drift gate (exit 1); the unchanged run passes it
    assert probe_command(["compare", str(runs["regressed"]), "--baseline", str(runs["base"])]) == (False, 1)
    assert probe_command(["compare", str(runs["same"]), "--baseline", str(runs["base"])]) == (False, 0)
    assert probe_command(["compare", str(runs["base"]), "--update", "--baseline", "local/base",
                          "--baselines-dir", str(tmp_path / "baselines")]) == (False, 0)
    assert (tmp_path / "baselines" / "local" / "base" / "metrics.csv").exists()
