"""The command line parses and checks before it loads torch (issue 32, item 7): ``--help``, a typo, ``metamorphic
--list``, ``cache`` and ``compare-runs`` never import it (nor do ``report`` / ``compare``,
``tests/reports/test_commands.py``). Checked by what is deterministic — ``'torch' in sys.modules`` in a fresh
process when the command ends — never by timing (``dsv4-parity bench --sections startup`` measures the time).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from bench.startup import torch_loaded

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [
    ["--help"], ["run", "--help"], ["metamorphic", "--help"], ["mutants", "--help"], ["bench", "--help"],
    ["cases", "--help"], ["rnu", "--suite", "smoke"], ["run", "--siute", "smoke"], ["run", "--suite", "smok"],
    ["run", "--oracle", "nope"], ["run", "--budget-s", "0"], ["metamorphic", "--list"], ["cache"],
    ["compare-runs", "nowhere-a", "nowhere-b"],
], ids=lambda argv: " ".join(argv))
def test_parsing_and_light_commands_do_not_load_torch(argv, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_PARITY_CACHE_DIR", str(tmp_path))  # `cache` reads it (and nothing else here)
    assert not torch_loaded(argv)


def test_the_probe_sees_torch_where_a_command_loads_it():
    """Negative control: a command that needs torch (it builds the suite's cases) shows it loaded."""
    assert torch_loaded(["cases", "--suite", "smoke"])


def stdlib_only(source: str) -> list[str]:
    """Top-level imports of ``source`` that are not the standard library."""
    found = []
    for node in ast.parse(source).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
            ["." + (node.module or "")] if isinstance(node, ast.ImportFrom) else []
        found += [n for n in names if n.split(".")[0] not in sys.stdlib_module_names]
    return found


def test_cache_can_load_the_compile_cache_file_alone():
    """``dsv4-parity cache`` loads ``fused/kernels/compile_cache.py`` without its package (cli.cache_command): that
    stays right only while the module's top level imports the standard library alone."""
    assert stdlib_only((ROOT / "fused" / "kernels" / "compile_cache.py").read_text()) == []
    assert stdlib_only("import os\nimport torch\nfrom . import base\n") == ["torch", "."]  # negative control


def test_the_names_the_parser_uses_agree_with_the_engine():
    from cases.suites import SUBSETS, SUITES
    from cases.vocabulary import STORED_SUITES, SUITE_SUBSETS
    from parity.names import ORACLE_SUMMARIES
    from parity.oracles import metamorphic

    assert tuple(SUITES) == STORED_SUITES and tuple(SUBSETS) == SUITE_SUBSETS
    assert list(metamorphic.ORACLES) == list(ORACLE_SUMMARIES) == list(metamorphic._ORACLE_CHECKS)
    assert all(o.summary == ORACLE_SUMMARIES[n] for n, o in metamorphic.ORACLES.items())


def test_cli_without_torch_still_says_so_in_one_line():
    """The check moved from import time to the commands that need torch; it must still be one line."""
    import subprocess

    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['dsv4-parity', 'cases']; import runpy; "
            "runpy.run_module('cli', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "cannot import torch" in done.stderr and "Traceback" not in done.stderr
    ok = subprocess.run([sys.executable, "-c", code.replace("'cases'", "'metamorphic', '--list'")],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0 and "thd-pack" in ok.stdout  # negative control: a torch-free command runs


def test_the_gate_loads_the_report_drawing_in_the_background_not_before_its_run(monkeypatch):
    """The HTML report's modules (``reports.html``: pandas' views, Jinja2) are imported by the report alone:
    ``reports.gate`` / ``reports.render`` (what ``dsv4-parity gate`` imports before its runs start) load without
    them, and a run that will draw its report starts importing them on a background thread
    (``cli.report_command.preload_report_modules``) while its cases run. The figures are SVG text: no plotting
    library is loaded at all. Control: the preload does load the report's modules."""
    import subprocess

    probe = ("import sys, threading; import reports.gate, reports.render; before = 'reports.html' in sys.modules; "
             "from cli.report_command import preload_report_modules; preload_report_modules(); "
             "[t.join() for t in threading.enumerate() if t.name == 'report-import']; "
             "print(before, 'reports.html' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "False"]


def test_a_command_that_crashes_is_not_reported_as_torch_free(monkeypatch):
    """The probe reads the marker the command prints on exit; a crash prints none, and is an error, never a
    "torch not loaded" (control: a command that exits says its exit code)."""
    import bench.startup as startup

    assert startup.probe_command(["--help"]) == (False, 0)
    monkeypatch.setattr(startup, "_PROBE", "import sys\nsys.argv = {argv!r}\nraise RuntimeError('boom')\n")
    with pytest.raises(RuntimeError, match="(?s)crashed: .*boom"):
        startup.torch_loaded(["--help"])
