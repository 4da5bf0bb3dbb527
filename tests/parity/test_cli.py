"""``dsv4-parity`` end to end: run, exit codes, resume, output directories, isolation, plug-ins."""

import json

import pytest

from cli.main import build_parser, main
from parity.run.runner import resolve_out_dir
from tests.parity.helpers import pick


def rows(out_dir):
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]


def ids(*cases):
    return [arg for c in cases for arg in ("--case-id", c.id)]


def test_a_handful_of_smoke_cases_pass_end_to_end(tmp_path, capsys):
    cases = [pick(dtype="float64", layout="bshd", ratio="128"), pick(dtype="float32", layout="thd", ratio="0"),
             pick(dtype="bfloat16", layout="thd", loss="sparse"), pick(dtype="float32", scope="core", loss="sparse")]
    out = tmp_path / "run"
    code = main(["run", "--suite", "smoke", *ids(*cases), "--out", str(out), "--quiet",
                 "--junit", str(tmp_path / "junit.xml")])
    stdout = capsys.readouterr().out
    assert "4 cases: 4 passed, 0 failed, 0 errors, 0 unsupported" in stdout, stdout
    assert code == 0
    got = rows(out)
    assert got[0]["type"] == "run" and got[-1]["type"] == "end"
    assert got[-1]["counts"] == {"pass": 4, "fail": 0, "error": 0, "unsupported": 0}
    env = got[0]["env"]
    assert {"python", "torch", "cuda", "cudnn", "cudnn_frontend", "flash_mla", "gpu", "driver", "git_rev", "code",
            "host"} <= set(env)
    assert got[0]["impl"] == "fused" and got[0]["against"] == "reference"
    case_rows = [r for r in got if r["type"] == "case"]
    assert [r["case_id"] for r in case_rows] == [c.id for c in cases]
    assert all(r["plan"] for r in case_rows)  # fused recorded which provider ran each stage
    assert (tmp_path / "junit.xml").exists()


def test_a_failing_case_exits_1_with_a_repro(tmp_path, capsys):
    case = pick(dtype="bfloat16", layout="bshd", scope="layer")
    code = main(["run", "--suite", "smoke", *ids(case), "--impl", "tests.parity.fakes:fused_bias",
                 "--out", str(tmp_path / "r"), "--quiet"])
    out = capsys.readouterr().out
    assert code == 1 and "1 cases: 0 passed, 1 failed" in out
    row = next(r for r in rows(tmp_path / "r") if r["type"] == "case")
    assert row["outcome"] == "fail" and row["first_failure"]["tensor"]
    assert row["repro"].startswith("dsv4-parity run --case ") and "--impl tests.parity.fakes:fused_bias" in row["repro"]


def test_an_error_exits_1(tmp_path, capsys):
    case = pick(dtype="float32", layout="bshd", ratio="0")
    code = main(["run", "--case", case.to_json(), "--impl", "tests.parity.fakes:fused_raises",
                 "--out", str(tmp_path / "r"), "--quiet"])
    assert code == 1 and "1 errors" in capsys.readouterr().out


@pytest.mark.parametrize("argv, field", [
    (["--case", '{"config": {}, "layout": {"kind": "bshd", "batch": 1, "seq_len": 4}}'], "config.hidden_size"),
    (["--case", '{"config": 1, "layout": 2, "bogus": 3}'], "bogus"),
    (["--case", "{not json"], "case"),
    (["--suite", "nosuch"], "suite"),
    (["--suite", "smoke", "--case-id", "zzzzzz"], "case_id"),
])
def test_bad_case_input_is_one_line_naming_the_field(argv, field, tmp_path, capsys):
    code = main(["run", *argv, "--out", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {field}:"), err


def test_unknown_implementation_or_provider_is_a_usage_error(tmp_path, capsys):
    assert main(["run", "--impl", "no.such.module", "--out", str(tmp_path / "r")]) == 2
    assert "cannot import implementation" in capsys.readouterr().err
    assert main(["run", "--impl", "reference", "--against", "parity", "--out", str(tmp_path / "r")]) == 2
    assert "lacks attention_layer" in capsys.readouterr().err


def test_resume_runs_only_the_unfinished_cases(tmp_path, capsys):
    a = pick(dtype="float32", layout="bshd", ratio="0")
    b = pick(dtype="float64", layout="bshd", ratio="0")
    out = tmp_path / "r"
    assert main(["run", "--suite", "smoke", *ids(a, b), "--impl", "reference", "--out", str(out), "--quiet"]) == 0
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    b_at = next(i for i, line in enumerate(lines) if f'"case_id":"{b.id}"' in line and '"type":"case"' in line)
    # as if killed while writing case b: its case row torn half-way
    (out / "results.jsonl").write_text("".join(lines[:b_at]) + lines[b_at][:40])
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--resume", "--quiet"]) == 0  # as the hints print it
    got = rows(out)
    assert [r["case_id"] for r in got if r["type"] == "case"] == [a.id, b.id]
    assert [r["type"] for r in got].count("run") == 1 and got[-1]["type"] == "end"
    assert "2 cases: 2 passed" in capsys.readouterr().out


def test_out_directory_rules(tmp_path, monkeypatch):
    root = tmp_path / "reports" / "out"
    monkeypatch.setattr("parity.run.runner.DEFAULT_OUT_ROOT", root)
    latest = root / "latest"
    assert resolve_out_dir(None, "R1", False, False) == (root / "R1", None)
    assert resolve_out_dir(None, "R1", True, False) == (root / "R1", latest)
    # the Makefile's --out reports/out/latest --make-default: a new run directory, the link moves to it
    assert resolve_out_dir(str(latest), "R2", True, False) == (root / "R2", latest)
    assert resolve_out_dir(str(tmp_path / "elsewhere"), "R3", True, False) == (tmp_path / "elsewhere", latest)
    assert resolve_out_dir(str(tmp_path / "elsewhere"), "R3", False, False) == (tmp_path / "elsewhere", None)


def test_make_default_moves_the_latest_link_and_resume_follows_it(tmp_path, monkeypatch, capsys):
    root = tmp_path / "reports" / "out"
    monkeypatch.setattr("parity.run.runner.DEFAULT_OUT_ROOT", root)
    case = pick(dtype="float64", layout="bshd", ratio="0")
    link = root / "latest"
    args = ["run", "--suite", "smoke", *ids(case), "--impl", "reference", "--quiet", "--out", str(link),
            "--make-default", "--no-report"]
    assert main(args) == 0
    first = link.resolve()
    assert link.is_symlink() and (first / "results.jsonl").exists()
    assert f"report:  dsv4-parity report {link}" in capsys.readouterr().out
    monkeypatch.setattr("cli.run_command.new_run_id", lambda *a: "second-run")
    assert main(args) == 0
    assert link.resolve() == root / "second-run" != first
    assert main(args + ["--resume"]) == 0  # continues in the directory the link points at
    assert link.resolve() == root / "second-run"
    assert len([r for r in rows(link) if r["type"] == "case"]) == 1


def test_worker_isolation_turns_a_crash_into_one_error(tmp_path):
    crash = pick(dtype="float32", layout="thd", ratio="0")
    fine = pick(dtype="float32", layout="bshd", ratio="0")
    code = main(["run", "--suite", "smoke", *ids(crash, fine), "--impl", "tests.parity.fakes:reference_crashes",
                 "--isolate", "worker", "--out", str(tmp_path / "r"), "--quiet"])
    assert code == 1
    got = {r["case_id"]: r for r in rows(tmp_path / "r") if r["type"] == "case"}
    assert got[crash.id]["outcome"] == "error" and "worker crashed (exit code 3)" in got[crash.id]["message"]
    assert got[fine.id]["outcome"] == "pass"  # a fresh worker took over


def test_help_and_plugins():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"run", "metamorphic", "calibrate"} <= set(sub.choices)
    assert "--impl" in sub.choices["shrink"].format_help()  # shrink runs the parity predicate
    text = sub.choices["run"].format_help()
    for word in ("--suite", "--resume", "--require", "--junit", "--make-default", "unsupported", "--oracle"):
        assert word in text


def test_shrink_uses_the_parity_predicate(tmp_path, capsys):
    case = pick(dtype="bfloat16", layout="bshd", scope="layer")
    code = main(["shrink", "--case", case.to_json(), "--impl", "tests.parity.fakes:fused_bias", "--max-calls", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "dsv4-parity run --case" in captured.out
    assert "original case" in captured.err and "fail (aggregate)" in captured.err


def test_require_provider(tmp_path, capsys):
    case = pick(dtype="float32", layout="bshd", ratio="0")
    assert main(["run", "--case", case.to_json(), "--require", "torch", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    row = next(r for r in rows(tmp_path / "a") if r["type"] == "case")
    assert set(row["plan"].values()) == {"torch"}
    # an implementation that reports no provider cannot satisfy a requirement: a silent fallback fails
    assert main(["run", "--case", case.to_json(), "--impl", "reference", "--require", "torch",
                 "--out", str(tmp_path / "b"), "--quiet"]) == 1
    row = next(r for r in rows(tmp_path / "b") if r["type"] == "case")
    assert row["decided_by"] == "require" and "did not run" in row["message"]


@pytest.mark.parametrize("isolate", ["none", "worker"])
def test_a_spent_budget_starts_no_case_lists_the_rest_and_fails(tmp_path, capsys, isolate):
    a = pick(dtype="float32", layout="bshd", ratio="0")
    b = pick(dtype="float64", layout="bshd", ratio="0")
    out = tmp_path / "r"
    code = main(["run", "--suite", "smoke", *ids(a, b), "--impl", "reference", "--out", str(out), "--quiet",
                 "--isolate", isolate, "--budget-s", "1e-9"])
    assert code == 1  # a time-boxed run never passes as a whole one
    got = rows(out)
    assert [r for r in got if r["type"] == "case"] == []
    assert got[-1]["stopped"] == "budget" and got[-1]["not_run"] == [a.id, b.id]
    assert "2 of 2 cases not run" in capsys.readouterr().err
    from reports.load import load_run

    assert load_run(out / "results.jsonl").complete is False
    # --resume finishes it; the end row is then a plain one (negative control of the budget's effect)
    assert main(["run", "--suite", "smoke", *ids(a, b), "--impl", "reference", "--out", str(out), "--resume",
                 "--quiet", "--isolate", isolate, "--budget-s", "600"]) == 0
    got = rows(out)
    assert [r["case_id"] for r in got if r["type"] == "case"] == [a.id, b.id]
    assert "not_run" not in got[-1] and load_run(out / "results.jsonl").complete is True


def test_case_rows_time_the_phases(tmp_path):
    a = pick(dtype="bfloat16", layout="thd", loss="sparse")
    main(["run", "--suite", "smoke", *ids(a), "--out", str(tmp_path / "r"), "--quiet"])
    case = [r for r in rows(tmp_path / "r") if r["type"] == "case"][0]
    phases = case["phases_s"]
    assert set(phases) == {"materialize", "impl", "sign_split", "reference", "compare"}  # sign-split: bf16 + loss
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= case["duration_s"]
