#!/usr/bin/env bash
# The H200 baseline run (device tool, after .device/2/step2.sh installed the GPU packages):
# fused(cudnn + flashmla, bf16) vs reference on a device-time-bounded subset of the `gate` suite, the two
# smallest ratio-128 cases first, then the small cases by size. Results stream to $OUT/gate/results.jsonl, so a run
# stopped by its time limit keeps every finished case. Usage: bash .ci/h200-gate.sh [SECONDS]
set -uo pipefail
export PYTHONUNBUFFERED=1
limit="${1:-300}"
out="${OUT:-reports/out}/gate"
ids=$(python3 - <<'PY'
from fused.gpu_suite import select
cases = select(256, 2)
cases.sort(key=lambda c: (c.config.compress_ratio != 128, c.layout.num_tokens))
print(" ".join(f"--case-id {c.id}" for c in cases))
PY
)
timeout "$limit" python3 -m parity.cli run --suite gate $ids --provider cudnn --require cudnn --out "$out" --quiet
echo "h200-gate: exit $?"
