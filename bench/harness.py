"""Harness throughput (``dsv4-parity bench``, section ``harness``): a parity run of a suite in this process, its
time split by the engine's own phases, to tell the time spent in the two implementations from the harness's own.

Phases (seconds summed over the cases, read from the ``phases_s`` the engine writes on every case row):
``materialize``; ``impl`` (the implementation under test, forward and backward with their snapshots); ``reference``
(the float64 truth and same-dtype noise runs); ``compare`` (structure rules, metrics, verdict); the rest of the
run (the runner's loop: result rows, writing, the run row's environment, progress) is ``other``. The harness
overhead is everything but ``impl`` and ``reference``. Nothing of the engine is replaced or wrapped.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from parity.run.stream import read_rows
from reports.render import render_run


#: The engine's phases (``phases_s`` of a case row) that are the implementations' own time.
IMPLEMENTATION_PHASES = ("impl", "reference")


def case_rows(results_path: Path) -> list[dict]:
    """The ``case`` rows of a ``results.jsonl`` (a torn last line of a killed run is skipped)."""
    return [row for row in read_rows(results_path) if row.get("type") == "case"]


def engine_phases(rows: list[dict]) -> dict[str, float]:
    """Seconds per engine phase (``phases_s``), summed over case rows (:func:`case_rows`)."""
    seconds: dict[str, float] = {}
    for row in rows:
        for phase, value in (row.get("phases_s") or {}).items():
            seconds[phase] = seconds.get(phase, 0.0) + float(value)
    return seconds


def spread_cases(cases: list, limit: int) -> list:
    """``limit`` cases spread evenly over the suite (all when ``limit`` ≤ 0 or ≥ the suite)."""
    if limit <= 0 or limit >= len(cases):
        return list(cases)
    step = len(cases) / limit
    return [cases[int(i * step)] for i in range(limit)]


def harness_throughput(s: Any, log: Callable[[str], None], deadline: Optional[float] = None) -> dict:
    """Run ``s.harness_suite`` (``harness_limit`` of its cases, spread over it) in-process, timing the engine's
    phases. With a ``deadline``: a first batch of two cases sizes a second batch that fits the time left."""
    from cases.suites import load_suite

    from parity.engine import RunOptions
    from parity.run.runner import RunConfig, run

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    suite = load_suite(s.harness_suite)
    load_s = time.perf_counter() - t0
    chosen = spread_cases(suite, s.harness_limit)
    batches = [chosen] if deadline is None else [chosen[:2], chosen[2:]]
    options = RunOptions(impl="fused", against="reference", provider=s.provider_for("fused"), device=s.device)
    total, ran = 0.0, 0
    counts: dict[str, int] = {}
    report_s = None
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-") as tmp:
        for i, batch in enumerate(batches):
            if i and ran:  # size the rest by the first batch's pace
                left = (deadline - time.monotonic()) * 0.9
                batch = spread_cases(batch, max(int(left / (total / ran)), 0)) if left > 0 else []
            if not batch:
                continue
            out_dir = Path(tmp) / f"run{i}"
            config = RunConfig(suite=s.harness_suite, options=options, out_dir=out_dir, isolate="none", quiet=True,
                               run_id="bench", argv=["dsv4-parity", "bench"])
            t0 = time.perf_counter()
            got, _code = run(batch, config)
            total += time.perf_counter() - t0
            for phase, value in engine_phases(case_rows(out_dir / "results.jsonl")).items():
                seconds[phase] = seconds.get(phase, 0.0) + value
            ran += len(batch)
            counts = {k: counts.get(k, 0) + v for k, v in got.items()}
        if ran and s.harness_report:
            report_s = _time_report(out_dir)  # the last batch's report
    if not ran:
        return {"suite": s.harness_suite, "status": "skipped", "message": "time budget"}
    phases = {k: round(v, 4) for k, v in sorted({**seconds, "load suite": load_s}.items())}
    implementation = sum(seconds.get(k, 0.0) for k in IMPLEMENTATION_PHASES)
    phases["other (runner loop, result rows, environment, progress)"] = round(max(total - sum(seconds.values()),
                                                                                  0.0), 4)
    per_case = total / ran
    out = {"suite": s.harness_suite, "status": "ok", "cases": ran, "suite_cases": len(suite),
           "isolation": "none (in-process)", "batches": len([b for b in batches if b]), "total_s": round(total, 3),
           "cases_per_min": 60.0 * ran / total, "phases": phases, "implementation_s": round(implementation, 4),
           "overhead_s": round(total - implementation, 4), "overhead_share": (total - implementation) / total,
           "report_s": report_s, "suite_estimate_s": round(per_case * len(suite) + load_s, 2),
           "counts": counts}
    log(f"harness {s.harness_suite}: {ran} cases in {total:.1f} s, overhead {out['overhead_share']:.1%}")
    return out


def _time_report(out_dir: Path) -> Optional[float]:
    """Seconds to render the run's report (every view, default baseline, no terminal summary)."""
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            render_run(out_dir, baseline="auto", console=None)
    except Exception:  # noqa: BLE001 — the report is optional here
        return None
    return round(time.perf_counter() - t0, 3)
