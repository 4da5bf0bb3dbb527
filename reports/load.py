"""Read a ``results.jsonl`` stream (schema: ``ARCHITECTURE.md``) into three pandas frames.

* ``cases``   — one row per case: ``case_id``, ``outcome``, ``decided_by``, ``first_failure`` (dict or None),
  ``message``, ``duration_s``, ``repro``, ``features`` (dict), ``plan`` (dict), ``topk`` (dict or None), ``case``
  (the case JSON object), and columns derived from the case JSON: ``case_dtype``, ``layout`` (``bshd``/``thd``),
  ``compress_ratio``, ``scope``, ``training``, ``profile``, ``tags`` (``;``-joined). Stream order.
* ``tensors`` — one row per (case, tensor): ``case_id``, ``tensor``, ``tensor_class``, ``dtype``, ``shape`` (``"2x16x64"``,
  ``""`` for a scalar), ``verdict``, ``rule``.
* ``metrics`` — one row per (case, tensor, metric): ``case_id``, ``tensor``, ``tensor_class``, ``metric``, ``value``
  (float; NaN for null), ``threshold`` (float or NaN), ``passed`` (True/False/None), ``usage`` (see
  :func:`reports.schema.usage`).

A stream that is still being written (or was cut) is readable: a torn last line is skipped, tensor / metric rows of a
case whose ``case`` row never came are dropped, and ``RunData.complete`` is False without an ``end`` row, or when that
row lists cases ``--budget-s`` left unstarted (:func:`ended_complete`). Each such repair is listed in
``RunData.warnings``. Anything else malformed raises :class:`ReportError` naming file:line and
field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from cases.vocabulary import OUTCOMES, TENSOR_CLASSES, outcome_counts

from .errors import ReportError
from .schema import usage_array

RESULTS_NAME = "results.jsonl"
REQUIRED = {
    "run": ("run_id",),
    "case": ("case_id", "outcome"),
    "tensor": ("case_id", "tensor", "tensor_class"),
    "metric": ("case_id", "tensor", "metric", "value"),
    "end": (),
    "resume": ("changed",),
}
CASE_FRAME_COLUMNS = ("case_id", "outcome", "decided_by", "first_failure", "message", "duration_s", "repro",
                      "features", "plan", "topk", "case", "case_dtype", "layout", "compress_ratio", "scope",
                      "training", "profile", "tags")
TENSOR_FRAME_COLUMNS = ("case_id", "tensor", "tensor_class", "dtype", "shape", "verdict", "rule")
METRIC_FRAME_COLUMNS = ("case_id", "tensor", "tensor_class", "metric", "value", "threshold", "passed", "usage")


@dataclass
class RunData:
    """One parsed run. ``run`` and ``end`` are the raw ``run`` / ``end`` rows (``end`` None while running)."""

    path: Path
    run: dict[str, Any]
    cases: pd.DataFrame
    tensors: pd.DataFrame
    metrics: pd.DataFrame
    end: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    #: ids of the cases cut off: fewer tensor + metric rows than their case row's ``n_rows`` (killed, a full disk)
    cut: list[str] = field(default_factory=list)
    #: ``resume`` rows: a ``--resume`` under another environment than the run row's (``changed``: key ->
    #: [recorded, then]), so the run mixes cases of two
    resumes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return str(self.run.get("run_id", ""))

    @property
    def env(self) -> dict[str, Any]:
        env = self.run.get("env")
        return env if isinstance(env, dict) else {}

    @property
    def complete(self) -> bool:
        return ended_complete(self.end)

    def incompleteness(self) -> list[str]:
        """One phrase per way the run is unfinished or its rows contradict each other (empty for a whole,
        consistent run): no ``end`` row, cases ``--budget-s`` left unstarted, cases cut off mid-write (:attr:`cut`),
        planned cases (the run row's ``planned``) never reported, a case recorded as ``pass`` with a failing tensor,
        tensor verdicts other than ``pass`` / ``fail`` (the engine writes no other; found by review: the drift gate
        passed all four of the last), a resume under another environment (:attr:`resumes`: code or libraries the
        earlier cases did not run under)."""
        found = []
        for row in self.resumes:
            changed = row.get("changed") if isinstance(row.get("changed"), dict) else {}
            what = ", ".join(f"{k} {v[0]} -> {v[1]}" if isinstance(v, list) and len(v) == 2 else str(k)
                             for k, v in changed.items())
            found.append(f"resumed under another environment ({what or 'unspecified'}) after {row.get('done', '?')} "
                         f"case(s): the run mixes cases of both")
        if self.end is None:
            found.append("no end row (killed or cut)")
        elif not self.complete:
            found.append(f"{len(self.end.get('not_run') or [])} case(s) not run (--budget-s)")
        if self.cut:
            found.append(f"{len(self.cut)} case(s) cut off (fewer rows than their case row records), e.g. "
                         f"{self.cut[0]}")
        planned = self.run.get("planned")
        if self.end is not None and isinstance(planned, list):
            said = set(self.cases["case_id"]) | set(self.cut) | {str(c) for c in self.end.get("not_run") or []}
            never = [str(c) for c in planned if str(c) not in said]
            if never:
                found.append(f"{len(never)} planned case(s) never reported, e.g. {never[0]}")
        failing = set(self.tensors.loc[self.tensors["verdict"] == "fail", "case_id"])
        contradicted = sorted(failing & set(self.cases.loc[self.cases["outcome"] == "pass", "case_id"]))
        if contradicted:
            found.append(f"{len(contradicted)} case(s) recorded as pass with a failing tensor, e.g. {contradicted[0]}")
        verdicts = self.tensors["verdict"].dropna()
        odd = verdicts.loc[~verdicts.isin(["pass", "fail"])]
        if len(odd):
            found.append(f"{len(odd)} tensor verdict(s) neither pass nor fail (e.g. {str(odd.iloc[0])!r})")
        return found

    @property
    def counts(self) -> dict[str, int]:
        """Case outcomes counted from the case rows (the ``end`` row's counts are only cross-checked)."""
        return outcome_counts(self.cases["outcome"].value_counts())

    @property
    def directory(self) -> Path:
        return self.path.parent


def resolve_results(run: str | Path, out_root: Path | None = None) -> Path:
    """``results.jsonl`` of ``run``: a results file, a run directory, or a run id under ``out_root``."""
    candidates = [Path(run)]
    if out_root is not None:
        candidates.append(out_root / str(run))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
        if (candidate / RESULTS_NAME).is_file():
            return candidate / RESULTS_NAME
    tried = " or ".join(str(c) for c in candidates)
    raise ReportError("run", f"no {RESULTS_NAME} found at {tried}")


def _float(value: Any, where: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(where, f"must be a number or null, got {value!r}")
    return float(value)


def _mapping(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _shape(value: Any) -> str:
    if isinstance(value, list):
        return "x".join(map(str, value))
    return "" if value is None else str(value)


def _case_columns(case: Any) -> dict[str, Any]:
    """Columns derived from the case JSON object (tolerant: an absent field gives None)."""
    case = case if isinstance(case, dict) else {}
    config = case.get("config") if isinstance(case.get("config"), dict) else {}
    layout = case.get("layout") if isinstance(case.get("layout"), dict) else {}
    tags = case.get("tags") if isinstance(case.get("tags"), list) else []
    return {"case_dtype": case.get("dtype"), "layout": layout.get("kind"),
            "compress_ratio": config.get("compress_ratio"), "scope": case.get("scope"),
            "training": case.get("training"), "profile": case.get("profile"),
            "tags": ";".join(str(t) for t in tags)}


def _usage(columns: dict[str, list[Any]]) -> np.ndarray:
    """Tolerance usage per metric row; a metric the engine marked failed uses at least its whole tolerance (its
    verdict wins over the direction :func:`reports.schema.usage` infers from the metric name)."""
    value = np.asarray(columns["value"], dtype=float)
    threshold = np.asarray(columns["threshold"], dtype=float)
    used = usage_array(np.asarray(columns["metric"], dtype=object), value, threshold)
    failed = np.array([p is False for p in columns["passed"]], dtype=bool)
    return np.where(failed, np.fmax(used, 1.0), used)


def read_rows(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """Parsed ``(line number, row)`` pairs and the warnings of the repairs (a torn last line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ReportError(str(path), f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ReportError(str(path), f"not a results stream: binary or not UTF-8 text (byte {exc.start})") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    try:  # fast path: one decode for the whole stream; per line only to locate a problem
        parsed = json.loads("[" + ",".join(line for _, line in numbered) + "]")
        if all(isinstance(row, dict) for row in parsed):
            return [(lineno, row) for (lineno, _), row in zip(numbered, parsed)], []
    except json.JSONDecodeError:
        pass
    rows, warnings = [], []
    for index, (lineno, line) in enumerate(numbered):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if index == len(numbered) - 1:
                warnings.append(f"{path.name}:{lineno}: torn last line skipped (run still writing or cut)")
                break
            raise ReportError(f"{path.name}:{lineno}", f"not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path.name}:{lineno}", f"must be a JSON object, got {type(row).__name__}")
        rows.append((lineno, row))
    return rows, warnings


def cut_cases(rows: list[tuple[int, dict[str, Any]]]) -> list[str]:
    """Case ids (stream order) whose last report has fewer or more tensor and metric rows after it than its case row
    records (``n_rows``): cut off by a kill or a full disk. ``rows`` as :func:`read_rows` gives them."""
    declared: dict[str, int] = {}  # case_id -> n_rows of its (last) case row
    counted: dict[str, int] = {}  # case_id -> tensor + metric rows seen since it
    for _, row in rows:
        kind = row.get("type")
        if kind in ("metric", "tensor"):
            counted[str(row.get("case_id"))] = counted.get(str(row.get("case_id")), 0) + 1
        elif kind == "case" and isinstance(row.get("n_rows"), int):
            declared[str(row.get("case_id"))] = row["n_rows"]
            counted[str(row.get("case_id"))] = 0
    return [cid for cid, n in declared.items() if counted.get(cid, 0) != n]


def peek_run(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The ``run`` row (first line) and the ``end`` row (last line, or None) without parsing the whole stream."""
    with path.open("rb") as handle:
        first = handle.readline()
        handle.seek(0, 2)
        size = handle.tell()
        handle.seek(max(0, size - 65536))
        tail = handle.read().splitlines()
    try:
        run = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        run = None
    if not isinstance(run, dict) or run.get("type") != "run":
        raise ReportError(f"{path.name}:1", "the first row is not a 'run' row: not a dsv4-parity results stream")
    last = next((line for line in reversed(tail) if line.strip()), b"")
    try:
        end = json.loads(last)
    except (json.JSONDecodeError, UnicodeDecodeError):
        end = None
    return run, end if isinstance(end, dict) and end.get("type") == "end" else None


def load_run(path: str | Path) -> RunData:
    """Parse one ``results.jsonl`` (or the run directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_NAME
    rows, warnings = read_rows(path)
    run_row: dict[str, Any] | None = None
    end_row: dict[str, Any] | None = None
    cases: dict[str, dict[str, Any]] = {}
    tensors: dict[tuple[str, str], dict[str, Any]] = {}
    metric_cols: dict[str, list[Any]] = {name: [] for name in METRIC_FRAME_COLUMNS}
    unknown_types: dict[str, int] = {}
    resumes: list[dict[str, Any]] = []
    superseded: dict[str, int] = {}  # case_id reported again -> index of its first metric row of the last report
    unknown_classes: set[str] = set()

    fname = path.name
    m_case, m_tensor, m_class, m_metric, m_value, m_threshold, m_passed = (
        metric_cols[c] for c in ("case_id", "tensor", "tensor_class", "metric", "value", "threshold", "passed"))
    for lineno, row in rows:
        kind = row.get("type")
        if kind not in REQUIRED:
            unknown_types[str(kind)] = unknown_types.get(str(kind), 0) + 1
            continue
        for name in REQUIRED[kind]:
            if name not in row:
                raise ReportError(f"{fname}:{lineno} field '{name}'", f"missing in a '{kind}' row")
        if kind == "metric":  # the hot loop: ~10 rows per tensor
            value, threshold, passed = row["value"], row.get("threshold"), row.get("passed")
            if type(value) is not float:
                value = _float(value, f"{fname}:{lineno} field 'value'")
            if type(threshold) is not float:
                threshold = _float(threshold, f"{fname}:{lineno} field 'threshold'")
            m_case.append(str(row["case_id"]))
            m_tensor.append(str(row["tensor"]))
            m_class.append(row.get("tensor_class"))
            m_metric.append(str(row["metric"]))
            m_value.append(value)
            m_threshold.append(threshold)
            m_passed.append(passed if passed is True or passed is False else None)
            continue
        where = f"{fname}:{lineno}"
        if kind == "tensor":
            klass = str(row["tensor_class"])
            if klass not in TENSOR_CLASSES:
                unknown_classes.add(klass)
            tensors[(str(row["case_id"]), str(row["tensor"]))] = {
                "case_id": str(row["case_id"]), "tensor": str(row["tensor"]), "tensor_class": klass,
                "dtype": row.get("dtype"), "shape": _shape(row.get("shape")), "verdict": row.get("verdict"),
                "rule": row.get("rule")}
        elif kind == "case":
            outcome = row["outcome"]
            if outcome not in OUTCOMES:
                raise ReportError(f"{where} field 'outcome'", f"must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
            case_id = str(row["case_id"])
            if case_id in cases:
                warnings.append(f"{where}: case {case_id} reported twice; the later report is used")
                del cases[case_id]  # keep stream order of the last report
                # and only its rows: the earlier report's tensors and metrics are not this report's
                for key in [k for k in tensors if k[0] == case_id]:
                    del tensors[key]
                superseded[case_id] = len(m_case)
            features = row.get("features")
            plan = row.get("plan")
            cases[case_id] = {
                "case_id": case_id, "outcome": outcome, "decided_by": row.get("decided_by"),
                "first_failure": _mapping(row.get("first_failure")), "message": str(row.get("message") or ""),
                "duration_s": _float(row.get("duration_s"), f"{where} field 'duration_s'"),
                "repro": str(row.get("repro") or ""), "features": features if isinstance(features, dict) else {},
                "plan": plan if isinstance(plan, dict) else {}, "topk": _mapping(row.get("topk")),
                "case": row.get("case"),
                **_case_columns(row.get("case"))}
        elif kind == "resume":
            resumes.append(row)
        elif kind == "run":
            if run_row is not None:
                warnings.append(f"{where}: a second 'run' row ignored (one run per stream)")
                continue
            run_row = row
        else:
            end_row = row

    if run_row is None:
        raise ReportError(path.name, "no 'run' row: not a dsv4-parity results stream")
    for kind, count in sorted(unknown_types.items()):
        warnings.append(f"{count} row(s) of unknown type {kind!r} ignored")
    cut = cut_cases(rows)
    if cut:
        warnings.append(f"{len(cut)} case(s) cut off (fewer rows than their case row records: killed or a full "
                        f"disk), e.g. {cut[0]}; `dsv4-parity run --out DIR --resume` re-runs them")
    if unknown_classes:
        warnings.append(f"unknown tensor class(es) {', '.join(sorted(unknown_classes))} (known: "
                        f"{', '.join(TENSOR_CLASSES)})")

    case_frame = pd.DataFrame(list(cases.values()), columns=list(CASE_FRAME_COLUMNS))
    tensor_frame = pd.DataFrame(list(tensors.values()), columns=list(TENSOR_FRAME_COLUMNS))
    metric_cols["usage"] = _usage(metric_cols)
    metric_frame = pd.DataFrame(metric_cols, columns=list(METRIC_FRAME_COLUMNS))
    if superseded:  # metric rows of a case's earlier reports
        since = metric_frame["case_id"].map(superseded)
        metric_frame = metric_frame.loc[since.isna() | (metric_frame.index >= since)].reset_index(drop=True)
    metric_frame = metric_frame.drop_duplicates(["case_id", "tensor", "metric"], keep="last")

    # Tensors named only by metric rows still get a tensor row (no verdict / rule).
    unnamed = {}
    for key in zip(metric_cols["case_id"], metric_cols["tensor"], metric_cols["tensor_class"]):
        if key[:2] not in tensors:
            unnamed.setdefault(key[:2], key)
    if unnamed:
        extra = pd.DataFrame(list(unnamed.values()), columns=["case_id", "tensor", "tensor_class"])
        tensor_frame = pd.concat([tensor_frame, extra.assign(dtype=None, shape="", verdict=None, rule=None)],
                                 ignore_index=True)
    # Rows of cases that never reported (a case still running when the stream was read) are dropped.
    orphan = ~tensor_frame["case_id"].isin(cases)
    if orphan.any():
        warnings.append(f"{int(orphan.sum())} tensor(s) of {tensor_frame.loc[orphan, 'case_id'].nunique()} case(s) "
                        f"without a 'case' row dropped (still running?)")
        tensor_frame = tensor_frame.loc[~orphan].reset_index(drop=True)
        metric_frame = metric_frame.loc[metric_frame["case_id"].isin(cases)].reset_index(drop=True)

    data = RunData(path=path, run=run_row, cases=case_frame, tensors=tensor_frame, metrics=metric_frame,
                   end=end_row, warnings=warnings, cut=[c for c in cut if c in cases], resumes=resumes)
    if end_row is None:
        warnings.append("no 'end' row: the run is still going or was cut; showing the cases so far")
    else:
        claimed = end_row.get("counts")
        if isinstance(claimed, dict) and any(int(claimed.get(o, 0) or 0) != n for o, n in data.counts.items()):
            warnings.append(f"the 'end' row counts {claimed} differ from the case rows {data.counts}")
    return data


def ended_complete(end: dict[str, Any] | None) -> bool:
    """A run with this ``end`` row (None: none came) ended and started every selected case (no ``not_run`` list
    from ``--budget-s``)."""
    return end is not None and not end.get("not_run")
