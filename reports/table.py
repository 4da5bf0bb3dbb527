"""The per-case per-tensor metrics table: ``results.csv`` and a baseline's ``metrics.csv`` (``reports/SCHEMA.md``).

One row per (case, tensor), in stream order; a case without tensor rows (``error`` / ``unsupported``, or a case that
failed before any comparison) keeps one row with an empty ``tensor``. Columns, in order:

    run_id, case_id, outcome, decided_by, case_dtype, layout, compress_ratio, scope, training, profile,
    tensor, tensor_class, dtype, shape, verdict, rule,
    max_abs, max_rel, rmse, rel_l2, cosine, tensor_sim, nan, inf, frac_outside, noise_floor_ratio, ref_error,
    worst_metric, worst_usage, failed_checks,
    <other metrics the engine emitted, alphabetically>

Metric cells hold the metric's value (empty when the engine did not emit it for that tensor). ``worst_usage`` is the
largest tolerance usage over the tensor's thresholded metrics (1.0 = at the threshold, see
:func:`reports.schema.usage`) and ``worst_metric`` the metric that reached it; ``failed_checks`` lists, ``;``-joined,
the metrics whose ``passed`` was false.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .errors import ReportError
from .load import RunData
from .schema import CASE_COLUMNS, CSV_COLUMNS, KNOWN_METRICS, TENSOR_COLUMNS

CSV_NAME = "results.csv"
KEY = ["case_id", "tensor"]
#: Columns read back as text (everything else in the schema is numeric, except ``training``: true/false/empty).
TEXT_COLUMNS = tuple(c for c in CASE_COLUMNS + TENSOR_COLUMNS + ("worst_metric", "failed_checks")
                     if c not in ("compress_ratio",))


def metrics_table(data: RunData) -> pd.DataFrame:
    """The wide table of one run (columns: :data:`reports.schema.CSV_COLUMNS` then extra metrics)."""
    metrics = data.metrics
    wide = metrics.pivot(index=KEY, columns="metric", values="value") if len(metrics) else pd.DataFrame()
    extras = sorted(set(wide.columns) - set(KNOWN_METRICS))
    wide = wide.reindex(columns=list(KNOWN_METRICS) + extras).reset_index() if len(metrics) else \
        pd.DataFrame(columns=KEY + list(KNOWN_METRICS))

    scored = metrics.dropna(subset=["usage"])
    if len(scored):
        worst = scored.loc[scored.groupby(KEY, sort=False)["usage"].idxmax(), KEY + ["metric", "usage"]]
        worst = worst.rename(columns={"metric": "worst_metric", "usage": "worst_usage"})
    else:
        worst = pd.DataFrame(columns=KEY + ["worst_metric", "worst_usage"])
    failing = metrics.loc[metrics["passed"].eq(False)]
    failed = (failing.groupby(KEY, sort=False)["metric"].agg(";".join).rename("failed_checks").reset_index()
              if len(failing) else pd.DataFrame(columns=KEY + ["failed_checks"]))

    tensors = data.tensors.copy()
    tensors["_order"] = np.arange(len(tensors))
    table = tensors.merge(wide, on=KEY, how="left").merge(worst, on=KEY, how="left").merge(failed, on=KEY, how="left")

    cases = data.cases.loc[:, [c for c in CASE_COLUMNS if c != "run_id"]].copy()
    cases["_case_order"] = np.arange(len(cases))
    table = cases.merge(table, on="case_id", how="left")  # a case without tensors keeps one row
    table = table.sort_values(["_case_order", "_order"], kind="stable", na_position="first")
    table["run_id"] = data.run_id
    table["tensor"] = table["tensor"].fillna("")
    table["failed_checks"] = table["failed_checks"].fillna("")
    table["worst_usage"] = pd.to_numeric(table["worst_usage"], errors="coerce")
    return table.loc[:, list(CSV_COLUMNS) + extras].reset_index(drop=True)


def write_csv(table: pd.DataFrame, path: Path) -> Path:
    """Write a metrics table; floats keep full precision (``repr``) so a baseline round-trips exactly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False, lineterminator="\n")
    return path


def read_csv(path: Path) -> pd.DataFrame:
    """Read a metrics table back (``results.csv`` or a baseline ``metrics.csv``); ids stay text.

    Refused with a :class:`ReportError` saying why: an unreadable or binary file, a file cut off mid-line (no final
    newline), a header without the key columns, and a metric cell that is not a number."""
    try:
        raw = Path(path).read_bytes()
        raw.decode("utf-8")
    except OSError as exc:
        raise ReportError(str(path), f"cannot read the metrics CSV: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ReportError(str(path), "not a metrics CSV: binary or not UTF-8 text") from None
    if raw and not raw.endswith(b"\n"):
        raise ReportError(str(path), "truncated: the last line is cut off (no final newline)")
    try:
        header = pd.read_csv(path, nrows=0).columns
    except (ValueError, pd.errors.EmptyDataError) as exc:
        raise ReportError(str(path), f"cannot read the metrics CSV: {exc}") from None
    missing = [c for c in ("case_id", "tensor", "tensor_class", "dtype", "verdict") if c not in header]
    if missing:
        raise ReportError(str(path), f"not a metrics CSV: column {missing[0]!r} missing (schema: reports/SCHEMA.md)")
    text = {c: str for c in header if c in TEXT_COLUMNS}
    try:
        table = pd.read_csv(path, dtype=text, keep_default_na=False,
                            na_values={c: [""] for c in header if c not in text})
    except ValueError as exc:  # pandas' ParserError: rows with too many fields, ...
        raise ReportError(str(path), f"not a well-formed metrics CSV: {str(exc).strip()}") from None
    for column in table.columns:
        if column not in text and column != "training":
            numbers = pd.to_numeric(table[column], errors="coerce")
            bad = numbers.isna() & table[column].notna()
            if bad.any():
                line = int(bad.to_numpy().nonzero()[0][0]) + 2  # 1-based, after the header
                raise ReportError(f"{path}:{line} column {column!r}",
                                  f"not a number: {table[column][bad].iloc[0]!r}")
            table[column] = numbers
    return table


__all__ = ["CSV_NAME", "metrics_table", "read_csv", "write_csv"]
