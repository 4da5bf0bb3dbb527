"""The mutation suite (``dsv4-parity mutants``) — every planted bug of :mod:`parity.mutation.mutants` must fail the parity suite.

For a suite (default ``smoke``), fused with the ``torch`` provider against the reference, in-process:

1. the **clean run**: every case, unmutated, written to ``<out>/results.jsonl`` like ``dsv4-parity run`` (the HTML
   report of the run directory then shows the kill matrix too). Only cases that pass clean can kill a mutant;
2. per mutant, the cases that hit one of its declared **reach cells** (:data:`parity.mutation.mutants.MUTANTS`, feature cells of
   :func:`cases.coverage.features`), fastest first (clean duration), until the first case that fails or errors —
   the mutant is **killed** there (``--keep-going`` runs every reaching case);
3. ``<out>/mutants.jsonl`` (``reports/mutants.py``): per kill one row per failing tensor of the killing case
   ``{mutant, status: "killed", case_id, tensor, check}`` (``check`` = the verdict rule: ``structure``,
   ``noise_floor``, ``similarity``, ``aggregate``, ``tie_margin``, or ``error`` for an exception, tensor
   ``(exception)``); otherwise one row ``{mutant, status, null, null, null}``.

A mutant is **survived** when some case executed its planted code (``parity.mutation.mutants.reached``) and no case failed;
**unreachable** when no case of the selection hits a declared cell (the missing cells are printed) or none of the
cases that do executed the point. Exit 0 iff the clean run passed and every mutant was killed; the last line reads
``mutants: K/N killed``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from cases.case import Case
from cases.coverage import Cell, cell_name, features, hits, parse_cell

from parity import policy as policy_mod
from parity.engine import RunOptions, run_case
from parity.mutation import mutants
from parity.names import MUTANTS_NAME
from parity.run import runner
from parity.run.execution import load_impl

@dataclass
class Kill:
    case_id: str
    tensor: Optional[str]
    check: str
    message: str = ""


@dataclass
class MutantOutcome:
    """What the suite did to one mutant."""

    name: str
    description: str
    status: str = "unreachable"         # killed / survived / unreachable
    kills: list = field(default_factory=list)   # Kill rows of the (first) killing case(s)
    cases_run: int = 0
    reached: bool = False               # the mutation point executed in some case
    missing: list = field(default_factory=list)  # declared cells no selected case hits
    reaching: int = 0                   # selected cases that hit a declared cell and passed clean
    duration_s: float = 0.0

    def rows(self) -> list[dict]:
        if self.status == "killed":
            return [{"mutant": self.name, "status": "killed", "case_id": k.case_id, "tensor": k.tensor,
                     "check": k.check} for k in self.kills]
        return [{"mutant": self.name, "status": self.status, "case_id": None, "tensor": None, "check": None}]


# ---- reach --------------------------------------------------------------------------------------------------------
def reach_cells(name: str) -> list[Optional[Cell]]:
    """Parsed reach cells of mutant ``name`` (``None`` = any case)."""
    return [parse_cell(text) if text else None for text in mutants.reach_cells(name)]


def reaches(feats: dict, cells: Sequence[Optional[Cell]]) -> bool:
    return any(cell is None or hits(feats, cell) for cell in cells)


# ---- running ------------------------------------------------------------------------------------------------------
def kills_of(result) -> list[Kill]:
    """The failing checks of a failed / errored :class:`parity.run.results.CaseResult`, first failure first."""
    if result.outcome == "error":
        return [Kill(result.case_id, "(exception)", "error", result.message)]
    first = result.first_failure or {}
    out = []
    if first.get("tensor") is None:  # a case-level structure problem (e.g. an input modified in place)
        out.append(Kill(result.case_id, "(case)", first.get("rule") or result.decided_by, result.message))
    failed = [t for t in result.tensors if t.failed]
    failed.sort(key=lambda t: t.name != first.get("tensor"))
    out += [Kill(result.case_id, t.name, t.rule, t.message) for t in failed]
    return out


def run_mutant(name: str, cases: Sequence[Case], clean: dict, run_one: Callable[[Case], object], *,
               keep_going: bool = False) -> MutantOutcome:
    """Run ``cases`` (those of the selection passing clean, ``clean[id] = (outcome, duration)``) with mutant ``name``
    active, cheapest reaching case first, until one fails (all of them with ``keep_going``)."""
    outcome = MutantOutcome(name, mutants.registered()[name])
    cells = reach_cells(name)
    feats = {c.id: features(c) for c in cases}
    outcome.missing = [cell_name(cell) for cell in cells
                       if cell is not None and not any(hits(f, cell) for f in feats.values())]
    todo = [c for c in cases if reaches(feats[c.id], cells) and clean.get(c.id, ("", 0.0))[0] == "pass"]
    todo.sort(key=lambda c: clean[c.id][1])
    outcome.reaching = len(todo)
    start = time.perf_counter()
    with mutants.activate(name):
        for case in todo:
            mutants.clear_reached()
            result = run_one(case)
            outcome.cases_run += 1
            outcome.reached |= name in mutants.reached()
            if result.outcome in ("fail", "error"):
                outcome.kills += kills_of(result)
                if not keep_going:
                    break
    mutants.clear_reached()
    outcome.duration_s = time.perf_counter() - start
    outcome.status = "killed" if outcome.kills else "survived" if outcome.reached else "unreachable"
    return outcome


def describe(o: MutantOutcome) -> str:
    """One terminal line per mutant."""
    head = f"{o.status.upper():<11} {o.name:<30}"
    if o.status == "killed":
        k = o.kills[0]
        more = len({x.case_id for x in o.kills})
        where = f"case {k.case_id}  {k.tensor}  [{k.check}]"
        if k.check == "error":
            where += f"  {k.message[:90]}"
        return (f"{head} {where}  ({o.cases_run} case{'s' * (o.cases_run != 1)}, {o.duration_s:.1f} s"
                + (f", {more} killing cases" if more > 1 else "") + ")")
    if o.status == "survived":
        return f"{head} ran {o.cases_run} reaching cases, none failed ({o.duration_s:.1f} s): strengthen a check"
    cells = [c for c in mutants.reach_cells(o.name) if c]
    if o.reaching == 0 and cells and len(o.missing) == len(cells):
        return f"{head} the suite lacks cell {o.missing[0]}" + \
            (f" (or any of: {'; '.join(o.missing[1:])})" if len(o.missing) > 1 else "")
    if o.reaching == 0:
        return f"{head} no case that hits its cells passes clean"
    return f"{head} {o.reaching} cases hit its cells but none executed the planted code: fix its reach cells (parity/mutation/mutants.py)"


def write_rows(outcomes: Sequence[MutantOutcome], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for o in outcomes:
            for row in o.rows():
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")
    return path


def clean_outcomes(results_path: Path) -> dict:
    """``{case_id: (outcome, duration_s)}`` from a results.jsonl."""
    out = {}
    for line in results_path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("type") == "case":
            out[row["case_id"]] = (row["outcome"], float(row["duration_s"]))
    return out


def mutation_suite(cases: Sequence[Case], names: Sequence[str], out_dir: Path, *, suite: str = "adhoc",
                   provider: str = "torch", device: str = "auto", policy_path: Optional[str] = None,
                   keep_going: bool = False, quiet: bool = True, argv: Sequence[str] = (),
                   echo: Callable[[str], None] = print, force: bool = False, link: Optional[Path] = None,
                   run_id: Optional[str] = None) -> tuple[dict, list[MutantOutcome]]:
    """The clean run (``out_dir/results.jsonl``), then every mutant of ``names``; writes ``mutants.jsonl``.
    Returns ``(clean counts, outcomes)``. ``out_dir`` is prepared as for ``dsv4-parity run`` (a directory holding
    a run is refused unless ``force`` replaces it: :mod:`parity.run.rundir`); ``link`` (a symlink) is pointed at it once
    the clean run starts."""
    if mutants.active():
        raise RuntimeError(f"mutants {sorted(mutants.active())} are active: the clean run would not be clean")
    options = RunOptions(impl="fused", against="reference", provider=provider, device=device,
                         policy_path=policy_path)
    config = runner.RunConfig(suite=suite, options=options, out_dir=out_dir, isolate="none", quiet=quiet, argv=argv,
                              run_id=run_id or runner.new_run_id(suite, "fused", "mutants"), force=force, link=link)
    counts, _ = runner.run(cases, config)
    clean = clean_outcomes(out_dir / "results.jsonl")
    echo(f"clean: {sum(counts.values())} cases: {counts['pass']} passed, {counts['fail']} failed, "
         f"{counts['error']} errors, {counts['unsupported']} unsupported")
    policy = policy_mod.load(policy_path) if policy_path else policy_mod.default()
    impl, against = load_impl("fused"), load_impl("reference")
    outcomes = []
    for name in names:
        o = run_mutant(name, cases, clean, lambda case: run_case(case, impl, against, options, policy),
                       keep_going=keep_going)
        outcomes.append(o)
        echo(describe(o))
    write_rows(outcomes, out_dir / MUTANTS_NAME)
    return counts, outcomes


__all__ = ["MutantOutcome", "mutation_suite", "run_mutant"]
