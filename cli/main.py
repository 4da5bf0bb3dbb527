"""``dsv4-parity``: the command line (``python -m cli`` works too).

This module builds the parser and dispatches; it loads torch only for a command that needs it, after the arguments
parsed and the checks that need no cases passed (``--help``, a typo, ``metamorphic --list`` and ``cache`` never
load it; ``bench --sections startup`` measures what that saves). ``run``, ``metamorphic`` and ``calibrate`` do
their work in :mod:`cli.run_command`; the other subcommands live beside it: ``cases`` / ``shrink``
(:mod:`cli.cases_command`), ``report`` / ``compare`` (:mod:`cli.report_command`), ``gate`` (every
production path in one gate, :mod:`cli.gate_command`), ``mutants`` (:mod:`cli.mutants_command`), ``bench`` (:mod:`cli.bench_command`), ``compare-runs``
(:mod:`cli.compare_runs_command`), ``cache`` (:mod:`cli.cache_command`), ``bisect`` (:mod:`cli.bisect_command`); each of those imports what its work needs
when it runs.

Exit codes: 0 all cases passed or were unsupported, 1 a case failed or errored, 2 a usage error (bad case JSON,
unknown suite or implementation).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from cases.errors import CaseError
from parity.names import ORACLE_SUMMARIES
from parity.run.usage import check_run_options

from cli import (bench_command, bisect_command, cache_command, cases_command, compare_runs_command, gate_command, mutants_command,
                 report_command)
from cli.options import (add_implementation_options, add_output_options, add_selection_options,
                         check_selection_options, given_options)

#: when this command started (``time.perf_counter``, as this module was imported): a run's end row says how long the
#: command took before its run's clock started (``prelude_s``: torch, the checks, the suite)
STARTED = time.perf_counter()

DESCRIPTION = """\
Numerical parity harness for DeepSeek-V4 hybrid attention (CSA / HCA / sliding window + sink, lightning indexer,
indexer KL losses; BSHD and packed THD).

`run` compares an implementation (default: fused) with the pure-PyTorch reference on a suite of cases: forward
(output, LSE, indexer scores, top-k, loss) and the gradient of every input and parameter, each judged by a layered
rule (exact structure; error / same-dtype reference error <= factor; cosine / tensor-sim floors; RMSE and scale
ratios) with tolerances from parity/policy.json. Results stream to <out>/results.jsonl.
"""
RUN_EPILOG = """\
examples:
  dsv4-parity run --suite smoke                       # fused vs reference, best provider, CPU or GPU
  dsv4-parity run --suite gate --provider cudnn --require cudnn --junit out/junit.xml
  dsv4-parity run --case-id 1adad73f706a --suite smoke  # one case (the id prefix is enough)
  dsv4-parity run --case '{"config": {...}, "layout": {...}}'
  dsv4-parity run --suite smoke --oracle thd-pack --impl reference
  dsv4-parity run --out reports/out/latest --resume   # continue a killed run (as it was recorded)
  dsv4-parity run --suite nightly --workers auto      # up to 6 workers per visible GPU, one merged results.jsonl

outcomes: pass, fail (numeric or structural), error (exception, CUDA fault, crashed worker), unsupported (the
implementation declined the case, or it needs a GPU). The exit code is 1 iff a case failed or errored.
"""




# ---- dispatch --------------------------------------------------------------------------------------------------------
def _later(name: str) -> Callable[[argparse.Namespace], int]:
    """``cli.run_command.<name>``, imported when the command runs (it loads torch)."""
    def call(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module("cli.run_command"), name)(args)

    call.__name__ = name
    return call


def load_torch() -> None:
    """Import torch for a command that needs it: one line and exit 2 where the interpreter has none; then the
    engine's settings (:func:`parity.engine.configure_torch`)."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        print(f"error: {sys.executable} cannot import torch; install it into that interpreter (pip install torch, or "
              "`pip install -e .[gpu]` on a GPU runner), or run `make parity` without PYTHON= to bootstrap .venv",
              file=sys.stderr)
        raise SystemExit(2) from None
    from parity.engine import configure_torch

    configure_torch()


def check_oracles(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in ORACLE_SUMMARIES]
    if unknown:
        raise CaseError("oracle", f"unknown oracle {unknown[0]!r} (known: {', '.join(ORACLE_SUMMARIES)})")


def precheck(args: argparse.Namespace) -> None:
    """The checks of ``run`` / ``metamorphic`` that need neither torch nor the cases (:class:`CaseError`)."""
    if args.command not in ("run", "metamorphic"):
        return
    check_run_options(args)
    check_selection_options(args)
    oracle = args.oracle
    check_oracles([oracle] if isinstance(oracle, str) else (oracle or []))


def cmd_metamorphic(args: argparse.Namespace) -> int:
    if args.list:
        for name, summary in ORACLE_SUMMARIES.items():
            print(f"{name:<20} {summary}")
        return 0
    return _later("cmd_metamorphic")(args)


# ---- parser ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    # no abbreviated options (``--base`` for ``--baseline``): a run records its argv (the run row, a gate's manifest,
    # each repro line) and a resume reads options back from it by their full names; an abbreviation would slip past
    # that check, and one that is unique today becomes ambiguous when an option is added
    parser = argparse.ArgumentParser(prog="dsv4-parity", description=DESCRIPTION, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))

    run = sub.add_parser("run", help="run parity cases (or a metamorphic oracle) and stream results.jsonl",
                         description=DESCRIPTION, epilog=RUN_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_selection_options(run)
    add_implementation_options(run)
    run.add_argument("--require", metavar="PROVIDER",
                     help="PROVIDER must run every stage it implements (a decline is 'unsupported') and a case "
                          "on which it ran no stage fails (catches silent fallbacks)")
    run.add_argument("--oracle", metavar="NAME",
                     help="run metamorphic oracle NAME on --impl instead of comparing with --against "
                          "(see `dsv4-parity metamorphic --list`)")
    add_output_options(run)
    # the manifest of the one-path gate this run is (recorded on its run row: `gate --resume` reads it back)
    run.add_argument("--gate-manifest", default=None, help=argparse.SUPPRESS)
    run.set_defaults(func=_later("cmd_run"))

    meta = sub.add_parser("metamorphic", help="run metamorphic oracles (no second implementation needed)",
                          description="Run metamorphic oracles on --impl: THD pack = per-segment runs, padding "
                                      "poison, poisoned padding-row output gradient, capacity padding, identical "
                                      "segments, determinism, CUDA-graph replay on other packings (CUDA only). "
                                      "Each oracle writes <out>/<oracle>/results.jsonl.")
    add_selection_options(meta)
    add_implementation_options(meta)
    meta.add_argument("--oracle", action="append", help="oracle name (repeatable; default all)")
    meta.add_argument("--list", action="store_true", help="list the oracles and exit")
    add_output_options(meta)
    meta.set_defaults(func=cmd_metamorphic, torch_free=lambda args: args.list)

    cal = sub.add_parser("calibrate", help="measure worst cases from result files into the tolerance policy",
                         description="Read results.jsonl files, print the worst value over the passing cases per "
                                     "(tensor class, dtype, provider) and metric, and with --write record them in "
                                     "the policy's `measured` blocks (thresholds are edited by hand).")
    cal.add_argument("results", nargs="+", type=Path, help="results.jsonl files or run directories")
    cal.add_argument("--policy", help="policy file (default parity/policy.json)")
    cal.add_argument("--write", action="store_true", help="update the policy's measured blocks")
    cal.add_argument("--margin", type=float, default=2.0, help="suggested threshold = margin × worst (default 2)")
    cal.add_argument("--include-failures", action="store_true",
                     help="also measure failing cases (default: passing cases only)")
    cal.set_defaults(func=_later("cmd_calibrate"))

    for command in (cases_command, report_command, gate_command, mutants_command, bench_command,
                    compare_runs_command, cache_command, bisect_command):
        command.add_parsers(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # a typo or --help ends here, before torch
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.command_started = STARTED if argv is None else time.perf_counter()  # a caller's own command: from now
    args.given = given_options(parser, args.argv)
    # --megatron reaches the worker processes as DSV4_MEGATRON, for this command only: restored when it returns (a
    # caller that runs several commands in one process, a test or `gate`, must not see the last one's tree)
    saved = {name: os.environ.get(name) for name in ("DSV4_MEGATRON", "DSV4_MEGATRON_ORIGIN")}
    if getattr(args, "megatron", None):
        os.environ["DSV4_MEGATRON"] = args.megatron
        os.environ["DSV4_MEGATRON_ORIGIN"] = "--megatron"  # how adapters.megatron.source names it in a message
    try:
        return _dispatch(args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _dispatch(args: argparse.Namespace) -> int:
    torch_free = getattr(args, "torch_free", False)
    args.prestart = None
    try:
        precheck(args)
        if args.command == "run":  # its workers start now, beside torch's import here (parity.run.prestart)
            from parity.run.prestart import begin
            from parity.run.worker import point_compile_caches

            point_compile_caches()  # before anything torch imports picks its own (the early children share them)
            args.prestart = begin(args)
        if not (torch_free(args) if callable(torch_free) else torch_free):
            load_torch()
        return int(args.func(args) or 0)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        runner = sys.modules.get("parity.run.runner")  # not loaded: no run was interrupted
        if runner is None or not isinstance(exc, runner.Interrupted):  # the runner already said how to continue
            print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dsv4-parity run ... | head`: the reader left; the results file is complete
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        if args.prestart is not None:  # children no run took (a usage error, an interrupted run)
            args.prestart.close()


if __name__ == "__main__":
    sys.exit(main())
