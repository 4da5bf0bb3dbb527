"""``dsv4-parity gate`` (``make parity``): every production path in one gate, each against its own baseline, one
summary at the end naming the report to open (cli/gate_command.py, reports/gate.py).

One tiny smoke case per run keeps these quick (a few seconds each); the Megatron ones need Megatron-LM (the pinned
snapshot or ``DSV4_MEGATRON``) and are skipped, saying why, without it.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cli.gate_command import paths_of, strip_options
from cli.main import build_parser, main
from parity.impls import load

CASE = "8cd3769bc4c5"  # smoke: r = 0, BSHD, 2 tokens, float64, layer scope; passes on every provider


def megatron_source() -> str | None:
    from adapters.megatron import source

    """A Megatron-LM tree (a directory, as ``DSV4_MEGATRON`` must name): the variable's, else the pinned snapshot
    extracted into the cache; None when neither exists."""
    if os.environ.get(source.ENV_PATH):
        return os.environ[source.ENV_PATH]
    archive = source.find_snapshot()
    return str(source.extract(archive)) if archive else None


needs_megatron = pytest.mark.skipif(megatron_source() is None, reason="no Megatron-LM: the pinned snapshot "
                                    "../shared/megatron/megatron-lm-dev-*.tar.gz is absent and DSV4_MEGATRON is unset")


def gate(*argv: str) -> int:
    return main(["gate", "--suite", "smoke", "--case-id", CASE, "--threads", "1", "--quiet", *argv])


def last_lines(text: str, n: int = 2) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


def test_the_paths_of_each_implementation():
    parser = build_parser()
    args = parser.parse_args(["gate", "--impl", "fused", "--provider", "torch"])
    assert paths_of(args) == ["torch"]  # the composition: the one provider asked for
    assert paths_of(parser.parse_args(["gate", "--paths", "auto,torch"])) == ["auto", "torch"]
    megatron = load("megatron")
    assert megatron.gate_paths("auto") == ["unfused", "emulated"]  # no GPU here: the fused path emulated
    assert megatron.gate_paths("cudnn") == ["unfused", "cudnn"]  # a GPU runner with the kernels
    assert megatron.gate_paths("unfused") == ["unfused", "emulated"]  # every production path, whatever is asked
    assert load("reference").gate_paths("auto") == ["auto"]  # negative control: no hook, one path


def test_gate_only_options_are_not_passed_to_the_runs():
    tokens = ["--suite", "smoke", "--paths=a,b", "--baseline", "none", "--with-oracle", "padding-dout", "--quiet",
              "--out", "x", "--make-default"]
    assert strip_options(tokens, {"--paths": True, "--baseline": True, "--with-oracle": True, "--out": True,
                                  "--make-default": False}) == ["--suite", "smoke", "--quiet"]
    assert strip_options(tokens, {}) == tokens  # negative control


def test_a_gate_of_two_paths_writes_one_directory_and_ends_on_its_report(tmp_path, capsys):
    out = tmp_path / "g"
    assert gate("--paths", "auto,torch", "--baseline", "none", "--out", str(out), "--junit",
                str(tmp_path / "junit.xml")) == 0
    text = capsys.readouterr().out
    manifest = json.loads((out / "gate.json").read_text())
    assert [p["name"] for p in manifest["paths"]] == ["auto", "torch"]
    assert (out / "auto" / "results.jsonl").is_file() and (out / "torch" / "index.html").is_file()
    assert last_lines(text) == ["gate: PASS", f"report: {out / 'index.html'}"]
    page = (out / "index.html").read_text()
    assert 'href="auto/index.html"' in page and 'href="torch/index.html"' in page and "PASS" in page
    suites = ET.parse(tmp_path / "junit.xml").getroot()
    assert suites.tag == "testsuites" and [s.get("name") for s in suites] == ["dsv4-parity.smoke.auto",
                                                                              "dsv4-parity.smoke.torch"]
    # `report` and `compare` read a gate directory too
    assert main(["report", str(out), "--baseline", "none"]) == 0
    assert last_lines(capsys.readouterr().out) == ["gate: PASS", f"report: {out / 'index.html'}"]
    assert main(["report", str(out), "--baseline", "none", "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert markdown.startswith("## dsv4-parity gate: **PASS**") and "### path `torch`" in markdown
    # ... but `compare` (the drift gate) against no baseline on every path compares nothing: a usage error, as for
    # one run, never a pass
    assert main(["compare", str(out), "--baseline", "none"]) == 2
    assert "no path of the gate" in capsys.readouterr().err


def test_a_path_without_its_baseline_fails_the_gate(tmp_path, capsys):
    """A gate that checked no coverage must not pass: a missing auto baseline fails its path (exit 1)."""
    out = tmp_path / "one"
    assert gate("--out", str(out), "--baselines-dir", str(tmp_path / "none")) == 1
    text = capsys.readouterr().out
    assert "auto FAIL: no baseline cpu/smoke: coverage and drift not checked" in text
    verdict, report = last_lines(text)
    assert verdict.startswith("gate: FAIL — auto: no baseline cpu/smoke") and report == f"report: {out / 'index.html'}"
    # negative control: with that baseline recorded from the run itself, the same gate passes
    assert main(["compare", str(out), "--update", "--baselines-dir", str(tmp_path / "b")]) == 0
    assert gate("--out", str(tmp_path / "two"), "--baselines-dir", str(tmp_path / "b")) == 0


def test_a_bad_baseline_option_is_a_usage_error(tmp_path, capsys):
    assert gate("--paths", "auto,torch", "--baseline", "cpu/smoke", "--out", str(tmp_path / "g")) == 2
    assert "name one baseline per path" in capsys.readouterr().err
    assert gate("--paths", "auto,auto", "--out", str(tmp_path / "h")) == 2
    assert not (tmp_path / "g").exists() and not (tmp_path / "h").exists()


@needs_megatron
def test_production_gate_runs_both_paths_each_against_its_own_baseline(tmp_path, capsys, monkeypatch):
    """``--impl megatron`` gates the unfused and the emulated path (no GPU here); each gets its own baseline
    (cpu/megatron-unfused-smoke, cpu/megatron-emulated-smoke); a path that lost coverage fails the gate."""
    monkeypatch.setenv("DSV4_MEGATRON", megatron_source())
    baselines = tmp_path / "baselines"
    first = tmp_path / "first"
    assert gate("--impl", "megatron", "--baseline", "none", "--out", str(first)) == 0
    assert main(["compare", str(first), "--update", "--baselines-dir", str(baselines)]) == 0
    assert sorted(p.name for p in (baselines / "cpu").iterdir()) == ["megatron-emulated-smoke",
                                                                    "megatron-unfused-smoke"]
    capsys.readouterr()
    second = tmp_path / "second"
    assert gate("--impl", "megatron", "--out", str(second), "--baselines-dir", str(baselines)) == 0
    text = capsys.readouterr().out
    assert "unfused: provider unfused" in text and "emulated: provider emulated" in text
    assert "vs cpu/megatron-emulated-smoke: 1 of the baseline's 1 run cases compared" in text
    # the emulated path declines its case: coverage lost on that path alone, the gate fails
    stream = second / "emulated" / "results.jsonl"
    rows = [json.loads(line) for line in stream.read_text().splitlines()]
    rows = [r for r in rows if r["type"] not in ("tensor", "metric")]
    for row in rows:
        if row["type"] == "case":
            row.update(outcome="unsupported", message="BridgeRefused: flash_mla_sparse_fwd(indexer_topk=128)")
            row.pop("n_rows", None)
    stream.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["compare", str(second), "--baselines-dir", str(baselines)]) == 1
    assert main(["report", str(second), "--baselines-dir", str(baselines)]) == 0
    text = capsys.readouterr().out
    assert "emulated FAIL: coverage lost: 1 case(s) the baseline ran now unsupported: BridgeRefused" in text
    assert "gate: FAIL — emulated: coverage lost" in text


def test_a_killed_gate_resumes_each_path_and_starts_the_rest(tmp_path, capsys):
    out = tmp_path / "g"
    assert gate("--paths", "auto,torch", "--baseline", "none", "--out", str(out)) == 0
    first = out / "auto" / "results.jsonl"
    rows = first.read_text().splitlines()
    first.write_text("\n".join(rows[:1]) + "\n")  # killed before its case finished: only the run row
    for path in (out / "torch").iterdir():
        path.unlink()
    (out / "torch").rmdir()  # the second path never started
    capsys.readouterr()
    assert main(["gate", "--out", str(out), "--resume"]) == 0  # the recorded --baseline none judges it
    assert last_lines(capsys.readouterr().out) == ["gate: PASS", f"report: {out / 'index.html'}"]
    for name in ("auto", "torch"):
        stream = (out / name / "results.jsonl").read_text()
        assert stream.count('"type":"case"') == 1 and '"type":"end"' in stream
    # negative control: --resume of a directory holding neither a gate nor a run is refused
    assert main(["gate", "--out", str(tmp_path / "empty"), "--resume"]) == 2


def _killed(run_dir: Path) -> None:
    """``run_dir``'s stream cut back to its run row, as a kill before its first case finished leaves it."""
    stream = run_dir / "results.jsonl"
    stream.write_text(stream.read_text().splitlines()[0] + "\n")


def test_a_resumed_gate_of_one_path_judges_as_it_was_started(tmp_path, capsys):
    """A one-path gate's run row keeps the gate's manifest: resumed with no options, it is the same path (named as
    started, not the default provider) judged against the same baseline (``--baseline none`` here, where no baseline
    of this arch exists: the gate a deadline cut on the H100 of 2026-12-06 failed on its resume for a missing
    baseline it had never asked for)."""
    out = tmp_path / "one"
    empty = str(tmp_path / "no-baselines")
    assert gate("--paths", "torch", "--baseline", "none", "--baselines-dir", empty, "--out", str(out)) == 0
    row = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert row["gate"]["paths"][0]["name"] == "torch" and "--baseline" in row["gate"]["argv"]
    _killed(out)
    capsys.readouterr()
    assert main(["gate", "--out", str(out), "--resume", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "torch: provider torch" in text and last_lines(text)[0] == "gate: PASS"
    # a conflicting --baseline on the resume is a usage error naming the recorded one
    _killed(out)
    assert main(["gate", "--out", str(out), "--resume", "--baseline", "cpu/smoke"]) == 2
    assert "--baseline: conflicts with the gate being resumed" in capsys.readouterr().err
    # ... and so is the same option abbreviated (argparse would take `--base` for `--baseline`, past that check)
    with pytest.raises(SystemExit) as usage:
        main(["gate", "--out", str(out), "--resume", "--base", "cpu/smoke"])
    assert usage.value.code == 2 and "unrecognized arguments: --base cpu/smoke" in capsys.readouterr().err
    # negative control: a gate recorded with the default baseline fails on the missing one when resumed
    other = tmp_path / "auto"
    assert gate("--paths", "torch", "--baselines-dir", empty, "--out", str(other)) == 1
    _killed(other)
    capsys.readouterr()
    assert main(["gate", "--out", str(other), "--resume"]) == 1
    assert "torch FAIL: no baseline cpu/" in capsys.readouterr().out
    # ... and it cannot be resumed out of its baseline either: no --baseline at the start means auto
    _killed(other)
    assert main(["gate", "--out", str(other), "--resume", "--baseline", "none"]) == 2
    assert "which recorded 'auto', not 'none'" in capsys.readouterr().err
    # the run row keeps the manifest once, as `gate`, not again in its argv
    row = json.loads((other / "results.jsonl").read_text().splitlines()[0])
    assert "gate" in row and not any("--gate-manifest" in str(t) for t in row["argv"])


def _end_row(run_dir: Path) -> dict:
    return next(json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()
                if '"type":"end"' in line)


def test_a_resumed_gate_runs_with_the_workers_it_was_started_with(tmp_path, capsys):
    """A gate started with ``--workers N`` (``make parity``'s ``--workers auto``) and resumed without it runs the
    rest with N workers, not one (the H100 call of 2026-12-07 ran a resumed gate's last 76 cases in one process);
    ``--workers`` given on the resume wins."""
    second = "9a8dbea368d1"  # another quick smoke case, so that two workers have a case each
    out = tmp_path / "w"
    assert gate("--case-id", second, "--paths", "torch", "--baseline", "none", "--workers", "2",
                "--out", str(out)) == 0
    assert _end_row(out)["occupancy"]["workers"] == 2
    _killed(out)
    assert main(["gate", "--out", str(out), "--resume", "--quiet"]) == 0
    assert _end_row(out)["occupancy"]["workers"] == 2
    # control: the value given on the resume is the one used
    _killed(out)
    assert main(["gate", "--out", str(out), "--resume", "--quiet", "--workers", "1"]) == 0
    assert _end_row(out)["occupancy"]["workers"] == 1
    # --isolate none given on the resume leaves the recorded --workers 2 out (one process cannot run two workers)
    _killed(out)
    assert main(["gate", "--out", str(out), "--resume", "--quiet", "--isolate", "none"]) == 0
    assert _end_row(out)["occupancy"]["workers"] == 1
    capsys.readouterr()


def test_a_resumed_gate_starts_a_path_it_never_began_as_the_resume_says(tmp_path):
    """A path the cut gate never began runs with the resume's execution options too (found by review: only the
    paths already begun got them)."""
    out = tmp_path / "g"
    assert gate("--paths", "auto,torch", "--baseline", "none", "--out", str(out)) == 0
    for path in (out / "torch").iterdir():
        path.unlink()
    (out / "torch").rmdir()
    assert main(["gate", "--out", str(out), "--resume", "--quiet", "--timeout", "77"]) == 0
    row = json.loads((out / "torch" / "results.jsonl").read_text().splitlines()[0])
    assert row["argv"][row["argv"].index("--timeout") + 1] == "77" and "--resume" not in row["argv"]
    assert row["threads"] == 1  # the gate's recorded --threads 1 kept: it sets a CPU result's summation order


def test_a_resumed_gate_of_two_paths_keeps_each_paths_baseline(tmp_path, capsys):
    """``--baseline P=NAME,...`` of a two-path gate (the PR gate's ``cudnn=h200/megatron-cudnn-gate`` on an H100)
    holds for its resume: the run the path's baseline was recorded from passes again against it."""
    baselines = tmp_path / "b"
    first = tmp_path / "first"
    assert gate("--paths", "auto,torch", "--baseline", "none", "--out", str(first)) == 0
    assert main(["compare", str(first / "torch"), "--update", "--baseline", "cpu/theirs", "--baselines-dir",
                 str(baselines)]) == 0
    out = tmp_path / "g"
    assert gate("--paths", "auto,torch", "--baseline", "auto=none,torch=cpu/theirs", "--baselines-dir",
                str(baselines), "--out", str(out)) == 0
    _killed(out / "torch")
    capsys.readouterr()
    assert main(["gate", "--out", str(out), "--resume", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "vs cpu/theirs" in text and last_lines(text)[0] == "gate: PASS"
