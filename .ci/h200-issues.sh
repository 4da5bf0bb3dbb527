#!/usr/bin/env bash
# The H200 runs of issues 28 and 31, as one device call (after .device/1/step1.sh and .device/2/step2.sh installed
# the GPU packages; under the device tool's 600 s per call). Each stage writes its results under $OUT and a line to
# $OUT/summary.txt, so what was measured goes into the repo as data.
#   knobs    production's switches on the real GPU: apply_rope_fusion (Triton fused MLA RoPE) and indexer-loss
#            coefficient 0 gate cases, on both production paths (unfused, cudnn), each against the reference
#   parent   production's fused path on the real kernels at 12d3cc03e3 (the parent of 608545cfc6, the fused CSA
#            indexer-loss fix) over the smallest THD r=4 sparse mean-loss training cases of the gate: it must fail,
#            naming the fused-path tensors (issue 28)
#   head     both production paths at head (the pinned snapshot) over the whole gate, within the time left: the
#            unfused path's pace on the GPU and the fused path against its baseline h200/megatron-cudnn-gate
#   baseline the fused path at head on the whole gate, stored as h200/megatron-cudnn-gate, then the unfused path
#            with 3 workers in the time left (a second call: bash .ci/h200-issues.sh baseline)
# Megatron: .mg/megatron-lm-dev-*.tar.gz (head) and .mg/m12d3cc03e3 (git archive of megatron/core + LICENSE at the
# bundle commit whose Upstream-Commit is 12d3cc03e3, with its .dsv4-parity-revision.json), carried as `.mg`.
# Usage: bash .ci/h200-issues.sh [STAGE ...]   (default: knobs parent head)
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-reports/out}"
mkdir -p "$out"
start=$(date +%s)
left() { local n=$(( $1 - $(date +%s) + start )); echo $(( n > 1 ? n : 1 )); }  # seconds left of an allowance
note() { echo "$*" | tee -a "$out/summary.txt"; }
snapshot=$(ls "$PWD"/.mg/megatron-lm-dev-*.tar.gz 2>/dev/null | head -1)
[ -n "$snapshot" ] && export DSV4_MEGATRON_SNAPSHOT="$snapshot"
ROPE="3719fafc36e2 77d8de990308 d325ce713ab9 724e85399069 7633aeba797a"
ZERO="76a3074fcfbd 83c32b6058fa"
PARENT="fa979696d70b ffa705463e86 ff44cb580cf3 b787200ca7d4 dbc757ae945f 72264cfca9f2 d6b4ceea1c51 23e49e20e21b
        7804f8058ac3 482c769e7e15 d3e8d472cac9 4db2f2e2701a"
ids() { for id in $*; do printf -- '--case-id %s ' "$id"; done; }
summarise() {  # results.jsonl -> one line of outcomes, then each non-pass case
  python3 - "$1" "$2" <<'PY' | tee -a "$out/summary.txt"
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
cases = [r for r in rows if r.get("type") == "case"]
phases = collections.Counter()
for r in cases:
    phases.update(r.get("phases_s") or {})
print(f"{sys.argv[2]}: {dict(collections.Counter(r['outcome'] for r in cases))}; phases (s, summed): "
      f"{ {k: round(v) for k, v in phases.most_common()} }")
for r in cases:
    if r["outcome"] not in ("pass",):
        print(f"  {r['outcome']:<11} {r['case_id']}  {r['message'][:400]}")
PY
}
keep_paths() {  # gate directory, name: each path's results under $OUT/<name>/<path>.jsonl, summarised
  for p in unfused cudnn; do
    [ -f "$1/$p/results.jsonl" ] && mkdir -p "$out/$2" && cp "$1/$p/results.jsonl" "$out/$2/$p.jsonl" && \
      summarise "$1/$p/results.jsonl" "$2 $p"
  done
}
for stage in "${@:-knobs parent head}"; do
  for s in $stage; do
    t0=$(date +%s)
    case "$s" in
      knobs)
        timeout -k 10 "$(left 200)" python3 -m cli gate --impl megatron --paths unfused,cudnn --suite gate \
          $(ids $ROPE $ZERO) --baseline none --workers auto --out /tmp/knobs --quiet > /tmp/knobs.log 2>&1
        note "knobs: gate exit $? in $(( $(date +%s) - t0 )) s"; tail -4 /tmp/knobs.log >> "$out/summary.txt"
        keep_paths /tmp/knobs knobs ;;
      parent)
        timeout -k 10 "$(left 380)" python3 -m cli run --impl megatron --provider cudnn --megatron "$PWD/.mg/m12d3cc03e3" \
          --suite gate $(ids $PARENT) --workers auto --out /tmp/parent --force --quiet > /tmp/parent.log 2>&1
        note "parent (12d3cc03e3, cudnn): run exit $? in $(( $(date +%s) - t0 )) s"; tail -4 /tmp/parent.log >> "$out/summary.txt"
        [ -f /tmp/parent/results.jsonl ] && cp /tmp/parent/results.jsonl "$out/parent.jsonl" && \
          summarise /tmp/parent/results.jsonl "parent cudnn" ;;
      head)
        budget=$(( $(left 560) - 60 ))
        [ "$budget" -gt 30 ] || { note "head: no time left"; continue; }
        timeout -k 10 "$(left 575)" python3 -m cli gate --impl megatron --suite gate --workers auto --budget-s \
          $(( budget / 2 )) --out /tmp/head --quiet > /tmp/head.log 2>&1
        note "head: gate exit $? in $(( $(date +%s) - t0 )) s (budget $(( budget / 2 )) s per path)"; tail -12 /tmp/head.log >> "$out/summary.txt"
        keep_paths /tmp/head head ;;
      baseline)
        # the fused path at head on the whole gate, retaken as h200/megatron-cudnn-gate (.ci/h200-megatron.sh), then
        # the unfused path with fewer workers (6 shared one GPU and ran out of memory) in the time left
        bash .ci/h200-megatron.sh gate "$(( $(left 370) - 90 ))" > /tmp/baseline.log 2>&1
        note "baseline (head, cudnn): exit $? in $(( $(date +%s) - t0 )) s"; tail -12 /tmp/baseline.log >> "$out/summary.txt"
        t1=$(date +%s)
        timeout -k 10 "$(left 580)" python3 -m cli run --suite gate --impl megatron --provider unfused --workers 3 \
          --budget-s "$(( $(left 580) - 60 ))" --out /tmp/unfused --force --quiet > /tmp/unfused.log 2>&1
        note "unfused (head, 3 workers): exit $? in $(( $(date +%s) - t1 )) s"
        [ -f /tmp/unfused/results.jsonl ] && cp /tmp/unfused/results.jsonl "$out/unfused.jsonl" && \
          summarise /tmp/unfused/results.jsonl "unfused 3 workers" ;;
      *) echo "usage: bash .ci/h200-issues.sh [knobs|parent|head|baseline ...]" >&2; exit 2 ;;
    esac
  done
done
note "h200-issues: $(( $(date +%s) - start )) s"
