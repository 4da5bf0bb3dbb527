#!/usr/bin/env bash
# Issue 33: this tree's PR gate against an earlier tree's, on one machine, over one compiled-kernel cache, runs
# alternating, so the ratio between them holds whatever card the device tool lent (a card's absolute seconds say
# nothing about another card's). Run after .device/1/step1.sh and .device/2/step2.sh installed the GPU packages.
#   OLD: a `git archive` of the earlier commit (tests left out), carried in .mg, e.g.
#        git archive --format=tar.gz -o .mg/ab-3703385.tar.gz 3703385 -- . ':!tests'
#   ORDER (default "new:cold new:warm old:warm new:warm old:warm"): tree:run steps; cold empties the cache first (the
#        fused kernels compile the same way in both trees, so the cache one tree fills serves the other); the tree
#        new0 is this tree with the workers started only once the run is planned (DSV4_PARITY_PRESTART=0: the
#        lever of parity.run.prestart alone, e.g. ORDER="new:warm new0:warm new:warm new0:warm")
#   IMPL (default fused): the bench's --gate-impl (megatron: production's gate; carry its snapshot in .mg)
#   AB_START (default 0): steps are numbered from AB_START + 1 (a later call on the same warm machine continuing the
#        order: ORDER="new:cold old:warm" first, then AB_START=2 ORDER="new:warm", so no step's directory is reused)
#   SUITE, LIMIT, PROVIDER (default gate, all, the bench's): --gate-suite / --gate-limit / --gate-provider (a CPU try-out:
#        SUITE=smoke LIMIT=2 PROVIDER=auto)
# Each step is `bench --sections gate --gate-runs RUN` in that tree: a line in $OUT/summary.txt (wall, outcomes,
# summed phases), its JSON in $OUT/ab-json.tar.gz, and the last run of each tree's results in $OUT/ab-<tree>.jsonl.gz
# (for `dsv4-parity compare-runs --verdicts`: the two trees must decide every case alike).
# Usage: bash .ci/gate-speed-ab.sh .mg/ab-<rev>.tar.gz
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-reports/out}"
mkdir -p "$out"
old_tar="${1:?usage: bash .ci/gate-speed-ab.sh OLD.tar.gz}"
order="${ORDER:-new:cold new:warm old:warm new:warm old:warm}"
impl="${IMPL:-fused}"
snapshot=$(ls "$PWD"/.mg/megatron-lm-dev-*.tar.gz 2>/dev/null | head -1)
[ -n "$snapshot" ] && export DSV4_MEGATRON_SNAPSHOT="$snapshot"
note() { echo "$*" | tee -a "$out/summary.txt"; }
old=/tmp/ab-old new="$PWD" cache=/tmp/dsv4-kernel-cache json=/tmp/ab-json
[ -d "$old" ] || { mkdir -p "$old" && tar xzf "$old_tar" -C "$old"; }
# both trees admit cases to the GPU by the same measured peaks: the newer tree's memory.csv files (e.g. h100/gate,
# recorded 2026-12-07) go into the older tree where it has none, or only the older tree would run cases out of memory
# and re-run them alone (admission only: no value changes). An older tree reads peak_gpu_bytes alone, so its copy
# carries there the bytes this tree admits by (reports.baselines.measured_peaks: the reserved peak where kept).
for peaks in reports/baselines/*/*/memory.csv; do
  [ -f "$peaks" ] && [ -d "$old/reports/baselines" ] && [ ! -f "$old/$peaks" ] && mkdir -p "$old/$(dirname "$peaks")" \
    && python3 -c 'import sys
from reports.baselines import measured_peaks
arch, name = sys.argv[1].split("/")[-3:-1]
with open(sys.argv[2], "w") as out:
    out.write("case_id,peak_gpu_bytes\n" + "".join(f"{c},{b}\n" for c, b in sorted(measured_peaks(arch, name).items())))
' "$peaks" "$old/$peaks"
done
mkdir -p "$json"
i="${AB_START:-0}"
for step in $order; do
  i=$((i + 1)) which="${step%%:*}" run="${step#*:}"
  [ "$which" = old ] && tree="$old" || tree="$new"
  t0=$(date +%s)
  prestart=1
  [ "$which" = new0 ] && prestart=0
  (cd "$tree" && DSV4_PARITY_PRESTART=$prestart python3 -m cli bench --sections gate --gate-impl "$impl" --gate-runs "$run" --gate-cache-dir "$cache" \
    --gate-suite "${SUITE:-gate}" ${LIMIT:+--gate-limit "$LIMIT"} ${PROVIDER:+--gate-provider "$PROVIDER"} --gate-dir "/tmp/ab-$i" --json "$json/$i-$which-$run.json" --no-plot > "$json/$i-$which-$run.log" 2>&1)
  code=$?
  [ -f "/tmp/ab-$i/$run/results.jsonl" ] && gzip -c "/tmp/ab-$i/$run/results.jsonl" > "$out/ab-$which.jsonl.gz"
  python3 - "$json/$i-$which-$run.json" "$i $which $run (exit $code, $(( $(date +%s) - t0 )) s)" <<'PY' | tee -a "$out/summary.txt"
import json, sys
try:
    runs = json.load(open(sys.argv[1])).get("gate", {}).get("runs", [])
except (OSError, ValueError) as exc:
    runs = []
    print(f"{sys.argv[2]}: no JSON ({exc})")
for r in runs:
    busy = r.get('occupancy') or {}
    print(f"{sys.argv[2]}: wall {r.get('wall_s')} s (before the run {r.get('prelude_s')}, the run {r.get('run_s')}, "
          f"after it {r.get('after_s')}), {r.get('outcomes')}, phases {r.get('phases_s')}, busy {busy.get('share')}, "
          f"workers started early {busy.get('prestarted')} of {busy.get('processes_started')}")
PY
done
tar czf "$out/ab-json.tar.gz" -C "$json" .
note "gate-speed-ab ($impl, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo no GPU), old $(basename "$old_tar")): done"
