"""``dsv4-parity report`` and ``dsv4-parity compare``: the command-line half of :mod:`reports`. The parser needs
only :mod:`reports.schema`; the commands import the views (pandas, Jinja2) when they run.

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
    report.set_defaults(func=report_command, torch_free=True)

    compare = subparsers.add_parser(
        "compare", help="relative-regression gate: fail when a tensor class's error grew over the baseline or "
                        "coverage shrank",
        description="Compare a run with a baseline per tensor class (see reports/SCHEMA.md, 'Drift'). Exit 1 when "
                    "a class regressed by more than the factor or a case newly fails, even inside the absolute "
                    "tolerances, or when coverage was lost: a case the baseline ran now unsupported or absent, a "
                    "tensor it compared missing, a new unsupported reason. --update stores the run as the baseline "
                    "instead. RUN may be a gate directory (dsv4-parity gate): each path against its own baseline.")
    compare.add_argument("run", help="run directory, its results.jsonl, or a run id under reports/out")
    compare.add_argument("--baseline", default="auto", metavar="NAME",
                         help="ARCH/NAME, NAME (this run's arch), a run directory, or 'auto' (ARCH/SUITE)")
    compare.add_argument("--update", action="store_true",
                         help="write this run as baseline NAME (metrics.csv, env.json, gate.json) and exit 0")
    compare.add_argument("--render", action="store_true", help="also write results.csv / index.html with drift")
    _gate_options(compare)
    compare.set_defaults(func=compare_command, torch_free=True)


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


def _gate_dir(run: str) -> tuple[Path, dict] | None:
    """``(directory, manifest)`` when ``run`` names a gate directory (``dsv4-parity gate`` of several paths)."""
    from reports.gate import read_manifest

    for candidate in (Path(run), OUT_ROOT / str(run)):
        if candidate.is_dir():
            manifest = read_manifest(candidate)
            if manifest is not None:
                return candidate, manifest
    return None


def _report_gate(args: argparse.Namespace, directory: Path, manifest: dict) -> int:
    """``report`` of a gate directory: every run rendered against its baseline, then the side-by-side summary
    (terminal), or the gate's markdown: its side-by-side block, then each path's summary in an equal share of 64 KiB."""
    from reports.gate import judge_gate_dir, markdown_summary, print_summary, title_of, write_index
    from reports.markdown import MAX_BYTES, render_markdown

    terminal = args.format == "terminal" and not args.quiet
    console = _console() if terminal else None
    verdicts = judge_gate_dir(directory, manifest, baseline=args.baseline, console=console,
                              baselines_root=args.baselines_dir)
    title = title_of(manifest)
    report = write_index(directory, verdicts, title=title)
    if console is not None:
        print_summary(verdicts, console, title=title, report=report)
    if args.format == "markdown":
        head = markdown_summary(verdicts, title=title)
        shown = [v for v in verdicts if v.rendered is not None]
        share = max(4096, (MAX_BYTES - len(head.encode()) - 1024) // max(1, len(shown)))
        parts = [head] + [f"---\n\n### {v.kind} `{v.name}`\n\n" + render_markdown(
            v.rendered.data, v.rendered.table, drift=v.rendered.drift, top=args.top, limit=share,
            baseline_name=v.baseline) for v in shown]
        print("\n".join(parts), end="")
    return 0


def report_command(args: argparse.Namespace) -> int:
    from reports.errors import ReportError
    from reports.load import resolve_results
    from reports.markdown import render_markdown
    from reports.render import render_run as _render

    try:
        gate = _gate_dir(args.run)
        if gate is not None:
            return _report_gate(args, *gate)
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
    from reports.errors import ReportError
    from reports.gate import manifest_runs, parse_baselines
    from reports.load import resolve_results

    console = _console()
    try:
        gate = _gate_dir(args.run)
        if gate is None:
            return _compare_one(resolve_results(args.run, OUT_ROOT), args.baseline, args, console)
        directory, manifest = gate
        runs = [(name, path) for kind, name, path in manifest_runs(directory, manifest) if kind == "path"]
        chosen = parse_baselines(args.baseline, [name for name, _ in runs])
        codes = []
        for name, path in runs:
            console.print(f"[bold]path {name}[/] ({path})")
            if chosen[name] is None:
                console.print("not gated against a baseline (--baseline none)")
                continue
            codes.append(_compare_one(resolve_results(path), chosen[name], args, console))
        if not codes:  # as for one run: a comparison against no baseline compares nothing, and passes nothing
            raise ReportError("--baseline", f"no path of the gate {directory} was compared "
                                            f"({', '.join(name for name, _ in runs) or 'it has no paths'}): name a "
                                            f"baseline (auto, or PATH=NAME) for at least one")
    except ReportError as error:
        return _fail("compare", error)
    return max(codes)


def _compare_one(results: Path, name: str, args: argparse.Namespace, console) -> int:
    """``compare`` of one run against baseline ``name`` (``auto``: its default), or ``--update`` of it."""
    from reports.baselines import default_baseline, default_name, load_baseline, save_baseline
    from reports.drift import GateConfig
    from reports.errors import ReportError
    from reports.load import load_run
    from reports.render import drift_of
    from reports.render import render_run as _render
    from reports.table import metrics_table
    from reports.terminal import render_drift

    try:
        data = load_run(results)
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
            drift = drift_of(data, metrics_table(data), base, **_overrides(args))
        shared = set(data.cases["case_id"]) & set(base.table["case_id"])
        metric = drift.config.metric
        baseline_has_values = metric in base.table and bool(base.table[metric].notna().any())
        # no case in common, or a baseline with no value of the metric at all: the baseline cannot judge this run
        # (a usage error); shared cases whose pairs all vanished from the run are lost coverage (the gate fails)
        if drift.pairs.empty and (not shared or not baseline_has_values) and len(data.cases):
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


def preload_report_modules() -> None:
    """Import the HTML report's modules (pandas, Jinja2) in a background thread, so the report
    drawn after a run's last case does not wait for them: called as a run starts. A failed import is left for the
    report itself to raise."""
    import importlib
    import threading

    def load() -> None:
        try:
            importlib.import_module("reports.html")
        except Exception:  # noqa: BLE001 — the report's own import says what is wrong
            pass

    threading.Thread(target=load, name="report-import", daemon=True).start()


def render_run(run: str | Path, *, quiet: bool = False) -> None:
    """What ``run --make-default`` and ``mutants`` call on their run directory: every view, default baseline, terminal
    summary on stdout unless ``quiet``. Raises :class:`ReportError` on a stream it cannot render."""
    from reports.render import render_run as _render

    _render(run, baseline="auto", console=None if quiet else _console())
