"""Runs that cannot lie: resume continues the recorded run, `latest` names the newest run from its start, cut-off
and errored cases are re-run, a run directory is never clobbered or shared, user-caused conditions are one line.

Every test here failed on the code before issue 20 (see the commit message for the record). The fault-injection
tests (kills, a torn line, a full disk, concurrent writers) are in ``test_fault_injection.py``.
"""

from __future__ import annotations

import json

import pytest

from parity import compare_runs
from cli.main import main
from parity.run.runner import resolve_out_dir
from tests.parity.helpers import pick

#: the three smallest smoke cases (2, 4 and 5 rows), reference against itself: well under a second each on a CPU
TINY = ("8cd3769bc4c5", "7a71760e0223", "a30ba7040990")
#: one intra-op thread, explicitly: runs made here in-process (pytest's thread count) and in child interpreters
#: (their own default) are compared bit for bit, which holds only at one thread count (README, "Reproducibility";
#: a30ba7040990 differs in the last bits between 1 and 2 threads, tests/parity/test_reproducibility.py)
RUN = ["run", "--suite", "smoke", "--impl", "reference", "--quiet", "--threads", "1",
       *(a for cid in TINY for a in ("--case-id", cid))]


def rows(out_dir):
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]


def case_ids(out_dir):
    return [r["case_id"] for r in rows(out_dir) if r["type"] == "case"]


def agree(a, b) -> bool:
    return compare_runs.compare(compare_runs.load(a), compare_runs.load(b)).ok


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run every interrupted-and-resumed run must equal."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(RUN + ["--out", str(out)]) == 0
    return out


def keep_cases(out_dir, n: int) -> None:
    """Cut the stream after its first ``n`` whole cases (as a kill between two cases leaves it)."""
    kept, seen = [], 0
    for line in (out_dir / "results.jsonl").read_text().splitlines(keepends=True):
        row = json.loads(line)
        if row["type"] == "case":
            seen += 1
        if row["type"] == "end" or seen > n:
            break
        kept.append(line)
    (out_dir / "results.jsonl").write_text("".join(kept))


# ---- 1. --resume continues the recorded run ------------------------------------------------------------------------
def test_resume_as_printed_continues_the_recorded_selection_and_implementation(whole, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out)]) == 0
    keep_cases(out, 2)
    # the README / --help / hints form: no --suite, no --impl, no --limit
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert case_ids(out) == case_ids(whole) == list(TINY)  # not the 48 smoke cases, not fused
    assert rows(out)[0]["impl"] == "reference"
    assert agree(whole, out)
    assert "3 cases: 3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("extra, option", [
    (["--impl", "fused"], "--impl"),
    (["--provider", "torch"], "--provider"),
    (["--suite", "nightly"], "--suite"),
    (["--limit", "2"], "--limit"),
    (["--case-id", TINY[0]], "--case-id"),
])
def test_resume_with_a_conflicting_option_is_a_usage_error(whole, tmp_path, capsys, extra, option):
    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out)]) == 0
    keep_cases(out, 1)
    before = (out / "results.jsonl").read_text()
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--resume", "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {option}:"), err
    assert (out / "results.jsonl").read_text() == before  # nothing appended


def test_resume_repeating_the_recorded_options_is_fine(whole, tmp_path):
    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out)]) == 0
    keep_cases(out, 1)
    assert main(RUN + ["--out", str(out), "--resume"]) == 0  # negative control of the conflict check
    assert case_ids(out) == case_ids(whole)


def test_the_budget_hint_works_as_printed(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out), "--budget-s", "1e-9"]) == 1
    hint = capsys.readouterr().err
    command = hint.split("continue with: ", 1)[1].split(")")[0].split()
    assert command[:2] == ["dsv4-parity", "run"] and "--resume" in command
    assert main(command[1:] + ["--quiet"]) == 0
    assert case_ids(out) == list(TINY)


def test_resume_of_an_ad_hoc_case_list_keeps_it(tmp_path):
    a = pick(dtype="float32", layout="bshd", ratio="0")
    b = pick(dtype="float64", layout="bshd", ratio="0")
    out = tmp_path / "r"
    assert main(["run", "--case", a.to_json(), "--case", b.to_json(), "--impl", "reference", "--quiet",
                 "--out", str(out)]) == 0
    keep_cases(out, 1)
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert case_ids(out) == [a.id, b.id]


# ---- 2. latest names the newest run from its start -----------------------------------------------------------------
def test_a_killed_run_is_latest_and_resume_continues_it(tmp_path, monkeypatch, capsys):
    root = tmp_path / "reports" / "out"
    monkeypatch.setattr("parity.run.runner.DEFAULT_OUT_ROOT", root)
    link = root / "latest"
    args = RUN + ["--out", str(link), "--make-default", "--no-report"]
    monkeypatch.setattr("cli.run_command.new_run_id", lambda *a: "first")
    assert main(args) == 0  # a complete older run
    monkeypatch.setattr("cli.run_command.new_run_id", lambda *a: "second")
    import parity.run.runner as runner

    real, calls = runner.execute, []

    def killed_at_the_third_case(request):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(request)

    monkeypatch.setattr(runner, "execute", killed_at_the_third_case)
    assert main(args) == 130
    assert "continue with: dsv4-parity run --out" in capsys.readouterr().err
    assert link.resolve() == root / "second"  # latest moved when the run started, not when it ended
    monkeypatch.setattr(runner, "execute", real)
    assert main(["run", "--out", str(link), "--resume", "--quiet"]) == 0
    assert case_ids(root / "second") == list(TINY)
    assert "2 cases already done, 1 to run" in capsys.readouterr().err


# ---- 3. cut-off and errored cases are re-run -----------------------------------------------------------------------
def test_a_case_cut_off_mid_rows_is_rerun(whole, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out)]) == 0
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    second = [i for i, line in enumerate(lines) if '"type":"case"' in line][1]
    (out / "results.jsonl").write_text("".join(lines[:second + 5]))  # 4 of its rows survived, all whole lines
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert "again: 1 cut off" in capsys.readouterr().err
    assert agree(whole, out)


def test_a_cut_off_case_is_flagged_by_the_report_loader(whole, tmp_path):
    from reports.load import load_run

    lines = (whole / "results.jsonl").read_text().splitlines(keepends=True)
    second = [i for i, line in enumerate(lines) if '"type":"case"' in line][1]
    (tmp_path / "results.jsonl").write_text("".join(lines[:second + 5]))
    assert any("cut off" in w for w in load_run(tmp_path / "results.jsonl").warnings)
    assert not any("cut off" in w for w in load_run(whole / "results.jsonl").warnings)


def test_errored_cases_are_retried_by_resume(tmp_path, monkeypatch):
    out = tmp_path / "r"
    argv = ["run", "--suite", "smoke", "--impl", "tests.parity.fakes:reference_flaky", "--case-id", TINY[1],
            "--quiet", "--out", str(out)]
    monkeypatch.setenv("DSV4_TEST_FLAKY", "1")
    assert main(argv) == 1
    assert {r["outcome"] for r in rows(out) if r["type"] == "case"} == {"error"}
    monkeypatch.delenv("DSV4_TEST_FLAKY")
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    got = [r for r in rows(out) if r["type"] == "case"]
    assert len(got) == 1 and got[0]["outcome"] == "pass"


# ---- 5. an existing run directory is never clobbered, nor shared ---------------------------------------------------
def test_an_existing_run_directory_is_refused_without_resume_or_force(whole, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out)]) == 0
    (out / "index.html").write_text("<html>old</html>")
    before = (out / "results.jsonl").read_text()
    capsys.readouterr()
    assert main(RUN + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: out:") and "--resume" in err and "--force" in err and len(err.splitlines()) == 1
    assert (out / "results.jsonl").read_text() == before
    assert main(RUN + ["--out", str(out), "--force"]) == 0
    assert not (out / "index.html").exists() and case_ids(out) == list(TINY)


def test_a_second_writer_is_refused_while_the_lock_is_held(whole, tmp_path, capsys):
    from parity.run.rundir import prepare

    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out), "--budget-s", "0.001"]) == 1  # a recorded run with cases left to run
    held = prepare(out, resume=True)
    try:
        assert main(RUN + ["--out", str(out), "--resume"]) == 2
        assert "another dsv4-parity run" in capsys.readouterr().err
    finally:
        held.close()
    assert main(RUN + ["--out", str(out), "--resume"]) == 0  # released: negative control
    assert agree(whole, out)


# ---- 6. user-caused conditions: one line, non-zero, before the first case -----------------------------------------
def test_out_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(RUN + ["--out", str(tmp_path / "file" / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: out:") and len(err.splitlines()) == 1
    assert main(RUN + ["--out", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_an_unwritable_junit_is_refused_before_the_first_case(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out), "--junit", str(tmp_path / "file" / "junit.xml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: junit:") and len(err.splitlines()) == 1
    assert not (out / "results.jsonl").exists()


@pytest.mark.parametrize("command", ["report", "calibrate", "compare-runs"])
def test_a_binary_results_file_is_rc_2_in_every_reader(whole, tmp_path, capsys, command):
    junk = tmp_path / "results.jsonl"
    junk.write_bytes(bytes(range(256)) * 8)
    argv = {"report": ["report", str(junk), "--baseline", "none"], "calibrate": ["calibrate", str(junk)],
            "compare-runs": ["compare-runs", str(junk), str(whole)]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "binary" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_without_torch_is_one_line():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['dsv4-parity', 'run']; import runpy; "
            "runpy.run_module('cli', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot import torch" in done.stderr and "Traceback" not in done.stderr


# ---- 7. validation -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, option", [
    (["--budget-s", "0"], "--budget-s"), (["--budget-s", "-5"], "--budget-s"), (["--timeout", "0"], "--timeout"),
    (["--limit", "0"], "--limit"), (["--limit", "-1"], "--limit"),
])
def test_non_positive_limits_are_usage_errors(tmp_path, capsys, extra, option):
    out = tmp_path / "r"
    assert main(["run", "--suite", "smoke", "--impl", "reference", "--quiet", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {option}:") and len(err.splitlines()) == 1, err
    assert not (out / "results.jsonl").exists()


@pytest.mark.parametrize("text", ["{not json", '{"classes": 3}', "[1, 2]"])
def test_a_bad_policy_is_a_usage_error(tmp_path, capsys, text):
    policy = tmp_path / "policy.json"
    policy.write_text(text)
    assert main(RUN + ["--out", str(tmp_path / "r"), "--policy", str(policy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: policy") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r" / "results.jsonl").exists()


def test_case_id_across_suites(tmp_path, capsys):
    from cases.suites import load_suite, suite_names

    by_id: dict = {}
    for name in suite_names():
        for case in load_suite(name):
            by_id.setdefault(case.id, set()).add(name)
    shared = next((cid for cid, names in by_id.items() if len(names) > 1), None)
    if shared is not None:  # one case in two suites is one case, not an ambiguity
        assert main(["run", "--case-id", shared, "--impl", "reference", "--quiet", "--out", str(tmp_path / "a")]) \
            in (0, 1)
        assert case_ids(tmp_path / "a") == [shared]
    ids = sorted(by_id)
    import os.path

    prefix = max((os.path.commonprefix([a, b]) for a, b in zip(ids, ids[1:])), key=len)  # two near-twin ids
    assert main(["run", "--case-id", prefix, "--quiet", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: case_id:") and "cases match" in err and len(err.splitlines()) == 1
    for hit in (cid for cid in ids if cid.startswith(prefix)):
        assert f"{hit} ({'/'.join(sorted(by_id[hit], key=suite_names().index))})" in err


# ---- 8. shrink ------------------------------------------------------------------------------------------------------
def test_shrink_prints_one_repro_that_carries_the_options(capsys):
    case = pick(dtype="bfloat16", layout="bshd", scope="layer")
    assert main(["shrink", "--case", case.to_json(), "--impl", "tests.parity.fakes:fused_bias",
                 "--max-calls", "2"]) == 0
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("dsv4-parity run --case") == 1
    assert "--impl tests.parity.fakes:fused_bias" in captured.out


# ---- output ---------------------------------------------------------------------------------------------------------
def test_a_run_off_a_terminal_prints_progress_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("parity.run.progress.EVERY_S", 0.0)
    assert main(RUN[:5] + ["--case-id", TINY[0], "--case-id", TINY[1], "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "progress: 1/2 cases (1 pass, 0 fail, 0 error, 0 unsupported)" in err and "ETA" in err
    assert "progress: 2/2 cases" in err


def test_unsupported_cases_are_one_line_per_reason_and_failures_print_a_repro(tmp_path, capsys):
    argv = ["run", "--suite", "smoke", "--isolate", "none", *RUN[6:]]
    assert main(argv + ["--impl", "tests.parity.fakes:fused_unsupported", "--out", str(tmp_path / "u")]) == 0
    err = capsys.readouterr().err
    assert err.count("UNSUPPORTED") == 1 and "UNSUPPORTED 3 cases: " in err
    assert main(argv + ["--impl", "tests.parity.fakes:fused_raises", "--out", str(tmp_path / "e")]) == 1
    err = capsys.readouterr().err
    assert err.count("ERROR") == 3 and err.count("  repro: dsv4-parity run --case") == 3


def test_resume_needs_an_out_directory(capsys):
    assert main(["run", "--resume", "--quiet"]) == 2
    assert "needs --out" in capsys.readouterr().err


def test_out_directory_rules_are_unchanged(tmp_path, monkeypatch):
    root = tmp_path / "reports" / "out"
    monkeypatch.setattr("parity.run.runner.DEFAULT_OUT_ROOT", root)
    assert resolve_out_dir(str(root / "latest"), "R2", True, False) == (root / "R2", root / "latest")


def test_a_case_that_cannot_fit_in_memory_is_refused_up_front_with_its_estimate(tmp_path, capsys, monkeypatch):
    from parity.run import memory

    case = pick(dtype="float32", layout="bshd", ratio="0")
    need = sum(memory.working_set(case).values())
    monkeypatch.setattr(memory, "host_available_bytes", lambda: need - 1)
    out = tmp_path / "r"
    assert main(["run", "--case", case.to_json(), "--impl", "reference", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: case:") and case.id in err and "GiB" in err and len(err.splitlines()) == 1
    assert not (out / "results.jsonl").exists()
    monkeypatch.setattr(memory, "host_available_bytes", lambda: need)  # negative control: it fits exactly
    assert main(["run", "--case", case.to_json(), "--impl", "reference", "--quiet", "--out", str(out)]) == 0


def test_a_passing_run_prints_no_repro_in_its_report(whole, capsys):
    assert main(["report", str(whole), "--baseline", "none", "--no-html", "--no-csv"]) == 0
    out = capsys.readouterr().out
    assert "Worst offenders" in out and TINY[0] in out  # the offenders table keeps the case ids
    assert "dsv4-parity run --case" not in out and "Repro" not in out


@pytest.mark.parametrize("edit", [{"code": "0000000older"}, {"torch": "2.0.0"}, None, {"git_rev": "0000000older"}],
                         ids=["other-code", "other-torch", "same-environment", "other-commit-same-code"])
def test_a_resume_under_another_environment_is_recorded_and_makes_the_run_incomplete(whole, tmp_path, capsys, edit):
    """A run killed, then resumed after the code (or torch) changed, mixes cases of two environments: the resume
    writes a ``resume`` row naming what changed, says so, and the run reads as incomplete (the drift gate fails it,
    it cannot become a baseline). Controls: a resume in the same environment writes none; nor does one at another
    commit of the same code (a commit of baselines or prose between two calls of one GPU gate)."""
    from reports.baselines import save_baseline
    from reports.errors import ReportError
    from reports.load import load_run
    from reports.table import metrics_table

    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out)]) == 0
    keep_cases(out, 2)
    if edit:
        lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
        head = json.loads(lines[0])
        head["env"].update(edit)
        (out / "results.jsonl").write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    err = capsys.readouterr().err
    resumes = [r for r in rows(out) if r["type"] == "resume"]
    data = load_run(out)
    if edit is None or "git_rev" in edit:
        assert resumes == [] and data.incompleteness() == [] and "another environment" not in err
        return
    (key, value), = edit.items()
    assert len(resumes) == 1 and resumes[0]["changed"][key][0] == value and resumes[0]["done"] == 2
    assert "resuming under another environment" in err and key in err
    assert [p for p in data.incompleteness() if p.startswith("resumed under another environment")]
    with pytest.raises(ReportError, match="resumed under another environment"):
        save_baseline(data, metrics_table(data), "cpu/x", root=tmp_path / "b")
    # a later resume keeps the record (the stream is rewritten for appending)
    keep_cases(out, 3)
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert [r for r in rows(out) if r["type"] == "resume"][0] == resumes[0]


def test_a_resume_with_nothing_left_to_run_records_no_other_environment(whole, tmp_path, capsys):
    """A finished run resumed under other code runs no case there: no ``resume`` row, the run stays whole (found by
    review: ``gate --resume`` resumes every path, finished ones too, and marked them incomplete)."""
    from reports.load import load_run

    out = tmp_path / "r"
    assert main(RUN + ["--out", str(out)]) == 0
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["env"]["code"] = "0000000older"
    (out / "results.jsonl").write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert [r for r in rows(out) if r["type"] == "resume"] == [] and load_run(out).incompleteness() == []


def test_what_a_resume_counts_as_another_environment():
    """The GPU counts by its architecture (a larger card of the same one re-runs the cases that did not fit); the
    kernel libraries not for a provider that runs none of them; code and torch always."""
    from parity.run.environment import environment_changes

    env = {"git_rev": "a", "torch": "2.11", "gpu": "NVIDIA H100 80GB HBM3 (sm90)", "flash_mla": "1.0.0",
           "cudnn_frontend": "1.32.0", "host": "x", "driver": "1"}
    assert environment_changes(env, {**env, "gpu": "NVIDIA H200 (sm90)", "host": "y", "driver": "2"}) == {}
    assert environment_changes(env, {**env, "gpu": "NVIDIA B200 (sm100)"}) == {
        "gpu": ["NVIDIA H100 80GB HBM3 (sm90)", "NVIDIA B200 (sm100)"]}
    assert environment_changes(env, {**env, "flash_mla": None}, "unfused") == {}
    assert environment_changes(env, {**env, "flash_mla": None}, "cudnn") == {"flash_mla": ["1.0.0", None]}
    assert environment_changes(env, {**env, "git_rev": "b"}, "unfused") == {"git_rev": ["a", "b"]}
    assert environment_changes(None, env) == {}
    # a run that records its code is judged by it: another commit of the same code is no change, other code is
    coded = {**env, "code": "c"}
    assert environment_changes(coded, {**coded, "git_rev": "b"}) == {}
    assert environment_changes(coded, {**coded, "code": "d"}) == {"code": ["c", "d"]}


def _repo_with_one_commit(path):
    """A git repository at ``path`` with ``a.py`` (``x = 1``) committed; returns ``git(*args)`` run there."""
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    return git


def test_the_revision_of_an_uncommitted_tree_names_its_content(tmp_path):
    """``git_rev`` of a dirty tree carries a hash of the change (tracked diff and untracked files), so a resume
    under other uncommitted code of the same commit counts as another environment; a clean tree is the bare commit
    (the control), and the same change gives the same name."""
    from parity.run.environment import git_rev

    git = _repo_with_one_commit(tmp_path)
    clean = git_rev(tmp_path)
    assert clean and "-dirty" not in clean
    (tmp_path / "a.py").write_text("x = 2\n")
    first = git_rev(tmp_path)
    assert first.startswith(clean + "-dirty.") and first == git_rev(tmp_path)
    (tmp_path / "a.py").write_text("x = 3\n")
    second = git_rev(tmp_path)
    assert second.startswith(clean + "-dirty.") and second != first
    (tmp_path / "a.py").write_text("x = 1\n")
    assert git_rev(tmp_path) == clean
    (tmp_path / "new.py").write_text("y = 1\n")  # an untracked module changes what runs too
    untracked = git_rev(tmp_path)
    assert untracked.startswith(clean + "-dirty.")
    (tmp_path / "new.py").write_text("y = 2\n")
    assert git_rev(tmp_path) not in (untracked, clean)
    (tmp_path / "new.py").unlink()
    (tmp_path / "reports" / "baselines" / "h200" / "gate").mkdir(parents=True)  # data and prose are not code
    (tmp_path / "reports" / "baselines" / "h200" / "gate" / "metrics.csv").write_text("case_id\n")
    (tmp_path / "NOTE.md").write_text("measured\n")
    assert git_rev(tmp_path) == clean
    (tmp_path / "runs" / "x").mkdir(parents=True)  # a run's own outputs in the checkout (found by review)
    (tmp_path / "runs" / "x" / "results.jsonl").write_text("{}\n")
    (tmp_path / "runs" / "x" / ".lock").write_text("123\n")
    assert git_rev(tmp_path) == clean
    (tmp_path / "a.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: named, not raised (found by review)
    latin = git_rev(tmp_path)
    assert latin.startswith(clean + "-dirty.")
    git("config", "core.abbrev", "20")  # diff settings and staging do not rename the same code
    git("add", "a.py")
    assert git_rev(tmp_path) == latin


def test_the_code_of_a_run_survives_a_commit_of_prose_or_baselines_alone(tmp_path):
    """``code_rev`` names the code, not the commit: committing a NOTE or a baseline keeps it (a GPU gate started
    before such a commit is continued after it); committing code changes it (the control), and uncommitted code
    carries the same suffix as ``git_rev``."""
    from parity.run.environment import code_rev, git_rev

    git = _repo_with_one_commit(tmp_path)
    first_commit, code = git_rev(tmp_path), code_rev(tmp_path)
    assert code and len(code) == 12 and "-dirty" not in code
    (tmp_path / "README.md").write_text("measured\n")
    (tmp_path / "reports" / "baselines" / "h200" / "x").mkdir(parents=True)
    (tmp_path / "reports" / "baselines" / "h200" / "x" / "metrics.csv").write_text("case_id\n")
    git("add", "-A")
    git("commit", "-qm", "data and prose")
    assert git_rev(tmp_path) != first_commit and code_rev(tmp_path) == code
    (tmp_path / "a.py").write_text("x = 2\n")
    dirty = code_rev(tmp_path)
    assert dirty.startswith(code + "-dirty.") and dirty.split("-dirty.")[1] == git_rev(tmp_path).split("-dirty.")[1]
    git("commit", "-qam", "code")
    assert code_rev(tmp_path) not in (code, dirty) and "-dirty" not in code_rev(tmp_path)
    (tmp_path / "b.md").write_text("x\n")  # more prose keeps it; a mode change is code
    git("add", "b.md")
    git("commit", "-qm", "more prose")
    after_prose = code_rev(tmp_path)
    (tmp_path / "a.py").chmod(0o755)
    git("commit", "-qam", "mode")
    assert code_rev(tmp_path) != after_prose
