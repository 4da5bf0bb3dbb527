"""``dsv4-parity mutants``: the command-line half of :mod:`parity.mutation.mutation_suite` (and, with ``--impl megatron``,
of :mod:`parity.mutation.megatron_mutants`).

Every run writes a new folder: without ``--out``, ``reports/out/<run-id>`` (``<time>-<suite>-fused-mutants``) with
the link ``reports/out/mutants`` moved to it, as ``make parity`` moves ``reports/out/latest``; ``--out`` a symlink
works the same way; ``--out DIR`` is that directory (refused when it holds a run, unless ``--force``). The suite
and the engine load torch: :func:`cmd_mutants` imports them when it runs (the parser needs none of it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from cases.errors import CaseError
from parity.names import MEGATRON_MUTANTS_OUT, MUTANTS_LINK, MUTANTS_NAME

from cli.options import PROVIDERS, add_megatron_argument, add_selection_options

DESCRIPTION = f"""\
Mutation suite: switch on each planted bug of parity/mutation/mutants.py in turn and run the suite (fused, --provider, against
the reference, in-process). A mutant is killed by the first case that passed clean and now fails or errors;
survived if its mutation point ran and nothing failed; unreachable if no case hits one of its reach cells
(`--list` shows them; the missing cell is printed). Writes <out>/results.jsonl (the clean run) and
<out>/{MUTANTS_NAME} (the kill matrix of `dsv4-parity report <out>`); each run a new folder, {MUTANTS_LINK} naming
the newest. Exit 0 iff the clean run passed and every mutant was killed; the last line reads `mutants: K/N killed`.
"""


def out_dir_of(out: Optional[str], run_id: str) -> tuple[Path, Optional[Path]]:
    """``(run directory, link to point at it or None)`` of a mutation run (module docstring). A real directory
    where the default link belongs (left by an older version) is kept: the run still gets a new folder."""
    from parity.run.runner import resolve_out_dir, unique_sibling

    if out:
        path = Path(out)
        return resolve_out_dir(out, run_id, False, False) if path.is_symlink() else (path, None)
    link = MUTANTS_LINK
    target = unique_sibling(link.parent, run_id)
    if link.exists() and not link.is_symlink():
        print(f"note: {link} is a directory (from an older version), not a link: this run writes {target}; remove "
              f"{link} to have it name the newest run", file=sys.stderr)
        return target, None
    return target, link


def megatron_mutants(args: argparse.Namespace) -> int:
    """``mutants --impl megatron``: :func:`parity.mutation.megatron_mutants.main`, imported when it runs (it loads torch)."""
    from parity.mutation.megatron_mutants import main

    return main(args)


def _render_report(out_dir: Path) -> Optional[str]:
    """index.html of the run directory (kill matrix included), best effort; returns a note on failure."""
    from cli.report_command import render_run

    try:
        render_run(out_dir, quiet=True)
    except Exception as exc:  # noqa: BLE001 — the verdict does not depend on the report
        return f"note: report rendering failed: {exc}"
    return None


#: options of the fused mutation suite that --impl megatron has no use for (each mutant runs on its own cases)
FUSED_ONLY = (("suite", None, "--suite"), ("case", [], "--case"), ("case_id", [], "--case-id"),
              ("limit", None, "--limit"), ("keep_going", False, "--keep-going"), ("device", "auto", "--device"),
              ("policy", None, "--policy"), ("quiet", False, "--quiet"), ("no_report", False, "--no-report"),
              ("force", False, "--force"))


def cmd_mutants(args: argparse.Namespace) -> int:
    from parity.mutation import mutants
    from parity.mutation.mutation_suite import mutation_suite
    from parity.run.runner import new_run_id

    from cli.options import select_cases

    if args.impl == "megatron":  # real-code mutants: patches to a scratch copy of Megatron-LM
        unused = [flag for name, default, flag in FUSED_ONLY if getattr(args, name, default) != default]
        if unused:
            print(f"error: {', '.join(unused)}: not used with --impl megatron (each mutant runs on its own cases, "
                  "`--list` shows them; --provider picks the plan)", file=sys.stderr)
            return 2
        return megatron_mutants(args)
    registered = list(mutants.registered())
    if args.list:
        for name in registered:
            cells = "; ".join(c or "any case" for c in mutants.reach_cells(name))
            print(f"{name:<30} {mutants.registered()[name]}\n{'':<30} reach: {cells}")
        return 0
    names = args.mutant or registered
    unknown = [n for n in names if n not in registered]
    if unknown:
        print(f"error: unknown mutant(s) {unknown} (known: {', '.join(registered)})", file=sys.stderr)
        return 2
    try:
        label, cases = select_cases(args)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_id = new_run_id(label, "fused", "mutants")
    out_dir, link = out_dir_of(args.out, run_id)
    start = time.perf_counter()
    counts, outcomes = mutation_suite(cases, names, out_dir, suite=label, provider=args.provider,
                                      device=args.device, policy_path=args.policy, keep_going=args.keep_going,
                                      quiet=args.quiet, argv=sys.argv, echo=lambda line: print(line, flush=True),
                                      force=args.force, link=link, run_id=run_id)
    if not args.no_report:
        note = _render_report(out_dir)
        if note:
            print(note, file=sys.stderr)
    killed = sum(o.status == "killed" for o in outcomes)
    clean_ok = not (counts["fail"] or counts["error"])
    print(f"results: {out_dir / 'results.jsonl'}, {out_dir / MUTANTS_NAME}  "
          f"({time.perf_counter() - start:.0f} s)")
    if not clean_ok:
        print(f"the clean run failed ({counts['fail']} failed, {counts['error']} errors): those cases kill nothing")
    print(f"mutants: {killed}/{len(outcomes)} killed")
    return 0 if clean_ok and killed == len(outcomes) else 1


def add_parsers(sub) -> dict:
    p = sub.add_parser("mutants", help="mutation suite: every planted bug (parity/mutation/mutants.py) must fail the suite",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_options(p)
    p.add_argument("--impl", default="fused", choices=("fused", "megatron"),
                   help="fused: the planted bugs of parity/mutation/mutants.py; megatron: patches to a scratch copy of "
                        "Megatron-LM run with --impl megatron (unfused and emulated providers)")
    add_megatron_argument(p)
    p.add_argument("--mutant", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    p.add_argument("--list", action="store_true", help="list the mutants and their reach cells, and exit")
    p.add_argument("--keep-going", action="store_true",
                   help="run every reaching case per mutant, not only up to the first kill (fuller kill matrix)")
    p.add_argument("--provider", default="torch", choices=PROVIDERS,
                   help="fused kernel provider (default torch); --impl megatron: cudnn runs the fused path's mutants "
                        "on the real kernels (gate cases, CUDA), emulated previews that plan on a CPU")
    p.add_argument("--capability", metavar="MAJOR.MINOR",
                   help="--impl megatron --provider emulated: the GPU capability the preview declares (default 9.0, "
                        "the H200; 10.0 for sm100)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run")
    p.add_argument("--policy", help="tolerance policy JSON (default parity/policy.json)")
    p.add_argument("--out",
                   help=f"run directory: results.jsonl of the clean run + {MUTANTS_NAME} (default: a new "
                        f"reports/out/<run-id> per run, the link {MUTANTS_LINK} moved to it; a symlink --out moves "
                        f"the same way); --impl megatron writes {MUTANTS_NAME} only, a row per mutant as it is "
                        f"judged (default {MEGATRON_MUTANTS_OUT})")
    p.add_argument("--force", action="store_true",
                   help="replace the run an --out directory holds (only what a run writes there is deleted)")
    p.add_argument("--no-report", action="store_true", help="do not render index.html")
    p.add_argument("--quiet", action="store_true", help="no per-case lines during the clean run")
    p.set_defaults(func=cmd_mutants)
    return {"mutants": p}
