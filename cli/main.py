"""``dsv4-parity``: the command line (``python -m cli`` works too).

This module: the parser, ``run`` (parity of an implementation against the reference, or a metamorphic oracle with
``--oracle``), ``metamorphic`` (every oracle) and ``calibrate`` (refresh the tolerance policy's measured worst
cases). The other subcommands live beside it: ``cases`` / ``shrink`` (:mod:`cli.cases_command`), ``report`` /
``compare`` (:mod:`cli.report_command`), ``mutants`` (:mod:`cli.mutants_command`), ``bench``
(:mod:`cli.bench_command`), ``compare-runs`` (:mod:`cli.compare_runs_command`).

Exit codes: 0 all cases passed or were unsupported, 1 a case failed or errored, 2 a usage error (bad case JSON,
unknown suite or implementation).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

try:  # every command needs torch: say so in one line instead of a traceback from deep in an import
    import torch  # noqa: F401
except ModuleNotFoundError:
    print(f"error: {sys.executable} cannot import torch; install it into that interpreter (pip install torch, or "
          "`pip install -e .[gpu]` on a GPU runner), or run `make parity` without PYTHON= to bootstrap .venv",
          file=sys.stderr)
    raise SystemExit(2) from None

from cases.errors import CaseError
from parity import resume as resume_mod
from parity.calibrate import calibrate
from parity.engine import configure_torch
from parity.impls import load
from parity.metamorphic import ORACLES, applicable
from parity.results import summary_line
from parity.runner import Interrupted, RunConfig, new_run_id, resolve_out_dir, run
from parity.shard import parse_workers
from parity.usage import check_memory, check_run_options

from cli import (bench_command, cache_command, cases_command, compare_runs_command, mutants_command,
                 report_command)
from cli.options import (add_implementation_options, add_output_options, add_selection_options, run_options,
                         select_cases, selection_record)

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


def _check_impls(args: argparse.Namespace, oracle: Optional[str]) -> None:
    """Usage errors before any case runs: unknown implementations, providers that cannot run here."""
    impl = load(args.impl)
    impl.check_ready()
    impl.check_provider(args.provider)
    with impl.parallel(getattr(args, "cp", 1)):  # --cp: an implementation without CP, or a size it refuses
        pass
    if getattr(args, "require", None):
        impl.check_provider(args.require)
    if not oracle:
        load(args.against)


# ---- run -------------------------------------------------------------------------------------------------------------
def _say(text: str) -> None:
    """Print to stdout; a closed pipe (``... | head``) must not turn a finished run's exit code into a crash."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _report_hint(out_dir: Path, link: Optional[Path]) -> str:
    shown = link if link is not None else out_dir
    return f"results: {out_dir / 'results.jsonl'}\nreport:  dsv4-parity report {shown}"


def _render_report(out_dir: Path) -> None:
    """Render the run's report (best effort: the run's verdict does not depend on it)."""
    try:
        report_command.render_run(out_dir)
    except Exception as exc:  # noqa: BLE001
        print(f"note: report rendering failed: {exc}", file=sys.stderr)


def _applicable(cases: list, oracle: Optional[str], cp: int = 1) -> list:
    """The cases an oracle applies to; with ``--cp N > 1`` the THD ones (context parallelism partitions a packed
    THD buffer: production refuses BSHD with CP), saying how many were left out."""
    cases = [c for c in cases if applicable(oracle, c)] if oracle else cases
    if cp > 1:
        thd = [c for c in cases if c.is_thd]
        if len(thd) < len(cases):
            _say(f"--cp {cp}: {len(cases) - len(thd)} BSHD case(s) not selected (production's context parallelism "
                 "needs a THD pack: \"DSv4 Hybrid with CP requires qkv_format='thd'\")")
        cases = thd
    return cases


def _recorded(args: argparse.Namespace, out_override: Optional[Path],
              link_override: Optional[Path]) -> tuple[Optional[dict], Optional[Path], Optional[Path]]:
    """``(recorded run row or None, out_dir, link)`` for ``--resume`` (out_dir None: not resolved yet)."""
    if out_override is not None:
        out_dir, link = out_override, link_override
    elif args.resume:
        if not args.out:
            raise CaseError("resume", "needs --out DIR, the run directory to continue")
        out_dir, link = resolve_out_dir(args.out, "", args.make_default, True)
    else:
        return None, None, None
    if not args.resume:
        return None, out_dir, link
    recorded = resume_mod.recorded_run(out_dir)
    stream = out_dir / "results.jsonl"
    if recorded is None and stream.is_file() and stream.stat().st_size:
        raise CaseError("resume", f"{stream} holds no readable run row (killed while starting?): nothing recorded "
                                  "to continue; start the run again with --force and its options")
    return recorded, out_dir, link


def run_oracle_or_parity(args: argparse.Namespace, oracle: Optional[str], out_override: Optional[Path] = None,
                         link_override: Optional[Path] = None) -> tuple[dict, int, Path, Optional[Path]]:
    check_run_options(args)
    given = getattr(args, "given", set())
    recorded, out_dir, link = _recorded(args, out_override, link_override)
    if recorded is not None:  # --resume continues exactly the recorded run (parity.resume)
        resume_mod.apply_recorded_options(args, given, recorded, out_dir)
        oracle = resume_mod.check_oracle(oracle, given, recorded, out_dir)
        if set(given) & set(resume_mod.SELECTION_OPTIONS):
            resume_mod.check_selection(given, _applicable(select_cases(args)[1], oracle, getattr(args, "cp", 1)),
                                       recorded, out_dir)
        label, cases = resume_mod.recorded_cases(recorded, out_dir)
        run_id = str(recorded.get("run_id") or out_dir.name)
        _check_impls(args, oracle)
        check_run_options(args)  # the recorded options too
    else:
        label, cases = select_cases(args)
        cases = _applicable(cases, oracle, getattr(args, "cp", 1))
        run_id = new_run_id(label, args.impl, oracle)
        if out_override is None:
            out_dir, link = resolve_out_dir(args.out, run_id, args.make_default, args.resume)
    options = run_options(args)
    check_memory(cases, options.torch_device())
    config = RunConfig(suite=label, options=options, out_dir=out_dir, oracle=oracle, resume=args.resume,
                       isolate=args.isolate, timeout=args.timeout, junit=args.junit,
                       argv=["dsv4-parity", *getattr(args, "argv", sys.argv[1:])],
                       run_id=run_id, quiet=args.quiet, workers=parse_workers(getattr(args, "workers", "1")),
                       threads=getattr(args, "threads", None), budget_s=getattr(args, "budget_s", None),
                       force=getattr(args, "force", False), link=link, selection=selection_record(label, cases))
    counts, code = run(cases, config)
    _say(summary_line(counts, counts.get("fixed?", 0)) + (f" [oracle {oracle}]" if oracle else ""))
    return counts, code, out_dir, link


def cmd_run(args: argparse.Namespace) -> int:
    try:
        _check_impls(args, args.oracle)
        if args.oracle:
            if args.oracle not in ORACLES:
                raise CaseError("oracle", f"unknown oracle {args.oracle!r} (known: {', '.join(ORACLES)})")
        counts, code, out_dir, link = run_oracle_or_parity(args, args.oracle)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # ImplError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the results stream cannot be read or written (e.g. a full disk at the start)
        print(f"error: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.make_default and not args.no_report:
        _render_report(out_dir)
    _say(_report_hint(out_dir, link))
    return code


def cmd_metamorphic(args: argparse.Namespace) -> int:
    if args.list:
        for name, oracle in ORACLES.items():
            print(f"{name:<20} {oracle.summary}")
        return 0
    names = args.oracle or list(ORACLES)
    try:
        unknown = [n for n in names if n not in ORACLES]
        if unknown:
            raise CaseError("oracle", f"unknown oracle {unknown[0]!r} (known: {', '.join(ORACLES)})")
        _check_impls(args, "metamorphic")
        root, link = resolve_out_dir(args.out, new_run_id(args.suite or "smoke", args.impl, "metamorphic"),
                                     args.make_default, args.resume)
        worst = 0
        for name in names:
            _, code, _, _ = run_oracle_or_parity(args, name, out_override=root / name)
            worst = max(worst, code)
    except (CaseError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"results: {root}/<oracle>/results.jsonl")
    return worst


def cmd_calibrate(args: argparse.Namespace) -> int:
    try:
        return calibrate(args.results, write=args.write, policy_path=args.policy, margin=args.margin,
                         include_failures=args.include_failures)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


# ---- parser ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4-parity", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    run.set_defaults(func=cmd_run)

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
    meta.set_defaults(func=cmd_metamorphic)

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
    cal.set_defaults(func=cmd_calibrate)

    for command in (cases_command, report_command, mutants_command, bench_command, compare_runs_command,
                    cache_command):
        command.add_parsers(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.given = resume_mod.given_options(parser, args.argv)
    if getattr(args, "megatron", None):
        os.environ["DSV4_MEGATRON"] = args.megatron
    configure_torch()
    try:
        return int(args.func(args) or 0)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if not isinstance(exc, Interrupted):  # the runner already said how to continue
            print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dsv4-parity run ... | head`: the reader left; the results file is complete
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
