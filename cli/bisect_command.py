"""``dsv4-parity bisect``: the first first-parent revision of a Megatron-LM clone where a case's verdict changes
(:mod:`parity.history.bisect`). Exit 0: found, or no change in range; 1: only revisions the adapter cannot drive separate
the last old from the first new one (all named); 2: a usage error (not a clone, an unknown revision, an endpoint the
adapter cannot drive)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cases.errors import CaseError
from parity.history import bisect, git_tree

from cli.options import select_cases

PROVIDERS = ("unfused", "emulated", "cudnn")


def _say(text: str = "") -> None:
    print(text, flush=True)


def _step_line(n: int, step: bisect.Step) -> str:
    shown = "; ".join(f"{cid[:12]} {v.describe()}" for cid, v in sorted(step.verdicts.items()))
    what = shown if step.status == "ok" else f"skipped: {step.why}"
    return (f"  step {n:>2}  {step.commit.label():<34} {step.generation or '-':<11} {step.side:<4} "
            f"{step.seconds:6.1f} s  {what}")


def _repro(repo: Path, step: bisect.Step, verdict: bisect.CaseVerdict) -> str:
    tree = f"/tmp/megatron-{step.commit.short}"
    run = verdict.repro or f"dsv4-parity run --case-id {verdict.case_id} --impl megatron"
    return f"git -C {repo} worktree add --detach {tree} {step.commit.short} && {run} --megatron {tree}"


def _print_result(result: bisect.Result, repo: Path, mode: str) -> None:
    _say()
    if result.status == "no-change":
        ends = result.steps[0], result.steps[-1]
        shown = "; ".join(f"{cid[:12]} {v.describe()}" for cid, v in sorted(ends[1].verdicts.items()))
        _say(f"no change in range: the verdict (by {mode}) is the same at {ends[0].commit.label()} and "
             f"{ends[1].commit.label()}: {shown}")
    elif result.status == "skipped-only":
        _say(f"the first revision where the verdict changes is one of {len(result.candidates)} (the adapter cannot "
             f"drive the ones before the last; none is blamed):")
        for step in result.candidates:
            _say(f"  {step.commit.label()}  {step.commit.subject}" + (f"  [{step.why}]" if step.why else ""))
    else:
        new, old = result.first_new, result.last_old
        _say(f"first revision where the verdict changes: {new.commit.sha}")
        _say(f"  subject:  {new.commit.subject}")
        if new.commit.upstream:
            _say(f"  upstream: {new.commit.upstream}")
        _say(f"  parent:   {old.commit.label()}  {old.commit.subject}")
        for cid in sorted(new.verdicts):
            before, after = old.verdicts.get(cid), new.verdicts[cid]
            _say(f"  case {cid}: {before.describe() if before else '?'}  ->  {after.describe()}")
            if before is not None:
                _say(f"    repro before: {_repro(repo, old, before)}")
            _say(f"    repro after:  {_repro(repo, new, after)}")
        changed = result.changed_tensors()
        _say("  tensors that changed verdict:" + ("" if changed else " none (the case outcome changed)"))
        for cid, name, a, b in changed:
            _say(f"    {cid[:12]} {name}: {a} -> {b}")
    if result.note:
        _say(f"note: {result.note}")
    times = [s.seconds for s in result.steps]
    _say(f"{len(times)} steps in {sum(times):.1f} s (per step: min {min(times):.1f} s, median "
         f"{statistics.median(times):.1f} s, max {max(times):.1f} s)")


def _select(args: argparse.Namespace) -> tuple[str, list]:
    """The cases to bisect and the suite holding them: ``--suite`` (default ``smoke``), or without it the first
    suite that holds every ``--case-id`` (a step runs its cases by suite, as ``run`` finds an id in any suite)."""
    from cases.suites import suite_names

    if args.suite or not args.case_id:
        args.suite = args.suite or "smoke"
        return select_cases(args)
    for name in suite_names():
        args.suite = name
        try:
            label, cases = select_cases(args)
        except CaseError:
            continue
        if cases:
            return label, cases
    args.suite = None
    raise CaseError("case-id", f"no suite ({', '.join(suite_names())}) holds every case of "
                               f"{', '.join(args.case_id)}; name the suite with --suite")


def command(args: argparse.Namespace) -> int:
    mode = args.by
    try:
        where = args.megatron or os.environ.get("DSV4_MEGATRON")
        if not where:
            raise CaseError("megatron", "needs --megatron PATH, a Megatron-LM git clone (or DSV4_MEGATRON)")
        repo = git_tree.check_repo(Path(where))
        good = git_tree.resolve(repo, args.good, "good")
        bad = git_tree.resolve(repo, args.bad, "bad")
        chain = [git_tree.commit(repo, sha) for sha in git_tree.first_parent_path(repo, good, bad)]
        args.case, args.limit = [], None
        label, cases = _select(args)
        if not cases:
            raise CaseError("case-id", "selects no case")
        context = {"good": good, "bad": bad, "suite": label, "cases": [c.id for c in cases],
                   "provider": args.provider}
        if args.json:  # claimed before any step: an unwritable path fails now, and no earlier file outlives this run
            try:
                bisect.write_json(args.json, {**context, "status": "incomplete",
                                              "why": "the bisect did not finish (interrupted, or a revision could "
                                                     "not be judged): nothing is blamed"})
            except OSError as exc:
                raise CaseError("json", f"cannot write {args.json}: {exc.strerror or exc}") from None
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    case_ids = [c.id for c in cases]
    _say(f"bisect: {len(chain)} first-parent revisions after {good[:10]} up to {bad[:10]}; "
         f"{len(case_ids)} case(s) of {label} ({', '.join(c[:12] for c in case_ids[:4])}"
         f"{', ...' if len(case_ids) > 4 else ''}); provider {args.provider}; verdict by {mode}")
    with tempfile.TemporaryDirectory(prefix="dsv4-parity-bisect-runs-") as runs, \
            git_tree.ThrowawayWorktree(repo) as tree:
        count = [0]

        def judge(commit: git_tree.Commit) -> bisect.Step:
            count[0] += 1
            start = time.perf_counter()
            path = tree.checkout(commit.sha)
            step = bisect.run_step(commit, path, case_ids, label, args.provider, Path(runs) / f"step-{count[0]}",
                                   timeout=args.step_timeout)
            step.seconds = time.perf_counter() - start  # the checkout included
            return step

        def progress(step: bisect.Step) -> None:
            _say(_step_line(len(steps_seen) + 1, step))
            steps_seen.append(step)

        steps_seen: list = []
        first = judge(git_tree.commit(repo, good))
        first.side = "old" if first.status == "ok" else "skip"
        progress(first)
        if first.status != "ok":
            print(f"error: good revision {first.commit.label()} cannot be judged: {first.why}", file=sys.stderr)
            return 2
        try:
            result = bisect.search(chain, first, judge, mode, progress)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    _print_result(result, repo, mode)
    if args.json:
        try:
            bisect.dump(result, mode, args.json, context)
        except OSError as exc:
            print(f"error: --json: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 1 if result.status == "skipped-only" else 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bisect", help="find the Megatron-LM revision where a case's verdict changes",
                       description="Bisect the first-parent history of a Megatron-LM git clone between --good (old) "
                                   "and --bad (new) for the first revision where the verdict of the selected "
                                   "case(s) differs from --good's (git bisect run semantics: revisions the adapter "
                                   "cannot drive are skipped, never blamed). The verdict is the case outcome "
                                   "against the contract before the known-deviation registry (known reads as "
                                   "fail); --by tensors also compares the failing tensors. Each step runs the "
                                   "case(s) in a fresh process on one throwaway worktree of the clone; its working "
                                   "tree and refs are not touched. Exit 0 found or no change in range, 1 only "
                                   "undrivable revisions left to blame, 2 usage error.")
    p.add_argument("--megatron", metavar="PATH", help="the Megatron-LM git clone (default $DSV4_MEGATRON)")
    p.add_argument("--good", "--old", dest="good", required=True, metavar="REV",
                   help="the old revision (a sha, branch, tag, REV^, or an upstream id of an Upstream-Commit trailer)")
    p.add_argument("--bad", "--new", dest="bad", required=True, metavar="REV",
                   help="the new revision, a first-parent descendant of --good")
    p.add_argument("--suite", help="suite of the case(s) (default smoke)")
    p.add_argument("--case-id", action="append", default=[], metavar="ID",
                   help="case of the suite (an id prefix is enough; repeatable; default: the whole suite)")
    p.add_argument("--provider", default="unfused", choices=PROVIDERS, help="megatron provider (default unfused)")
    p.add_argument("--by", default="outcome", choices=bisect.MODES,
                   help="what counts as a change: the case outcome (default), or the outcome and its failing tensors")
    p.add_argument("--step-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="a step that runs longer is skipped (default 1800)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result (every step) as JSON")
    p.set_defaults(func=command)
