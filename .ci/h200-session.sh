#!/usr/bin/env bash
# One H200 measuring session in three device calls (each under the device tool's 600 s per call), after
# .device/1/step1.sh and .device/2/step2.sh installed the GPU packages. Every stage writes what it measured under
# $OUT (JSON, results, baselines) so the numbers go into the repo as data. Send the calls back to back: the machine
# and its compiled-kernel cache ($HOME/.cache/dsv4-parity) survive between calls only while it stays warm.
#   fused     the PR gate cold then warm over the default kernel cache (issue 22's measurement); drift vs h200/gate
#   megatron  production on the whole gate, then the production suite in the time left (.ci/h200-megatron.sh)
#   extras    bench --impl fused,megatron (layer, 4K/16K/32K, kernel + pro), then the real-code mutants on cudnn
# Megatron: DSV4_MEGATRON (a checkout) or DSV4_MEGATRON_SNAPSHOT (default: the pinned archive staged in .device/2).
# Usage: bash .ci/h200-session.sh fused|megatron|extras
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-reports/out}"
mkdir -p "$out"
snapshot=$(ls .device/2/megatron-lm-dev-*.tar.gz 2>/dev/null | head -1)
[ -n "${DSV4_MEGATRON:-}${DSV4_MEGATRON_SNAPSHOT:-}" ] || [ -z "$snapshot" ] || export DSV4_MEGATRON_SNAPSHOT="$PWD/$snapshot"
start=$(date +%s)
left() { local n=$(( $1 - $(date +%s) + start )); echo $(( n > 1 ? n : 1 )); }  # seconds left of an allowance (>= 1)

case "${1:-}" in
  fused)
    timeout -k 10 560 python3 -m cli bench --sections gate --gate-runs cold,warm --gate-dir /tmp/h200-gate \
      --gate-cache-dir "$HOME/.cache/dsv4-parity" --gate-budget-s 510 --json "$out/bench-h200-gate.json" --no-plot --quiet
    echo "h200-session fused: bench exit $?"
    for run in cold warm; do
      [ -f "/tmp/h200-gate/$run/results.jsonl" ] && cp "/tmp/h200-gate/$run/results.jsonl" "$out/gate-$run-results.jsonl"
    done
    [ -f /tmp/h200-gate/warm/results.jsonl ] && timeout -k 5 "$(left 580)" python3 -m cli compare /tmp/h200-gate/warm \
      --baseline h200/gate | tail -16 ;;
  megatron)
    bash .ci/h200-megatron.sh gate 380
    # h200-megatron.sh stops its run at budget + 90 s, then updates the baseline (~30 s): end by 570 s of the 600
    budget=$(( $(left 570) - 90 - 40 ))
    if [ "$budget" -gt 40 ]; then bash .ci/h200-megatron.sh production "$budget"
    else echo "h200-session megatron: no time left for the production suite"; fi ;;
  extras)
    timeout -k 10 200 python3 -m cli bench --sections e2e --impl fused,megatron --profile kernel,pro --tokens 4K,16K,32K \
      --scope layer --provider cudnn --no-reference --budget-s 170 --json "$out/bench-megatron.json" --no-plot
    echo "h200-session extras: bench exit $?"
    timeout -k 10 "$(left 570)" python3 -m cli mutants --impl megatron --provider cudnn --out "$out/mutants"
    echo "h200-session extras: mutants exit $?" ;;
  *)
    echo "usage: bash .ci/h200-session.sh fused|megatron|extras" >&2; exit 2 ;;
esac
echo "h200-session ${1}: $(( $(date +%s) - start )) s"
