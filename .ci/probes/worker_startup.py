"""What a worker process pays before it runs cases at its normal pace (issue 33;
`reports/baselines/h100/bench/NOTE-20261207g.md`: on the H100's warm gate each worker's first case spent 5.1–5.9 s in
`impl` and its first reference 6.4–7.5 s, even on a 70-row case, after a ~5.8 s process start).

Runs one small case twice in a fresh process, two ways, each step timed from the process's start:

* ``worker``: the order a worker takes (``parity.run.worker``): torch, the harness, then the case (twice);
* ``preloaded``: torch, the harness, then CUDA's first use, ``torch._dynamo`` (``torch.utils.checkpoint`` imports it
  on its first call) and the provider's kernel libraries, each timed, then the case (twice).
* ``warmed``: torch, the harness, then what a worker child does before its first request since 2026-12-07
  (:func:`parity.run.worker.warm_up`), then the case (twice): the first run's extra cost left after the warm-up.

The first run's phases minus the second's are the first-use costs; what ``preloaded`` moves out of them is what a
worker that imported those before its first case (or a fork server that imported them once) would save per process.

    python3 .ci/probes/worker_startup.py [--provider cudnn] [--case-id ID] [--suite gate]

Prints; changes nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
#: the Python modules each provider's kernels come from (a missing one is reported, not fatal)
LIBRARIES = {"cudnn": ("cudnn", "cutlass.cute", "flash_mla"), "flashmla": ("flash_mla",)}
ORDERS = ("worker", "preloaded", "warmed")


def child(order: str, provider: str, case_id: str, suite: str) -> None:
    """One fresh process's timeline, as JSON on stdout: ``[[step, seconds since start], ...]`` and the two runs'
    phases."""
    start = time.perf_counter()
    marks = []

    def mark(step: str) -> None:
        marks.append([step, round(time.perf_counter() - start, 3)])

    import importlib

    import torch

    mark("import torch")
    from dataclasses import asdict

    from cases.suites import find_case
    from parity.engine import RunOptions, configure_torch
    from parity.run.execution import execute

    configure_torch()
    mark("import the harness")
    if order == "preloaded":
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
            mark("CUDA first use")
        import torch._dynamo  # noqa: F401

        mark("import torch._dynamo")
        for name in LIBRARIES.get(provider, ()):
            try:
                importlib.import_module(name)
                mark(f"import {name}")
            except Exception as exc:  # noqa: BLE001 — a library this machine lacks: said, not fatal
                mark(f"import {name}: {type(exc).__name__}")
    if order == "warmed":
        from parity.run.worker import warm_spec, warm_up

        warm_up(warm_spec("fused", "reference", provider, "cuda" if torch.cuda.is_available() else "cpu"))
        mark("parity.run.worker.warm_up")
    case = find_case(suite, case_id)
    request = {"case": case.to_dict(), "options": asdict(RunOptions(provider=provider)), "oracle": None}
    runs = []
    for n in (1, 2):
        rows = execute(request)
        mark(f"case run {n}: {rows[0]['outcome']}")
        runs.append({k: round(v, 3) for k, v in (rows[0].get("phases_s") or {}).items()})
    print(json.dumps({"marks": marks, "runs": runs}))


def smallest_case(suite: str) -> str:
    """The id of the suite's smallest bf16 training case with an indexer loss (every phase runs, sign-split too)."""
    from cases.suites import load_suite
    from parity.run.memory import input_bytes

    cases = [c for c in load_suite(suite) if c.training and c.dtype == "bfloat16" and c.config.has_indexer
             and c.config.dsa_indexer_loss_coeff > 0]
    return min(cases, key=input_bytes).id


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", default="auto")
    ap.add_argument("--case-id")
    ap.add_argument("--suite", default="gate")
    ap.add_argument("--child", choices=ORDERS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    case_id = args.case_id or smallest_case(args.suite)
    if args.child:
        child(args.child, args.provider, case_id, args.suite)
        return 0
    print(f"case {case_id} ({args.suite}), provider {args.provider}")
    for order in ORDERS:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", order, "--provider", args.provider,
                               "--case-id", case_id, "--suite", args.suite], capture_output=True, text=True,
                              cwd=REPO)
        wall = time.perf_counter() - t0
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"{order}: exit {proc.returncode}: {proc.stderr.strip()[-600:]}")
            continue
        got = json.loads(lines[-1])
        print(f"{order} (process wall {wall:.2f} s):")
        for step, at in got["marks"]:
            print(f"  {at:8.2f} s  {step}")
        first, second = got["runs"]
        extra = {k: round(first.get(k, 0) - second.get(k, 0), 2) for k in first}
        print(f"  first run's phases minus the second's: {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
