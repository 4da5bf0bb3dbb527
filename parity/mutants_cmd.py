"""``dsv4-parity mutants``: the mutation suite — every planted bug of :mod:`fused.mutants` must fail the parity suite.

For a suite (default ``smoke``), fused with the ``torch`` provider against the reference, in-process:

1. the **clean run**: every case, unmutated, written to ``<out>/results.jsonl`` like ``dsv4-parity run`` (the HTML
   report of the run directory then shows the kill matrix too). Only cases that pass clean can kill a mutant;
2. per mutant, the cases that hit one of its declared **reach cells** (:data:`CATALOGUE`, feature cells of
   :func:`cases.coverage.features`), fastest first (clean duration), until the first case that fails or errors —
   the mutant is **killed** there (``--keep-going`` runs every reaching case);
3. ``<out>/mutants.jsonl`` (``reports/mutants.py``): per kill one row per failing tensor of the killing case
   ``{mutant, status: "killed", case_id, tensor, check}`` (``check`` = the verdict rule: ``structure``,
   ``noise_floor``, ``similarity``, ``aggregate``, ``tie_margin``, or ``error`` for an exception, tensor
   ``(exception)``); otherwise one row ``{mutant, status, null, null, null}``.

A mutant is **survived** when some case executed its mutation point (``fused.mutants.reached``) and no case failed;
**unreachable** when no case of the selection hits a declared cell (the missing cells are printed) or none of the
cases that do executed the point. Exit 0 iff the clean run passed and every mutant was killed; the last line reads
``mutants: K/N killed``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from cases.case import Case
from cases.coverage import Cell, cell_name, features, hits, parse_cell
from cases.errors import CaseError

DEFAULT_OUT = Path("reports") / "out" / "mutants"
MUTANTS_NAME = "mutants.jsonl"
ANY = ("",)  # reach cells of a mutant every case executes

DESCRIPTION = """\
Mutation suite: switch on each planted bug of fused.mutants in turn and run the suite (fused, --provider, against
the reference, in-process). A mutant is killed by the first case that passed clean and now fails or errors;
survived if its mutation point ran and nothing failed; unreachable if no case hits one of its reach cells
(`--list` shows them; the missing cell is printed). Writes <out>/results.jsonl (the clean run) and
<out>/mutants.jsonl (the kill matrix of `dsv4-parity report <out>`). Exit 0 iff the clean run passed and every
mutant was killed; the last line reads `mutants: K/N killed`.
"""

#: mutant -> the feature cells of the cases that can reach (and expose) it; "" = any case. The first entry is the
#: cell named when a suite misses them all.
CATALOGUE: dict[str, tuple[str, ...]] = {
    # 1. THD dense-loss backward without max_seqlen_q/k (the kernel contract refuses it)
    "thd_dense_bwd_no_max_seqlen": ("layout=thd loss=dense",),
    # 2. batch collapsed with a view instead of a permute (right only for one sequence)
    "view_over_batch": ("layout=bshd loss=sparse sequences=2-3", "layout=bshd loss=sparse sequences=4+",
                        "layout=bshd loss=dense sequences=2-3", "layout=bshd loss=dense sequences=4+"),
    # 3. capacity-padding compressed rows out of bounds / onto a valid row
    "invalid_comp_rows_oob": ("layout=thd capacity=over", "layout=thd capacity=production"),
    "invalid_comp_rows_onto_valid": ("layout=thd capacity=over", "layout=thd capacity=production"),
    # 4. real instead of padded boundaries in one stage (the attention compressor)
    "compressor_real_offsets": ("alignment_padding=true ratio=4", "alignment_padding=true ratio=128"),
    # 5. RoPE positions global across the pack (invisible to window keys: RoPE is relative; compressed keys see it)
    "global_rope_positions": ("layout=thd ratio=4 sequences=2-3", "layout=thd ratio=4 sequences=4+",
                              "layout=thd ratio=128 sequences=2-3", "layout=thd ratio=128 sequences=4+"),
    # 6. compressed causal rule off by one
    "compressed_causal_off_by_one": ("ratio=4", "ratio=128"),
    # 7. r=4 overlap reaching into the previous segment
    "overlap_crosses_segments": ("layout=thd ratio=4 sequences=2-3", "layout=thd ratio=4 sequences=4+"),
    # 8. sink dropped from the forward softmax / from the teacher denominator
    "sink_dropped_forward": ANY,
    "sink_dropped_teacher": ("loss=sparse", "loss=dense"),
    # 9. teacher normalised over the compressed set only
    "teacher_compressed_only": ("loss=sparse", "loss=dense"),
    # 10. -1 top-k slots used as index 0 in the backward
    "minus_one_as_zero_bwd": ANY,
    # 11. padding-row gradients not zeroed (slack rows alone see no key: they cannot show it)
    "padding_grads_not_zeroed": ("alignment_padding=true", "dummy_tail=true"),
    # 12. mean loss over all physical rows
    "loss_over_physical_rows": ("layout=thd reduction=mean alignment_padding=true",
                                "layout=thd reduction=mean dummy_tail=true", "layout=thd reduction=mean slack=true"),
    # 13. top-k width K instead of min(K, n_comp) for short sequences
    "topk_width_k_short": ("ratio=4 dense_mode=false topk_saturated=false",),
    # 14. the indexer-loss gradient leaking into the attention branch
    "indexer_grad_leaks": ("loss=sparse", "loss=dense"),
    # 15. the sparse KL over the full top-k width, -1 slots included
    "kl_full_width_nan": ("loss=sparse",),
}


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


# ---- catalogue ----------------------------------------------------------------------------------------------------
def reach_cells(name: str) -> list[Optional[Cell]]:
    """Parsed reach cells of mutant ``name`` (``None`` = any case); unknown mutants reach any case."""
    return [parse_cell(text) if text else None for text in CATALOGUE.get(name, ANY)]


def reaches(feats: dict, cells: Sequence[Optional[Cell]]) -> bool:
    return any(cell is None or hits(feats, cell) for cell in cells)


def catalogue_problems(registered: Sequence[str]) -> list[str]:
    """Registered mutants without declared cells, and declared names nobody registered."""
    out = [f"mutant {n!r} has no reach cells in parity.mutants_cmd.CATALOGUE (treated as reachable by any case)"
           for n in registered if n not in CATALOGUE]
    out += [f"CATALOGUE names {n!r}, which fused.mutants does not register" for n in CATALOGUE if n not in registered]
    return out


# ---- running ------------------------------------------------------------------------------------------------------
def kills_of(result) -> list[Kill]:
    """The failing checks of a failed / errored :class:`parity.results.CaseResult`, first failure first."""
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
    from fused import mutants

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
    cells = [c for c in CATALOGUE.get(o.name, ANY) if c]
    if o.reaching == 0 and cells and len(o.missing) == len(cells):
        return f"{head} the suite lacks cell {o.missing[0]}" + \
            (f" (or any of: {'; '.join(o.missing[1:])})" if len(o.missing) > 1 else "")
    if o.reaching == 0:
        return f"{head} no case that hits its cells passes clean"
    return f"{head} {o.reaching} cases hit its cells but none executed the mutation point: fix its CATALOGUE cells"


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
                   echo: Callable[[str], None] = print) -> tuple[dict, list[MutantOutcome]]:
    """The clean run (``out_dir/results.jsonl``), then every mutant of ``names``; writes ``mutants.jsonl``.
    Returns ``(clean counts, outcomes)``."""
    from fused import mutants

    from . import policy as policy_mod
    from .engine import RunOptions, run_case
    from .runner import RunConfig, _impl, new_run_id, run

    if mutants.active():
        raise RuntimeError(f"mutants {sorted(mutants.active())} are active: the clean run would not be clean")
    (out_dir / MUTANTS_NAME).unlink(missing_ok=True)  # never leave a previous run's matrix next to this run
    options = RunOptions(impl="fused", against="reference", provider=provider, device=device,
                         policy_path=policy_path)
    config = RunConfig(suite=suite, options=options, out_dir=out_dir, isolate="none", quiet=quiet, argv=argv,
                       run_id=new_run_id(suite, "fused", "mutants"))
    counts, _ = run(cases, config)
    clean = clean_outcomes(out_dir / "results.jsonl")
    echo(f"clean: {sum(counts.values())} cases: {counts['pass']} passed, {counts['fail']} failed, "
         f"{counts['error']} errors, {counts['unsupported']} unsupported")
    policy = policy_mod.load(policy_path) if policy_path else policy_mod.default()
    impl, against = _impl("fused"), _impl("reference")
    outcomes = []
    for name in names:
        o = run_mutant(name, cases, clean, lambda case: run_case(case, impl, against, options, policy),
                       keep_going=keep_going)
        outcomes.append(o)
        echo(describe(o))
    write_rows(outcomes, out_dir / MUTANTS_NAME)
    return counts, outcomes


# ---- command ------------------------------------------------------------------------------------------------------
def _render_report(out_dir: Path) -> Optional[str]:
    """index.html of the run directory (kill matrix included), best effort; returns a note on failure."""
    try:
        render = importlib.import_module("reports.commands").render_run
        render(out_dir, quiet=True)
    except Exception as exc:  # noqa: BLE001 — the verdict does not depend on the report
        return f"note: report rendering failed: {exc}"
    return None


def cmd_mutants(args: argparse.Namespace) -> int:
    if getattr(args, "impl", "fused") == "megatron":  # real-code mutants: patches to a scratch copy of Megatron-LM
        from adapters.megatron.mutants import main

        return main(args)
    from fused import mutants

    from .cli import select_cases

    registered = list(mutants.registered())
    if args.list:
        for name in registered:
            cells = "; ".join(c or "any case" for c in CATALOGUE.get(name, ANY))
            print(f"{name:<30} {mutants.registered()[name]}\n{'':<30} reach: {cells}")
        return 0
    for problem in catalogue_problems(registered):
        print(f"warning: {problem}", file=sys.stderr)
    names = args.mutant or registered
    unknown = [n for n in names if n not in registered]
    if unknown:
        print(f"error: unknown mutant(s) {unknown} (known: {', '.join(registered)})", file=sys.stderr)
        return 2
    try:
        label, cases = select_cases(args)
    except CaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    start = time.perf_counter()
    counts, outcomes = mutation_suite(cases, names, out_dir, suite=label, provider=args.provider,
                                      device=args.device, policy_path=args.policy, keep_going=args.keep_going,
                                      quiet=args.quiet, argv=sys.argv,
                                      echo=lambda line: print(line, flush=True))
    if not args.no_report:
        note = _render_report(out_dir)
        if note:
            print(note, file=sys.stderr)
    killed = sum(o.status == "killed" for o in outcomes)
    clean_ok = not (counts["fail"] or counts["error"])
    print(f"results: {out_dir / 'results.jsonl'}, {out_dir / MUTANTS_NAME}  "
          f"({time.perf_counter() - start:.0f} s)")
    if not clean_ok:
        print(f"the clean run failed ({counts['fail']} failed, {counts['error']} errors): those cases kill nothing")
    print(f"mutants: {killed}/{len(outcomes)} killed")
    return 0 if clean_ok and killed == len(outcomes) else 1


def add_parsers(sub) -> dict:
    from .cli import PROVIDERS, _add_selection, add_megatron_argument

    p = sub.add_parser("mutants", help="mutation suite: every planted bug (fused.mutants) must fail the suite",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_selection(p)
    p.add_argument("--mutant", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    p.add_argument("--impl", default="fused", choices=("fused", "megatron"),
                   help="fused: the planted bugs of fused.mutants; megatron: patches to a scratch copy of "
                        "Megatron-LM run with --impl megatron (unfused and emulated providers)")
    add_megatron_argument(p)
    p.add_argument("--list", action="store_true", help="list the mutants and their reach cells, and exit")
    p.add_argument("--keep-going", action="store_true",
                   help="run every reaching case per mutant, not only up to the first kill (fuller kill matrix)")
    p.add_argument("--provider", default="torch", choices=PROVIDERS, help="fused kernel provider (default torch)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run")
    p.add_argument("--policy", help="tolerance policy JSON (default parity/policy.json)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help=f"run directory: results.jsonl of the clean run + {MUTANTS_NAME} (default {DEFAULT_OUT})")
    p.add_argument("--no-report", action="store_true", help="do not render index.html")
    p.add_argument("--quiet", action="store_true", help="no per-case lines during the clean run")
    p.set_defaults(func=cmd_mutants)
    return {"mutants": p}


__all__ = ["CATALOGUE", "MutantOutcome", "cmd_mutants", "mutation_suite", "run_mutant"]
