"""index.html: one self-contained file with every section; drift, failures, coverage and mutants rendered."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from reports.coverage import coverage, gaps
from reports.load import load_run
from reports.render import render_run

from .conftest import read_rows, rows_of, write_rows


class Page(HTMLParser):
    """Tags with their attributes, the text of ``<script type="application/json">``."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.data: dict[str, str] = {}
        self._json: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "script" and attrs.get("type") == "application/json":
            self._json = attrs.get("id")

    def handle_data(self, data):
        if self._json:
            self.data[self._json] = self.data.get(self._json, "") + data

    def handle_endtag(self, tag):
        if tag == "script":
            self._json = None

    def find(self, tag=None, **attrs):
        return [a for t, a in self.tags if (tag is None or t == tag) and all(a.get(k) == v for k, v in attrs.items())]


@pytest.fixture(scope="module")
def rendered(runs, tmp_path_factory):
    """The planted-regression run with mutants, rendered against the base run."""
    import shutil
    root = tmp_path_factory.mktemp("html")
    run_dir = Path(shutil.copytree(runs["regressed"], root / "regressed"))
    shutil.copy(runs["mutated"] / "mutants.jsonl", run_dir / "mutants.jsonl")
    result = render_run(run_dir, baseline=str(runs["base"]))
    text = result.html.read_text()
    return {"dir": run_dir, "text": text, "page": Page(text), "result": result}


def test_the_page_is_self_contained(rendered):
    page, text = rendered["page"], rendered["text"]
    csp = page.find("meta", **{"http-equiv": "Content-Security-Policy"})
    assert csp and "default-src 'none'" in csp[0]["content"] and "img-src data:" in csp[0]["content"]
    assert page.find("link") == [] and [a for a in page.find("script") if "src" in a] == []
    images = page.find("img")
    assert len(images) >= 3 and all(a["src"].startswith("data:image/svg+xml;base64,") for a in images)
    for tag, attrs in page.tags:
        for name in ("src", "href", "action"):
            assert not re.match(r"(https?:)?//", attrs.get(name) or ""), (tag, attrs)
    assert "@import" not in text and "url(" not in text.split("</style>")[0]


def test_every_section_is_present(rendered):
    ids = {a.get("id") for _, a in rendered["page"].tags}
    assert {"summary", "drift", "cases", "distributions", "coverage", "failures", "mutants", "environment",
            "cases-table", "case-filter", "drift-table", "class-table", "mutant-table"} <= ids


def test_planted_regression_row_is_highlighted_and_only_that_one(rendered):
    rows = rendered["page"].find("tr")
    drift_rows = {a["data-class"]: a["class"] for a in rows if "drift-row" in (a.get("class") or "")}
    assert drift_rows["grad_param"] == "drift-row regression"
    assert all(c in ("drift-row steady", "drift-row no-pairs") for k, c in drift_rows.items() if k != "grad_param")
    assert "Drift gate <b>FAIL</b>" in rendered["text"]


def test_case_table_has_one_row_per_case_and_sort_keys(rendered, runs):
    page = rendered["page"]
    case_rows = [a for a in page.find("tr") if "case-row" in (a.get("class") or "")]
    cases = [r["case_id"] for r in read_rows(runs["regressed"]) if r["type"] == "case"]
    assert [a["data-case"] for a in case_rows] == cases
    numeric = [a for a in page.find("td") if a.get("data-col") == "usage"]
    assert len(numeric) == len(cases)
    assert all(a["data-v"] == "" or float(a["data-v"]) >= 0 for a in numeric)


def test_embedded_case_data_parses_and_carries_tensors_and_repro(rendered, runs):
    data = json.loads(rendered["page"].data["case-data"])
    rows = read_rows(runs["regressed"])
    cases = {r["case_id"]: r for r in rows if r["type"] == "case"}
    assert set(data["cases"]) == set(cases)
    some = next(c for c in cases.values() if c["outcome"] == "pass")
    entry = data["cases"][some["case_id"]]
    assert entry["r"] == some["repro"] and entry["c"] == some["case"]
    assert len(entry["t"]) == sum(r["type"] == "tensor" and r["case_id"] == some["case_id"] for r in rows)
    assert data["metrics"][0] == "noise_floor_ratio"


def test_failing_cases_show_json_and_repro(rendered):
    data = load_run(rendered["dir"])
    failing = data.cases.loc[data.cases["outcome"].isin(["fail", "error"])]
    details = rendered["page"].find("details")
    assert {a["id"] for a in details} == {f"failure-{c}" for c in failing["case_id"]}
    copies = {a["data-copy"] for a in rendered["page"].find("button") if "data-copy" in a}
    assert set(failing["repro"]) <= copies


def test_mutation_section_counts_and_highlights_survivors(rendered):
    text = rendered["text"]
    assert re.search(r'<tr class="mutant survived"><td><code>lse_base2</code>', text)
    assert re.search(r'<tr class="mutant unreachable"><td><code>topk_tie_upper_index</code>', text)


def test_without_mutants_or_baseline_those_sections_say_so(copy_run):
    run_dir = copy_run("base")
    text = render_run(run_dir, baseline=None).html.read_text()
    assert 'id="mutants"' not in text and 'id="drift-none"' in text and 'id="drift-table"' not in text


def test_hostile_strings_are_escaped(tmp_path):
    rows = rows_of(n_cases=3, fail_every=1)
    evil = "</script><script>alert(1)</script><b>x</b>"
    for r in rows:
        if r["type"] == "case":
            r["message"] = evil
            r["first_failure"]["message"] = evil
    text = render_run(write_rows(rows, tmp_path), baseline=None, html=True, csv=False).html.read_text()
    assert evil not in text and "alert(1)" in text  # present, but only escaped
    assert text.count("<script") == 2  # the JSON island and the page script, nothing injected


def test_coverage_flags_a_boolean_side_no_case_reached(runs):
    data = load_run(runs["base"])
    groups = coverage(data.cases)
    assert "zero_length=true" not in gaps(groups)  # negative control: the synthetic suite has both sides
    only_false = data.cases.copy()
    only_false["features"] = [{**f, "zero_length": False} for f in only_false["features"]]
    assert "zero_length=true" in gaps(coverage(only_false))
    ratio = next(g for g in coverage(data.cases) if g["feature"] == "ratio")
    assert [v["label"] for v in ratio["values"]] == ["0", "4", "128"]
    assert sum(v["total"] for v in ratio["values"]) == len(data.cases)


def test_topk_regimes_and_providers_are_summed_over_cases(rendered, runs):
    cases = [r for r in read_rows(runs["regressed"]) if r["type"] == "case"]
    topk = [c["topk"] for c in cases if c["topk"]]
    clear, tied = sum(t["clear"] for t in topk), sum(t["tied"] for t in topk)
    assert f"<b>{clear}</b> clear" in rendered["text"] and f"<b>{tied}</b> tied" in rendered["text"]
    plan_rows = re.findall(r"<tr><td>(\w+)</td><td><code>(\w+)</code></td><td class=\"n\">(\d+)</td></tr>",
                           rendered["text"])
    assert ("attention", "reference", str(len(cases))) in plan_rows


@pytest.mark.parametrize("end, banner", [
    ({"stopped": "budget", "budget_s": 30.0, "not_run": ["aaaaaaaaaaaa"] * 5}, "Incomplete run: its time budget"),
    (None, "Incomplete stream"),
    ({}, None),  # negative control: a finished run has no banner
])
def test_incomplete_runs_say_why(tmp_path, end, banner):
    rows = rows_of(n_cases=3)
    if end is None:
        rows = rows[:-1]
    else:
        rows[-1] = {**rows[-1], **end}
    text = render_run(write_rows(rows, tmp_path), baseline=None, html=True, csv=False).html.read_text()
    if banner is None:
        assert "Incomplete" not in text
    else:
        assert banner in text
        if end:
            assert "5 of the selected cases" in text


# ---- "Tensors by class": what failed in that class (issue 32, item 5) ---------------------------------------------
def class_table_cells(text: str) -> dict[str, dict[str, str]]:
    """``{class: {column: cell text}}`` of the page's "Tensors by class" table."""
    table = text.split('id="class-table"', 1)[1].split("</table>", 1)[0]
    head = [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<th[^>]*>(.*?)</th>", table)]
    out = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1], flags=re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
        out[cells[0]] = dict(zip(head, cells))
    return out


def failed_in_class(rows: list[dict]) -> dict[str, int]:
    """Failed cases with a failing tensor of each class, from the stream itself."""
    outcome = {r["case_id"]: r["outcome"] for r in rows if r["type"] == "case"}
    hit = {(r["tensor_class"], r["case_id"]) for r in rows
           if r["type"] == "tensor" and r["verdict"] == "fail" and outcome[r["case_id"]] == "fail"}
    classes = {r["tensor_class"] for r in rows if r["type"] == "tensor"}
    return {k: sum(1 for c, _ in hit if c == k) for k in classes}


def test_cases_fail_counts_what_failed_in_each_class(tmp_path, monkeypatch):
    rows = rows_of(n_cases=40, fail_every=7, error_every=0, unsupported_every=0)
    expected = failed_in_class(rows)
    failed_cases = sum(r["type"] == "case" and r["outcome"] == "fail" for r in rows)
    assert failed_cases >= 4 and sum(expected.values()) == failed_cases  # one failing tensor per failed case
    assert any(n == 0 for n in expected.values())  # some class failed nowhere: it must not look failed
    text = render_run(write_rows(rows, tmp_path / "new"), baseline=None, csv=False).html.read_text()
    cells = class_table_cells(text)
    assert {k: int(v["cases fail"]) for k, v in cells.items()} == expected
    holding = {k: len({r["case_id"] for r in rows if r["type"] == "tensor" and r["tensor_class"] == k})
               for k in expected}
    assert {k: int(v["cases pass"]) for k, v in cells.items()} == {
        k: holding[k] - expected[k] for k in expected}

    # negative control: the table as it was (failed cases *holding* the class) does not pass this check
    from reports import summary

    def holding_failed(table):
        out = summary.outcome_by_class(None, table).rename(columns={"pass": "cases_pass", "fail": "cases_fail"})
        return out.assign(cases_known=0)[["tensor_class", "cases_pass", "cases_fail", "cases_known"]]

    monkeypatch.setattr("reports.html.class_cases", holding_failed)
    old = class_table_cells(render_run(write_rows(rows, tmp_path / "old"), baseline=None, csv=False)
                            .html.read_text())
    assert {k: int(v["cases fail"]) for k, v in old.items()} != expected
