"""Command-line start-up (``dsv4-parity bench``, section ``startup``): how long ``dsv4-parity --help`` and a
mistyped command take, as a ratio to a bare interpreter (``python -c pass``) on the same machine at the same time.

Each command is a fresh ``python -m cli ...`` child of this interpreter, run ``repeats`` times interleaved with the
others (so a burst of load hits every row alike); a row is the median wall time, the ratio that median over the
bare interpreter's. ``import torch`` is measured once beside them, for scale: what every command paid before the
parser stopped loading torch for work that does not need it. Rows also say whether the child had torch loaded
when it exited (``torch_loaded``), which is what the ratio is about.

Reported, never asserted (timings on a shared machine are noisy; ``tests/test_startup.py`` checks what is
deterministic: that these commands import no torch).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]

#: A ``python -c`` probe: runs the command, then prints its exit code and whether torch was loaded when it finished
#: (a command that crashes instead of exiting prints neither: :func:`probe_command` raises).
_PROBE = ("import sys, runpy\nsys.argv = {argv!r}\ncode = 0\ntry:\n    runpy.run_module('cli', run_name='__main__')\n"
          "except SystemExit as exc:\n    code = exc.code\n"
          "print('exit=' + str(code) + ' torch_loaded=' + str('torch' in sys.modules), file=sys.stderr)\n")

#: rows timed once, not ``repeats`` times: context, not the measurement (a torch import costs seconds)
ONCE = ("import torch",)
#: (row name, argv after ``python``): the baseline first; cli rows run ``python -m cli ...``
COMMANDS = (
    ("python -c pass", ["-c", "pass"]),
    ("import torch", ["-c", "import torch"]),
    ("dsv4-parity --help", ["-m", "cli", "--help"]),
    ("dsv4-parity run --help", ["-m", "cli", "run", "--help"]),
    ("dsv4-parity <typo>", ["-m", "cli", "rnu", "--suite", "smoke"]),
    ("dsv4-parity run --siute <typo>", ["-m", "cli", "run", "--siute", "smoke"]),
)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _time_once(argv: list[str], env: dict) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - start, done.returncode


def probe_command(argv: list[str]) -> tuple[bool, object]:
    """``(torch loaded, exit code)`` of ``python -m cli <argv>`` when it exits (one extra, untimed child); raises
    :class:`RuntimeError` with the tail of its stderr where the command crashed instead of exiting."""
    code = _PROBE.format(argv=["dsv4-parity", *argv])
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    marks = [line for line in done.stderr.splitlines() if line.startswith("exit=") and " torch_loaded=" in line]
    if not marks:
        raise RuntimeError(f"dsv4-parity {' '.join(argv)} crashed: {done.stderr.strip()[-1500:]}")
    exit_code, loaded = marks[-1].removeprefix("exit=").split(" torch_loaded=")
    return loaded == "True", (int(exit_code) if exit_code.lstrip("-").isdigit() else exit_code)


def torch_loaded(argv: list[str]) -> bool:
    """Whether ``python -m cli <argv>`` has torch in ``sys.modules`` when it exits (:func:`probe_command`)."""
    return probe_command(argv)[0]


def startup(repeats: int = 5, log: Callable[[str], None] = lambda _: None) -> dict:
    """``{repeats, rows: [{command, argv, median_s, min_s, ratio, exit_code, torch_loaded}]}``; ``ratio`` =
    median / the median of ``python -c pass``."""
    env = _env()
    times: dict[str, list[float]] = {name: [] for name, _ in COMMANDS}
    codes: dict[str, int] = {}
    for i in range(max(1, repeats)):
        for name, argv in COMMANDS:
            if i and name in ONCE:
                continue
            seconds, codes[name] = _time_once(argv, env)
            times[name].append(seconds)
    base = statistics.median(times[COMMANDS[0][0]])
    rows = []
    for name, argv in COMMANDS:
        median = statistics.median(times[name])
        cli = argv[:2] == ["-m", "cli"]
        rows.append({"command": name, "argv": argv, "runs": len(times[name]), "median_s": round(median, 4), "min_s": round(min(times[name]), 4),
                     "ratio": round(median / base, 2) if base > 0 else None, "exit_code": codes[name],
                     "torch_loaded": torch_loaded(argv[2:]) if cli else name == "import torch"})
        log(f"startup {name}: {median * 1000:.0f} ms median, {rows[-1]['ratio']}x python -c pass"
            + (f", torch loaded: {rows[-1]['torch_loaded']}" if cli else ""))
    return {"status": "ok", "repeats": max(1, repeats), "rows": rows}
