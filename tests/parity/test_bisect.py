"""``dsv4-parity bisect``'s search (:func:`parity.history.bisect.search`) with a planted history: ``git bisect run``
semantics (undrivable revisions skipped, never blamed), "no change in range", verdicts read before the registry, and
the tensors that changed verdict. The search over the real history bundle: ``tests/adapters/test_megatron_history.py``.
"""

from __future__ import annotations

import pytest

from parity.history import bisect
from parity.history.git_tree import Commit

CHAIN = [Commit(f"{i:040x}", f"commit {i}") for i in range(1, 21)]  # 20 revisions after the good one
GOOD = Commit("0" * 40, "good")


def verdict(outcome, *failing):
    tensors = {name: "fail" if name in failing else "pass" for name in ("out", "indexer_loss", "grad/hidden")}
    return {"c": bisect.CaseVerdict("c", outcome, failing, tensors)}


def judge_for(first_new: int, skipped=(), new=("pass",), old=("fail", "indexer_loss")):
    seen = []

    def judge(commit):
        i = int(commit.sha, 16)
        seen.append(i)
        if i in skipped:
            return bisect.Step(commit, "skip", why="not a revision this adapter can drive")
        return bisect.Step(commit, "ok", verdict(*(new if i >= first_new else old)))

    return judge, seen


def good_step():
    return bisect.Step(GOOD, "ok", verdict("fail", "indexer_loss"))


@pytest.mark.parametrize("first_new", [1, 7, 13, 20])
def test_the_first_new_revision_is_found_in_log_steps(first_new):
    judge, seen = judge_for(first_new)
    result = bisect.search(CHAIN, good_step(), judge)
    assert result.status == "found" and int(result.first_new.commit.sha, 16) == first_new
    assert int(result.last_old.commit.sha, 16) == first_new - 1
    assert len(seen) <= 6  # bad + ceil(log2(20))
    assert ("c", "indexer_loss", "fail", "pass") in result.changed_tensors()


def test_undrivable_revisions_are_skipped_never_blamed():
    judge, seen = judge_for(10, skipped={9, 10, 11})
    result = bisect.search(CHAIN, good_step(), judge)
    # 9..11 are skipped between the last old (8) and the first new one judged (12): any of 9..12 may be the first
    assert result.status == "skipped-only" and result.first_new.status == "ok"
    assert [int(s.commit.sha, 16) for s in result.candidates] == [9, 10, 11, 12]


def test_a_skip_next_to_the_change_still_finds_it():
    judge, _ = judge_for(12, skipped={11 + 2, 14})  # skipped revisions after the change
    result = bisect.search(CHAIN, good_step(), judge)
    assert result.status == "found" and int(result.first_new.commit.sha, 16) == 12


def test_equal_verdicts_at_both_ends_are_no_change_in_range():
    judge, seen = judge_for(99)  # never new
    result = bisect.search(CHAIN, good_step(), judge)
    assert result.status == "no-change" and seen == [20]
    # negative control: the same history with a change is found
    assert bisect.search(CHAIN, good_step(), judge_for(5)[0]).status == "found"


def test_by_tensors_a_failure_that_moves_is_a_change_by_outcome_it_is_not():
    judge, _ = judge_for(8, new=("fail", "grad/hidden"))
    assert bisect.search(CHAIN, good_step(), judge, mode="outcome").status == "no-change"
    found = bisect.search(CHAIN, good_step(), judge, mode="tensors")
    assert found.status == "found" and int(found.first_new.commit.sha, 16) == 8


def test_an_undrivable_bad_revision_is_refused():
    judge, _ = judge_for(5, skipped={20})
    with pytest.raises(ValueError, match="bad revision"):
        bisect.search(CHAIN, good_step(), judge)


def test_verdicts_are_read_before_the_registry():
    rows = [{"type": "run"},
            {"type": "case", "case_id": "a", "outcome": "known", "message": "m",
             "known": {"id": "e", "status": "reproduced", "was": "fail"}},
            {"type": "tensor", "case_id": "a", "tensor": "indexer_loss", "verdict": "fail"},
            {"type": "tensor", "case_id": "a", "tensor": "out", "verdict": "pass"},
            {"type": "case", "case_id": "b", "outcome": "pass", "known": {"id": "e", "status": "fixed?"}}]
    found = bisect.verdicts_of(rows)
    assert found["a"].outcome == "fail" and found["a"].failing == ("indexer_loss",) and found["a"].registry == "e"
    assert found["b"].outcome == "pass" and found["b"].registry is None  # a fixed? flag changes no verdict


def test_usage_errors_come_before_any_step(tmp_path, capsys):
    """Not a clone, an unknown revision, an unknown case: exit 2 with one line, nothing run."""
    import subprocess

    from cli.main import main

    assert main(["bisect", "--megatron", str(tmp_path), "--good", "a", "--bad", "b", "--case-id", "c"]) == 2
    assert "is not a git repository" in capsys.readouterr().err
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "one"], check=True)
    assert main(["bisect", "--megatron", str(repo), "--good", "nosuchrev", "--bad", "HEAD", "--case-id", "c"]) == 2
    assert "'nosuchrev' names no commit" in capsys.readouterr().err
    assert main(["bisect", "--megatron", str(repo), "--good", "HEAD", "--bad", "HEAD", "--case-id", "c"]) == 2
    assert "the same commit" in capsys.readouterr().err


def test_a_crash_in_production_is_its_own_verdict_not_a_numeric_failure():
    """``fail`` decided by ``raised`` (production raised in its own code) differs from a numeric ``fail`` (found by
    review: a crash between two numeric states moved the blame to the commit that fixed the crash). Control: two
    numeric failures of the same tensors are one verdict."""
    rows = lambda decided: [{"type": "run"}, {"type": "case", "case_id": "a", "outcome": "fail",  # noqa: E731
                                              "decided_by": decided, "message": "m"}]
    crash, numeric = bisect.verdicts_of(rows("raised"))["a"], bisect.verdicts_of(rows("noise_floor"))["a"]
    assert crash.raised and crash.key("outcome") != numeric.key("outcome")
    assert crash.key("tensors") != numeric.key("tensors") and "raised" in crash.describe()
    assert numeric.key("outcome") == bisect.verdicts_of(rows("aggregate"))["a"].key("outcome")


def test_a_verdict_that_changes_twice_is_flagged():
    """old -> X -> bad's verdict: the revision met is reported with a note that the verdict changes more than once.
    Control: one change, no note."""
    def judge(commit):
        i = int(commit.sha, 16)
        state = ("fail", "indexer_loss") if i < 6 else ("unsupported",) if i < 15 else ("pass",)
        return bisect.Step(commit, "ok", verdict(*state))

    result = bisect.search(CHAIN, good_step(), judge)
    assert result.status == "found" and "changes more than once" in result.note
    assert bisect.search(CHAIN, good_step(), judge_for(7)[0]).note == ""


def test_the_json_of_a_range_blames_nothing():
    """``skipped-only``: the range's ends go under ``range``, ``first_new`` / ``last_old`` are null and no tensor is
    listed as changed (found by review: a reader of ``first_new`` blamed a revision that was not adjacent). Control: a
    found change names both."""
    skipped = bisect.to_json(bisect.search(CHAIN, good_step(), judge_for(10, skipped={9, 10, 11})[0]), "outcome")
    assert skipped["first_new"] is None and skipped["last_old"] is None and skipped["changed_tensors"] == []
    assert int(skipped["range"]["upto"]["commit"], 16) == 12 and int(skipped["range"]["after"]["commit"], 16) == 8
    found = bisect.to_json(bisect.search(CHAIN, good_step(), judge_for(10)[0]), "outcome")
    assert int(found["first_new"]["commit"], 16) == 10 and found["range"] is None and found["changed_tensors"]


def test_an_unwritable_json_path_is_a_usage_error_before_any_step(tmp_path, capsys, monkeypatch):
    """``--json`` into a missing directory: exit 2 before any revision runs (found by review: the traceback came
    after the whole bisect, with exit 1, the code of "only skipped revisions left"). A writable path is claimed at
    once with an ``incomplete`` placeholder, so a file from an earlier run never reads as this run's result."""
    import json
    import subprocess

    from cli import bisect_command
    from cli.main import main

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for message in ("one", "two"):
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                        "--allow-empty", "-m", message], check=True)
    ran = []
    monkeypatch.setattr(bisect_command.bisect, "run_step", lambda *a, **k: ran.append(a) or (_ for _ in ()).throw(
        KeyboardInterrupt()))
    args = ["bisect", "--megatron", str(repo), "--good", "HEAD~1", "--bad", "HEAD", "--case-id", "8cd3769bc4c5"]
    assert main([*args, "--json", str(tmp_path / "no" / "dir" / "out.json")]) == 2
    assert "error: json: cannot write" in capsys.readouterr().err and ran == []
    stale = tmp_path / "out.json"
    stale.write_text(json.dumps({"status": "found", "stale": True}))
    assert main([*args, "--json", str(stale)]) == 130  # interrupted in its first step
    assert len(ran) == 1
    claimed = json.loads(stale.read_text())
    assert claimed["status"] == "incomplete" and "stale" not in claimed and claimed["cases"] == ["8cd3769bc4c5"]


def test_a_case_id_is_found_in_the_suite_that_holds_it(tmp_path, capsys, monkeypatch):
    """Without ``--suite``, a gate case id bisects over the gate suite (found by review: only smoke was searched, "no
    case has id"). Control: an id no suite holds is a usage error, before any step."""
    import json
    import subprocess

    from cli import bisect_command
    from cli.main import main

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for message in ("one", "two"):
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                        "--allow-empty", "-m", message], check=True)
    monkeypatch.setattr(bisect_command.bisect, "run_step", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    args = ["bisect", "--megatron", str(repo), "--good", "HEAD~1", "--bad", "HEAD", "--json", str(tmp_path / "b.json")]
    assert main([*args, "--case-id", "7971c6fed744"]) == 130  # reached its first step
    assert json.loads((tmp_path / "b.json").read_text())["suite"] == "gate"
    assert main([*args, "--case-id", "000000000000"]) == 2
    assert "no suite" in capsys.readouterr().err
