"""Drift against a baseline and the relative-regression gate (``dsv4-parity compare``).

The statistic (documented for users in ``reports/SCHEMA.md`` §Drift):

1. **Pairs.** Current and baseline rows are matched on ``(case_id, tensor)`` (``case_id`` hashes the whole case, so a
   pair is the same computation). Pairs where either side lacks the gate metric (``topk_indices`` has no error
   metric) or is NaN are skipped.
2. **Floored ratio per pair.** ``ratio = max(cur, floor) / max(base, floor)``. The default metric is the engine's
   gating metric, ``noise_floor_ratio`` (kernel error / the same-dtype reference's error + ulp floor): it is
   normalised per case, so pairs of every dtype and scale are comparable, and drift in it is drift toward the
   threshold. Its floor is ``ratio_floor`` (default 0.25: moves far below the reference's own noise are not
   regressions). For the dtype-scaled metrics (``max_rel``, ``rel_l2``, ``max_abs``, ``rmse``) the floor is
   ``floor_ulps * eps(dtype)`` with ``eps`` of the tensor's own dtype (2**-52 float64, 2**-7 bfloat16) and
   ``floor_ulps`` 4 for the element-wise maxima, 0.25 for the RMS aggregates (:data:`FLOOR_ULPS`), so a float64
   error moving from 1e-16 to 3e-16 — rounding noise — is not a 3x regression. The floor also removes 0/0.
   (``max_rel`` is heavy-tailed — it divides by elements down to 1e-3 of the tensor's largest — which is why it is
   not the default.)
3. **Per tensor class**, the ``statistic`` of the pair ratios: ``p90`` by default (``median``, ``max`` or ``pNN``).
   p90 ignores a few noisy pairs yet still sees a regression confined to a tenth of the class (one layout, one
   ratio); the median and max are reported beside it.
4. **Gate.** A class is a *regression* when its statistic exceeds ``factor`` (default 2, per-class overrides in
   ``factors``) and an *improvement* when it is below ``1/factor``. ``compare`` also fails on *new failures*: a
   (case, tensor) whose verdict went pass -> fail, or a case whose outcome went pass -> fail/error. A gate that
   matched no pair at all fails: it compared nothing (a baseline of another suite, or one without readable values of
   the metric).
5. **Coverage** (:mod:`reports.coverage_gate`). The gate fails when the run did less than its baseline: a case the
   baseline ran (pass / known / fail) is now unsupported or absent, a tensor the baseline compared is missing, or a
   new unsupported reason appears. Cases and tensors only the run has are counted, never gated (suites grow).

Absolute tolerances are not consulted: a class can regress while every tensor still passes — that is the point.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd

from cases.vocabulary import TENSOR_CLASSES

from .coverage_gate import Coverage, coverage_against
from .errors import ReportError
from .schema import DRIFT_METRICS, dtype_eps

KEY = ["case_id", "tensor"]
#: Default floors in ulps: element-wise maxima of a correct kernel sit at a few ulps, RMS aggregates below one.
FLOOR_ULPS = {"max_rel": 4.0, "max_abs": 4.0, "rel_l2": 0.25, "rmse": 0.25}
STATUS_ORDER = ("regression", "new failures", "improvement", "steady", "no pairs")


@dataclass(frozen=True)
class GateConfig:
    """The drift gate's parameters (CLI flags > the baseline's ``gate.json`` > these defaults)."""

    metric: str = "noise_floor_ratio"
    statistic: str = "p90"
    factor: float = 2.0
    floor_ulps: float | None = None  # None: FLOOR_ULPS[metric]
    ratio_floor: float = 0.25
    factors: Mapping[str, float] = field(default_factory=dict)

    def validate(self, where: str = "gate") -> "GateConfig":
        if self.metric not in DRIFT_METRICS:
            raise ReportError(f"{where}.metric", f"must be one of {', '.join(DRIFT_METRICS)}, got {self.metric!r}")
        quantile(self.statistic, where=f"{where}.statistic")
        for name, value in [("factor", self.factor), *((f"factors.{k}", v) for k, v in self.factors.items())]:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 1.0:
                raise ReportError(f"{where}.{name}", f"must be a number > 1, got {value!r}")
        for name in ("floor_ulps", "ratio_floor"):
            value = getattr(self, name)
            if name == "floor_ulps" and value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0.0:
                raise ReportError(f"{where}.{name}", f"must be a positive number, got {value!r}")
        unknown = sorted(set(self.factors) - set(TENSOR_CLASSES))
        if unknown:
            raise ReportError(f"{where}.factors.{unknown[0]}", f"unknown tensor class (known: {', '.join(TENSOR_CLASSES)})")
        return self

    def factor_for(self, tensor_class: str) -> float:
        return float(self.factors.get(tensor_class, self.factor))

    @property
    def ulps(self) -> float:
        """The floor in ulps for the dtype-scaled metrics (explicit, else :data:`FLOOR_ULPS` of the metric)."""
        return float(self.floor_ulps) if self.floor_ulps is not None else FLOOR_ULPS.get(self.metric, 4.0)

    def describe(self) -> str:
        floor = f"{self.ratio_floor:g}" if self.metric == "noise_floor_ratio" else f"{self.ulps:g} ulp"
        return (f"{self.statistic} over matched (case, tensor) pairs of current/baseline {self.metric} "
                f"(floor {floor}); regression when > {self.factor:g}x")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["factors"] = dict(self.factors)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "gate") -> "GateConfig":
        if not isinstance(data, Mapping):
            raise ReportError(where, "must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ReportError(f"{where}.{unknown[0]}", f"unknown gate setting (known: {', '.join(sorted(known))})")
        factors = data.get("factors", {})
        if not isinstance(factors, Mapping):
            raise ReportError(f"{where}.factors", "must be an object {tensor_class: factor}")
        return cls(**{**data, "factors": dict(factors)}).validate(where)

    def updated(self, **changes: Any) -> "GateConfig":
        changes = {k: v for k, v in changes.items() if v is not None}
        return type(self)(**{**self.to_dict(), **changes}).validate("option")


def quantile(statistic: str, where: str = "statistic") -> float:
    """``median`` -> 0.5, ``max`` -> 1.0, ``pNN`` -> NN/100."""
    if statistic == "median":
        return 0.5
    if statistic == "max":
        return 1.0
    match = re.fullmatch(r"p(\d{1,2}(?:\.\d+)?|100)", statistic)
    if not match:
        raise ReportError(where, f"must be 'median', 'max' or 'pNN' (e.g. p90), got {statistic!r}")
    return float(match.group(1)) / 100.0


@dataclass
class DriftResult:
    """``classes``: one row per tensor class; ``pairs``: every matched pair with its ratio; ``new_failures``;
    ``coverage``: what the run compared against what the baseline compared."""

    config: GateConfig
    classes: pd.DataFrame
    pairs: pd.DataFrame
    new_failures: pd.DataFrame
    only_current: int
    only_baseline: int
    coverage: Coverage

    @property
    def regressions(self) -> list[str]:
        return self.classes.loc[self.classes["status"] == "regression", "tensor_class"].tolist()

    @property
    def passed(self) -> bool:
        """No regression, no new failure, no coverage lost, and at least one pair compared (a gate that compared
        nothing fails)."""
        return not self.pairs.empty and not self.regressions and self.new_failures.empty and not self.coverage.lost

    def reasons(self) -> list[str]:
        """Why the gate failed, one phrase each (empty when it passed)."""
        found = []
        if self.coverage.lost:
            found.append(self.coverage.headline())
        if self.regressions:
            found.append(f"regressed: {', '.join(self.regressions)}")
        if len(self.new_failures):
            found.append(f"{len(self.new_failures)} new failure(s)")
        if self.pairs.empty:
            found.append("no (case, tensor) pair had the metric on both sides: nothing was compared")
        return found


def _floor(config: GateConfig, dtypes: pd.Series) -> np.ndarray:
    if config.metric == "noise_floor_ratio":
        return np.full(len(dtypes), config.ratio_floor)
    return config.ulps * np.array([dtype_eps(d) for d in dtypes], dtype=float)


def _class_order(name: str) -> tuple[int, str]:
    return (TENSOR_CLASSES.index(name) if name in TENSOR_CLASSES else len(TENSOR_CLASSES), name)


def compare_tables(current: pd.DataFrame, baseline: pd.DataFrame, config: GateConfig = GateConfig(), *,
                   reasons: Mapping[str, str] | None = None,
                   baseline_reasons: Mapping[str, int] | None = None,
                   incomplete: list[str] | None = None, other: list[str] | None = None) -> DriftResult:
    """Drift of ``current`` against ``baseline`` (both metrics tables, :mod:`reports.table` schema). ``reasons`` /
    ``baseline_reasons``: the unsupported reasons of the run's cases and the baseline's counts; ``incomplete``: how
    the run is unfinished and ``other`` how it did other work than the baseline
    (:func:`reports.coverage_gate.coverage_against`)."""
    config.validate()
    metric = config.metric
    cur = current.loc[current["tensor"].astype(str) != ""]
    base = baseline.loc[baseline["tensor"].astype(str) != ""]
    if metric not in cur.columns:
        cur = cur.assign(**{metric: np.nan})
    if metric not in base.columns:
        raise ReportError("baseline", f"has no {metric!r} column: nothing to compare (a metrics table of another "
                                      "schema, or cut columns); refresh it with `dsv4-parity compare --update`")
    merged = cur[KEY + ["tensor_class", "dtype", "verdict", "outcome", metric]].merge(
        base[KEY + ["dtype", "verdict", "outcome", metric]], on=KEY, how="outer", suffixes=("", "_base"),
        indicator=True)
    both = merged.loc[merged["_merge"] == "both"].copy()
    only_current = int((merged["_merge"] == "left_only").sum())
    only_baseline = int((merged["_merge"] == "right_only").sum())

    both["dtype"] = both["dtype"].where(both["dtype"].notna(), both["dtype_base"])
    valid = both[metric].notna() & both[f"{metric}_base"].notna()
    pairs = both.loc[valid, KEY + ["tensor_class", "dtype"]].copy()
    pairs["current"] = both.loc[valid, metric].astype(float)
    pairs["baseline"] = both.loc[valid, f"{metric}_base"].astype(float)
    pairs["floor"] = _floor(config, pairs["dtype"])
    pairs = pairs.loc[np.isfinite(pairs["floor"])]  # integer tensors: no meaningful error ratio
    pairs["ratio"] = np.maximum(pairs["current"], pairs["floor"]) / np.maximum(pairs["baseline"], pairs["floor"])
    # a gate-metric value no comparison can give (infinite, or a negative error ratio) is a broken comparison: its
    # ratio is +inf, a regression of its class (found by review: +inf values made the class statistic NaN, read as
    # steady, and a negative one clamped to the floor)
    broken = ~np.isfinite(pairs["current"]) | (pairs["current"] < 0)
    pairs.loc[broken, "ratio"] = math.inf
    pairs = pairs.reset_index(drop=True)

    q = quantile(config.statistic)
    rows = []
    with np.errstate(invalid="ignore"):  # quantiles across +inf ratios: NaN in the shown median / p90, quietly
        for klass in sorted(set(both["tensor_class"].dropna()) | set(pairs["tensor_class"]), key=_class_order):
            ratios = pairs.loc[pairs["tensor_class"] == klass, "ratio"].to_numpy()
            factor = config.factor_for(klass)
            if len(ratios) == 0:
                rows.append({"tensor_class": klass, "pairs": 0, "median": math.nan, "p90": math.nan, "max": math.nan,
                             "min": math.nan, "statistic": math.nan, "factor": factor, "status": "no pairs",
                             "worse": 0, "better": 0})
                continue
            stat = math.inf if not np.isfinite(ratios).all() else float(np.quantile(ratios, q))
            status = "regression" if stat > factor else "improvement" if stat < 1.0 / factor else "steady"
            rows.append({"tensor_class": klass, "pairs": int(len(ratios)), "median": float(np.median(ratios)),
                         "p90": float(np.quantile(ratios, 0.9)), "max": float(ratios.max()), "min": float(ratios.min()),
                         "statistic": stat, "factor": factor, "status": status,
                         "worse": int((ratios > factor).sum()), "better": int((ratios < 1.0 / factor).sum())})
    classes = pd.DataFrame(rows, columns=["tensor_class", "pairs", "median", "p90", "max", "min", "statistic",
                                          "factor", "status", "worse", "better"])
    return DriftResult(config=config, classes=classes, pairs=pairs,
                       new_failures=_new_failures(current, baseline, both), only_current=only_current,
                       only_baseline=only_baseline,
                       coverage=coverage_against(current, baseline, reasons=reasons,
                                                 baseline_reasons=baseline_reasons, metric=metric,
                                                 incomplete=incomplete, other=other))


def _new_failures(current: pd.DataFrame, baseline: pd.DataFrame, both: pd.DataFrame) -> pd.DataFrame:
    """Tensors that went pass -> fail, and cases that went pass -> fail/error/known or known -> fail/error (one row
    each). Tensors of a case whose outcome is ``known`` (a registered known deviation) are not new failures, but the
    case is when the baseline passed it: the deviation came back, or a new bug has its shape (found by review: the
    drift gate read pass -> known as no change, and known -> fail as an improvement)."""
    columns = ["case_id", "tensor", "baseline", "current"]
    known = set(current.loc[current["outcome"] == "known", "case_id"]) if "outcome" in current else set()
    tensor_rows = both.loc[(both["verdict_base"] == "pass") & (both["verdict"] == "fail") &
                           ~both["case_id"].isin(known), KEY]
    found = [tensor_rows.assign(baseline="pass", current="fail")]
    cur_outcome = current.drop_duplicates("case_id").set_index("case_id")["outcome"]
    base_outcome = baseline.drop_duplicates("case_id").set_index("case_id")["outcome"]
    joined = pd.concat([base_outcome.rename("baseline"), cur_outcome.rename("current")], axis=1, join="inner")
    worse = joined.loc[((joined["baseline"] == "pass") & joined["current"].isin(["fail", "error", "known"]))
                       | ((joined["baseline"] == "known") & joined["current"].isin(["fail", "error"]))]
    worse = worse.loc[~worse.index.isin(tensor_rows["case_id"])]  # already listed by tensor
    found.append(worse.reset_index(names="case_id").assign(tensor=""))
    # a case the baseline does not hold that fails or errors is a new failure too (found by review: `compare` passed
    # a run whose only failure was a case new to it)
    new = cur_outcome.loc[~cur_outcome.index.isin(base_outcome.index) & cur_outcome.isin(["fail", "error"])]
    found.append(pd.DataFrame({"case_id": new.index, "current": new.to_numpy(), "baseline": "(new case)",
                               "tensor": ""}))
    return pd.concat(found, ignore_index=True)[columns]
