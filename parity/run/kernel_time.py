"""The implementation's own kernel time in a case: how long its kernel calls took on the device's clock.

* :class:`Stopwatch` — one region timed with a ``torch.cuda.Event`` pair on CUDA (asynchronous: read after the
  device is synchronised) or ``time.perf_counter`` on the CPU.
* :class:`KernelTime` — the observer an implementation's ``observe_kernels(observer)`` hook runs every kernel call
  inside (``fused.observe_kernels``, production's kernel seam in ``adapters.megatron``): the calls and their summed
  seconds, outermost calls only (a kernel called inside another is not counted twice); a call that raised is left out.

The engine attaches a :class:`KernelTime` to the implementation's calls (its ``impl`` phase: its run, the run with
``dO`` on padding rows only, its public compressor / indexer; not under ``--cp``, whose ranks run in other
processes) and records ``impl_kernels: {calls, seconds}`` in the case row, so a run's wall time can be set against
the sum of the kernel times it exists to check (``bench --sections gate``: how far the harness is from the GPU's own pace). On CUDA an
event pair measures the stream's timeline between the call's start and end: a GPU shared with other processes
stretches it, and the launch gaps inside a call count too.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class Stopwatch:
    """Times a region on the device's clock: CUDA events (asynchronous, read after a synchronise) or the CPU's
    ``perf_counter``."""

    def __init__(self, device: str):
        self.device = device
        self._start = self._end = None
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        if self.device == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.device == "cuda":
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        """Elapsed seconds (on CUDA the caller has synchronised)."""
        if self.device == "cuda":
            return self._start.elapsed_time(self._end) / 1e3
        return self._t1 - self._t0


class KernelTime:
    """``with observe_kernels(timer.observe): run()``, then (after the device is synchronised) :meth:`seconds` and
    :attr:`calls`."""

    def __init__(self, device: str):
        self.device = device
        self.calls = 0
        self._watches: list[Stopwatch] = []
        self._depth = 0

    @contextlib.contextmanager
    def observe(self, stage: str, provider: str) -> Iterator[None]:
        """One kernel call (what the ``observe_kernels`` hook enters around it)."""
        if self._depth:
            yield
            return
        watch = Stopwatch(self.device)
        self._depth += 1
        try:
            watch.start()
            yield
            watch.stop()
        finally:
            self._depth -= 1
        self._watches.append(watch)
        self.calls += 1

    def seconds(self) -> float:
        """The finished calls' summed seconds (on CUDA: after a synchronise)."""
        return sum(w.seconds() for w in self._watches)

    def record(self) -> dict:
        """``{"calls": n, "seconds": s}`` for the case row."""
        return {"calls": self.calls, "seconds": round(self.seconds(), 6)}
