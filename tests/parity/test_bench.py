"""``dsv4-parity bench`` runs and writes a well-formed report. Speed is reported by the bench, never asserted here:
these tests check that it runs, its output schema, and the instruments it is built from (each with a negative
control)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from cases.errors import CaseError
from bench import core as bench, flops as bench_flops, harness as bench_harness, measure as bench_measure, output as bench_output, scaling as bench_scaling
from bench.workloads import Workload
from cli.main import main as cli_main

SMALL = ["bench", "--profile", "tiny", "--tokens", "64,128", "--repeats", "1", "--warmup", "0",
         "--harness-limit", "2", "--budget-s", "0", "--no-harness-report", "--startup-repeats", "1", "--quiet"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    code = cli_main(SMALL + ["--json", str(out)])
    return code, out


# ---- the command ------------------------------------------------------------------------------------------------------
def test_bench_runs_and_writes_json_and_plot(small_run):
    code, out = small_run
    assert code == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert bench_output.check_schema(report) == []
    assert report["schema"] == bench_output.SCHEMA
    assert report["settings"]["tokens"] == [64, 128] and report["settings"]["device"] in ("cpu", "cuda")


def test_bench_report_covers_every_section(small_run):
    report = json.loads(small_run[1].read_text())
    measured = {(r["tokens"], r["scope"], r["impl"]) for r in report["e2e"] if r["status"] == "ok"}
    assert measured == {(t, s, i) for t in (64, 128) for s in ("core", "layer") for i in ("fused", "reference")}
    fused = [r for r in report["e2e"] if r["impl"] == "fused"]
    assert all(r["kernels"] and r["kernel_sum_ms"] > 0 and r["composition_ratio"] > 0 for r in fused)
    assert {k["stage"] for k in fused[0]["kernels"]} >= {"indexer_forward", "sparse_attn_fwd", "sparse_attn_bwd"}
    groups = {r["group"] for r in report["stages"]}
    assert groups >= {"compressor", "indexer forward", "top-k", "sparse attention fwd", "sparse attention bwd",
                      "score recompute", "indexer backward"}
    assert all(r["reference"]["status"] == "ok" for r in report["stages"])
    assert {f["series"] for f in report["scaling"]["fits"]} >= {"reference, THD pack of fixed segments",
                                                                  "reference, one sequence"}
    breakdown = report["breakdown"]
    assert [(r["tokens"], r["status"]) for r in breakdown] == [(64, "ok"), (128, "ok")]
    for r in breakdown:  # the torch provider's ops are the provider's; the compressor and index maps are ours
        assert r["provider_ms"] > 0 and r["composition_ms"] > 0 and r["wall_ms"] > 0
        assert any(s["site"].startswith("fused/") for s in r["sites"]), r["sites"]
        assert not any(s["site"].startswith(("fused/kernels/", "parity/")) for s in r["sites"]), r["sites"]
    h = report["harness"]
    assert h["status"] == "ok" and h["cases"] == 2 and sum(h["counts"].values()) == 2
    assert 0 <= h["overhead_share"] <= 1 and "impl" in h["phases"] and "compare" in h["phases"]
    assert {t["name"] for t in report["targets"]} >= {"smoke suite on CPU", "fused core fwd+bwd / sum of its kernels"}
    startup = {r["command"]: r for r in report["startup"]["rows"]}  # issue 32, item 7: a ratio, not a timed test
    assert startup["python -c pass"]["ratio"] == 1.0
    for name in ("dsv4-parity --help", "dsv4-parity <typo>"):
        assert startup[name]["ratio"] > 0 and startup[name]["torch_loaded"] is False
    assert startup["dsv4-parity <typo>"]["exit_code"] == 2 and startup["dsv4-parity --help"]["exit_code"] == 0
    assert startup["import torch"]["torch_loaded"] is True  # negative control of the column


def test_check_schema_rejects_broken_reports(small_run):
    """Negative controls: each corruption is reported."""
    good = json.loads(small_run[1].read_text())
    broken = []
    r = copy.deepcopy(good); del r["e2e"]; broken.append(r)                                  # noqa: E702
    r = copy.deepcopy(good); r["schema"] = "other/0"; broken.append(r)                      # noqa: E702
    r = copy.deepcopy(good); r["e2e"][0]["tokens"] = "64"; broken.append(r)                 # noqa: E702
    r = copy.deepcopy(good); r["e2e"][0]["status"] = "fine"; broken.append(r)               # noqa: E702
    r = copy.deepcopy(good); r["e2e"][0]["time"]["median_ms"] = None; broken.append(r)      # noqa: E702
    r = copy.deepcopy(good); del r["stages"][0]["reference"]["time_ms"]; broken.append(r)   # noqa: E702
    r = copy.deepcopy(good); r["targets"][0]["status"] = "great"; broken.append(r)          # noqa: E702
    r = copy.deepcopy(good); del r["harness"]["overhead_share"]; broken.append(r)           # noqa: E702
    r = copy.deepcopy(good); del r["breakdown"][0]["provider_ms"]; broken.append(r)         # noqa: E702
    r = copy.deepcopy(good); del r["startup"]["rows"][2]["ratio"]; broken.append(r)         # noqa: E702
    for i, doc in enumerate(broken):
        assert bench_output.check_schema(doc), f"corruption {i} not reported"


@pytest.mark.parametrize("argv, field", [(["--profile", "huge"], "profile"), (["--tokens", "12x"], "tokens"),
                                         (["--sections", "e2e,speed"], "sections"), (["--scope", "all"], "scope")])
def test_bad_options_exit_2_naming_the_field(argv, field, capsys):
    assert cli_main(["bench"] + argv) == 2
    assert field in capsys.readouterr().err


# ---- instruments -------------------------------------------------------------------------------------------------------
def test_parse_tokens():
    assert bench.parse_tokens("4K,256,64k,256") == [256, 4096, 65536]
    with pytest.raises(CaseError, match="tokens"):
        bench.parse_tokens("-5")


def test_slope_classifies_linear_and_quadratic():
    xs = [256, 512, 1024, 2048]
    assert bench_scaling._verdict(bench_scaling._slope(xs, [3.0 * x for x in xs])) == "linear"
    assert bench_scaling._verdict(bench_scaling._slope(xs, [x * x for x in xs])) == "quadratic"  # negative control
    assert bench_scaling._slope([256], [1.0]) is None


def test_findings_name_a_quadratic_function_and_not_a_linear_one():
    def series(name, function, ys):
        return {"name": name, "impl": "reference", "kind": "function memory", "function": function,
                "points": [{"tokens": t, "status": "ok", "retained_bytes": y} for t, y in zip((256, 512, 1024), ys)]}

    all_series = [series("a: retained", "reference.indexer:index_scores", [1, 4, 16]),
                  series("b: retained", "reference.sparse_attention:sparse_attention", [1, 2, 4])]
    found = bench_scaling.findings_from_fits(all_series, bench_scaling.fit_series(all_series))
    assert [f["function"] for f in found] == ["reference.indexer:index_scores"]
    assert "reference/indexer.py:" in found[0]["where"]


def test_key_counts_match_a_brute_force_count():
    w = Workload("tiny", 100, ratio=4)
    c = w.config
    W, K = c.csa_window_size, c.dsa_indexer_topk
    counts = bench_flops.key_counts(c, [100, 37])
    rows = [(i, L) for L in (100, 37) for i in range(L)]
    assert counts.rows == 137
    assert counts.w == sum(min(i + 1, W) for i, _ in rows)
    assert counts.v == sum((i + 1) // 4 for i, _ in rows)
    assert counts.c == sum(min(K, (i + 1) // 4) for i, _ in rows)
    window_only = bench_flops.key_counts(Workload("tiny", 100, ratio=0).config, [100])
    assert window_only.v == window_only.c == 0 and window_only.keys == window_only.w


def test_model_flops_grow_linearly_with_fixed_segments():
    c = Workload("kernel", 1, ratio=4).config
    one = bench_flops.total_flops(c, bench_flops.key_counts(c, [4096]), scope="layer", loss="sparse")
    four = bench_flops.total_flops(c, bench_flops.key_counts(c, [4096] * 4), scope="layer", loss="sparse")
    single = bench_flops.total_flops(c, bench_flops.key_counts(c, [4 * 4096]), scope="layer", loss="sparse")
    assert four == pytest.approx(4 * one)
    assert single > four  # one long sequence: the indexer scores every visible entry (negative control)


def test_memory_meter_sees_an_allocation_and_its_absence():
    device = "cpu"
    if not bench_measure.MemoryMeter(device).available:
        pytest.skip("no glibc heap statistics here")
    with bench_measure.MemoryMeter(device) as meter:
        x = torch.ones(4 << 20, dtype=torch.float32)  # 16 MiB
        y = x + 1
        del x, y
    assert meter.peak >= 16 << 20
    with bench_measure.MemoryMeter(device) as idle:
        torch.zeros(16).sum()
    assert idle.peak < 4 << 20


def test_kernel_recorder_counts_calls_and_leaves_the_providers_alone():
    from fused import plan as plan_mod
    from fused.plan import load_provider

    torch_provider = load_provider("torch")[0]
    before = dict(vars(torch_provider))
    work = Workload("tiny", 64, dtype="float32", scope="core")
    from bench.workloads import forward_backward, make_tensors
    import fused

    step = forward_backward(fused, work.case, make_tensors(work, "cpu"), lambda: fused.use_backend("torch"))
    with bench_measure.KernelRecorder("cpu") as rec:
        assert plan_mod._OBSERVERS == [rec.observe] and vars(torch_provider) == before
        step()
        rec.flush()
        once = {stage: s.calls for (stage, _p), s in rec.stats.items()}
        step()
        rec.flush()
    assert plan_mod._OBSERVERS == [] and vars(torch_provider) == before
    assert once["sparse_attn_fwd"] >= 1 and once["sparse_attn_bwd"] >= 1
    calls = {stage: s.calls for (stage, _p), s in rec.stats.items()}
    assert calls == {stage: 2 * n for stage, n in once.items()}
    assert rec.total_seconds > 0
    step()  # outside the recorder nothing is recorded (negative control)
    assert {stage: s.calls for (stage, _p), s in rec.stats.items()} == calls


def test_engine_phases_sum_the_case_rows(tmp_path):
    """The harness reads the engine's own ``phases_s``: summed over case rows; other rows (and a case row of an
    older run without ``phases_s``) add nothing (negative control)."""
    rows = [{"type": "run"}, {"type": "case", "phases_s": {"materialize": 0.5, "impl": 1.0}},
            {"type": "case", "phases_s": {"impl": 2.0, "compare": 0.25}}, {"type": "case"},
            {"type": "tensor", "phases_s": {"impl": 100.0}}, {"type": "end"}]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"type": "case", "phases_s": {"impl"')  # torn
    assert bench_harness.engine_phases(bench_harness.case_rows(path)) == {"materialize": 0.5, "impl": 3.0,
                                                                          "compare": 0.25}


def _bench(**changes):
    """A :class:`bench.core.Bench` on the tiny profile, settings as the command line would give."""
    from cli.main import build_parser

    ns = build_parser().parse_args(["bench", "--profile", "tiny", "--tokens", "64", "--repeats", "1", "--budget-s", "0",
                            "--quiet"])
    settings = bench.resolve_settings(ns)
    for k, v in changes.items():
        setattr(settings, k, v)
    report = bench.empty_report(settings, [])
    return bench.Bench(settings, report, lambda _m: None)


def test_an_out_of_memory_run_becomes_a_row_and_the_bench_goes_on(monkeypatch):
    b = _bench()
    work = b.workload("tiny", 64, scope="core")
    real = bench.make_tensors

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(bench, "make_tensors", boom)
    row = b.e2e(work, "reference", None)
    assert row["status"] == "oom" and "out of memory" in row["message"]
    monkeypatch.setattr(bench, "make_tensors", real)
    other = b.e2e(work.with_(scope="layer"), "reference", None)
    assert other["status"] == "ok"  # negative control: the same bench measures the next workload


def test_budget_and_size_limits_skip_rows():
    import time as _time

    b = _bench(ref_max_tokens=32)
    work = b.workload("tiny", 64, scope="core")
    assert b.e2e(work, "reference", None)["status"] == "skipped"  # above --ref-max-tokens
    assert b.e2e(work, "fused", _time.monotonic() - 1)["status"] == "skipped"  # deadline passed
    assert b.e2e(work.with_(tokens=32), "reference", None)["status"] == "ok"  # negative control


class _FakeCudaAllocator:
    """Stands in for the CUDA caching allocator's statistics and events, so the CUDA branches run on a CPU."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.events = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n):
        self.allocated -= n

    def install(self, monkeypatch):
        import time as _time

        alloc = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                alloc.events += 1
                self.t = _time.perf_counter()

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: alloc.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: alloc.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: setattr(alloc, "peak", alloc.allocated))


def test_cuda_memory_windows_keep_the_outer_peak_across_resets(monkeypatch):
    fake = _FakeCudaAllocator()
    fake.install(monkeypatch)
    fake.alloc(1000)  # the inputs: below the meter's start
    with bench_measure.MemoryMeter("cuda") as meter:
        fake.alloc(300)
        with meter.window() as w:  # resets the allocator's peak: the outer one must survive it
            fake.alloc(200)
            fake.free(200)
        with meter.window() as idle:
            pass
        fake.free(300)
    assert (meter.peak, w.peak, idle.peak, meter.retained) == (500, 200, 0, 0)


def test_cuda_timing_uses_events(monkeypatch):
    fake = _FakeCudaAllocator()
    fake.install(monkeypatch)
    timing = bench_measure.time_call(lambda: None, "cuda", warmup=1, repeats=3)
    assert len(timing.seconds) == 3 and fake.events == 6
    bench_measure.time_call(lambda: None, "cpu", warmup=0, repeats=2)
    assert fake.events == 6  # negative control: the CPU clock records no event


def test_the_json_is_checkpointed_after_every_row_and_section(tmp_path):
    """A bench killed mid-way keeps what it measured: the JSON is rewritten (``partial``) after every e2e row and
    after each section."""
    seen = []
    args = bench.resolve_settings(_parsed(SMALL + ["--sections", "e2e,harness", "--json", str(tmp_path / "b.json")]))
    final = bench.run_bench(args, checkpoint=lambda doc: seen.append(copy.deepcopy(doc)))
    rows = len(final["e2e"])  # 2 tokens x 2 scopes x (fused, reference)
    assert rows == 8 and [len(d["e2e"]) for d in seen[:rows]] == list(range(1, rows + 1))
    assert all("sections_done" not in d for d in seen[:rows])  # mid-section: rows, no section done yet
    assert [d["sections_done"] for d in seen[rows:]] == [["e2e"], ["e2e", "harness"]]
    assert all(d["partial"] is True for d in seen) and "partial" not in final
    assert seen[rows]["e2e"] and not seen[rows]["harness"] and seen[-1]["harness"]


def _parsed(argv):
    from cli.main import build_parser

    return build_parser().parse_args(argv)


def test_graph_replay_target_uses_the_worst_breakdown_row(small_run):
    report = json.loads(small_run[1].read_text())
    settings = _cpu_settings()
    rows = [dict(status="ok", profile="kernel", tokens=t, wall_ms=w, busy_ms=b, provider_ms=p, graph=g)
            for t, w, b, p, g in ((4096, 14.0, 6.0, 4.0, {"ms": 6.0, "error": None}),
                                  (32768, 54.0, 52.0, 40.0, {"ms": 44.0, "error": None}),
                                  (8192, 9.0, 8.0, 5.0, {"ms": None, "error": "RuntimeError: capture"}))]
    report["breakdown"] = rows
    names = {t["name"]: t for t in bench.evaluate_targets(report, settings)}
    graphed = names["fused core fwd+bwd as a CUDA graph / sum of its kernels"]
    assert graphed["measured"] == 1.5 and graphed["status"] == "missed" and "T=4096" in graphed["note"]
    report["breakdown"] = [dict(rows[1])]  # 44 / 40 = 1.1
    names = {t["name"]: t for t in bench.evaluate_targets(report, settings)}
    assert names["fused core fwd+bwd as a CUDA graph / sum of its kernels"]["status"] == "met"
    report["breakdown"] = [dict(rows[2])]  # negative control: a failed capture gives no graph row
    names = {t["name"]: t for t in bench.evaluate_targets(report, settings)}
    assert "fused core fwd+bwd as a CUDA graph / sum of its kernels" not in names


def _cpu_settings():
    from cli.main import build_parser

    return bench.resolve_settings(build_parser().parse_args(["bench", "--profile", "tiny", "--tokens", "64",
                                                             "--device", "cpu"]))


def test_time_call_starts_no_repeat_that_would_end_past_the_deadline(monkeypatch):
    """The bench's budget: a repeat whose predicted end (now + the last repeat's time) is past the deadline is not
    started (it used to start whenever the deadline had not yet passed, and ran on past it)."""
    clock = [0.0]
    monkeypatch.setattr(bench_measure.time, "monotonic", lambda: clock[0])

    class Watch:  # each call of fn takes 1 s of the fake clock
        def __init__(self, device):
            pass

        def start(self):
            self.t0 = clock[0]

        def stop(self):
            self.t1 = clock[0]

        def seconds(self):
            return self.t1 - self.t0

    monkeypatch.setattr(bench_measure, "Stopwatch", Watch)

    def fn():
        clock[0] += 1.0

    timing = bench_measure.time_call(fn, "cpu", warmup=0, repeats=10, target_s=100.0, deadline=2.5)
    assert len(timing.seconds) == 2 and clock[0] <= 2.5  # a third repeat would have ended at 3.0
    clock[0] = 0.0
    assert len(bench_measure.time_call(fn, "cpu", warmup=0, repeats=10, target_s=100.0, deadline=None).seconds) == 10


def test_the_gate_target_is_judged_only_on_the_h200_it_names():
    """The PR gate's wall-time targets are one H200's: the same whole-gate run on another card is reported with its
    minutes and not judged; on an H200 it is (control), met or missed by the run's own ``met``."""
    settings = _cpu_settings()
    settings.device = "cuda"  # the report's device (no GPU needed to judge a report)
    run = {"run": "warm", "wall_s": 93.2, "target_s": 60.0, "met": False, "cases": 227, "outcomes": {"pass": 204},
           "exit_code": 0, "compile": {"totals": {}}}
    name = "PR gate, warm compiled-kernel cache, one H200"

    def judged(gpu):
        report = {"env": {"gpu": gpu}, "machine": {}, "e2e": [], "gate": {"suite": "gate", "runs": [dict(run)]}}
        return {t["name"]: t for t in bench.evaluate_targets(report, settings)}[name]

    h100 = judged("NVIDIA H100 80GB HBM3")
    assert h100["status"] == "not judged"
    assert "on an NVIDIA H100 80GB HBM3: the target is one H200's, not judged" in h100["note"]
    assert h100["measured"] == 1.55
    h200 = judged("NVIDIA H200")
    assert h200["status"] == "missed" and "not judged" not in h200["note"]
