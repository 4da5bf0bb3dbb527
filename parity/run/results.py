"""The results stream ``results.jsonl`` (schema: ARCHITECTURE.md "Results stream"): rows, writer, resume.

One case's rows (``case``, then its ``tensor`` rows, then their ``metric`` rows) are appended in one unbuffered
write and fsynced. The ``case`` row carries ``n_rows``, the number of ``tensor`` + ``metric`` rows that follow it
(:func:`sealed`), so a case cut off by a kill or a full disk is recognisable. :func:`read_for_resume` keeps only the
*finished* cases — a ``case`` row followed by all its ``n_rows`` rows, whose outcome is not ``error`` nor a
``device-memory`` refusal of a smaller GPU than the one resuming (both run again, :func:`_again`) — and drops
everything else: torn lines, cut-off cases, errored cases and the closing ``end`` row; the run
then appends to the same file. A write that fails (disk full, file-size limit) raises :class:`ResultsWriteError`.

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
from cases.vocabulary import ALWAYS_COUNTED, OUTCOMES

from parity.judge.verdict import MetricRow, TensorResult
from parity.run import out_of_memory
from parity.run.stream import case_blocks, parse_lines

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
    peak_gpu_bytes: dict = field(default_factory=dict)  # CUDA: per phase, the most GPU memory allocated while it ran
    peak_gpu_reserved_bytes: dict = field(default_factory=dict)  # CUDA: per phase, the most the allocator held (cache)
    repro: str = ""
    features: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)
    topk: Optional[dict] = None
    tensors: list = field(default_factory=list)  # verdict.TensorResult
    sign_split: Optional[dict] = None  # {adopted, rejected, window_usage, scores} of the truth run (parity/judge/sign_split.py)
    not_provided: dict = field(default_factory=dict)  # {tensor: why the implementation has none}
    precision: Optional[str] = None  # the implementation's declared working precision, when below the case dtype
    known: Optional[dict] = None  # the known deviation that matched ({id, status, ...}), see parity.deviations.known
    failed_at: Optional[dict] = None  # an exception's {stage, implementation_run}: where the case stopped
    impl_kernels: Optional[dict] = None  # {calls, seconds}: the implementation's kernel calls in its run (kernel_time)

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
        out = {"sign_split": self.sign_split} if self.sign_split else {}
        if self.peak_gpu_bytes:
            out["peak_gpu_bytes"] = dict(self.peak_gpu_bytes)
        if self.peak_gpu_reserved_bytes:
            out["peak_gpu_reserved_bytes"] = dict(self.peak_gpu_reserved_bytes)
        if self.not_provided:
            out["not_provided"] = self.not_provided
        if self.precision:
            out["precision"] = self.precision
        if self.known:
            out["known"] = self.known
        if self.failed_at:
            out["failed_at"] = self.failed_at
        if self.impl_kernels is not None:
            out["impl_kernels"] = dict(self.impl_kernels)
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
                   phases_s=head.get("phases_s") or {}, peak_gpu_bytes=head.get("peak_gpu_bytes") or {},
                   peak_gpu_reserved_bytes=head.get("peak_gpu_reserved_bytes") or {},
                   repro=head["repro"], features=head["features"],
                   plan=head["plan"], topk=head["topk"],
                   tensors=list(tensors.values()), sign_split=head.get("sign_split"),
                   not_provided=head.get("not_provided") or {}, precision=head.get("precision"),
                   known=head.get("known"), failed_at=head.get("failed_at"), impl_kernels=head.get("impl_kernels"))


def dumps(row: dict) -> str:
    return json.dumps(row, separators=(",", ":"), allow_nan=False)


def _again(case_row: dict, gpu_capacity: Optional[int] = None) -> bool:
    """Whether a resumed run runs this case again: an ``error``; and a case that did not fit its GPU (rule
    ``device-memory``) where the resuming GPU is larger than the one it ran out of memory on (``gpu_capacity``, bytes,
    against the capacity in torch's message kept in ``first_failure``), or where either is unknown. On a GPU of the
    same size it would only run out of memory again: one to four large cases re-run alone, holding the pool back."""
    if case_row.get("outcome") == "error":
        return True
    if case_row.get("decided_by") != "device-memory":
        return False
    recorded = _capacity_of(case_row)
    return recorded is None or gpu_capacity is None or gpu_capacity > recorded * LARGER_GPU


#: How much more memory than torch's message names a GPU must have to count as larger: the message rounds the capacity
#: to 0.01 GiB, so the same card reads up to 0.005 GiB either side of its own size.
LARGER_GPU = 1.01


def _capacity_of(case_row: dict) -> Optional[int]:
    """The GPU capacity (bytes) torch's out-of-memory message of a ``device-memory`` row names, or None."""
    text = out_of_memory.first_failure(case_row).get("message")
    need = out_of_memory.least_need(text) if isinstance(text, str) else None
    return need[1] if need else None


def sealed(rows: list[dict]) -> list[dict]:
    """One case's rows with ``n_rows`` (the count of rows after the ``case`` row) recorded on its ``case`` row."""
    rows[0]["n_rows"] = len(rows) - 1
    return rows


class ResultsWriteError(OSError):
    """The results stream could not be written (disk full, file-size limit, I/O error)."""


class ResultsWriter:
    """Append-only JSONL writer; each :meth:`write` is unbuffered ``os.write`` calls + fsync (nothing is left in a
    buffer to be flushed half-way later when a write fails)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, rows: Iterable[dict]) -> None:
        blob = memoryview("".join(dumps(r) + "\n" for r in rows).encode("utf-8"))
        try:
            while blob:
                blob = blob[os.write(self._fd, blob):]
            os.fsync(self._fd)
        except OSError as exc:
            raise ResultsWriteError(exc.errno, f"cannot write {self.path}: {exc.strerror}") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create_stream(path: Path, rows: Iterable[dict]) -> None:
    """Create ``path`` holding ``rows`` (a run's ``run`` row) in one step: written to ``<path>.tmp``, synced, renamed.
    A run killed while starting leaves no ``results.jsonl`` without its ``run`` row (at most the temporary, which
    the next run in the directory deletes, :mod:`parity.run.rundir`). Raises :class:`ResultsWriteError`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write("".join(dumps(r) + "\n" for r in rows))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ResultsWriteError(exc.errno, f"cannot write {path}: {exc.strerror}") from None


@dataclass
class Existing:
    run_row: Optional[dict]
    outcomes: dict  # case_id -> outcome, finished cases in file order
    cut: list = field(default_factory=list)      # case ids whose rows were cut off (re-run)
    errored: list = field(default_factory=list)  # case ids that ended in an error (re-run)
    larger_gpu: list = field(default_factory=list)  # did not fit a smaller GPU than this one (re-run)


def read_for_resume(path: Path, gpu_capacity: Optional[int] = None) -> Existing:
    """Clean ``path`` for appending (see module docstring) and return what it already holds; ``gpu_capacity`` (bytes,
    None off a GPU) is the memory of the GPU the resumed run runs on (:func:`_again`)."""
    path = Path(path)
    if not path.exists():
        return Existing(None, {})
    try:
        rows = parse_lines(path.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        raise ResultsWriteError(exc.errno, f"cannot read {path}: {exc.strerror}") from None
    blocks, cut = case_blocks(rows)
    finished = {b[0]["case_id"]: b for b in blocks if not _again(b[0], gpu_capacity)}
    again = [b[0] for b in blocks if _again(b[0], gpu_capacity) and b[0]["case_id"] not in finished]
    errored = [r["case_id"] for r in again if r.get("outcome") == "error"]
    larger = [r["case_id"] for r in again if r.get("outcome") != "error"]
    run_rows = [r for r in rows if r["type"] == "run"]
    resumes = [r for r in rows if r["type"] == "resume"]  # earlier resumes under another environment (kept)
    kept = run_rows[:1] + resumes + [r for block in finished.values() for r in block]
    tmp = path.with_suffix(".jsonl.tmp")
    try:
        tmp.write_text("".join(dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ResultsWriteError(exc.errno, f"cannot rewrite {path} for resuming: {exc.strerror}") from None
    return Existing(run_rows[0] if run_rows else None, {cid: b[0]["outcome"] for cid, b in finished.items()},
                    cut=[c for c in cut if c not in finished], errored=errored, larger_gpu=larger)


def counts(outcomes: Iterable[str]) -> dict:
    """``{outcome: n}``; ``known`` (registered known deviations) only when some case has it."""
    c = {k: 0 for k in ALWAYS_COUNTED}
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
