"""The expected GPU peak of a case (``parity.run.memory.expected_gpu_bytes``), which the worker pool's memory
admission uses, against what torch reported on the H100 gate of 2026-12-06, and where the runner turns it on."""

import csv
from pathlib import Path

import pytest

from cases.suites import load_suite
from parity.engine import RunOptions
from parity.run import memory, runner
from parity.run.out_of_memory import least_need
from parity.run.placement import plan_slots

H100_RUN = Path(__file__).resolve().parents[2] / "reports/baselines/h100/megatron-pr-gate-20261206/cases.csv"


def h100_unfused_rows():
    with open(H100_RUN, newline="") as handle:
        return [r for r in csv.DictReader(handle) if r["run"] == "head-unfused"]


def test_the_unfused_model_covers_every_measured_need_and_fits_what_ran_alone():
    cases = {c.id: c for c in load_suite("gate")}
    needs = {r["case_id"]: least_need(r["message"]) for r in h100_unfused_rows()}
    measured = {cid: need[0] for cid, need in needs.items() if need is not None}
    assert len(measured) == 8  # the eight cases that ran out of memory alone on the 79 GiB card
    for cid, need in measured.items():
        assert memory.expected_gpu_bytes(cases[cid], "megatron", "unfused") >= need, cid
    # negative control: the buffer alone (or 4 ×) is below what they needed
    assert any(4 * memory.unfused_gather_bytes(cases[cid]) < need for cid, need in measured.items())
    # and the model does not exceed the H200 (139.8 GiB) on any gate case: each can run there
    assert max(memory.expected_gpu_bytes(c, "megatron", "unfused") for c in cases.values()) < 139 * 2**30


@pytest.mark.parametrize("impl,provider", [("fused", "cudnn"), ("megatron", "cudnn"), ("megatron", "emulated"),
                                           ("reference", None)])
def test_paths_without_a_model_weigh_nothing(impl, provider):
    case = load_suite("gate")[0]
    assert memory.expected_gpu_bytes(case, impl, provider) == 0
    assert memory.expected_gpu_bytes(case, "megatron", "unfused") > 0  # control


def test_the_runner_admits_by_memory_only_on_a_shared_gpu(monkeypatch):
    monkeypatch.setattr(memory, "device_total_bytes", lambda: 80 * 2**30)
    monkeypatch.setattr(runner, "resolved_provider", lambda options: options.provider)
    options = RunOptions(impl="megatron", provider="unfused")
    shared = plan_slots(4, "cuda", tokens=["0"], cpu_count=16)
    admission = runner._memory_admission(options, "cuda", shared)
    assert admission["capacity"] == 76 * 2**30  # 1 GiB per worker's CUDA context
    case = load_suite("gate")[0]
    assert admission["weigh"](case) == memory.expected_gpu_bytes(case, "megatron", "unfused")
    assert runner._memory_admission(options, "cuda", plan_slots(2, "cuda", tokens=["0", "1"])) == {}  # a GPU each
    assert runner._memory_admission(options, "cpu", plan_slots(2, "cpu")) == {}


def test_a_measured_peak_wins_over_the_model_on_any_path():
    case = load_suite("gate")[0]
    measured = {case.id: 10 << 30}
    expected = int(memory.MEASURED_MARGIN * (10 << 30)) + memory.MEASURED_SLACK
    assert memory.expected_gpu_bytes(case, "fused", "cudnn", measured) == expected
    assert memory.expected_gpu_bytes(case, "megatron", "unfused", measured) == expected
    # controls: another case's measurement does not apply; without one the model / 0 stands
    assert memory.expected_gpu_bytes(case, "fused", "cudnn", {"another": 1 << 40}) == 0
    assert memory.expected_gpu_bytes(case, "megatron", "unfused", {}) == int(
        memory.UNFUSED_PEAK_PER_GATHER[("512_keys_and_up" if memory._compressed_keys_per_row(case) >= 512
                                        else "other")] * memory.unfused_gather_bytes(case))


def test_the_runner_weighs_by_the_measured_peaks_it_is_given(monkeypatch):
    monkeypatch.setattr(memory, "device_total_bytes", lambda: 80 * 2**30)
    monkeypatch.setattr(runner, "resolved_provider", lambda options: options.provider)
    case = load_suite("gate")[0]
    admission = runner._memory_admission(RunOptions(impl="fused", provider="cudnn"), "cuda",
                                         plan_slots(3, "cuda", tokens=["0"], cpu_count=12), {case.id: 1 << 30})
    assert admission["weigh"](case) == memory.expected_gpu_bytes(case, "fused", "cudnn", {case.id: 1 << 30}) > 0


def test_the_cli_reads_the_peaks_of_this_paths_baseline_on_this_gpu(monkeypatch):
    import torch

    import cli.run_command
    import reports.baselines
    from cli.run_command import measured_peaks

    assert measured_peaks("gate", RunOptions(impl="megatron", provider="unfused", device="cpu")) is None
    options = RunOptions(impl="megatron", provider="unfused")
    asked = []
    monkeypatch.setattr(RunOptions, "torch_device", lambda self: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(cli.run_command, "resolved_provider", lambda options: options.provider)
    monkeypatch.setattr(reports.baselines, "measured_peaks",
                        lambda arch, name, root=None: asked.append((arch, name)) or {"x": 1})
    assert measured_peaks("gate", options) == {"x": 1}
    assert asked == [("h200", "megatron-unfused-gate")]


def test_the_h100s_measured_fused_path_memory_covers_the_gate_and_keeps_its_largest_cases_apart():
    from reports.baselines import measured_peaks

    peaks = measured_peaks("h100", "megatron-cudnn-gate")
    cases = {c.id: c for c in load_suite("gate")}
    assert set(peaks) == set(cases)
    weights = sorted((memory.expected_gpu_bytes(cases[cid], "megatron", "cudnn", peaks) for cid in peaks),
                     reverse=True)
    capacity = memory.admission_capacity(int(79.18 * 2**30), 6)
    assert weights[0] + weights[1] > capacity  # the two largest (~33 GiB each, × 1.15) no longer run together
    assert weights[-1] + weights[-2] < capacity  # control: small ones still share


def test_the_h100s_measured_unfused_peaks_stand_for_the_h200_and_fit_it():
    """``h100/megatron-unfused-gate/memory.csv`` (all 227 gate cases, run on an H100 on 2026-12-07; the 2026-12-06
    baseline lacked 9 that ran out of its 80 GB then) is what an H200 run of production's unfused path admits by,
    having none of its own: every gate case has a peak, every peak fits the H200 beside nothing, and the cases the
    model weighs above half the card (run nearly alone by it) weigh less measured (the model held them apart from
    every other case)."""
    from reports.baselines import measured_peaks

    peaks = measured_peaks("h200", "megatron-unfused-gate")
    assert peaks == measured_peaks("h100", "megatron-unfused-gate") and len(peaks) == 227
    cases = {c.id: c for c in load_suite("gate")}
    assert set(peaks) == set(cases)
    capacity = memory.admission_capacity(int(139.80 * 2**30), 6)
    measured = {cid: memory.expected_gpu_bytes(cases[cid], "megatron", "unfused", peaks) for cid in peaks}
    modelled = {cid: memory.expected_gpu_bytes(cases[cid], "megatron", "unfused") for cid in peaks}
    assert max(measured.values()) < capacity
    heavy = [c for c in peaks if modelled[c] > capacity / 2]
    assert len(heavy) >= 10 and all(measured[c] < modelled[c] for c in heavy)


def test_the_h100s_fused_gate_peaks_are_what_its_processes_held_and_keep_its_largest_cases_apart():
    """``h100/gate/memory.csv`` (the fused gate on an H100, 2026-12-07, 204 cases run; 6 of them had run out of
    memory beside five others, the gate admitting by nothing) keeps what each case's allocator held from the GPU,
    and that is what an H100 or H200 run of the fused gate admits by: the reserved peak, above the allocations on
    every case; the H100 runs at most two of the largest cases together and the H200 at most four; the smallest
    still share (control)."""
    import pandas as pd

    from reports.baselines import BASELINES_ROOT, PEAKS_NAME, measured_peaks

    table = pd.read_csv(BASELINES_ROOT / "h100" / "gate" / PEAKS_NAME, dtype={"case_id": str})
    assert len(table) == 204 and (table["peak_gpu_reserved_bytes"] >= table["peak_gpu_bytes"]).all()
    peaks = measured_peaks("h200", "gate")
    assert peaks == dict(zip(table["case_id"], table["peak_gpu_reserved_bytes"]))
    cases = {c.id: c for c in load_suite("gate")}
    weights = sorted((memory.expected_gpu_bytes(cases[cid], "fused", "cudnn", peaks) for cid in peaks), reverse=True)
    h100, h200 = (memory.admission_capacity(int(gib * 2**30), 6) for gib in (79.18, 139.80))
    assert sum(weights[:3]) > h100 and sum(weights[:5]) > h200
    assert sum(weights[-6:]) < h100  # control: six small ones share either card
