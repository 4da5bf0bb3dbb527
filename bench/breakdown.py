"""Where the fused path's time goes outside its kernels (``dsv4-parity bench --sections breakdown``).

One warm forward + backward of the fused core is run under ``torch.profiler`` with Python stacks. Every device
kernel (CUDA) — or, on the CPU, every op's self time — is attributed to a **site**:

* ``provider`` — launched inside a provider stage call (each runs in a ``record_function("provider::<stage>")``
  range while profiling, so the CuTe-DSL kernels, launched through TVM-FFI and not an ATen op, hang on it), from a
  frame in ``fused/kernels/`` or the kernel packages (``cudnn`` / ``flash_mla`` / ``cutlass`` / ``tvm_ffi``), or
  attached to no op (to no CPU event, or straight to an autograd Function's range: profilers hang TVM-FFI launches
  there): the time the composition ratio's denominator already counts;
* a built-in autograd node without a frame of ours (``autograd CatBackward0``): the backward of an eager op;
* otherwise the **innermost frame of this repository** that issued the op (``fused/sparse_attention.py:62
  sparse_attention_backward``), with the ATen op name (``aten::masked_fill``): the composition's own copies, casts,
  pads, index maps and eager compressor; where the profiler records no Python frames (torch 2.11 with CUDA
  activities, on the H200), the innermost composition function around the op (``fused/compressor.py _pool``): while
  profiling, every function of the composition runs in a ``record_function("fused::<module>.<function>")`` range
  (:class:`CompositionRanges`).

The step's wall time (synchronised) minus the union of the device busy intervals is the **idle** time: host work
the GPU waited for (Python, launches, host syncs). On CUDA one more step runs under ``torch.cuda``'s sync debug
mode: ``host_syncs`` counts the implicit device-to-host synchronisations (``.item()``, ``nonzero``, a copy to the
host) it reports and names the line of ours that issued each (:func:`sync_sites`); and the step is captured once in
a CUDA graph and replayed (``graph``, :func:`graph_replay_ms`): the time without the host's launch cost, as a
production step captured in a graph runs it — a capture that fails names the host read that broke it. ``sites``
lists the composition sites by device time, largest first, so the first rows are what to cut.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

from bench.measure import synchronize
from fused.plan import observe_kernels

#: Path segments of frames that belong to a kernel provider (its padding, its wrapper, the kernel packages).
PROVIDER_PACKAGES = ("cudnn", "flash_mla", "cutlass", "tvm_ffi")
#: Top-level folders of this repository's code (everything else is torch or the Python runtime).
OWN_PACKAGES = ("fused", "cases", "reference")
_FRAME = re.compile(r"^(?P<path>.+)\((?P<line>\d+)\): (?P<func>.*)$")
_AUTOGRAD_NODE = "autograd::engine::evaluate_function: "
#: ``record_function`` name prefix around every provider stage call while profiling (:func:`provider_ranges`).
PROVIDER_RANGE = "provider::"
#: ``record_function`` name prefix around every function of the composition while profiling
#: (:class:`CompositionRanges`): ``"fused::<module>.<function>"``.
COMPOSITION_RANGE = "fused::"
#: The composition's modules (``fused/<name>.py``) whose functions get a range; the rest is plumbing or tooling.
COMPOSITION_MODULES = ("core_attention", "compressor", "indexer", "indexer_loss", "sparse_attention", "index_maps",
                       "ops", "layer", "thd")


def classify(chain: Iterable[str]) -> Optional[str]:
    """The site of an op from the names above it, innermost first (:func:`ancestry`): ``"provider"``, the innermost
    frame of ours (``"fused/x.py:12 fn"``), ``"autograd <node>"`` when a built-in autograd node comes first, or None.

    Frames are the profiler's ``"path(line): function"`` names; anything else is skipped.
    """
    for name in chain:
        if name.startswith(PROVIDER_RANGE):
            return "provider"
        if name.startswith(COMPOSITION_RANGE):
            module, _, func = name[len(COMPOSITION_RANGE):].partition(".")
            return f"fused/{module}.py {func}"
        if name.startswith(_AUTOGRAD_NODE):
            return "autograd " + name[len(_AUTOGRAD_NODE):]
        m = _FRAME.match(name)
        if not m:
            continue
        parts = m["path"].replace("\\", "/").split("/")
        folders = parts[:-1]
        if any(p in folders for p in PROVIDER_PACKAGES) or ("fused" in folders and "kernels" in folders):
            return "provider"
        own = repository_path(parts)
        if own:
            return f"{own}:{m['line']} {m['func'].strip()}"
    return None


def repository_path(parts: list[str]) -> Optional[str]:
    """A file path split at ``/``, from this repository's innermost top folder (``fused/ops.py``), or None when no
    folder of it is one of ours."""
    own = [i for i, p in enumerate(parts[:-1]) if p in OWN_PACKAGES]
    return "/".join(parts[own[-1]:]) if own else None


def ancestry(event: Any, frames: Optional[dict] = None) -> list[str]:
    """Names above ``event``, innermost first, the event's own first: its recorded ``stack`` frames when the
    profiler gives them, its CPU ancestors' names (ops, ``record_function`` ranges, autograd nodes; Python-function
    events in newer profilers), then ``frames[id(event)]`` (:func:`enclosing_frames`, older profilers)."""
    names: list[str] = []
    e = event
    while e is not None:
        names.append(str(e.name))
        names.extend(getattr(e, "stack", None) or [])
        e = getattr(e, "cpu_parent", None)
    return names + (frames or {}).get(id(event), [])


def enclosing_frames(events: list) -> dict[int, list[str]]:
    """``{id(op): [Python-function event names enclosing it, innermost first]}`` by time on the op's thread: profilers
    that record Python-function events without making them the ops' ``cpu_parent``. One sweep in start order with a
    stack of the open Python events (they nest properly on a thread)."""
    from torch.autograd import DeviceType

    by_thread: dict[Any, list] = {}
    for e in events:
        if getattr(e, "device_type", None) == DeviceType.CPU:
            by_thread.setdefault(getattr(e, "thread", None), []).append(e)
    out: dict[int, list[str]] = {}
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        open_frames: list = []
        for e in evs:
            while open_frames and open_frames[-1].time_range.end < e.time_range.start:
                open_frames.pop()
            if _FRAME.match(str(e.name)):
                open_frames.append(e)
            elif open_frames:
                out[id(e)] = [f.name for f in reversed(open_frames) if f.time_range.end >= e.time_range.end]
    return out


class CompositionRanges:
    """Within ``with``: every function of the composition's modules (:data:`COMPOSITION_MODULES`), wherever it is
    looked up (its own module and every ``fused`` module that imported it), runs inside
    ``record_function("fused::<module>.<function>")``: the site of an op even where the profiler records no Python
    frames (torch 2.11 with CUDA activities). Restored on exit."""

    def __enter__(self) -> "CompositionRanges":
        import importlib
        import inspect

        from torch.profiler import record_function

        def ranged(func: Callable) -> Callable:
            name = f"{COMPOSITION_RANGE}{func.__module__.rsplit('.', 1)[-1]}.{func.__name__}"

            def call(*args, **kwargs):
                with record_function(name):
                    return func(*args, **kwargs)

            call.__wrapped__ = func
            return call

        modules = {f"fused.{m}" for m in COMPOSITION_MODULES}
        wrapped: dict[int, Callable] = {}
        self._patched = []
        for module in [importlib.import_module("fused")] + [importlib.import_module(f"fused.{m}")
                                                            for m in COMPOSITION_MODULES]:
            for attr, value in list(vars(module).items()):
                if inspect.isfunction(value) and value.__module__ in modules:
                    setattr(module, attr, wrapped.setdefault(id(value), ranged(value)))
                    self._patched.append((module, attr, value))
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, value in reversed(self._patched):
            setattr(module, attr, value)


def provider_ranges() -> contextlib.AbstractContextManager:
    """Within ``with``: every kernel call of the fused path runs inside ``record_function("provider::<stage>")``,
    so the kernels it launches — through ATen ops or not (CuTe DSL via TVM-FFI) — hang on that range or below it.
    Attached at the dispatcher's observation point (:func:`fused.plan.observe_kernels`); no provider is touched."""
    from torch.profiler import record_function

    return observe_kernels(lambda stage, provider: record_function(PROVIDER_RANGE + stage))


def _top_op(event: Any) -> str:
    """The outermost ATen op above ``event`` (``aten::contiguous`` rather than the ``aten::copy_`` it runs)."""
    name, e = event.name, event
    while e is not None:
        if str(e.name).startswith("aten::"):
            name = e.name
        e = getattr(e, "cpu_parent", None)
    return str(name)


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start_us, end_us)`` intervals, in ms."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def attribute(events: Iterable[Any], device: str) -> dict:
    """``{"device_ms", "busy_ms", "provider_ms", "composition_ms", "sites": [...]}`` from profiler events.

    CUDA: the cost of an op is the device time of the kernels it launched (``kernels``; the device-side spans of
    ``record_function`` ranges are not kernels), and device time attached to no op counts as ``provider``. CPU: the
    cost is each op's self CPU time (no device side).
    """
    from torch.autograd import DeviceType

    sites: dict[tuple[str, str], dict] = {}
    device_ms = attached_ms = provider_ms = 0.0
    intervals: list[tuple[float, float]] = []
    events = list(events)
    frames = enclosing_frames(events)
    # record_function ranges (ours and autograd's) also appear on the device timeline as spans over their kernels,
    # and are attached to their CPU range like kernels: neither is device work
    spans = {str(e.name) for e in events if e.device_type != DeviceType.CPU and getattr(e, "is_user_annotation", False)}
    for e in events:
        if device == "cuda":
            if e.device_type != DeviceType.CPU:
                if str(e.name) not in spans:
                    intervals.append((e.time_range.start, e.time_range.end))
                    device_ms += (e.time_range.end - e.time_range.start) / 1e3
                continue
            cost = sum(k.duration for k in getattr(e, "kernels", []) if str(k.name) not in spans) / 1e3
        else:
            if e.device_type != DeviceType.CPU or not str(e.name).startswith("aten::"):
                continue
            cost = e.self_cpu_time_total / 1e3
        if cost <= 0:
            continue
        attached_ms += cost
        # kernels hung directly on a range that is not an op (an autograd Function's forward / backward record) were
        # launched outside any op: TVM-FFI, i.e. the CuTe-DSL providers (the composition issues ATen ops only)
        site = "provider" if device == "cuda" and "::" not in str(e.name) else classify(ancestry(e, frames))
        if site == "provider":
            provider_ms += cost
            continue
        site = site or "(no repository frame)"
        key = (site, _top_op(e))
        row = sites.setdefault(key, {"site": key[0], "op": key[1], "calls": 0, "ms": 0.0})
        row["calls"] += 1
        row["ms"] += cost
    if device == "cuda":
        provider_ms += max(device_ms - attached_ms, 0.0)  # kernels launched outside ATen ops: CuTe DSL / TVM-FFI
    else:
        device_ms = attached_ms
    ordered = sorted(sites.values(), key=lambda r: -r["ms"])
    for r in ordered:
        r["ms"] = round(r["ms"], 4)
    return {"device_ms": round(device_ms, 4), "busy_ms": round(_union_ms(intervals), 4) if intervals else None,
            "provider_ms": round(provider_ms, 4), "composition_ms": round(sum(r["ms"] for r in ordered), 4),
            "sites": ordered}


def sync_sites(records: Iterable[Any]) -> dict:
    """``{"count", "sites": [{"site", "count"}]}`` from the warnings the sync debug mode raised: each is attributed to
    the Python line that issued the synchronising op, shown from this repository's top folder when it is ours, else
    as ``package/file.py``."""
    sites: dict[str, int] = {}
    count = 0
    for w in records:
        if "synchroniz" not in str(getattr(w, "message", "")):
            continue
        count += 1
        parts = str(w.filename).replace("\\", "/").split("/")
        key = f"{repository_path(parts) or '/'.join(parts[-2:])}:{w.lineno}"
        sites[key] = sites.get(key, 0) + 1
    return {"count": count, "sites": [{"site": k, "count": v} for k, v in sorted(sites.items(), key=lambda kv: -kv[1])]}


def host_syncs(step: Callable[[], None]) -> dict:
    """One ``step`` under ``torch.cuda.set_sync_debug_mode("warn")``: :func:`sync_sites` of what it reported."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:  # before the closing synchronize, which the mode would report as the step's own
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    return sync_sites(records)


def graph_replay_ms(step: Callable[[], None], repeats: int = 3) -> dict:
    """CUDA: ``{"ms": median wall of a replay, "error": None}`` of ``step`` captured once in a CUDA graph (after a
    warm-up on a side stream, as capture requires), or ``{"ms": None, "error": "<why the capture failed>"}``."""
    import torch

    from parity.oracles.graph_replay import capture_graph

    graph = None
    try:
        graph, _ = capture_graph(step)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ms": round(sorted(times)[len(times) // 2], 4), "error": None}
    except Exception as exc:  # noqa: BLE001 — a failed capture is a finding, reported in the row
        return {"ms": None, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    finally:
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


#: Lines libkineto prints to the process's stderr on every profiler start / stop, whatever KINETO_LOG_LEVEL says.
PROFILER_CHATTER = ("USDT:", "STAGE:")


@contextlib.contextmanager
def profiler_chatter_dropped() -> Iterator[None]:
    """Run the body with file descriptor 2 captured, then re-emit every captured line except the profiler's own
    :data:`PROFILER_CHATTER` (written by native code, so ``sys.stderr`` redirection cannot catch it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(PROFILER_CHATTER)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def profile_step(step: Callable[[], None], device: str, top: int = 25) -> dict:
    """One unprofiled call of ``step`` (already warm) for the wall time, then one under the profiler for the
    attribution (:func:`attribute`; the profiler's own host cost would inflate the wall time, not the device's).
    ``idle_ms`` = wall - device busy (CUDA). ``sites`` keeps the ``top`` largest; ``host_syncs`` and ``graph``
    (CUDA, else None): :func:`host_syncs`, :func:`graph_replay_ms`."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    t0 = time.perf_counter()
    step()
    synchronize(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for attempt in range(3):
        with profiler_chatter_dropped(), provider_ranges(), CompositionRanges(), \
                profile(activities=activities, with_stack=True, record_shapes=False) as prof:
            step()
            synchronize(device)
        try:
            events = prof.events()
            break
        except UnicodeDecodeError:  # torch's event parsing now and then reads a torn name (torch 2.13, CPU): again
            if attempt == 2:
                raise
    out = attribute(events, device)
    out["wall_ms"] = round(wall_ms, 4)
    out["idle_ms"] = None if out["busy_ms"] is None else round(max(wall_ms - out["busy_ms"], 0.0), 4)
    out["host_syncs"] = host_syncs(step) if device == "cuda" else None
    out["graph"] = graph_replay_ms(step) if device == "cuda" else None
    out["sites_total"] = len(out["sites"])
    out["sites"] = out["sites"][:top]
    return out
