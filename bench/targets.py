"""The bench's targets — reported against, never asserted — the one place their limits are written
(:func:`bench.core.evaluate_targets` and :mod:`bench.gate` report against them)."""

TARGETS = {
    "smoke_cpu_minutes": 2.0,        # the smoke suite on 2 CPU cores
    "gate_gpu_minutes": 10.0,        # the gate suite (>= 200 cases) on one H200, in-process harness estimate
    "harness_overhead_share": 0.15,  # time outside the two implementations' runs
    "composition_ratio": 1.2,        # fused core fwd+bwd / the sum of its kernels (or its device busy time)
    "pr_gate_warm_s": 60.0,          # the PR gate (make parity's command) with a warm compiled-kernel cache (issue 33)
    "pr_gate_cold_s": 120.0,         # ... with an empty one
    "production_gate_warm_s": 90.0,  # the production gate (--impl megatron --provider cudnn), warm
}
