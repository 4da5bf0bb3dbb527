#!/usr/bin/env bash
# Issue 33's H200 measurements as device calls (after .device/1/step1.sh and .device/2/step2.sh installed the GPU
# packages). Each stage writes under $OUT and a line to $OUT/summary.txt, so what was measured goes into the repo as
# data (reports/baselines/h200/bench/).
#   cuda      the CUDA halves of the new tests: draws bit-identical on CPU and CUDA, the reference's ordered gather
#             gradient bit-identical to autograd's index_put on CUDA, the reference on CUDA
#   fused     bench --sections gate --gate-runs cold,warm,warm: make parity's gate (fused, cudnn, --workers auto);
#             the second warm run gives the spread between runs
#   production bench --sections gate --gate-impl megatron --gate-runs warm over the same kernel cache (PROD_RUNS=warm,warm
#             where production's own kernel keys are not compiled yet: its first run compiles them)
#   mps       the warm fused gate under an MPS server (after `fused`: its kernel cache), the workers' kernels concurrent
#   ops       bench --sections ops over 24 gate cases on the GPU (fused, cudnn): ATen ops per case and phase, the
#             reference's and the comparison's by site (compare with reports/baselines/cpu/bench/NOTE-ops-20261206.md)
#   signsplit .ci/probes/sign_split_entry.py on production's fused path (cudnn, the 2 largest bf16 layer and core gate
#             cases): whether its indexer (the core forward stopped once the kernels have scored) agrees bit for bit
#             with the case forward on the real kernels, and its time against one forward a head
#             (reports/baselines/cpu/bench/NOTE-sign-split-20261208.md measured it on the CPU, emulated)
# Megatron (production): .mg/megatron-lm-dev-*.tar.gz (the pinned snapshot), carried as .mg.
# Usage: bash .ci/h200-gate-speed.sh STAGE ...
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-reports/out}"
mkdir -p "$out"
snapshot=$(ls "$PWD"/.mg/megatron-lm-dev-*.tar.gz 2>/dev/null | head -1)
[ -n "$snapshot" ] && export DSV4_MEGATRON_SNAPSHOT="$snapshot"
note() { echo "$*" | tee -a "$out/summary.txt"; }
cache=/tmp/dsv4-kernel-cache
for stage in "$@"; do
  t0=$(date +%s)
  case "$stage" in
    cuda)
      python3 -m pytest -q -p no:cacheprovider tests/cases/test_draws_cuda.py tests/reference/test_gather_rows.py \
        tests/reference/test_cuda.py > "$out/pytest-cuda.txt" 2>&1
      note "cuda tests: exit $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$out/pytest-cuda.txt")" ;;
    fused|production)
      impl=fused runs="${RUNS:-cold,warm,warm}"  # RUNS=cold,warm: one warm run (no spread) where a call is short
      [ "$stage" = production ] && impl=megatron runs="${PROD_RUNS:-warm}"  # PROD_RUNS=warm,warm: the first run
      # on a machine whose cache holds only the fused gate's kernels compiles production's own kernel keys
      # BUDGET=S: the runs left when S seconds are spent are skipped, so the JSON is written inside a call's limit
      python3 -m cli bench --sections gate --gate-impl "$impl" --gate-runs "$runs" --gate-cache-dir "$cache" \
        ${BUDGET:+--gate-budget-s "$BUDGET"} --gate-dir "/tmp/gate-$stage" --json "$out/bench-$stage.json" --no-plot \
        > "$out/bench-$stage.log" 2>&1
      note "$stage gate bench: exit $? in $(( $(date +%s) - t0 )) s"
      for run in cold warm; do  # (the repeat's stays: $OUT returns 8 files at most)
        [ -f "/tmp/gate-$stage/$run/results.jsonl" ] && gzip -c "/tmp/gate-$stage/$run/results.jsonl" > "$out/$stage-$run.jsonl.gz"
      done
      python3 - "$out/bench-$stage.json" <<'PY' | tee -a "$out/summary.txt"
import json, sys
g = json.load(open(sys.argv[1])).get("gate", {})
for r in g.get("runs", []):
    print(f"  {r.get('run')}: {r.get('wall_s')} s, {r.get('outcomes')}, phases {r.get('phases_s')}, "
          f"wall/impl {r.get('wall_over_impl')}, target {r.get('target_s')} met {r.get('met')}")
print(f"  spread: {g.get('spread')}")
PY
      ;;
    mps)  # the warm fused gate again with the workers' kernels under one MPS server (processes share the GPU
      # concurrently instead of time-slicing; the card's settings are untouched: a user daemon, stopped after)
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      if ! command -v nvidia-cuda-mps-control >/dev/null || ! nvidia-cuda-mps-control -d; then
        note "mps: no MPS control daemon here"; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; continue; fi
      python3 -m cli bench --sections gate --gate-impl fused --gate-runs warm --gate-cache-dir "$cache" \
        --gate-dir /tmp/gate-mps --json "$out/bench-mps.json" --no-plot > "$out/bench-mps.log" 2>&1
      note "mps warm gate bench: exit $? in $(( $(date +%s) - t0 )) s"
      # its results too (2026-12-06: one case errored under MPS and the run was not kept)
      [ -f /tmp/gate-mps/warm/results.jsonl ] && gzip -c /tmp/gate-mps/warm/results.jsonl > "$out/mps-warm.jsonl.gz"
      grep -h '^ERROR' -A2 "$out/bench-mps.log" 2>/dev/null | head -20 >> "$out/summary.txt"
      echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      tail -3 /tmp/mps-log/control.log 2>/dev/null >> "$out/summary.txt"
      python3 - "$out/bench-mps.json" <<'PY' | tee -a "$out/summary.txt"
import json, sys
for r in json.load(open(sys.argv[1])).get("gate", {}).get("runs", []):
    print(f"  mps {r.get('run')}: {r.get('wall_s')} s, {r.get('outcomes')}, phases {r.get('phases_s')}")
PY
      ;;
    ops)
      timeout -k 10 400 python3 -m cli bench --sections ops --harness-suite gate --harness-limit 24 --provider cudnn \
        --budget-s 360 --json "$out/bench-ops.json" --no-plot > "$out/bench-ops.log" 2>&1
      note "ops bench: exit $? in $(( $(date +%s) - t0 )) s: $(grep -m1 'ATen ops a case' "$out/bench-ops.log")" ;;
    signsplit)
      timeout -k 10 400 python3 .ci/probes/sign_split_entry.py --impl megatron --provider cudnn --count 2 \
        > "$out/sign-split-megatron.txt" 2>&1
      note "sign-split probe (megatron, cudnn): exit $? in $(( $(date +%s) - t0 )) s"
      grep -E "probe|no pattern" "$out/sign-split-megatron.txt" | tee -a "$out/summary.txt" ;;
    *) note "unknown stage $stage" ;;
  esac
done
