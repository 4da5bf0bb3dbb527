#!/usr/bin/env bash
# Stage production's Megatron trees for a device call (`.mg`, git-ignored: pass it in the device tool's carry):
#   .mg/megatron-lm-dev-d48bd6be0a.tar.gz   the pinned snapshot (head), copied from ../shared/megatron/
#   .mg/m<upstream>.tar.gz                  for each upstream revision given (default 608545cfc6 12d3cc03e3): `git archive`
#       of megatron/core + LICENSE at the history bundle's commit whose Upstream-Commit trailer is that revision, under
#       one top-level directory m<upstream>/, with the .dsv4-parity-revision.json the adapter reads (the bundle commit
#       and its upstream commit), ~2 MB each.
# Usage: bash .ci/stage-megatron-revisions.sh [UPSTREAM ...]   (the bundle: $BUNDLE, default
#        ../shared/megatron/megatron-core-dsv4-history.bundle; its clone is kept in $HIST, default /tmp/dsv4-history)
set -euo pipefail
bundle="${BUNDLE:-../shared/megatron/megatron-core-dsv4-history.bundle}"
hist="${HIST:-/tmp/dsv4-history}"
mkdir -p .mg
snapshot=$(ls ../shared/megatron/megatron-lm-dev-*.tar.gz 2>/dev/null | head -1 || true)
[ -n "$snapshot" ] && [ ! -f ".mg/$(basename "$snapshot")" ] && cp "$snapshot" .mg/
if [ -d "$hist" ]; then  # an earlier clone: brought up to the bundle's branches
  git -C "$hist" fetch -q "$(cd "$(dirname "$bundle")" && pwd)/$(basename "$bundle")" '+refs/heads/*:refs/remotes/origin/*'
else
  git clone -q "$bundle" "$hist"
fi
work=""
trap '[ -z "$work" ] || rm -rf "$work"' EXIT
for upstream in "${@:-608545cfc6 12d3cc03e3}"; do
  for want in $upstream; do
    commit=$(git -C "$hist" log --all --format='%H %(trailers:key=Upstream-Commit,valueonly,separator=)' |
      awk -v u="$want" 'index($2, u) == 1 && !found {print $1; found = 1}')
    [ -n "$commit" ] || { echo "no commit of $bundle has Upstream-Commit $want" >&2; exit 1; }
    full=$(git -C "$hist" log -1 --format='%(trailers:key=Upstream-Commit,valueonly,separator=)' "$commit")
    work=$(mktemp -d)
    git -C "$hist" archive --prefix="m$want/" "$commit" megatron/core LICENSE | tar x -C "$work"
    printf '{"revision": "%s", "upstream": "%s"}\n' "$commit" "$full" > "$work/m$want/.dsv4-parity-revision.json"
    tar czf ".mg/m$want.tar.gz" -C "$work" "m$want"
    rm -rf "$work"; work=""
    echo "staged .mg/m$want.tar.gz: bundle commit ${commit:0:10}, upstream $full ($(du -k ".mg/m$want.tar.gz" | cut -f1) KiB)"
  done
done
