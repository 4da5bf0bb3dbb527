"""CLI plumbing for the case commands; ``parity/cli.py`` calls :func:`add_parsers` on its subparsers.

* ``dsv4-parity cases --suite NAME [--json] [--coverage]`` lists a suite's cases (``--json``: a JSON list of case
  objects, each loadable with ``Case.from_dict``); ``--coverage`` prints the coverage table instead and exits 1 if
  a declared cell is missed.
* ``dsv4-parity shrink (--case JSON | --case-id ID --suite NAME) [--max-calls N]`` shrinks a failing case and prints
  the minimal repro. The "still fails" predicate comes from the caller: ``args.predicate_factory`` is a callable
  ``factory(args) -> (Case -> bool)`` (True = still fails), installed with ``add_parsers(..., predicate_factory=f)``
  or ``set_defaults(predicate_factory=f)`` on the ``shrink`` subparser. Without one, ``shrink`` exits 2. A predicate
  with a ``repro(case)`` attribute prints the minimal repro with the options it ran (``--impl`` ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional

from .case import Case
from .coverage import cell_name, coverage_counts, format_table, marginals
from .errors import CaseError
from .layout import ThdLayout
from .shrink import shrink
from .suites import SUITES, find_case, id_repro, load_suite, suite_names

PredicateFactory = Callable[[argparse.Namespace], Callable[[Case], bool]]


def describe(case: Case) -> str:
    """One line: id, profile, kind, layout, loss, dtype, scope, tags."""
    c, layout = case.config, case.layout
    if isinstance(layout, ThdLayout):
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
    try:
        cases = load_suite(args.suite)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cells = SUITES[args.suite].required_cells
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


def resolve_case(args: argparse.Namespace) -> Case:
    """The case named by ``--case JSON`` or ``--case-id ID --suite NAME``."""
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
    factory: Optional[PredicateFactory] = getattr(args, "predicate_factory", None)
    if factory is None:
        print("error: no failure predicate installed (run `dsv4-parity shrink`, whose parity CLI provides it)",
              file=sys.stderr)
        return 2
    predicate = factory(args)
    try:
        small = shrink(case, predicate, max_calls=args.max_calls, log=lambda line: print(line, file=sys.stderr))
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    repro = getattr(predicate, "repro", None)  # the parity predicate knows --impl / --against / --provider
    print(repro(small) if callable(repro) else small.repro)
    return 0


def add_parsers(subparsers, *, predicate_factory: Optional[PredicateFactory] = None) -> dict:
    """Register ``cases`` and ``shrink`` on an ``argparse`` subparsers object; returns {name: parser}."""
    names = ", ".join(suite_names())
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
    sh.set_defaults(func=cmd_shrink)
    if predicate_factory is not None:
        sh.set_defaults(predicate_factory=predicate_factory)
    return {"cases": cases, "shrink": sh}


def main(argv=None) -> int:
    """Stand-alone entry (``python -m cases.commands``) for the two commands, without a parity predicate."""
    parser = argparse.ArgumentParser(prog="dsv4-parity")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
