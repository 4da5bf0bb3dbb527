#!/usr/bin/env bash
# Issue 33 on a GPU: where a gate case's seconds go, alone and sharing the GPU (no GPU packages needed: the fused
# path runs over the torch kernel provider; the reference, the comparison and sign-split are what is measured).
#   0. the reference's CUDA tests (tests/reference/test_cuda.py, test_gather_rows.py);
#   1. .ci/probes/profile_cases.py over three of the gate's largest THD training cases (layer r = 4 with the sparse
#      and the dense loss, core r = 128): per phase the engine's seconds against the GPU's own kernel time, launches,
#      syncs, copies;
#   2. the first of them run by 1 and then by 6 processes at once (--plain): what time-slicing one GPU costs a phase.
#   nvidia-smi samples the GPU's utilisation meanwhile ($OUT/smi.csv).
# Usage: bash .ci/gpu-profile.sh   (writes $OUT/profile.txt, $OUT/shared-<k>.txt, $OUT/smi.csv, $OUT/summary.txt)
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-reports/out}"
mkdir -p "$out"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 > "$out/smi.csv" 2>&1 &
smi=$!
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider tests/reference/test_cuda.py tests/reference/test_gather_rows.py \
  > "$out/pytest-cuda.txt" 2>&1
echo "cuda tests: exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$out/pytest-cuda.txt")" | tee -a "$out/summary.txt"
t0=$(date +%s)
python3 .ci/probes/profile_cases.py --provider torch a5ffe7e7a0dc 3dbd24e37ed5 bdf7cb0366b1 \
  > "$out/profile.txt" 2>&1
echo "profile: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
t0=$(date +%s)
for k in 1 6; do
  for i in $(seq 1 "$k"); do
    python3 .ci/probes/profile_cases.py --provider torch --plain a5ffe7e7a0dc > "$out/shared-$k-$i.txt" 2>&1 &
  done
  wait $(jobs -p | grep -v "^$smi$")
  echo "shared by $k:" >> "$out/summary.txt"; grep -h '^== case' "$out"/shared-"$k"-*.txt >> "$out/summary.txt"
done
echo "sharing: $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
kill "$smi" 2>/dev/null
