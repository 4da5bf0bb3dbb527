#!/usr/bin/env bash
# Issue 28 on the H200: the Megatron PR gate exactly as a GPU runner runs it,
#   make parity PYTHON=python3 RUN_ARGS='--impl megatron --megatron TREE'
# (production's unfused path AND its fused path on the real kernels, each against its own baseline), at three
# revisions. Run after .device/1/step1.sh and .device/2/step2.sh installed the GPU packages; carry `.mg`:
#   .mg/megatron-lm-dev-d48bd6be0a.tar.gz   head (the pinned snapshot)
#   .mg/m608545cfc6.tar.gz, .mg/m12d3cc03e3.tar.gz   `git archive` of megatron/core + LICENSE at the history bundle's
#       commit whose Upstream-Commit is that revision, with its .dsv4-parity-revision.json
#   (all three made by `bash .ci/stage-megatron-revisions.sh`)
# Stages (in order; each one gate directory /tmp/pr-<stage>, resumed when a call ran out of time):
#   head    each path gated against its baseline (a card without its own: the other sm90 card's, below; neither:
#           ungated) and, complete, recorded as <arch>/megatron-<path>-gate where this card had none
#   608     608545cfc6 (the fused CSA indexer-loss fix): both paths against both baselines; must pass
#   12d     12d3cc03e3 (its parent): must fail, naming the fused-path tensors
#   probe   not a gate: .ci/probes/gather_backward.py on e0e0647850c7 at head (whether the gather-backward-atomic
#           stand-in hooks production's KV gather there, and the deterministic flag its scatter runs under)
# The unfused path fits an 80 GB card on every gate case since 2026-12-07 (peaks up to 47 GiB; 9 cases had run out
# of it on 2026-12-06): its H100 baseline (h100/megatron-unfused-gate) holds all 227 cases, and gates an H200 that
# has none of its own. The unfused path needs none of the GPU packages (no step 1 / step 2).
# DEADLINE=S (seconds this call may spend, default 560) stops the gate in time; the next call resumes it
# (`dsv4-parity gate --out DIR --resume`, the README's way to continue a killed `make parity`).
# What comes back: $OUT/summary.txt (every gate's closing summary) and $OUT/pr-gate-<stage>-<paths>-<arch>.tar.gz
# (the gate directory: each path's results.jsonl, gate.json, the log and, for head, the recorded baselines). Put one in
# `.mg/` and a later call on a fresh machine of the same card continues that gate instead of starting it again (the
# machine goes back ~30 s after a call; a resumed run never mixes cards: the archive's name carries the card).
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-reports/out}"
mkdir -p "$out"
start=$(date +%s)
deadline="${DEADLINE:-560}"
paths="${PATHS:-auto}"  # PATHS=cudnn: the fused path alone (the gate's --paths)
left() { local n=$(( deadline - $(date +%s) + start )); echo $(( n > 1 ? n : 1 )); }
note() { echo "$*" | tee -a "$out/summary.txt"; }
# the GPU's baseline directory (h200, or h100 where the device tool lent an H100: its baselines are its own)
arch=$(python3 -c 'import torch; from reports.baselines import arch_of; print(arch_of({"gpu": torch.cuda.get_device_name()}))')
saved=/tmp/pr-baselines  # baselines recorded on this machine, restored if the next call's tree lacks them
restore() { mkdir -p "reports/baselines/$arch"; [ -d "$saved" ] && for b in "$saved"/*; do
  [ -d "reports/baselines/$arch/$(basename "$b")" ] || cp -r "$b" "reports/baselines/$arch/"; done; }
have() { [ -f "reports/baselines/$arch/megatron-$1-gate/metrics.csv" ]; }
# an H100 lent for the H200 runs the same sm90 kernels: its fused path is gated against the H200's baseline
cudnn_base() { if have cudnn; then echo auto; elif [ -f reports/baselines/h200/megatron-cudnn-gate/metrics.csv ]; then
  echo h200/megatron-cudnn-gate; else echo none; fi; }
# the unfused path's, likewise: an H200 (no baseline of its own yet) is gated against the H100's (all 227 cases)
unfused_base() { if have unfused; then echo auto; elif [ -f reports/baselines/h100/megatron-unfused-gate/metrics.csv ]; then
  echo h100/megatron-unfused-gate; else echo none; fi; }
tree() {  # stage, revision -> the Megatron tree's directory (extracted once)
  local a d
  # the pinned snapshot keeps its snapshot-id layout <id>/<id> (how the adapter names its revision)
  if [ "$1" = head ]; then a=.mg/megatron-lm-dev-d48bd6be0a.tar.gz; d=/tmp/mg/megatron-lm-dev-d48bd6be0a
  else a=".mg/m$2.tar.gz"; d="/tmp/mg/$1"; fi
  [ -d "$d" ] || { mkdir -p "$d" && tar xzf "$a" -C "$d"; }
  echo "$d/$(ls "$d" | head -1)"
}
rundir() {  # gate dir, path -> that path's run directory (a gate of one path is its run directory)
  if [ -d "$1/$2" ]; then echo "$1/$2"; elif [ "$paths" = "$2" ]; then echo "$1"; else echo "$1/$2"; fi; }
pack() {  # stage, gate dir -> $OUT/pr-gate-<stage>-<paths>-<arch>.tar.gz: what the gate wrote (each path's
  # results.jsonl, gate.json, the log; beside it, for head, the baselines recorded here), the report renderings left
  # out. Carried back in `.mg`, it lets a later call on a fresh machine of the same card continue the gate (`unpack`).
  local name="pr-gate-$1-$paths-$arch.tar.gz" extra=""
  cp "$2.log" "$2/gate.log" 2>/dev/null
  [ "$1" = head ] && [ -d "$saved" ] && extra="$(basename "$saved")"
  tar czf "$out/$name" --exclude=index.html --exclude=results.csv --exclude=.lock -C "$(dirname "$2")" \
    "$(basename "$2")" $extra
}
unpack() {  # stage, gate dir: a gate an earlier call packed on this card (.mg/pr-gate-...), when this machine has none
  local packed=".mg/pr-gate-$1-$paths-$arch.tar.gz"
  [ -e "$2" ] || [ ! -f "$packed" ] && return
  tar xzf "$packed" -C "$(dirname "$2")" && note "$1: continuing the gate packed by an earlier call ($packed)"
  restore  # the baselines it recorded (pr-baselines beside the gate directory)
}
restore
[ $# -gt 0 ] || set -- head 608 12d
for stage in "$@"; do
  if [ "$stage" = probe ]; then
    [ "$(left)" -gt 60 ] || { note "probe: not started ($(left) s left in this call)"; break; }
    DSV4_MEGATRON="$(tree head head)" timeout -k 10 "$(left)" python3 .ci/probes/gather_backward.py e0e0647850c7 \
      > "$out/probe-gather-backward.txt" 2>&1
    note "probe (e0e0647850c7, head, unfused): exit $?; $(grep -c '^  GatherBackward0:' "$out/probe-gather-backward.txt") KV gathers listed, $(grep -m1 'install:' "$out/probe-gather-backward.txt")"
    continue
  fi
  dir="/tmp/pr-$stage-$paths"
  unpack "$stage" "$dir"
  [ -f "$dir/.done" ] && { note "$stage: done earlier ($(cat "$dir/.done"))"; continue; }
  case "$stage" in
    head) rev=head  # a path whose baseline this arch lacks runs ungated and, complete, is recorded
      if [ "$paths" = auto ]; then
        baseline="unfused=$(unfused_base),cudnn=$(cudnn_base)"
      elif [ "$paths" = cudnn ]; then baseline=$(cudnn_base)
      elif [ "$paths" = unfused ]; then baseline=$(unfused_base)
      else baseline=$(have "$paths" && echo auto || echo none); fi ;;
    608|12d) [ "$stage" = 608 ] && rev=608545cfc6 || rev=12d3cc03e3
      case "$paths" in auto) baseline="unfused=$(unfused_base),cudnn=$(cudnn_base)" ;; cudnn) baseline=$(cudnn_base) ;;
        unfused) baseline=$(unfused_base) ;; *) baseline=auto ;; esac ;;
    *) echo "usage: bash .ci/h200-pr-gate.sh [head|608|12d|probe ...]" >&2; exit 2 ;;
  esac
  megatron=$(tree "$stage" "$rev")
  [ "$(left)" -gt 60 ] || { note "$stage: not started ($(left) s left in this call)"; break; }
  t0=$(date +%s)
  export DSV4_MEGATRON="$megatron"  # a resumed run finds its tree here (the run row does not record --megatron)
  if [ -f "$dir/gate.json" ] || [ -f "$dir/results.jsonl" ]; then  # a gate this machine started earlier and a call's deadline cut: continue it
    timeout -k 15 "$(left)" python3 -m cli gate --impl megatron --out "$dir" --resume >> "$dir.log" 2>&1
  else
    timeout -k 15 "$(left)" make parity PYTHON=python3 OUT="$dir" BASELINE="$baseline" \
      RUN_ARGS="--impl megatron --paths $paths --megatron $megatron" > "$dir.log" 2>&1
  fi
  code=$?
  if [ "$code" -ge 124 ]; then
    note "$stage ($rev): stopped by this call's deadline after $(( $(date +%s) - t0 )) s; the next call resumes it"
    pack "$stage" "$dir"; break
  fi
  echo "exit $code in a last call of $(( $(date +%s) - t0 )) s" > "$dir/.done"
  note "$stage ($rev): make parity exit $code (last call $(( $(date +%s) - t0 )) s)"
  sed -n '/^gate: path\|^[a-z]*: provider\|FAIL\|PASS\|coverage\|unsupported:/p' "$dir.log" | tail -30 >> "$out/summary.txt"
  if [ "$stage" = head ]; then
    for p in unfused cudnn; do
      have "$p" || [ ! -f "$(rundir "$dir" $p)/results.jsonl" ] || { python3 -m cli compare "$(rundir "$dir" $p)" --update >> "$out/summary.txt" 2>&1 \
        && mkdir -p "$saved" && cp -r "reports/baselines/$arch/megatron-$p-gate" "$saved/"; }
    done
  fi
  pack "$stage" "$dir"
done
note "h200-pr-gate ($arch, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)): $(( $(date +%s) - start )) s this call"
