"""A parity run: cases → isolated execution → ``results.jsonl`` streamed case by case → summary, JUnit, exit code.

:func:`run` drives a whole run (one case in this process: :func:`parity.run.execution.execute`, which the worker
child, :mod:`parity.run.worker`, calls too):

* writes the ``run`` row (options and :func:`parity.run.environment.environment`), then one block of rows per case as
  it finishes, then the ``end`` row with the counts;
* ``resume``: keeps the finished cases of an existing ``results.jsonl`` and runs only the others;
* isolation ``none`` (in-process, the CPU default), ``worker`` (a child process replaced after any error or crash,
  the GPU default) or ``case`` (a fresh child per case);
* ``workers`` (``--workers N|auto``, :mod:`parity.run.placement`): N child processes, on CUDA each pinned to one visible
  GPU (``CUDA_VISIBLE_DEVICES``; ``auto`` puts up to 6 on a GPU), fed from one queue ordered by estimated cost; the
  parent alone writes the one ``results.jsonl`` as cases finish (completion order). The ``run`` row records
  ``workers``, ``devices`` and ``threads``; every ``case`` row the ``worker`` (slot index) and ``device`` (``cpu`` /
  ``cuda:<token>``) it ran on, and ``retried`` if it ran out of GPU memory on a shared GPU and this is its re-run
  alone (:class:`parity.run.worker.WorkerPool`). With one worker the run is what it was before sharding (suite order,
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
import os
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from cases.case import Case
from cases.errors import CaseError

from parity import names
from parity.engine import RunOptions
from parity.run import memory, placement, results, shard
from parity.run.environment import environment, environment_changes
from parity.run.execution import error_rows, execute, load_impl
from parity.run.junit import write_junit
from parity.run.progress import Progress
from parity.run.rundir import check_writable_file, prepare
from parity.run.placement import Slot
from parity.run.worker import WorkerPool, children_for, warm_spec

REPO = names.REPO
DEFAULT_OUT_ROOT = names.OUT_ROOT


# ---- output directory ------------------------------------------------------------------------------------------------
def new_run_id(suite: str, impl: str, oracle: Optional[str] = None) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = impl.replace(":", "-").replace("/", "-").split(".")[-1]
    return f"{stamp}-{suite}-{name}" + (f"-{oracle}" if oracle else "")


def unique_sibling(parent: Path, run_id: str) -> Path:
    """``parent/run_id``, or ``parent/run_id-2``, ``-3``, ... when a run of the same second already has that name:
    a new run never lands in another run's directory."""
    path, n = parent / run_id, 1
    while path.exists() or path.is_symlink():
        n += 1
        path = parent / f"{run_id}-{n}"
    return path


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
        return unique_sibling(DEFAULT_OUT_ROOT, run_id), (latest if make_default else None)
    path = Path(out)
    names_latest = path.absolute() == latest.absolute() or (path.is_symlink() and path.absolute() == latest)
    if path.is_symlink():
        return (path.resolve(), None) if resume else (unique_sibling(path.parent, run_id), path)
    if names_latest and not path.exists():
        return unique_sibling(path.parent, run_id), path
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
    workers: Union[int, str] = 1  # N or "auto" (parity.run.placement.resolve_workers)
    threads: Optional[int] = None  # intra-op threads per worker (default: parity.run.placement.plan_slots)
    budget_s: Optional[float] = None  # start no case after this many seconds; the rest is recorded as not run
    force: bool = False  # clear a non-empty out_dir instead of refusing it
    link: Optional[Path] = None  # a symlink (reports/out/latest) to point at out_dir once the run row is written
    selection: Optional[dict] = None  # how the cases were chosen, recorded on the run row for --resume
    peaks: Optional[dict] = None  # {case_id: bytes} measured on this GPU before (memory admission; the CLI reads it)
    gate: Optional[dict] = None  # the manifest of the one-path gate this run is (run row ``gate``: its --resume)
    prestart: Optional[Any] = None  # worker children started before the run (parity.run.prestart.Prestart)
    command_started: Optional[float] = None  # time.perf_counter() as the command started (end row prelude_s)


def _isolation(config: RunConfig, workers: int) -> str:
    if config.isolate == "none" and workers > 1:
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
    """Run ``cases``; returns ``(counts, exit code)`` (2: the results could not be written)."""
    device = config.options.torch_device()
    workers = placement.resolve_workers(config.workers, device)
    mode = _isolation(config, workers)  # usage errors before anything is written
    if config.threads is not None and config.threads < 1:
        raise CaseError("threads", f"must be a positive integer, got {config.threads}")
    # the intra-op thread count is part of what a CPU result is (it sets the summation order of parallel
    # reductions): always an explicit number, recorded in the run row and re-applied by --resume
    threads = config.threads if config.threads is not None else (torch.get_num_threads() if workers == 1 else None)
    slots = placement.plan_slots(workers, device, threads=threads)
    out_dir = config.out_dir
    path = out_dir / "results.jsonl"
    check_writable_file(config.junit, "junit")
    rundir = prepare(out_dir, resume=config.resume, force=config.force)  # usage errors before anything is written
    try:
        return _run_locked(cases, config, device, workers, mode, slots, path)
    finally:
        rundir.close()


def occupancy(spans: Sequence[float], workers: int, wall_s: float, processes: int, waited: int,
              prestarted: int = 0) -> dict:
    """How busy a run's workers were: ``case_s`` the summed spans of its cases (each from handed out to finished, in
    the parent: the child's start-up, a re-run alone's wait and the answer's transfer included), ``share`` that sum
    over ``workers`` × ``wall_s``, ``processes_started`` (worker children, replacements included),
    ``waited_for_memory`` (cases that waited for GPU memory), ``prestarted`` (of the children, those started before
    the run's clock: :mod:`parity.run.prestart`). The end row's ``occupancy``; a resumed run's covers its last
    invocation only."""
    busy = float(sum(spans))
    return {"workers": workers, "wall_s": round(wall_s, 3), "case_s": round(busy, 3),
            "share": round(busy / (workers * wall_s), 4) if workers and wall_s > 0 else None,
            "processes_started": processes, "waited_for_memory": waited, "prestarted": prestarted}


def _prestarted(config: RunConfig, wanted: list) -> Optional[list]:
    """The children started before the run for the slots whose fresh children would be ``wanted`` (``(command,
    env)`` each), None for a slot without one (:meth:`parity.run.prestart.Prestart.assign`: it stops the rest)."""
    if config.prestart is None:
        return None
    spares, differs = config.prestart.assign(wanted)
    if differs:  # said even under --quiet: it costs the run its early start
        print(f"note: {sum(s is None for s in spares)} of {len(spares)} worker(s) started anew: the children started "
              f"early differ from this run's in {', '.join(differs)}", file=sys.stderr)
    return spares


def occupancy_line(o: dict) -> str:
    share = "-" if o.get("share") is None else f"{100 * o['share']:.0f} %"
    return (f"workers: {o['workers']} over {o['wall_s']:.0f} s, busy {share} (cases handed out to finished: "
            f"{o['case_s']:.0f} s); {o['processes_started']} worker process(es) started"
            + (f" ({o['prestarted']} before the run)" if o.get("prestarted") else "")
            + f", {o['waited_for_memory']} case(s) waited for GPU memory")


def _gpu_capacity(device: str) -> Optional[int]:
    """The memory (bytes) of the GPU a run on ``device`` uses, None off a GPU (what a resume weighs ``device-memory``
    cases against: :func:`parity.run.results._again`)."""
    return memory.device_total_bytes() if device == "cuda" else None


def _resume_note(existing: results.Existing, todo: int) -> str:
    again = []
    if existing.cut:
        again.append(f"{len(existing.cut)} cut off")
    if existing.errored:
        again.append(f"{len(existing.errored)} errored")
    if existing.larger_gpu:
        again.append(f"{len(existing.larger_gpu)} that did not fit their GPU, this one larger or its size unknown")
    return (f"resuming: {len(existing.outcomes)} cases already done, {todo} to run"
            + (f" (again: {', '.join(again)})" if again else ""))


def _record_other_environment(writer: results.ResultsWriter, existing: results.Existing, device: str,
                              todo: int) -> None:
    """A resume under other code, libraries or GPU than the run row records (:func:`environment_changes`): the run
    then mixes cases of two environments (a resume with nothing left to run adds no case: no row). Written as a
    ``resume`` row (``changed``: key -> [recorded, now]; ``done``:
    the cases finished before it) and said on stderr; the reports count the run as incomplete (a gate must not pass
    cases the code under test never ran)."""
    row = existing.run_row
    info = row.get("impl_info") if isinstance(row.get("impl_info"), dict) else {}
    changed = environment_changes(row.get("env"), environment(device), info.get("provider") or row.get("provider"))
    if not changed:
        return
    writer.write([{"type": "resume", "at": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                   "changed": changed, "done": len(existing.outcomes), "todo": todo}])
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    print(f"resuming under another environment than the run's ({what}): its {len(existing.outcomes)} finished "
          f"case(s) ran there, the {todo} left run here; the run counts as incomplete (start it afresh to gate "
          f"this code)", file=sys.stderr)


def _run_locked(cases: Sequence[Case], config: RunConfig, device: str, workers: int, mode: str,
                slots: list[Slot], path: Path) -> tuple[dict, int]:
    out_dir = config.out_dir
    existing = results.read_for_resume(path, _gpu_capacity(device)) if config.resume else results.Existing(None, {})
    todo = [c for c in cases if c.id not in existing.outcomes]
    if workers > 1:
        todo = shard.by_cost(todo, device)  # the shared queue: most expensive first (LPT)
    outcomes = dict(existing.outcomes)
    fixed: list[str] = []  # cases where a registered known deviation did not reproduce
    # intra-op threads of the processes running the cases (recorded; resolved by run(), never None)
    threads_before, threads = None, slots[0].threads
    if mode == "none":
        threads_before = _set_threads(threads)
        threads = _set_threads(None)
    started = time.perf_counter()
    if existing.run_row is None:  # the stream appears with its run row whole (a kill now leaves no torn start)
        opts = config.options
        results.create_stream(path, [{
            "type": "run", "run_id": config.run_id, "suite": config.suite, "impl": opts.impl,
            "against": f"oracle:{config.oracle}" if config.oracle else opts.against,
            "provider": resolved_provider(opts),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": list(config.argv), "env": environment(device),
            "options": asdict(opts), "workers": workers, "devices": [s.device for s in slots],
            "threads": threads, "selection": config.selection or {},
            "planned": [c.id for c in cases], **_impl_info(opts.impl, opts.provider, opts.cp),
            **({"gate": config.gate} if config.gate else {})}])
    writer = results.ResultsWriter(path)
    if config.link is not None:
        point_link(config.link, out_dir)  # from its start, `latest` names this run
    if config.resume and existing.run_row is not None and existing.outcomes and todo:
        _record_other_environment(writer, existing, device, len(todo))
    if config.resume and (existing.outcomes or existing.cut or existing.errored or existing.larger_gpu):
        print(_resume_note(existing, len(todo)), file=sys.stderr)
    progress = Progress(len(todo), config.quiet)
    pool = None
    handed: dict[str, float] = {}  # case id -> seconds into the run when it was first handed out (its timeline)
    spans: list[float] = []  # handed out -> finished, per case finished by this invocation

    def starting(case: Case) -> None:
        handed.setdefault(case.id, time.perf_counter() - started)  # a re-run alone keeps its first start
        progress.starting(case)

    def request(case: Case) -> dict:
        return {"case": case.to_dict(), "options": asdict(config.options), "oracle": config.oracle}

    def finished(case: Case, rows: list[dict], slot: Slot) -> None:
        now = time.perf_counter() - started
        start = handed.get(case.id, now)
        rows[0]["at_s"] = [round(start, 3), round(now, 3)]  # the case's span in this invocation (additive field)
        spans.append(now - start)
        writer.write(results.sealed(_tag(rows, slot)))
        outcomes[case.id] = rows[0]["outcome"]
        if (rows[0].get("known") or {}).get("status") == "fixed?":
            fixed.append(case.id)
        progress.done(rows[0])

    deadline = None if config.budget_s is None else started + config.budget_s

    def spent() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    def within_budget(cases: Sequence[Case]) -> Iterable[Case]:
        for case in cases:
            if spent():
                return
            yield case

    failure = None
    try:
        if mode == "none":
            if config.prestart is not None:
                config.prestart.close()
            for case in within_budget(todo):
                starting(case)
                finished(case, execute(request(case)), slots[0])
        else:
            used = slots[:max(1, min(workers, len(todo)))]
            opts = config.options
            warm = warm_spec(opts.impl, opts.against, opts.provider, device)
            admission = _memory_admission(opts, device, used, config.peaks)
            spares = _prestarted(config, children_for(used, warm))  # from here the pool stops them (close)
            pool = WorkerPool(used, timeout=config.timeout, fresh=(mode == "case"), backfill=len(todo), warm=warm,
                              spares=spares, **admission)
            jobs = ((c, request(c)) for c in within_budget(todo))
            for done in pool.run(jobs, on_start=lambda c, _: starting(c), stop=spent):
                rows = done.rows if done.rows is not None else error_rows(done.key, config.options, done.why)
                if done.retried:  # re-run alone after running out of GPU memory on a shared GPU (additive field)
                    rows[0].setdefault("retried", done.retried)
                finished(done.key, rows, done.slot)
    except results.ResultsWriteError as exc:
        failure = exc
    except KeyboardInterrupt:
        print(f"interrupted: the finished cases are kept in {path}; continue with: "
              f"{resume_command(out_dir)}", file=sys.stderr)
        raise Interrupted() from None
    finally:
        progress.close()
        if pool is not None:
            pool.close()
            if pool.weigh is not None:
                print(f"memory admission: {pool.waited} case(s) waited for GPU memory, {pool.backfilled} started "
                      f"past a waiting one in room it could not use (each GPU lends {pool.capacity / 2**30:.1f} GiB "
                      "to its workers; parity.run.memory.expected_gpu_bytes)", file=sys.stderr)
        if threads_before is not None:
            _set_threads(threads_before)
        if failure is not None:
            writer.close()
    counts = results.counts(outcomes.values())
    # every case this invocation never handed out (a spent budget: the pool starts nothing after it, read ahead or not)
    not_run = [c.id for c in todo if c.id not in handed] if failure is None else []
    if failure is not None:
        print(f"error: {failure.strerror}; the run stopped, {sum(counts.values())} finished cases are kept; free "
              f"space, then continue with: {resume_command(out_dir)}", file=sys.stderr)
        return counts, 2
    end = {"type": "end", "counts": counts, "duration_s": round(time.perf_counter() - started, 3)}
    if config.command_started is not None:  # the command's time before this run's clock started (additive field)
        end["prelude_s"] = round(started - config.command_started, 3)
    end["occupancy"] = occupancy(spans, len(used) if pool is not None else 1, end["duration_s"],
                                 pool.started if pool is not None else 0, pool.waited if pool is not None else 0,
                                 pool.adopted if pool is not None else 0)
    if pool is not None and spans and not config.quiet:
        print(occupancy_line(end["occupancy"]), file=sys.stderr)
    if fixed:
        end["fixed"] = fixed
    if not_run and deadline is not None:
        end.update(stopped="budget", budget_s=config.budget_s, not_run=not_run)
        print(f"budget of {config.budget_s:g} s spent: {len(not_run)} of {len(cases)} cases not run "
              f"(continue with: {resume_command(out_dir)})", file=sys.stderr)
    elif not_run:  # never without a budget: a fault of the runner, reported as such, the run incomplete
        end.update(stopped="not started", not_run=not_run)
        print(f"error: {len(not_run)} of {len(cases)} cases were never started (a fault of the runner); continue "
              f"with: {resume_command(out_dir)}", file=sys.stderr)
    code = 1 if counts["fail"] or counts["error"] or not_run else 0
    try:
        writer.write([end])
    except results.ResultsWriteError as exc:
        print(f"error: {exc.strerror}; every case finished but the end row is missing: continue with "
              f"{resume_command(out_dir)}", file=sys.stderr)
        code = 2
    writer.close()
    if config.junit:
        try:
            write_junit(path, config.junit)
        except OSError as exc:
            print(f"error: junit: cannot write {config.junit}: {exc.strerror or exc}", file=sys.stderr)
            code = 2
    if fixed:
        counts = dict(counts, **{"fixed?": len(fixed)})
    return counts, code


def _memory_admission(options: RunOptions, device: str, slots: Sequence[Slot], peaks: Optional[dict] = None) -> dict:
    """The worker pool's memory admission (``weigh``, ``capacity``) where several workers share a GPU, by each case's
    expected peak (:func:`parity.run.memory.expected_gpu_bytes`: ``peaks`` measured before, else a model, else 0:
    it fits beside any cases within the capacity); nothing on a CPU or with a GPU per worker."""
    if device != "cuda":
        return {}
    per_device = max(Counter(s.device for s in slots).values())
    if per_device < 2:
        return {}
    provider = resolved_provider(options)  # a case without a model weighs 0
    capacity = memory.admission_capacity(memory.device_total_bytes(), per_device)
    return {"weigh": lambda case: memory.expected_gpu_bytes(case, options.impl, provider, peaks),
            "capacity": capacity}


def _impl_info(name: str, provider: Optional[str] = None, cp: int = 1) -> dict:
    """``{"impl_info": ...}`` for the run row when the implementation describes itself (revision, the run
    provider's stand-ins; with ``--cp`` described inside its context-parallel context)."""
    try:
        impl = load_impl(name)
        with impl.parallel(cp):
            info = impl.describe(provider)
    except Exception as exc:  # noqa: BLE001 — the run row is informative; the cases report real problems
        return {"impl_info": {"error": str(exc)}}
    return {"impl_info": info} if info else {}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run, after the runner printed how to continue it."""


def resume_command(out_dir: Path) -> str:
    """The command continuing the run in ``out_dir`` (the recorded run decides suite, implementation, options)."""
    return f"dsv4-parity run --out {shlex.quote(str(out_dir))} --resume"


def _set_threads(threads: Optional[int]) -> int:
    """Set this process's intra-op thread count (``None``: leave it); returns the count before."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return before


def resolved_provider(options: RunOptions) -> str:
    """The provider recorded in the ``run`` row: as requested, ``none`` for an implementation without providers."""
    try:
        return load_impl(options.impl).resolve_provider(options.provider)
    except Exception:  # noqa: BLE001 — an implementation that cannot load is reported per case
        return options.provider


def select(cases: Iterable[Case], ids: Sequence[str], suites: Optional[dict] = None) -> list[Case]:
    """Cases whose id equals or starts with one of ``ids`` (every id must match exactly one case). ``suites``
    (case id -> suite names) says where each candidate comes from when the pool spans several suites; a case found
    in several suites is one case."""
    cases = list({c.id: c for c in cases}.values())
    chosen = []
    for wanted in ids:
        hits = [c for c in cases if c.id == wanted] or [c for c in cases if c.id.startswith(wanted)]
        if not hits:
            raise CaseError("case_id", f"no case has id {wanted!r}")
        if len(hits) > 1:
            shown = ", ".join(c.id + (f" ({'/'.join(suites.get(c.id, ()))})" if suites else "") for c in hits[:6])
            more = f", ... ({len(hits)} in all)" if len(hits) > 6 else ""
            raise CaseError("case_id", f"{len(hits)} cases match id {wanted!r}: {shown}{more}; give more of the "
                                       "id" + (" or --suite" if suites else ""))
        if hits[0] not in chosen:
            chosen.append(hits[0])
    return chosen
