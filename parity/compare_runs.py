"""Do two runs agree case by case? (``dsv4-parity compare-runs A B``).

The check behind "N workers give the same results as one": a sweep sharded over N GPUs (``--workers N``) must
produce, for every case, exactly what a single-worker run produces. For each case id in both runs it compares

* the ``case`` row: ``outcome``, ``decided_by``, ``first_failure``, ``message``, ``plan``, ``topk``, ``features``
  (for an ``error`` the message only up to its first ``": "`` — a crashed worker's message carries the tail of its
  stderr, which depends on what else that worker ran);
* every ``tensor`` row: ``tensor_class``, ``dtype``, ``shape``, ``verdict``, ``rule``;
* every ``metric`` row: ``value`` (bit-identical by default; ``rel_tol`` allows ``|a-b| <= rel_tol·max(|a|,|b|)``),
  ``threshold``, ``passed``;

and ignores what legitimately differs: ``duration_s``, ``worker``, ``device``, ``repro``, the ``run`` row, the order
of the cases in the file. ``verdicts_only`` compares what a gate decides and nothing of how: per case ``outcome``,
``plan`` and ``features`` (of two errors, the kind of error), per tensor its identity and ``verdict`` — for two runs of a GPU whose kernels accumulate
with atomics (run-to-run different values, so the deciding rule of a passing tensor may change too). Cases present
in one run only, a run without its ``end`` row (killed) and a case written twice are reported too; ``common_only``
restricts the verdict to the cases both runs finished (time-limited runs).

The summary also prints each run's wall time, worker count and per-worker busy time, the numbers behind the
throughput claim (informational: speed is reported, never asserted).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CASE_FIELDS = ("outcome", "decided_by", "first_failure", "message", "plan", "topk", "features")
TENSOR_FIELDS = ("tensor_class", "dtype", "shape", "verdict", "rule")
#: the fields ``verdicts_only`` compares (no values, no deciding rule; of two errors also the kind of error)
VERDICT_CASE_FIELDS = ("outcome", "plan", "features")
VERDICT_TENSOR_FIELDS = ("tensor_class", "dtype", "shape", "verdict")


from parity.run.stream import StreamError, read_stream


class RunsError(ValueError):
    """A run that cannot be read (usage error, exit 2)."""


@dataclass
class RunRecord:
    """The rows of one ``results.jsonl``, by case id."""

    path: Path
    run: Optional[dict] = None
    end: Optional[dict] = None
    cases: dict = field(default_factory=dict)     # case_id -> case row
    tensors: dict = field(default_factory=dict)   # case_id -> {tensor: row}
    metrics: dict = field(default_factory=dict)   # case_id -> {(tensor, metric): row}
    duplicates: list = field(default_factory=list)


def results_path(path: Path | str) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "results.jsonl"
    if not path.is_file():
        raise RunsError(f"no results file at {path}")
    return path


def load(path: Path | str) -> RunRecord:
    """Read a run directory or ``results.jsonl`` (torn lines skipped; a case written twice: the last one kept)."""
    record = RunRecord(results_path(path))
    tensors, metrics = defaultdict(dict), defaultdict(dict)
    try:
        rows = read_stream(record.path)
    except StreamError as exc:
        raise RunsError(str(exc)) from None
    for row in rows:
        kind = row.get("type")
        if kind in ("case", "tensor", "metric") and not isinstance(row.get("case_id"), str):
            continue  # not a row this command can place
        if kind == "run":
            record.run = record.run or row
        elif kind == "end":
            record.end = row
        elif kind == "case":
            cid = row["case_id"]
            if cid in record.cases:
                record.duplicates.append(cid)
                tensors.pop(cid, None)  # the rows before belong to the earlier copy
                metrics.pop(cid, None)
            record.cases[cid] = row
        elif kind == "tensor":
            tensors[row["case_id"]][row.get("tensor")] = row
        elif kind == "metric":
            metrics[row["case_id"]][(row.get("tensor"), row.get("metric"))] = row
    record.tensors, record.metrics = dict(tensors), dict(metrics)
    return record


@dataclass
class Difference:
    case_id: str
    what: str   # "outcome", "tensor out: verdict", "metric grad/hidden.max_abs: value", ...
    a: Any
    b: Any

    def line(self) -> str:
        return f"{self.case_id}  {self.what}: {self.a!r} != {self.b!r}"


@dataclass
class Agreement:
    compared: int
    only_a: list
    only_b: list
    differences: list
    problems: list
    common_only: bool = False
    verdicts_only: bool = False

    @property
    def differing_cases(self) -> list:
        return sorted({d.case_id for d in self.differences})

    @property
    def ok(self) -> bool:
        if self.differences or self.compared == 0:
            return False
        return self.common_only or not (self.only_a or self.only_b or self.problems)


def _same_value(a: Any, b: Any, rel_tol: float) -> bool:
    if a == b:
        return True
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and rel_tol > 0:
        return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel_tol * max(abs(a), abs(b))
    return False


def _error_kind(message: Any) -> Any:
    return message.split(": ", 1)[0] if isinstance(message, str) else message


def compare_case(cid: str, a: RunRecord, b: RunRecord, rel_tol: float = 0.0,
                 verdicts_only: bool = False) -> list[Difference]:
    """Every difference between the two runs' results for case ``cid`` (see the module docstring)."""
    out = []
    ca, cb = a.cases[cid], b.cases[cid]
    errors = (ca.get("outcome") == "error" and cb.get("outcome") == "error") or \
        (ca.get("decided_by") == "device-memory" and cb.get("decided_by") == "device-memory")  # numbers move
    fields = CASE_FIELDS if not verdicts_only else VERDICT_CASE_FIELDS + (("message",) if errors else ())
    for name in fields:
        va, vb = ca.get(name), cb.get(name)
        if errors and name == "message":
            va, vb = _error_kind(va), _error_kind(vb)
        if errors and name == "first_failure" and isinstance(va, dict) and isinstance(vb, dict):
            va = {**va, "message": _error_kind(va.get("message"))}
            vb = {**vb, "message": _error_kind(vb.get("message"))}
        if va != vb:
            out.append(Difference(cid, name, va, vb))
    ta, tb = a.tensors.get(cid, {}), b.tensors.get(cid, {})
    for tensor in sorted(set(ta) | set(tb)):
        if tensor not in ta or tensor not in tb:
            out.append(Difference(cid, f"tensor {tensor}", tensor in ta, tensor in tb))
            continue
        for name in VERDICT_TENSOR_FIELDS if verdicts_only else TENSOR_FIELDS:
            if ta[tensor].get(name) != tb[tensor].get(name):
                out.append(Difference(cid, f"tensor {tensor}: {name}", ta[tensor].get(name), tb[tensor].get(name)))
    if verdicts_only:
        return out
    ma, mb = a.metrics.get(cid, {}), b.metrics.get(cid, {})
    for key in sorted(set(ma) | set(mb)):
        label = f"metric {key[0]}.{key[1]}"
        if key not in ma or key not in mb:
            out.append(Difference(cid, label, key in ma, key in mb))
            continue
        ra, rb = ma[key], mb[key]
        if not _same_value(ra.get("value"), rb.get("value"), rel_tol):
            out.append(Difference(cid, f"{label}: value", ra.get("value"), rb.get("value")))
        for name in ("threshold", "passed"):
            if ra.get(name) != rb.get(name):
                out.append(Difference(cid, f"{label}: {name}", ra.get(name), rb.get(name)))
    return out


def compare(a: RunRecord, b: RunRecord, *, rel_tol: float = 0.0, common_only: bool = False,
            verdicts_only: bool = False) -> Agreement:
    """Case-by-case agreement of two runs."""
    common = [cid for cid in a.cases if cid in b.cases]
    differences = [d for cid in common for d in compare_case(cid, a, b, rel_tol, verdicts_only)]
    problems = []
    for label, rec in (("A", a), ("B", b)):
        if rec.end is None:
            problems.append(f"run {label} has no end row (killed or still running): {rec.path}")
        if rec.duplicates:
            problems.append(f"run {label} holds {len(rec.duplicates)} case(s) twice: {', '.join(rec.duplicates[:5])}")
    return Agreement(compared=len(common), only_a=[c for c in a.cases if c not in b.cases],
                     only_b=[c for c in b.cases if c not in a.cases], differences=differences, problems=problems,
                     common_only=common_only, verdicts_only=verdicts_only)


# ---- throughput (informational) -------------------------------------------------------------------------------------
def timing(record: RunRecord) -> dict:
    """``{wall_s, workers, cases, busy_s: {worker: seconds}}`` of a run (``wall_s`` None without an end row)."""
    busy: dict = defaultdict(float)
    for row in record.cases.values():
        busy[row.get("worker", 0)] += float(row.get("duration_s") or 0.0)
    return {"wall_s": None if record.end is None else record.end.get("duration_s"),
            "workers": (record.run or {}).get("workers", 1), "cases": len(record.cases),
            "busy_s": dict(sorted(busy.items(), key=lambda kv: str(kv[0])))}


def _timing_line(label: str, t: dict) -> str:
    wall = "?" if t["wall_s"] is None else f"{t['wall_s']:.1f} s"
    busy = t["busy_s"]
    spread = ""
    if busy:
        spread = f"; busy per worker {min(busy.values()):.1f}–{max(busy.values()):.1f} s" if len(busy) > 1 else \
            f"; busy {sum(busy.values()):.1f} s"
    return f"{label}: {t['cases']} cases, {t['workers']} worker(s), wall {wall}{spread}"


def report(agreement: Agreement, a: RunRecord, b: RunRecord, show: int = 20) -> list[str]:
    lines = [_timing_line("A", timing(a)) + f"  [{a.path}]", _timing_line("B", timing(b)) + f"  [{b.path}]"]
    ta, tb = timing(a), timing(b)
    if ta["wall_s"] and tb["wall_s"]:
        lines.append(f"wall-time ratio A/B: {ta['wall_s'] / tb['wall_s']:.2f}x")
    for cid in agreement.only_a[:show]:
        lines.append(f"only in A: {cid}")
    for cid in agreement.only_b[:show]:
        lines.append(f"only in B: {cid}")
    lines += [d.line() for d in agreement.differences[:show]]
    if len(agreement.differences) > show:
        lines.append(f"... {len(agreement.differences) - show} more differences")
    lines += agreement.problems
    verdict = "AGREE" if agreement.ok else "DIFFER"
    scope = (" (common cases only)" if agreement.common_only else "") + \
        (" (outcomes and verdicts only)" if agreement.verdicts_only else "")
    lines.append(f"compare-runs: {agreement.compared} cases in both, {len(agreement.differing_cases)} differ, "
                 f"{len(agreement.only_a)} only in A, {len(agreement.only_b)} only in B{scope}: {verdict}")
    return lines
