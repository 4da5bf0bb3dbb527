"""results.csv: the documented column schema, one row per case x tensor, exact round trip, ids kept as text."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from reports.errors import ReportError
from reports.load import load_run
from reports.schema import CSV_COLUMNS
from reports.table import metrics_table, read_csv, write_csv

from .conftest import read_rows, rows_of, write_rows

SCHEMA_MD = Path(__file__).resolve().parents[2] / "reports" / "SCHEMA.md"


def test_columns_are_the_documented_schema_then_extra_metrics(runs):
    table = metrics_table(load_run(runs["base"]))
    assert list(table.columns[:len(CSV_COLUMNS)]) == list(CSV_COLUMNS)
    extras = list(table.columns[len(CSV_COLUMNS):])
    assert extras == sorted(extras) and {"set_mismatch", "tied_rows"} <= set(extras)


def test_schema_md_documents_every_fixed_column_in_order():
    text = SCHEMA_MD.read_text()
    documented = []
    for line in text.splitlines():
        match = re.match(r"\| (\d+(?:–\d+)?) \| (.+?) \|", line)
        if match:
            documented += re.findall(r"`([a-z_0-9]+)`", match.group(2))
    assert documented == list(CSV_COLUMNS)


def test_one_row_per_case_and_tensor_and_every_case_present(runs):
    data = load_run(runs["base"])
    table = metrics_table(data)
    with_tensors = table.loc[table["tensor"] != ""]
    assert len(with_tensors) == len(data.tensors)
    assert not with_tensors.duplicated(["case_id", "tensor"]).any()
    assert set(table["case_id"]) == set(data.cases["case_id"])
    bare = table.loc[table["tensor"] == ""]
    assert set(bare["outcome"]) == {"error", "unsupported"}
    assert bare["case_id"].is_unique


def test_metric_cells_equal_the_stream_values(runs):
    table = metrics_table(load_run(runs["base"])).set_index(["case_id", "tensor"])
    metrics = [r for r in read_rows(runs["base"]) if r["type"] == "metric"]
    for row in metrics[::37]:
        assert table.loc[(row["case_id"], row["tensor"]), row["metric"]] == row["value"]


def test_failing_tensor_summary_columns(runs):
    data = load_run(runs["base"])
    table = metrics_table(data)
    failing = table.loc[table["verdict"] == "fail"]
    assert len(failing) > 0
    assert (failing["worst_usage"] > 1.0).all()
    assert failing["failed_checks"].str.len().gt(0).all()
    passing = table.loc[table["verdict"] == "pass"]
    assert (passing["worst_usage"] <= 1.0).all() and (passing["failed_checks"] == "").all()


def test_csv_round_trip_is_exact(runs, tmp_path):
    table = metrics_table(load_run(runs["base"]))
    back = read_csv(write_csv(table, tmp_path / "results.csv"))
    assert list(back.columns) == list(table.columns)
    for column in ("max_rel", "noise_floor_ratio", "worst_usage", "rmse"):
        a, b = table[column].to_numpy(dtype=float), back[column].to_numpy(dtype=float)
        assert all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))
    assert back["case_id"].tolist() == table["case_id"].tolist()


def test_numeric_looking_case_ids_stay_text(tmp_path):
    rows = rows_of(n_cases=2, fail_every=0, error_every=0, unsupported_every=0)
    ids = {r["case_id"] for r in rows if "case_id" in r}
    mapping = dict(zip(sorted(ids), ["000123456789", "1e5000000000"]))
    for r in rows:
        if "case_id" in r:
            r["case_id"] = mapping[r["case_id"]]
    path = write_csv(metrics_table(load_run(write_rows(rows, tmp_path))), tmp_path / "results.csv")
    assert set(read_csv(path)["case_id"]) == set(mapping.values())
    # negative control: a default pandas read mangles exactly these ids
    assert set(pd.read_csv(path)["case_id"].astype(str)) != set(mapping.values())


def test_reading_a_foreign_csv_names_the_missing_column(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("case_id,value\nabc,1\n")
    with pytest.raises(ReportError, match="column 'tensor' missing"):
        read_csv(path)
