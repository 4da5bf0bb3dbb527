"""index.html in headless Chromium (DevTools protocol over a pipe): no console errors, sorting, filtering, details,
and the planted regression highlighted. Skips only when no Chromium is installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reports.load import load_run
from reports.render import render_run

from .cdp import Browser, find_chromium

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(find_chromium() is None,
                                 reason="headless Chromium not installed (python tests/setup_browser.py installs "
                                        "Debian's chromium)")]

REGRESSION_BG = "rgb(253, 226, 224)"  # tr.regression td in report.css


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("browser")
    run_dir = Path(shutil.copytree(runs["regressed"], root / "regressed"))
    shutil.copy(runs["mutated"] / "mutants.jsonl", run_dir / "mutants.jsonl")
    return render_run(run_dir, baseline=str(runs["base"])).html


@pytest.fixture(scope="module")
def browser():
    with Browser(timeout=60) as b:
        yield b


@pytest.fixture
def page(browser, report):
    browser.open(report)
    return browser


def visible(page) -> list[str]:
    return page.evaluate("Array.from(document.querySelectorAll('#cases-table tr.case-row'))"
                         ".filter(r => !r.hidden).map(r => r.dataset.case)")


def column(page, key: str) -> list[str]:
    return page.evaluate(f"Array.from(document.querySelectorAll('#cases-table tr.case-row'))"
                         f".filter(r => !r.hidden).map(r => r.querySelector('td[data-col={key}]').dataset.v "
                         f"?? r.querySelector('td[data-col={key}]').textContent.trim())")


def type_filter(page, text: str) -> None:
    page.evaluate(f"(() => {{ const i = document.getElementById('case-filter'); i.value = {json.dumps(text)}; "
                  f"i.dispatchEvent(new Event('input', {{bubbles: true}})); }})()")


def test_loads_without_console_errors_and_images_decode(page):
    assert page.console_errors() == []
    assert page.evaluate("typeof window.dsv4Report") == "object"
    widths = page.evaluate("Array.from(document.images).map(i => i.complete ? i.naturalWidth : 0)")
    assert len(widths) >= 3 and all(w > 100 for w in widths)


def test_console_error_detection_catches_planted_errors(browser, report, tmp_path):
    """Negative control: a network fetch (blocked by the page's CSP) and a thrown error are both reported."""
    text = report.read_text().replace(
        "</main>", '<img src="https://example.invalid/x.png"><script>window.noSuchFunction();</script></main>', 1)
    broken = tmp_path / "broken.html"
    broken.write_text(text)
    browser.open(broken)
    errors = browser.console_errors()
    assert any("Content Security Policy" in e for e in errors)
    assert any("noSuchFunction" in e for e in errors)


def test_clicking_headers_sorts_numbers_worst_first_then_flips(page):
    page.evaluate("document.querySelector('#cases-table th[data-key=usage]').click()")
    values = [float(v) for v in column(page, "usage") if v != ""]
    assert len(values) > 10 and values == sorted(values, reverse=True)
    assert column(page, "usage")[-1] == ""  # cases without a thresholded metric sort last
    assert page.evaluate("document.querySelector('th[data-key=usage]').getAttribute('aria-sort')") == "descending"
    page.evaluate("document.querySelector('#cases-table th[data-key=usage]').click()")
    values = [float(v) for v in column(page, "usage") if v != ""]
    assert values == sorted(values)
    page.evaluate("document.querySelector('#cases-table th[data-key=case]').click()")
    ids = visible(page)
    assert ids == sorted(ids)


def test_filtering_by_outcome_text_and_numeric_predicate(page, report):
    data = load_run(report.parent)
    failing = set(data.cases.loc[data.cases["outcome"] == "fail", "case_id"])
    type_filter(page, "outcome:fail")
    assert set(visible(page)) == failing
    assert page.evaluate("document.getElementById('case-count').textContent") == \
        f"{len(failing)} of {len(data.cases)} cases shown"
    type_filter(page, "usage>1")
    assert set(visible(page)) == failing
    thd = set(data.cases.loc[data.cases["layout"] == "thd", "case_id"])
    type_filter(page, "layout:thd")
    assert set(visible(page)) == thd
    type_filter(page, "")
    page.evaluate("document.querySelector('input.outcome-toggle[value=pass]').click()")
    assert set(visible(page)) == set(data.cases.loc[data.cases["outcome"] != "pass", "case_id"])


def test_planted_regression_is_highlighted(page):
    style = ("(cls) => { const td = document.querySelector(`#drift-table tr[data-class=${cls}] td`); "
             "return getComputedStyle(td).backgroundColor; }")
    assert page.evaluate(f"({style})('grad_param')") == REGRESSION_BG
    for steady in ("out", "lse", "grad_input"):
        assert page.evaluate(f"({style})('{steady}')") != REGRESSION_BG
    status = page.evaluate("getComputedStyle(document.querySelector("
                           "'#drift-table tr[data-class=grad_param] td.status')).color")
    assert status == "rgb(197, 34, 31)"  # --fail


def test_expanding_a_failing_case_shows_its_tensors_with_the_failed_check(page, report):
    data = load_run(report.parent)
    case_id = data.cases.loc[data.cases["outcome"] == "fail", "case_id"].iloc[0]
    n_tensors = int((data.tensors["case_id"] == case_id).sum())
    page.evaluate(f"document.querySelector('tr[data-case=\"{case_id}\"] button.expand').click()")
    rows = page.evaluate(f"document.querySelector('tr[data-case=\"{case_id}\"]').nextElementSibling"
                         f".querySelectorAll('table.tensors > tbody > tr').length")
    assert rows == n_tensors
    assert page.evaluate(f"document.querySelector('tr[data-case=\"{case_id}\"]').nextElementSibling"
                         f".querySelectorAll('td.mfail').length") >= 2  # verdict + the failed metric
    page.evaluate("document.querySelector('#cases-table th[data-key=tensors]').click()")  # detail follows its row
    assert page.evaluate(f"document.querySelector('tr[data-case=\"{case_id}\"]').nextElementSibling"
                         f".classList.contains('detail')")
    assert page.console_errors() == []


def test_pairwise_coverage_matrix_counts_every_case(page, report):
    total = page.evaluate("Array.from(document.querySelectorAll('#cov-matrix tbody td'))"
                          ".reduce((s, td) => s + (parseInt(td.textContent) || 0), 0)")
    assert total == len(load_run(report.parent).cases)
