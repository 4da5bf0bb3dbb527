"""Coverage is part of the drift gate (reports/coverage_gate.py): a run that did less than its baseline fails it.

Each way of losing coverage is planted on a synthetic run — a results file cut in half, a ``--budget-s`` stop, cases
turned unsupported, a tensor dropped, a new unsupported reason — with its negative control (the same run with equal
coverage passes), through ``compare_tables`` and through ``dsv4-parity compare`` (exit 1, the message says how much
is missing).
"""

from __future__ import annotations

import json

import pytest

from cli.main import main
from reports.baselines import load_baseline, save_baseline
from reports.coverage_gate import case_reasons, coverage_against, reason_key
from reports.drift import compare_tables
from reports.load import load_run
from reports.markdown import render_markdown
from reports.render import render_run
from reports.table import metrics_table

from .conftest import rows_of, write_rows

N = 40
BRIDGE = ("BridgeRefused: flash_mla_sparse_fwd(indexer_topk={k}): sgl-flash-mla 1.0.0 has no nv_dev API; refusing "
          "rather than emulating it")


@pytest.fixture
def baseline(tmp_path):
    """A 40-case synthetic run stored as a baseline (so it records its unsupported reasons)."""
    run = write_rows(rows_of(n_cases=N, run_id="base"), tmp_path / "base")
    data = load_run(run)
    save_baseline(data, metrics_table(data), "cpu/smoke", root=tmp_path / "baselines")
    return load_baseline("cpu/smoke", root=tmp_path / "baselines")


def gate(run_dir, baseline):
    data = load_run(run_dir)
    return compare_tables(metrics_table(data), baseline.table, reasons=case_reasons(data.cases),
                          baseline_reasons=baseline.reasons)


def compare(run_dir, tmp_path, capsys) -> tuple[int, str]:
    code = main(["compare", str(run_dir), "--baseline", "cpu/smoke", "--baselines-dir", str(tmp_path / "baselines")])
    return code, capsys.readouterr().out


def ran_case_ids(rows, n):
    return [r["case_id"] for r in rows if r["type"] == "case" and r["outcome"] in ("pass", "fail")][:n]


def turn_unsupported(rows, ids, message):
    """The cases ``ids`` declined: their tensor / metric rows gone, outcome unsupported with ``message``."""
    out = []
    for row in rows:
        if row["type"] in ("tensor", "metric") and row["case_id"] in ids:
            continue
        if row["type"] == "case" and row["case_id"] in ids:
            row = {**row, "outcome": "unsupported", "decided_by": "unsupported", "first_failure": None,
                   "message": message.format(k=128 * (1 + ids.index(row["case_id"])))}
        out.append(row)
    return out


def test_equal_coverage_passes(baseline, tmp_path, capsys):
    """Negative control: the same run again compares every case and tensor of the baseline."""
    same = write_rows(rows_of(n_cases=N, run_id="same"), tmp_path / "same")
    result = gate(same, baseline)
    assert result.passed and not result.coverage.lost and result.coverage.problems() == []
    assert result.coverage.compared == result.coverage.baseline_ran
    assert result.coverage.tensors == result.coverage.baseline_tensors > 0
    code, out = compare(same, tmp_path, capsys)
    assert code == 0 and "drift gate: PASS" in out and "coverage lost" not in out
    assert f"{result.coverage.baseline_ran} of the baseline's {result.coverage.baseline_ran} run cases compared" in out


def test_a_results_file_cut_in_half_fails_and_says_how_much_is_missing(baseline, tmp_path, capsys):
    run = write_rows(rows_of(n_cases=N, run_id="cut"), tmp_path / "cut")
    stream = run / "results.jsonl"
    data = stream.read_bytes()
    stream.write_bytes(data[: len(data) // 2])  # a torn last line too
    result = gate(run, baseline)
    assert not result.passed and result.coverage.lost and result.regressions == []
    absent = len(result.coverage.absent)
    assert 0 < absent < result.coverage.baseline_ran
    code, out = compare(run, tmp_path, capsys)
    assert code == 1
    assert f"coverage lost: {absent} of the baseline's {result.coverage.baseline_ran} run cases absent" in out
    assert "drift gate: FAIL" in out


def test_a_budget_stop_fails_the_gate(baseline, tmp_path, capsys):
    rows = rows_of(n_cases=N, run_id="budget", complete=False)
    cases = [r for r in rows if r["type"] == "case"]
    cut = cases[29]["case_id"]  # the run stopped after 30 cases
    keep = {r["case_id"] for r in cases[:30]}
    kept = [r for r in rows if r["type"] == "run" or r.get("case_id") in keep]
    kept.append({"type": "end", "counts": {}, "duration_s": 1.0, "stopped": "budget", "budget_s": 1.0,
                 "not_run": [r["case_id"] for r in cases[30:]]})
    run = write_rows(kept, tmp_path / "budget")
    result = gate(run, baseline)
    assert not result.passed and set(result.coverage.absent) <= {r["case_id"] for r in cases[30:]}
    assert cut not in result.coverage.absent and len(result.coverage.absent) > 0
    code, out = compare(run, tmp_path, capsys)
    assert code == 1 and f"{len(result.coverage.absent)} of the baseline's" in out


def test_cases_turned_unsupported_fail_with_their_reason_counted(baseline, tmp_path, capsys):
    rows = rows_of(n_cases=N, run_id="refused")
    ids = ran_case_ids(rows, 6)
    run = write_rows(turn_unsupported(rows, ids, BRIDGE), tmp_path / "refused")
    result = gate(run, baseline)
    assert not result.passed and sorted(result.coverage.now_unsupported["case_id"]) == sorted(ids)
    key = reason_key(BRIDGE.format(k=128))
    assert result.coverage.new_reasons == [key]  # six messages (six K values), one reason
    code, out = compare(run, tmp_path, capsys)
    assert code == 1
    assert "coverage lost: 6 case(s) the baseline ran now unsupported: BridgeRefused: " \
           "flash_mla_sparse_fwd(indexer_topk=N)" in out
    assert "(baseline 0, NEW)" in out  # the summary line: the reason's count against the baseline's


def test_a_missing_tensor_fails_the_gate(baseline, tmp_path, capsys):
    rows = rows_of(n_cases=N, run_id="thin")
    victim = next(r for r in rows if r["type"] == "tensor" and r["tensor"] == "grad/hidden")
    key = (victim["case_id"], victim["tensor"])
    thin = [r for r in rows if not (r["type"] in ("tensor", "metric") and (r["case_id"], r["tensor"]) == key)]
    run = write_rows(thin, tmp_path / "thin")
    result = gate(run, baseline)
    assert not result.passed
    assert result.coverage.missing_tensors.values.tolist() == [list(key)]
    assert result.coverage.tensors == result.coverage.baseline_tensors - 1
    code, out = compare(run, tmp_path, capsys)
    assert code == 1 and "1 tensor(s) compared in the baseline missing from 1 case(s) still in the run, e.g." in out
    assert f"{key[0]}/grad/hidden" in out


def test_a_new_reason_on_a_case_unsupported_in_both_fails(baseline, tmp_path):
    rows = rows_of(n_cases=N, run_id="reason")
    declined = [r["case_id"] for r in rows if r["type"] == "case" and r["outcome"] == "unsupported"]
    assert declined  # the synthetic run declines one case
    same = write_rows(rows, tmp_path / "same")
    assert gate(same, baseline).passed  # negative control: the same reason
    changed = [{**r, "message": "ConfigRefused: production's config validation refuses this case"}
               if r["type"] == "case" and r["case_id"] in declined else r for r in rows]
    result = gate(write_rows(changed, tmp_path / "changed"), baseline)
    assert not result.passed and len(result.coverage.now_unsupported) == 0 and result.coverage.absent == []
    assert result.coverage.new_reasons == ["ConfigRefused: production's config validation refuses this case"]
    assert "new unsupported reason (1 case(s)): ConfigRefused" in result.coverage.problems()[0]


def test_cases_and_tensors_only_the_run_has_are_not_gated(baseline, tmp_path):
    """Suites grow: a run with more cases (and their reasons) than its baseline keeps passing — unless a case new to
    it fails or errors (found by review: `compare` passed a run whose only failure was a new case)."""
    rows = rows_of(n_cases=N + 25, run_id="bigger")
    old = {r["case_id"] for r in rows_of(n_cases=N, run_id="base") if r["type"] == "case"}
    passing = [{**r, "outcome": "pass"} if r["type"] == "case" and r["case_id"] not in old
               and r["outcome"] in ("fail", "error") else r for r in rows]
    result = gate(write_rows(passing, tmp_path / "bigger"), baseline)
    assert result.only_current > 0 and result.passed and not result.coverage.lost
    new = next(r["case_id"] for r in passing if r["type"] == "case" and r["case_id"] not in old)
    failing = [{**r, "outcome": "fail"} if r["type"] == "case" and r["case_id"] == new else r for r in passing]
    result = gate(write_rows(failing, tmp_path / "new-fail"), baseline)
    assert not result.passed and list(result.new_failures["case_id"]) == [new]
    assert list(result.new_failures["baseline"]) == ["(new case)"]


def test_a_baseline_without_recorded_reasons_infers_them_from_the_cases_unsupported_in_both(baseline, tmp_path):
    rows = rows_of(n_cases=N, run_id="legacy")
    same = load_run(write_rows(rows, tmp_path / "same"))
    legacy = coverage_against(metrics_table(same), baseline.table, reasons=case_reasons(same.cases),
                              baseline_reasons=None)
    assert not legacy.lost and not legacy.reasons_recorded and "retake it to record them" in legacy.line()
    ids = ran_case_ids(rows, 2)
    refused = load_run(write_rows(turn_unsupported(rows, ids, BRIDGE), tmp_path / "refused"))
    lost = coverage_against(metrics_table(refused), baseline.table, reasons=case_reasons(refused.cases),
                            baseline_reasons=None)
    assert lost.lost and lost.new_reasons == [reason_key(BRIDGE.format(k=1))]


def test_reason_keys_fold_case_specific_integers_only():
    assert reason_key(BRIDGE.format(k=512)) == reason_key(BRIDGE.format(k=1024))
    key = reason_key("refuses the dense indexer loss on SM90 (cudnn-frontend 1.32.0), T=4096 rows")
    assert "SM90" in key and "1.32.0" in key and "T=N rows" in key
    assert reason_key("a\n  b") == "a b" and reason_key("") == "(no reason given)"
    assert len(reason_key("x" * 1000)) == 200


def test_every_view_says_coverage_was_lost(baseline, tmp_path):
    rows = rows_of(n_cases=N, run_id="views")
    ids = ran_case_ids(rows, 3)
    run = write_rows(turn_unsupported(rows, ids, BRIDGE), tmp_path / "views")
    rendered = render_run(run, baseline=str(baseline.path), console=None)
    assert not rendered.drift.passed
    text = render_markdown(rendered.data, rendered.table, drift=rendered.drift, baseline_name="cpu/smoke")
    assert "**coverage lost:** 3 case(s) the baseline ran now unsupported: BridgeRefused" in text
    assert "1 errored, coverage lost: 3 case(s) the baseline ran now unsupported" in text
    html = rendered.html.read_text()
    assert 'id="coverage-lost"' in html and "3 case(s) the baseline ran now unsupported" in html
    # negative control: the same views of an equal-coverage run say nothing of the kind
    same = render_run(write_rows(rows, tmp_path / "same"), baseline=str(baseline.path), console=None)
    assert 'id="coverage-lost"' not in same.html.read_text()
    assert "coverage lost" not in render_markdown(same.data, same.table, drift=same.drift)


def test_a_run_that_compared_nothing_the_baseline_ran_fails_instead_of_a_usage_error(baseline, tmp_path, capsys):
    rows = rows_of(n_cases=N, run_id="none")
    ids = [r["case_id"] for r in rows if r["type"] == "case"]
    run = write_rows(turn_unsupported(rows, ids, BRIDGE), tmp_path / "none")
    code, out = compare(run, tmp_path, capsys)
    assert code == 1 and "now unsupported" in out
    # negative control: a run sharing no case with the baseline is still an input error (another suite)
    other = write_rows(rows_of(n_cases=5, run_id="other", seed=7), tmp_path / "other")
    assert main(["compare", str(other), "--baseline", "cpu/smoke",
                 "--baselines-dir", str(tmp_path / "baselines")]) == 2


def test_the_baseline_records_its_unsupported_reasons(baseline):
    env = json.loads((baseline.path / "env.json").read_text())
    assert env["unsupported_reasons"] == {"no provider for this case on cpu": 1}
    assert baseline.reasons == env["unsupported_reasons"]


def test_a_case_that_now_errors_loses_its_tensors(baseline, tmp_path):
    """A case the baseline ran that now errors compared nothing: its tensors count as missing, said so."""
    rows = rows_of(n_cases=N, run_id="errs")
    victim = ran_case_ids(rows, 1)[0]
    broken = [r for r in rows if not (r["type"] in ("tensor", "metric") and r["case_id"] == victim)]
    broken = [{**r, "outcome": "error", "message": "RuntimeError: boom"} if r["type"] == "case"
              and r["case_id"] == victim else r for r in broken]
    result = gate(write_rows(broken, tmp_path / "errs"), baseline)
    assert not result.passed and result.coverage.errored == 1
    assert "missing from 1 case(s) still in the run (1 of them now error)" in result.coverage.problems()[0]


def engine_order(rows):
    """The engine's stream order: each ``case`` row first, with ``n_rows``, then its tensor and metric rows (the
    synthetic runs write the case row last, without ``n_rows``)."""
    out, pending = [], []
    for row in rows:
        if row["type"] in ("tensor", "metric"):
            pending.append(row)
        elif row["type"] == "case":
            out += [{**row, "n_rows": len(pending)}, *pending]
            pending = []
        else:
            out.append(row)
    return out


def test_engine_ordered_stream_passes(baseline, tmp_path, capsys):
    """Negative control of the three below: the same run in the engine's order, whole, passes."""
    run = write_rows(engine_order(rows_of(n_cases=N, run_id="whole")), tmp_path / "whole")
    assert load_run(run).cut == []
    code, out = compare(run, tmp_path, capsys)
    assert code == 0 and "coverage lost" not in out


def test_a_case_cut_off_mid_write_fails_though_its_tensors_are_there(baseline, tmp_path, capsys):
    """A case whose metric rows were lost (killed or a full disk after its tensor rows; the end row present) kept
    a verdict for every tensor: the tensor count was equal and the drift gate compared 920 of 946 pairs and passed.
    Now its missing gate metric and the cut are both coverage lost."""
    rows = engine_order(rows_of(n_cases=N, run_id="cutoff"))
    victim = ran_case_ids(rows, 5)[2]
    run = write_rows([r for r in rows if not (r["type"] == "metric" and r["case_id"] == victim)], tmp_path / "cutoff")
    assert load_run(run).cut == [victim]
    code, out = compare(run, tmp_path, capsys)
    assert code == 1 and "drift gate: FAIL" in out
    assert "the run is incomplete: 1 case(s) cut off" in out
    assert f"lack the gate metric noise_floor_ratio that the baseline has" in out and victim in out


def test_a_stream_cut_inside_its_last_case_without_an_end_row_fails_the_drift_gate(baseline, tmp_path, capsys):
    rows = [r for r in engine_order(rows_of(n_cases=N, run_id="torn")) if r["type"] != "end"]
    last = [i for i, r in enumerate(rows) if r["type"] == "case" and r["outcome"] == "pass"][-1]
    stream = write_rows(rows[:last + 1 + rows[last]["n_rows"] // 2], tmp_path / "torn") / "results.jsonl"
    stream.write_text(stream.read_text() + '{"type": "metric", "case_')  # and a torn last line
    code, out = compare(stream.parent, tmp_path, capsys)
    assert code == 1 and "the run is incomplete: no end row (killed or cut)" in out and "cut off" in out


@pytest.mark.parametrize("dropped, lost", [("noise_floor_ratio", True), ("max_abs", False)])
def test_a_tensor_without_the_gate_metric_is_coverage_lost(baseline, tmp_path, capsys, dropped, lost):
    """Every tensor keeps its verdict but the drift gate's metric is gone for a whole class (an engine change that
    stops writing it): those tensors were never judged for drift. Control: dropping another metric is not lost
    coverage (the drift gate compares ``noise_floor_ratio`` alone)."""
    rows = rows_of(n_cases=N, run_id="nometric")
    assert any(r["type"] == "metric" and r["metric"] == dropped for r in rows)
    kept = [r for r in rows if not (r["type"] == "metric" and r["metric"] == dropped
                                    and r["tensor_class"] == "grad_param")]
    result = gate(write_rows(kept, tmp_path / "nometric"), baseline)
    assert result.coverage.lost is lost and (len(result.coverage.missing_metric) > 0) is lost
    if lost:
        assert "lack the gate metric noise_floor_ratio" in result.coverage.headline()


def test_a_case_reported_again_keeps_only_its_last_reports_rows(baseline, tmp_path, capsys):
    """A case reported a second time without its rows (``n_rows`` 0, pass) does not inherit the first report's
    tensors: they are missing, and coverage is lost. Control: reported again with its rows, the gate passes."""
    rows = engine_order(rows_of(n_cases=N, run_id="twice"))
    victim = ran_case_ids(rows, 1)[0]
    first = next(i for i, r in enumerate(rows) if r["type"] == "case" and r["case_id"] == victim)
    block = rows[first:first + 1 + rows[first]["n_rows"]]
    end = [r for r in rows if r["type"] == "end"]
    body = [r for r in rows if r["type"] != "end"]
    again = write_rows(body + [{**block[0], "n_rows": 0}] + end, tmp_path / "again")
    result = gate(again, baseline)
    assert result.coverage.lost and set(result.coverage.missing_tensors["case_id"]) == {victim}
    whole = write_rows(body + block + end, tmp_path / "whole")
    assert gate(whole, baseline).passed


@pytest.mark.parametrize("value", [float("inf"), -1.0])
@pytest.mark.parametrize("share", [1.0, 0.125])
def test_a_gate_metric_no_comparison_can_give_is_a_regression(baseline, tmp_path, value, share):
    """An infinite error ratio (or a negative one) on a compared tensor is a broken comparison. Found by review:
    +inf on every tensor of a class made the class's p90 NaN, read as steady (drift gate PASS), and -1 clamped to the
    floor; the pairs' verdicts and ``passed`` fields left as they were. Now their ratio is +inf: the class regresses,
    also when only an eighth of its pairs are broken (below the p90). Control: the same run unedited passes."""
    rows = rows_of(n_cases=N, run_id="edited")
    assert gate(write_rows(rows, tmp_path / "plain"), baseline).passed
    targets = [r for r in rows if r["type"] == "metric" and r["metric"] == "noise_floor_ratio"
               and r.get("tensor_class") == "grad_param" and isinstance(r.get("value"), float)]
    hit = {id(r) for r in targets[:max(1, int(len(targets) * share))]}
    edited = [{**r, "value": value} if id(r) in hit else r for r in rows]
    result = gate(write_rows(edited, tmp_path / "edited"), baseline)
    assert not result.passed and "grad_param" in result.regressions


@pytest.mark.parametrize("edit", ["planned, never reported", "pass with a failing tensor", "odd verdict"])
def test_rows_that_contradict_each_other_fail_the_drift_gate(baseline, tmp_path, capsys, edit):
    """Found by review, each passed the drift gate: the run row plans a case that never reports (and the end row
    does not list it as not run); a case recorded as ``pass`` with a tensor whose verdict is ``fail``; a tensor
    verdict the engine never writes (``skipped``). Control: the engine-ordered stream, unedited, with its plan
    (``test_engine_ordered_stream_passes``, and here the same stream with ``planned`` naming exactly its cases)."""
    rows = engine_order(rows_of(n_cases=N, run_id="contradicts"))
    ids = [r["case_id"] for r in rows if r["type"] == "case"]
    rows[0] = {**rows[0], "planned": ids}
    code, out = compare(write_rows(rows, tmp_path / "planned"), tmp_path, capsys)
    assert code == 0 and "incomplete" not in out
    passing = next(r["case_id"] for r in rows if r["type"] == "case" and r["outcome"] == "pass" and r.get("n_rows"))
    if edit == "planned, never reported":
        rows[0] = {**rows[0], "planned": ids + ["ffffffffffff"]}
        want = "1 planned case(s) never reported, e.g. ffffffffffff"
    elif edit == "pass with a failing tensor":
        victim = next(i for i, r in enumerate(rows) if r["type"] == "tensor" and r["case_id"] == passing)
        rows[victim] = {**rows[victim], "verdict": "fail"}
        want = f"1 case(s) recorded as pass with a failing tensor, e.g. {passing}"
    else:
        victim = next(i for i, r in enumerate(rows) if r["type"] == "tensor" and r["case_id"] == passing)
        rows[victim] = {**rows[victim], "verdict": "skipped"}
        want = "1 tensor verdict(s) neither pass nor fail (e.g. 'skipped')"
    code, out = compare(write_rows(rows, tmp_path / "edited"), tmp_path, capsys)
    assert code == 1 and "drift gate: FAIL" in out and want in out, out


def with_provider(rows, provider: str, kernel: str):
    """The run declaring ``provider`` and every case's plan running ``kernel`` for each stage."""
    out = []
    for row in rows:
        if row["type"] == "run":
            row = {**row, "provider": provider}
        elif row["type"] == "case" and row.get("plan"):
            row = {**row, "plan": {stage: kernel for stage in row["plan"]}}
        out.append(row)
    return out


def gpu_baseline(tmp_path, record_kernels: bool):
    """A baseline whose cases ran the cudnn kernels under ``--provider cudnn`` (``record_kernels`` False: taken
    before baselines recorded their kernels, as the committed H200 ones were)."""
    run = write_rows(with_provider(rows_of(n_cases=N, run_id="gpu"), "cudnn", "cudnn"), tmp_path / "gpu")
    data = load_run(run)
    root = tmp_path / "gpu-baselines"
    save_baseline(data, metrics_table(data), "h200/gate", root=root)
    if not record_kernels:
        env = root / "h200/gate/env.json"
        env.write_text(json.dumps({k: v for k, v in json.loads(env.read_text()).items() if k != "kernels"}))
    return load_baseline("h200/gate", root=root)


@pytest.mark.parametrize("record_kernels", [True, False], ids=["kernels-recorded", "declared-provider-only"])
def test_a_run_whose_kernels_fell_back_to_torch_fails_against_a_baseline_that_ran_the_real_ones(
        tmp_path, record_kernels):
    """A GPU runner whose kernel packages do not import: ``--provider auto`` falls back to the torch provider, every
    comparison holds (the torch provider is contract-exact), every case and tensor is there, and yet the real kernels
    never ran. Control: the same rows with the cudnn kernels pass."""
    base = gpu_baseline(tmp_path, record_kernels)
    assert ("kernels" in base.env) is record_kernels
    fell_back = write_rows(with_provider(rows_of(n_cases=N, run_id="fb"), "auto", "torch"), tmp_path / "fb")
    data = load_run(fell_back)
    result = render_run(fell_back, baseline=str(base.path), html=False, csv=False).drift
    assert not result.passed and result.coverage.lost
    assert result.coverage.compared == result.coverage.baseline_ran  # nothing else is missing
    problem = result.coverage.problems()[0]
    assert problem.startswith("the run did other work than its baseline")
    assert ("cudnn" in problem) and (("ran in none of its cases" in problem) is record_kernels)
    same = write_rows(with_provider(rows_of(n_cases=N, run_id="ok"), "cudnn", "cudnn"), tmp_path / "ok")
    assert render_run(same, baseline=str(base.path), html=False, csv=False).drift.passed
    assert data.run["provider"] == "auto"


def test_another_implementation_or_declared_provider_is_other_work(tmp_path):
    base = gpu_baseline(tmp_path, True)
    rows = with_provider(rows_of(n_cases=N, run_id="other"), "cudnn", "cudnn")
    rows[0] = {**rows[0], "impl": "megatron", "impl_info": {"provider": "emulated"}}
    run = write_rows(rows, tmp_path / "other")
    problems = render_run(run, baseline=str(base.path), html=False, csv=False).drift.coverage.other_work
    assert problems == ["impl 'megatron', the baseline's 'fused'", "provider 'emulated', the baseline's 'cudnn'"]


def test_a_torch_fallback_the_baseline_had_is_no_loss_when_the_run_runs_the_real_kernel(tmp_path):
    """Only a non-torch kernel can be lost: a stage the baseline ran on the torch provider that now runs cudnn is
    more work, not less."""
    run = write_rows(with_provider(rows_of(n_cases=N, run_id="t"), "cudnn", "torch"), tmp_path / "t")
    data = load_run(run)
    save_baseline(data, metrics_table(data), "h200/gate", root=tmp_path / "b")
    base = load_baseline("h200/gate", root=tmp_path / "b")
    assert all(k.endswith(":torch") for k in base.env["kernels"])
    better = write_rows(with_provider(rows_of(n_cases=N, run_id="c"), "cudnn", "cudnn"), tmp_path / "c")
    assert render_run(better, baseline=str(base.path), html=False, csv=False).drift.passed


def test_a_run_directory_baseline_read_through_its_csv_keeps_the_kernel_rule(tmp_path):
    """A run directory as the baseline is read through its ``results.csv`` once that is newer than the stream (the
    usual case: its report was drawn); the kernels its cases ran still count (found by review: that path recorded
    none, so only the declared-provider fallback applied). Control: the same baseline read from its stream."""
    import os

    base_dir = write_rows(with_provider(rows_of(n_cases=N, run_id="b"), "auto", "cudnn"), tmp_path / "b")
    fell_back = write_rows(with_provider(rows_of(n_cases=N, run_id="fb"), "auto", "torch"), tmp_path / "fb")
    from_stream = render_run(fell_back, baseline=str(base_dir), html=False, csv=False).drift
    render_run(base_dir, baseline=None, html=False, csv=True)  # the baseline's results.csv, newer than its stream
    stream = base_dir / "results.jsonl"
    os.utime(stream, (stream.stat().st_atime, (base_dir / "results.csv").stat().st_mtime - 10))
    from_csv = render_run(fell_back, baseline=str(base_dir), html=False, csv=False).drift
    for drift in (from_stream, from_csv):
        assert not drift.passed and "ran in none of its cases" in drift.coverage.other_work[0]


@pytest.mark.parametrize("run_kernel, lost", [("cudnn", False), ("torch+cudnn", False), ("torch", True)])
def test_a_stage_that_ran_a_kernel_and_its_fallback_counts_for_each(tmp_path, run_kernel, lost):
    """A plan value ``cudnn+torch`` (the kernel on some calls, its fallback on others) is two kernels: a run whose
    stage ran ``cudnn`` alone, or the same two in another order, lost nothing; one that ran only the fallback lost
    the kernel (found by review: values were compared as whole strings)."""
    run = write_rows(with_provider(rows_of(n_cases=N, run_id="b"), "cudnn", "cudnn+torch"), tmp_path / "b")
    data = load_run(run)
    save_baseline(data, metrics_table(data), "h200/gate", root=tmp_path / "bl")
    base = load_baseline("h200/gate", root=tmp_path / "bl")
    assert all(k.rsplit(":", 1)[1] in ("cudnn", "torch") for k in base.env["kernels"])
    now = write_rows(with_provider(rows_of(n_cases=N, run_id="n"), "cudnn", run_kernel), tmp_path / "n")
    drift = render_run(now, baseline=str(base.path), html=False, csv=False).drift
    assert (not drift.passed) is lost and bool(drift.coverage.other_work) is lost
