#!/usr/bin/env bash
# The H200 baseline run (device tool, after .device/2/step2.sh installed the GPU packages):
# fused(cudnn + flashmla, bf16) vs reference on the `gate` suite within a time budget: first the baseline subset
# (cases.suites.gpu_subset: every case of <= 256 buffer rows + the 2 smallest ratio-128 cases, 58 cases, r128
# first), then the rest of the suite smallest first. No case starts after SECONDS (--budget-s: the end row lists
# the cases not run); results stream to $OUT/gate/results.jsonl, so even a hard kill keeps every finished case.
# Workers: --workers ${WORKERS:-auto} (auto: up to 6 per GPU; the gate is host-bound by JIT compiles and draws).
# Usage: [WORKERS=N] bash .ci/h200-gate.sh [SECONDS]
set -uo pipefail
export PYTHONUNBUFFERED=1
limit="${1:-300}"
out="${OUT:-reports/out}/gate"
ids=$(python3 - <<'PY'
from cases.suites import gpu_subset, load_suite
subset = gpu_subset(256, 2)
subset.sort(key=lambda c: (c.config.compress_ratio != 128, c.layout.num_tokens))
chosen = {c.id for c in subset}
rest = sorted((c for c in load_suite("gate") if c.id not in chosen), key=lambda c: c.layout.num_tokens)
print(" ".join(f"--case-id {c.id}" for c in subset + rest))
PY
)
# the hard stop leaves room for the last case started before the budget ran out
timeout $((limit + 150)) python3 -m cli run --suite gate $ids --provider cudnn --require cudnn \
    --workers "${WORKERS:-auto}" --budget-s "$limit" --out "$out" --quiet
echo "h200-gate: exit $?"
