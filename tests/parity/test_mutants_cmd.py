"""``dsv4-parity mutants``: planted bugs are killed by the suite, reported in the kill-matrix schema of
``reports/mutants.py``; a mutant no case can reach is ``unreachable`` (naming the missing cell), one that runs but is
never noticed is ``survived``; the exit code and the last line say so."""

from __future__ import annotations

import json

import pytest

from cases.coverage import parse_cell
from fused import mutants
from parity import mutants_cmd
from parity.cli import main
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


def test_every_registered_mutant_declares_parseable_reach_cells():
    registered = list(mutants_cmd.registered())
    assert len(registered) >= 18 and set(mutants.registered()) <= set(registered)
    assert mutants_cmd.catalogue_problems(registered) == []
    for name in registered:
        for text in mutants_cmd.CATALOGUE[name]:
            if text:
                parse_cell(text)
    # negative control: a registered mutant without cells, and a declared name nobody registered, are reported
    problems = mutants_cmd.catalogue_problems(registered[1:] + ["planted_without_cells"])
    assert any("planted_without_cells" in p for p in problems)
    assert any(repr(registered[0]) in p for p in problems)


def test_reach_is_recorded_only_for_active_mutants():
    mutants.clear_reached()
    assert not mutants.is_active(mutants.KL_FULL_WIDTH_NAN) and mutants.reached() == frozenset()
    with mutants.activate(mutants.KL_FULL_WIDTH_NAN):
        assert not mutants.is_active(mutants.SINK_DROPPED_FORWARD)
        assert mutants.is_active(mutants.KL_FULL_WIDTH_NAN)
    assert mutants.reached() == {mutants.KL_FULL_WIDTH_NAN}
    mutants.clear_reached()


def test_clean_cases_pass_and_planted_bugs_are_killed_end_to_end(tmp_path, capsys):
    names = [mutants.KL_FULL_WIDTH_NAN, mutants.THD_DENSE_BWD_NO_MAX_SEQLEN, mutants.PADDING_GRADS_NOT_ZEROED]
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
    code, stdout, rows, _ = run_cli(tmp_path, capsys, [BSHD_WINDOW], [mutants.GLOBAL_ROPE_POSITIONS])
    assert code == 1
    assert rows == [{"mutant": "global_rope_positions", "status": "unreachable", "case_id": None, "tensor": None,
                     "check": None}]
    line = next(l for l in stdout.splitlines() if l.startswith("UNREACHABLE"))
    assert mutants_cmd.CATALOGUE["global_rope_positions"][0] in line, line
    assert stdout.strip().splitlines()[-1] == "mutants: 0/1 killed"


def test_a_mutant_that_runs_but_changes_nothing_here_survives(monkeypatch):
    """Negative control: the .view over a batch of one is the right answer, so the suite cannot kill it there; the
    command must say 'survived', not 'killed' (and not 'unreachable': the point did execute)."""
    monkeypatch.setitem(mutants_cmd.CATALOGUE, mutants.VIEW_OVER_BATCH, mutants_cmd.ANY)
    impl, against, options = load("fused"), load("reference"), RunOptions(provider="torch")
    clean = {BSHD_DENSE_BATCH1.id: ("pass", 0.0)}
    outcome = mutants_cmd.run_mutant(mutants.VIEW_OVER_BATCH, [BSHD_DENSE_BATCH1], clean,
                                     lambda case: run_case(case, impl, against, options))
    assert (outcome.status, outcome.reached, outcome.kills, outcome.cases_run) == ("survived", True, [], 1)
    assert mutants_cmd.describe(outcome).startswith("SURVIVED")
    assert outcome.rows() == [{"mutant": "view_over_batch", "status": "survived", "case_id": None, "tensor": None,
                               "check": None}]


def test_cases_failing_clean_are_not_used_to_kill():
    calls = []
    outcome = mutants_cmd.run_mutant(mutants.SINK_DROPPED_FORWARD, [BSHD_WINDOW], {BSHD_WINDOW.id: ("fail", 0.0)},
                                     calls.append)
    assert calls == [] and outcome.status == "unreachable" and outcome.reaching == 0


def test_unknown_mutant_is_a_usage_error(tmp_path, capsys):
    assert main(["mutants", "--mutant", "sink_droped", "--out", str(tmp_path)]) == 2
    assert "unknown mutant" in capsys.readouterr().err


def test_the_clean_run_refuses_to_start_with_a_mutant_active(tmp_path):
    name = mutants.SINK_DROPPED_FORWARD
    with mutants.activate(name), pytest.raises(RuntimeError, match="clean run would not be clean"):
        mutants_cmd.mutation_suite([BSHD_WINDOW], [name], tmp_path)
