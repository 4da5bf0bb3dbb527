"""The results stream: row schema, resume after a kill, summary line, JUnit XML."""

import json
import xml.etree.ElementTree as ET

from parity.judge.verdict import MetricRow, TensorResult
from parity.run import results
from parity.run.junit import write_junit
from tests.parity.helpers import pick

CASE_FIELDS = {"type", "case_id", "case", "outcome", "decided_by", "first_failure", "message", "duration_s", "phases_s", "repro",
               "features", "plan", "topk"}
TENSOR_FIELDS = {"type", "case_id", "tensor", "tensor_class", "dtype", "shape", "verdict", "rule"}
METRIC_FIELDS = {"type", "case_id", "tensor", "tensor_class", "metric", "value", "threshold", "passed"}


def _result(case, outcome="pass", value=0.5):
    t = TensorResult("out", "out", "float32", [2, 3], "pass" if outcome == "pass" else "fail", "noise_floor",
                     metrics=[MetricRow("noise_floor_ratio", value, 3.0, value <= 3.0), MetricRow("max_abs", 1e-7),
                              MetricRow("scale_ratio", float("inf"), 3.0, False), MetricRow("x", float("nan"))])
    return results.CaseResult(case=case, outcome=outcome, decided_by="noise_floor", repro=case.repro, tensors=[t],
                        message="" if outcome == "pass" else "out: too far",
                        first_failure=None if outcome == "pass" else {"tensor": "out", "rule": "noise_floor",
                                                                       "message": "out: too far"})


def test_rows_follow_the_schema_and_are_strict_json():
    case = pick(dtype="float32", layout="bshd", ratio="0")
    rows = _result(case).rows()
    assert [r["type"] for r in rows] == ["case", "tensor"] + ["metric"] * 4
    assert set(rows[0]) == CASE_FIELDS and set(rows[1]) == TENSOR_FIELDS
    assert all(set(r) == METRIC_FIELDS for r in rows[2:])
    text = "\n".join(results.dumps(r) for r in rows)
    assert "Infinity" not in text and "NaN" not in text
    metrics = {r["metric"]: r for r in rows[2:]}
    assert metrics["scale_ratio"]["value"] == results.FLOAT_MAX and metrics["x"]["value"] is None
    assert metrics["max_abs"]["threshold"] is None and metrics["max_abs"]["passed"] is None
    back = results.CaseResult.from_rows(json.loads(json.dumps(rows)))
    assert back.case == case and back.tensors[0].metrics[0].value == 0.5


def test_resume_drops_torn_and_orphan_rows_and_the_end_row(tmp_path):
    a = pick(dtype="float32", layout="bshd", ratio="0")
    b = pick(dtype="float64", layout="bshd", ratio="0")
    c = pick(dtype="bfloat16", layout="bshd", ratio="0")
    path = tmp_path / "results.jsonl"
    with results.ResultsWriter(path) as w:
        w.write([{"type": "run", "run_id": "r1"}])
        w.write(_result(a).rows())
        w.write(_result(b, "fail").rows())
        w.write([{"type": "end", "counts": {}, "duration_s": 1.0}])
    orphan = [r for r in _result(c).rows() if r["type"] != "case"]  # a case killed mid-write
    with open(path, "a") as fh:
        fh.write("".join(results.dumps(r) + "\n" for r in orphan) + '{"type": "metric", "case_id"')
    existing = results.read_for_resume(path)
    assert existing.run_row["run_id"] == "r1"
    assert existing.outcomes == {a.id: "pass", b.id: "fail"}
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in kept].count("end") == 0
    assert all(r.get("case_id") != c.id for r in kept)
    assert results.read_for_resume(tmp_path / "none.jsonl").outcomes == {}


def test_resume_runs_errors_and_cases_that_did_not_fit_their_gpu_again(tmp_path):
    """An ``error`` and an ``unsupported`` case of rule ``device-memory`` (it did not fit the GPU it ran on: a run
    resumed on a larger one may fit it) run again; a kernel's refusal (``unsupported``, rule ``unsupported``) is kept."""
    a, b, c = (pick(dtype=d, layout="bshd", ratio="0") for d in ("float32", "float64", "bfloat16"))
    path = tmp_path / "results.jsonl"
    refused = _result(c, "unsupported")
    memory = _result(b, "unsupported")
    memory.decided_by = "device-memory"
    with results.ResultsWriter(path) as w:
        w.write([{"type": "run", "run_id": "r1"}])
        w.write(_result(a, "error").rows())
        w.write(memory.rows())
        w.write(refused.rows())
    existing = results.read_for_resume(path)
    assert existing.errored == [a.id] and existing.larger_gpu == [b.id]  # no capacity in its message: run again
    assert existing.outcomes == {c.id: "unsupported"}


def test_a_resume_on_a_gpu_of_the_same_size_keeps_the_cases_that_did_not_fit_it(tmp_path):
    """A ``device-memory`` case runs again only on a larger GPU than the one whose capacity torch's message names
    (79.18 GiB here): on the same card (its exact size either side of the message's rounding) it is kept, as decided;
    on a 139.80 GiB GPU, or where the resuming run is on no GPU, it runs again (``larger_gpu``)."""
    from tests.parity.pool_child import OOM_BEYOND

    a, b = (pick(dtype=d, layout="bshd", ratio="0") for d in ("float32", "float64"))
    memory = _result(b, "unsupported")
    memory.decided_by = "device-memory"
    memory.first_failure = {"tensor": None, "rule": "device-memory", "message": OOM_BEYOND}
    gib = 1 << 30

    def resumed(capacity):
        path = tmp_path / f"results-{capacity}.jsonl"
        with results.ResultsWriter(path) as w:
            w.write([{"type": "run", "run_id": "r1"}])
            w.write(_result(a).rows())
            w.write(memory.rows())
        return results.read_for_resume(path, capacity)

    for same in (int(79.175 * gib), int(79.18 * gib), int(79.1849 * gib)):
        kept = resumed(same)
        assert kept.outcomes == {a.id: "pass", b.id: "unsupported"} and kept.larger_gpu == []
    for again in (int(139.80 * gib), None):
        larger = resumed(again)
        assert larger.outcomes == {a.id: "pass"} and larger.larger_gpu == [b.id] and larger.errored == []


def test_summary_line():
    counts = results.counts(["pass", "pass", "fail", "error", "unsupported", "pass"])
    assert results.summary_line(counts) == "6 cases: 3 passed, 1 failed, 1 errors, 1 unsupported"


def test_junit_marks_failures_errors_and_skips_with_the_repro(tmp_path):
    a = pick(dtype="float32", layout="bshd", ratio="0")
    b = pick(dtype="float64", layout="bshd", ratio="0")
    c = pick(dtype="bfloat16", layout="bshd", ratio="0")
    path = tmp_path / "results.jsonl"
    err = results.CaseResult(case=c, outcome="error", decided_by="error", message="boom",
                             repro="dsv4-parity run --case X")
    with results.ResultsWriter(path) as w:
        w.write([{"type": "run", "run_id": "r1", "suite": "smoke", "impl": "fused"}])
        for res in (_result(a), _result(b, "fail"), err):
            w.write(res.rows())
    root = ET.parse(write_junit(path, tmp_path / "j" / "junit.xml")).getroot()
    assert root.get("tests") == "3" and root.get("failures") == "1" and root.get("errors") == "1"
    cases = {tc.get("name"): tc for tc in root.iter("testcase")}
    failure = cases[b.id].find("failure")
    assert failure is not None and "repro: dsv4-parity run --case" in failure.text
    assert cases[c.id].find("error").get("message") == "boom"
    assert cases[a.id].find("failure") is None and cases[a.id].find("error") is None
