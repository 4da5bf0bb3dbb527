"""compare-runs: two runs agree case by case, whatever the file order, durations and workers — and any real
difference (a metric bit, an outcome, a case set, a killed run) is told apart."""

import json

import pytest

from cli.main import main
from parity.compare_runs import compare, load


def case_rows(cid, outcome="pass", value=0.125, worker=0, duration=0.5, message=""):
    return [
        {"type": "case", "case_id": cid, "case": {}, "outcome": outcome, "decided_by": "aggregate",
         "first_failure": None, "message": message, "duration_s": duration, "repro": f"repro {worker}",
         "features": {"layout": "bshd"}, "plan": {"attention": "torch"}, "topk": None, "worker": worker,
         "device": f"cuda:{worker}"},
        {"type": "tensor", "case_id": cid, "tensor": "out", "tensor_class": "out", "dtype": "float32",
         "shape": [2, 4], "verdict": "pass", "rule": "aggregate"},
        {"type": "metric", "case_id": cid, "tensor": "out", "tensor_class": "out", "metric": "max_abs",
         "value": value, "threshold": 1.0, "passed": True},
        {"type": "metric", "case_id": cid, "tensor": "out", "tensor_class": "out", "metric": "nan",
         "value": None, "threshold": None, "passed": None},
    ]


def write(path, blocks, *, workers=1, end=True):
    rows = [{"type": "run", "run_id": path.name, "workers": workers}]
    for block in blocks:
        rows += block
    if end:
        rows.append({"type": "end", "counts": {}, "duration_s": 10.0 / workers})
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def single(tmp_path):
    return write(tmp_path / "one", [case_rows("a"), case_rows("b", value=3e-7), case_rows("c", outcome="fail")])


def test_same_results_in_another_order_on_other_workers_agree(single, tmp_path, capsys):
    other = write(tmp_path / "four", [case_rows("c", outcome="fail", worker=3, duration=0.1),
                                      case_rows("a", worker=1, duration=9.0), case_rows("b", value=3e-7, worker=2)],
                  workers=4)
    got = compare(load(single), load(other))
    assert got.ok and got.compared == 3 and not got.differences
    assert main(["compare-runs", str(single), str(other / "results.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "3 cases in both, 0 differ" in out and "AGREE" in out and "wall-time ratio A/B: 4.00x" in out


def test_one_bit_of_one_metric_is_a_difference(single, tmp_path, capsys):
    bumped = write(tmp_path / "bumped", [case_rows("a"), case_rows("b", value=3.0000000000000004e-7),
                                         case_rows("c", outcome="fail")])
    got = compare(load(single), load(bumped))
    assert not got.ok and got.differing_cases == ["b"]
    assert got.differences[0].what == "metric out.max_abs: value"
    assert compare(load(single), load(bumped), rel_tol=1e-12).ok  # unless a tolerance is asked for
    assert main(["compare-runs", str(single), str(bumped)]) == 1
    assert "DIFFER" in capsys.readouterr().out


@pytest.mark.parametrize("change, what", [
    (lambda rows: rows[0].update(outcome="fail"), "outcome"),
    (lambda rows: rows[0].update(plan={"attention": "cudnn"}), "plan"),
    (lambda rows: rows[1].update(verdict="fail"), "tensor out: verdict"),
    (lambda rows: rows[2].update(threshold=2.0), "metric out.max_abs: threshold"),
    (lambda rows: rows.pop(3), "metric out.nan"),
    (lambda rows: rows.pop(1), "tensor out"),
])
def test_each_compared_field_is_told_apart(single, tmp_path, change, what):
    rows = case_rows("a")
    change(rows)
    other = write(tmp_path / "other", [rows, case_rows("b", value=3e-7), case_rows("c", outcome="fail")])
    got = compare(load(single), load(other))
    assert not got.ok and {d.what for d in got.differences} == {what}


def test_verdicts_only_ignores_values_and_the_deciding_rule_but_not_a_verdict(single, tmp_path, capsys):
    """Two GPU runs: other values, another rule decided a passing tensor — the same verdicts (and a flip is not)."""
    rows = case_rows("a", value=0.5)
    rows[1].update(rule="noise_floor")
    rows[0].update(decided_by="noise_floor")
    other = write(tmp_path / "gpu", [rows, case_rows("b", value=4e-7), case_rows("c", outcome="fail")])
    assert not compare(load(single), load(other)).ok  # the default is bit-identical
    got = compare(load(single), load(other), verdicts_only=True)
    assert got.ok and got.compared == 3
    assert main(["compare-runs", "--verdicts", str(single), str(other)]) == 0
    assert "(outcomes and verdicts only): AGREE" in capsys.readouterr().out
    assert main(["compare-runs", "--verdicts", "--rel-tol", "0.1", str(single), str(other)]) == 2
    assert "--rel-tol would be ignored" in capsys.readouterr().err
    # negative controls: a tensor verdict or an outcome that flips is still a difference
    flipped = case_rows("a")
    flipped[1].update(verdict="fail")
    other = write(tmp_path / "flip", [flipped, case_rows("b", value=3e-7), case_rows("c", outcome="pass")])
    got = compare(load(single), load(other), verdicts_only=True)
    assert {(d.case_id, d.what) for d in got.differences} == {("a", "tensor out: verdict"), ("c", "outcome")}
    # two errors of another kind differ; of the same kind (another stderr tail) they agree
    crash_a = write(tmp_path / "ea", [case_rows("x", outcome="error", message="RuntimeError: CUDA fault at 1")])
    crash_b = write(tmp_path / "eb", [case_rows("x", outcome="error", message="RuntimeError: CUDA fault at 2")])
    crash_c = write(tmp_path / "ec", [case_rows("x", outcome="error", message="TimeoutError: case ran 1800 s")])
    assert compare(load(crash_a), load(crash_b), verdicts_only=True).ok
    assert not compare(load(crash_a), load(crash_c), verdicts_only=True).ok


def test_a_different_case_set_and_a_killed_run_differ(single, tmp_path):
    fewer = write(tmp_path / "fewer", [case_rows("a"), case_rows("b", value=3e-7)], end=False)
    got = compare(load(single), load(fewer))
    assert got.only_a == ["c"] and not got.differences and not got.ok
    assert any("no end row" in p for p in got.problems)
    assert compare(load(single), load(fewer), common_only=True).ok  # the common cases do agree
    swapped = write(tmp_path / "swapped", [case_rows("a"), case_rows("b", value=3e-7), case_rows("d")])
    got = compare(load(single), load(swapped))
    assert got.only_a == ["c"] and got.only_b == ["d"] and not got.ok


def test_crash_messages_agree_on_their_kind_only(tmp_path):
    crash = "worker crashed (exit code 3): "
    a = write(tmp_path / "a", [case_rows("x", outcome="error", message=crash + "tail one")])
    b = write(tmp_path / "b", [case_rows("x", outcome="error", message=crash + "a different stderr tail")])
    c = write(tmp_path / "c", [case_rows("x", outcome="error", message="timed out after 5 s (worker killed): t")])
    assert compare(load(a), load(b)).ok
    assert [d.what for d in compare(load(a), load(c)).differences] == ["message"]


def test_cases_that_did_not_fit_their_gpu_agree_whatever_torch_said(tmp_path):
    """Two runs in which a case did not fit the GPU (rule ``device-memory``) agree though torch's numbers moved
    (held + asked depend on the allocator's state); the message's stage must match. Control: a kernel's refusal
    (rule ``unsupported``) keeps comparing its whole message."""
    def refused(message, rule="device-memory"):
        rows = case_rows("x", outcome="unsupported", message=message)
        rows[0].update(decided_by=rule, first_failure={"tensor": None, "rule": rule,
                                                       "message": "OutOfMemoryError: " + message[-9:]})
        return rows[:1]

    fit = "megatron run: does not fit the GPU's 79 GiB even alone: needs at least {} GiB"
    a = write(tmp_path / "a", [refused(fit.format(84))])
    b = write(tmp_path / "b", [refused(fit.format(86))])
    assert compare(load(a), load(b)).ok
    c = write(tmp_path / "c", [refused(fit.format(86).replace("megatron run", "megatron run with dO on padding"))])
    assert [d.what for d in compare(load(a), load(c)).differences] == ["message"]
    d = write(tmp_path / "d", [refused("KernelRefused: topk=128", "unsupported")])
    e = write(tmp_path / "e", [refused("KernelRefused: topk=256", "unsupported")])
    assert "message" in [x.what for x in compare(load(d), load(e)).differences]


def test_a_case_written_twice_keeps_the_last_copy_and_is_reported(single, tmp_path):
    twice = write(tmp_path / "twice", [case_rows("a", value=9.0), case_rows("a"), case_rows("b", value=3e-7),
                                       case_rows("c", outcome="fail")])
    got = compare(load(single), load(twice))
    assert not got.differences and any("twice" in p for p in got.problems) and not got.ok


def test_unreadable_input_is_a_usage_error(single, tmp_path, capsys):
    assert main(["compare-runs", str(single), str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no results file" in err


def test_the_comparison_runs_without_torch(single, tmp_path):
    """``compare-runs`` reads dictionaries only (:mod:`parity.run.stream`): a whole comparison, one that differs,
    leaves torch unloaded (control: ``tests/test_startup.py::test_the_probe_sees_torch_where_a_command_loads_it``)."""
    from bench.startup import probe_command

    bumped = write(tmp_path / "bumped", [case_rows("a", value=0.25), case_rows("b", value=3e-7),
                                         case_rows("c", outcome="fail")])
    assert probe_command(["compare-runs", str(single), str(bumped)]) == (False, 1)  # ran, found the difference
    assert probe_command(["compare-runs", str(single), str(single)]) == (False, 0)
