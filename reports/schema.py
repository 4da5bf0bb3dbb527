"""Names shared by every view: row types of ``results.jsonl``, metrics and the CSV column schema (outcomes and
tensor classes: :mod:`cases.vocabulary`).

The CSV schema (``results.csv`` and a baseline's ``metrics.csv``) is documented in ``reports/SCHEMA.md``; the column
order below is that schema, version :data:`CSV_SCHEMA_VERSION`. Adding a column at the end is a minor change;
renaming, removing or reordering one bumps the version.
"""

from __future__ import annotations

import math

ROW_TYPES = ("run", "case", "tensor", "metric", "end")
VERDICTS = ("pass", "fail")

#: Metrics with a fixed CSV column, in column order. Other metrics the engine emits follow them alphabetically.
KNOWN_METRICS = ("max_abs", "max_rel", "rmse", "rel_l2", "cosine", "tensor_sim", "nan", "inf", "frac_outside",
                 "noise_floor_ratio", "ref_error")
#: Similarity metrics: the threshold is a floor (value >= threshold passes). Every other metric is an error
#: (value <= threshold passes).
HIGHER_IS_BETTER = frozenset({"cosine", "tensor_sim"})
#: Error metrics the drift gate may compare (lower is better, scale-free enough to take ratios of).
DRIFT_METRICS = ("noise_floor_ratio", "max_rel", "rel_l2", "max_abs", "rmse")

CSV_SCHEMA_VERSION = 1
CASE_COLUMNS = ("run_id", "case_id", "outcome", "decided_by", "case_dtype", "layout", "compress_ratio", "scope",
                "training", "profile")
TENSOR_COLUMNS = ("tensor", "tensor_class", "dtype", "shape", "verdict", "rule")
SUMMARY_COLUMNS = ("worst_metric", "worst_usage", "failed_checks")
CSV_COLUMNS = CASE_COLUMNS + TENSOR_COLUMNS + KNOWN_METRICS + SUMMARY_COLUMNS

#: Machine epsilon (spacing of 1.0) per dtype name; the drift floor is a multiple of it.
DTYPE_EPS = {
    "float64": 2.0 ** -52,
    "float32": 2.0 ** -23,
    "tfloat32": 2.0 ** -10,
    "bfloat16": 2.0 ** -7,
    "float16": 2.0 ** -10,
    "float8_e4m3fn": 2.0 ** -3,
    "float8_e5m2": 2.0 ** -2,
}


def dtype_eps(name: object) -> float:
    """Epsilon of a dtype name (``"float32"``, ``"torch.bfloat16"``); NaN for integer / unknown dtypes."""
    if not isinstance(name, str):
        return math.nan
    return DTYPE_EPS.get(name.removeprefix("torch."), math.nan)


def usage(metric: str, value: float, threshold: float | None) -> float:
    """How much of its tolerance a metric uses: 0 = perfect, 1 = exactly at the threshold, > 1 = outside.

    Error metrics: ``value / threshold``. Similarity metrics (:data:`HIGHER_IS_BETTER`): ``(1 - value) /
    (1 - threshold)``. NaN when there is no threshold; a zero allowance gives 0 if met exactly, else inf.
    """
    if threshold is None or value is None or math.isnan(threshold):
        return math.nan
    if math.isnan(value):
        return math.inf
    if metric in HIGHER_IS_BETTER:
        spent, allowed = 1.0 - value, 1.0 - threshold
    else:
        spent, allowed = value, threshold
    if allowed <= 0.0:
        return 0.0 if spent <= 0.0 else math.inf
    return max(spent, 0.0) / allowed


def usage_array(metric: "np.ndarray", value: "np.ndarray", threshold: "np.ndarray") -> "np.ndarray":
    """Vectorised :func:`usage` over metric rows (``metric`` names, float ``value`` / ``threshold``, NaN = none)."""
    import numpy as np  # here, not at the top: the command line reads this module's names before anything heavy

    similar = np.isin(metric, list(HIGHER_IS_BETTER))
    spent = np.where(similar, 1.0 - value, value)
    allowed = np.where(similar, 1.0 - threshold, threshold)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.maximum(spent, 0.0) / allowed
    out = np.where(allowed <= 0.0, np.where(spent <= 0.0, 0.0, np.inf), out)
    out = np.where(np.isnan(value), np.inf, out)
    return np.where(np.isnan(threshold), np.nan, out)


