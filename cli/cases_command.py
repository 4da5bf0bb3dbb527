"""``dsv4-parity cases`` and ``dsv4-parity shrink``.

* ``dsv4-parity cases --suite NAME [--json] [--coverage]`` lists a suite's cases (``--json``: a JSON list of case
  objects, each loadable with ``Case.from_dict``); ``--coverage`` prints the coverage table instead and exits 1 if
  a declared cell is missed.
* ``dsv4-parity shrink (--case JSON | --case-id ID --suite NAME) [--max-calls N]`` shrinks a failing case and prints
  the minimal repro. "Still fails" = the same outcome and deciding rule as the original case
  (:func:`shrink_predicate`), for ``--impl`` against ``--against`` on ``--provider``; the repro printed (once, on
  stdout) carries those options.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from cases.errors import CaseError
from cases.vocabulary import SUITE_NAMES

from cli.options import add_implementation_options, run_options

# The cases, the shrinker and the engine load torch: each command imports them when it runs (cli.main).


def describe(case) -> str:
    """One line: id, profile, kind, layout, loss, dtype, scope, tags."""
    c, layout = case.config, case.layout
    if case.is_thd:
        shape = (f"thd real={list(layout.real_lengths)} padded={list(layout.padded_lengths)} "
                 f"T={layout.total_tokens} cap={layout.compressed_capacity}")
    else:
        shape = f"bshd B={layout.batch} S={layout.seq_len}"
    loss = case.loss_mode if case.loss_mode == "none" else f"{case.loss_mode}/{case.loss_reduction}"
    kind = f"r={c.compress_ratio}" + (" dense-mode" if c.csa_dense_mode else "")
    model = f"n={c.num_attention_heads} W={c.csa_window_size} K={c.dsa_indexer_topk}"
    return (f"{case.id}  {case.profile:<6} {kind:<14} {model:<16} loss={loss:<15} {case.dtype:<8} {case.scope:<5} "
            f"{shape}")


def cmd_cases(args: argparse.Namespace) -> int:
    from cases.coverage import cell_name, coverage_counts, format_table, marginals
    from cases.suites import id_repro, load_suite, required_cells

    try:
        cases = load_suite(args.suite)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cells = required_cells(args.suite)  # a subset (gate-cpu) declares none
    if args.coverage:
        counts = coverage_counts(cases, cells)
        if args.json:
            table = {"suite": args.suite, "cases": len(cases),
                     "required": [{"cell": cell_name(cell), "count": n} for cell, n in counts],
                     "features": {k: dict(v) for k, v in marginals(cases).items()}}
            print(json.dumps(table, indent=1))
        else:
            print(format_table(cases, cells))
        return 1 if any(n == 0 for _, n in counts) else 0
    if args.json:
        print(json.dumps([c.to_dict() for c in cases], indent=1))
    else:
        for case in cases:
            print(describe(case))
        print(f"{len(cases)} cases in suite {args.suite!r}; run one with: {id_repro(cases[0], args.suite)}"
              if cases else f"suite {args.suite!r} is empty")
    return 0


def resolve_case(args: argparse.Namespace):
    """The case named by ``--case JSON`` or ``--case-id ID --suite NAME``."""
    from cases.case import Case
    from cases.suites import find_case

    if getattr(args, "case", None):
        return Case.from_json(args.case)
    if not getattr(args, "suite", None):
        raise CaseError("suite", "--case-id needs --suite NAME")
    return find_case(args.suite, args.case_id)


def cmd_shrink(args: argparse.Namespace) -> int:
    try:
        case = resolve_case(args)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from cases.shrink import shrink

    try:
        predicate = shrink_predicate(args, case)
        small = shrink(case, predicate, max_calls=args.max_calls, log=lambda line: print(line, file=sys.stderr))
    except CaseError as exc:  # e.g. the case does not fail: nothing to shrink (a usage error)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(run_options(args).repro(small))  # with --impl / --against / --provider: it reproduces as printed
    return 0


def shrink_predicate(args: argparse.Namespace, case) -> Callable[[object], bool]:
    """``case -> still fails``: the same outcome and deciding rule as the original ``case``."""
    from parity.engine import run_case
    from parity.impls import load

    options = run_options(args)
    impl, against = load(options.impl), load(options.against)
    first = run_case(case, impl, against, options)
    signature = (first.outcome, first.decided_by)
    print(f"shrink: original case {first.case_id}: {first.outcome} ({first.decided_by}) {first.message}",
          file=sys.stderr)
    if first.outcome not in ("fail", "error"):
        raise CaseError("case", f"{first.case_id} does not fail ({first.outcome}) for --impl {options.impl} against "
                                f"{options.against}: nothing to shrink (shrink reduces a failing case)")

    def still_fails(candidate) -> bool:
        if signature[0] not in ("fail", "error"):
            return False
        result = run_case(candidate, impl, against, options)
        return (result.outcome, result.decided_by) == signature

    return still_fails


def add_parsers(subparsers) -> dict:
    """Register ``cases`` and ``shrink`` on an ``argparse`` subparsers object; returns {name: parser}."""
    names = ", ".join(SUITE_NAMES)
    cases = subparsers.add_parser("cases", help="list a suite's cases or its coverage table",
                                  description="List the cases of a suite (or its coverage table).")
    cases.add_argument("--suite", default="smoke", help=f"suite name ({names})")
    cases.add_argument("--json", action="store_true", help="print a JSON list of case objects")
    cases.add_argument("--coverage", action="store_true", help="print the coverage table (exit 1 if a cell is missed)")
    cases.set_defaults(func=cmd_cases)

    sh = subparsers.add_parser("shrink", help="shrink a failing case to a minimal repro",
                               description="Shrink a failing case (delta debugging) and print the minimal repro.")
    which = sh.add_mutually_exclusive_group(required=True)
    which.add_argument("--case", help="the case as JSON")
    which.add_argument("--case-id", help="a case id of --suite")
    sh.add_argument("--suite", help=f"suite of --case-id ({names})")
    sh.add_argument("--max-calls", type=int, default=1000, help="most predicate evaluations (default 1000)")
    add_implementation_options(sh)
    sh.set_defaults(func=cmd_shrink)
    return {"cases": cases, "shrink": sh}
