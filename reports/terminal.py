"""The terminal view (rich): run header, outcome × tensor-class summary, drift, worst offenders with repro lines.

Repro commands are printed on their own lines, never inside a table cell, so that they can be copied whole.
"""

from __future__ import annotations

import math

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .drift import DriftResult
from .load import RunData
from .summary import class_cases, class_summary, offenders, plan_counts, topk_regimes

OUTCOME_STYLE = {"pass": "green", "fail": "bold red", "error": "bold magenta", "unsupported": "yellow", "known": "cyan"}
#: The engine writes ±inf as ±1.7976931348623157e308 (strict JSON); anything this large is shown as inf.
INF_SENTINEL = 1e308
STATUS_STYLE = {"regression": "bold red", "improvement": "green", "steady": "", "no pairs": "dim"}


def fmt(value: object, digits: int = 3) -> str:
    """Compact number: ``1.23e-05``, ``0.456``, ``12``; ``-`` for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int,)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value) or abs(value) >= INF_SENTINEL:
            return "inf" if value > 0 else "-inf"
        if value == 0.0:
            return "0"
        if 1e-3 <= abs(value) < 1e4:
            return f"{value:.{digits}g}"
        return f"{value:.{digits - 1}e}"
    return str(value)


def render_terminal(data: RunData, table: pd.DataFrame, console: Console, *, drift: DriftResult | None = None,
                    baseline_name: str | None = None, top: int = 10, outputs: dict[str, str] | None = None) -> None:
    run = data.run
    counts = data.counts
    head = Text.assemble(("run ", "bold"), (data.run_id, "bold cyan"),
                         f"  suite={run.get('suite')}  {run.get('impl')} vs {run.get('against')}"
                         f"  provider={run.get('provider')}  {len(data.cases)} cases  ")
    for outcome, n in counts.items():
        head.append(f"{outcome}={n} ", style=OUTCOME_STYLE[outcome] if n else "dim")
    if not data.complete:
        why = (f"{len(data.end['not_run'])} cases not run, budget spent" if data.end is not None
               else "no end row")
        head.append(f" (incomplete: {why})", style="bold yellow")
    console.print(head)
    for warning in data.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)

    summary = class_summary(table).merge(class_cases(table), on="tensor_class", how="left")
    grid = Table(title="Tensors by class (and the cases holding the class: whose tensors of it pass / fail)",
                 title_justify="left",
                 header_style="bold")
    for name, justify in [("class", "left"), ("tensors", "right"), ("pass", "right"), ("fail", "right"),
                          ("cases pass", "right"), ("cases fail", "right"), ("max_rel p50", "right"),
                          ("max_rel max", "right"), ("nfr p50", "right"), ("nfr max", "right"),
                          ("worst usage", "right")]:
        grid.add_column(name, justify=justify)
    if summary.empty:
        console.print("no tensor was compared", style="yellow")
    for row in summary.to_dict("records"):
        grid.add_row(row["tensor_class"], str(row["tensors"]), str(row["pass"]),
                     Text(str(row["fail"]), style="bold red" if row["fail"] else "dim"),
                     str(row["cases_pass"]), Text(str(row["cases_fail"]), style="red" if row["cases_fail"] else "dim"),
                     fmt(row["max_rel_p50"]), fmt(row["max_rel_max"]), fmt(row["nfr_p50"]), fmt(row["nfr_max"]),
                     _usage_text(row["worst_usage"]))
    if not summary.empty:
        console.print(grid)

    regimes = topk_regimes(data)
    if regimes and regimes["rows"]:
        console.print(f"top-k rows: {regimes['clear']} clear, {regimes['tied']} tied "
                      f"({100.0 * regimes['tied'] / regimes['rows']:.1f}%) over {regimes['cases']} cases",
                      highlight=False)
    plans = plan_counts(data)
    if len(plans):
        console.print("providers: " + ", ".join(f"{r.stage}={r.provider} ({r.cases})" for r in plans.itertuples()),
                      highlight=False)

    if drift is not None:
        render_drift(drift, console, baseline_name=baseline_name)

    worst = offenders(data, table, top)
    if len(worst):
        console.print(f"[bold]Worst offenders[/] (top {len(worst)}: failing first, then closest to a threshold)")
        listing = Table(header_style="bold", show_edge=False)
        for name in ("#", "case", "outcome", "tensor", "metric", "value", "threshold", "usage", "message"):
            listing.add_column(name, no_wrap=name != "tensor", overflow="fold" if name == "tensor" else "ellipsis",
                               max_width=48 if name == "message" else None)
        for i, row in enumerate(worst.itertuples(index=False), 1):
            listing.add_row(str(i), row.case_id, Text(row.outcome, style=OUTCOME_STYLE.get(row.outcome, "")),
                            row.tensor if isinstance(row.tensor, str) else "-", row.worst_metric
                            if isinstance(row.worst_metric, str) else "-", fmt(row.value), fmt(row.threshold),
                            _usage_text(row.worst_usage), row.message or "")
        console.print(listing)
        failing = [(i, row) for i, row in enumerate(worst.itertuples(index=False), 1)
                   if row.repro and row.outcome in ("fail", "error")]
        if failing:
            console.print("[bold]Repro[/] (one line per failing offender):")
        for i, row in failing:
            console.print(f"  #{i} {row.repro}", highlight=False, soft_wrap=True, markup=False)
    for label, path in (outputs or {}).items():
        console.print(f"{label}: {path}", highlight=False)


def _usage_text(value: float) -> Text:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return Text("-", style="dim")
    style = "bold red" if value > 1.0 else "yellow" if value > 0.5 else ""
    return Text(fmt(float(value)), style=style)


def render_drift(drift: DriftResult, console: Console, *, baseline_name: str | None = None) -> None:
    title = f"Drift vs baseline {baseline_name}" if baseline_name else "Drift vs baseline"
    if drift.classes.empty:
        console.print(f"{title}: no matched (case, tensor) pairs", highlight=False)
    grid = Table(title=f"{title}: {drift.config.describe()}", title_justify="left", header_style="bold")
    for name in ("class", "pairs", "median", "p90", "max", "statistic", "factor", "worse", "better", "status"):
        grid.add_column(name, justify="left" if name in ("class", "status") else "right")
    for row in drift.classes.itertuples(index=False):
        style = STATUS_STYLE.get(row.status, "")
        grid.add_row(row.tensor_class, str(row.pairs), ratio_text(row.median), ratio_text(row.p90),
                     ratio_text(row.max), Text(ratio_text(row.statistic), style=style), f"{row.factor:g}x",
                     str(row.worse), str(row.better),
                     Text(row.status, style=style))
    if not drift.classes.empty:
        console.print(grid)
    console.print(f"matched pairs: {len(drift.pairs)}; only in this run: {drift.only_current}; "
                  f"only in the baseline: {drift.only_baseline}", highlight=False)
    if len(drift.new_failures):
        console.print(f"[bold red]{len(drift.new_failures)} new failure(s)[/] (worse than in the baseline, or new "
                      "and failing):")
        for row in drift.new_failures.head(20).itertuples(index=False):
            console.print(f"  {row.case_id} {row.tensor or '(case)'}: {row.baseline} -> {row.current}",
                          highlight=False)
    render_coverage(drift, console, baseline_name=baseline_name)
    verdict = "[bold green]PASS[/]" if drift.passed else "[bold red]FAIL[/]"
    console.print(f"drift gate: {verdict} ", end="")
    console.print("; ".join(drift.reasons()), highlight=False, markup=False)


def render_coverage(drift: DriftResult, console: Console, *, baseline_name: str | None = None) -> None:
    """The coverage part of the gate: what was compared against the baseline, then each way coverage was lost."""
    coverage = drift.coverage
    console.print(f"coverage vs {baseline_name or 'the baseline'}: {coverage.line()}", highlight=False, markup=False)
    for problem in coverage.problems():
        console.print("[bold red]coverage lost:[/] ", end="")
        console.print(problem, highlight=False, markup=False)


def ratio_text(value: object, sign: str = "x") -> str:
    """A drift ratio: ``1.37x``; scientific outside [1e-3, 1e4) (``2.35e+14x``, not fifteen digits); ``-`` if
    missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    value = float(value)
    if math.isinf(value):
        return f"{'inf' if value > 0 else '-inf'}{sign}"
    return f"{value:.2f}{sign}" if value == 0.0 or 1e-3 <= abs(value) < 1e4 else f"{value:.2e}{sign}"
