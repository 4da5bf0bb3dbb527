"""Committed baselines: ``reports/baselines/<arch>/<name>/`` = ``metrics.csv`` + ``env.json`` (+ ``gate.json``).

* ``metrics.csv`` — the run's per-case per-tensor metrics table (schema: ``reports/SCHEMA.md``).
* ``env.json``    — where it came from: ``run_id``, ``suite``, ``impl``, ``against``, ``provider``, ``started``,
  ``counts``, ``arch``, ``env`` (python / torch / cuda / cudnn / cudnn_frontend / flash_mla / gpu / driver / git_rev),
  ``unsupported_reasons`` (``{reason: cases}``, :func:`reports.coverage_gate.reason_key`; the coverage gate's
  reference) and, when the run row has one, ``impl_info`` (the implementation's self-description, e.g.
  ``--impl megatron``'s revision, provider, stand-ins and kernel versions).
* ``gate.json``   — optional :class:`reports.drift.GateConfig` overrides for comparisons against this baseline.
* ``memory.csv``  — on a GPU: each case's peak GPU memory in that run (``case_id,peak_gpu_bytes``, and
  ``peak_gpu_reserved_bytes`` since 2026-12-07: the largest of its phases' PyTorch allocations, and of what the
  caching allocator held from the GPU for them), which later runs of the same path on that GPU read as the expected
  peak of the worker pool's memory admission (:func:`measured_peaks`, ``parity.run.memory.expected_gpu_bytes``).

``<arch>`` is :func:`arch_of` the run's GPU (``cpu`` without one, ``h200`` for "NVIDIA H200", ...). ``<name>`` is
:func:`default_name`: ``<suite>`` for ``--impl fused``, ``<impl>-<provider>-<suite>`` for another implementation
(``megatron-unfused-smoke``, ``megatron-cudnn-gate``: each production path has its own). Library versions go into
``<name>`` when they matter (e.g. ``h200/smoke-cudnn9.10``); ``env.json`` always records them.

A baseline is named (``--baseline``) by ``<arch>/<name>`` (under the baselines root), a bare ``<name>`` (under the
current run's own arch), or a path: a baseline directory, a run directory or a ``results.jsonl`` — any earlier
*complete* run can serve. A name (:data:`NAME`: ``NAME`` or ``ARCH/NAME`` of ``[A-Za-z0-9._-]``) is only ever looked up
under the baselines root, never in the working directory, so a stray ``cpu/smoke`` run directory where ``make parity``
runs cannot stand in for the committed ``cpu/smoke``; a path must say it is one (``/…``, ``./…``, ``../…``, ``~/…``, or
more than two parts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from cases.vocabulary import outcome_counts

from .coverage_gate import kernel_counts, reason_counts, reason_key
from .drift import GateConfig
from .errors import ReportError
from .load import RESULTS_NAME, RunData, cut_cases, ended_complete, load_run, peek_run, read_rows
from .schema import CSV_SCHEMA_VERSION
from .table import CSV_NAME, metrics_table, read_csv, write_csv

BASELINES_ROOT = Path(__file__).resolve().parent / "baselines"
METRICS_NAME = "metrics.csv"
ENV_NAME = "env.json"
GATE_NAME = "gate.json"
PEAKS_NAME = "memory.csv"
#: a baseline's name: ``NAME`` or ``ARCH/NAME`` (what ``--update`` writes and ``--baseline`` looks up under the root)
NAME = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)?")


def is_name(text: str) -> bool:
    """Whether ``text`` names a baseline under the root (:data:`NAME`, no part ``.`` / ``..``), not a path."""
    return bool(NAME.fullmatch(text)) and not any(part in (".", "..") for part in text.split("/"))


@dataclass
class Baseline:
    name: str
    path: Path
    table: pd.DataFrame
    env: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)

    @property
    def reasons(self) -> dict[str, int] | None:
        """``{unsupported reason: cases}`` the baseline recorded, or None (recorded before baselines kept them)."""
        found = self.env.get("unsupported_reasons")
        return {str(k): int(v) for k, v in found.items()} if isinstance(found, dict) else None


def arch_of(env: dict[str, Any] | None) -> str:
    """Architecture slug of a run's env: ``cpu`` without a GPU, else the model token (``h200``, ``a100``, ``gb200``)."""
    gpu = (env or {}).get("gpu")
    if not gpu:
        return "cpu"
    text = str(gpu).lower().replace("nvidia", " ")
    match = re.search(r"\b([a-z]{1,3}\d{2,4}[a-z]?)\b", text)
    return match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "gpu"


def provenance(run: dict[str, Any], counts: dict[str, int], complete: bool,
               end: dict[str, Any] | None = None, reasons: dict[str, int] | None = None,
               kernels: dict[str, int] | None = None) -> dict[str, Any]:
    """``env.json`` of a baseline: the run row's identity and environment (and the implementation's
    ``impl_info``: revision, provider, stand-ins), the case counts, the unsupported reasons with their counts
    (``reasons``; None: not known), the kernels its cases ran (``kernels``: ``stage:provider`` -> cases,
    :func:`reports.coverage_gate.kernel_counts`; None: not known); for a run its time budget stopped
    (``--budget-s``), ``not_run`` = the number of selected cases it did not start."""
    env = run.get("env") if isinstance(run.get("env"), dict) else {}
    out = {"run_id": run.get("run_id"), "suite": run.get("suite"), "impl": run.get("impl"),
           "against": run.get("against"), "provider": run.get("provider"), "started": run.get("started"),
           "argv": run.get("argv"), "counts": counts, "complete": complete, "arch": arch_of(env),
           "schema_version": CSV_SCHEMA_VERSION, "env": env}
    if reasons is not None:
        out["unsupported_reasons"] = reasons
    if kernels is not None:
        out["kernels"] = kernels
    if isinstance(run.get("impl_info"), dict):
        out["impl_info"] = run["impl_info"]
    if end and end.get("not_run"):
        out["not_run"] = len(end["not_run"])
    return out


def _counts(table: pd.DataFrame) -> dict[str, int]:
    return outcome_counts(table.drop_duplicates("case_id")["outcome"].value_counts())


def available(root: Path = BASELINES_ROOT) -> list[str]:
    return sorted(str(p.parent.relative_to(root)) for p in root.glob(f"*/*/{METRICS_NAME}"))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(str(path), f"not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise ReportError(str(path), "not valid JSON: binary or not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ReportError(str(path), "must be a JSON object")
    return data


def _last_case_rows(rows: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The last ``case`` row of each case in a results stream's rows (:func:`reports.load.read_rows`)."""
    found: dict[str, dict[str, Any]] = {}
    for _, row in rows:
        if row.get("type") == "case" and "case_id" in row:
            found[str(row["case_id"])] = row
    return list(found.values())


def _stream_reasons(cases: list[dict[str, Any]]) -> dict[str, int]:
    """``{unsupported reason: cases}`` of a stream's case rows (:func:`_last_case_rows`)."""
    keys = [reason_key(r["message"]) for r in cases
            if r.get("outcome") == "unsupported" and r.get("message") is not None]
    return {str(k): int(v) for k, v in pd.Series(keys, dtype=object).value_counts().items()}


def _from_run(name: str, results: Path) -> Baseline:
    """An earlier run as the baseline: its ``results.csv`` when newer than the JSONL, else the JSONL itself. Only a
    complete run (an ``end`` row, every case started, none cut off): a partial one would gate only the work it did."""
    csv = results.parent / CSV_NAME
    if csv.is_file() and csv.stat().st_mtime >= results.stat().st_mtime:
        run, end = peek_run(results)
        rows = read_rows(results)[0]  # one read of the stream: its cut cases, unsupported reasons and kernels
        cases = _last_case_rows(rows)
        _refuse_partial("--baseline", f"run {name}", ended_complete(end), end, cut_cases(rows),
                        sum(1 for _, r in rows if r.get("type") == "resume"))
        table = read_csv(csv)
        return Baseline(name=name, path=results.parent, table=table,
                        env=provenance(run, _counts(table), ended_complete(end), end, _stream_reasons(cases),
                                       kernel_counts(r.get("plan") for r in cases)))
    data = load_run(results)
    _refuse_partial("--baseline", f"run {name}", data.complete, data.end, data.cut, len(data.resumes))
    return Baseline(name=name, path=results.parent, table=metrics_table(data),
                    env=provenance(data.run, data.counts, data.complete, reasons=reason_counts(data.cases),
                                   kernels=kernel_counts(data.cases["plan"])))


def _refuse_partial(option: str, run: str, complete: bool, end: dict[str, Any] | None, cut: list[str],
                    resumed: int = 0) -> None:
    """Refuse (``option``'s error) a partial ``run`` as a baseline: no ``end`` row, cases ``--budget-s`` left
    unstarted, cases cut off mid-write, or ``resumed`` resumes under another environment (its cases ran under two
    codes or library sets). Taking one (``--update``) or comparing against one (``--baseline``) would gate only the
    work it did."""
    if end is None:
        why = "has no 'end' row (it died, was killed or is still running)"
    elif not complete:
        why = f"left {len(end.get('not_run') or [])} case(s) unstarted (--budget-s)"
    elif cut:
        why = f"has {len(cut)} case(s) cut off (e.g. {cut[0]})"
    elif resumed:
        why = f"was resumed under another environment {resumed} time(s) (its resume rows): its cases mix two"
    else:
        return
    what = "refusing to baseline a partial run" if option == "--update" else "a partial run cannot be a baseline"
    fix = "run it afresh" if resumed and end is not None and complete and not cut else \
        "finish it with `dsv4-parity run --out DIR --resume`"
    raise ReportError(option, f"{run} {why}: {what} (it would gate only the work it did); {fix}")


def load_baseline(name: str, *, current: RunData | None = None, root: Path = BASELINES_ROOT) -> Baseline:
    """Resolve and read a baseline (see the module docstring for how ``name`` is looked up)."""
    if is_name(name):
        return _under_root(name, current, root)
    path = Path(name).expanduser()
    if path.is_file() and path.name == RESULTS_NAME:
        return _from_run(name, path)
    if path.is_dir():
        if (path / METRICS_NAME).is_file():
            return _baseline_dir(name, path)
        if (path / RESULTS_NAME).is_file():
            return _from_run(name, path / RESULTS_NAME)
        raise ReportError("--baseline", f"{path} holds neither {METRICS_NAME} nor {RESULTS_NAME}")
    raise ReportError("--baseline", f"no baseline directory, run directory or {RESULTS_NAME} at {path}")


def _under_root(name: str, current: RunData | None, root: Path) -> Baseline:
    """Baseline ``name`` (``ARCH/NAME``, or ``NAME`` under the current run's arch) under ``root``."""
    tried = []
    for candidate in ([root / name] if "/" in name else []) + \
            ([root / arch_of(current.env if current else None) / name] if "/" not in name else []):
        tried.append(str(candidate))
        if (candidate / METRICS_NAME).is_file():
            return _baseline_dir(name, candidate)
    known = ", ".join(available(root)) or "none yet"
    local = (f"; a path {name!r} exists here: a baseline name is looked up under the baselines root only, so to "
             f"use that run or directory name it as a path (./{name})" if Path(name).exists() else "")
    raise ReportError("--baseline", f"no baseline {name!r} (looked for {' and '.join(tried)}); available: "
                                    f"{known}{local}")


def _baseline_dir(name: str, path: Path) -> Baseline:
    table, env = read_csv(path / METRICS_NAME), _read_json(path / ENV_NAME)
    if env.get("complete") is False or env.get("not_run"):
        raise ReportError(str(path / ENV_NAME), "records a partial run (complete: false): a baseline must hold a "
                                                "whole run; retake it with `dsv4-parity compare RUN --update`")
    recorded = env.get("counts")
    if isinstance(recorded, dict) and all(isinstance(v, int) for v in recorded.values()):
        held = table["case_id"].nunique()
        if held != sum(recorded.values()):
            raise ReportError(str(path / METRICS_NAME), f"holds {held} cases but {ENV_NAME} records "
                                                        f"{sum(recorded.values())}: truncated or edited; refresh it "
                                                        "with `dsv4-parity compare --update`")
    return Baseline(name=name, path=path, table=table, env=env, gate=_read_json(path / GATE_NAME))


def run_provider(run: dict[str, Any]) -> str | None:
    """The provider a run used, as its implementation resolved it (``impl_info.provider``: ``auto`` -> ``unfused``
    for ``--impl megatron``), else the run row's ``provider``."""
    info = run.get("impl_info") if isinstance(run.get("impl_info"), dict) else {}
    provider = info.get("provider") or run.get("provider")
    return str(provider) if provider else None


def default_name(data: RunData) -> str | None:
    """The run's baseline name under its arch (:func:`name_for` its suite, implementation and resolved provider)."""
    suite, impl = data.run.get("suite"), data.run.get("impl")
    return name_for(str(suite), impl, run_provider(data.run)) if suite else None


def name_for(suite: str, impl: str | None, provider: str | None) -> str:
    """``<suite>`` for ``--impl fused``, ``<impl>-<provider>-<suite>`` for another implementation
    (``megatron-unfused-gate``, ``megatron-cudnn-gate``), so production's baselines never stand in for the
    composition's, nor one production path's for another's (``<impl>-<suite>`` when there is no provider)."""
    if impl in (None, "fused"):
        return suite
    return f"{impl}-{provider}-{suite}" if provider and provider not in ("auto", "none") else f"{impl}-{suite}"


def case_peaks(results: Path) -> dict[str, tuple[int, int]]:
    """``{case_id: (allocated, reserved)}``: each case's largest ``peak_gpu_bytes`` and largest
    ``peak_gpu_reserved_bytes`` (0 where the rows have none) over its phases in a ``results.jsonl``, for the cases
    that ran to their verdict (``pass`` / ``fail`` / ``known``). Left out: cases without ``peak_gpu_bytes`` (a CPU
    run), ``error`` cases (a phase that ran out of memory or raised records only what it held before: less than the
    case needs) and ``unsupported`` ones (declined before their work)."""

    def largest(phases) -> int:
        values = [v for v in phases.values() if isinstance(v, (int, float))] if isinstance(phases, dict) else []
        return int(max(values)) if values else 0

    peaks: dict[str, tuple[int, int]] = {}
    for _, row in read_rows(results)[0]:
        if row.get("type") != "case" or row.get("outcome") not in ("pass", "fail", "known") or not row.get("case_id"):
            continue
        allocated, reserved = largest(row.get("peak_gpu_bytes")), largest(row.get("peak_gpu_reserved_bytes"))
        if allocated:
            before = peaks.get(str(row["case_id"]), (0, 0))
            peaks[str(row["case_id"])] = (max(before[0], allocated), max(before[1], reserved))
    return peaks


#: GPUs whose runs allocate the same: the H100 and the H200 run the same sm90 kernels through the same PyTorch, so a
#: case's peak allocation measured on one stands for the other where it has none of its own (the H100's peaks were
#: taken first: the H200 was not lent). The pool's margin and its re-run alone cover what a workspace choice moves.
SAME_ALLOCATIONS = {"h100": ("h200",), "h200": ("h100",)}


def measured_peaks(arch: str, name: str, root: Path = BASELINES_ROOT) -> dict[str, int]:
    """The ``memory.csv`` of baseline ``<arch>/<name>`` as ``{case_id: bytes}``; where that GPU has none, the one of
    a GPU of :data:`SAME_ALLOCATIONS`; {} where there is none. A case's bytes are its reserved peak where the file
    has one (what its process held from the GPU: on the H100's fused gate of 2026-12-07 1.26× its allocations at the
    median and up to 1.53× on the cases that ran out of memory beside others), else its allocated peak (files
    written before reserved peaks were kept)."""
    for source in (arch, *SAME_ALLOCATIONS.get(arch, ())):
        path = root / source / name / PEAKS_NAME
        if path.is_file():
            table = pd.read_csv(path, dtype={"case_id": str})
            reserved = (table["peak_gpu_reserved_bytes"] if "peak_gpu_reserved_bytes" in table
                        else [0] * len(table))
            return {str(c): int(r) if r and r > 0 else int(b)
                    for c, b, r in zip(table["case_id"], table["peak_gpu_bytes"], reserved)}
    return {}


def default_baseline(data: RunData, root: Path = BASELINES_ROOT) -> str | None:
    """``<arch>/<default_name>`` of the run when such a baseline is committed, else None."""
    name = default_name(data)
    if name and (root / arch_of(data.env) / name / METRICS_NAME).is_file():
        return f"{arch_of(data.env)}/{name}"
    return None


def save_baseline(data: RunData, table: pd.DataFrame, name: str, *, root: Path = BASELINES_ROOT,
                  gate: GateConfig | None = None) -> Path:
    """Write ``table`` as baseline ``name`` (``<arch>/<name>``, or a bare name under the run's arch)."""
    if not is_name(name) or ".." in name:
        raise ReportError("--baseline", f"baseline names are NAME or ARCH/NAME ([A-Za-z0-9._-]), got {name!r}")
    target = root / (name if "/" in name else f"{arch_of(data.env)}/{name}")
    # found by review: a budget-stopped or cut run used to be taken (only a run without its end row was refused)
    _refuse_partial("--update", f"run {data.run_id}", data.complete, data.end, data.cut, len(data.resumes))
    target.mkdir(parents=True, exist_ok=True)
    write_csv(table, target / METRICS_NAME)
    env = provenance(data.run, data.counts, data.complete, data.end, reason_counts(data.cases),
                     kernel_counts(data.cases["plan"]))
    (target / ENV_NAME).write_text(json.dumps(env, indent=2, sort_keys=True) + "\n")
    if gate is not None:
        (target / GATE_NAME).write_text(json.dumps(gate.to_dict(), indent=2, sort_keys=True) + "\n")
    peaks = case_peaks(data.path)
    if peaks:
        pd.DataFrame([(case, a, r) for case, (a, r) in sorted(peaks.items())],
                     columns=["case_id", "peak_gpu_bytes", "peak_gpu_reserved_bytes"]).to_csv(
            target / PEAKS_NAME, index=False)
    elif (target / PEAKS_NAME).is_file():
        (target / PEAKS_NAME).unlink()  # retaken without GPU peaks: the old ones describe another run
    return target
