"""Messages that said the wrong thing (issue 32, item 10), each beside the case that must keep working.

The disk-full closing line is checked where the disk fills (``test_fault_injection.py``); here its rule
(:func:`cli.run_command._closing_line`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cases.suites import load_suite
from cli.main import build_parser, main
from tests.parity.helpers import pick
from tests.parity.test_run_integrity import TINY

ROOT = Path(__file__).resolve().parents[2]


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---- cases --suite gate-cpu ------------------------------------------------------------------------------------------
def test_cases_lists_the_gate_cpu_subset(capsys):
    assert main(["cases", "--suite", "gate-cpu", "--json"]) == 0  # was KeyError: 'gate-cpu'
    assert [c["config"] for c in json.loads(capsys.readouterr().out)] == \
        [c.to_dict()["config"] for c in load_suite("gate-cpu")]
    assert main(["cases", "--suite", "gate-cpu", "--coverage"]) == 0  # a subset declares no cells of its own
    assert main(["cases", "--suite", "nope"]) == 2  # negative control: an unknown name is still an error
    assert "gate-cpu" in err_line(capsys).split("known:")[1]


def test_help_names_every_suite():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("cases", "shrink", "run", "mutants"):
        text = re.sub(r"-\s+", "-", " ".join(sub[command].format_help().split()))  # argparse wraps at hyphens
        assert all(name in text for name in ("smoke", "gate-cpu", "nightly", "production")), command


def test_run_help_lists_impl_megatron():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    impl = next(a for a in sub["run"]._actions if a.dest == "impl")
    assert re.search(r"\bmegatron\b", impl.help) and re.search(r"\bfused\b", impl.help)


# ---- a binary case file ----------------------------------------------------------------------------------------------
def test_a_binary_case_file_is_named(tmp_path, capsys):
    junk = tmp_path / "case.bin"
    junk.write_bytes(bytes(range(256)) * 4)
    assert main(["run", "--case", f"@{junk}", "--impl", "reference", "--quiet", "--out", str(tmp_path / "a")]) == 2
    err = err_line(capsys)
    assert err.startswith("error: case:") and str(junk) in err and "binary" in err
    good = tmp_path / "case.json"  # negative control: the same option with a case file runs
    good.write_text(pick(dtype="float64", layout="bshd", ratio="0").to_json())
    assert main(["run", "--case", f"@{good}", "--impl", "reference", "--quiet", "--out", str(tmp_path / "b")]) == 0


# ---- where a Megatron path came from -------------------------------------------------------------------------------
@pytest.mark.parametrize("how, origin", [("env", "(DSV4_MEGATRON)"), ("option", "(--megatron)")])
def test_a_bad_megatron_path_names_where_it_came_from(tmp_path, how, origin):
    """Each case is the other's negative control. A child process: ``--megatron`` sets the variable for the process."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DSV4_PARITY_CACHE_DIR": str(tmp_path)}
    argv = [sys.executable, "-m", "cli", "run", "--impl", "megatron", "--suite", "smoke", "--case-id", TINY[0],
            "--quiet", "--out", str(tmp_path / "r")]
    if how == "env":
        env["DSV4_MEGATRON"] = "/nowhere"
    else:
        argv += ["--megatron", "/nowhere"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "/nowhere" in line and origin in line, line


# ---- shrink on a passing case --------------------------------------------------------------------------------------
def test_shrink_on_a_passing_case_is_a_usage_error(capsys):
    case = pick(dtype="float64", layout="bshd", ratio="0")
    assert main(["shrink", "--case", case.to_json(), "--impl", "reference"]) == 2  # was: error: ... and exit 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: case:") and "does not fail" in err and "nothing to shrink" in err
    # negative control: a failing case shrinks (exit 0; tests/parity/test_cli.py checks its repro)
    assert main(["shrink", "--case", case.to_json(), "--impl", "tests.parity.fakes:fused_bias",
                 "--max-calls", "2"]) == 0


# ---- the closing line of a run that stopped ----------------------------------------------------------------------
def test_the_closing_line_says_when_a_run_stopped(tmp_path):
    from cli.run_command import _closing_line

    done = {"pass": 12, "fail": 0, "error": 0, "unsupported": 0}
    whole = _closing_line(done, 12, 0, tmp_path, None)
    assert whole == "12 cases: 12 passed, 0 failed, 0 errors, 0 unsupported"  # negative control: a whole run
    stopped = _closing_line(done, 48, 2, tmp_path, None).splitlines()
    assert stopped[0] == ("stopped after 12 of 48 cases (the results could not be written): 12 passed, 0 failed, "
                          "0 errors, 0 unsupported")
    assert stopped[-1] == f"continue with: dsv4-parity run --out {tmp_path} --resume"
    assert _closing_line(done, 48, 1, tmp_path, None).startswith("incomplete, 12 of 48 cases: ")  # a spent budget


# ---- cache --help ----------------------------------------------------------------------------------------------------
MARKUP = re.compile(r"``|:(mod|func|class|data|meth):`")


def test_cache_help_has_no_markup():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert not MARKUP.search(sub["cache"].format_help())
    import cli.cache_command

    assert MARKUP.search(cli.cache_command.__doc__)  # negative control: the detector sees the docstring's markup
    for name, parser in sub.items():  # and no other command shows it either
        assert not MARKUP.search(parser.format_help()), name


# ---- the memory pre-check counts the run's working set ---------------------------------------------------------------
def test_a_long_sequence_is_refused_by_its_working_set_not_its_inputs():
    from cases.case import Case
    from cases.errors import CaseError
    from parity.run import memory

    small = pick(dtype="float32", layout="bshd", ratio="4", loss="sparse")
    data = small.to_dict()
    data["layout"] = {"kind": "bshd", "batch": 1, "seq_len": 200_000}
    case = Case.from_dict(data)
    inputs = memory.input_bytes(case)
    scores = memory.working_set(case)["index_scores"]
    assert scores == 8 * 200_000 * 50_000 > 10 * inputs  # [S, S/4] float64: 80 GB, the inputs a few GB
    host = 4 * inputs  # what the inputs-only bound (twice the inputs) let through
    with pytest.raises(CaseError, match=r"index_scores \[1, 200000, 50000\] alone 74\.5 GiB"):
        memory.check_memory([case], "cpu", host=host)
    memory.check_memory([case], "cpu", host=sum(memory.working_set(case).values()))  # negative control: it fits
    with pytest.raises(CaseError, match="GPU memory"):  # on CUDA the GPU holds the truth run
        memory.check_memory([case], "cuda", host=host, gpu=host)
