"""What a run prints while it goes: a rich progress bar on a terminal; on a pipe or a CI log, a progress line at most
every :data:`EVERY_S` seconds (cases done, outcomes so far, elapsed, ETA).

Per case, only what needs attention: a ``FAIL`` / ``ERROR`` line with its message and repro. ``unsupported`` cases
are not listed one by one: :meth:`Progress.close` prints one line per distinct reason with its count.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Optional

from cases.vocabulary import ALWAYS_COUNTED, OUTCOMES

#: Seconds between two plain progress lines (no terminal).
EVERY_S = 30.0


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """Progress of ``total`` cases (``quiet``: prints nothing)."""

    def __init__(self, total: int, quiet: bool, every_s: Optional[float] = None):
        self.total, self.quiet = total, quiet
        self.every_s = EVERY_S if every_s is None else every_s
        self.started = self.last = time.monotonic()
        self.outcomes: Counter = Counter()
        self.unsupported: Counter = Counter()
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

            self.console = Console(stderr=True)
            self.bar = Bar(TextColumn("[bold]parity"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TextColumn("{task.description}"), console=self.console, transient=True)
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def starting(self, case) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=case.id)

    def _print(self, line: str, style: str = "") -> None:
        if self.bar is not None:
            self.console.print(line, style=style, markup=False, highlight=False, soft_wrap=True)
        elif not self.quiet:
            print(line, file=sys.stderr, flush=True)

    def done(self, row: dict) -> None:
        outcome = row["outcome"]
        self.outcomes[outcome] += 1
        fixed = (row.get("known") or {}).get("status") == "fixed?"  # a registered known deviation that passed
        if outcome == "unsupported":
            self.unsupported[str(row.get("message") or "(no reason given)")] += 1
        elif outcome != "pass" or fixed:
            label = "FIXED?" if fixed else outcome.upper()
            style = {"fail": "red", "error": "magenta", "known": "cyan"}.get("known" if fixed else outcome, "")
            self._print(f"{label:<11} {row['case_id']}  {row['message']}", style)
            if row.get("repro"):
                self._print(f"  repro: {row['repro']}")
        if self.bar is not None:
            self.bar.advance(self.task)
        elif not self.quiet and time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        """``progress: 120/540 cases (118 pass, 1 fail, 0 error, 1 unsupported), 3m12s elapsed, ETA 7m40s``."""
        done = sum(self.outcomes.values())
        elapsed = time.monotonic() - self.started
        eta = clock(elapsed / done * (self.total - done)) if done else "?"
        so_far = ", ".join(f"{self.outcomes[o]} {o}" for o in OUTCOMES if o in ALWAYS_COUNTED or self.outcomes[o])
        return f"progress: {done}/{self.total} cases ({so_far}), {clock(elapsed)} elapsed, ETA {eta}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        for reason, n in self.unsupported.most_common():
            self._print(f"UNSUPPORTED {n} case{'s' if n != 1 else ''}: {reason}", "yellow")
