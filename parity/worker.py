"""Case isolation: cases run in a child process so that a crash or a sticky CUDA error fails one case only.

The child (``python -m parity.worker``) reads one request per line on stdin, ``{"case": {...}, "options": {...},
"oracle": null | name}``, runs it with :func:`parity.runner.execute` and answers one line on its protocol channel:
``@@dsv4-parity@@ <JSON list of result rows>``. Anything the libraries print goes to stderr (fd 1 is redirected),
so the channel stays clean.

:class:`WorkerPool` (one child at a time) sends a case, waits up to ``timeout`` seconds, and turns a dead or hung
child into an ``error`` result with the tail of its stderr. With ``fresh=True`` every case gets a new child;
otherwise a child is reused until a case ends in ``error`` (the CUDA context may be poisoned) — so a sticky fault
still costs exactly one case, without paying process start-up and kernel JIT per case.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

MARK = "@@dsv4-parity@@ "
REPO = Path(__file__).resolve().parents[1]


class WorkerPool:
    def __init__(self, timeout: float = 1800.0, fresh: bool = False):
        self.timeout = timeout
        self.fresh = fresh
        self.proc: Optional[subprocess.Popen] = None
        self.stderr = None

    # ---- child management --------------------------------------------------------------------------------------
    def _start(self) -> None:
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "parity.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, cwd=str(REPO), env=env,
                                     text=True, bufsize=1)

    def _stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stop()

    def _stderr_tail(self, limit: int = 1500) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - limit))
        text = self.stderr.read().decode("utf-8", "replace")
        return " | ".join(line.strip() for line in text.strip().splitlines()[-8:])

    def close(self) -> None:
        self._stop()

    # ---- one case --------------------------------------------------------------------------------------------------
    def submit(self, request: dict) -> tuple[Optional[list], str]:
        """``(rows, "")`` on an answer, else ``(None, why)`` (crash or timeout; the child is gone)."""
        if self.proc is None or self.proc.poll() is not None:
            self._stop()
            self._start()
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            why = f"worker died before the case (exit {self.proc.poll()}): {self._stderr_tail()}"
            self._kill()
            return None, why
        deadline = time.monotonic() + self.timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    why = f"timed out after {self.timeout:g} s (worker killed): {self._stderr_tail()}"
                    self._kill()
                    return None, why
                if not sel.select(timeout=min(left, 5.0)):
                    continue
                line = self.proc.stdout.readline()
                if not line:  # EOF: the child died
                    code = self.proc.wait()
                    why = f"worker crashed (exit code {code}): {self._stderr_tail()}"
                    self._stop()
                    return None, why
                if line.startswith(MARK):
                    rows = json.loads(line[len(MARK):])
                    if self.fresh or (rows and rows[0].get("outcome") == "error"):
                        self._stop()
                    return rows, ""
        finally:
            sel.close()


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints go to stderr
    sys.stdout = sys.stderr
    from .engine import configure_torch
    from .runner import execute  # imported after the redirect: importing torch may print

    configure_torch()

    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        rows = execute(request)
        proto.write(MARK + json.dumps(rows, separators=(",", ":"), allow_nan=False) + "\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
