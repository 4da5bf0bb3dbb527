"""``dsv4-parity``: the command line (``python -m parity.cli`` works too).

Subcommands of this package: ``run`` (parity of an implementation against the reference, or a metamorphic oracle
with ``--oracle``), ``metamorphic`` (every oracle), ``calibrate`` (refresh the tolerance policy's measured worst
cases). Plug-ins, imported only if present: ``cases`` / ``shrink`` (``cases.commands``), ``report`` / ``compare``
(``reports.commands``), ``mutants`` (``parity.mutants_cmd``), ``bench`` (``parity.bench``), ``compare-runs``
(``parity.compare_runs``).

Exit codes: 0 all cases passed or were unsupported, 1 a case failed or errored, 2 a usage error (bad case JSON,
unknown suite or implementation).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Optional, Sequence

from cases.errors import CaseError

PROVIDERS = ("auto", "torch", "cudnn", "flashmla", "unfused", "emulated")
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
  dsv4-parity run --out reports/out/latest --resume   # continue a killed run
  dsv4-parity run --suite nightly --workers auto      # up to 4 workers per visible GPU, one merged results.jsonl

outcomes: pass, fail (numeric or structural), error (exception, CUDA fault, crashed worker), unsupported (the
implementation declined the case, or it needs a GPU). The exit code is 1 iff a case failed or errored.
"""


def _add_common(p: argparse.ArgumentParser, *, impl_default: str = "fused") -> None:
    p.add_argument("--impl", default=impl_default,
                   help=f"implementation under test: reference, fused, or module[:attr] (default {impl_default})")
    p.add_argument("--against", default="reference", help="the implementation giving the truth (default reference)")
    p.add_argument("--provider", default="auto", choices=PROVIDERS,
                   help="kernel provider; auto = per stage, the best available here (default auto); megatron: "
                        "unfused (production's PyTorch path), emulated (its fused path over the torch kernels), "
                        "cudnn")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run (default: cuda if available)")
    p.add_argument("--policy", help="tolerance policy JSON (default parity/policy.json)")
    add_megatron_argument(p)


def add_megatron_argument(p: argparse.ArgumentParser) -> None:
    """``--megatron PATH``: the Megatron-LM checkout ``--impl megatron`` tests (sets ``DSV4_MEGATRON`` for this
    process and its workers; default: that variable, else the pinned snapshot)."""
    p.add_argument("--megatron", metavar="PATH",
                   help="Megatron-LM checkout for --impl megatron (default $DSV4_MEGATRON, else the pinned snapshot "
                        "../shared/megatron/megatron-lm-dev-*.tar.gz)")


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", help="suite name (smoke, gate, nightly, production; default smoke)")
    p.add_argument("--case", action="append", default=[], metavar="JSON",
                   help="a case as JSON, or @FILE holding one case object or a list (repeatable)")
    p.add_argument("--case-id", action="append", default=[], metavar="ID",
                   help="run only this case of the suite (an unambiguous id prefix is enough; repeatable)")
    p.add_argument("--limit", type=int, help="run at most N cases (the first N of the selection)")


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (default reports/out/<run-id>); a symlink such as "
                                 "reports/out/latest names the current run: a new run moves it")
    p.add_argument("--resume", action="store_true", help="keep the finished cases in --out and run the rest")
    p.add_argument("--make-default", action="store_true",
                   help="point reports/out/latest at this run (what `make report` reads) and render its report")
    p.add_argument("--no-report", action="store_true", help="with --make-default: do not render the report")
    p.add_argument("--junit", type=Path, metavar="PATH", help="also write JUnit XML here")
    p.add_argument("--isolate", default="auto", choices=("auto", "none", "worker", "case"),
                   help="process isolation: none (in-process), worker (a child replaced after any error), case "
                        "(a fresh child per case); auto = worker on GPU or with --workers > 1, none otherwise")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case in a worker (default 1800)")
    p.add_argument("--workers", default="1", metavar="N|auto",
                   help="worker processes sharing the cases (default 1 = as without sharding); auto = on CUDA "
                        "GPUs x clamp(cores // (4 x GPUs), 1, 4), e.g. 4 on one GPU with 16 cores (a GPU sweep is "
                        "host-bound: kernel JIT and tensor draws), 1 on CPU. On CUDA each worker is pinned to one "
                        "GPU (CUDA_VISIBLE_DEVICES), several share a GPU round-robin, and a case that runs out of "
                        "GPU memory while sharing is re-run once alone on its GPU; on CPU each uses one thread. "
                        "Cases go most expensive first to the next idle worker; the parent writes the one "
                        "results.jsonl")
    p.add_argument("--threads", type=int, metavar="T",
                   help="intra-op threads per worker (default: 1 per CPU worker, cores/N per GPU worker, "
                        "unchanged for one worker). CPU results are bitwise reproducible only at equal T")
    p.add_argument("--budget-s", type=float, metavar="SECONDS",
                   help="start no case after SECONDS (running cases finish); the end row lists the cases not run, "
                        "the run is incomplete and exits 1 (continue it with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no per-case lines")


# ---- case selection --------------------------------------------------------------------------------------------------
def _parse_cases(items: Sequence[str]) -> list:
    import json

    from cases.case import Case

    out = []
    for item in items:
        if item.startswith("@"):
            try:
                text = Path(item[1:]).read_text()
            except OSError as exc:
                raise CaseError("case", f"cannot read {item[1:]}: {exc.strerror}") from None
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise CaseError("case", f"{item[1:]} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
            for i, obj in enumerate(data if isinstance(data, list) else [data]):
                try:
                    out.append(Case.from_dict(obj))
                except CaseError as exc:
                    raise CaseError(f"{item[1:]}[{i}].{exc.field}", exc.message) from None
        else:
            out.append(Case.from_json(item))
    return out


def select_cases(args: argparse.Namespace) -> tuple[str, list]:
    """``(suite label, cases)`` from ``--case`` / ``--case-id`` / ``--suite`` / ``--limit``."""
    from .runner import select

    if args.case:
        label, cases = "adhoc", _parse_cases(args.case)
    else:
        from cases.suites import load_suite, suite_names

        names = [args.suite] if args.suite else (["smoke"] if not args.case_id else suite_names())
        label = args.suite or ("smoke" if not args.case_id else "adhoc")
        if args.case_id and not args.suite:
            pool = []
            for name in names:
                try:
                    pool += load_suite(name)
                except CaseError:
                    continue  # a suite file not generated yet
        else:
            pool = load_suite(names[0])
        cases = select(pool, args.case_id) if args.case_id else pool
    if args.limit is not None:
        cases = cases[:max(args.limit, 0)]
    return label, cases


def _options(args: argparse.Namespace):
    from .engine import RunOptions

    return RunOptions(impl=args.impl, against=args.against, provider=args.provider, device=args.device,
                      require=getattr(args, "require", None), policy_path=args.policy)


def _check_impls(args: argparse.Namespace, oracle: Optional[str]) -> None:
    """Usage errors before any case runs: unknown implementations, providers that cannot run here."""
    from .impls import load

    impl = load(args.impl)
    impl.check_ready()
    impl.check_provider(args.provider)
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
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _report_hint(out_dir: Path, link: Optional[Path]) -> str:
    shown = link if link is not None else out_dir
    return f"results: {out_dir / 'results.jsonl'}\nreport:  dsv4-parity report {shown}"


def _render_report(out_dir: Path) -> None:
    """Render the report if the reports package offers a renderer (best effort, never fails the run)."""
    mod = _plugin("reports.commands")
    render = getattr(mod, "render_run", None) if mod is not None else None
    if callable(render):
        try:
            render(out_dir)
        except Exception as exc:  # noqa: BLE001 — the run's verdict does not depend on the report
            print(f"note: report rendering failed: {exc}", file=sys.stderr)


def run_oracle_or_parity(args: argparse.Namespace, oracle: Optional[str], out_override: Optional[Path] = None,
                         link_override: Optional[Path] = None) -> tuple[dict, int, Path, Optional[Path]]:
    from .results import summary_line
    from .runner import RunConfig, new_run_id, point_link, resolve_out_dir, run
    from .shard import parse_workers

    label, cases = select_cases(args)
    if oracle:
        from .metamorphic import applicable

        cases = [c for c in cases if applicable(oracle, c)]
    run_id = new_run_id(label, args.impl, oracle)
    if out_override is not None:
        out_dir, link = out_override, link_override
    else:
        out_dir, link = resolve_out_dir(args.out, run_id, args.make_default, args.resume)
        if (out_dir / "results.jsonl").exists() and args.resume:
            run_id = out_dir.name
    config = RunConfig(suite=label, options=_options(args), out_dir=out_dir, oracle=oracle, resume=args.resume,
                       isolate=args.isolate, timeout=args.timeout, junit=args.junit,
                       argv=["dsv4-parity", *getattr(args, "argv", sys.argv[1:])],
                       run_id=run_id, quiet=args.quiet, workers=parse_workers(getattr(args, "workers", "1")),
                       threads=getattr(args, "threads", None), budget_s=getattr(args, "budget_s", None))
    counts, code = run(cases, config)
    if link is not None:
        point_link(link, out_dir)
    _say(summary_line(counts, counts.get("fixed?", 0)) + (f" [oracle {oracle}]" if oracle else ""))
    return counts, code, out_dir, link


def cmd_run(args: argparse.Namespace) -> int:
    try:
        _check_impls(args, args.oracle)
        if args.oracle:
            from .metamorphic import ORACLES

            if args.oracle not in ORACLES:
                raise CaseError("oracle", f"unknown oracle {args.oracle!r} (known: {', '.join(ORACLES)})")
        counts, code, out_dir, link = run_oracle_or_parity(args, args.oracle)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # ImplError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.make_default and not args.no_report:
        _render_report(out_dir)
    _say(_report_hint(out_dir, link))
    return code


def cmd_metamorphic(args: argparse.Namespace) -> int:
    from .metamorphic import ORACLES
    from .runner import new_run_id, resolve_out_dir

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
    from .calibrate import calibrate

    try:
        return calibrate(args.results, write=args.write, policy_path=args.policy, margin=args.margin,
                         include_failures=args.include_failures)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


# ---- shrink predicate ------------------------------------------------------------------------------------------------
def shrink_predicate(args: argparse.Namespace):
    """``factory(args) -> (case -> still fails)``: the same outcome and deciding rule as the original case."""
    from cases.commands import resolve_case

    from .engine import run_case
    from .impls import load

    options = _options(args)
    impl, against = load(options.impl), load(options.against)
    first = run_case(resolve_case(args), impl, against, options)
    signature = (first.outcome, first.decided_by)
    print(f"shrink: original case {first.case_id}: {first.outcome} ({first.decided_by}) {first.message}",
          file=sys.stderr)

    def still_fails(case) -> bool:
        if signature[0] not in ("fail", "error"):
            return False
        result = run_case(case, impl, against, options)
        return (result.outcome, result.decided_by) == signature

    return still_fails


# ---- parser ----------------------------------------------------------------------------------------------------------
def _plugin(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            return None  # not written yet
        print(f"warning: plug-in {module} failed to import: {exc}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 — a broken plug-in must not take the CLI down
        print(f"warning: plug-in {module} failed to import: {exc}", file=sys.stderr)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4-parity", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run parity cases (or a metamorphic oracle) and stream results.jsonl",
                         description=DESCRIPTION, epilog=RUN_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_selection(run)
    _add_common(run)
    run.add_argument("--require", metavar="PROVIDER",
                     help="PROVIDER must run every stage it implements (a decline is 'unsupported') and a case "
                          "on which it ran no stage fails (catches silent fallbacks)")
    run.add_argument("--oracle", metavar="NAME",
                     help="run metamorphic oracle NAME on --impl instead of comparing with --against "
                          "(see `dsv4-parity metamorphic --list`)")
    _add_output(run)
    run.set_defaults(func=cmd_run)

    meta = sub.add_parser("metamorphic", help="run metamorphic oracles (no second implementation needed)",
                          description="Run metamorphic oracles on --impl: THD pack = per-segment runs, padding "
                                      "poison, capacity padding, identical segments, determinism. Each oracle "
                                      "writes <out>/<oracle>/results.jsonl.")
    _add_selection(meta)
    _add_common(meta)
    meta.add_argument("--oracle", action="append", help="oracle name (repeatable; default all)")
    meta.add_argument("--list", action="store_true", help="list the oracles and exit")
    _add_output(meta)
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

    cases_cmd = _plugin("cases.commands")
    if cases_cmd is not None:
        parsers = cases_cmd.add_parsers(sub, predicate_factory=shrink_predicate) or {}
        if "shrink" in parsers:
            _add_common(parsers["shrink"])
    for module in ("reports.commands", "parity.mutants_cmd", "parity.bench", "parity.compare_runs"):
        mod = _plugin(module)
        if mod is not None and hasattr(mod, "add_parsers"):
            mod.add_parsers(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    if getattr(args, "megatron", None):
        import os

        os.environ["DSV4_MEGATRON"] = args.megatron
    from .engine import configure_torch

    configure_torch()
    try:
        return int(args.func(args) or 0)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (finished cases are kept; continue with --resume)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dsv4-parity run ... | head`: the reader left; the results file is complete
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
