"""A parity run: cases → isolated execution → ``results.jsonl`` streamed case by case → summary, JUnit, exit code.

``execute(request)`` runs one case in the current process and returns its result rows; the worker child
(:mod:`parity.worker`) calls the same function. :func:`run` drives a whole run:

* writes the ``run`` row (options and :func:`parity.environment.environment`), then one block of rows per case as
  it finishes, then the ``end`` row with the counts;
* ``resume``: keeps the finished cases of an existing ``results.jsonl`` and runs only the others;
* isolation ``none`` (in-process, the CPU default), ``worker`` (a child process replaced after any error or crash,
  the GPU default) or ``case`` (a fresh child per case);
* ``workers`` (``--workers N|auto``, :mod:`parity.shard`): N child processes, on CUDA each pinned to one visible
  GPU (``CUDA_VISIBLE_DEVICES``; ``auto`` puts up to 4 on a GPU), fed from one queue ordered by estimated cost; the
  parent alone writes the one ``results.jsonl`` as cases finish (completion order). The ``run`` row records
  ``workers``, ``devices`` and ``threads``; every ``case`` row the ``worker`` (slot index) and ``device`` (``cpu`` /
  ``cuda:<token>``) it ran on, and ``retried`` if it ran out of GPU memory on a shared GPU and this is its re-run
  alone (:class:`parity.worker.WorkerPool`). With one worker the run is what it was before sharding (suite order,
  same isolation);
* ``budget_s`` (``--budget-s``): no case starts once the budget is spent (cases already running finish, and so does
  the re-run alone of a case that ran out of GPU memory: it was started before); the
  ``end`` row then says ``stopped: "budget"`` and lists the ``not_run`` case ids, the run counts as incomplete
  (reports, ``compare --update``) and the exit code is 1 — a time-boxed run never passes as a full one;
* prints a progress bar (rich) and one line per case that did not pass, then
  ``N cases: P passed, F failed, E errors, U unsupported``; returns 1 iff a case failed or errored.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from cases.case import Case

from . import results as R
from . import shard
from .engine import RunOptions, run_case
from .shard import Slot

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT_ROOT = REPO / "reports" / "out"


@functools.lru_cache(maxsize=None)
def _impl(name: str):
    from .impls import load

    return load(name)


def execute(request: dict) -> list[dict]:
    """Run one request ``{"case", "options", "oracle"}`` in this process; returns its result rows."""
    case = Case.from_dict(request["case"])
    options = RunOptions(**request["options"])
    oracle = request.get("oracle")
    try:
        impl = _impl(options.impl)
        if oracle:
            from .metamorphic import run_oracle

            result = run_oracle(oracle, case, impl, options)
        else:
            result = run_case(case, impl, _impl(options.against), options)
    except Exception as exc:  # noqa: BLE001 — e.g. an implementation that cannot even be imported
        from .engine import one_line

        result = R.CaseResult(case=case, outcome="error", decided_by="error", message=one_line(exc),
                              repro=options.repro(case),
                              first_failure={"tensor": None, "rule": "error", "message": one_line(exc)})
    return result.rows()


def error_rows(case: Case, options: RunOptions, message: str) -> list[dict]:
    return R.CaseResult(case=case, outcome="error", decided_by="error", message=message, repro=options.repro(case),
                        first_failure={"tensor": None, "rule": "error", "message": message}).rows()


# ---- output directory ------------------------------------------------------------------------------------------------
def new_run_id(suite: str, impl: str, oracle: Optional[str] = None) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = impl.replace(":", "-").replace("/", "-").split(".")[-1]
    return f"{stamp}-{suite}-{name}" + (f"-{oracle}" if oracle else "")


def resolve_out_dir(out: Optional[str], run_id: str, make_default: bool, resume: bool) -> tuple[Path, Optional[Path]]:
    """``(directory to write, symlink to point at it or None)``.

    * no ``--out``: ``reports/out/<run_id>``;
    * ``--out`` is a symlink (``reports/out/latest``, the Makefile's default): it names "the current run" — a
      fresh run goes to a new sibling ``<run_id>`` directory and the link moves there; ``--resume`` continues in
      the directory it points at;
    * otherwise ``--out`` is the directory itself.

    ``--make-default`` also points ``reports/out/latest`` at the run (what ``make report`` reads).
    """
    latest = DEFAULT_OUT_ROOT / "latest"
    if out is None:
        return DEFAULT_OUT_ROOT / run_id, (latest if make_default else None)
    path = Path(out)
    names_latest = path.absolute() == latest.absolute() or (path.is_symlink() and path.absolute() == latest)
    if path.is_symlink():
        return (path.resolve(), None) if resume else (path.parent / run_id, path)
    if names_latest and not path.exists():
        return path.parent / run_id, path
    return path, (latest if make_default and not names_latest else None)


def point_link(link: Path, target: Path) -> None:
    """Atomically make ``link`` a relative symlink to ``target`` (replacing a previous link, never a directory)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists() and not link.is_symlink():
        print(f"note: {link} is a real directory; not replacing it with a link", file=sys.stderr)
        return
    tmp = link.with_name(link.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(os.path.relpath(target.resolve(), link.parent.resolve()))
    os.replace(tmp, link)


# ---- the run loop ----------------------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    suite: str
    options: RunOptions
    out_dir: Path
    oracle: Optional[str] = None
    resume: bool = False
    isolate: str = "auto"  # auto / none / worker / case
    timeout: float = 1800.0
    junit: Optional[Path] = None
    argv: Sequence[str] = ()
    run_id: str = ""
    quiet: bool = False
    workers: Union[int, str] = 1  # N or "auto" (parity.shard.resolve_workers)
    threads: Optional[int] = None  # intra-op threads per worker (default: parity.shard.plan_slots)
    budget_s: Optional[float] = None  # start no case after this many seconds; the rest is recorded as not run


class _Progress:
    """A rich progress bar on a terminal; plain lines otherwise."""

    def __init__(self, total: int, quiet: bool):
        self.quiet = quiet
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.console = Console(stderr=True)
            self.bar = Progress(TextColumn("[bold]parity"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.description}"), console=self.console, transient=True)
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def starting(self, case: Case) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=case.id)

    def done(self, row: dict) -> None:
        line = None
        fixed = (row.get("known") or {}).get("status") == "fixed?"
        if row["outcome"] != "pass" or fixed:
            label = "FIXED?" if fixed else row["outcome"].upper()
            line = f"{label:<11} {row['case_id']}  {row['message']}"
        if self.bar is not None:
            self.bar.advance(self.task)
            if line:
                style = {"fail": "red", "error": "magenta", "unsupported": "yellow", "known": "cyan"}.get(
                    "known" if fixed else row["outcome"], "")
                self.console.print(line, style=style, markup=False, highlight=False)
        elif line and not self.quiet:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _isolation(config: RunConfig, workers: int) -> str:
    if config.isolate == "none" and workers > 1:
        from cases.errors import CaseError

        raise CaseError("isolate", f"'none' runs in this process and cannot use {workers} workers "
                                   "(use --isolate worker or case, or --workers 1)")
    if config.isolate != "auto":
        return config.isolate
    return "worker" if config.options.torch_device() == "cuda" or workers > 1 else "none"


def _tag(rows: list[dict], slot: Slot) -> list[dict]:
    """Record on the ``case`` row which worker / device ran it (additive fields)."""
    rows[0]["worker"] = slot.index
    rows[0]["device"] = slot.device
    return rows


def run(cases: Sequence[Case], config: RunConfig) -> tuple[dict, int]:
    """Run ``cases``; returns ``(counts, exit code)``."""
    from .environment import environment

    device = config.options.torch_device()
    workers = shard.resolve_workers(config.workers, device)
    mode = _isolation(config, workers)  # usage errors before anything is written
    if config.threads is not None and config.threads < 1:
        from cases.errors import CaseError

        raise CaseError("threads", f"must be a positive integer, got {config.threads}")
    slots = shard.plan_slots(workers, device, threads=config.threads)
    out_dir = config.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.jsonl"
    existing = R.read_for_resume(path) if config.resume else R.Existing(None, {})
    if not config.resume and path.exists():
        path.unlink()
    todo = [c for c in cases if c.id not in existing.outcomes]
    if workers > 1:
        todo = shard.by_cost(todo, device)  # the shared queue: most expensive first (LPT)
    outcomes = dict(existing.outcomes)
    fixed: list[str] = []  # cases where a registered known deviation did not reproduce
    # intra-op threads of the processes running the cases (recorded; None: each child's own default)
    threads_before, threads = None, slots[0].threads
    if mode == "none":
        threads_before = _set_threads(config.threads)
        threads = _set_threads(None)
    started = time.perf_counter()
    writer = R.ResultsWriter(path)
    if existing.run_row is None:
        opts = config.options
        writer.write([{"type": "run", "run_id": config.run_id, "suite": config.suite, "impl": opts.impl,
                       "against": f"oracle:{config.oracle}" if config.oracle else opts.against,
                       "provider": _run_provider(opts),
                       "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                       "argv": list(config.argv), "env": environment(device),
                       "options": asdict(opts), "workers": workers, "devices": [s.device for s in slots],
                       "threads": threads, **_impl_info(opts.impl)}])
    if config.resume and existing.outcomes:
        print(f"resuming: {len(existing.outcomes)} cases already done, {len(todo)} to run", file=sys.stderr)
    progress = _Progress(len(todo), config.quiet)
    pool = None

    def request(case: Case) -> dict:
        return {"case": case.to_dict(), "options": asdict(config.options), "oracle": config.oracle}

    def finished(case: Case, rows: list[dict], slot: Slot) -> None:
        writer.write(_tag(rows, slot))
        outcomes[case.id] = rows[0]["outcome"]
        if (rows[0].get("known") or {}).get("status") == "fixed?":
            fixed.append(case.id)
        progress.done(rows[0])

    deadline = None if config.budget_s is None else started + config.budget_s
    not_run: list[str] = []

    def within_budget(cases: Sequence[Case]) -> Iterable[Case]:
        for i, case in enumerate(cases):
            if deadline is not None and time.perf_counter() >= deadline:
                not_run.extend(c.id for c in cases[i:])
                return
            yield case

    try:
        if mode == "none":
            for case in within_budget(todo):
                progress.starting(case)
                finished(case, execute(request(case)), slots[0])
        else:
            from .worker import WorkerPool

            pool = WorkerPool(slots[:max(1, min(workers, len(todo)))], timeout=config.timeout,
                              fresh=(mode == "case"))
            jobs = ((c, request(c)) for c in within_budget(todo))
            for done in pool.run(jobs, on_start=lambda c, _: progress.starting(c)):
                rows = done.rows if done.rows is not None else error_rows(done.key, config.options, done.why)
                if done.retried:  # re-run alone after running out of GPU memory on a shared GPU (additive field)
                    rows[0].setdefault("retried", done.retried)
                finished(done.key, rows, done.slot)
    finally:
        progress.close()
        if pool is not None:
            pool.close()
        if threads_before is not None:
            _set_threads(threads_before)
    counts = R.counts(outcomes.values())
    end = {"type": "end", "counts": counts, "duration_s": round(time.perf_counter() - started, 3)}
    if fixed:
        end["fixed"] = fixed
    if not_run:
        end.update(stopped="budget", budget_s=config.budget_s, not_run=not_run)
        print(f"budget of {config.budget_s:g} s spent: {len(not_run)} of {len(cases)} cases not run "
              f"(continue with --resume --out {out_dir})", file=sys.stderr)
    writer.write([end])
    writer.close()
    if config.junit:
        from .junit import write_junit

        write_junit(path, config.junit)
    code = 1 if counts["fail"] or counts["error"] or not_run else 0
    if fixed:
        counts = dict(counts, **{"fixed?": len(fixed)})
    return counts, code


def _impl_info(name: str) -> dict:
    """``{"impl_info": ...}`` for the run row when the implementation describes itself (revision, stand-ins)."""
    from .impls import load

    try:
        info = load(name).describe()
    except Exception as exc:  # noqa: BLE001 — the run row is informative; the cases report real problems
        return {"impl_info": {"error": str(exc)}}
    return {"impl_info": info} if info else {}


def _set_threads(threads: Optional[int]) -> int:
    """Set this process's intra-op thread count (``None``: leave it); returns the count before."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return before


def _run_provider(options: RunOptions) -> str:
    """The provider recorded in the ``run`` row: as requested, ``none`` for an implementation without providers."""
    try:
        return _impl(options.impl).resolve_provider(options.provider)
    except Exception:  # noqa: BLE001 — an implementation that cannot load is reported per case
        return options.provider


def select(cases: Iterable[Case], ids: Sequence[str]) -> list[Case]:
    """Cases whose id equals or starts with one of ``ids`` (every id must match exactly one case)."""
    from cases.errors import CaseError

    cases = list(cases)
    chosen = []
    for wanted in ids:
        hits = [c for c in cases if c.id == wanted] or [c for c in cases if c.id.startswith(wanted)]
        if len(hits) != 1:
            raise CaseError("case_id", f"{'no case has' if not hits else f'{len(hits)} cases match'} id {wanted!r}")
        if hits[0] not in chosen:
            chosen.append(hits[0])
    return chosen
