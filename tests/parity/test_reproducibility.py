"""The reproducibility contract (README, "Reproducibility"): on one machine and torch build a run's values are a
function of the case, the implementation, the provider and the intra-op thread count; the verdicts do not depend
on the thread count.

* The thread count really changes bits (the premise: without it the rest would assert nothing): smoke case
  a30ba7040990 at 1 and at 2 threads differs in the last bits of several metrics, and agrees on every verdict.
* A run records its thread count as a number (never "the process's default"), and ``--resume`` re-applies it, so a
  resumed run equals an uninterrupted one bit for bit whatever the resuming process's own default is. The negative
  control resumes with an explicit other ``--threads``: it is allowed, says so, and its values differ.
"""

from __future__ import annotations

import json

import pytest
import torch

from cli.main import main
from parity import compare_runs
from tests.parity.test_run_integrity import keep_cases

CASE = "a30ba7040990"  # 5 rows: its cosines differ in the last bit between 1 and 2 threads
TWO = ("7a71760e0223", CASE)
BASE = ["run", "--suite", "smoke", "--impl", "reference", "--quiet", *(a for c in TWO for a in ("--case-id", c))]


def compare(a, b, **kw) -> compare_runs.Agreement:
    return compare_runs.compare(compare_runs.load(a), compare_runs.load(b), **kw)


def run_row(out) -> dict:
    return json.loads((out / "results.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module")
def at_threads(tmp_path_factory):
    """``{1: run dir, 2: run dir}``: the two cases run uninterrupted at 1 and at 2 intra-op threads."""
    runs = {}
    for n in (1, 2):
        out = tmp_path_factory.mktemp(f"t{n}") / "run"
        assert main(BASE + ["--threads", str(n), "--out", str(out)]) == 0
        runs[n] = out
    return runs


def test_the_thread_count_changes_last_bits_never_verdicts(at_threads):
    bitwise = compare(at_threads[1], at_threads[2])
    if bitwise.ok:
        pytest.skip("on this machine 1 and 2 threads give identical bits for these cases: the premise is absent")
    assert bitwise.differing_cases == [CASE]
    assert all(d.what.startswith("metric") for d in bitwise.differences), bitwise.differences[:3]
    assert compare(at_threads[1], at_threads[2], verdicts_only=True).ok  # same outcomes, same per-tensor verdicts


def test_a_run_records_its_thread_count_as_a_number(at_threads, tmp_path):
    assert [run_row(at_threads[n])["threads"] for n in (1, 2)] == [1, 2]
    out = tmp_path / "default"  # no --threads: this process's count, written down
    assert main(BASE[:-2] + ["--out", str(out)]) == 0
    assert run_row(out)["threads"] == torch.get_num_threads()


def test_resume_reapplies_the_recorded_thread_count(at_threads, tmp_path, capsys):
    if compare(at_threads[1], at_threads[2]).ok:
        pytest.skip("1 and 2 threads give identical bits here: a resume at the wrong count would not show")
    before = torch.get_num_threads()
    out = tmp_path / "r"
    assert main(BASE + ["--threads", "2", "--out", str(out)]) == 0
    keep_cases(out, 1)  # killed after the first case: CASE is still to run
    torch.set_num_threads(1)  # the resuming process's own default differs from the recorded 2
    try:
        assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    finally:
        torch.set_num_threads(before)
    assert "differs from the" not in capsys.readouterr().err
    assert compare(at_threads[2], out).ok  # bit for bit the uninterrupted 2-thread run

    # negative control: an explicit other count is honoured, said, and the resumed case's bits differ
    other = tmp_path / "other"
    assert main(BASE + ["--threads", "2", "--out", str(other)]) == 0
    keep_cases(other, 1)
    assert main(["run", "--out", str(other), "--resume", "--quiet", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "note: --threads 1 differs from the 2 intra-op thread(s) the run recorded" in err
    mixed = compare(at_threads[2], other)
    assert not mixed.ok and mixed.differing_cases == [CASE]
    assert compare(at_threads[2], other, verdicts_only=True).ok
