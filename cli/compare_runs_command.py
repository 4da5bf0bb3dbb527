"""``dsv4-parity compare-runs A B``: do two runs agree case by case (:mod:`parity.compare_runs`)?"""

from __future__ import annotations

import argparse
import sys


def command(args: argparse.Namespace) -> int:
    from parity.compare_runs import RunsError, compare, load, report

    if args.verdicts and args.rel_tol:
        print("dsv4-parity compare-runs: error: --verdicts compares no metric value, so --rel-tol would be ignored: "
              "give one of them", file=sys.stderr)
        return 2
    try:
        a, b = load(args.a), load(args.b)
    except (RunsError, OSError) as exc:
        print(f"dsv4-parity compare-runs: error: {exc}", file=sys.stderr)
        return 2
    agreement = compare(a, b, rel_tol=args.rel_tol, common_only=args.common_only, verdicts_only=args.verdicts)
    for line in report(agreement, a, b, show=args.show):
        print(line)
    return 0 if agreement.ok else 1


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare-runs", help="check that two runs agree case by case (e.g. 1 vs N workers)",
                       description="Do two runs agree case by case? Compares outcomes, verdicts and every metric value "
                       "per case; ignores durations, worker/device fields and file order. Exit 0 = agree, "
                       "1 = differ, 2 = unreadable input.")
    p.add_argument("a", help="run directory or results.jsonl (e.g. the single-GPU run)")
    p.add_argument("b", help="run directory or results.jsonl (e.g. the --workers N run)")
    p.add_argument("--rel-tol", type=float, default=0.0,
                   help="relative tolerance on metric values (default 0: bit-identical)")
    p.add_argument("--verdicts", action="store_true",
                   help="compare outcomes and per-tensor verdicts only, not metric values or which rule decided: "
                        "for two GPU runs, whose atomics change values (and so the deciding rule of a passing "
                        "tensor) from run to run")
    p.add_argument("--common-only", action="store_true",
                   help="judge only the cases both runs finished (time-limited or killed runs)")
    p.add_argument("--show", type=int, default=20, help="differences listed (default 20)")
    p.set_defaults(func=command, torch_free=True)
