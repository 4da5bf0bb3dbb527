"""Sharding a sweep (``--workers N|auto``): worker count, placement, cost order, and end to end — the merged
``results.jsonl`` of two workers equals one worker's case by case, resume works, a crash costs one case."""

import dataclasses
import json
import shutil

import pytest

from cases.errors import CaseError
from cases.layout import BshdLayout
from cases.suites import load_suite
from parity.run import placement, shard
from cli.main import main
from parity.compare_runs import compare, load
from tests.parity.helpers import pick


def rows(out_dir):
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]


def ids(*cases):
    return [arg for c in cases for arg in ("--case-id", c.id)]


# ---- worker count and placement --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("AUTO", "auto"), ("3", 3), (1, 1), (None, 1)])
def test_workers_values(value, expected):
    assert placement.parse_workers(value) == expected


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", 0])
def test_bad_workers_values_name_the_field(value):
    with pytest.raises(CaseError, match="^workers: must be a positive integer or 'auto'"):
        placement.parse_workers(value)


@pytest.mark.parametrize("device, cores, gpus, expected", [
    ("cuda", 1, 1, 1),     # too few cores for a second worker: 1 // 2 = 0, clamped up to 1 per GPU
    ("cuda", 2, 1, 1),
    ("cuda", 4, 1, 2),
    ("cuda", 8, 1, 4),
    ("cuda", 16, 1, 6),    # the H100 / H200 machines: 6 workers share the GPU (measured best of 4 / 6 / 8)
    ("cuda", 64, 1, 6),    # at most 6 per GPU, however many cores
    ("cuda", 16, 2, 8),    # 4 per GPU
    ("cuda", 6, 3, 3),     # 1 per GPU
    ("cuda", 64, 8, 32),
    ("cuda", 128, 8, 48),  # 6 per GPU on an 8-GPU host
    ("cuda", 16, 0, 1),    # no visible GPU
    ("cpu", 16, 0, 1),     # CPU: one worker, as before
    ("cpu", 128, 8, 1),
])
def test_auto_workers_per_gpu_follow_the_cores(device, cores, gpus, expected):
    assert placement.auto_workers(device, gpus, cores) == expected
    tokens = [str(i) for i in range(gpus)]
    assert placement.resolve_workers("auto", device, tokens=tokens, cpu_count=cores) == expected


def test_auto_on_one_gpu_shares_it_with_two_threads_each():
    workers = placement.resolve_workers("auto", "cuda", tokens=["3"], cpu_count=16)
    slots = placement.plan_slots(workers, "cuda", tokens=["3"], cpu_count=16)
    assert [s.device for s in slots] == ["cuda:3"] * 6
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in slots} == {"3"} and {s.threads for s in slots} == {2}
    assert set(slots[0].env) == {"CUDA_VISIBLE_DEVICES", "DSV4_PARITY_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}


def test_explicit_and_cpu_worker_counts():
    assert placement.resolve_workers("auto", "cpu") == 1
    assert placement.resolve_workers("4", "cpu") == 4  # an explicit N runs anywhere (CPU workers are testable)
    assert placement.visible_cuda_devices(None, 3) == ["0", "1", "2"]
    assert placement.visible_cuda_devices("2, 5", 2) == ["2", "5"]  # the parent's own pinning is respected
    assert placement.visible_cuda_devices("2,5,7", 2) == ["2", "5"]  # only what CUDA enumerates
    assert placement.visible_cuda_devices("", 4) == []


def test_each_gpu_worker_is_pinned_to_one_device():
    slots = placement.plan_slots(4, "cuda", tokens=["3", "7"], cpu_count=16)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["3", "7", "3", "7"]  # round-robin past 2 GPUs
    assert [s.device for s in slots] == ["cuda:3", "cuda:7", "cuda:3", "cuda:7"]
    assert {s.env["DSV4_PARITY_THREADS"] for s in slots} == {"4"}  # 16 cores / 4 workers
    # negative control: one worker is the run as before sharding — not pinned, default threads
    one = placement.plan_slots(1, "cuda", tokens=["3", "7"], cpu_count=16)
    assert one[0].env == {} and one[0].device == "cuda:3" and one[0].threads is None


def test_cpu_workers_are_single_threaded_and_unpinned():
    slots = placement.plan_slots(2, "cpu", cpu_count=2)
    assert all(s.env == {"DSV4_PARITY_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} for s in slots)
    assert [s.device for s in slots] == ["cpu", "cpu"]
    assert placement.plan_slots(1, "cpu")[0].env == {}  # one worker: unchanged
    assert placement.plan_slots(1, "cpu", threads=3)[0].env["DSV4_PARITY_THREADS"] == "3"  # --threads wins


# ---- cost estimate and order -----------------------------------------------------------------------------------------
def test_the_cost_grows_with_every_size_factor():
    case = pick(dtype="float32", layout="bshd", ratio="4", loss="sparse", scope="layer")
    base = shard.estimate_cost(case)
    cfg = case.config
    bigger = {
        "tokens": dataclasses.replace(case, layout=BshdLayout(case.layout.batch, case.layout.seq_len * 2)),
        "batch": dataclasses.replace(case, layout=BshdLayout(case.layout.batch * 2, case.layout.seq_len)),
        "heads": dataclasses.replace(case, config=cfg.replace(num_attention_heads=cfg.num_attention_heads * 2)),
        "window": dataclasses.replace(case, config=cfg.replace(csa_window_size=cfg.csa_window_size * 4)),
        "dtype": dataclasses.replace(case, dtype="bfloat16"),  # bf16 on CPU: slower per multiply-add
    }
    for name, other in bigger.items():
        assert shard.estimate_cost(other) > base, name
    # negative controls: less work costs less
    assert shard.estimate_cost(dataclasses.replace(case, scope="core")) < base  # no projections
    assert shard.estimate_cost(dataclasses.replace(case, training=False)) < base  # no indexer loss
    assert shard.estimate_cost(dataclasses.replace(case, config=cfg.replace(dsa_indexer_topk=1))) < base
    # the device changes the dtype factors: fp32 is the cheap dtype on CPU, bf16 on CUDA
    f32 = dataclasses.replace(case, dtype="float32")
    bf16 = dataclasses.replace(case, dtype="bfloat16")
    assert shard.estimate_cost(f32, "cpu") < shard.estimate_cost(bf16, "cpu")
    assert shard.estimate_cost(f32, "cuda") > shard.estimate_cost(bf16, "cuda")


def is_descending(cases, device="cpu"):
    costs = [shard.estimate_cost(c, device) for c in cases]
    return all(a >= b for a, b in zip(costs, costs[1:]))


def test_the_queue_is_most_expensive_first():
    smoke = load_suite("smoke")
    ordered = shard.by_cost(smoke)
    assert sorted(c.id for c in ordered) == sorted(c.id for c in smoke)  # a permutation
    assert is_descending(ordered)
    assert not is_descending(smoke)  # negative control: the suite order is not (the check can fail)
    gate = load_suite("gate")[:3]  # kernel-sized cases outrank every tiny one
    assert {c.id for c in shard.by_cost(smoke + gate, "cuda")[:3]} == {c.id for c in gate}


# ---- end to end ------------------------------------------------------------------------------------------------------
def smoke_cases():
    return [pick(dtype="float64", layout="bshd", ratio="0"), pick(dtype="float32", layout="thd", ratio="0"),
            pick(dtype="float64", layout="thd", ratio="4"), pick(dtype="bfloat16", layout="bshd", ratio="4")]


def test_two_workers_give_one_workers_results_case_by_case_and_resume(tmp_path, capsys):
    cases = smoke_cases()
    one, two = tmp_path / "one", tmp_path / "two"
    # the reference: one worker, in-process, at the thread count of the CPU workers (bitwise equality needs it)
    assert main(["run", "--suite", "smoke", *ids(*cases), "--workers", "1", "--threads", "1", "--out", str(one),
                 "--quiet"]) == 0
    assert main(["run", "--suite", "smoke", *ids(*cases), "--workers", "2", "--out", str(two), "--quiet"]) == 0
    got = rows(two)
    assert [r["type"] for r in got].count("run") == 1 and got[-1]["type"] == "end"
    assert got[0]["workers"] == 2 and got[0]["devices"] == ["cpu", "cpu"] and got[0]["threads"] == 1
    case_rows = [r for r in got if r["type"] == "case"]
    assert sorted(r["case_id"] for r in case_rows) == sorted(x.id for x in cases)
    assert {r["worker"] for r in case_rows} == {0, 1} and {r["device"] for r in case_rows} == {"cpu"}
    # the timeline: each case's span (handed out -> finished) lies in the run; the end row sums them
    end = got[-1]
    spans = [r["at_s"] for r in case_rows]
    assert all(0 <= a <= b <= end["duration_s"] + 1e-3 for a, b in spans)
    busy = end["occupancy"]
    assert busy["workers"] == 2 and busy["processes_started"] == 2 and busy["waited_for_memory"] == 0
    assert busy["prestarted"] == 2  # both children were started before torch was loaded here (parity.run.prestart)
    assert 0 <= end["prelude_s"] < 60  # the command's time before its run's clock started (here: from main's call)
    assert busy["case_s"] == pytest.approx(sum(b - a for a, b in spans), abs=0.01)
    assert 0 < busy["share"] <= 1

    agreement = compare(load(one), load(two))
    assert agreement.ok, agreement.differences[:5]
    assert agreement.compared == 4 and len(load(two).metrics) == 4  # metric rows were compared, not vacuous

    # killed while writing the last case: everything before it is kept, --resume --workers 2 reruns only that one
    last = max(i for i, r in enumerate(got) if r["type"] == "case")
    text = "".join(json.dumps(r) + "\n" for r in got[:last]) + '{"type":"case","case_id":"'
    (two / "results.jsonl").write_text(text)
    killed = tmp_path / "killed"
    shutil.copytree(two, killed)
    capsys.readouterr()
    assert main(["run", "--suite", "smoke", *ids(*cases), "--workers", "2", "--out", str(two), "--resume",
                 "--quiet"]) == 0
    out = capsys.readouterr()
    assert "resuming: 3 cases already done, 1 to run" in out.err and "4 cases: 4 passed" in out.out
    assert compare(load(one), load(two)).ok
    # negative control: the same helper tells a different case set apart
    short = compare(load(one), load(killed))
    assert not short.ok and short.only_a == [got[last]["case_id"]] and not short.differences
    assert main(["compare-runs", str(one), str(two)]) == 0


def test_a_worker_crash_fails_only_its_case(tmp_path):
    crash = pick(dtype="float32", layout="thd", ratio="0")  # reference_crashes dies (os._exit(3)) on THD cases
    fine = pick(dtype="float32", layout="bshd", ratio="0")
    out = tmp_path / "r"
    code = main(["run", "--suite", "smoke", *ids(crash, fine), "--impl", "tests.parity.fakes:reference_crashes",
                 "--workers", "2", "--out", str(out), "--quiet"])
    assert code == 1
    got = {r["case_id"]: r for r in rows(out) if r["type"] == "case"}
    assert got[crash.id]["outcome"] == "error" and "worker crashed (exit code 3)" in got[crash.id]["message"]
    assert got[fine.id]["outcome"] == "pass"
    assert {got[crash.id]["worker"], got[fine.id]["worker"]} == {0, 1}  # they ran side by side
    assert rows(out)[-1]["counts"] == {"pass": 1, "fail": 0, "error": 1, "unsupported": 0}


@pytest.mark.parametrize("argv, field", [
    (["--workers", "0"], "workers"),
    (["--workers", "many"], "workers"),
    (["--workers", "2", "--isolate", "none"], "isolate"),
    (["--threads", "0"], "threads"),
])
def test_bad_sharding_options_are_one_line_usage_errors(argv, field, tmp_path, capsys):
    case = pick(dtype="float64", layout="bshd", ratio="0")
    out = tmp_path / "r"
    assert main(["run", "--suite", "smoke", *ids(case), *argv, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {field}:"), err
    assert not (out / "results.jsonl").exists()  # refused before anything was written


def test_one_worker_in_process_records_where_it_ran(tmp_path):
    case = pick(dtype="float64", layout="bshd", ratio="0")
    assert main(["run", "--suite", "smoke", *ids(case), "--impl", "reference", "--out", str(tmp_path / "r"),
                 "--quiet"]) == 0
    got = rows(tmp_path / "r")
    assert got[0]["workers"] == 1 and got[0]["devices"] == ["cpu"] and isinstance(got[0]["threads"], int)
    row = next(r for r in got if r["type"] == "case")
    assert row["worker"] == 0 and row["device"] == "cpu"


def test_occupancy_is_the_case_time_over_the_workers_wall_time():
    from parity.run.runner import occupancy, occupancy_line

    o = occupancy([1.0, 2.0, 3.0], workers=2, wall_s=6.0, processes=3, waited=1)
    assert o == {"workers": 2, "wall_s": 6.0, "case_s": 6.0, "share": 0.5, "processes_started": 3,
                 "waited_for_memory": 1, "prestarted": 0}
    assert occupancy_line(o) == ("workers: 2 over 6 s, busy 50 % (cases handed out to finished: 6 s); 3 worker "
                                 "process(es) started, 1 case(s) waited for GPU memory")
    early = occupancy([1.0], workers=2, wall_s=2.0, processes=3, waited=0, prestarted=2)
    assert "3 worker process(es) started (2 before the run)," in occupancy_line(early)
    assert occupancy([], workers=1, wall_s=0.0, processes=0, waited=0)["share"] is None  # no time: no share
