"""Where a gate case's seconds go on the GPU, phase by phase (issue 33): host time against the GPU's own kernel time.

Runs each case once to warm up (cuBLAS handles, the provider's kernels), once plainly (the phase seconds the engine
records, no profiler), then once under ``torch.profiler`` with the engine's phases marked, and prints per phase:

* ``wall``: the engine's phase seconds of the plain run (synchronised at both ends);
* ``kernels``: the summed durations of the GPU kernels launched in the phase (profiled run), and how many;
* ``launch`` / ``sync`` / ``memcpy``: CUDA runtime calls made in the phase (kernel launches, stream / device / event
  synchronisations, copies): a host that waits for the GPU is a ``sync``;
* the phase's top ATen ops by summed kernel time and by host time;
* ``--parents fill_,copy_``: where those ops come from — each call counted under its outermost ATen op (an op that
  calls it inside its own implementation, which a ``TorchDispatchMode`` op count cannot see) or the autograd node
  whose backward ran it (``autograd::engine::evaluate_function: SliceBackward0``), with its kernel time.

A phase whose ``kernels`` is near its ``wall`` is bound by the GPU's arithmetic (six workers time-slicing one GPU then
add up); one far below it is bound by the host (launches, Python, waits), which more workers overlap.

    python3 .ci/probes/profile_cases.py a5ffe7e7a0dc 3dbd24e37ed5 [--provider auto] [--suite gate] [--top 12] [--plain]
        [--parents fill_,copy_,add_]

Prints; changes nothing. On a CPU (no kernels) it shows the host side only.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

RUNTIME = {"launch": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"),
           "sync": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
                    "cuCtxSynchronize"),
           "memcpy": ("cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyAsync", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2")}


def _phase_of(intervals, t):
    for name, start, end in intervals:
        if start <= t <= end:
            return name
    return "(outside)"


def _origin(e) -> str:
    """The outermost ATen op above ``e`` (``e`` itself when none), or the autograd node whose backward ran it."""
    origin, node = e.name, e.cpu_parent
    while node is not None and not node.name.startswith("phase:"):
        if node.name.startswith("autograd::engine::evaluate_function"):
            return node.name.split(": ", 1)[-1] + " > " + origin[6:] if origin.startswith("aten::") else node.name
        if node.name.startswith("aten::"):
            origin = node.name
        node = node.cpu_parent
    return origin[6:] if origin.startswith("aten::") else origin


def profile_case(case, impl, against, options, top: int, plain_only: bool = False, parents=()) -> None:
    from parity import engine
    sync = torch.cuda.synchronize if options.device == "cuda" else (lambda: None)
    engine.run_case(case, impl, against, options)  # warm-up
    sync()
    t0 = time.perf_counter()
    plain = engine.run_case(case, impl, against, options)
    wall = time.perf_counter() - t0
    if plain_only:
        print(f"== case {case.id}: plain run {wall:.2f} s, outcome {plain.outcome}, phases " +
              ", ".join(f"{k} {v:.3f}" for k, v in plain.phases_s.items()))
        return

    def observer(phase):
        return torch.profiler.record_function(f"phase:{phase}")

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with engine.observing_phases(observer):
            profiled = engine.run_case(case, impl, against, options)
        sync()
    events = prof.events()
    intervals = [(e.name[len("phase:"):], e.time_range.start, e.time_range.end) for e in events
                 if e.name.startswith("phase:")]
    kernel_us = collections.Counter()
    kernel_n = collections.Counter()
    runtime = collections.defaultdict(collections.Counter)
    op_kernel = collections.defaultdict(collections.Counter)
    op_host = collections.defaultdict(collections.Counter)
    op_calls = collections.defaultdict(collections.Counter)
    origin_n = collections.defaultdict(collections.Counter)
    origin_us = collections.defaultdict(collections.Counter)
    for e in events:
        if e.name.startswith("phase:") or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        phase = _phase_of(intervals, e.time_range.start)
        for kind, names in RUNTIME.items():
            if e.name in names:
                runtime[phase][kind] += 1
        if e.name.startswith("aten::"):
            op_host[phase][e.name] += e.self_cpu_time_total
            op_calls[phase][e.name] += 1
        for k in getattr(e, "kernels", []) or []:
            d = getattr(k, "duration", None)
            if d is None:
                d = k.time_range.end - k.time_range.start
            kernel_us[phase] += d
            kernel_n[phase] += 1
            op_kernel[phase][e.name] += d
            if e.name[6:] in parents:
                origin_us[phase][(e.name[6:], _origin(e))] += d
        if e.name.startswith("aten::") and e.name[6:] in parents:
            origin_n[phase][(e.name[6:], _origin(e))] += 1
    print(f"\n== case {case.id}: {case.layout} scope={case.scope} training={case.training} "
          f"r={case.config.compress_ratio} n={case.config.num_attention_heads} {case.dtype}; outcome {plain.outcome} "
          f"(profiled: {profiled.outcome}); plain run {wall:.2f} s")
    print(f"   {'phase':<12} {'wall s':>8} {'kernels s':>10} {'kernels':>8} {'launch':>7} {'sync':>6} {'memcpy':>7}")
    for phase in ("materialize", "impl", "sign_split", "reference", "compare", "(outside)"):
        w = plain.phases_s.get(phase)
        if w is None and not kernel_n[phase] and not runtime[phase]:
            continue
        r = runtime[phase]
        print(f"   {phase:<12} {w if w is not None else float('nan'):8.3f} {kernel_us[phase] / 1e6:10.3f} "
              f"{kernel_n[phase]:8d} {r['launch']:7d} {r['sync']:6d} {r['memcpy']:7d}")
    for phase in ("reference", "sign_split", "compare", "impl"):
        if not op_kernel[phase] and not op_host[phase]:
            continue
        print(f"   {phase}: top ops by kernel time (ms, calls): " + ", ".join(
            f"{n[6:]} {v / 1e3:.1f} ({op_calls[phase][n]})" for n, v in op_kernel[phase].most_common(top)))
        print(f"   {phase}: top ops by host self time (ms, calls): " + ", ".join(
            f"{n[6:]} {v / 1e3:.1f} ({op_calls[phase][n]})" for n, v in op_host[phase].most_common(top)))
        if origin_n[phase]:
            print(f"   {phase}: where {', '.join(parents)} come from (calls, kernel ms): " + "; ".join(
                f"{op} under {where} {n} ({origin_us[phase][(op, where)] / 1e3:.1f})"
                for (op, where), n in origin_n[phase].most_common(top)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case_ids", nargs="+")
    ap.add_argument("--suite", default="gate")
    ap.add_argument("--provider", default="auto")
    ap.add_argument("--impl", default="fused")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--parents", default="", help="ATen ops (comma-separated, e.g. fill_,copy_) to attribute to the "
                    "outermost op or autograd node that ran them")
    ap.add_argument("--plain", action="store_true", help="no profiled run: the plain run's phase seconds only (run "
                    "several at once to see what sharing the GPU costs)")
    args = ap.parse_args(argv)
    from cases import suites
    from parity import engine, impls
    engine.configure_torch()
    impl, against = impls.load(args.impl), impls.load("reference")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = engine.RunOptions(impl=args.impl, provider=args.provider, device=device)
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}, provider {impl.resolve_provider(args.provider)}")
    for cid in args.case_ids:
        try:
            profile_case(suites.find_case(args.suite, cid), impl, against, options, args.top, args.plain,
                          tuple(filter(None, args.parents.split(","))))
        except Exception as exc:  # noqa: BLE001 — a probe: report and go on with the next case
            print(f"\n== case {cid}: {type(exc).__name__}: {exc}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
