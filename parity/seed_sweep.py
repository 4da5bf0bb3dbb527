"""``python -m parity.seed_sweep``: false failures of the policy over many tensor seeds of the same case shapes.

A suite's cases (filtered by dtype, by default bf16 cases with non-zero indexer gradients) are re-run in turn with
fresh seeds (``case.replace(seed=...)``: same shapes, new tensors) until ``--cases N`` have run, fused (torch
provider) against the reference on the CPU, in-process. Every case row goes to ``<out>/results.jsonl`` (``dsv4-parity calibrate`` reads
it); the summary prints the failures and, per tensor class, the worst value of each gating metric and its usage
of the threshold (value / threshold; for similarities ``(1 - sim) / (1 - floor)``). Exit 1 iff a case failed or
errored.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from cases.case import Case
from cases.suites import load_suite

from parity.engine import RunOptions, run_case
from parity.impls import load
from parity.judge.verdict import GATES
from parity.run.results import ResultsWriter

DEFAULT_OUT = Path("reports") / "out" / "seed-sweep"


def trains_indexer(case: Case) -> bool:
    """The case has indexer gradients that are not all 0: a loss, and a sequence of 8 real rows (a row that sees two
    compressed keys; with one key the KL is 0 whatever the tensors)."""
    c, lay = case.config, case.layout
    longest = max(lay.real_lengths, default=0) if case.is_thd else lay.seq_len
    return c.has_indexer and case.training and c.dsa_indexer_loss_coeff > 0 and longest >= 8


def sweep_cases(suite: str, dtype: str, count: int, indexer_only: bool = True, first_seed: int = 1) -> list[Case]:
    """``count`` cases: the selected cases of ``suite`` re-seeded in turn (seed-major order)."""
    base = [c for c in load_suite(suite) if c.dtype == dtype and (not indexer_only or trains_indexer(c))]
    return [base[i % len(base)].replace(seed=first_seed + i) for i in range(count)] if base else []


def worst_by_class(results: Sequence) -> dict:
    """``{class: {metric: (worst value, its usage, case id, tensor)}}`` over the gating metrics of ``results``."""
    worst: dict = {}
    for res in results:
        for t in res.tensors:
            for m in t.metrics:
                if m.metric not in GATES or m.threshold is None:
                    continue
                usage = m.usage
                best = worst.setdefault(t.tensor_class, {}).get(m.metric)
                if best is None or (not math.isnan(usage) and usage > best[1]):
                    worst[t.tensor_class][m.metric] = (m.value, usage, res.case_id, t.name)
    return worst


def _shown(metric: str, value: float) -> str:
    return f"1-{metric} {1 - value:.3g}" if GATES[metric][2] == "floor" else f"{metric} {value:.3g}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parity.seed_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="smoke")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cases", type=int, default=100, help="how many re-seeded cases to run (default 100)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--all-cases", action="store_true", help="not only the cases that train an indexer")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--policy")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    cases = sweep_cases(args.suite, args.dtype, args.cases, not args.all_cases)
    options = RunOptions(provider="torch", device="cpu", policy_path=args.policy)
    impl, against = load("fused"), load("reference")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    writer = ResultsWriter(out / "results.jsonl")
    results, bad, start = [], [], time.perf_counter()
    for i, case in enumerate(cases, 1):
        res = run_case(case, impl, against, options)
        writer.write(res.rows())
        results.append(res)
        if res.outcome in ("fail", "error"):
            bad.append(res)
            print(f"{res.outcome}: {case.id} (seed {case.seed}): {res.message}", flush=True)
        if i % 50 == 0:
            print(f"{i}/{len(cases)} cases, {len(bad)} failed, {time.perf_counter() - start:.0f} s", flush=True)
    writer.close()
    print(f"{len(cases)} re-seeded {args.suite} {args.dtype} cases: "
          f"{sum(r.outcome == 'pass' for r in results)} passed, {len(bad)} failed or errored")
    for cls, metrics in sorted(worst_by_class(results).items()):
        cells = ", ".join(f"{_shown(m, v)} (usage {u:.2f}, {cid})" for m, (v, u, cid, _) in sorted(metrics.items()))
        print(f"  {cls}: {cells}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
