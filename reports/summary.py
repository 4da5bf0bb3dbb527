"""Aggregates every view shows: per tensor class, per case, and the worst offenders.

All inputs are the metrics table of :mod:`reports.table` (one row per case × tensor) and the case frame of
:mod:`reports.load`; nothing here formats text.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from cases.vocabulary import OUTCOMES, TENSOR_CLASSES

from .drift import DriftResult
from .load import RunData

SEVERITY = {"fail": 0, "error": 1, "unsupported": 4, "pass": 3, "known": 2}


def _class_key(series: pd.Series) -> pd.Series:
    order = {name: i for i, name in enumerate(TENSOR_CLASSES)}
    return series.map(lambda c: order.get(c, len(order)))


def class_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per tensor class: tensors / pass / fail counts, cases, failing cases, p50 and max of ``max_rel`` and of the
    noise-floor ratio, and the worst tolerance usage."""
    rows = table.loc[table["tensor"] != ""]
    columns = ["tensor_class", "tensors", "pass", "fail", "cases", "failing_cases", "max_rel_p50", "max_rel_max",
               "nfr_p50", "nfr_max", "worst_usage"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    grouped = rows.groupby("tensor_class", sort=False)
    out = pd.DataFrame({
        "tensors": grouped.size(),
        "pass": grouped["verdict"].agg(lambda v: int((v == "pass").sum())),
        "fail": grouped["verdict"].agg(lambda v: int((v == "fail").sum())),
        "cases": grouped["case_id"].nunique(),
        "failing_cases": grouped.apply(lambda g: g.loc[g["verdict"] == "fail", "case_id"].nunique(),
                                       include_groups=False),
        "max_rel_p50": grouped["max_rel"].median(),
        "max_rel_max": grouped["max_rel"].max(),
        "nfr_p50": grouped["noise_floor_ratio"].median(),
        "nfr_max": grouped["noise_floor_ratio"].max(),
        "worst_usage": grouped["worst_usage"].max(),
    }).reset_index()
    return out.sort_values("tensor_class", key=_class_key, kind="stable").reset_index(drop=True)[columns]


def class_cases(table: pd.DataFrame) -> pd.DataFrame:
    """Per tensor class, what failed *in that class* (the "Tensors by class" table): ``cases_pass`` = cases whose
    tensors of the class all pass; ``cases_fail`` = failed cases (outcome ``fail``) with a failing tensor of the
    class; ``cases_known`` = cases of a registered known deviation with a failing tensor of the class. A case that
    failed on one class counts as passing in every other class it holds."""
    rows = table.loc[table["tensor"] != "", ["case_id", "tensor_class", "outcome", "verdict"]]
    columns = ["tensor_class", "cases_pass", "cases_fail", "cases_known"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    failed = rows.assign(failed=rows["verdict"] == "fail").groupby(["tensor_class", "case_id"], sort=False).agg(
        failed=("failed", "any"), outcome=("outcome", "first")).reset_index()
    grouped = failed.groupby("tensor_class", sort=False)
    out = pd.DataFrame({
        "cases_pass": grouped["failed"].agg(lambda f: int((~f).sum())),
        "cases_fail": grouped.apply(lambda g: int((g["failed"] & (g["outcome"] == "fail")).sum()),
                                    include_groups=False),
        "cases_known": grouped.apply(lambda g: int((g["failed"] & (g["outcome"] == "known")).sum()),
                                     include_groups=False),
    }).reset_index()
    return out.sort_values("tensor_class", key=_class_key, kind="stable").reset_index(drop=True)[columns]


def outcome_by_class(data: RunData, table: pd.DataFrame) -> pd.DataFrame:
    """Cross-tab: rows tensor class, columns case outcome, cells = cases of that outcome having that class."""
    rows = table.loc[table["tensor"] != "", ["case_id", "tensor_class", "outcome"]].drop_duplicates()
    cross = pd.crosstab(rows["tensor_class"], rows["outcome"]).reindex(columns=list(OUTCOMES), fill_value=0)
    cross = cross.reset_index()
    return cross.sort_values("tensor_class", key=_class_key, kind="stable").reset_index(drop=True)


def case_summary(data: RunData, table: pd.DataFrame, drift: DriftResult | None = None) -> pd.DataFrame:
    """One row per case (stream order): the case columns plus ``tensors``, ``failed``, ``worst_tensor``,
    ``worst_metric``, ``worst_usage``, ``nfr_max``, ``max_rel_max`` and (with a baseline) ``drift_max``."""
    rows = table.loc[table["tensor"] != ""]
    grouped = rows.groupby("case_id", sort=False)
    per_case = pd.DataFrame({
        "tensors": grouped.size(),
        "failed": grouped["verdict"].agg(lambda v: int((v == "fail").sum())),
        "nfr_max": grouped["noise_floor_ratio"].max(),
        "max_rel_max": grouped["max_rel"].max(),
    })
    scored = rows.dropna(subset=["worst_usage"])
    if len(scored):
        worst = scored.loc[scored.groupby("case_id", sort=False)["worst_usage"].idxmax(),
                           ["case_id", "tensor", "worst_metric", "worst_usage"]].set_index("case_id")
        per_case = per_case.join(worst.rename(columns={"tensor": "worst_tensor"}))
    else:
        per_case = per_case.assign(worst_tensor=None, worst_metric=None, worst_usage=np.nan)
    if drift is not None and len(drift.pairs):
        per_case = per_case.join(drift.pairs.groupby("case_id")["ratio"].max().rename("drift_max"))
    else:
        per_case["drift_max"] = np.nan
    cases = data.cases.drop(columns=["case"]).set_index("case_id")
    out = cases.join(per_case, how="left")
    out["tensors"] = out["tensors"].fillna(0).astype(int)
    out["failed"] = out["failed"].fillna(0).astype(int)
    return out.reset_index()


def offenders(data: RunData, table: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The ``n`` worst cases, one row each at its worst tensor: failing cases first (by tolerance usage), then
    errored ones, then the passing cases closest to a threshold. Columns: ``case_id``, ``outcome``, ``tensor``,
    ``worst_metric``, ``value``, ``threshold``, ``worst_usage``, ``message``, ``repro``."""
    summary = case_summary(data, table)
    summary = summary.loc[summary["outcome"] != "unsupported"].copy()
    summary["_sev"] = summary["outcome"].map(SEVERITY)
    summary["_usage"] = summary["worst_usage"].fillna(-1.0)
    ranked = summary.sort_values(["_sev", "_usage"], ascending=[True, False], kind="stable").head(n)
    metrics = data.metrics.set_index(["case_id", "tensor", "metric"])
    values, thresholds = [], []
    for case_id, tensor, metric in zip(ranked["case_id"], ranked["worst_tensor"], ranked["worst_metric"]):
        key = (case_id, tensor, metric)
        if isinstance(metric, str) and key in metrics.index:
            row = metrics.loc[key]
            values.append(float(row["value"]))
            thresholds.append(float(row["threshold"]))
        else:
            values.append(np.nan)
            thresholds.append(np.nan)
    ranked = ranked.assign(tensor=ranked["worst_tensor"], value=values, threshold=thresholds)
    return ranked[["case_id", "outcome", "tensor", "worst_metric", "value", "threshold", "worst_usage", "message",
                   "repro"]].reset_index(drop=True)


def topk_regimes(data: RunData) -> dict[str, int] | None:
    """Rows of the top-k comparison per regime, summed over the cases that have one (spec parity-anchors §12):
    ``clear`` rows must match as sets, ``tied`` rows were compared by gathered values. None without top-k."""
    found = [t for t in data.cases["topk"] if isinstance(t, dict)]
    if not found:
        return None
    totals = {key: int(sum(t.get(key) or 0 for t in found)) for key in ("rows", "clear", "tied")}
    totals["cases"] = len(found)
    return totals


def plan_counts(data: RunData) -> pd.DataFrame:
    """Cases per (stage, provider) from the ``plan`` dicts: which kernels actually ran (silent fallbacks show)."""
    pairs = [(stage, str(provider)) for plan in data.cases["plan"] for stage, provider in (plan or {}).items()]
    if not pairs:
        return pd.DataFrame(columns=["stage", "provider", "cases"])
    frame = pd.DataFrame(pairs, columns=["stage", "provider"])
    return frame.value_counts().rename("cases").reset_index().sort_values(["stage", "cases"],
                                                                          ascending=[True, False], kind="stable")
