"""``dsv4-parity bench``: performance of the fused path, the reference and the harness — reported, never asserted.

Sections (``--sections``, all by default):

* ``e2e`` — per profile × tokens × scope (``core``, ``layer``): forward + backward of the fused path and of the
  reference: time (median of the repeats), model TFLOP/s (:mod:`parity.bench_flops`) and its share of the H200's
  measured bf16 dense peak (CUDA only), peak memory above the inputs. For the fused path also the time of every
  kernel call (each provider's stage methods wrapped, :class:`parity.bench_measure.KernelRecorder`) and the
  **composition ratio** = fused forward + backward / sum of its kernels' times (target ≤ 1.2 at core scope).
* ``stages`` — per stage (compressor, indexer forward, top-k, sparse attention forward / backward, score
  recompute, indexer backward): the fused kernels' time in the core-scope run next to the reference's stage
  function timed in isolation on inputs of the same shapes (:func:`parity.bench_workloads.reference_stages`).
* ``scaling`` — reference forward + backward time and peak memory against the tokens ``T`` at fixed W and K: a THD
  pack of fixed-length segments (must grow linearly), one sequence of ``T`` (the indexer's scores are ``T × T/4``),
  the dense loss; and the memory of single reference functions (the dense-loss teacher, the indexer scores and the
  sparse attention with autograd) — each series gets a log-log slope; a superlinear *memory* slope of a function
  becomes a finding that names it (module, function, file:line).
* ``harness`` — a parity run of ``--harness-suite`` (in-process, the engine's phases timed by wrapping
  ``parity.engine`` / ``parity.snapshot`` / ``parity.structure`` / ``parity.verdict`` / the results writer):
  cases per minute, and the share of the time spent outside the two implementations' forward and backward.

Targets (reported against, never asserted): smoke ≤ 2 min on 2 CPU cores; gate (≥ 200 cases) ≤ 10 min on one
H200; the reference runs a 32K-token Pro pack on one H200 without OOM; harness overhead ≤ 15 %; fused
forward + backward ≤ 1.2 × the sum of its kernels.

Timing: warm-up runs, then repeats on ``torch.cuda.Event`` pairs (CUDA) or ``perf_counter`` (CPU); memory:
``torch.cuda.max_memory_allocated`` (CUDA) or the C heap sampled after every op in a separate run (CPU). A
``--budget-s`` deadline (split between the sections) skips what does not fit, so one device call always ends.

Output: a rich table on the terminal, machine-readable JSON (``--json PATH``; schema ``dsv4-parity-bench/1``, see
:func:`empty_report`) and a PNG of the scaling and end-to-end plots next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from cases.errors import CaseError

from .bench_flops import H200_BF16_PEAK_TFLOPS, kernel_flops, tflops
from .bench_measure import (Budget, KernelRecorder, MemoryMeter, Timing, free_memory, is_oom, synchronize,
                            time_call)
from .bench_workloads import (LAYOUTS, LOSSES, StageCall, Workload, clear_caches, forward_backward,
                              fused_compressor_stage, make_tensors, reference_stages, tensor_bytes)

SCHEMA = "dsv4-parity-bench/1"
SECTIONS = ("e2e", "stages", "scaling", "harness")
#: Share of the remaining budget each section may use when it starts (the last one takes what is left).
SECTION_SHARE = {"e2e": 0.45, "stages": 0.35, "scaling": 0.45, "harness": 1.0}

DEFAULTS = {
    "cpu": {"profiles": ("tiny",), "tokens": (256, 512, 1024, 2048), "segment_len": 256, "dtype": "float32",
            "budget_s": 55.0, "harness_suite": "smoke", "harness_limit": 0, "ref_max_tokens": None},
    "cuda": {"profiles": ("kernel", "flash", "pro"), "tokens": (4096, 8192, 16384, 32768, 65536),
             "segment_len": 4096, "dtype": "bfloat16", "budget_s": 300.0, "harness_suite": "gate",
             "harness_limit": 24, "ref_max_tokens": 32768},
}

#: Stage groups of the table: (row name, fused kernel stages, reference stage name).
STAGE_GROUPS = (
    ("compressor", (), "compressor"),
    ("indexer forward", ("indexer_forward",), "indexer_forward"),
    ("top-k", ("indexer_top_k", "compactify"), "indexer_top_k"),
    ("sparse attention fwd", ("sparse_attn_fwd",), "sparse_attn_fwd"),
    ("sparse attention bwd", ("sparse_attn_bwd",), "sparse_attn_bwd"),
    ("score recompute", ("sparse_attn_score_recompute", "sparse_indexer_score_recompute", "csa_teacher_lse",
                         "dense_attn_score_recompute", "dense_indexer_score_recompute"), "score_recompute"),
    ("indexer backward", ("indexer_backward", "dense_indexer_backward"), "indexer_backward"),
)

TARGETS = {
    "smoke_cpu_minutes": 2.0,
    "gate_gpu_minutes": 10.0,
    "harness_overhead_share": 0.15,
    "composition_ratio": 1.2,
}


# ---- settings -----------------------------------------------------------------------------------------------------------
def parse_tokens(text: str) -> list[int]:
    """``"4K,8192,64k"`` → ``[4096, 8192, 65536]``."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        mult = 1024 if item.endswith("k") else 1
        try:
            value = int(item[:-1] if mult > 1 else item) * mult
        except ValueError:
            raise CaseError("tokens", f"not a token count: {item!r} (use e.g. 256,512 or 4K,64K)") from None
        if value <= 0:
            raise CaseError("tokens", f"must be positive, got {value}")
        out.append(value)
    if not out:
        raise CaseError("tokens", "needs at least one token count")
    return sorted(set(out))


def _csv(text: Optional[str]) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


@dataclass
class Settings:
    device: str
    profiles: list[str]
    tokens: list[int]
    layout: str
    segment_len: int
    ratio: int
    loss: str
    dtype: str
    scopes: list[str]
    sections: list[str]
    provider: str = "auto"
    warmup: int = 1
    repeats: int = 3
    target_s: float = 1.0
    budget_s: Optional[float] = None
    ref_max_tokens: Optional[int] = None
    harness_suite: str = "smoke"
    harness_limit: int = 6
    harness_report: bool = True
    peak_tflops: Optional[float] = None
    threads: Optional[int] = None
    quiet: bool = False

    def to_dict(self) -> dict:
        return dict(vars(self))


def resolve_settings(args: argparse.Namespace) -> Settings:
    """Fill the per-device defaults and validate (one :class:`CaseError` naming the option)."""
    from cases.profiles import PROFILES

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise CaseError("device", "cuda was asked for, but torch sees no CUDA device")
    d = DEFAULTS[device]
    profiles = _csv(args.profile) or list(d["profiles"])
    for p in profiles:
        if p not in PROFILES:
            raise CaseError("profile", f"unknown profile {p!r} (known: {', '.join(PROFILES)})")
    tokens = parse_tokens(args.tokens) if args.tokens else list(d["tokens"])
    sections = _csv(args.sections) or list(SECTIONS)
    for s in sections:
        if s not in SECTIONS:
            raise CaseError("sections", f"unknown section {s!r} (known: {', '.join(SECTIONS)})")
    scopes = _csv(args.scope) or ["core", "layer"]
    for s in scopes:
        if s not in ("core", "layer"):
            raise CaseError("scope", f"must be core and/or layer, got {s!r}")
    if args.ratio not in (0, 4, 128):
        raise CaseError("ratio", f"must be 0, 4 or 128, got {args.ratio}")
    dtype = args.dtype or d["dtype"]
    if dtype not in ("float64", "float32", "bfloat16"):
        raise CaseError("dtype", f"must be float64, float32 or bfloat16, got {dtype!r}")
    budget = d["budget_s"] if args.budget_s is None else (None if args.budget_s <= 0 else args.budget_s)
    ref_max = d["ref_max_tokens"] if args.ref_max_tokens is None else (args.ref_max_tokens or None)
    return Settings(
        device=device, profiles=profiles, tokens=tokens, layout=args.layout,
        segment_len=args.segment_len or d["segment_len"], ratio=args.ratio, loss=args.loss, dtype=dtype,
        scopes=scopes, sections=sections, provider=args.provider, warmup=max(args.warmup, 0),
        repeats=max(args.repeats, 1), target_s=args.target_s, budget_s=budget, ref_max_tokens=ref_max,
        harness_suite=args.harness_suite or d["harness_suite"],
        harness_limit=d["harness_limit"] if args.harness_limit is None else args.harness_limit,
        harness_report=not args.no_harness_report,
        peak_tflops=args.peak_tflops if args.peak_tflops is not None else (
            H200_BF16_PEAK_TFLOPS if device == "cuda" else None),
        threads=args.threads if args.threads is not None else (1 if device == "cpu" else None),
        quiet=args.quiet)


# ---- the report object ------------------------------------------------------------------------------------------------
def machine() -> dict:
    """The host: cores, memory, load average (numbers from a shared machine are noisy)."""
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    try:
        info["cpus_allowed"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        info["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2 ** 30, 1)
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2 ** 30, 1)
    return info


def empty_report(settings: Settings, argv: Sequence[str]) -> dict:
    """The JSON document, before measuring. Every list holds row objects:

    * ``e2e``: label (``profile tokens layout segment_len ratio loss dtype scope``) + ``impl provider status
      message time flops tflops peak_fraction peak_mem_bytes inputs_bytes`` and, fused: ``kernels`` (per
      ``stage``/``provider``: ``calls time_ms peak_mem_bytes`` per iteration), ``kernel_sum_ms``,
      ``composition_ratio``;
    * ``stages``: ``profile tokens layout group`` + ``fused`` / ``reference`` {``status time_ms tflops
      peak_mem_bytes retained_bytes function kernels``} + ``speedup`` (reference / fused);
    * ``scaling``: ``series`` (``name impl kind function points[{tokens status time_ms peak_mem_bytes
      retained_bytes}]``) and ``fits`` (``series metric slope points verdict``);
    * ``harness``: ``suite cases total_s cases_per_min phases{name: s} implementation_s overhead_s overhead_share
      suite_cases suite_estimate_s counts``;
    * ``targets``: ``name target measured unit status note``; ``findings``: ``kind function where message``;
      ``skipped``: ``what why``.
    """
    from .environment import environment

    return {"schema": SCHEMA, "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": list(argv), "settings": settings.to_dict(), "env": environment(settings.device),
            "machine": machine(), "peak_tflops": settings.peak_tflops, "e2e": [], "stages": [],
            "scaling": {"series": [], "fits": []}, "harness": None, "targets": [], "findings": [], "skipped": [],
            "duration_s": None}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/site-packages/" not in frame.filename and "/torch/" not in frame.filename:
            where = " [" + "/".join(frame.filename.split("/")[-2:]) + f":{frame.lineno}]"
            break
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:400] + where


def _status_of(exc: BaseException) -> str:
    from .impls import is_unsupported

    if is_oom(exc):
        return "oom"
    return "unsupported" if is_unsupported(exc) else "error"


# ---- e2e ---------------------------------------------------------------------------------------------------------------
class Bench:
    """One bench run: settings, budget, the report being filled, and a cache of measured e2e rows."""

    def __init__(self, settings: Settings, report: dict, log: Callable[[str], None]):
        self.s = settings
        self.report = report
        self.log = log
        self.budget = Budget(settings.budget_s)
        self.e2e_cache: dict[tuple, dict] = {}

    def skip(self, what: str, why: str) -> None:
        self.report["skipped"].append({"what": what, "why": why})

    def _impl(self, name: str):
        from .impls import load

        return load(name)

    def workload(self, profile: str, tokens: int, **changes) -> Workload:
        s = self.s
        w = Workload(profile, tokens, layout=s.layout, segment_len=s.segment_len, ratio=s.ratio, loss=s.loss,
                     dtype=s.dtype)
        return w.with_(**changes) if changes else w

    def ref_too_big(self, tokens: int) -> bool:
        return self.s.ref_max_tokens is not None and tokens > self.s.ref_max_tokens

    def e2e(self, work: Workload, impl_name: str, deadline: Optional[float]) -> dict:
        """Measure (or fetch) one forward + backward row."""
        key = (work, impl_name)
        if key in self.e2e_cache:
            return self.e2e_cache[key]
        row = dict(work.label(), impl=impl_name, provider=None, status="ok", message="", time=Timing().to_dict(),
                   flops=work.flops, tflops=None, peak_fraction=None, peak_mem_bytes=None, inputs_bytes=None)
        if Budget.passed(deadline):
            row.update(status="skipped", message="time budget")
        elif impl_name == "reference" and self.ref_too_big(work.tokens):
            row.update(status="skipped", message=f"above --ref-max-tokens {self.s.ref_max_tokens}")
        else:
            self._measure_e2e(work, impl_name, row, deadline)
        self.e2e_cache[key] = row
        self.log(f"e2e {work.profile} T={work.tokens} {work.layout} {work.scope} {work.effective_loss} loss "
                 f"{impl_name}: {row['status']} "
                 f"{row['time']['median_ms']} ms {row['message']}")
        return row

    def _measure_e2e(self, work: Workload, impl_name: str, row: dict, deadline: Optional[float]) -> None:
        s, device = self.s, self.s.device
        tensors = step = None
        failed = False
        try:
            impl = self._impl(impl_name)
            provider = impl.resolve_provider(s.provider)
            row["provider"] = provider
            tensors = make_tensors(work, device)
            row["inputs_bytes"] = tensor_bytes(tensors)
            step = forward_backward(impl.api, work.case, tensors, impl.context(provider))
            fused = impl.has_providers
            mem_rec = None
            if device == "cuda":  # the allocator's peak costs nothing: the memory run is the first warm-up
                peak, mem_rec = self._memory_run(step, fused)
                row["peak_mem_bytes"] = peak
            estimate = None
            for _ in range(max(s.warmup, 1 if device == "cuda" else 0)):
                t0 = time.perf_counter()
                step()
                synchronize(device)
                estimate = time.perf_counter() - t0
            # timed runs, kernel calls recorded
            with (KernelRecorder(device) if fused else contextlib.nullcontext()) as rec:
                timing = time_call(step, device, warmup=0, repeats=s.repeats, target_s=s.target_s,
                                   deadline=deadline, estimate_s=estimate)
                if rec is not None:
                    rec.flush()
            if device != "cuda":  # the CPU meter slows every op down: a run of its own, after the timed ones
                peak, mem_rec = self._memory_run(step, fused)
                row["peak_mem_bytes"] = peak
        except Exception as exc:  # noqa: BLE001 — an OOM or a failing implementation is a row, not a crash
            row.update(status=_status_of(exc), message=_one_line(exc))
            failed = True
        finally:  # after the except clause: its traceback (and the tensors it holds) is released by then
            del tensors, step
            free_memory(device, collect=failed)
        if failed:
            return
        row["time"] = timing.to_dict()
        seconds = timing.median
        row["tflops"] = tflops(work.flops, seconds)
        if row["tflops"] is not None and s.peak_tflops:
            row["peak_fraction"] = row["tflops"] / s.peak_tflops
        if rec is not None:
            iters = len(timing.seconds)
            peaks = {k: v.peak_bytes for k, v in mem_rec.stats.items()} if mem_rec is not None else {}
            kernels = []
            for key, stat in sorted(rec.stats.items()):
                stat.peak_bytes = peaks.get(key)
                kernels.append(stat.to_dict(iters))
            row["kernels"] = kernels
            kernel_sum = rec.total_seconds / max(iters, 1)
            mean = sum(timing.seconds) / max(iters, 1)
            row["kernel_sum_ms"] = round(kernel_sum * 1e3, 4)
            row["composition_ratio"] = (mean / kernel_sum) if kernel_sum > 0 else None
            ran: dict[str, set] = {}
            for k in kernels:
                ran.setdefault(k["stage"], set()).add(k["provider"])
            row["plan"] = {stage: "+".join(sorted(p)) for stage, p in ran.items()}

    def _memory_run(self, step: Callable[[], None], fused: bool) -> tuple[Optional[int], Optional[KernelRecorder]]:
        """One run under a :class:`MemoryMeter`: ``(peak bytes above the inputs, the per-kernel recorder)``."""
        device = self.s.device
        with MemoryMeter(device) as meter:
            with (KernelRecorder(device, meter) if fused else contextlib.nullcontext()) as rec:
                step()
            if rec is not None:
                rec.flush()
        return meter.peak, rec

    # ---- sections
    def run_e2e(self) -> None:
        deadline = self.budget.section(SECTION_SHARE["e2e"])
        for tokens in self.s.tokens:            # small T of every profile first: a budget cut drops the largest
            for profile in self.s.profiles:
                for scope in self.s.scopes:
                    work = self.workload(profile, tokens, scope=scope)
                    for impl in ("fused", "reference"):
                        self.report["e2e"].append(self.e2e(work, impl, deadline))

    def run_stages(self) -> None:
        deadline = self.budget.section(SECTION_SHARE["stages"])
        scope = "core" if "core" in self.s.scopes else self.s.scopes[0]
        for tokens in self.s.tokens:
            for profile in self.s.profiles:
                work = self.workload(profile, tokens, scope=scope)
                fused_row = self.e2e(work, "fused", deadline)
                self.report["stages"] += self._stage_rows(work, fused_row, deadline)

    def _time_stage(self, stage: StageCall, deadline: Optional[float]) -> dict:
        device = self.s.device
        out = {"status": "ok", "message": "", "function": stage.function, "time_ms": None, "tflops": None,
               "peak_mem_bytes": None, "retained_bytes": None}
        if Budget.passed(deadline):
            out.update(status="skipped", message="time budget")
            return out
        holder: dict[str, Any] = {"state": None}

        def before() -> None:
            holder["state"] = None  # drop the previous graph before building the next
            holder["state"] = stage.prepare()

        failed = False
        try:
            if stage.prepare is not None:
                before()
            t0 = time.perf_counter()
            with MemoryMeter(device) as meter:
                result = stage.run(holder["state"])
            estimate = time.perf_counter() - t0
            out["peak_mem_bytes"], out["retained_bytes"] = meter.peak, meter.retained
            del result
            timing = time_call(lambda: stage.run(holder["state"]), device, warmup=0, repeats=self.s.repeats,
                               target_s=self.s.target_s / 2, deadline=deadline, estimate_s=estimate,
                               before=before if stage.prepare is not None else None)
        except Exception as exc:  # noqa: BLE001
            out.update(status=_status_of(exc), message=_one_line(exc))
            failed = True
        finally:
            holder.clear()
            free_memory(device, collect=failed)
        if failed:
            return out
        out["time_ms"] = round(timing.median * 1e3, 4)
        out["tflops"] = tflops(stage.flops, timing.median)
        return out

    def _stage_rows(self, work: Workload, fused_row: dict, deadline: Optional[float]) -> list[dict]:
        label = {k: work.label()[k] for k in ("profile", "tokens", "layout", "segment_len", "ratio", "loss",
                                             "dtype")}
        ref_stages: dict[str, StageCall] = {}
        ref_status = None
        if self.ref_too_big(work.tokens):
            ref_status = f"above --ref-max-tokens {self.s.ref_max_tokens}"
        elif Budget.passed(deadline):
            ref_status = "time budget"
        else:
            try:
                ref_stages = {st.name: st for st in reference_stages(work, self.s.device)}
            except Exception as exc:  # noqa: BLE001
                ref_status = _one_line(exc)
        kernels: dict[str, list] = {}
        for k in fused_row.get("kernels", []):
            kernels.setdefault(k["stage"], []).append(k)
        flops = kernel_flops(work.config, work.counts, loss=work.effective_loss)
        rows = []
        for group, fused_stages, ref_name in STAGE_GROUPS:
            fused = {"status": fused_row["status"], "message": fused_row["message"], "time_ms": None,
                     "tflops": None, "peak_mem_bytes": None, "kernels": []}
            if group == "compressor":
                try:
                    stage = fused_compressor_stage(work, self.s.device)
                except Exception as exc:  # noqa: BLE001
                    stage = None
                    fused.update(status=_status_of(exc), message=_one_line(exc))
                if stage is not None:
                    fused.update(self._time_stage(stage, deadline))
                elif fused["status"] == "ok":
                    continue  # no compressor in this layer
            else:
                ran = [k for name in fused_stages for k in kernels.get(name, [])]
                if fused_row["status"] == "ok" and ran:
                    t = sum(k["time_ms"] for k in ran)
                    fused.update(time_ms=round(t, 4), kernels=ran,
                                 tflops=tflops(sum(flops.get(k["stage"], 0.0) for k in ran), t / 1e3),
                                 peak_mem_bytes=max((k["peak_mem_bytes"] or 0) for k in ran))
                elif fused_row["status"] == "ok":
                    fused.update(status="absent", message="no such kernel call in this workload")
            if ref_status is not None:
                reference = {"status": "skipped", "message": ref_status}
            elif ref_name in ref_stages:
                reference = self._time_stage(ref_stages[ref_name], deadline)
            else:
                reference = {"status": "absent", "message": "not a stage of this workload"}
            if fused.get("status") == "absent" and reference.get("status") == "absent":
                continue
            speedup = None
            if fused.get("time_ms") and reference.get("time_ms"):
                speedup = reference["time_ms"] / fused["time_ms"]
            rows.append(dict(label, group=group, fused=fused, reference=reference, speedup=speedup))
        self.log(f"stages {work.profile} T={work.tokens}: {len(rows)} rows")
        return rows

    # ---- scaling
    def run_scaling(self) -> None:
        deadline = self.budget.section(SECTION_SHARE["scaling"])
        profile = self.s.profiles[0]
        scope = "layer" if "layer" in self.s.scopes else self.s.scopes[0]
        series_defs = [
            ("reference, THD pack of fixed segments", dict(layout="pack")),
            ("reference, one sequence", dict(layout="seq")),
        ]
        if self.s.ratio == 4:
            series_defs.append(("reference, one sequence, dense loss", dict(layout="seq", loss="dense")))
        scaling = self.report["scaling"]
        for name, changes in series_defs:
            points = []
            for tokens in self.s.tokens:
                work = self.workload(profile, tokens, scope=scope, **changes)
                row = self.e2e(work, "reference", deadline)
                points.append({"tokens": tokens, "status": row["status"], "message": row["message"],
                               "time_ms": row["time"]["median_ms"], "peak_mem_bytes": row["peak_mem_bytes"]})
            label = self.workload(profile, self.s.tokens[0], scope=scope, **changes).label()
            label.pop("tokens")
            scaling["series"].append({"name": name, "impl": "reference", "kind": "forward+backward",
                                      "function": None, "workload": label, "points": points})
        for name, function, build in _function_series(self.s.ratio):
            points = []
            for tokens in self.s.tokens:
                work = self.workload(profile, tokens, layout="seq", loss="dense")
                if self.ref_too_big(tokens) or Budget.passed(deadline):
                    points.append({"tokens": tokens, "status": "skipped", "message": "budget or size"})
                    continue
                points.append(dict(tokens=tokens, **self._function_point(build, work)))
            scaling["series"].append({"name": name, "impl": "reference", "kind": "function memory",
                                      "function": function, "workload": {"profile": profile, "layout": "seq"},
                                      "points": points})
        scaling["fits"] = fit_series(scaling["series"])
        self.report["findings"] += findings_from_fits(scaling["series"], scaling["fits"])

    def _function_point(self, build: Callable, work: Workload) -> dict:
        device = self.s.device
        failed = False
        try:
            run, output_bytes = build(work, device)
            t0 = time.perf_counter()
            with MemoryMeter(device) as meter:
                result = run()
            seconds = time.perf_counter() - t0
            del result
            point = {"status": "ok", "message": "", "time_ms": round(seconds * 1e3, 4),
                     "peak_mem_bytes": meter.peak, "retained_bytes": meter.retained, "output_bytes": output_bytes}
        except Exception as exc:  # noqa: BLE001
            point = {"status": _status_of(exc), "message": _one_line(exc)}
            failed = True
        finally:
            free_memory(device, collect=failed)
        return point

    # ---- harness
    def run_harness(self) -> None:
        self.budget.section(SECTION_SHARE["harness"])
        try:
            self.report["harness"] = harness_throughput(self.s, self.log)
        except Exception as exc:  # noqa: BLE001
            self.report["harness"] = {"suite": self.s.harness_suite, "status": _status_of(exc),
                                      "message": _one_line(exc)}


# ---- reference functions' memory ----------------------------------------------------------------------------------
def _function_series(ratio: int) -> list[tuple[str, str, Callable]]:
    """Reference functions whose memory vs T is checked: (series name, function path, builder).

    A builder returns ``(run, output_bytes)``; ``run()`` is measured by a :class:`MemoryMeter` (peak above the
    start, and ``retained``: still in use after it, i.e. its outputs and what autograd saved for the backward)."""
    from .bench_workloads import _resolve

    def inputs(work: Workload, device: str):
        c = work.config
        S, n, D = work.tokens, c.num_attention_heads, c.v_head_dim
        nI, dI = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        n_comp = S // 4
        gen = torch.Generator(device=device).manual_seed(2)
        dt = work.case.torch_dtype

        def r(*shape):
            return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

        return c, S, n, D, nI, dI, n_comp, r

    def teacher(work: Workload, device: str):
        c, S, n, D, nI, dI, n_comp, r = inputs(work, device)
        f = _resolve("reference.indexer_loss:indexer_kl_rows")
        scores = torch.randn((1, S, n_comp), device=device)
        q, kv, comp = r(1, S, n, D), r(1, S, D), r(1, n_comp, D)
        sink = torch.zeros(n, device=device)

        def run():
            with torch.no_grad():
                return f(scores, None, q, kv, comp, sink, c)

        return run, 4 * S

    def scores_saved(work: Workload, device: str):
        c, S, n, D, nI, dI, n_comp, r = inputs(work, device)
        f = _resolve("reference.indexer:index_scores")
        q, k, w = (t.requires_grad_(True) for t in (r(1, S, nI, dI), r(1, n_comp, dI), r(1, S, nI)))
        return (lambda: f(q, k, w, c.indexer_softmax_scale, ratio=4)), 4 * S * n_comp

    def attention_saved(work: Workload, device: str):
        c, S, n, D, nI, dI, n_comp, r = inputs(work, device)
        f = _resolve("reference.sparse_attention:sparse_attention")
        win = _resolve("reference.sparse_attention:window_indices")
        K = c.dsa_indexer_topk
        comp_ids = torch.arange(K, device=device).view(1, 1, K).expand(1, S, K)
        visible = ((torch.arange(S, device=device) + 1) // 4).view(1, S, 1)
        comp_ids = torch.where(comp_ids < visible, comp_ids + S, -1)
        ids = torch.cat((win(S, c.csa_window_size, device).view(1, S, -1), comp_ids), dim=-1)
        q = r(1, S, n, D).requires_grad_(True)
        kv_full = r(1, S + n_comp, D).requires_grad_(True)
        sink = torch.zeros(n, device=device, requires_grad=True)
        return (lambda: f(q, kv_full, ids, sink, c.softmax_scale)), (S * n * D * q.element_size() + 4 * S * n)

    out = [("dense-loss teacher (no grad): peak", "reference.indexer_loss:indexer_kl_rows", teacher)]
    if ratio == 4:
        out.append(("indexer scores with autograd: retained", "reference.indexer:index_scores", scores_saved))
    out.append(("sparse attention with autograd: retained", "reference.sparse_attention:sparse_attention",
                attention_saved))
    return out


def _slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(y) on log(x)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return None if den == 0 else sum((p[0] - mx) * (p[1] - my) for p in pts) / den


def _verdict(slope: Optional[float]) -> str:
    if slope is None:
        return "n/a"
    if slope < 1.25:
        return "linear"
    if slope < 1.75:
        return "superlinear"
    return "quadratic"


def fit_series(series: list[dict]) -> list[dict]:
    """Log-log slope of time and memory of every series over its measured points."""
    fits = []
    for s in series:
        ok = [p for p in s["points"] if p.get("status") == "ok"]
        metrics = ("time_ms", "peak_mem_bytes") if s["kind"] != "function memory" else (
            "retained_bytes" if "retained" in s["name"] else "peak_mem_bytes",)
        for metric in metrics:
            pts = [p for p in ok if p.get(metric)]
            slope = _slope([p["tokens"] for p in pts], [p[metric] for p in pts])
            fits.append({"series": s["name"], "metric": metric, "slope": slope, "points": len(pts),
                         "verdict": _verdict(slope)})
    return fits


def _where(function: str) -> Optional[str]:
    from .bench_workloads import _resolve

    try:
        obj = _resolve(function)
        path = Path(inspect.getsourcefile(obj)).resolve()
        line = inspect.getsourcelines(obj)[1]
        try:
            path = path.relative_to(Path.cwd().resolve())
        except ValueError:
            pass
        return f"{path}:{line}"
    except (ImportError, AttributeError, TypeError, OSError):
        return None


def findings_from_fits(series: list[dict], fits: list[dict]) -> list[dict]:
    """A function whose memory grows faster than linearly in T is a finding (it is not chunked, or autograd keeps
    a ``T × T`` tensor); so is a forward + backward series whose memory is not linear."""
    by_name = {s["name"]: s for s in series}
    out = []
    for fit in fits:
        s = by_name[fit["series"]]
        if fit["metric"] == "time_ms" or fit["slope"] is None or fit["slope"] < 1.5:
            continue
        pts = [p for p in s["points"] if p.get("status") == "ok" and p.get(fit["metric"])]
        last = pts[-1] if pts else {}
        msg = (f"{fit['series']}: {fit['metric']} grows as T^{fit['slope']:.2f} "
               f"({last.get(fit['metric'])} bytes at T={last.get('tokens')})")
        if s.get("function"):
            out.append({"kind": "memory superlinear in T", "function": s["function"],
                        "where": _where(s["function"].split(" ")[0]), "message": msg})
        elif "fixed segments" in s["name"]:
            out.append({"kind": "memory superlinear in T", "function": None, "where": None, "message": msg})
    return out


# ---- harness throughput ---------------------------------------------------------------------------------------------
class PhaseClock:
    """Accumulates seconds per phase name; nested phases of the same clock are not double counted."""

    def __init__(self, device: str):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.role: Optional[str] = None
        self._grad_depth = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def timed(self, phase: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            synchronize(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.add(phase, time.perf_counter() - t0)

        return wrapper


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any):
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


@contextlib.contextmanager
def engine_phases(clock: PhaseClock, impl_api: Any):
    """Time the engine's phases in this process (restored on exit): ``materialize``; ``<role> forward`` /
    ``<role> backward`` (role ``impl``, ``truth`` = float64 reference, ``noise`` = same-dtype reference);
    ``snapshot`` (leaf copies and mutation checks around them); ``compare`` (structure rules, metrics, verdict);
    ``rows`` (building the result rows), ``write`` (writing them), ``environment`` (the run row's versions)."""
    from . import engine, environment, results, snapshot, structure, verdict

    real_run, real_call, real_grad = engine.run, snapshot._call, torch.autograd.grad

    def run(module, case, tensors, *args, **kwargs):
        clock.role = "impl" if module is impl_api else ("truth" if kwargs.get("upcast") else "noise")
        t0 = time.perf_counter()
        try:
            return real_run(module, case, tensors, *args, **kwargs)
        finally:
            synchronize(clock.device)
            clock.add("snapshot", time.perf_counter() - t0)  # the forward / backward parts are subtracted below
            clock.role = None

    def call(*args, **kwargs):
        role = clock.role or "other"
        return clock.timed(f"{role} forward", real_call)(*args, **kwargs)

    def grad(*args, **kwargs):
        if clock.role is None or clock._grad_depth:
            return real_grad(*args, **kwargs)
        clock._grad_depth += 1
        try:
            return clock.timed(f"{clock.role} backward", real_grad)(*args, **kwargs)
        finally:
            clock._grad_depth -= 1

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(engine, "run", run))
        stack.enter_context(_patched(engine, "materialize", clock.timed("materialize", engine.materialize)))
        stack.enter_context(_patched(snapshot, "_call", call))
        stack.enter_context(_patched(torch.autograd, "grad", grad))
        stack.enter_context(_patched(structure, "check", clock.timed("compare", structure.check)))
        stack.enter_context(_patched(verdict, "judge_case_tensors",
                                     clock.timed("compare", verdict.judge_case_tensors)))
        stack.enter_context(_patched(verdict, "case_decision", clock.timed("compare", verdict.case_decision)))
        stack.enter_context(_patched(results.ResultsWriter, "write",
                                     clock.timed("write", results.ResultsWriter.write)))
        stack.enter_context(_patched(results.CaseResult, "rows", clock.timed("rows", results.CaseResult.rows)))
        stack.enter_context(_patched(environment, "environment",
                                     clock.timed("environment", environment.environment)))
        yield
    impl_parts = sum(v for k, v in clock.seconds.items() if k.endswith(" forward") or k.endswith(" backward"))
    clock.seconds["snapshot"] = max(clock.seconds.get("snapshot", 0.0) - impl_parts, 0.0)


def _spread(cases: list, limit: int) -> list:
    """``limit`` cases spread evenly over the suite (all when ``limit`` ≤ 0 or ≥ the suite)."""
    if limit <= 0 or limit >= len(cases):
        return list(cases)
    step = len(cases) / limit
    return [cases[int(i * step)] for i in range(limit)]


def harness_throughput(s: Settings, log: Callable[[str], None]) -> dict:
    """Run ``s.harness_suite`` (or ``harness_limit`` of its cases) in-process and time the engine's phases."""
    from cases.suites import load_suite

    from .engine import RunOptions
    from .impls import load
    from .runner import RunConfig, run

    clock = PhaseClock(s.device)
    t0 = time.perf_counter()
    suite = load_suite(s.harness_suite)
    clock.add("load suite", time.perf_counter() - t0)
    cases = _spread(suite, s.harness_limit)
    options = RunOptions(impl="fused", against="reference", provider=s.provider, device=s.device)
    impl = load("fused")
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-") as tmp:
        out_dir = Path(tmp) / "run"
        config = RunConfig(suite=s.harness_suite, options=options, out_dir=out_dir, isolate="none", quiet=True,
                           run_id="bench", argv=["dsv4-parity", "bench"])
        t0 = time.perf_counter()
        with engine_phases(clock, impl.api):
            counts, _code = run(cases, config)
        total = time.perf_counter() - t0
        report_s = None
        if s.harness_report:
            report_s = _time_report(out_dir)
    phases = {k: round(v, 4) for k, v in sorted(clock.seconds.items())}
    run_phases = {k: v for k, v in clock.seconds.items() if k != "load suite"}
    implementation = sum(v for k, v in run_phases.items() if k.endswith(" forward") or k.endswith(" backward"))
    phases["other (runner loop, case JSON, progress)"] = round(max(total - sum(run_phases.values()), 0.0), 4)
    per_case = total / max(len(cases), 1)
    out = {"suite": s.harness_suite, "status": "ok", "cases": len(cases), "suite_cases": len(suite),
           "isolation": "none (in-process)", "total_s": round(total, 3), "cases_per_min": 60.0 * len(cases) / total,
           "phases": phases, "implementation_s": round(implementation, 4),
           "overhead_s": round(total - implementation, 4), "overhead_share": (total - implementation) / total,
           "report_s": report_s, "suite_estimate_s": round(per_case * len(suite) + clock.seconds["load suite"], 2),
           "counts": counts}
    log(f"harness {s.harness_suite}: {len(cases)} cases in {total:.1f} s, overhead {out['overhead_share']:.1%}")
    return out


def _time_report(out_dir: Path) -> Optional[float]:
    """Seconds to render the run's report through the reports plug-in (``None`` if it is not installed)."""
    import importlib

    try:
        mod = importlib.import_module("reports.commands")
    except ImportError:
        return None
    render = getattr(mod, "render_run", None)
    if not callable(render):
        return None
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            render(out_dir, quiet=True)
    except Exception:  # noqa: BLE001 — the report is optional here
        return None
    return round(time.perf_counter() - t0, 3)


# ---- targets ------------------------------------------------------------------------------------------------------------
def _target(name: str, target: str, measured: Any, unit: str, ok: Optional[bool], note: str = "") -> dict:
    status = "not measured" if ok is None else ("met" if ok else "missed")
    return {"name": name, "target": target, "measured": measured, "unit": unit, "status": status, "note": note}


def evaluate_targets(report: dict, s: Settings) -> list[dict]:
    out = []
    h = report.get("harness") or {}
    ok_h = h.get("status") == "ok"
    cores = report["machine"].get("cpus_allowed") or report["machine"].get("cpu_count")
    if ok_h and h["suite"] == "smoke" and s.device == "cpu":
        est = h["suite_estimate_s"] / 60
        out.append(_target("smoke suite on CPU", f"<= {TARGETS['smoke_cpu_minutes']} min on 2 cores",
                           round(est, 2), "min", est <= TARGETS["smoke_cpu_minutes"],
                           f"{'measured' if h['cases'] == h['suite_cases'] else 'extrapolated from'} "
                           f"{h['cases']}/{h['suite_cases']} cases, in-process, {cores} cores, load "
                           f"{report['machine'].get('load_avg')}; import and CLI start-up not included"))
    else:
        out.append(_target("smoke suite on CPU", f"<= {TARGETS['smoke_cpu_minutes']} min on 2 cores", None, "min",
                           None, "run the bench on the CPU with the smoke harness suite"))
    if ok_h and h["suite"] == "gate" and s.device == "cuda":
        est = h["suite_estimate_s"] / 60
        out.append(_target("gate suite on one H200", f"<= {TARGETS['gate_gpu_minutes']} min (>= 200 cases)",
                           round(est, 2), "min", est <= TARGETS["gate_gpu_minutes"],
                           f"{'measured' if h['cases'] == h['suite_cases'] else 'extrapolated from'} "
                           f"{h['cases']}/{h['suite_cases']} cases, in-process"))
    else:
        out.append(_target("gate suite on one H200", f"<= {TARGETS['gate_gpu_minutes']} min", None, "min", None,
                           "needs CUDA (--harness-suite gate)"))
    if ok_h:
        share = h["overhead_share"]
        out.append(_target(f"harness overhead ({h['suite']})", f"<= {TARGETS['harness_overhead_share']:.0%}",
                           round(share, 4), "share", share <= TARGETS["harness_overhead_share"],
                           "time outside the implementations' forward + backward (the target is for a gate run)"))
    else:
        out.append(_target("harness overhead", "<= 15%", None, "share", None, "harness section not run"))
    probe = report.get("pro_pack_probe")
    if probe:
        ok = probe["status"] == "ok"
        out.append(_target("reference, 32K-token Pro pack, one H200", "no OOM", probe["status"], "",
                           ok if probe["status"] in ("ok", "oom") else None,
                           f"layer fwd+bwd {probe['dtype']}, peak {probe.get('peak_mem_bytes')} B above inputs "
                           f"{probe.get('inputs_bytes')} B; {probe.get('message', '')}"))
    else:
        out.append(_target("reference, 32K-token Pro pack, one H200", "no OOM", None, "", None,
                           "needs CUDA with the pro profile"))
    ratios = [r for r in report["e2e"] if r.get("impl") == "fused" and r["status"] == "ok" and r["scope"] == "core"
              and r.get("composition_ratio")]
    if ratios:
        worst = max(ratios, key=lambda r: r["composition_ratio"])
        out.append(_target("fused core fwd+bwd / sum of its kernels", f"<= {TARGETS['composition_ratio']}",
                           round(worst["composition_ratio"], 3), "x",
                           worst["composition_ratio"] <= TARGETS["composition_ratio"],
                           f"worst of {len(ratios)} workloads ({worst['profile']} T={worst['tokens']}, provider "
                           f"{worst['provider']}); eager compressor / projections / index maps count as overhead"))
    else:
        out.append(_target("fused core fwd+bwd / sum of its kernels", "<= 1.2", None, "x", None,
                           "no fused core-scope row"))
    return out


def pro_pack_probe(bench: Bench, deadline: Optional[float]) -> Optional[dict]:
    """CUDA: the reference on a 32K-token Pro pack (segments of ``segment_len``), layer fwd+bwd in bf16."""
    if bench.s.device != "cuda":
        return None
    work = Workload("pro", 32768, layout="pack", segment_len=bench.s.segment_len, ratio=4, loss="sparse",
                    dtype="bfloat16", scope="layer")
    row = bench.e2e(work, "reference", deadline)
    bench.report["e2e"].append(row)
    return {"status": row["status"], "message": row["message"], "dtype": "bfloat16",
            "peak_mem_bytes": row["peak_mem_bytes"], "inputs_bytes": row["inputs_bytes"],
            "time_ms": row["time"]["median_ms"]}


# ---- schema -------------------------------------------------------------------------------------------------------------
STATUSES = {"ok", "oom", "error", "unsupported", "skipped", "absent"}
_E2E_FIELDS = {"profile": str, "tokens": int, "layout": str, "scope": str, "impl": str, "status": str,
               "message": str, "time": dict, "flops": (int, float), "tflops": (int, float, type(None)),
               "peak_fraction": (int, float, type(None)), "peak_mem_bytes": (int, type(None)),
               "inputs_bytes": (int, type(None))}
_STAGE_SIDE = {"status": str, "time_ms": (int, float, type(None)), "tflops": (int, float, type(None)),
               "peak_mem_bytes": (int, type(None))}
_TARGET_STATUSES = {"met", "missed", "not measured"}


def check_schema(report: Any) -> list[str]:
    """Problems with a bench JSON document (empty list: it follows ``dsv4-parity-bench/1``)."""
    problems: list[str] = []

    def need(obj: Any, fields: dict, where: str) -> None:
        if not isinstance(obj, dict):
            problems.append(f"{where}: not an object")
            return
        for name, kind in fields.items():
            if name not in obj:
                problems.append(f"{where}.{name}: missing")
            elif not isinstance(obj[name], kind) or isinstance(obj[name], bool):
                problems.append(f"{where}.{name}: {type(obj[name]).__name__} is not {kind}")
        if isinstance(obj.get("status"), str) and obj["status"] not in STATUSES | _TARGET_STATUSES:
            problems.append(f"{where}.status: unknown status {obj['status']!r}")

    need(report, {"schema": str, "created": str, "settings": dict, "env": dict, "machine": dict, "e2e": list,
                  "stages": list, "scaling": dict, "targets": list, "findings": list, "skipped": list}, "report")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"report.schema: {report['schema']!r} is not {SCHEMA!r}")
    for i, row in enumerate(report["e2e"]):
        need(row, _E2E_FIELDS, f"e2e[{i}]")
        if isinstance(row, dict) and isinstance(row.get("time"), dict):
            need(row["time"], {"median_ms": (int, float, type(None)), "repeats": int}, f"e2e[{i}].time")
            if row.get("status") == "ok" and row["time"].get("median_ms") is None:
                problems.append(f"e2e[{i}]: status ok without a time")
    for i, row in enumerate(report["stages"]):
        need(row, {"profile": str, "tokens": int, "group": str, "fused": dict, "reference": dict}, f"stages[{i}]")
        for side in ("fused", "reference"):
            if isinstance(row, dict) and isinstance(row.get(side), dict):
                need(row[side], {"status": str}, f"stages[{i}].{side}")
                if row[side].get("status") == "ok":
                    need(row[side], _STAGE_SIDE, f"stages[{i}].{side}")
    need(report["scaling"], {"series": list, "fits": list}, "scaling")
    for i, s in enumerate(report["scaling"].get("series", [])):
        need(s, {"name": str, "impl": str, "kind": str, "points": list}, f"scaling.series[{i}]")
        for j, p in enumerate(s.get("points", []) if isinstance(s, dict) else []):
            need(p, {"tokens": int, "status": str}, f"scaling.series[{i}].points[{j}]")
    for i, f in enumerate(report["scaling"].get("fits", [])):
        need(f, {"series": str, "metric": str, "slope": (int, float, type(None)), "verdict": str},
             f"scaling.fits[{i}]")
    h = report.get("harness")
    if h is not None:
        need(h, {"suite": str, "status": str}, "harness")
        if isinstance(h, dict) and h.get("status") == "ok":
            need(h, {"cases": int, "suite_cases": int, "total_s": (int, float), "cases_per_min": (int, float),
                     "phases": dict, "overhead_share": (int, float), "suite_estimate_s": (int, float),
                     "counts": dict}, "harness")
    for i, t in enumerate(report["targets"]):
        need(t, {"name": str, "target": str, "status": str, "note": str}, f"targets[{i}]")
        if isinstance(t, dict) and t.get("status") not in _TARGET_STATUSES:
            problems.append(f"targets[{i}].status: {t.get('status')!r}")
    for i, f in enumerate(report["findings"]):
        need(f, {"kind": str, "message": str}, f"findings[{i}]")
    return problems


# ---- output ------------------------------------------------------------------------------------------------------------
def _ms(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def _mib(x: Optional[int]) -> str:
    return "—" if x is None else f"{x / 2 ** 20:,.1f}"


def _tf(x: Optional[float]) -> str:
    return "—" if x is None else (f"{x:.3g}" if x >= 0.01 else f"{x:.2e}")


def render_tables(report: dict, console=None) -> None:
    """The report as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 170)
    env, m = report["env"], report["machine"]
    console.print(f"[bold]dsv4-parity bench[/] — {env.get('gpu') or m.get('processor')} · "
                  f"{m.get('cpus_allowed', m.get('cpu_count'))} cores · load {m.get('load_avg')} · torch "
                  f"{env.get('torch')} · peak {report.get('peak_tflops') or 'n/a'} TFLOP/s · "
                  f"{report.get('duration_s')} s")
    peak = report.get("peak_tflops")
    if report["e2e"]:
        t = Table(title="End to end: forward + backward (time = median; memory = peak above inputs)")
        for col in ("profile", "T", "layout", "scope", "impl", "status", "ms", "TFLOP/s",
                    "% peak" if peak else "", "MiB", "kernels ms", "ratio"):
            if col:
                t.add_column(col, justify="right" if col not in ("profile", "layout", "scope", "impl", "status")
                             else "left")
        for r in report["e2e"]:
            cells = [r["profile"], str(r["tokens"]), r["layout"], r["scope"], r["impl"], r["status"],
                     _ms(r["time"]["median_ms"]), _tf(r["tflops"])]
            if peak:
                cells.append("—" if r["peak_fraction"] is None else f"{100 * r['peak_fraction']:.1f}")
            cells += [_mib(r["peak_mem_bytes"]), _ms(r.get("kernel_sum_ms")),
                      "—" if not r.get("composition_ratio") else f"{r['composition_ratio']:.2f}"]
            t.add_row(*cells)
        console.print(t)
    if report["stages"]:
        t = Table(title="Stages: fused kernels (in the core-scope run) vs the reference stage alone")
        for col in ("profile", "T", "stage", "fused ms", "fused TFLOP/s", "fused MiB", "ref ms", "ref TFLOP/s",
                    "ref MiB", "ref/fused"):
            t.add_column(col, justify="left" if col in ("profile", "stage") else "right")
        for r in report["stages"]:
            f, g = r["fused"], r["reference"]
            t.add_row(r["profile"], str(r["tokens"]), r["group"],
                      _ms(f.get("time_ms")) if f.get("status") == "ok" else f.get("status", "—"),
                      _tf(f.get("tflops")), _mib(f.get("peak_mem_bytes")),
                      _ms(g.get("time_ms")) if g.get("status") == "ok" else g.get("status", "—"),
                      _tf(g.get("tflops")), _mib(g.get("peak_mem_bytes")),
                      "—" if not r.get("speedup") else f"{r['speedup']:.2f}")
        console.print(t)
    fits = report["scaling"]["fits"]
    if fits:
        t = Table(title="Scaling with T (log-log slope; 1 = linear, 2 = quadratic)")
        for col in ("series", "metric", "slope", "points", "verdict"):
            t.add_column(col, justify="left" if col in ("series", "metric", "verdict") else "right")
        for f in fits:
            t.add_row(f["series"], f["metric"], "—" if f["slope"] is None else f"{f['slope']:.2f}",
                      str(f["points"]), f["verdict"])
        console.print(t)
    h = report.get("harness")
    if h and h.get("status") == "ok":
        t = Table(title=f"Harness: {h['cases']}/{h['suite_cases']} {h['suite']} cases in {h['total_s']} s — "
                        f"{h['cases_per_min']:.1f} cases/min, overhead {h['overhead_share']:.1%}")
        t.add_column("phase")
        t.add_column("s", justify="right")
        t.add_column("share", justify="right")
        for k, v in h["phases"].items():
            t.add_row(k, f"{v:.3f}", f"{v / h['total_s']:.1%}" if k != "load suite" else "")
        if h.get("report_s") is not None:
            t.add_row("report rendering (after the run)", f"{h['report_s']:.3f}", "")
        console.print(t)
    elif h:
        console.print(f"harness: {h.get('status')} {h.get('message')}")
    if report["targets"]:
        t = Table(title="Targets (reported, never asserted)")
        for col in ("target", "goal", "measured", "status", "note"):
            t.add_column(col, overflow="fold")
        for x in report["targets"]:
            style = {"met": "green", "missed": "red"}.get(x["status"], "yellow")
            t.add_row(x["name"], x["target"], f"{x['measured']} {x['unit']}" if x["measured"] is not None else "—",
                      f"[{style}]{x['status']}[/]", x["note"])
        console.print(t)
    for f in report["findings"]:
        console.print(f"[bold red]finding[/] {f['function'] or ''} {f['where'] or ''}: {f['message']}")
    if report["skipped"]:
        console.print(f"skipped: {len(report['skipped'])} item(s) (see the JSON)")


def write_plot(report: dict, path: Path) -> Optional[Path]:
    """Log-log plots (scaling: reference time and memory vs T; e2e: fused vs reference time) as one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for s in report["scaling"]["series"]:
        pts = [p for p in s["points"] if p.get("status") == "ok"]
        if s["kind"] == "forward+backward":
            xs = [p["tokens"] for p in pts if p.get("time_ms")]
            axes[0].plot(xs, [p["time_ms"] for p in pts if p.get("time_ms")], "o-", label=s["name"])
        metric = "retained_bytes" if "retained" in s["name"] else "peak_mem_bytes"
        mp = [p for p in pts if p.get(metric)]
        axes[1].plot([p["tokens"] for p in mp], [p[metric] / 2 ** 20 for p in mp], "o-", label=s["name"])
    for (profile, scope, impl) in sorted({(r["profile"], r["scope"], r["impl"]) for r in report["e2e"]}):
        pts = [r for r in report["e2e"] if (r["profile"], r["scope"], r["impl"]) == (profile, scope, impl)
               and r["status"] == "ok" and r["layout"] == report["settings"]["layout"]]
        if pts:
            axes[2].plot([r["tokens"] for r in pts], [r["time"]["median_ms"] for r in pts],
                         "o-" if impl == "fused" else "s--", label=f"{impl} {profile} {scope}")
    for ax in axes:  # a dotted "∝ T" guide through the first point of the first line
        lines = ax.get_lines()
        if lines and len(lines[0].get_xdata()) > 1:
            xs, ys = list(lines[0].get_xdata()), list(lines[0].get_ydata())
            ax.plot([xs[0], xs[-1]], [ys[0], ys[0] * xs[-1] / xs[0]], ":", color="gray", label="∝ T")
    titles = ("reference fwd+bwd time vs T", "memory vs T (MiB)", "end to end fwd+bwd time vs T")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("tokens T")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("ms")
    axes[2].set_ylabel("ms")
    fig.suptitle(f"dsv4-parity bench — {report['env'].get('gpu') or report['machine'].get('processor')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ---- command ------------------------------------------------------------------------------------------------------------
def run_bench(settings: Settings, argv: Sequence[str] = (), log: Optional[Callable[[str], None]] = None) -> dict:
    """Measure every selected section; returns the report (the JSON document)."""
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        return _run_sections(settings, argv, log or (lambda _msg: None))
    finally:
        torch.set_num_threads(threads)


def _run_sections(settings: Settings, argv: Sequence[str], log: Callable[[str], None]) -> dict:
    start = time.perf_counter()
    report = empty_report(settings, argv)
    bench = Bench(settings, report, log)
    if "e2e" in settings.sections:
        bench.run_e2e()
    if "stages" in settings.sections:
        bench.run_stages()
        if "e2e" not in settings.sections:  # the fused rows the stages used are still worth reporting
            report["e2e"] = [r for r in bench.e2e_cache.values() if r["scope"] == "core"]
    if "e2e" in settings.sections and settings.device == "cuda" and "pro" in settings.profiles:
        report["pro_pack_probe"] = pro_pack_probe(bench, bench.budget.section(0.3))
    if "scaling" in settings.sections:
        bench.run_scaling()
    if "harness" in settings.sections:
        bench.run_harness()
    clear_caches()
    free_memory(settings.device)
    report["targets"] = evaluate_targets(report, settings)
    report["duration_s"] = round(time.perf_counter() - start, 2)
    return _jsonable(report)


def default_json_path() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("reports") / "out" / "bench" / f"bench-{stamp}.json"


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        settings = resolve_settings(args)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        if not settings.quiet:
            print(f"bench: {msg}", file=sys.stderr, flush=True)

    report = run_bench(settings, sys.argv, log)
    path = Path(args.json) if args.json else default_json_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    png = None if args.no_plot else write_plot(report, Path(args.plot) if args.plot else path.with_suffix(".png"))
    render_tables(report)
    print(f"json: {path}" + (f"\nplot: {png}" if png else ""))
    return 0


BENCH_EPILOG = """\
examples:
  dsv4-parity bench                                   # CPU: tiny profile, T = 256..2048, ~20 s
  dsv4-parity bench --json out/bench.json             # + out/bench.png
  dsv4-parity bench --profile kernel,flash,pro --tokens 4K,8K,16K,32K,64K --json $OUT/bench.json   # one H200
  dsv4-parity bench --sections harness --harness-suite smoke --harness-limit 0   # the whole smoke suite

Numbers are reported, never asserted (exit 0 unless the options are wrong). Everything that does not fit the
--budget-s deadline, exceeds --ref-max-tokens or runs out of memory is listed as skipped / oom in the JSON.
"""


def add_parsers(subparsers: argparse._SubParsersAction) -> dict:
    """Register ``bench`` (the plug-in hook :func:`parity.cli.build_parser` calls)."""
    p = subparsers.add_parser(
        "bench", help="benchmark the fused path, the reference and the harness (reported, never asserted)",
        description=__doc__.split("\n\n")[0] + "\n\n" + "Sections: e2e, stages, scaling, harness (see the module "
        "docstring of parity/bench.py for what each measures).", epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help="profiles, comma-separated (CPU default tiny; CUDA kernel,flash,pro)")
    p.add_argument("--tokens", help="token counts T, comma-separated, 4K suffixes allowed (CPU default "
                                    "256,512,1024,2048; CUDA 4K,8K,16K,32K,64K)")
    p.add_argument("--layout", default="seq", choices=LAYOUTS,
                   help="seq: one sequence of T tokens (BSHD); pack: THD pack of --segment-len segments")
    p.add_argument("--segment-len", type=int, help="segment length of THD packs (CPU 256, CUDA 4096)")
    p.add_argument("--ratio", type=int, default=4, help="compress ratio of the benchmarked layer (default 4)")
    p.add_argument("--loss", default="sparse", choices=LOSSES, help="indexer loss (default sparse)")
    p.add_argument("--dtype", help="activation dtype (CPU default float32, CUDA bfloat16)")
    p.add_argument("--scope", help="core and/or layer, comma-separated (default core,layer)")
    p.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)} (default all)")
    p.add_argument("--provider", default="auto", choices=("auto", "torch", "cudnn", "flashmla"),
                   help="fused kernel provider (default auto: the best per stage)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per measurement (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, at most (default 3)")
    p.add_argument("--target-s", type=float, default=1.0,
                   help="seconds of timed repeats per measurement; fewer repeats when one run is slower")
    p.add_argument("--budget-s", type=float, help="deadline for the whole bench in seconds (CPU 55, CUDA 300; 0 = none)")
    p.add_argument("--ref-max-tokens", type=int,
                   help="skip reference runs above this T (CUDA default 32768; 0 = no limit)")
    p.add_argument("--harness-suite", help="suite for the harness section (CPU smoke, CUDA gate)")
    p.add_argument("--harness-limit", type=int,
                   help="cases of it, spread over the suite (CPU 0 = all, CUDA 24)")
    p.add_argument("--no-harness-report", action="store_true", help="do not time the report rendering")
    p.add_argument("--peak-tflops", type=float, help="peak for the %% column (CUDA default 790, the H200 bf16)")
    p.add_argument("--threads", type=int,
                   help="torch intra-op threads (CPU default 1: on a shared machine two threads make the timings "
                        "bimodal; CUDA default: unchanged)")
    p.add_argument("--json", metavar="PATH", help="write the JSON here (default reports/out/bench/bench-<time>.json)")
    p.add_argument("--plot", metavar="PATH", help="write the PNG here (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_bench)
    return {"bench": p}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m parity.bench``: the subcommand alone."""
    parser = argparse.ArgumentParser(prog="dsv4-parity")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench"] + list(sys.argv[1:] if argv is None else argv))
    from .engine import configure_torch

    configure_torch()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
