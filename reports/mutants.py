"""The mutation kill matrix, from ``mutants.jsonl`` in the run directory (written by ``dsv4-parity mutants``).

Rows: ``{mutant, status: killed|survived|unreachable, case_id, tensor, check}`` — one per (mutant, killing case
and tensor) for kills, one per mutant otherwise. A mutant is *killed* if any row kills it, else *survived* if any
row says so (the suite ran the mutated code and noticed nothing — the case that matters), else *unreachable* (no
case executed the mutated code).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .errors import ReportError

MUTANTS_NAME = "mutants.jsonl"
STATUSES = ("killed", "survived", "unreachable")
FIELDS = ("mutant", "status", "case_id", "tensor", "check")


@dataclass
class MutantReport:
    rows: pd.DataFrame       # the raw rows (FIELDS)
    mutants: pd.DataFrame    # per mutant: mutant, status, kills, cases, checks, example_cases
    matrix: pd.DataFrame     # index mutant, columns tensor, cells = number of killing rows

    @property
    def counts(self) -> dict[str, int]:
        found = self.mutants["status"].value_counts()
        return {s: int(found.get(s, 0)) for s in STATUSES}


def read_mutants(path: Path) -> pd.DataFrame:
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(where, f"not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(row, dict):
            raise ReportError(where, "must be a JSON object")
        for name in ("mutant", "status"):
            if name not in row:
                raise ReportError(f"{where} field '{name}'", "missing")
        if row["status"] not in STATUSES:
            raise ReportError(f"{where} field 'status'", f"must be one of {', '.join(STATUSES)}, got {row['status']!r}")
        rows.append({name: row.get(name) for name in FIELDS})
    return pd.DataFrame(rows, columns=list(FIELDS))


def load_mutants(directory: Path, tensor_order: list[str] | None = None) -> MutantReport | None:
    """The kill matrix of ``directory/mutants.jsonl``, or None when the run has none."""
    path = Path(directory) / MUTANTS_NAME
    if not path.is_file():
        return None
    rows = read_mutants(path)
    summary = []
    for mutant, group in rows.groupby("mutant", sort=False):
        killed = group.loc[group["status"] == "killed"]
        status = "killed" if len(killed) else "survived" if (group["status"] == "survived").any() else "unreachable"
        summary.append({"mutant": mutant, "status": status, "kills": len(killed),
                        "cases": killed["case_id"].nunique(),
                        "checks": ", ".join(sorted(set(killed["check"].dropna().astype(str)))),
                        "example_cases": killed["case_id"].dropna().astype(str).drop_duplicates().head(3).tolist()})
    mutants = pd.DataFrame(summary, columns=["mutant", "status", "kills", "cases", "checks", "example_cases"])
    rank = {s: i for i, s in enumerate(("survived", "unreachable", "killed"))}
    mutants = mutants.sort_values("status", key=lambda s: s.map(rank), kind="stable").reset_index(drop=True)
    kills = rows.loc[(rows["status"] == "killed") & rows["tensor"].notna()]
    matrix = pd.crosstab(kills["mutant"], kills["tensor"]) if len(kills) else pd.DataFrame()
    columns = list(matrix.columns)
    if tensor_order:
        position = {name: i for i, name in enumerate(tensor_order)}
        columns.sort(key=lambda name: (position.get(name, len(position)), name))
    matrix = matrix.reindex(index=mutants["mutant"], columns=columns, fill_value=0).fillna(0).astype(int)
    return MutantReport(rows=rows, mutants=mutants, matrix=matrix)
