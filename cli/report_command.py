"""``dsv4-parity report`` and ``dsv4-parity compare``: the command-line half of :mod:`reports`. The parser needs
only :mod:`reports.schema`; the commands import the views (pandas, matplotlib) when they run.

Exit codes: 0 rendered / gate passed; 1 drift gate failed (``compare``); 2 bad input (one-line message on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parity.names import OUT_ROOT
from reports.schema import DRIFT_METRICS

LATEST = OUT_ROOT / "latest"


def _gate_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("drift gate (defaults: the baseline's gate.json, else noise_floor_ratio / "
                                      "p90 / 2x; reports/SCHEMA.md)")
    group.add_argument("--metric", choices=DRIFT_METRICS, default=None, help="error metric compared")
    group.add_argument("--stat", dest="statistic", default=None, metavar="STAT",
                       help="per-class statistic of the pair ratios: median, max or pNN (default p90)")
    group.add_argument("--factor", type=float, default=None, help="regression when the statistic exceeds this")
    group.add_argument("--floor-ulps", type=float, default=None,
                       help="floor in ulps of the tensor's dtype for max_rel / max_abs (default 4) or rel_l2 / rmse "
                            "(default 0.25)")
    group.add_argument("--ratio-floor", type=float, default=None,
                       help="floor for noise_floor_ratio (default 0.25)")
    parser.add_argument("--baselines-dir", type=Path, default=None, help=argparse.SUPPRESS)  # None: the committed


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    return {name: getattr(args, name) for name in ("metric", "statistic", "factor", "floor_ulps", "ratio_floor")}


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser(
        "report", help="render a run's terminal summary, results.csv and index.html",
        description="Render every view of a run from its results.jsonl: terminal summary, results.csv and one "
                    "self-contained index.html, written next to the JSONL.")
    report.add_argument("run", nargs="?", default=str(LATEST),
                        help="run directory, its results.jsonl, or a run id under reports/out (default: latest)")
    report.add_argument("--baseline", default="auto", metavar="NAME",
                        help="drift baseline: ARCH/NAME, NAME (this run's arch), a run directory, 'auto' "
                             "(ARCH/SUITE when committed; default) or 'none'")
    report.add_argument("--top", type=int, default=10, help="worst offenders listed in the terminal")
    report.add_argument("--no-html", action="store_true", help="skip index.html")
    report.add_argument("--no-csv", action="store_true", help="skip results.csv")
    report.add_argument("--quiet", action="store_true", help="no terminal summary")
    report.add_argument("--format", choices=("terminal", "markdown"), default="terminal",
                        help="the summary on stdout: the terminal view (default), or markdown for a CI job summary "
                             "or PR comment, at most 64 KiB (reports/markdown.py)")
    _gate_options(report)
    report.set_defaults(func=report_command)

    compare = subparsers.add_parser(
        "compare", help="relative-regression gate: fail when a tensor class's error grew over the baseline",
        description="Compare a run with a baseline per tensor class (see reports/SCHEMA.md, 'Drift'). Exit 1 when "
                    "a class regressed by more than the factor or a case newly fails, even inside the absolute "
                    "tolerances. --update stores the run as the baseline instead.")
    compare.add_argument("run", help="run directory, its results.jsonl, or a run id under reports/out")
    compare.add_argument("--baseline", default="auto", metavar="NAME",
                         help="ARCH/NAME, NAME (this run's arch), a run directory, or 'auto' (ARCH/SUITE)")
    compare.add_argument("--update", action="store_true",
                         help="write this run as baseline NAME (metrics.csv, env.json, gate.json) and exit 0")
    compare.add_argument("--render", action="store_true", help="also write results.csv / index.html with drift")
    _gate_options(compare)
    compare.set_defaults(func=compare_command)


def _baselines_dir(args: argparse.Namespace) -> Path:
    from reports.baselines import BASELINES_ROOT

    return args.baselines_dir if args.baselines_dir is not None else BASELINES_ROOT


def _console():
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # CI logs / pipes: rich's 80-column default folds the tables
        console = Console(highlight=False, width=160)
    return console


def _fail(command: str, error: Exception) -> int:
    print(f"dsv4-parity {command}: error: {error}", file=sys.stderr)
    return 2


def report_command(args: argparse.Namespace) -> int:
    from reports.errors import ReportError
    from reports.load import resolve_results
    from reports.markdown import render_markdown
    from reports.render import render_run as _render

    try:
        results = resolve_results(args.run, OUT_ROOT)
        baseline = None if args.baseline in ("none", "") else args.baseline
        terminal = args.format == "terminal" and not args.quiet
        rendered = _render(results, baseline=baseline, console=_console() if terminal else None,
                           html=not args.no_html, csv=not args.no_csv, top=args.top,
                           baselines_root=_baselines_dir(args), gate_overrides=_overrides(args))
        if args.format == "markdown":
            print(render_markdown(rendered.data, rendered.table, drift=rendered.drift, top=args.top,
                                  baseline_name=rendered.baseline.name if rendered.baseline else None), end="")
    except ReportError as error:
        return _fail("report", error)
    return 0


def compare_command(args: argparse.Namespace) -> int:
    from reports.baselines import default_baseline, default_name, load_baseline, save_baseline
    from reports.drift import GateConfig, compare_tables
    from reports.errors import ReportError
    from reports.load import load_run, resolve_results
    from reports.render import gate_for
    from reports.render import render_run as _render
    from reports.table import metrics_table
    from reports.terminal import render_drift

    console = _console()
    try:
        results = resolve_results(args.run, OUT_ROOT)
        data = load_run(results)
        name = args.baseline
        if name == "auto":
            name = default_baseline(data, _baselines_dir(args)) or (default_name(data) if args.update else None)
            if not name:
                raise ReportError("--baseline", "no committed baseline for this run's arch/suite; pass --baseline")
        if args.update:
            gate = GateConfig().updated(**_overrides(args))
            target = save_baseline(data, metrics_table(data), name, root=_baselines_dir(args), gate=gate)
            console.print(f"baseline written: {target}")
            return 0
        if args.render:
            rendered = _render(results, baseline=name, console=None, baselines_root=_baselines_dir(args),
                               gate_overrides=_overrides(args))
            drift, base = rendered.drift, rendered.baseline
            console.print(f"html: {rendered.html}")
        else:
            base = load_baseline(name, current=data, root=_baselines_dir(args))
            drift = compare_tables(metrics_table(data), base.table, gate_for(base, **_overrides(args)))
        if drift.pairs.empty:
            raise ReportError("--baseline", f"{base.name} and run {data.run_id} have no (case, tensor) pair with "
                                            f"{drift.config.metric} on both sides ({drift.only_current} only in the "
                                            f"run, {drift.only_baseline} only in the baseline: another suite, case "
                                            f"ids changed, or the values are missing): nothing was compared; "
                                            f"refresh the baseline with --update")
    except ReportError as error:
        return _fail("compare", error)
    console.print(f"run {data.run_id} vs baseline {base.name} ({base.env.get('run_id', base.path)})")
    render_drift(drift, console, baseline_name=base.name)
    return 0 if drift.passed else 1


def render_run(run: str | Path, *, quiet: bool = False) -> None:
    """What ``run --make-default`` and ``mutants`` call on their run directory: every view, default baseline, terminal
    summary on stdout unless ``quiet``. Raises :class:`ReportError` on a stream it cannot render."""
    from reports.render import render_run as _render

    _render(run, baseline="auto", console=None if quiet else _console())
