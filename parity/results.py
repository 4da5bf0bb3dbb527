"""The results stream ``results.jsonl`` (schema: ARCHITECTURE.md "Results stream"): rows, writer, resume.

One case's rows (``case``, then its ``tensor`` rows, then their ``metric`` rows) are appended in a single
``write`` and flushed to disk, so a run killed at any moment leaves whole cases behind. :func:`read_for_resume`
drops a torn last line, the rows of a case whose ``case`` row never arrived and the closing ``end`` row, and
returns the finished case ids; the run then appends to the same file.

Every line is strict JSON: a NaN metric value is written as ``null`` and ±inf as ±1.7976931348623157e308 (the
largest double), so any JSON reader accepts the stream and an infinite error still sorts as the worst.
Beyond the schema, the ``run`` row also carries ``options`` (the engine options), and metric rows may carry
metrics outside the fixed list (``ulp_floor``, ``rmse_ratio``, ``scale_ratio``, ``ref_cosine``, top-k row counts...).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from cases.case import Case

OUTCOMES = ("pass", "fail", "error", "unsupported", "known")
FLOAT_MAX = 1.7976931348623157e308


def _num(x: Any) -> Any:
    """Strict-JSON number: NaN becomes null, ±inf the largest finite float (±1.7976931348623157e308)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else math.copysign(FLOAT_MAX, x)
    return x


@dataclass
class CaseResult:
    """Everything the engine concluded about one case."""

    case: Case
    outcome: str
    decided_by: str
    first_failure: Optional[dict] = None
    message: str = ""
    duration_s: float = 0.0
    phases_s: dict = field(default_factory=dict)  # seconds: materialize / impl / reference / compare
    repro: str = ""
    features: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)
    topk: Optional[dict] = None
    tensors: list = field(default_factory=list)  # verdict.TensorResult
    not_provided: dict = field(default_factory=dict)  # {tensor: why the implementation has none}
    precision: Optional[str] = None  # the implementation's declared working precision, when below the case dtype
    known: Optional[dict] = None  # the known deviation that matched ({id, status, ...}), see parity.known

    @property
    def case_id(self) -> str:
        return self.case.id

    def case_row(self) -> dict:
        return {"type": "case", "case_id": self.case_id, "case": self.case.to_dict(), "outcome": self.outcome,
                "decided_by": self.decided_by, "first_failure": self.first_failure, "message": self.message,
                "duration_s": round(self.duration_s, 4),
                "phases_s": {k: round(v, 4) for k, v in self.phases_s.items()},
                "repro": self.repro, "features": self.features,
                "plan": self.plan, "topk": self.topk, **self._extra()}

    def _extra(self) -> dict:
        """Additive case-row fields, present only when set."""
        out = {}
        if self.not_provided:
            out["not_provided"] = self.not_provided
        if self.precision:
            out["precision"] = self.precision
        if self.known:
            out["known"] = self.known
        return out

    def rows(self) -> list[dict]:
        out = [self.case_row()]
        for t in self.tensors:
            out.append({"type": "tensor", "case_id": self.case_id, "tensor": t.name, "tensor_class": t.tensor_class,
                        "dtype": t.dtype, "shape": list(t.shape), "verdict": t.verdict, "rule": t.rule})
        for t in self.tensors:
            for m in t.metrics:
                out.append({"type": "metric", "case_id": self.case_id, "tensor": t.name,
                            "tensor_class": t.tensor_class, "metric": m.metric, "value": _num(float(m.value)),
                            "threshold": None if m.threshold is None else _num(float(m.threshold)),
                            "passed": m.passed})
        return out

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "CaseResult":
        """Rebuild from rows (worker → parent transfer; tensors come back as plain verdict objects)."""
        from .verdict import MetricRow, TensorResult

        head = rows[0]
        tensors = {}
        for row in rows[1:]:
            if row["type"] == "tensor":
                tensors[row["tensor"]] = TensorResult(row["tensor"], row["tensor_class"], row["dtype"], row["shape"],
                                                      row["verdict"], row["rule"])
        for row in rows[1:]:
            if row["type"] == "metric" and row["tensor"] in tensors:
                value = math.nan if row["value"] is None else float(row["value"])
                tensors[row["tensor"]].metrics.append(MetricRow(
                    row["metric"], value, None if row["threshold"] is None else float(row["threshold"]),
                    row["passed"]))
        return cls(case=Case.from_dict(head["case"]), outcome=head["outcome"], decided_by=head["decided_by"],
                   first_failure=head["first_failure"], message=head["message"], duration_s=head["duration_s"],
                   phases_s=head.get("phases_s") or {}, repro=head["repro"], features=head["features"],
                   plan=head["plan"], topk=head["topk"],
                   tensors=list(tensors.values()), not_provided=head.get("not_provided") or {},
                   precision=head.get("precision"), known=head.get("known"))


def dumps(row: dict) -> str:
    return json.dumps(row, separators=(",", ":"), allow_nan=False)


class ResultsWriter:
    """Append-only JSONL writer; each :meth:`write` is one ``write`` + flush + fsync."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, rows: Iterable[dict]) -> None:
        blob = "".join(dumps(r) + "\n" for r in rows)
        self._fh.write(blob)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Existing:
    run_row: Optional[dict]
    outcomes: dict  # case_id -> outcome, finished cases in file order


def read_for_resume(path: Path) -> Existing:
    """Clean ``path`` for appending (see module docstring) and return what it already holds."""
    path = Path(path)
    if not path.exists():
        return Existing(None, {})
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line from a killed run
        if isinstance(row, dict) and "type" in row:
            rows.append(row)
    finished = {r["case_id"]: r["outcome"] for r in rows if r["type"] == "case"}
    kept = [r for r in rows if r["type"] == "run" or
            (r["type"] in ("case", "tensor", "metric") and r.get("case_id") in finished)]
    run_rows = [r for r in kept if r["type"] == "run"]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
    return Existing(run_rows[0] if run_rows else None, finished)


def counts(outcomes: Iterable[str]) -> dict:
    """``{outcome: n}``; ``known`` (registered known deviations) only when some case has it."""
    c = {k: 0 for k in OUTCOMES if k != "known"}
    for o in outcomes:
        c[o] = c.get(o, 0) + 1
    return c


def summary_line(c: dict, fixed: int = 0) -> str:
    """``N cases: P passed, F failed, E errors, U unsupported``, plus ``, K known`` / ``, X fixed?`` when any."""
    n = sum(c.get(o, 0) for o in OUTCOMES)
    line = (f"{n} cases: {c['pass']} passed, {c['fail']} failed, {c['error']} errors, "
            f"{c['unsupported']} unsupported")
    if c.get("known"):
        line += f", {c['known']} known"
    if fixed:
        line += f", {fixed} fixed?"
    return line
