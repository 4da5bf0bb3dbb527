"""Measuring instruments of ``dsv4-parity bench``: wall / CUDA-event timing, peak memory, per-kernel timing of the
fused providers, and a time budget.

* :func:`time_call` — warm-up runs, then repeats timed with ``torch.cuda.Event`` pairs on CUDA (after a
  synchronise) or ``time.perf_counter`` on the CPU; the repeat count adapts to the time one call takes.
* :class:`MemoryMeter` — peak bytes above the bytes in use when it starts, also per nested :meth:`window`.
  CUDA: the caching allocator's ``max_memory_allocated`` (exact). CPU: the C heap in use (glibc ``mallinfo2``),
  sampled after every ATen op through a ``TorchDispatchMode``; it sees every tensor that is alive between two ops
  (outputs, saved-for-backward tensors), not the scratch buffers inside one op, and it slows the run down — so CPU
  memory is measured in a run of its own, never in a timed one.
* :class:`KernelRecorder` — an observer of an implementation's kernel calls (its ``observe_kernels`` hook; by
  default the fused path's dispatcher, :func:`fused.plan.observe_kernels`) that records calls, time and
  (optionally) each call's peak memory per stage and provider. Only outermost calls are timed, so a kernel call
  made inside another is not counted twice.
* :class:`Budget` — a wall-clock deadline with per-section shares, so that a bench in one device call ends in time.
"""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused.plan import observe_kernels
from parity.run.kernel_time import Stopwatch


# ---- timing -------------------------------------------------------------------------------------------------------
def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Timing:
    """Seconds of each timed repeat (warm-up runs excluded)."""

    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.seconds) if self.seconds else None

    def to_dict(self) -> dict:
        if not self.seconds:
            return {"median_ms": None, "min_ms": None, "max_ms": None, "repeats": 0}
        return {"median_ms": round(self.median * 1e3, 4), "min_ms": round(min(self.seconds) * 1e3, 4),
                "max_ms": round(max(self.seconds) * 1e3, 4), "repeats": len(self.seconds)}


def time_call(fn: Callable[[], Any], device: str, *, warmup: int = 1, repeats: int = 3, target_s: float = 2.0,
              deadline: Optional[float] = None, before: Optional[Callable[[], Any]] = None,
              estimate_s: Optional[float] = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then up to ``repeats`` timed ones (fewer when one call takes more
    than ``target_s / repeats`` or the ``deadline`` — a ``time.monotonic`` value — passes; at least one).
    ``before()`` runs untimed ahead of every call (e.g. building the graph a backward consumes); ``estimate_s``:
    the duration of one call if already known (sets the repeat count when there is no warm-up)."""
    first = estimate_s
    for _ in range(max(warmup, 0)):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        first = time.perf_counter() - t0
    n = max(repeats, 1)
    if first is not None and first > 0:
        n = max(1, min(n, int(target_s / first)))
    timing = Timing()
    for i in range(n):
        if i and not Budget.fits(deadline, timing.seconds[-1]):
            break  # the next repeat would end past the deadline
        if before:
            before()
        watch = Stopwatch(device)
        synchronize(device)
        watch.start()
        fn()
        watch.stop()
        synchronize(device)
        timing.seconds.append(watch.seconds())
    return timing


# ---- memory -------------------------------------------------------------------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_reader() -> Optional[Callable[[], int]]:
    """Bytes the C heap has handed out (glibc ``mallinfo2``: arena blocks in use + mmapped blocks), or None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def used() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return used


HEAP_IN_USE = _heap_reader()


class _Window:
    """Peak bytes above the bytes in use when the window opened (``peak``), and the in-use change (``retained``)."""

    def __init__(self, start: int):
        self.start = start
        self.high = start
        self.end = start

    @property
    def peak(self) -> int:
        return max(self.high - self.start, 0)

    @property
    def retained(self) -> int:
        return self.end - self.start


class _OpSampler(TorchDispatchMode):
    def __init__(self, meter: "MemoryMeter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.meter._sample()
        return out


class MemoryMeter:
    """``with MemoryMeter(device) as m: ...`` then ``m.peak`` (bytes above the start); ``m.window()`` nests.

    ``available`` is False where nothing can be measured (a CPU without glibc); ``peak`` is then None.
    """

    def __init__(self, device: str):
        self.device = device
        self.available = device == "cuda" or HEAP_IN_USE is not None
        self._windows: list[_Window] = []
        self._outer: Optional[_Window] = None
        self._mode: Optional[_OpSampler] = None

    # ---- raw readings
    def _in_use(self) -> int:
        if self.device == "cuda":
            return torch.cuda.memory_allocated()
        return HEAP_IN_USE() if HEAP_IN_USE is not None else 0

    def _fold(self) -> None:
        """Fold the high-water mark since the last reading into every open window."""
        if self.device == "cuda":
            high = torch.cuda.max_memory_allocated()
        else:
            high = self._in_use()
        for w in self._windows:
            w.high = max(w.high, high)

    def _sample(self) -> None:  # CPU: after every op
        self._fold()

    def _reset(self) -> None:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    # ---- API
    def __enter__(self) -> "MemoryMeter":
        if not self.available:
            return self
        synchronize(self.device)
        if self.device == "cuda":
            self._reset()
        self._outer = _Window(self._in_use())
        self._windows.append(self._outer)
        if self.device != "cuda":
            self._mode = _OpSampler(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.available:
            return
        synchronize(self.device)
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        self._fold()
        self._outer.end = self._in_use()
        self._windows.remove(self._outer)

    @contextlib.contextmanager
    def window(self) -> Iterator[_Window]:
        """A nested measurement: ``peak`` above the bytes in use at its start (an op's workspace and outputs)."""
        if not self.available or self._outer is None:
            yield _Window(0)
            return
        synchronize(self.device)
        self._fold()
        w = _Window(self._in_use())
        self._reset()  # CUDA: the peak restarts at the current allocation; open windows already hold theirs
        self._windows.append(w)
        try:
            yield w
        finally:
            synchronize(self.device)
            self._fold()
            w.end = self._in_use()
            self._windows.remove(w)

    @property
    def peak(self) -> Optional[int]:
        return self._outer.peak if (self.available and self._outer is not None) else None

    @property
    def retained(self) -> Optional[int]:
        return self._outer.retained if (self.available and self._outer is not None) else None


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory failure (CUDA allocator or the host)."""
    if isinstance(exc, (MemoryError, getattr(torch.cuda, "OutOfMemoryError", MemoryError))):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text


def free_memory(device: str, *, collect: bool = False) -> None:
    """Return cached CUDA blocks; ``collect``: first break reference cycles (after an exception, whose traceback
    keeps tensors alive). A full ``gc.collect`` takes ~0.3 s once torch is imported, so not after every run."""
    if collect:
        import gc

        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- per-kernel timing of an implementation's kernel calls -------------------------------------------------------------------------
@dataclass
class KernelStat:
    """One kernel stage under one provider: calls, total seconds, largest per-call peak memory (bytes)."""

    stage: str
    provider: str
    calls: int = 0
    seconds: float = 0.0
    peak_bytes: Optional[int] = None

    def to_dict(self, iterations: int = 1) -> dict:
        per = max(iterations, 1)
        return {"stage": self.stage, "provider": self.provider, "calls": self.calls / per,
                "time_ms": round(self.seconds / per * 1e3, 4),
                "peak_mem_bytes": self.peak_bytes}


class KernelRecorder:
    """Record every kernel-stage call of an implementation (see the module docstring).

    ``with KernelRecorder(device) as rec: ...`` — then ``rec.flush()`` (synchronises and reads the CUDA events),
    ``rec.stats`` ``{(stage, provider): KernelStat}`` and ``rec.total_seconds`` (outermost calls only).
    ``meter``: a running :class:`MemoryMeter`; each call then gets a memory window (slower: use in a memory run).
    Attached at the implementation's observation point: ``observe_kernels(observer)``, a context manager within
    which every kernel call runs inside ``observer(stage, provider)`` (default :func:`fused.plan.observe_kernels`;
    ``--impl megatron``: production's kernel seam, reached through :mod:`parity.impls`); no provider is touched.
    """

    def __init__(self, device: str, meter: Optional[MemoryMeter] = None,
                 observe: Callable[[Callable[[str, str], Any]], Any] = observe_kernels):
        self.device = device
        self.meter = meter
        self._observe = observe
        self.stats: dict[tuple[str, str], KernelStat] = {}
        self._pending: list[tuple[KernelStat, Stopwatch]] = []
        self._depth = 0
        self._observing: Optional[contextlib.AbstractContextManager] = None
        self.enabled = True

    def __enter__(self) -> "KernelRecorder":
        self._observing = self._observe(self.observe)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._observing.__exit__(*exc)
        self._observing = None

    @contextlib.contextmanager
    def observe(self, stage: str, provider: str):
        """One kernel call (the observer the ``observe_kernels`` hook enters around it)."""
        if not self.enabled or self._depth:
            yield
            return
        stat = self.stats.setdefault((stage, provider), KernelStat(stage, provider))
        stat.calls += 1
        watch = Stopwatch(self.device)
        self._depth += 1
        window = self.meter.window() if self.meter is not None else contextlib.nullcontext()
        try:
            with window as w:
                watch.start()
                yield
                watch.stop()
        finally:
            self._depth -= 1
        if self.meter is not None and w is not None:
            stat.peak_bytes = max(stat.peak_bytes or 0, w.peak)
        self._pending.append((stat, watch))

    def flush(self) -> None:
        """Read the timings of the finished calls (synchronises on CUDA)."""
        synchronize(self.device)
        for stat, watch in self._pending:
            stat.seconds += watch.seconds()
        self._pending.clear()

    def reset(self) -> None:
        self.flush()
        self.stats.clear()

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.stats.values())


# ---- time budget --------------------------------------------------------------------------------------------------
class Budget:
    """A wall-clock deadline (``time.monotonic``) for the whole bench, handed out to sections by share."""

    def __init__(self, seconds: Optional[float]):
        self.start = time.monotonic()
        self.end = None if seconds is None else self.start + seconds

    def remaining(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def section(self, share: float) -> Optional[float]:
        """Deadline of a section that may use ``share`` of the time left (None: unbounded)."""
        if self.end is None:
            return None
        return time.monotonic() + max(self.remaining(), 0.0) * share

    @staticmethod
    def passed(deadline: Optional[float]) -> bool:
        return deadline is not None and time.monotonic() > deadline

    @staticmethod
    def fits(deadline: Optional[float], seconds: Optional[float]) -> bool:
        """Would work of ``seconds`` (unknown: 0) started now end by ``deadline``?"""
        return deadline is None or time.monotonic() + (seconds or 0.0) <= deadline
