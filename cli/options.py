"""Options shared by the subcommands, and the case selection they name (``--suite`` / ``--case`` / ``--case-id``).

The ``add_*`` functions build parsers and import nothing heavy (the command line parses and checks its arguments
before it loads torch); the selection helpers load the cases, and with them torch, when a command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from cases.errors import CaseError
from cases.vocabulary import SUITE_NAMES, check_suite

PROVIDERS = ("auto", "torch", "cudnn", "flashmla", "unfused", "emulated")


def add_implementation_options(p: argparse.ArgumentParser, *, impl_default: str = "fused") -> None:
    p.add_argument("--impl", default=impl_default,
                   help=f"implementation under test: fused, megatron (production's Megatron-LM layer, see "
                        f"--megatron), reference, or module[:attr] (default {impl_default})")
    p.add_argument("--against", default="reference", help="the implementation giving the truth (default reference)")
    p.add_argument("--provider", default="auto", choices=PROVIDERS,
                   help="kernel provider; auto = per stage, the best available here (default auto); megatron: "
                        "unfused (production's PyTorch path), emulated (its fused path over the torch kernels), "
                        "cudnn")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to run (default: cuda if available); an explicit cpu also runs the cases "
                        "that ask for CUDA (e.g. --suite gate-cpu)")
    p.add_argument("--policy", help="tolerance policy JSON (default parity/policy.json)")
    p.add_argument("--cp", type=int, default=1, metavar="N",
                   help="--impl megatron: run production's THD context-parallel branch with N ranks (2, 4; separate "
                        "processes in one gloo group on the CPU), judged on the whole pack (default 1: off)")
    add_megatron_argument(p)


def add_megatron_argument(p: argparse.ArgumentParser) -> None:
    """``--megatron PATH``: the Megatron-LM checkout ``--impl megatron`` tests (sets ``DSV4_MEGATRON`` for this
    process and its workers; default: that variable, else the pinned snapshot)."""
    p.add_argument("--megatron", metavar="PATH",
                   help="Megatron-LM checkout for --impl megatron (default $DSV4_MEGATRON, else the pinned snapshot "
                        "../shared/megatron/megatron-lm-dev-*.tar.gz)")


def add_selection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", help=f"suite name ({', '.join(SUITE_NAMES)}; default smoke)")
    p.add_argument("--case", action="append", default=[], metavar="JSON",
                   help="a case as JSON, or @FILE holding one case object or a list (repeatable)")
    p.add_argument("--case-id", action="append", default=[], metavar="ID",
                   help="run only this case of the suite (an unambiguous id prefix is enough; repeatable)")
    p.add_argument("--limit", type=int, help="run at most N cases (the first N of the selection)")


def add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run directory (default reports/out/<run-id>); a symlink such as "
                                 "reports/out/latest names the current run: a new run moves it")
    p.add_argument("--resume", action="store_true",
                   help="continue the run recorded in --out: its selection, implementation and options (from its "
                        "run row); re-runs the cases that errored or were cut off")
    p.add_argument("--force", action="store_true",
                   help="replace the run an --out directory holds: deletes what a run writes there (results.jsonl, "
                        "results.csv, index.html, mutants.jsonl, .lock) and nothing else; a directory holding no "
                        "run is never touched")
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
                        "GPUs x clamp(cores // (2 x GPUs), 1, 6), e.g. 6 on one GPU with 16 cores (a GPU sweep is "
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
def given_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every option ``argv`` sets explicitly (parsed once more with every default suppressed): what
    ``--resume`` checks against the recorded run (:mod:`parity.run.resume`)."""
    saved = []

    def suppress(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    suppress(sub)
            elif action.dest != "help":
                saved.append((action, action.default))
                action.default = argparse.SUPPRESS
        saved.append((p, dict(p._defaults)))
        p._defaults.clear()

    suppress(parser)
    try:
        namespace = parser.parse_args(list(argv))
    finally:
        for owner, value in saved:
            if isinstance(owner, argparse.ArgumentParser):
                owner._defaults.update(value)
            else:
                owner.default = value
    return set(vars(namespace))


def check_selection_options(args: argparse.Namespace) -> None:
    """What can be checked of ``--suite`` before the cases load (an unknown name: :class:`CaseError`)."""
    if getattr(args, "suite", None) and not getattr(args, "case", None):
        check_suite(args.suite)


def _parse_cases(items: Sequence[str]) -> list:
    from cases.case import Case

    out = []
    for item in items:
        if item.startswith("@"):
            try:
                text = Path(item[1:]).read_text(encoding="utf-8")
            except OSError as exc:
                raise CaseError("case", f"cannot read {item[1:]}: {exc.strerror}") from None
            except UnicodeDecodeError:
                raise CaseError("case", f"{item[1:]} is not a case file: binary or not UTF-8 text (a case is JSON; "
                                        "see `dsv4-parity cases --json`)") from None
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
    from cases.suites import load_suite, suite_names
    from parity.run.runner import select

    if args.case:
        label, cases = "adhoc", _parse_cases(args.case)
    else:
        names = [args.suite] if args.suite else (["smoke"] if not args.case_id else suite_names())
        label = args.suite or ("smoke" if not args.case_id else "adhoc")
        suites: dict = {}  # case id -> the suites holding it (for an ambiguous id prefix)
        if args.case_id and not args.suite:
            pool = []
            for name in names:
                try:
                    found = load_suite(name)
                except CaseError:
                    continue  # a suite file not generated yet
                pool += found
                for case in found:
                    suites.setdefault(case.id, []).append(name)
        else:
            pool = load_suite(names[0])
        cases = select(pool, args.case_id, suites or None) if args.case_id else pool
    if args.limit is not None:
        cases = cases[:args.limit]  # --limit >= 1: parity.run.usage.check_run_options
    return label, cases


def selection_record(label: str, cases: list) -> dict:
    """The selection recorded on the run row (what ``--resume`` continues): a suite by name, or the ad-hoc cases."""
    from cases.suites import suite_names

    if label in suite_names():
        return {"label": label}
    return {"label": label, "cases": [c.to_dict() for c in cases]}


def run_options(args: argparse.Namespace) -> RunOptions:
    """The engine options named on the command line."""
    from parity.engine import RunOptions

    return RunOptions(impl=args.impl, against=args.against, provider=args.provider, device=args.device,
                      require=getattr(args, "require", None), policy_path=args.policy, cp=getattr(args, "cp", 1))
