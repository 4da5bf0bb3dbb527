"""Fault injection: kills at random points, a torn last line, a full disk, concurrent writers, a corrupt baseline.

The claim under test: whatever happens to a run, ``dsv4-parity run --out DIR --resume`` then yields what an
uninterrupted run yields (``compare-runs`` AGREE), and nothing is reported that was not done.

* **Kill points.** A SIGKILL stops the writer between two bytes of an append-only stream: what it leaves is a prefix
  of the uninterrupted stream. ``test_resume_after_a_kill_at_any_byte`` cuts the stream at 20 random byte offsets
  (seeded) past the ``run`` row — inside a case row, inside a case's metric rows, between cases, inside the ``end``
  row — and resumes each. ``test_real_sigkills_then_resume`` sends real SIGKILLs to a running child at random
  moments (a few, each a fresh interpreter) and resumes in between.
* **Disk full.** A child with ``RLIMIT_FSIZE`` (SIGXFSZ ignored, so a write fails with EFBIG as on a full disk) set to
  end inside the second case's rows.
* **Concurrent writers.** Two children on one ``--out``: exactly one runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity import compare_runs
from cli.main import main
from tests.parity.test_run_integrity import RUN, TINY, case_ids

REPO = Path(__file__).resolve().parents[2]


def agree(a, b) -> compare_runs.Agreement:
    return compare_runs.compare(compare_runs.load(a), compare_runs.load(b))


def child(argv, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "cli", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(RUN + ["--out", str(out)]) == 0
    return out


def test_resume_after_a_kill_at_any_byte(whole, tmp_path):
    stream = (whole / "results.jsonl").read_bytes()
    start = stream.index(b"\n") + 1  # past the run row (a kill before it leaves nothing to resume)
    offsets = sorted(random.Random(20).sample(range(start, len(stream)), 20))
    for i, cut in enumerate(offsets):
        out = tmp_path / f"k{i}"
        out.mkdir()
        (out / "results.jsonl").write_bytes(stream[:cut])
        assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0, cut
        agreement = agree(whole, out)
        assert agreement.ok, (cut, agreement.differences[:3], agreement.problems)


def test_a_torn_last_line_is_dropped_and_its_case_rerun(whole, tmp_path):
    lines = (whole / "results.jsonl").read_text().splitlines(keepends=True)
    last_metric = max(i for i, line in enumerate(lines) if '"type":"metric"' in line)
    out = tmp_path / "r"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(lines[:last_metric]) + lines[last_metric][:25])
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert agree(whole, out).ok
    assert case_ids(out) == list(TINY)


def _started(proc: subprocess.Popen, out: Path) -> bool:
    """Wait until ``proc`` holds the run directory's lock (it is past its imports) or exits; True if it holds it."""
    while proc.poll() is None:
        try:
            if (out / ".lock").read_text().strip() == str(proc.pid):
                return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def test_real_sigkills_then_resume(whole, tmp_path):
    out = tmp_path / "r"
    rng = random.Random(7)
    argv = RUN + ["--out", str(out)]
    kills = 0
    while kills < 2:
        proc = child(argv)
        if _started(proc, out):
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment: the run row, a case, a write
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=120)
        if proc.returncode == 0:
            break
        stream = out / "results.jsonl"
        argv = ["run", "--out", str(out), "--resume", "--quiet"] if stream.exists() and \
            stream.read_text().startswith('{"type":"run"') else RUN + ["--out", str(out), "--force"]
    else:
        assert main(argv) == 0
    assert kills >= 1  # the child was killed mid-run at least once (it takes longer than 0.4 s past its lock)
    agreement = agree(whole, out)
    assert agreement.ok, (kills, agreement.differences[:3], agreement.problems)


def _limit_file_size(limit: int):
    def apply():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_stops_the_run_keeps_the_finished_cases_and_resume_completes_it(whole, tmp_path):
    lines = (whole / "results.jsonl").read_bytes().splitlines(keepends=True)
    heads = [i for i, line in enumerate(lines) if b'"type":"case"' in line]
    # the run row (its length varies by a few bytes with the path) + the first case + half of the second
    first_case = sum(len(line) for line in lines[heads[0]:heads[1]])
    second_case = sum(len(line) for line in lines[heads[1]:heads[2]])
    out = tmp_path / "r"
    proc = child(RUN + ["--out", str(out)], preexec_fn=_limit_file_size(len(lines[0]) + first_case + second_case // 2))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "File too large" in error[0] and "--resume" in error[0], stderr
    closing = stdout.strip().splitlines()  # what finished, then (the last line) how to continue: issue 32
    assert any(line.startswith(f"stopped after 1 of {len(TINY)} cases") and ": 1 passed, 0 failed" in line
               for line in closing), stdout
    assert closing[-1] == f"continue with: dsv4-parity run --out {out} --resume", stdout
    from parity.run.stream import case_blocks, parse_lines

    blocks, cut = case_blocks(parse_lines((out / "results.jsonl").read_text()))
    assert [b[0]["case_id"] for b in blocks] == [TINY[0]] and cut == [TINY[1]]  # the second one cut mid-rows
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0
    assert agree(whole, out).ok


def test_concurrent_writers_one_runs_the_other_is_refused(whole, tmp_path):
    out = tmp_path / "r"
    procs = [child(RUN + ["--out", str(out)]) for _ in range(2)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    codes = sorted(code for _, _, code in results)
    assert codes == [0, 2], results
    refused = next(err for _, err, code in results if code == 2)
    assert "another dsv4-parity run" in refused or "already holds a run" in refused
    assert "Traceback" not in refused
    assert agree(whole, out).ok  # one run's results, whole


def _baseline(tmp_path, whole, mangle) -> Path:
    """A baseline directory made from ``whole`` by ``compare --update``, then ``mangle(metrics.csv path)``."""
    root = tmp_path / "baselines"
    assert main(["compare", str(whole), "--update", "--baseline", "cpu/b", "--baselines-dir",
                          str(root)]) == 0
    path = root / "cpu" / "b" / "metrics.csv"
    mangle(path)
    return path.parent


def _drop_column(name):
    def mangle(path):
        import pandas as pd

        table = pd.read_csv(path, dtype=str, keep_default_na=False)
        table.drop(columns=[name]).to_csv(path, index=False, lineterminator="\n")
    return mangle


def _replace_values(name, text):
    def mangle(path):
        import pandas as pd

        table = pd.read_csv(path, dtype=str, keep_default_na=False)
        table[name] = text
        table.to_csv(path, index=False, lineterminator="\n")
    return mangle


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])


def _drop_last_rows(path):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:len(lines) // 2]))


def _binary(path):
    path.write_bytes(bytes(range(256)) * 16)


def _garbage(path):
    path.write_text("this is,not\na metrics,table,at all\n")


@pytest.mark.parametrize("mangle, why", [
    (_drop_column("noise_floor_ratio"), "no 'noise_floor_ratio' column"),
    (_replace_values("noise_floor_ratio", "n/a"), "not a number"),
    (_replace_values("noise_floor_ratio", ""), "nothing was compared"),
    (_truncate, "truncated"),
    (_drop_last_rows, "env.json records"),
    (_binary, "binary"),
    (_garbage, "not a metrics CSV"),
])
def test_a_corrupt_baseline_fails_the_gate_saying_why(whole, tmp_path, capsys, mangle, why):
    baseline = _baseline(tmp_path, whole, mangle)
    capsys.readouterr()
    code = main(["compare", str(whole), "--baseline", str(baseline)])
    captured = capsys.readouterr()
    assert code == 2, captured.out
    assert why in captured.err and "PASS" not in captured.out, captured.err


def test_an_intact_baseline_passes_the_gate(whole, tmp_path, capsys):
    baseline = _baseline(tmp_path, whole, lambda path: None)  # negative control of the corrupt-baseline cases
    assert main(["compare", str(whole), "--baseline", str(baseline)]) == 0
    assert "drift gate: PASS" in capsys.readouterr().out
