"""``dsv4-parity run``, ``metamorphic`` and ``calibrate``: their work, after :mod:`cli.main` parsed and checked the
command line (this module is imported only then: it loads torch).

``run`` compares an implementation with the reference on a selection of cases, or runs a metamorphic oracle on it
(``--oracle``); ``--resume`` continues the run recorded in ``--out`` (:mod:`parity.run.resume`). ``metamorphic`` runs
every oracle (each in ``<out>/<oracle>/``). ``calibrate`` refreshes the tolerance policy's measured worst cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from cases.errors import CaseError
from parity.calibrate import calibrate
from parity.impls import load
from parity.oracles.metamorphic import ORACLES, applicable
from parity.run import resume as resume_mod
from parity.run.memory import check_memory
from parity.run.results import summary_line
from parity.run.runner import RunConfig, new_run_id, resolve_out_dir, resolved_provider, resume_command, run
from parity.run.usage import check_run_options, parse_workers

from cli import report_command
from cli.gate_command import strip_options  # the run row keeps the gate's manifest as ``gate``, not in its argv
from cli.options import run_options, select_cases, selection_record


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
    """``(recorded run row or None, out_dir, link)``; with ``--resume`` the row is never None: a directory without
    a recorded run is a usage error (out_dir None: a fresh run, not resolved yet)."""
    if out_override is not None:
        out_dir, link = out_override, link_override
    elif args.resume:
        if not args.out:
            raise CaseError("resume", "needs --out DIR, the run directory to continue")
        if not Path(args.out).exists():
            raise CaseError("resume", f"{args.out} does not exist: nothing to continue; start the run without "
                                      "--resume")
        out_dir, link = resolve_out_dir(args.out, "", args.make_default, True)
    else:
        return None, None, None
    if not args.resume:
        return None, out_dir, link
    recorded = resume_mod.recorded_run(out_dir)
    if recorded is None:
        raise CaseError("resume", _nothing_recorded(out_dir))
    return recorded, out_dir, link


def _nothing_recorded(out_dir: Path) -> str:
    """Why ``out_dir`` cannot be resumed (it holds no readable ``run`` row), and what to do instead."""
    stream = out_dir / "results.jsonl"
    if stream.is_file() and stream.stat().st_size:
        return (f"{stream} holds no readable run row (killed while starting?): nothing recorded to continue; "
                f"delete it and start the run again without --resume")
    where = "does not exist" if not out_dir.exists() else "holds no recorded run (no results.jsonl with a run row)"
    return f"{out_dir} {where}: nothing to continue; start the run without --resume"


def _closing_line(counts: dict, planned: int, code: int, out_dir: Path, oracle: Optional[str]) -> str:
    """``N cases: P passed, ...`` for a run that finished every planned case; otherwise it says how many of them
    finished and, where the results could not be written (exit 2), that the run stopped and how to continue."""
    line = summary_line(counts, counts.get("fixed?", 0)) + (f" [oracle {oracle}]" if oracle else "")
    finished = sum(v for k, v in counts.items() if k != "fixed?")
    if finished >= planned:
        return line
    tally = line.split(": ", 1)[1]
    if code == 2:
        return (f"stopped after {finished} of {planned} cases (the results could not be written): {tally}\n"
                f"continue with: {resume_command(out_dir)}")
    return f"incomplete, {finished} of {planned} cases: {tally}"


def measured_peaks(suite: str, options) -> Optional[dict]:
    """On a GPU: each case's peak GPU memory in the committed baseline of this path on this GPU
    (``reports/baselines/<arch>/<name>/memory.csv``, else a GPU's of the same allocations:
    ``reports.baselines.SAME_ALLOCATIONS``), for the worker pool's memory admission; None elsewhere."""
    if options.torch_device() != "cuda":
        return None
    import torch  # noqa: PLC0415

    from reports.baselines import arch_of, measured_peaks as read_peaks, name_for  # noqa: PLC0415

    arch = arch_of({"gpu": torch.cuda.get_device_name()})
    return read_peaks(arch, name_for(suite, options.impl, resolved_provider(options))) or None


def _gate_manifest(args: argparse.Namespace) -> Optional[dict]:
    """The one-path gate's manifest ``gate`` passed this run (hidden ``--gate-manifest`` JSON), or None."""
    text = getattr(args, "gate_manifest", None)
    if not text:
        return None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CaseError("gate-manifest", f"not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CaseError("gate-manifest", "expected a JSON object")
    return manifest


def run_oracle_or_parity(args: argparse.Namespace, oracle: Optional[str], out_override: Optional[Path] = None,
                         link_override: Optional[Path] = None) -> tuple[dict, int, Path, Optional[Path]]:
    check_run_options(args)
    given = getattr(args, "given", set())
    recorded, out_dir, link = _recorded(args, out_override, link_override)
    if recorded is not None:  # --resume continues exactly the recorded run (parity.run.resume)
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
    early = getattr(args, "prestart", None)  # the host's memory as it was before the early workers started
    check_memory(cases, options.torch_device(), host=early.host_available if early is not None else None)
    config = RunConfig(suite=label, options=options, out_dir=out_dir, oracle=oracle, resume=args.resume,
                       isolate=args.isolate, timeout=args.timeout, junit=args.junit,
                       argv=["dsv4-parity", *strip_options(getattr(args, "argv", sys.argv[1:]), {"--gate-manifest": True})],
                       run_id=run_id, quiet=args.quiet, workers=parse_workers(getattr(args, "workers", "1")),
                       threads=getattr(args, "threads", None), budget_s=getattr(args, "budget_s", None),
                       force=getattr(args, "force", False), link=link, selection=selection_record(label, cases),
                       peaks=measured_peaks(label, options) if oracle is None else None,
                       gate=_gate_manifest(args), prestart=getattr(args, "prestart", None),
                       command_started=getattr(args, "command_started", None))
    counts, code = run(cases, config)
    _say(_closing_line(counts, len(cases), code, out_dir, oracle))
    return counts, code, out_dir, link


def cmd_run(args: argparse.Namespace) -> int:
    try:
        _check_impls(args, args.oracle)
        if args.oracle:
            if args.oracle not in ORACLES:
                raise CaseError("oracle", f"unknown oracle {args.oracle!r} (known: {', '.join(ORACLES)})")
        if args.make_default and not args.no_report:
            report_command.preload_report_modules()  # drawn after the last case: imported while the cases run
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
    if code == 2:  # stopped: the closing line ended on how to continue
        return code
    _say(_report_hint(out_dir, link))
    return code


def cmd_metamorphic(args: argparse.Namespace) -> int:
    """Every oracle of ``--oracle`` (default all) in ``<out>/<oracle>/``; ``--resume`` continues each recorded
    oracle run and starts those the interrupted run had not reached (``--list``: :mod:`cli.main`, without torch)."""
    names = args.oracle or list(ORACLES)
    try:
        unknown = [n for n in names if n not in ORACLES]
        if unknown:
            raise CaseError("oracle", f"unknown oracle {unknown[0]!r} (known: {', '.join(ORACLES)})")
        _check_impls(args, "metamorphic")
        if args.resume and not args.out:
            raise CaseError("resume", "needs --out DIR, the metamorphic run directory to continue")
        root, link = resolve_out_dir(args.out, new_run_id(args.suite or "smoke", args.impl, "metamorphic"),
                                     args.make_default, args.resume)
        started = {n for n in names if resume_mod.recorded_run(root / n) is not None} if args.resume else set()
        if args.resume and not started:
            raise CaseError("resume", f"{root} holds no recorded oracle run (<oracle>/results.jsonl): nothing to "
                                      "continue; start it without --resume")
        worst = 0
        for name in names:
            oracle_args = args
            if args.resume and name not in started:  # not reached before the interruption: a fresh run
                oracle_args = argparse.Namespace(**{**vars(args), "resume": False})
            _, code, _, _ = run_oracle_or_parity(oracle_args, name, out_override=root / name)
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


