"""A run directory is a run's, and only a run's (issue 32, items 1, 3 and 9):

* ``--force`` deletes only what a run writes, and only in a directory that holds a run; any other non-empty
  directory is refused with a message that says what is there;
* ``--resume`` on a directory with no recorded run is refused (exit 2, one line), never a fresh run;
* no ``.lock`` is left in a finished run's directory, nor in one whose run was refused.

Each refusal has its negative control: the same command on a directory that holds a run succeeds.
"""

from __future__ import annotations

import fcntl
import os

import pytest

from cli.main import main
from parity.run import rundir
from tests.parity.test_run_integrity import TINY, case_ids

#: one tiny smoke case, reference against itself (well under a second)
ONE = ["run", "--suite", "smoke", "--impl", "reference", "--quiet", "--case-id", TINY[0]]


def one_line_error(capsys, field: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}:") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def foreign(tmp_path):
    """A directory of someone's files, as ``--out .`` in a checkout or a home directory would be."""
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "passwd").write_text("root:x:0:0\n")
    (out / "hosts").write_text("127.0.0.1 localhost\n")
    (out / "sub" / "data.txt").write_text("keep me\n")
    return out


def snapshot(path):
    return sorted((str(p.relative_to(path)), p.read_bytes() if p.is_file() else None) for p in path.rglob("*"))


# ---- item 1: --force ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("force", [False, True])
def test_a_directory_holding_no_run_is_refused_and_left_alone(tmp_path, capsys, force):
    out = foreign(tmp_path)
    before = snapshot(out)
    assert main(ONE + ["--out", str(out)] + (["--force"] if force else [])) == 2
    err = one_line_error(capsys, "out")
    assert "holds no dsv4-parity run" in err and "already holds a run" not in err
    assert all(name in err for name in ("hosts", "passwd", "sub/")), err  # says what is there
    assert ("--force replaces only a run" in err) == force
    assert snapshot(out) == before  # nothing deleted, nothing added (no results.jsonl, no .lock)


def test_force_replaces_a_run_and_keeps_what_no_run_writes(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(ONE + ["--out", str(out)]) == 0
    (out / "index.html").write_text("<html>old report</html>")
    (out / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    assert main(ONE + ["--out", str(out)]) == 2  # negative control of --force: refused without it
    assert "already holds a run" in one_line_error(capsys, "out")
    assert main(ONE + ["--out", str(out), "--force"]) == 0
    assert not (out / "index.html").exists()  # the old run's report went with it
    assert (out / "notes.txt").read_text() == "mine\n"  # not written by a run: kept, and said so
    assert "kept what no run writes: notes.txt" in capsys.readouterr().err
    assert case_ids(out) == [TINY[0]]


def test_a_torn_stream_is_no_run_to_force(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "results.jsonl").write_bytes(bytes(range(256)))  # someone's binary file of that name
    assert main(ONE + ["--out", str(out), "--force"]) == 2
    assert "holds no dsv4-parity run" in one_line_error(capsys, "out")
    assert (out / "results.jsonl").read_bytes() == bytes(range(256))


def test_what_a_run_killed_while_starting_leaves_does_not_block_the_next(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / rundir.STALE).write_text('{"type":"ru')  # killed inside results.create_stream
    (out / rundir.LOCK_NAME).write_text("12345\n")  # and its lock (a SIGKILL cannot clean up)
    assert main(ONE + ["--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl"]


# ---- item 3: --resume needs a recorded run -------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["missing", "empty", "foreign", "empty stream"])
def test_resume_without_a_recorded_run_is_refused(tmp_path, capsys, state):
    out = tmp_path / "r"
    if state == "empty":
        out.mkdir()
    elif state == "foreign":
        out = foreign(tmp_path)
    elif state == "empty stream":
        out.mkdir()
        (out / "results.jsonl").write_text("")
    before = snapshot(out) if out.exists() else None
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 2
    err = one_line_error(capsys, "resume")
    assert "without --resume" in err
    assert (snapshot(out) if out.exists() else None) == before  # no run started, no lock left


def test_resume_of_a_recorded_run_continues_it(tmp_path, capsys):
    """Negative control of the refusals above: a recorded, unfinished run is continued."""
    out = tmp_path / "r"
    assert main(["run", "--suite", "smoke", "--impl", "reference", "--quiet", "--out", str(out),
                 *(a for cid in TINY for a in ("--case-id", cid)), "--budget-s", "0.001"]) == 1
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert case_ids(out) == list(TINY)


def test_metamorphic_resume_needs_a_recorded_oracle_run(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    argv = ["metamorphic", "--oracle", "determinism", "--impl", "reference", "--suite", "smoke", "--case-id",
            TINY[0], "--quiet", "--out", str(out)]
    assert main(argv + ["--resume"]) == 2
    assert "holds no recorded oracle run" in one_line_error(capsys, "resume")
    assert main(argv) == 0  # negative control: a fresh run, then its resume
    assert main(argv + ["--resume"]) == 0
    assert not (out / "determinism" / rundir.LOCK_NAME).exists()


# ---- item 9: no .lock left behind ----------------------------------------------------------------------------------
def test_no_lock_is_left_by_a_finished_or_a_refused_run(tmp_path, capsys):
    out = tmp_path / "r"
    held = rundir.prepare(out, resume=False)
    assert (out / rundir.LOCK_NAME).read_text().strip() == str(os.getpid())  # negative control: a run holds one
    held.close()
    assert not (out / rundir.LOCK_NAME).exists()
    assert main(ONE + ["--out", str(out)]) == 0
    assert not (out / rundir.LOCK_NAME).exists()  # finished
    assert main(ONE + ["--out", str(out)]) == 2  # refused: holds a run
    assert not (out / rundir.LOCK_NAME).exists()
    other = foreign(tmp_path)
    assert main(ONE + ["--out", str(other), "--force"]) == 2  # refused: holds no run
    assert not (other / rundir.LOCK_NAME).exists()


def test_a_refusal_for_a_concurrent_run_keeps_the_holders_lock(tmp_path, capsys):
    out = tmp_path / "r"
    held = rundir.prepare(out, resume=False)
    try:
        with pytest.raises(rundir.CaseError, match="another dsv4-parity run"):
            rundir.prepare(out, resume=True)
        assert (out / rundir.LOCK_NAME).exists()  # the refused run removed nothing of the running one's
    finally:
        held.close()


def test_a_lock_taken_on_a_file_its_holder_just_deleted_is_taken_again(tmp_path, monkeypatch):
    """The race the deleted lock opens: a run opens ``.lock``, the holder deletes it and releases it, then the run's
    ``flock`` succeeds on a file nobody else can see. ``_lock`` must notice and lock the current file."""
    out = tmp_path / "r"
    out.mkdir()
    orphaned = []
    real_flock = fcntl.flock

    def flock(fd, op):
        if not orphaned:  # the holder's close happens between our open and our flock
            (out / rundir.LOCK_NAME).unlink()
            orphaned.append(os.fstat(fd).st_nlink)
        return real_flock(fd, op)

    monkeypatch.setattr(rundir.fcntl, "flock", flock)
    held = rundir.prepare(out, resume=False)
    try:
        assert orphaned == [0]  # negative control: the first lock really was on a deleted file
        assert os.fstat(held.lock_fd).st_ino == os.stat(out / rundir.LOCK_NAME).st_ino
        assert os.fstat(held.lock_fd).st_nlink == 1
    finally:
        held.close()
