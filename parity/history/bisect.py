"""``dsv4-parity bisect``: the first first-parent revision of a Megatron-LM clone where a case's verdict changes.

``git bisect run`` semantics over the first-parent chain ``good..bad``: ``good`` is the old side, ``bad`` the new;
a revision whose verdict equals ``good``'s is *old*, any other verdict is *new*; a revision the adapter cannot
drive (the step refused as a usage error, exit 2: an API generation it does not know; or a case ended in an adapter
``error``) is *skipped* — never blamed: when only skipped revisions separate the last old one from the first new
one, all of them are named. Equal verdicts at both ends: "no change in range" (a change that reverted inside the
range is not looked for, as with ``git bisect``).

**The verdict** of a revision is, per selected case, its outcome against the contract *before* the
known-deviation registry: ``known`` reads as what it was (``fail``; an ``error`` registered as known is skipped
like any error), so a registry entry whose revision range does not cover old revisions cannot make their verdict
differ (``--by outcome``, the default: ``pass`` / ``fail`` / ``unsupported``). ``--by tensors`` adds the set of
failing tensors (a fail that moves to other tensors is a change). The tensors that changed verdict between the two
sides are printed either way.

Each step runs ``python -m cli run --impl megatron --megatron <worktree>`` in a fresh process (Python imports one
Megatron-LM per process) in one throwaway worktree of the clone (:class:`parity.history.git_tree.ThrowawayWorktree`); the
clone's working tree and refs are never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from parity.history import git_tree
from parity.run.stream import read_rows

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MODES = ("outcome", "tensors")


@dataclass
class CaseVerdict:
    """One case at one revision: ``outcome`` (before the registry), its failing tensors (in the run's tensor order),
    per-tensor verdicts, the message and repro of the case row."""

    case_id: str
    outcome: str
    failing: tuple[str, ...] = ()
    tensors: dict = field(default_factory=dict)
    message: str = ""
    repro: str = ""
    registry: Optional[str] = None  # the known-deviation id the registry gave it, if any
    raised: bool = False  # a ``fail`` because production raised in its own code (a crash, not a numeric failure)

    def key(self, mode: str) -> tuple:
        """The verdict compared between revisions. A crash in production's own code is its own verdict, never the
        same as a numeric failure (found by review: a crash between two numeric states moved the blame to the
        commit that fixed the crash)."""
        outcome = "fail (raised)" if self.raised else self.outcome
        return (outcome, tuple(sorted(self.failing))) if mode == "tensors" else (outcome,)

    def describe(self) -> str:
        shown = ", ".join(self.failing[:4]) + (f" (+{len(self.failing) - 4})" if len(self.failing) > 4 else "")
        return self.outcome + (" (raised in production's code)" if self.raised else "") + (f" ({shown})" if shown
                                                                                            else "")


@dataclass
class Step:
    """One tested revision: ``status`` ``ok`` (verdicts read) or ``skip`` (``why``), its verdicts and wall time."""

    commit: git_tree.Commit
    status: str
    verdicts: dict = field(default_factory=dict)  # case id -> CaseVerdict
    why: str = ""
    seconds: float = 0.0
    side: str = ""  # old / new / skip (set by the search)
    generation: str = ""  # the adapter's API generation of the revision (the step's run row)

    def key(self, mode: str) -> tuple:
        return tuple(sorted((cid, v.key(mode)) for cid, v in self.verdicts.items()))


@dataclass
class Result:
    """``status``: ``found`` (``first_new`` and ``last_old``), ``no-change`` or ``skipped-only`` (``candidates``:
    the skipped revisions and the first new one, any of which may be the first)."""

    status: str
    steps: list
    first_new: Optional[Step] = None
    last_old: Optional[Step] = None
    candidates: list = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""  # a sign that the verdict changes more than once in the range (bisect assumes one change)

    def changed_tensors(self) -> list[tuple[str, str, str, str]]:
        """``(case id, tensor, verdict before, verdict after)`` for every tensor whose verdict differs."""
        if self.first_new is None or self.last_old is None:
            return []
        out = []
        for cid, before in self.last_old.verdicts.items():
            after = self.first_new.verdicts.get(cid)
            if after is None:
                continue
            for name in dict.fromkeys([*before.tensors, *after.tensors]):
                a, b = before.tensors.get(name, "-"), after.tensors.get(name, "-")
                if a != b:
                    out.append((cid, name, a, b))
            if not before.tensors and not after.tensors and before.outcome != after.outcome:
                out.append((cid, "(case)", before.outcome, after.outcome))
        return out


# ---- one step -------------------------------------------------------------------------------------------------------
def verdicts_of(rows: list[dict]) -> dict:
    """``{case id: CaseVerdict}`` from a step's ``results.jsonl`` rows (outcomes before the registry)."""
    out: dict[str, CaseVerdict] = {}
    for row in rows:
        if row.get("type") == "case":
            known = row.get("known") or {}
            outcome = row.get("outcome")
            if outcome == "known":
                outcome = known.get("was", "fail")
            out[row["case_id"]] = CaseVerdict(row["case_id"], str(outcome), message=str(row.get("message", "")),
                                              repro=str(row.get("repro", "")),
                                              registry=known.get("id") if known.get("status") == "reproduced" else None,
                                              raised=str(outcome) == "fail" and row.get("decided_by") == "raised")
        elif row.get("type") == "tensor" and row.get("case_id") in out:
            out[row["case_id"]].tensors[str(row.get("tensor"))] = str(row.get("verdict"))
    for verdict in out.values():
        verdict.failing = tuple(n for n, v in verdict.tensors.items() if v == "fail")  # in the run's tensor order
    return out


def run_step(commit: git_tree.Commit, tree: Path, case_ids: Sequence[str], suite: str, provider: str, out: Path,
             python: str = sys.executable, timeout: float = 1800.0) -> Step:
    """Run the cases on the Megatron-LM at ``tree`` (checked out at ``commit``) in a fresh process: a :class:`Step`
    with status ``ok`` or ``skip`` (a usage error of the step — the adapter refused the revision — or an adapter
    error), timed."""
    start = time.perf_counter()
    status, verdicts, why, generation = _run(tree, case_ids, suite, provider, out, python, timeout)
    return Step(commit, status, verdicts, why, time.perf_counter() - start, generation=generation)


def _run(tree: Path, case_ids: Sequence[str], suite: str, provider: str, out: Path, python: str,
         timeout: float) -> tuple[str, dict, str, str]:
    cmd = [python, "-m", "cli", "run", "--impl", "megatron", "--megatron", str(tree), "--provider", provider,
           "--suite", suite, *[a for cid in case_ids for a in ("--case-id", cid)], "--out", str(out), "--force",
           "--quiet", "--threads", "1", "--workers", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("DSV4_MEGATRON", None)
    try:
        done = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "skip", {}, f"the step ran past {timeout:.0f} s", ""
    if done.returncode == 2:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        return "skip", {}, (lines[-1] if lines else "usage error").removeprefix("error: "), ""
    stream = out / "results.jsonl"
    if done.returncode not in (0, 1) or not stream.is_file():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return "skip", {}, f"the step exited {done.returncode}: {tail}", ""
    rows = read_rows(stream)
    run_row = next((r for r in rows if r.get("type") == "run"), {})
    generation = str((run_row.get("impl_info") or {}).get("api_generation", ""))
    verdicts = verdicts_of(rows)
    missing = [cid for cid in case_ids if cid not in verdicts]
    if missing:
        return "skip", verdicts, f"no result for {', '.join(missing)}", generation
    errors = [v for v in verdicts.values() if v.outcome == "error"]
    if errors:
        return "skip", verdicts, f"adapter error on {errors[0].case_id}: {errors[0].message}", generation
    return "ok", verdicts, "", generation


# ---- the search -----------------------------------------------------------------------------------------------------
def search(chain: Sequence[git_tree.Commit], good: Step, judge: Callable[[git_tree.Commit], Step],
           mode: str = "outcome", progress: Callable[[Step], None] = lambda step: None) -> Result:
    """Bisect ``chain`` (the commits after ``good``, oldest first; the last is ``bad``) with ``judge``; ``good``'s
    step is already judged (it must be ``ok``)."""
    start = time.perf_counter()
    steps = [good]
    good.side = "old"
    reference = good.key(mode)

    def judged(i: int) -> Step:
        step = judge(chain[i])
        step.side = "skip" if step.status != "ok" else ("old" if step.key(mode) == reference else "new")
        steps.append(step)
        progress(step)
        return step

    bad = judged(len(chain) - 1)
    if bad.side == "skip":
        raise ValueError(f"bad revision {bad.commit.label()} cannot be judged: {bad.why}")
    if bad.side == "old":
        return Result("no-change", steps, seconds=time.perf_counter() - start)
    lo, hi = -1, len(chain) - 1  # chain[lo] (or good) is old, chain[hi] is new
    sides = {hi: bad}
    while hi - lo > 1:
        untested = [i for i in range(lo + 1, hi) if i not in sides]
        if not untested:
            break
        mid = (lo + hi) // 2
        i = min(untested, key=lambda j: (abs(j - mid), j))
        step = sides[i] = judged(i)
        if step.side == "old":
            lo = i
        elif step.side == "new":
            hi = i
    last_old = good if lo < 0 else sides[lo]
    between = [sides[i] for i in range(lo + 1, hi)]
    seconds = time.perf_counter() - start
    note = ""
    if sides[hi].key(mode) != bad.key(mode):  # old -> X here, X -> bad's verdict later: two changes at least
        note = (f"the verdict changes more than once: {sides[hi].commit.label()} differs from {bad.commit.label()} "
                f"too; bisect assumes one change and reports the one it met")
    if between:  # every revision between the last old and the first new one was skipped
        return Result("skipped-only", steps, sides[hi], last_old, [*between, sides[hi]], seconds, note)
    return Result("found", steps, sides[hi], last_old, seconds=seconds, note=note)


def to_json(result: Result, mode: str) -> dict:
    """The result as plain data (``--json``)."""

    def step(s: Step) -> dict:
        return {"commit": s.commit.sha, "upstream": s.commit.upstream, "subject": s.commit.subject, "side": s.side,
                "status": s.status, "why": s.why, "seconds": round(s.seconds, 3), "generation": s.generation,
                "verdicts": {cid: {"outcome": v.outcome, "failing": list(v.failing), "registry": v.registry}
                             for cid, v in s.verdicts.items()}}

    found = result.status == "found"  # otherwise nothing is blamed: the range's ends are not adjacent
    return {"status": result.status, "by": mode, "seconds": round(result.seconds, 3), "note": result.note,
            "first_new": step(result.first_new) if found and result.first_new else None,
            "last_old": step(result.last_old) if found and result.last_old else None,
            "range": ({"after": step(result.last_old), "upto": step(result.first_new)}
                      if not found and result.first_new and result.last_old else None),
            "candidates": [step(s) for s in result.candidates],
            "changed_tensors": [list(t) for t in result.changed_tensors()] if found else [],
            "steps": [step(s) for s in result.steps]}


def dump(result: Result, mode: str, path: Path, context: Optional[dict] = None) -> None:
    """Write ``--json`` (``context``: what was asked — revisions, cases, provider — written beside the result)."""
    write_json(path, {**(context or {}), **to_json(result, mode)})


def write_json(path: Path, data: dict) -> None:
    """``data`` to ``path`` in one step (temporary file + rename): a reader never sees half a file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, target)
