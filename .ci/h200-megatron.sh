#!/usr/bin/env bash
# Production (Megatron-LM's DSv4 layer, `--impl megatron --provider cudnn`: its fused path over the real cuDNN DSA +
# FlashMLA kernels) vs the reference on the H200 (device tool, after .device/2/step2.sh installed the GPU packages).
# Runs SUITE (default gate) within SECONDS (--budget-s: no case starts later; the end row lists the cases not run),
# stores the run as the baseline <arch>/megatron-cudnn-<suite> and copies the baseline and the results under $OUT.
# Megatron: DSV4_MEGATRON (a checkout) or DSV4_MEGATRON_SNAPSHOT (the pinned archive; stage it next to the wheels).
# Usage: [WORKERS=N] bash .ci/h200-megatron.sh [SUITE] [SECONDS]
set -uo pipefail
export PYTHONUNBUFFERED=1
suite="${1:-gate}"
limit="${2:-480}"
out="${OUT:-reports/out}"
run="/tmp/megatron-$suite"
# the hard stop leaves room for the last case started before the budget ran out
timeout $((limit + 90)) python3 -m cli run --suite "$suite" --impl megatron --provider cudnn \
    --workers "${WORKERS:-auto}" --budget-s "$limit" --out "$run" --force --quiet
code=$?
echo "h200-megatron $suite: run exit $code"
python3 -m cli compare "$run" --update && \
    cp -r "reports/baselines/h200/megatron-cudnn-$suite" "$out/baseline-megatron-cudnn-$suite"
mkdir -p "$out/megatron-$suite" && cp "$run/results.jsonl" "$out/megatron-$suite/"
python3 - "$run/results.jsonl" <<'PY'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
cases = [r for r in rows if r.get("type") == "case"]
print("outcomes:", dict(collections.Counter(r["outcome"] for r in cases)))
for r in cases:
    if r["outcome"] not in ("pass", "known"):
        print(f"  {r['outcome']:<11} {r['case_id']}  {r['message'][:300]}")
phases = collections.Counter()
for r in cases:
    phases.update(r.get("phases_s") or {})
print("phases (s, summed):", {k: round(v, 1) for k, v in phases.most_common()})
PY
exit $code
