"""The reference's ATen ops on gate cases with the widths shrunk, under either schedule of its ordered gather
gradient (issue 33; `reports/baselines/cpu/bench/NOTE-ops-20261207f.md`).

Each named case (default: 8 spread over the suite) runs through the engine (the fused path on the torch provider
against the reference, ``bench.ops.count_case``) with hidden 32, 2 heads of 16, ``qk_pos_emb_head_dim`` 8, q-LoRA /
o-LoRA 16 and 2 indexer heads of 8; its layout, rows, window, top-k, ratio, dtype, scope and mode are kept (the op
count does not depend on the widths, and full widths take minutes a case on a CPU). ``--schedule`` picks the gather
gradient's schedule whatever the device (``segments``: CUDA's, ``ranks``: the CPU's). Prints each case's ops per
phase, then the reference's most frequent ops and sites. On a GPU a counted op is about one kernel launch.

    python3 .ci/probes/reference_ops.py [CASE_ID ...] [--suite gate] [--count 8] [--schedule segments|ranks]

Prints; changes nothing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHRUNK = dict(hidden_size=32, num_attention_heads=2, v_head_dim=16, qk_pos_emb_head_dim=8, q_lora_rank=16,
              o_lora_rank=16, dsa_indexer_n_heads=2, dsa_indexer_head_dim=8)


def shrunk(case):
    """``case`` with :data:`SHRUNK` widths (``o_groups`` at most 2)."""
    config = dataclasses.replace(case.config, **SHRUNK, o_groups=min(case.config.o_groups, 2))
    return case.replace(config=config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case_ids", nargs="*")
    ap.add_argument("--suite", default="gate")
    ap.add_argument("--count", type=int, default=8, help="cases spread over the suite when none are named")
    ap.add_argument("--schedule", choices=("segments", "ranks"), default="segments")
    args = ap.parse_args(argv)
    import reference.sparse_attention as sparse_attention
    from bench.harness import spread_cases
    from bench.ops import count_case
    from cases.suites import find_case, load_suite
    from parity import engine, impls

    engine.configure_torch()
    if args.schedule == "segments":  # the cases run on the CPU, whose schedule sum_rows_in_order looks up by name
        sparse_attention.sum_runs_by_rank = sparse_attention.sum_runs_by_segments
    cases = ([find_case(args.suite, cid) for cid in args.case_ids] if args.case_ids
             else spread_cases(load_suite(args.suite), args.count))
    options = engine.RunOptions(impl="fused", against="reference", provider="torch", device="cpu")
    fused, reference = impls.load("fused"), impls.load("reference")
    ops, sites, total = collections.Counter(), collections.Counter(), 0
    for case in cases:
        t0 = time.perf_counter()
        result, counts = count_case(shrunk(case), options, fused, reference)
        per_phase = {phase: sum(n.values()) for phase, n in counts.per_phase.items()}
        total += per_phase.get("reference", 0)
        ops.update(counts.per_phase.get("reference", {}))
        sites.update(counts.sites.get("reference", {}))
        print(f"{case.id} {result.outcome}: {per_phase} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"reference, schedule {args.schedule}: {total} ops over {len(cases)} cases")
    print("reference top ops:", ops.most_common(12))
    print("reference sites:", sites.most_common(12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
