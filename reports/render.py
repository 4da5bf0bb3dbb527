"""Render every view of one run directory: ``results.csv``, ``index.html`` and the terminal summary.

``dsv4-parity report`` calls :func:`render_run` on an existing run; ``dsv4-parity run --make-default`` calls it
through :func:`reports.commands.render_run` at the end of a run. Inputs are only ``results.jsonl`` (and ``mutants.jsonl`` when present) in the run directory, plus an
optional baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.console import Console

from .baselines import BASELINES_ROOT, Baseline, default_baseline, load_baseline
from .coverage_gate import case_reasons, kernel_counts, other_work
from .drift import DriftResult, GateConfig, compare_tables
from .load import RunData, load_run
from .mutants import load_mutants
from .table import CSV_NAME, metrics_table, write_csv
from .terminal import render_terminal


@dataclass
class Rendered:
    data: RunData
    csv: Path | None
    html: Path | None
    drift: DriftResult | None
    baseline: Baseline | None
    table: pd.DataFrame | None = None


def gate_for(baseline: Baseline, **overrides: object) -> GateConfig:
    """The baseline's ``gate.json`` settings with CLI overrides (None = keep) on top of the defaults."""
    config = GateConfig.from_dict(baseline.gate, where=f"{baseline.path}/gate.json") if baseline.gate else GateConfig()
    return config.updated(**overrides)


def drift_of(data: RunData, table: pd.DataFrame, base: Baseline, **overrides: object) -> DriftResult:
    """The drift gate of a run (its metrics ``table``) against ``base``, coverage included (the run's unsupported
    reasons against the ones the baseline recorded; what it ran against what the baseline ran)."""
    return compare_tables(table, base.table, gate_for(base, **overrides), reasons=case_reasons(data.cases),
                          baseline_reasons=base.reasons, incomplete=data.incompleteness(),
                          other=other_work(data.run, kernel_counts(data.cases["plan"]), base.env))


def render_run(run: str | Path, *, baseline: str | None = "auto", console: Console | None = None,
               html: bool = True, csv: bool = True, top: int = 10, baselines_root: Path = BASELINES_ROOT,
               gate_overrides: dict[str, object] | None = None) -> Rendered:
    """Render ``run`` (a run directory or its ``results.jsonl``) next to its ``results.jsonl``.

    ``baseline``: a name or path (see :mod:`reports.baselines`), ``"auto"`` for ``<arch>/<suite>`` when committed,
    or None for no drift section. ``console=None`` prints nothing.
    """
    data = load_run(run)
    table = metrics_table(data)
    if baseline == "auto":
        baseline = default_baseline(data, baselines_root)
    base = load_baseline(baseline, current=data, root=baselines_root) if baseline else None
    drift = drift_of(data, table, base, **(gate_overrides or {})) if base else None
    directory = data.directory
    csv_path = write_csv(table, directory / CSV_NAME) if csv else None
    html_path = None
    if html:
        from .html import HTML_NAME, render_html  # Jinja2: imported when a report is drawn (see cli.report_command)

        html_path = render_html(data, table, directory / HTML_NAME, drift=drift,
                                baseline_name=base.name if base else None, baseline_env=base.env if base else None,
                                mutants=load_mutants(directory, data.tensors["tensor"].drop_duplicates().tolist()))
    if console is not None:
        outputs = {k: str(v) for k, v in (("csv", csv_path), ("html", html_path)) if v is not None}
        render_terminal(data, table, console, drift=drift, baseline_name=base.name if base else None, top=top,
                        outputs=outputs)
    return Rendered(data=data, csv=csv_path, html=html_path, drift=drift, baseline=base, table=table)
