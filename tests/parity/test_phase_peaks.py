"""Each case row records, on CUDA, the most GPU memory allocated while each phase ran (``peak_gpu_bytes``): what a
case needs of a GPU, phase by phase; and the most its allocator held (``peak_gpu_reserved_bytes``). The CUDA statistics are stood in for here (no GPU in CI): the clock resets the
peak at each phase's start and keeps the largest reading per phase; on a CPU nothing is recorded (the control)."""

from __future__ import annotations

import torch

from parity.engine import RunOptions, _PhaseClock, run_case
from parity import impls
from tests.parity.helpers import pick


class FakeCudaStats:
    """``torch.cuda``'s peak statistics over a scripted allocation history: ``allocate(n)`` raises the live bytes."""

    def __init__(self):
        self.live, self.peak, self.resets = 0, 0, 0

    def allocate(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def free(self, n: int) -> None:
        self.live -= n

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak = self.live

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def max_memory_reserved(self, device=None) -> int:  # the allocator's cache: here a fixed 10 bytes over the peak
        return self.peak + 10


def test_the_clock_keeps_each_phases_peak(monkeypatch):
    stats = FakeCudaStats()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", stats.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", stats.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", stats.max_memory_reserved)
    seconds, peaks, reserved = {}, {}, {}
    clock = _PhaseClock(seconds, "cuda", peaks, reserved=reserved)
    with clock("materialize"):
        stats.allocate(100)                  # the case's tensors stay
    with clock("impl"):
        stats.allocate(900)
        stats.free(900)                      # the implementation's peak: 1000 with the tensors
    with clock("reference"):
        stats.allocate(50)
        stats.free(50)
    with clock("impl"):                      # a second block of a phase: the larger of the two is kept
        stats.allocate(300)
        stats.free(300)
    assert peaks == {"materialize": 100, "impl": 1000, "reference": 150}
    assert reserved == {"materialize": 110, "impl": 1010, "reference": 160}
    assert stats.resets == 4 and set(seconds) == set(peaks)
    # control: on a CPU the clock reads no CUDA statistics and records none
    cpu_peaks = {}
    with _PhaseClock({}, "cpu", cpu_peaks)("impl"):
        stats.allocate(10)
    assert cpu_peaks == {} and stats.resets == 4


def test_a_cpu_case_row_has_no_peak_field_and_a_gpu_one_would():
    case = pick(dtype="float32", layout="bshd", ratio="0")
    result = run_case(case, impls.load("fused"), impls.load("reference"), RunOptions(device="cpu"))
    assert result.outcome == "pass" and "peak_gpu_bytes" not in result.rows()[0]
    assert "peak_gpu_reserved_bytes" not in result.rows()[0]
    result.peak_gpu_bytes, result.peak_gpu_reserved_bytes = {"impl": 123}, {"impl": 456}
    row = result.rows()[0]
    assert row["peak_gpu_bytes"] == {"impl": 123} and row["peak_gpu_reserved_bytes"] == {"impl": 456}
    from parity.run.results import CaseResult

    back = CaseResult.from_rows(result.rows())  # read back as written
    assert back.peak_gpu_bytes == {"impl": 123} and back.peak_gpu_reserved_bytes == {"impl": 456}
