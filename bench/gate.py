"""``dsv4-parity bench --sections gate``: the PR gate's wall time, cold and warm, and where it goes.

The gate suite runs as ``dsv4-parity run`` subprocesses (exactly what ``make parity`` runs on a GPU runner:
``--suite gate --provider cudnn --workers auto --make-default``, the report rendering included), twice over one compiled-kernel cache directory: **cold** (a fresh,
empty cache: every CuTe-DSL kernel compiles) then **warm** (the same cache, as a re-run on the same runner). Each run
records its wall time, the outcome counts, the per-case phases summed over the workers (``phases_s`` of the
``results.jsonl`` case rows: materialize / impl / reference / compare), the implementation's kernel calls and their
summed time (the rows' ``impl_kernels``: the wall time over it is how far the gate is from the GPU's own pace), and
the compiled-kernel cache's counters summed
over its processes (:mod:`fused.kernels.compile_cache`: per kernel namespace the compiles and their seconds, the
loads from disk and theirs). Targets (:data:`bench.targets.TARGETS`): warm and cold wall time, no failure, and the
two runs agree case by case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from bench.harness import case_rows, engine_phases
from parity.run.stream import read_rows
from bench.targets import TARGETS
from fused.kernels import compile_cache

#: Library cache variables the child must derive from its own ``DSV4_PARITY_CACHE_DIR`` (not inherit from ours).
CHILD_UNSET = ("CUTE_DSL_CACHE_DIR", "CUDNN_FRONTEND_COMPILED_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
               compile_cache.ENV_SWITCH)
REPO = Path(__file__).resolve().parents[1]  # the repository root (bench/..)
PHASES = ("materialize", "impl", "reference", "compare")


def gate_command(suite: str, provider: str, workers: str, out: Path, limit: Optional[int],
                 make_default: bool = True, impl: str = "fused") -> list[str]:
    """``make parity``'s command line (``make_default``: also point ``reports/out/latest`` at the run and render its
    report, as ``make parity`` does); ``impl`` other than ``fused``: ``--impl`` (``megatron``: the production gate)."""
    cmd = [sys.executable, "-m", "cli", "run", "--suite", suite, "--provider", provider, "--workers",
           str(workers), "--out", str(out)] + (["--impl", impl] if impl != "fused" else [])
    return cmd + (["--limit", str(limit)] if limit else []) + (["--make-default"] if make_default else [])


def summarize_results(path: Path) -> dict[str, Any]:
    """Outcome counts and per-phase seconds summed over the case rows of one ``results.jsonl``."""
    every = read_rows(path) if path.is_file() else []
    rows = [row for row in every if row.get("type") == "case"]
    end = every[-1] if every and every[-1].get("type") == "end" else {}  # none: a killed run
    outcomes: dict[str, int] = {}
    for row in rows:
        outcomes[row["outcome"]] = outcomes.get(row["outcome"], 0) + 1
    phases = {**{p: 0.0 for p in PHASES}, **engine_phases(rows)}
    cases = len(rows)
    total = sum(phases.values()) or 1.0
    timed = [row["impl_kernels"] for row in rows if isinstance(row.get("impl_kernels"), dict)]
    kernels = {"cases": len(timed), "calls": sum(int(k.get("calls") or 0) for k in timed),
               "seconds": round(sum(float(k.get("seconds") or 0.0) for k in timed), 3)}
    return {"cases": cases, "outcomes": outcomes, "phases_s": {k: round(v, 2) for k, v in phases.items()},
            "impl_kernels": kernels,
            "phase_share": {k: round(v / total, 4) for k, v in phases.items()},
            "device_memory": sum(row.get("decided_by") == "device-memory" for row in rows),
            "occupancy": end.get("occupancy"), "run_s": end.get("duration_s"), "prelude_s": end.get("prelude_s")}


def outside_the_run(wall_s: float, summary: dict[str, Any]) -> Optional[float]:
    """Seconds of a gate command's wall time outside its run and before it: what follows the run's last case (the
    report, the workers' and the process's exit; None when the run row lacks what it takes)."""
    run_s, prelude_s = summary.get("run_s"), summary.get("prelude_s")
    if run_s is None or prelude_s is None:
        return None
    return round(wall_s - prelude_s - run_s, 2)


def collect_compile_stats(stats_dir: Path) -> dict[str, Any]:
    """Per-namespace compile-cache counters summed over the run's processes, and their totals."""
    docs = []
    for path in sorted(stats_dir.glob("*.json")) if stats_dir.is_dir() else []:
        try:
            docs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    per_kernel = compile_cache.merge_stats(docs)
    totals: dict[str, float] = {}
    for row in per_kernel.values():
        for name, value in row.items():
            totals[name] = round(totals.get(name, 0) + value, 3)
    stores = sorted({d["store"] for d in docs if d.get("store")})
    off = sorted({d["off"] for d in docs if d.get("off")})
    return {"processes": len(docs), "per_kernel": per_kernel, "totals": totals, "stores": stores, "off": off}


RUN_LABELS = ("cold", "warm")  # cold empties the compiled-kernel cache first; warm runs over it as it is


def unknown_runs(runs: Sequence[str]) -> Optional[str]:
    """Why ``runs`` (``--gate-runs``) is not a list of :data:`RUN_LABELS`, else None."""
    unknown = sorted(set(runs) - set(RUN_LABELS))
    if not unknown:
        return None
    return (f"unknown run {', '.join(unknown)} (runs are {' and '.join(RUN_LABELS)}, in order; name one again to "
            "repeat it: cold,warm,warm)")


def kernel_pace(wall_s: float, cases: int, impl_s: float, kernel_s: Optional[float] = None) -> dict[str, Any]:
    """How far the gate is from the GPU's own pace: ``per_case_s`` (wall / cases); ``impl_per_case_s`` (the ``impl``
    phase summed over the workers / cases: the implementation under test, its kernels and their composition, the
    only part a kernel engineer's change moves) and ``wall_over_impl``: the wall time over that sum, 1.0 when the gate
    took no longer than running the implementation's cases back to back; ``kernel_per_case_s`` and
    ``wall_over_kernels``: the same against the summed time of the implementation's kernel calls alone (the case
    rows' ``impl_kernels``, :mod:`parity.run.kernel_time`; None where none were timed)."""
    timed = kernel_s is not None and kernel_s > 0
    return {"per_case_s": round(wall_s / cases, 3) if cases else None,
            "impl_per_case_s": round(impl_s / cases, 3) if cases else None,
            "wall_over_impl": round(wall_s / impl_s, 2) if impl_s > 0 else None,
            "kernel_per_case_s": round(kernel_s / cases, 4) if timed and cases else None,
            "wall_over_kernels": round(wall_s / kernel_s, 1) if timed else None}


def run_gate_once(label: str, root: Path, cache_dir: Path, *, suite: str, provider: str, workers: str,
                  limit: Optional[int], timeout_s: Optional[float], make_default: bool = True, impl: str = "fused",
                  runner: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                  name: Optional[str] = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """One gate run as a subprocess over ``cache_dir``, written under ``root / name`` (default the label); its wall
    time, outcomes, phases and compile counters, judged against the label's target."""
    name = name or label
    out, stats_dir = root / name, root / f"{name}-compile-stats"
    for path in (out, stats_dir):
        shutil.rmtree(path, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in CHILD_UNSET}
    env.update({compile_cache.ENV_DIR: str(cache_dir), compile_cache.ENV_STATS: str(stats_dir)})
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = gate_command(suite, provider, workers, out, limit, make_default, impl)
    start = clock()
    try:
        proc = runner(cmd, env=env, timeout=timeout_s, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
        code, tail = proc.returncode, (proc.stdout or "")[-2000:]
    except subprocess.TimeoutExpired as exc:
        code, tail = None, f"timed out after {timeout_s} s: " + str(exc.output or "")[-1500:]
    wall = clock() - start
    row = {"run": label, "wall_s": round(wall, 2), "exit_code": code, "command": " ".join(cmd[1:]),
           "cache_dir": str(cache_dir), "out": str(out), "output_tail": tail.splitlines()[-6:]}
    row.update(summarize_results(out / "results.jsonl"))
    row["after_s"] = outside_the_run(wall, row)  # the command's wall = prelude_s + run_s + after_s
    row.update(kernel_pace(wall, row["cases"], row["phases_s"].get("impl", 0.0), row["impl_kernels"]["seconds"]))
    row["compile"] = collect_compile_stats(stats_dir)
    target = TARGETS.get(f"{'pr' if impl == 'fused' else 'production'}_gate_{label}_s")
    failed = row["outcomes"].get("fail", 0) + row["outcomes"].get("error", 0)
    row["target_s"] = target
    # a case that did not fit the GPU (rule device-memory) is work the gate skipped: its time is not the gate's
    row["met"] = None if target is None else bool(wall <= target and code == 0 and failed == 0
                                                  and not row["device_memory"])
    return row


def compare_outcomes(cold_out: Path, warm_out: Path) -> dict[str, Any]:
    """Case-by-case outcome agreement of two runs (the cache must not change a verdict)."""
    def outcomes(path: Path) -> dict[str, str]:
        return {row["case_id"]: row["outcome"] for row in case_rows(path)} if path.is_file() else {}

    a, b = outcomes(cold_out / "results.jsonl"), outcomes(warm_out / "results.jsonl")
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return {"common_cases": len(set(a) & set(b)), "differing": differ, "agree": not differ and bool(a) and a == b}


def gate_section(root: Path, *, suite: str = "gate", provider: str = "cudnn", workers: str = "auto",
                 limit: Optional[int] = None, runs: Sequence[str] = ("cold", "warm"), impl: str = "fused",
                 cache_dir: Optional[Path] = None, budget_s: Optional[float] = None, make_default: bool = True,
                 log: Callable[[str], None] = lambda _m: None,
                 runner: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Run the gate ``runs`` in order over one cache directory (``cold`` empties it first) under ``root``; a label
    named again is a repeat of that run (``run_spread``)."""
    root.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache_dir) if cache_dir is not None else root / "kernel-cache"
    deadline = None if budget_s is None else clock() + budget_s
    section: dict[str, Any] = {"suite": suite, "impl": impl, "provider": provider, "workers": workers, "limit": limit,
                               "cache_dir": str(cache_dir), "runs": []}
    why = unknown_runs(runs)
    if why:
        raise ValueError(f"--gate-runs: {why}")
    seen: dict[str, int] = {}
    for label in runs:
        seen[label] = seen.get(label, 0) + 1
        name = label if seen[label] == 1 else f"{label}-{seen[label]}"  # a repeat writes beside the first
        left = None if deadline is None else deadline - clock()
        if left is not None and left <= 10:
            section["runs"].append({"run": label, "repeat": seen[label], "skipped": "budget"})
            continue
        if label == "cold":
            compile_cache.clear(cache_dir)
        log(f"gate {name}: {suite} suite, impl {impl}, provider {provider}, workers {workers}, cache {cache_dir}")
        row = run_gate_once(label, root, cache_dir, suite=suite, provider=provider, workers=workers, limit=limit,
                            timeout_s=left, make_default=make_default, impl=impl, runner=runner, name=name,
                            clock=clock)
        row["repeat"] = seen[label]
        busy = row.get("occupancy") or {}
        log(f"gate {name}: {row['wall_s']} s, {row['outcomes']}, compiled {row['compile']['totals'].get('compiled', 0)}"
            f" kernels in {row['compile']['totals'].get('compile_s', 0)} s, loaded "
            f"{row['compile']['totals'].get('loaded', 0)}"
            + (f"; workers busy {100 * busy['share']:.0f} %" if busy.get("share") is not None else "")
            + (f", {busy.get('prestarted', 0)} of {busy.get('processes_started')} worker process(es) started before the run"
               if busy.get("processes_started") else "")
            + (f"; wall / kernel time {row['wall_over_kernels']}" if row.get("wall_over_kernels") else "")
            + (f"; before the run {row['prelude_s']} s, the run {row['run_s']} s, after it {row['after_s']} s"
               if row.get("after_s") is not None else ""))
        section["runs"].append(row)
    done = [r for r in section["runs"] if "out" in r]
    first = {r["run"]: r for r in reversed(done)}
    if "cold" in first and "warm" in first:
        section["cold_vs_warm"] = compare_outcomes(Path(first["cold"]["out"]), Path(first["warm"]["out"]))
    repeats = {f"{r['run']}-{r['repeat']}": compare_outcomes(Path(first[r["run"]]["out"]), Path(r["out"]))
               for r in done if r["repeat"] > 1}
    if repeats:  # the same gate again must give the same verdicts
        section["repeat_vs_first"] = repeats
    spreads = run_spread(done)
    if spreads:
        section["spread"] = spreads
    return section


def run_spread(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{run label: {runs, wall_s: [...], min_s, max_s, spread}}`` for each label run to its end more than once over
    the same cases, ``spread`` = (max - min) / min of their wall times: how far one measurement of the same gate on the
    same machine can move."""
    walls: dict[str, list[float]] = {}
    cases: dict[str, int] = {}
    for row in rows:  # only complete runs of the same cases: a timed-out run's wall time is its deadline
        if row.get("exit_code") is None or cases.setdefault(row["run"], row["cases"]) != row["cases"]:
            continue
        walls.setdefault(row["run"], []).append(row["wall_s"])
    return {label: {"runs": len(w), "wall_s": w, "min_s": min(w), "max_s": max(w),
                    "spread": round((max(w) - min(w)) / min(w), 3) if min(w) > 0 else None}
            for label, w in walls.items() if len(w) > 1}
