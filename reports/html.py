"""The HTML view: ONE self-contained file (Jinja2 template ``templates/report.html.j2``, CSS / JS / images inline).

A Content-Security-Policy meta tag (``default-src 'none'``, images only from ``data:``) makes the browser refuse any
network fetch, so a page that renders at all is self-contained. Sections: run summary, drift vs the baseline,
sortable / filterable case table (click a case for its per-tensor metrics, JSON and repro), per-tensor error
distributions and noise-floor-ratio plots, coverage matrix, failing cases, mutation kill matrix, environment.

The page exposes ``window.dsv4Report`` (``sortBy``, ``setFilter``, ``visibleCaseIds``) for the browser tests.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from cases.vocabulary import OUTCOMES

from . import plots
from .coverage import coverage, gaps
from .drift import DriftResult
from .load import RunData
from .mutants import MutantReport
from .schema import CSV_COLUMNS
from .summary import case_summary, class_cases, class_summary, plan_counts, topk_regimes
from .terminal import INF_SENTINEL, fmt, ratio_text

TEMPLATES = Path(__file__).resolve().parent / "templates"
HTML_NAME = "index.html"
#: Metric columns of a case's tensor table, the deciding ones first (``nan`` / ``inf`` only when some are non-zero).
DETAIL_METRICS = ("noise_floor_ratio", "ref_error", "max_rel", "max_abs", "rel_l2", "rmse", "cosine", "tensor_sim",
                  "frac_outside")
MAX_FAILING = 200
MAX_PAIRS = 15


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), trim_blocks=True,
                             lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["num"] = lambda v, digits=3: fmt(_py(v), digits)
    env.filters["ratio"] = lambda v: "-" if _missing(v) else ratio_text(v, "×")
    env.filters["sortv"] = _sort_value
    return env


def _sort_value(value: Any) -> str:
    """``data-v`` of a numeric cell: what JavaScript's parseFloat reads back (``Infinity``, empty = missing)."""
    value = _py(value)
    if _missing(value):
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
        return ("Infinity" if value > 0 else "-Infinity") if math.isinf(value) else repr(value)
    return str(value)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


def _py(value: Any) -> Any:
    """numpy scalars -> Python; NaN stays float NaN."""
    if hasattr(value, "item"):
        value = value.item()
    return value


def _short(value: Any) -> Any:
    """4 significant digits for the embedded JSON (NaN -> null, inf -> a large sentinel string)."""
    value = _py(value)
    if _missing(value):
        return None
    if isinstance(value, float):
        if math.isinf(value) or abs(value) >= INF_SENTINEL:
            return "inf" if value > 0 else "-inf"
        return float(f"{value:.4g}")
    return value


def _json_for_script(data: Any) -> str:
    """JSON safe inside a ``<script type="application/json">`` element."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _case_details(data: RunData, table: pd.DataFrame) -> dict[str, Any]:
    """Per case: tensors with their metrics, the case JSON, repro, plan, top-k regimes, features, message."""
    extras = [c for c in table.columns if c not in CSV_COLUMNS]
    nonfinite = [m for m in ("nan", "inf") if (table[m].fillna(0) != 0).any()]
    columns = list(DETAIL_METRICS) + nonfinite + extras
    tensors: dict[str, list] = {}
    rows = table.loc[table["tensor"] != ""]
    records = zip(rows["case_id"], rows["tensor"], rows["tensor_class"], rows["dtype"], rows["shape"],
                  rows["verdict"], rows["rule"], rows["worst_metric"], rows["worst_usage"], rows["failed_checks"],
                  *(rows[c] for c in columns))
    for case_id, tensor, klass, dtype, shape, verdict, rule, worst, usage, failed, *values in records:
        tensors.setdefault(case_id, []).append(
            [tensor, klass, _short(dtype), _short(shape), _short(verdict), _short(rule), _short(worst),
             _short(usage), failed.split(";") if isinstance(failed, str) and failed else [],
             [_short(v) for v in values]])
    cases = {}
    for row in data.cases.itertuples(index=False):
        cases[row.case_id] = {"t": tensors.get(row.case_id, []), "c": row.case, "r": row.repro, "p": row.plan,
                              "k": row.topk, "f": row.features, "m": row.message, "ff": row.first_failure}
    return {"metrics": columns, "cases": cases}


def _failing(data: RunData, table: pd.DataFrame) -> list[dict[str, Any]]:
    bad = data.cases.loc[data.cases["outcome"].isin(["fail", "error"])].head(MAX_FAILING)
    failing_metrics = data.metrics.loc[data.metrics["passed"].eq(False)]
    by_case = dict(tuple(failing_metrics.groupby("case_id")))
    found = []
    for row in bad.itertuples(index=False):
        checks = by_case.get(row.case_id)
        found.append({
            "case_id": row.case_id, "outcome": row.outcome, "decided_by": row.decided_by, "message": row.message,
            "first_failure": row.first_failure, "repro": row.repro,
            "case_json": json.dumps(row.case, indent=2, sort_keys=True) if row.case is not None else "null",
            "checks": [] if checks is None else [
                {"tensor": c.tensor, "metric": c.metric, "value": c.value, "threshold": c.threshold,
                 "usage": c.usage} for c in checks.itertuples(index=False)]})
    return found


def _drift_context(drift: DriftResult | None, baseline_name: str | None, baseline_env: dict[str, Any]) -> Any:
    if drift is None:
        return None
    pairs = drift.pairs.sort_values("ratio", ascending=False, kind="stable")
    return {"name": baseline_name, "passed": drift.passed, "describe": drift.config.describe(),
            "config": drift.config, "classes": drift.classes.to_dict("records"),
            "worst": pairs.head(MAX_PAIRS).to_dict("records"),
            "best": pairs.loc[pairs["ratio"] < 1.0].tail(MAX_PAIRS).iloc[::-1].to_dict("records"),
            "new_failures": drift.new_failures.to_dict("records"), "only_current": drift.only_current,
            "only_baseline": drift.only_baseline, "matched": len(drift.pairs), "regressions": drift.regressions,
            "baseline_run": baseline_env.get("run_id"), "plot": plots.drift_plot(drift),
            "coverage": _coverage_context(drift)}


def _coverage_context(drift: DriftResult) -> dict[str, Any]:
    coverage = drift.coverage
    reasons = [{"reason": r.reason, "cases": int(r.cases), "new": bool(r.new),
                "baseline": None if r.baseline is None or pd.isna(r.baseline) else int(r.baseline)}
               for r in coverage.reasons.itertuples(index=False)]
    return {"lost": coverage.lost, "line": coverage.line(), "headline": coverage.headline(),
            "problems": coverage.problems(), "reasons": reasons}


def _env_rows(data: RunData, baseline_env: dict[str, Any] | None) -> list[dict[str, Any]]:
    current = data.env
    base = (baseline_env or {}).get("env") or {}
    keys = list(current) + [k for k in base if k not in current]
    return [{"key": k, "value": current.get(k), "baseline": base.get(k) if baseline_env else None,
             "differs": bool(baseline_env) and current.get(k) != base.get(k)} for k in keys]


def render_html(data: RunData, table: pd.DataFrame, path: Path, *, drift: DriftResult | None = None,
                baseline_name: str | None = None, baseline_env: dict[str, Any] | None = None,
                mutants: MutantReport | None = None) -> Path:
    """Write the report page to ``path``."""
    cases = case_summary(data, table, drift)
    classes = class_summary(table).merge(class_cases(table), on="tensor_class", how="left")
    groups = coverage(data.cases)
    context = {
        "run": data.run, "run_id": data.run_id, "counts": data.counts, "total": len(data.cases),
        "complete": data.complete, "warnings": data.warnings, "end": data.end or {},
        "generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "classes": classes.to_dict("records"), "cases": cases.to_dict("records"),
        "outcomes": [o for o in OUTCOMES if o in data.counts],
        "topk": topk_regimes(data), "plans": plan_counts(data).to_dict("records"),
        "has_drift": drift is not None,
        "details_json": _json_for_script(_case_details(data, table)),
        "plots": {"tensors": plots.tensor_distributions(table, data.metrics),
                  "nfr": plots.noise_floor_histograms(table, data.metrics)},
        "coverage": groups, "coverage_gaps": gaps(groups), "failing": _failing(data, table),
        "n_failing": int(data.cases["outcome"].isin(["fail", "error"]).sum()), "max_failing": MAX_FAILING,
        "drift": _drift_context(drift, baseline_name, baseline_env or {}),
        "mutants": None if mutants is None else {"counts": mutants.counts,
                                                 "rows": mutants.mutants.to_dict("records"),
                                                 "tensors": list(mutants.matrix.columns),
                                                 "matrix": mutants.matrix.to_dict("index")},
        "env": _env_rows(data, baseline_env if drift is not None else None),
        "css": (TEMPLATES / "report.css").read_text(), "js": (TEMPLATES / "report.js").read_text(),
    }
    html = _environment().get_template("report.html.j2").render(**context)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    return path
