"""Synthetic runs shared by the report tests (written once per worker; tests copy before mutating)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.reports.synthetic import synthetic_rows, write_jsonl, write_synthetic_run

N_CASES = 40
PLANTED = {"grad_param": 3.0}


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Path]:
    """``base``: a 40-case run; ``same``: the identical run again (another run id); ``regressed``: the same cases
    with every grad_param error metric 3x larger, still inside every tolerance; ``mutated``: base + mutants.jsonl."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "base": write_synthetic_run(root / "base", N_CASES, run_id="base"),
        "same": write_synthetic_run(root / "same", N_CASES, run_id="same"),
        "regressed": write_synthetic_run(root / "regressed", N_CASES, run_id="regressed", scale=PLANTED),
        "mutated": write_synthetic_run(root / "mutated", N_CASES, run_id="mutated", mutants=True),
    }


@pytest.fixture
def copy_run(runs, tmp_path):
    """A private copy of one of the shared runs (for tests that write outputs or edit the stream)."""
    def make(name: str) -> Path:
        return Path(shutil.copytree(runs[name], tmp_path / name))
    return make


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "results.jsonl").read_text().splitlines() if line.strip()]


def write_rows(rows: list[dict], path: Path) -> Path:
    return write_jsonl(rows, path / "results.jsonl").parent


def rows_of(**kwargs) -> list[dict]:
    return list(synthetic_rows(**kwargs))
