"""``dsv4-parity mutants``: planted bugs are killed by the suite, reported in the kill-matrix schema of
``reports/mutants.py``; a mutant no case can reach is ``unreachable`` (naming the missing cell), one that runs but is
never noticed is ``survived``; the exit code and the last line say so."""

from __future__ import annotations

import json

import pytest

from parity.mutation import mutants, mutation_suite as mutants_cmd
from cli.main import main
from parity.engine import RunOptions, run_case
from parity.impls import load
from reports.mutants import FIELDS, load_mutants
from tests.parity.helpers import pick

SPARSE_THD = pick(layout="thd", loss="sparse", dtype="float64")
DENSE_THD_PADDED = pick(layout="thd", loss="dense", alignment_padding=True)
BSHD_WINDOW = pick(layout="bshd", ratio="0")
BSHD_DENSE_BATCH1 = pick(layout="bshd", loss="dense", sequences="1")


def run_cli(tmp_path, capsys, cases, names):
    out = tmp_path / "mut"
    argv = ["mutants", "--suite", "smoke", "--out", str(out), "--no-report", "--quiet"]
    argv += [a for c in cases for a in ("--case-id", c.id)] + [a for n in names for a in ("--mutant", n)]
    code = main(argv)
    stdout = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "mutants.jsonl").read_text().splitlines()]
    return code, stdout, rows, out


def test_clean_cases_pass_and_planted_bugs_are_killed_end_to_end(tmp_path, capsys):
    names = ["kl_full_width_nan", "thd_dense_bwd_no_max_seqlen", "padding_grads_not_zeroed"]
    code, stdout, rows, out = run_cli(tmp_path, capsys, [SPARSE_THD, DENSE_THD_PADDED], names)
    assert "clean: 2 cases: 2 passed, 0 failed, 0 errors, 0 unsupported" in stdout, stdout
    assert stdout.strip().splitlines()[-1] == "mutants: 3/3 killed", stdout
    assert code == 0
    assert all(list(row) == list(FIELDS) and row["status"] == "killed" for row in rows)
    first = {}
    for row in rows:
        first.setdefault(row["mutant"], row)
    # NaN loss caught by the structure rule; the missing max_seqlen by the kernel contract; padding by exact zeros
    assert (first[names[0]]["tensor"], first[names[0]]["check"]) == ("indexer_loss", "structure")
    assert (first[names[1]]["tensor"], first[names[1]]["check"]) == ("(exception)", "error")
    assert first[names[2]]["check"] == "structure" and first[names[2]]["tensor"].startswith("grad/")
    assert first[names[2]]["case_id"] == DENSE_THD_PADDED.id
    report = load_mutants(out)  # the kill matrix the HTML report renders
    assert report.counts == {"killed": 3, "survived": 0, "unreachable": 0}
    assert "indexer_loss" in report.matrix.columns
    assert (out / "results.jsonl").exists()


def test_a_mutant_whose_cells_the_selection_lacks_is_unreachable(tmp_path, capsys):
    code, stdout, rows, _ = run_cli(tmp_path, capsys, [BSHD_WINDOW], ["global_rope_positions"])
    assert code == 1
    assert rows == [{"mutant": "global_rope_positions", "status": "unreachable", "case_id": None, "tensor": None,
                     "check": None}]
    line = next(l for l in stdout.splitlines() if l.startswith("UNREACHABLE"))
    assert mutants.reach_cells("global_rope_positions")[0] in line, line
    assert stdout.strip().splitlines()[-1] == "mutants: 0/1 killed"


def test_a_mutant_that_runs_but_changes_nothing_here_survives(monkeypatch):
    """Negative control: the .view over a batch of one is the right answer, so the suite cannot kill it there; the
    command must say 'survived', not 'killed' (and not 'unreachable': the point did execute)."""
    monkeypatch.setitem(mutants.MUTANTS, "view_over_batch", mutants.dataclasses.replace(mutants.MUTANTS["view_over_batch"], reach=mutants.ANY))
    impl, against, options = load("fused"), load("reference"), RunOptions(provider="torch")
    clean = {BSHD_DENSE_BATCH1.id: ("pass", 0.0)}
    outcome = mutants_cmd.run_mutant("view_over_batch", [BSHD_DENSE_BATCH1], clean,
                                     lambda case: run_case(case, impl, against, options))
    assert (outcome.status, outcome.reached, outcome.kills, outcome.cases_run) == ("survived", True, [], 1)
    assert mutants_cmd.describe(outcome).startswith("SURVIVED")
    assert outcome.rows() == [{"mutant": "view_over_batch", "status": "survived", "case_id": None, "tensor": None,
                               "check": None}]


def test_cases_failing_clean_are_not_used_to_kill():
    calls = []
    outcome = mutants_cmd.run_mutant("sink_dropped_forward", [BSHD_WINDOW], {BSHD_WINDOW.id: ("fail", 0.0)},
                                     calls.append)
    assert calls == [] and outcome.status == "unreachable" and outcome.reaching == 0


def test_unknown_mutant_is_a_usage_error(tmp_path, capsys):
    assert main(["mutants", "--mutant", "sink_droped", "--out", str(tmp_path)]) == 2
    assert "unknown mutant" in capsys.readouterr().err


def test_the_clean_run_refuses_to_start_with_a_mutant_active(tmp_path):
    name = "sink_dropped_forward"
    with mutants.activate(name), pytest.raises(RuntimeError, match="clean run would not be clean"):
        mutants_cmd.mutation_suite([BSHD_WINDOW], [name], tmp_path)


# ---- re-runnable (issue 32, item 8) -----------------------------------------------------------------------------------
def test_mutants_runs_twice_each_run_in_its_own_folder_with_the_link_moved(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default link is reports/out/mutants, relative as in `make mutants`
    argv = ["mutants", "--suite", "smoke", "--case-id", BSHD_WINDOW.id, "--mutant", "sink_dropped_forward",
            "--no-report", "--quiet"]
    link = tmp_path / "reports" / "out" / "mutants"
    folders = []
    for _ in range(2):
        assert main(argv) == 0, capsys.readouterr()
        assert capsys.readouterr().out.strip().splitlines()[-1] == "mutants: 1/1 killed"
        assert link.is_symlink()
        folders.append(link.resolve())
        assert (folders[-1] / "results.jsonl").is_file() and (folders[-1] / "mutants.jsonl").is_file()
        assert not (folders[-1] / ".lock").exists()
    assert folders[0] != folders[1] and folders[0].is_dir()  # the first run is kept, the link names the second
    assert load_mutants(link).counts == {"killed": 1, "survived": 0, "unreachable": 0}


def test_an_explicit_out_holding_a_run_is_refused_unless_forced(tmp_path, capsys):
    """Negative control of the default: one plain directory cannot take two runs without --force."""
    out = tmp_path / "mut"
    argv = ["mutants", "--suite", "smoke", "--case-id", BSHD_WINDOW.id, "--mutant", "sink_dropped_forward",
            "--no-report", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "Traceback" not in err
    assert main(argv + ["--force"]) == 0
    assert [r["status"] for r in map(json.loads, (out / "mutants.jsonl").read_text().splitlines())][:1] == ["killed"]
