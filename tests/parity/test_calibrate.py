"""``dsv4-parity calibrate``: worst cases over passing cases, written into the policy's measured blocks only."""

import json

from parity.calibrate import measure
from parity.run import results
from cli.main import main
from parity.judge.verdict import MetricRow, TensorResult
from parity.policy import POLICY_PATH, load
from tests.parity.helpers import pick


def _write(path, cases_and_values):
    with results.ResultsWriter(path) as w:
        w.write([{"type": "run", "run_id": "r1", "suite": "smoke", "impl": "fused", "provider": "auto"}])
        for case, outcome, ratio in cases_and_values:
            t = TensorResult("out", "out", case.dtype, [1], "pass", "noise_floor",
                             metrics=[MetricRow("noise_floor_ratio", ratio, 3.0, ratio <= 3),
                                      MetricRow("cosine", 1 - ratio * 1e-6, 0.999, True)])
            w.write(results.CaseResult(case=case, outcome=outcome, decided_by="noise_floor", tensors=[t],
                                 plan={"sparse_attn_fwd": "torch"}).rows())


def test_measure_takes_the_worst_passing_case(tmp_path):
    a = pick(dtype="bfloat16", layout="bshd", ratio="0")
    b = pick(dtype="bfloat16", layout="thd", ratio="0")
    c = pick(dtype="bfloat16", layout="bshd", ratio="128")
    _write(tmp_path / "results.jsonl", [(a, "pass", 0.5), (b, "pass", 1.5), (c, "fail", 9.0)])
    worst, sources = measure([tmp_path])
    assert worst[("out", "bfloat16", "torch")]["noise_floor_ratio"] == (1.5, b.id)
    assert worst[("out", "bfloat16", "torch")]["cosine"][1] == b.id
    assert list(sources.values()) == [2]
    with_failures, _ = measure([tmp_path], include_failures=True)
    assert with_failures[("out", "bfloat16", "torch")]["noise_floor_ratio"] == (9.0, c.id)


def test_write_updates_measured_blocks_not_thresholds(tmp_path, capsys):
    a = pick(dtype="bfloat16", layout="bshd", ratio="0")
    _write(tmp_path / "results.jsonl", [(a, "pass", 1.25)])
    policy = tmp_path / "policy.json"
    policy.write_text(POLICY_PATH.read_text())
    assert main(["calibrate", str(tmp_path), "--policy", str(policy), "--write"]) == 0
    assert "worst 1.25" in capsys.readouterr().out
    before = json.loads(POLICY_PATH.read_text())["classes"]["out"]["bfloat16"]["*"]
    after = load(policy).tolerance("out", "bfloat16", "torch")
    assert after.noise_floor_ratio == before["noise_floor_ratio"]
    assert after.measured["noise_floor_ratio"] == 1.25
    assert after.measured["cosine_eps"] == 1.25e-6 and "smoke fused" in after.measured["from"]
    assert main(["calibrate", str(tmp_path / "missing")]) == 2  # negative control: a missing file is a usage error
