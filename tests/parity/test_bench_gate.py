"""The bench's gate section (bench/gate.py): cold / warm runs over one compiled-kernel cache, phases summed
from results.jsonl, compile counters summed from the processes' stats files, targets and cold-vs-warm agreement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fused.kernels import compile_cache
from bench import gate as bench_gate


def fake_gate(outcomes_by_run, compiled_by_run, seen_env):
    """A stand-in for ``subprocess.run`` of ``dsv4-parity run``: writes the results stream and a stats file."""
    def runner(cmd, env, timeout, **_kw):
        out = Path(cmd[cmd.index("--out") + 1])
        label = out.name
        seen_env.append(env)
        out.mkdir(parents=True)
        rows = [{"type": "run"}]
        for i, outcome in enumerate(outcomes_by_run[label]):
            rows.append({"type": "case", "case_id": f"c{i}", "outcome": outcome,
                         "phases_s": {"materialize": 1.0, "impl": 3.0, "reference": 0.5, "compare": 0.5},
                         **({"impl_kernels": {"calls": 4, "seconds": 0.25}} if outcome == "pass" else {})})
        rows.append({"type": "end"})
        (out / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        stats = Path(env[compile_cache.ENV_STATS])
        stats.mkdir(parents=True)
        n = compiled_by_run[label]
        row = {"compiled": n, "compile_s": 8.0 * n, "loaded": 2 - n, "load_s": 0.01}
        for pid in (1, 2):
            doc = {"pid": pid, "store": "/c/dsa-kernels/v1/e", "off": None, "stats": {"sparse_attn_bwd": row}}
            (stats / f"{pid}.json").write_text(json.dumps(doc))
        return subprocess.CompletedProcess(cmd, 1 if "fail" in outcomes_by_run[label] else 0, stdout="done\n")
    return runner


def test_cold_then_warm_over_one_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", "/somewhere/else")
    seen = []
    runner = fake_gate({"cold": ["pass", "unsupported"], "warm": ["pass", "unsupported"]}, {"cold": 2, "warm": 0},
                       seen)
    cache = tmp_path / "kc"
    (cache / "dsa-kernels").mkdir(parents=True)
    (cache / "dsa-kernels" / "stale").write_text("x")
    section = bench_gate.gate_section(tmp_path / "g", cache_dir=cache, runner=runner)
    cold, warm = section["runs"]
    assert not (cache / "dsa-kernels" / "stale").exists()  # cold starts from an empty cache
    assert all(e[compile_cache.ENV_DIR] == str(cache) for e in seen)  # both runs share it
    assert all("CUTE_DSL_CACHE_DIR" not in e for e in seen)  # derived by the child from its own root
    assert cold["cases"] == 2 and cold["outcomes"] == {"pass": 1, "unsupported": 1}
    assert cold["phases_s"] == {"materialize": 2.0, "impl": 6.0, "reference": 1.0, "compare": 1.0}
    assert cold["phase_share"]["impl"] == 0.6
    assert cold["compile"]["processes"] == 2 and cold["compile"]["totals"]["compiled"] == 4
    assert cold["compile"]["stores"] == ["/c/dsa-kernels/v1/e"] and cold["compile"]["off"] == []
    assert cold["compile"]["per_kernel"]["sparse_attn_bwd"]["compile_s"] == 32.0
    assert warm["compile"]["totals"]["compiled"] == 0 and warm["compile"]["totals"]["loaded"] == 4
    assert cold["met"] is True and warm["met"] is True and cold["target_s"] == 120 and warm["target_s"] == 60
    assert section["cold_vs_warm"]["agree"]
    # the pace against the implementation's own time: 2 cases, impl 6 s summed
    assert cold["impl_per_case_s"] == 3.0 and cold["wall_over_impl"] == round(cold["wall_s"] / 6.0, 2)
    # and against its kernel calls alone: one case timed them (0.25 s, 4 calls), the unsupported one ran none
    assert cold["impl_kernels"] == {"cases": 1, "calls": 4, "seconds": 0.25}
    assert cold["kernel_per_case_s"] == 0.125 and cold["wall_over_kernels"] == round(cold["wall_s"] / 0.25, 1)


def test_kernel_pace_without_timed_kernels_says_none():
    """Negative control: a run whose rows timed no kernel (an implementation without ``observe_kernels``, or one
    written before) gives no kernel ratio rather than a ratio over zero."""
    pace = bench_gate.kernel_pace(10.0, 2, 4.0, 0.0)
    assert pace["wall_over_kernels"] is None and pace["kernel_per_case_s"] is None
    assert bench_gate.kernel_pace(10.0, 2, 4.0)["wall_over_kernels"] is None
    assert bench_gate.kernel_pace(10.0, 2, 4.0, 0.5)["wall_over_kernels"] == 20.0


def test_the_production_gate_runs_megatron_against_its_own_target(tmp_path):
    seen, commands = [], []
    runner = fake_gate({"warm": ["pass"]}, {"warm": 0}, seen)
    section = bench_gate.gate_section(tmp_path / "g", runs=("warm",), impl="megatron",
                                      runner=lambda cmd, **kw: commands.append(cmd) or runner(cmd, **kw))
    (warm,) = section["runs"]
    assert commands[0][commands[0].index("--impl") + 1] == "megatron" and section["impl"] == "megatron"
    assert warm["target_s"] == 90
    fused = []
    bench_gate.gate_section(tmp_path / "f", runs=("warm",), runner=lambda cmd, **kw: fused.append(cmd) or
                            fake_gate({"warm": ["pass"]}, {"warm": 0}, [])(cmd, **kw))
    assert "--impl" not in fused[0]  # negative control: the fused gate is make parity's own command


def test_a_failure_or_a_changed_verdict_is_reported(tmp_path):
    runner = fake_gate({"cold": ["pass", "pass"], "warm": ["pass", "fail"]}, {"cold": 1, "warm": 0}, [])
    section = bench_gate.gate_section(tmp_path / "g", runner=runner)
    warm = section["runs"][1]
    assert warm["met"] is False and warm["exit_code"] == 1
    assert section["cold_vs_warm"] == {"common_cases": 2, "differing": ["c1"], "agree": False}


def test_a_repeated_run_is_kept_beside_the_first_and_its_spread_reported(tmp_path):
    runner = fake_gate({"cold": ["pass"], "warm": ["pass"], "warm-2": ["pass"]}, {"cold": 1, "warm": 0, "warm-2": 0},
                       [])
    clock = iter([0.0, 100.0, 100.0, 150.0, 150.0, 210.0])
    section = bench_gate.gate_section(tmp_path / "g", runs=("cold", "warm", "warm"), runner=runner,
                                      clock=lambda: next(clock))
    cold, warm, again = section["runs"]
    assert (warm["run"], warm["repeat"], again["run"], again["repeat"]) == ("warm", 1, "warm", 2)
    assert Path(again["out"]).name == "warm-2" and Path(warm["out"]).name == "warm"  # the repeat overwrote nothing
    assert again["target_s"] == 60  # judged as a warm run
    assert section["spread"] == {"warm": {"runs": 2, "wall_s": [50.0, 60.0], "min_s": 50.0, "max_s": 60.0,
                                          "spread": 0.2}}
    assert section["repeat_vs_first"] == {"warm-2": {"common_cases": 1, "differing": [], "agree": True}}
    # negative control: runs named once each have no spread
    single = bench_gate.gate_section(tmp_path / "h", runs=("cold", "warm"),
                                     runner=fake_gate({"cold": ["pass"], "warm": ["pass"]}, {"cold": 1, "warm": 0}, []))
    assert "spread" not in single


def test_spread_leaves_out_a_run_cut_by_its_deadline_and_a_gate_that_skipped_work_misses_its_target(tmp_path):
    rows = [{"run": "warm", "exit_code": 0, "cases": 2, "wall_s": 50.0},
            {"run": "warm", "exit_code": None, "cases": 1, "wall_s": 9.0},  # timed out: its deadline, not the gate
            {"run": "warm", "exit_code": 1, "cases": 2, "wall_s": 55.0}]
    assert bench_gate.run_spread(rows) == {"warm": {"runs": 2, "wall_s": [50.0, 55.0], "min_s": 50.0, "max_s": 55.0,
                                                    "spread": 0.1}}
    assert bench_gate.run_spread(rows[:2]) == {}
    with pytest.raises(ValueError, match="unknown run hot"):
        bench_gate.gate_section(tmp_path / "x", runs=("warm", "hot"), runner=None)

    def did_not_fit(cmd, **kw):  # a case declined for GPU memory: the gate did less than its suite
        proc = fake_gate({"warm": ["pass", "unsupported"]}, {"warm": 0}, [])(cmd, **kw)
        path = Path(cmd[cmd.index("--out") + 1]) / "results.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[2]["decided_by"] = "device-memory"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return proc

    (warm,) = bench_gate.gate_section(tmp_path / "m", runs=("warm",), runner=did_not_fit)["runs"]
    assert warm["device_memory"] == 1 and warm["met"] is False
    (plain,) = bench_gate.gate_section(tmp_path / "n", runs=("warm",),
                                       runner=fake_gate({"warm": ["pass", "unsupported"]}, {"warm": 0}, []))["runs"]
    assert plain["device_memory"] == 0 and plain["met"] is True  # control: a kernel's refusal is the suite's own


def test_budget_skips_runs_that_cannot_start(tmp_path):
    runner = fake_gate({"cold": ["pass"]}, {"cold": 1}, [])
    section = bench_gate.gate_section(tmp_path / "g", runs=("cold",), budget_s=5, runner=runner)
    assert section["runs"] == [{"run": "cold", "repeat": 1, "skipped": "budget"}]


def test_summarize_tolerates_a_torn_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"type": "case", "case_id": "a", "outcome": "pass", "phases_s": {"impl": 2.0}})
                    + "\n{\"type\": \"ca")
    s = bench_gate.summarize_results(path)
    assert s["cases"] == 1 and s["phases_s"]["impl"] == 2.0
    assert s["occupancy"] is None  # a killed run has no end row


def test_summarize_reads_the_workers_occupancy_from_the_end_row(tmp_path):
    path = tmp_path / "results.jsonl"
    busy = {"workers": 6, "wall_s": 935.0, "case_s": 504.3, "share": 0.0899, "processes_started": 23,
            "waited_for_memory": 40}
    path.write_text(json.dumps({"type": "case", "case_id": "a", "outcome": "pass", "phases_s": {"impl": 2.0}}) + "\n"
                    + json.dumps({"type": "end", "counts": {"pass": 1}, "duration_s": 935.0, "occupancy": busy}))
    assert bench_gate.summarize_results(path)["occupancy"] == busy


def test_a_gate_commands_wall_splits_into_before_during_and_after_its_run(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"type": "case", "case_id": "a", "outcome": "pass", "phases_s": {"impl": 2.0}}) + "\n"
                    + json.dumps({"type": "end", "counts": {"pass": 1}, "duration_s": 70.0, "prelude_s": 9.5}))
    summary = bench_gate.summarize_results(path)
    assert (summary["run_s"], summary["prelude_s"]) == (70.0, 9.5)
    assert bench_gate.outside_the_run(85.0, summary) == 5.5
    # an end row written before prelude_s was recorded, or a killed run: nothing is made up
    assert bench_gate.outside_the_run(85.0, {"run_s": 70.0, "prelude_s": None}) is None
    assert bench_gate.outside_the_run(85.0, {"run_s": None, "prelude_s": None}) is None


def test_real_run_of_two_smoke_cases(tmp_path):
    """The plumbing end to end on the CPU: the real ``dsv4-parity run`` subprocess (smoke, torch provider)."""
    section = bench_gate.gate_section(tmp_path / "g", suite="smoke", provider="torch", workers="1", limit=2,
                                      make_default=False)  # (the default also renders and links reports/out/latest)
    cold, warm = section["runs"]
    assert cold["exit_code"] == 0, cold["output_tail"]
    assert cold["cases"] == 2 and cold["outcomes"].get("pass") == 2 and cold["phases_s"]["impl"] > 0
    assert warm["cases"] == 2 and section["cold_vs_warm"]["agree"]
    assert cold["met"] is True  # 2 smoke cases are far inside the gate's targets
    assert cold["occupancy"]["workers"] == 1 and cold["occupancy"]["case_s"] > 0


@pytest.mark.parametrize("sections", ["gate", "harness,gate"])
def test_bench_accepts_the_opt_in_section(sections):
    import argparse

    from bench import core
    from cli import bench_command

    parser = argparse.ArgumentParser()
    bench_command.add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--sections", sections, "--device", "cpu", "--gate-limit", "3",
                              "--gate-runs", "warm", "--gate-budget-s", "500"])
    settings = core.resolve_settings(args)
    assert "gate" in settings.sections and settings.gate["limit"] == 3 and settings.gate["runs"] == ["warm"]
    assert settings.gate["budget_s"] == 500
    default = core.resolve_settings(parser.parse_args(["bench", "--device", "cpu"]))
    assert "gate" not in default.sections
