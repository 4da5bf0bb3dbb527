"""``--resume`` continues exactly the run recorded in ``<out>/results.jsonl``.

The ``run`` row records what a run is: its case selection (``selection``: the suite label, and for an ad-hoc
selection the case objects themselves; ``planned``: the ids of every selected case, in order), ``options`` (impl,
against, provider, device, require, policy) and, for a metamorphic run, ``against: "oracle:NAME"``. A resume takes
all of these from the row (and, for ``--impl megatron``, the Megatron-LM tree it tested: ``impl_info``), so
``dsv4-parity run --out DIR --resume`` works as printed. An option given on the resume
command line that differs from the recorded one is a usage error (a resume that quietly ran other cases, or another
implementation, would label one run's results with another's name); options that do not change results
(``--workers``, ``--isolate``, ``--timeout``, ``--budget-s``, ``--junit``, ``--quiet``) may differ.

``--threads`` is the one in between: on a CPU the intra-op thread count sets the summation order of parallel
reductions, so it changes a result's last bits (never its meaning). A resume re-applies the recorded count, so the
resumed run equals an uninterrupted one bit for bit (README, "Reproducibility"); an explicit different
``--threads`` is allowed and says on stderr that the cases it runs may differ from the recorded ones in the last
bits.

Which options a command line set explicitly (argparse fills in defaults otherwise) is ``cli.options.given_options``;
a directory with no recorded run cannot be resumed (the command line refuses it: :func:`recorded_run` is None).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

from cases.case import Case
from cases.errors import CaseError
from cases.suites import load_suite

#: command-line dest -> key of the run row's ``options``
RECORDED_OPTIONS = {"impl": "impl", "against": "against", "provider": "provider", "device": "device",
                    "require": "require", "policy": "policy_path", "cp": "cp"}
SELECTION_OPTIONS = ("suite", "case", "case_id", "limit")


def recorded_run(out_dir: Path) -> Optional[dict]:
    """The ``run`` row of ``out_dir/results.jsonl`` (None without a readable one)."""
    path = Path(out_dir) / "results.jsonl"
    try:
        with path.open("rb") as handle:
            first = handle.readline()
    except OSError:
        return None
    try:
        row = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) and row.get("type") == "run" else None


def _same(dest: str, given, recorded) -> bool:
    if dest == "policy" and given and recorded:
        return Path(given).resolve() == Path(recorded).resolve()
    return given == recorded


def _conflict(option: str, given, recorded, out_dir: Path) -> CaseError:
    return CaseError(option, f"conflicts with the run being resumed ({out_dir}), which recorded {recorded!r}, "
                             f"not {given!r}; a resume continues the recorded run: drop {option}, or start a new "
                             "run in another --out")


def recorded_oracle(run_row: dict) -> Optional[str]:
    against = str(run_row.get("against") or "")
    return against.split(":", 1)[1] if against.startswith("oracle:") else None


def apply_recorded_options(args: argparse.Namespace, given: Iterable[str], run_row: dict, out_dir: Path) -> None:
    """Set ``args``' result-changing options to the recorded ones; a conflicting explicit option raises."""
    given = set(given)
    options = run_row.get("options") if isinstance(run_row.get("options"), dict) else {}
    for dest, key in RECORDED_OPTIONS.items():
        if key not in options:
            continue
        if dest in given and not _same(dest, getattr(args, dest, None), options[key]):
            raise _conflict(f"--{dest}", getattr(args, dest, None), options[key], out_dir)
        setattr(args, dest, options[key])
    _apply_recorded_threads(args, given, run_row)
    _apply_recorded_tree(args, given, run_row, out_dir)


#: the ``impl_info`` origins of a tree the user named (``--megatron PATH``, ``DSV4_MEGATRON``); the pinned snapshot
#: is found again by default
NAMED_TREE_ORIGINS = ("--megatron", "DSV4_MEGATRON")


def _apply_recorded_tree(args: argparse.Namespace, given: set, run_row: dict, out_dir: Path) -> None:
    """The Megatron-LM tree under test is part of the run: a resume runs the recorded one (``impl_info``'s
    ``megatron_root``, when the user had named it), never whatever ``DSV4_MEGATRON`` says now. A different explicit
    ``--megatron`` conflicts; a recorded tree that is gone is a usage error naming its revision."""
    info = run_row.get("impl_info") if isinstance(run_row.get("impl_info"), dict) else {}
    root, origin = info.get("megatron_root"), info.get("megatron_origin")
    if not isinstance(root, str) or origin not in NAMED_TREE_ORIGINS:
        return
    if "megatron" in given and getattr(args, "megatron", None):
        if Path(args.megatron).expanduser().resolve() != Path(root).resolve():
            raise _conflict("--megatron", args.megatron, root, out_dir)
        return
    if not Path(root).is_dir():
        raise CaseError("--megatron", f"the run being resumed ({out_dir}) tested Megatron-LM at {root} (revision "
                                      f"{info.get('revision')}), which no longer exists: pass --megatron PATH, a "
                                      "tree of that revision there, or start a new run")
    args.megatron = root
    os.environ["DSV4_MEGATRON"] = root  # the workers' tree (cli.main restores the variable when the command ends)
    os.environ["DSV4_MEGATRON_ORIGIN"] = str(origin)


def _apply_recorded_threads(args: argparse.Namespace, given: set, run_row: dict) -> None:
    """``--threads``: the recorded count unless given; a different explicit count is allowed, with a note."""
    recorded = run_row.get("threads")
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 1:
        return  # a run recorded before thread counts were always explicit: each process's own default
    if "threads" not in given or getattr(args, "threads", None) is None:
        args.threads = recorded
    elif args.threads != recorded:
        print(f"note: --threads {args.threads} differs from the {recorded} intra-op thread(s) the run recorded: "
              "on a CPU the cases run now may differ from the recorded ones in the last bits (README, "
              "\"Reproducibility\")", file=sys.stderr)


def check_oracle(oracle: Optional[str], given: Iterable[str], run_row: dict, out_dir: Path) -> Optional[str]:
    """The oracle of the resumed run (a different explicit ``--oracle`` raises)."""
    recorded = recorded_oracle(run_row)
    if "oracle" in set(given) and oracle != recorded:
        raise _conflict("--oracle", oracle, recorded, out_dir)
    return recorded


def recorded_cases(run_row: dict, out_dir: Path) -> tuple[str, list[Case]]:
    """``(suite label, cases)`` of the recorded selection, in the recorded order."""
    selection = run_row.get("selection")
    planned = run_row.get("planned")
    if not isinstance(selection, dict) or not isinstance(planned, list):
        raise CaseError("resume", f"the run in {out_dir} predates recorded selections; repeat its selection "
                                  "(--suite / --case-id / --case / --limit) and options, or start a new run")
    label = str(selection.get("label") or run_row.get("suite") or "adhoc")
    if isinstance(selection.get("cases"), list):
        cases = [Case.from_dict(c) for c in selection["cases"]]
    else:
        by_id = {c.id: c for c in load_suite(label)}
        missing = [cid for cid in planned if cid not in by_id]
        if missing:
            raise CaseError("resume", f"{len(missing)} recorded case(s) are no longer in suite {label!r} (e.g. "
                                      f"{missing[0]}; regenerated?): this run cannot be continued")
        cases = [by_id[cid] for cid in planned]
    return label, cases


def check_selection(given: Iterable[str], chosen: Sequence[Case], run_row: dict, out_dir: Path) -> None:
    """An explicit selection on a resume must pick exactly the recorded cases."""
    named = sorted(set(given) & set(SELECTION_OPTIONS))
    if named and [c.id for c in chosen] != list(run_row.get("planned") or []):
        raise CaseError("--" + named[0].replace("_", "-"),
                        f"selects other cases than the run being resumed ({out_dir}: "
                        f"{len(run_row.get('planned') or [])} cases of {run_row.get('suite')!r}); a resume "
                        "continues the recorded run: drop the selection, or start a new run in another --out")
