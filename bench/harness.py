"""Harness throughput (``dsv4-parity bench``, section ``harness``): a parity run of a suite in this process with the
engine's phases timed, to tell the time spent in the two implementations from the harness's own.

Phases (seconds summed over the cases): ``materialize``; ``impl`` / ``truth`` (the float64 reference) / ``noise``
(the same-dtype reference) ``forward`` and ``backward``; ``snapshot`` (leaf copies and mutation checks around
them); ``compare`` (structure rules, metrics, verdict); ``rows`` / ``write`` (building and writing the result
rows); ``environment`` (the run row's versions); the rest of the runner's loop. The harness overhead is everything
but the implementations' forward and backward. The wrappers are module attributes replaced for the duration of the
run and restored after it; no code of the engine changes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench.measure import synchronize
from reports.render import render_run


class PhaseClock:
    """Accumulates seconds per phase name; nested phases of the same clock are not double counted."""

    def __init__(self, device: str):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.role: Optional[str] = None
        self._grad_depth = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def timed(self, phase: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            synchronize(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.add(phase, time.perf_counter() - t0)

        return wrapper


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any):
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


@contextlib.contextmanager
def engine_phases(clock: PhaseClock, impl_api: Any):
    """Time the engine's phases in this process (restored on exit): ``materialize``; ``<role> forward`` /
    ``<role> backward`` (role ``impl``, ``truth`` = float64 reference, ``noise`` = same-dtype reference);
    ``snapshot`` (leaf copies and mutation checks around them); ``compare`` (structure rules, metrics, verdict);
    ``rows`` (building the result rows), ``write`` (writing them), ``environment`` (the run row's versions)."""
    from parity import engine, environment, results, snapshot, structure, verdict

    real_run, real_call, real_grad = engine.run, snapshot._call, torch.autograd.grad

    def run(module, case, tensors, *args, **kwargs):
        clock.role = "impl" if module is impl_api else ("truth" if kwargs.get("upcast") else "noise")
        t0 = time.perf_counter()
        try:
            return real_run(module, case, tensors, *args, **kwargs)
        finally:
            synchronize(clock.device)
            clock.add("snapshot", time.perf_counter() - t0)  # the forward / backward parts are subtracted below
            clock.role = None

    def call(*args, **kwargs):
        role = clock.role or "other"
        return clock.timed(f"{role} forward", real_call)(*args, **kwargs)

    def grad(*args, **kwargs):
        if clock.role is None or clock._grad_depth:
            return real_grad(*args, **kwargs)
        clock._grad_depth += 1
        try:
            return clock.timed(f"{clock.role} backward", real_grad)(*args, **kwargs)
        finally:
            clock._grad_depth -= 1

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(engine, "run", run))
        stack.enter_context(_patched(engine, "materialize", clock.timed("materialize", engine.materialize)))
        stack.enter_context(_patched(snapshot, "_call", call))
        stack.enter_context(_patched(torch.autograd, "grad", grad))
        stack.enter_context(_patched(structure, "check", clock.timed("compare", structure.check)))
        stack.enter_context(_patched(verdict, "judge_case_tensors",
                                     clock.timed("compare", verdict.judge_case_tensors)))
        stack.enter_context(_patched(verdict, "case_decision", clock.timed("compare", verdict.case_decision)))
        stack.enter_context(_patched(results.ResultsWriter, "write",
                                     clock.timed("write", results.ResultsWriter.write)))
        stack.enter_context(_patched(results.CaseResult, "rows", clock.timed("rows", results.CaseResult.rows)))
        stack.enter_context(_patched(environment, "environment",
                                     clock.timed("environment", environment.environment)))
        yield
    impl_parts = sum(v for k, v in clock.seconds.items() if k.endswith(" forward") or k.endswith(" backward"))
    clock.seconds["snapshot"] = max(clock.seconds.get("snapshot", 0.0) - impl_parts, 0.0)


def _spread(cases: list, limit: int) -> list:
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
    from parity.impls import load
    from parity.runner import RunConfig, run

    clock = PhaseClock(s.device)
    t0 = time.perf_counter()
    suite = load_suite(s.harness_suite)
    clock.add("load suite", time.perf_counter() - t0)
    chosen = _spread(suite, s.harness_limit)
    batches = [chosen] if deadline is None else [chosen[:2], chosen[2:]]
    options = RunOptions(impl="fused", against="reference", provider=s.provider, device=s.device)
    impl = load("fused")
    total, ran = 0.0, 0
    counts: dict[str, int] = {}
    report_s = None
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-") as tmp:
        for i, batch in enumerate(batches):
            if i and ran:  # size the rest by the first batch's pace
                left = (deadline - time.monotonic()) * 0.9
                batch = _spread(batch, max(int(left / (total / ran)), 0)) if left > 0 else []
            if not batch:
                continue
            out_dir = Path(tmp) / f"run{i}"
            config = RunConfig(suite=s.harness_suite, options=options, out_dir=out_dir, isolate="none", quiet=True,
                               run_id="bench", argv=["dsv4-parity", "bench"])
            t0 = time.perf_counter()
            with engine_phases(clock, impl.api):
                got, _code = run(batch, config)
            total += time.perf_counter() - t0
            ran += len(batch)
            counts = {k: counts.get(k, 0) + v for k, v in got.items()}
        if ran and s.harness_report:
            report_s = _time_report(out_dir)  # the last batch's report
    if not ran:
        return {"suite": s.harness_suite, "status": "skipped", "message": "time budget"}
    phases = {k: round(v, 4) for k, v in sorted(clock.seconds.items())}
    run_phases = {k: v for k, v in clock.seconds.items() if k != "load suite"}
    implementation = sum(v for k, v in run_phases.items() if k.endswith(" forward") or k.endswith(" backward"))
    phases["other (runner loop, case JSON, progress)"] = round(max(total - sum(run_phases.values()), 0.0), 4)
    per_case = total / ran
    out = {"suite": s.harness_suite, "status": "ok", "cases": ran, "suite_cases": len(suite),
           "isolation": "none (in-process)", "batches": len([b for b in batches if b]), "total_s": round(total, 3),
           "cases_per_min": 60.0 * ran / total, "phases": phases, "implementation_s": round(implementation, 4),
           "overhead_s": round(total - implementation, 4), "overhead_share": (total - implementation) / total,
           "report_s": report_s, "suite_estimate_s": round(per_case * len(suite) + clock.seconds["load suite"], 2),
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
