"""Production's history (``../shared/megatron/megatron-core-dsv4-history.bundle``, cloned into a temporary
directory): ``dsv4-parity bisect`` names the commit that changed a verdict and leaves the clone's refs and worktrees
as they were; a revision before the THD PR is refused up front (exit 2). Skipped, saying why, without the bundle.

Cost: three fresh processes that import Megatron-LM (two bisect steps, one refusal), ~10 s each on an idle 2-core
CPU. ``SLOW=1`` adds a bisect across the three API generations on a case whose verdict never changes (two more).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.megatron import generations as gens

ROOT = Path(__file__).resolve().parents[2]
BUNDLES = [ROOT.parent / "shared" / "megatron" / "megatron-core-dsv4-history.bundle",
           ROOT / "shared" / "megatron" / "megatron-core-dsv4-history.bundle"]
BUNDLE = next((b for b in BUNDLES if b.is_file()), None)
pytestmark = pytest.mark.skipif(BUNDLE is None or shutil.which("git") is None,
                                reason="no history bundle at ../shared/megatron/megatron-core-dsv4-history.bundle "
                                       "(or no git)")
SLOW = bool(os.environ.get("SLOW"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    path = tmp_path_factory.mktemp("history") / "megatron"
    subprocess.run(["git", "clone", "-q", str(BUNDLE), str(path)], check=True, capture_output=True)
    return path


def _state(repo: Path) -> tuple[str, str]:
    refs = subprocess.run(["git", "-C", str(repo), "for-each-ref"], capture_output=True, text=True).stdout
    trees = subprocess.run(["git", "-C", str(repo), "worktree", "list", "--porcelain"], capture_output=True,
                           text=True).stdout
    return refs, trees


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DSV4_MEGATRON", None)
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def _bisect(clone: Path, good: str, bad: str, case: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bisect.json"
    done = _cli("bisect", "--megatron", str(clone), "--good", good, "--bad", bad, "--case-id", case,
                "--provider", "unfused", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_bisect_names_the_commit_that_fixed_the_unfused_indexer_loss(clone, tmp_path):
    """43e45e1307 (fails on the indexer loss) .. 059c16cd11 (passes): bisect names 059c16cd11 by its upstream id,
    with the tensors that changed verdict. The clone's refs and worktrees are the same before and after."""
    before = _state(clone)
    done, result = _bisect(clone, "43e45e1307", "059c16cd11", "9a8dbea368d1", tmp_path)
    assert result["status"] == "found", done.stdout
    assert result["first_new"]["upstream"].startswith("059c16cd11")
    assert result["last_old"]["upstream"].startswith("43e45e1307")
    assert ["9a8dbea368d1", "indexer_loss", "fail", "pass"] in result["changed_tensors"]
    assert {s["generation"] for s in result["steps"]} == {"csa-kernels"}
    assert "first revision where the verdict changes" in done.stdout and "upstream: 059c16cd11" in done.stdout
    assert all(s["seconds"] > 0 for s in result["steps"]) and "steps in" in done.stdout
    assert _state(clone) == before


def test_a_revision_before_the_thd_pr_is_refused_up_front(clone, tmp_path):
    """056d9c0f24^ has DSv4 but no THD path: exit 2 with the missing symbol and the first THD revision, no case
    run (the bisect test above is the control: later revisions are driven)."""
    tree = tmp_path / "pre-thd"
    subprocess.run(["git", "-C", str(clone), "worktree", "add", "-q", "--detach", str(tree), "origin/dev~84"],
                   check=True, capture_output=True)
    try:
        subject = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%(trailers:key=Upstream-Commit,"
                                  "valueonly)"], capture_output=True, text=True).stdout
        assert subject.startswith("72cef25a49"), subject  # 056d9c0f24^ (the dev chain's first commit)
        done = _cli("run", "--impl", "megatron", "--megatron", str(tree), "--suite", "smoke", "--case-id",
                    "c63c8c6d34a6", "--out", str(tmp_path / "out"), "--quiet")
        assert done.returncode == 2, done.stderr[-2000:]
        assert "CompressedSparseAttention._forward_thd" in done.stderr and gens.OLDEST.first in done.stderr
        assert not (tmp_path / "out" / "results.jsonl").exists()
    finally:
        subprocess.run(["git", "-C", str(clone), "worktree", "remove", "--force", str(tree)], capture_output=True)


@pytest.mark.skipif(not SLOW, reason="SLOW=1: two more Megatron imports (a bisect across the API generations)")
def test_a_case_whose_verdict_never_changes_reports_no_change_in_range(clone, tmp_path):
    done, result = _bisect(clone, "056d9c0f24", "1c44a57092", "c63c8c6d34a6", tmp_path)
    assert result["status"] == "no-change" and "no change in range" in done.stdout
    assert [s["generation"] for s in result["steps"]] == ["dsa-kernels", "csa-utils"]


def _tree_at(clone: Path, upstream: str, where: Path) -> Path:
    """A worktree of the bundle commit whose ``Upstream-Commit:`` trailer starts with ``upstream``."""
    log = subprocess.run(["git", "-C", str(clone), "log", "origin/dev",
                          "--format=%H %(trailers:key=Upstream-Commit,valueonly,separator=)"],
                         capture_output=True, text=True, check=True).stdout
    commit = next(line.split()[0] for line in log.splitlines() if len(line.split()) == 2
                  and line.split()[1].startswith(upstream))
    subprocess.run(["git", "-C", str(clone), "worktree", "add", "-q", "--detach", str(where), commit],
                   check=True, capture_output=True)
    return where


def test_an_architecture_specific_entry_holds_at_the_history_revisions_it_is_verified_at(clone, tmp_path):
    """The registry's revision claims are checked where the history reaches them: the sm90 Path C entry is verified
    at 608545cfc6 (on the H100's real kernels, 2026-12-06), so there, on the emulated provider declaring (9, 0), its
    gate case is ``known`` by that entry. Negative control: at the parent 12d3cc03e3, where the entry is not
    registered, the same case fails the same way and the message names the entry as matching but not registered.
    One bf16 gate case of 138 rows per revision (~30 s each)."""
    from parity.mutation import megatron_mutants as mutants

    registry = json.loads((ROOT / "adapters" / "megatron" / "known_deviations.json").read_text())["entries"]
    entry = next(e for e in registry if e["id"] == "fused-thd-core-padding-grad-unmasked-path-c-sm90")
    assert any(v.startswith("608545cfc6") for v in entry["revisions"]["verified"])
    assert not any(v.startswith("12d3cc03e3") for v in entry["revisions"]["verified"])
    plan = {"suite": "gate", "device": "cpu", "stand_in_capability": [9, 0]}
    case = entry["cases"][0]
    trees = []
    try:
        trees.append(_tree_at(clone, "608545cfc6", tmp_path / "fix"))
        (row,) = mutants.run_child(trees[-1], [("emulated", case, 1)], plan)
        assert row["outcome"] == "known" and f"known deviation {entry['id']}" in row["message"], row
        trees.append(_tree_at(clone, "12d3cc03e3", tmp_path / "parent"))
        (row,) = mutants.run_child(trees[-1], [("emulated", case, 1)], plan)
        assert row["outcome"] == "fail", row
        assert f"{entry['id']} matches this case but is not registered at revision 12d3cc03e3" in row["message"], row
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(clone), "worktree", "remove", "--force", str(tree)], capture_output=True)


def _gate(tree: Path, path: str, cases: tuple, out: Path) -> subprocess.CompletedProcess:
    """``dsv4-parity gate --impl megatron`` on one production path of ``tree``, on ``cases`` of the smoke suite, not
    gated against a baseline (the selection is a slice of the suite: coverage has its own tests)."""
    ids = [token for case in cases for token in ("--case-id", case)]
    return _cli("gate", "--impl", "megatron", "--megatron", str(tree), "--paths", path, "--suite", "smoke", *ids,
                "--baseline", "none", "--out", str(out))


@pytest.mark.parametrize("bug", [
    # (the fix, its parent, the production path it lives on, smoke cases, a tensor the gate must name at the parent)
    ("608545cfc6", "12d3cc03e3", "emulated", ("339801b464f2", "f2ceea9c0311"), "indexer"),
    ("059c16cd11", "43e45e1307", "unfused", ("9a8dbea368d1",), "indexer_loss"),
], ids=["fused-indexer-loss-608545cfc6", "unfused-indexer-loss-059c16cd11"])
def test_the_gate_catches_the_historical_bugs_at_their_parents_and_passes_at_their_fixes(clone, tmp_path, bug):
    """What a gate is worth: each of production's two reachable historical DSv4 bugs, at the parent of its fix, makes
    ``dsv4-parity gate`` (``make parity``'s command) exit 1 naming the failing tensors; at the fix the same command
    on the same cases exits 0 (the control: the cases and the path are ones the gate passes). ~20 s a revision."""
    fix, parent, path, cases, tensor = bug
    trees = []
    try:
        trees.append(_tree_at(clone, parent, tmp_path / "parent"))
        done = _gate(trees[-1], path, cases, tmp_path / "out-parent")
        assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
        assert "gate: FAIL" in done.stdout and "failed" in done.stdout, done.stdout[-3000:]
        named = done.stdout.split(f"{path} FAIL:", 1)[1].split("gate: FAIL", 1)[0]  # the path's failing tensors
        assert tensor in named, done.stdout[-3000:]
        trees.append(_tree_at(clone, fix, tmp_path / "fix"))
        done = _gate(trees[-1], path, cases, tmp_path / "out-fix")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "gate: PASS" in done.stdout, done.stdout[-3000:]
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(clone), "worktree", "remove", "--force", str(tree)], capture_output=True)
