"""Coverage against a baseline: the part of the drift gate that fails a run for the work it did not do.

A run can pass every comparison it made and still have made far fewer than its baseline: cases declined as
``unsupported`` (a kernel bridge that refuses what production asks for), cases never started (``--budget-s``), a
results file cut in half. :func:`coverage_against` compares what the run compared with what the baseline compared;
the gate (:attr:`reports.drift.DriftResult.passed`) fails when any of these holds (:attr:`Coverage.lost`):

* a case the baseline **ran** (outcome ``pass`` / ``known`` / ``fail``) is now ``unsupported``, or absent from the run;
* a tensor the baseline compared (a row with a verdict) is missing from a case still in the run (an ``error``, a
  case cut off mid-write, an implementation that stopped providing it);
* a tensor the baseline has the gate **metric** for (``noise_floor_ratio``: the value the drift rule compares) lacks it
  in the run, though the tensor is there (its metric rows cut off, or no longer written): drift could not judge it;
* an unsupported **reason** appears that the baseline did not have (:func:`reason_key`: the one-line message with
  standalone integers as ``N``, so ``indexer_topk=512`` and ``indexer_topk=1024`` are one reason);
* the run itself is **incomplete** (:attr:`Coverage.incomplete`, from :func:`reports.load.RunData.incompleteness`): no
  ``end`` row (killed, cut, still running), cases ``--budget-s`` left unstarted, or cases cut off mid-write;
* the run did **other work** than its baseline (:attr:`Coverage.other_work`, :func:`other_work`): another
  implementation or oracle, another declared provider, or kernels the baseline's cases ran (``env.json``
  ``kernels``: ``stage:provider`` -> cases) that none of the run's cases ran. The case a gate must not pass: a GPU
  runner whose kernel packages do not import, where ``--provider auto`` falls back to the torch provider and every
  comparison still holds against the baseline that ran cuDNN and FlashMLA.

Cases and tensors only the run has are never gated (suites grow). An intentional loss of coverage is accepted only by
retaking the baseline (``dsv4-parity compare RUN --update``).

A baseline records its reasons with their counts in ``env.json`` (``unsupported_reasons``, written by
:func:`reports.baselines.provenance`). A baseline recorded before that has none: its reasons are then inferred as
those of the cases unsupported in both runs (:attr:`Coverage.reasons_recorded` False; the views say so), so a reason
of a case the baseline ran, or of a new case, still counts as new.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import pandas as pd

RAN = ("pass", "known", "fail")
REASON_CHARS = 200
SHOWN_CHARS = 110
EXAMPLES = 3
_INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")


def reason_key(message: Any) -> str:
    """The unsupported reason of a case message: one line, standalone integers as ``N``, at most
    :data:`REASON_CHARS` characters (``BridgeRefused: flash_mla_sparse_fwd(indexer_topk=N): …``)."""
    text = " ".join(str(message or "").split()) or "(no reason given)"
    text = _INTEGER.sub("N", text)
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"


def shown(reason: str, width: int = SHOWN_CHARS) -> str:
    """A reason clipped for a summary line."""
    return reason if len(reason) <= width else reason[:width - 1] + "…"


def case_reasons(cases: pd.DataFrame) -> dict[str, str]:
    """``{case_id: reason_key(message)}`` of the unsupported cases of a case frame (:mod:`reports.load`)."""
    if cases.empty or "message" not in cases:
        return {}
    rows = cases.loc[cases["outcome"] == "unsupported"]
    return {str(c): reason_key(m) for c, m in zip(rows["case_id"], rows["message"])}


def reason_counts(cases: pd.DataFrame) -> dict[str, int]:
    """``{reason: cases}`` of a case frame, most frequent first (what a baseline's ``env.json`` records)."""
    counts = pd.Series(list(case_reasons(cases).values()), dtype=object).value_counts()
    return {str(k): int(v) for k, v in counts.items()}


def _per_case(table: pd.DataFrame) -> pd.Series:
    if table.empty:
        return pd.Series(dtype=object)
    return table.drop_duplicates("case_id").set_index("case_id")["outcome"].astype(str)


def _compared(table: pd.DataFrame) -> pd.DataFrame:
    """The (case, tensor) rows a run compared: a tensor name and a verdict."""
    rows = table.loc[(table["tensor"].astype(str) != "") & table["verdict"].notna(), ["case_id", "tensor"]]
    return rows.drop_duplicates()


@dataclass
class Coverage:
    """What the run compared against what the baseline compared (module docstring).

    ``now_unsupported``: case_id, baseline (its outcome there), reason. ``absent``: ids of cases the baseline ran
    that the run lacks. ``missing_tensors``: case_id, tensor — compared in the baseline, missing from a case still in
    the run (``errored``: how many of those cases now error). ``missing_metric``: case_id, tensor — still compared, but
    without the gate metric the baseline has for it. ``reasons``: reason, cases (in the run), baseline (cases there;
    None when not recorded), new. ``incomplete``: one phrase per way the run itself is unfinished."""

    baseline_ran: int
    compared: int
    baseline_tensors: int
    tensors: int
    now_unsupported: pd.DataFrame
    absent: list[str]
    missing_tensors: pd.DataFrame
    reasons: pd.DataFrame
    reasons_recorded: bool
    baseline_unsupported: int = 0
    errored: int = 0
    notes: list[str] = field(default_factory=list)
    missing_metric: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["case_id", "tensor"]))
    metric: str = ""
    incomplete: list[str] = field(default_factory=list)
    other_work: list[str] = field(default_factory=list)

    @property
    def new_reasons(self) -> list[str]:
        return self.reasons.loc[self.reasons["new"], "reason"].tolist()

    @property
    def lost(self) -> bool:
        return bool(len(self.now_unsupported) or self.absent or len(self.missing_tensors) or self.new_reasons
                    or len(self.missing_metric) or self.incomplete or self.other_work)

    def problems(self) -> list[str]:
        """One plain sentence per way coverage was lost (empty when none was)."""
        found = [f"the run did other work than its baseline: {why}" for why in self.other_work]
        found += [f"the run is incomplete: {why}" for why in self.incomplete]
        if len(self.now_unsupported):
            by_reason = self.now_unsupported["reason"].value_counts()
            listed = "; ".join(f"{shown(str(r))} ({n})" for r, n in by_reason.items())
            found.append(f"{len(self.now_unsupported)} case(s) the baseline ran now unsupported: {listed}")
        if self.absent:
            found.append(f"{len(self.absent)} of the baseline's {self.baseline_ran} run cases absent from the run "
                         f"(not run or cut off), e.g. {', '.join(self.absent[:EXAMPLES])}")
        if len(self.missing_tensors):
            cases = self.missing_tensors["case_id"].nunique()
            examples = ", ".join(f"{c}/{t}" for c, t in self.missing_tensors.head(EXAMPLES).itertuples(index=False))
            errored = f" ({self.errored} of them now error)" if self.errored else ""
            found.append(f"{len(self.missing_tensors)} tensor(s) compared in the baseline missing from {cases} case(s) "
                         f"still in the run{errored}, e.g. {examples}")
        if len(self.missing_metric):
            cases = self.missing_metric["case_id"].nunique()
            examples = ", ".join(f"{c}/{t}" for c, t in self.missing_metric.head(EXAMPLES).itertuples(index=False))
            found.append(f"{len(self.missing_metric)} tensor(s) in {cases} case(s) lack the gate metric {self.metric} "
                         f"that the baseline has (metric rows cut off or no longer written; drift cannot judge "
                         f"them), e.g. {examples}")
        for row in self.reasons.loc[self.reasons["new"]].itertuples(index=False):
            found.append(f"new unsupported reason ({row.cases} case(s)): {shown(str(row.reason))}")
        return found

    def headline(self) -> str:
        """``coverage lost: <the first problem>`` (and how many more), or ``coverage: equal to the baseline``."""
        problems = self.problems()
        if not problems:
            return "coverage: equal to the baseline" + ("" if not self.notes else f" ({'; '.join(self.notes)})")
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return f"coverage lost: {problems[0]}{more}"

    def line(self) -> str:
        """What was compared, against the baseline: cases, tensors and the unsupported reasons with both counts."""
        text = (f"{self.compared} of the baseline's {self.baseline_ran} run cases compared, {self.tensors} of its "
                f"{self.baseline_tensors} tensors")
        return f"{text}; unsupported: {self.reasons_text()}"

    def reasons_text(self) -> str:
        if self.reasons.empty:
            return "none (baseline: none)"
        parts = []
        for row in self.reasons.itertuples(index=False):
            base = "?" if row.baseline is None or pd.isna(row.baseline) else str(int(row.baseline))
            parts.append(f"{int(row.cases)} {shown(str(row.reason), 80)} (baseline {base}{', NEW' if row.new else ''})")
        text = "; ".join(parts)
        if not self.reasons_recorded:
            text += (f" [the baseline records no reasons ({self.baseline_unsupported} unsupported case(s)): inferred "
                     f"from the cases unsupported in both; retake it to record them]")
        return text


def coverage_against(current: pd.DataFrame, baseline: pd.DataFrame, *, reasons: Mapping[str, str] | None = None,
                     baseline_reasons: Mapping[str, int] | None = None, metric: str | None = None,
                     incomplete: list[str] | None = None, other: list[str] | None = None) -> Coverage:
    """Coverage of ``current`` against ``baseline`` (metrics tables, :mod:`reports.table`).

    ``reasons``: ``{case_id: reason}`` of the run's unsupported cases (:func:`case_reasons`; None: every such case
    reads ``(reason not given)``). ``baseline_reasons``: ``{reason: cases}`` from the baseline's ``env.json``; None
    when it records none (then inferred, module docstring). ``metric``: the drift gate's metric (its values are
    gated like the tensors; None: not checked). ``incomplete``: how the run itself is unfinished (lost coverage);
    ``other``: how it did other work than the baseline (:func:`other_work`)."""
    cur_outcome, base_outcome = _per_case(current), _per_case(baseline)
    ran = base_outcome[base_outcome.isin(RAN)]
    now = cur_outcome.reindex(ran.index)
    unsupported_ids = now.index[now == "unsupported"].tolist()
    absent = now.index[now.isna()].tolist()
    reasons = dict(reasons or {})
    cur_unsupported = cur_outcome.index[cur_outcome == "unsupported"]
    reason_of = {str(c): reasons.get(str(c), "(reason not given)") for c in cur_unsupported}
    now_unsupported = pd.DataFrame({"case_id": unsupported_ids,
                                    "baseline": [ran[c] for c in unsupported_ids],
                                    "reason": [reason_of[str(c)] for c in unsupported_ids]},
                                   columns=["case_id", "baseline", "reason"])

    base_rows, cur_rows = _compared(baseline), _compared(current)
    lost_cases = set(unsupported_ids) | set(absent)
    merged = base_rows.merge(cur_rows, on=["case_id", "tensor"], how="left", indicator=True)
    gone = merged.loc[merged["_merge"] == "left_only", ["case_id", "tensor"]]
    missing = gone.loc[~gone["case_id"].isin(lost_cases)].reset_index(drop=True)
    missing_metric = _missing_metric(current, baseline, metric) if metric else pd.DataFrame(
        columns=["case_id", "tensor"])

    base_unsupported = base_outcome.index[base_outcome == "unsupported"]
    if baseline_reasons is not None:
        known = {str(k): int(v) for k, v in baseline_reasons.items()}
        recorded = True
    else:  # inferred: the reasons of the cases unsupported in both
        both = [str(c) for c in base_unsupported if str(c) in reason_of]
        known = pd.Series([reason_of[c] for c in both], dtype=object).value_counts().to_dict()
        recorded = False
    counts = pd.Series(list(reason_of.values()), dtype=object).value_counts()
    names = list(counts.index) + [r for r in known if r not in counts.index]
    table = pd.DataFrame({"reason": names,
                          "cases": [int(counts.get(r, 0)) for r in names],
                          "baseline": [known.get(r, 0) if recorded else known.get(r) for r in names],
                          "new": [r not in known for r in names]},
                         columns=["reason", "cases", "baseline", "new"])
    table["new"] = table["new"].astype(bool)
    return Coverage(baseline_ran=len(ran), compared=int(now.isin(RAN).sum()),
                    baseline_tensors=len(base_rows), tensors=len(base_rows) - len(gone),
                    now_unsupported=now_unsupported, absent=[str(c) for c in absent], missing_tensors=missing,
                    reasons=table, reasons_recorded=recorded, baseline_unsupported=len(base_unsupported),
                    errored=int((cur_outcome.reindex(missing["case_id"].unique()) == "error").sum()),
                    missing_metric=missing_metric, metric=metric or "", incomplete=list(incomplete or []),
                    other_work=list(other or []))


def _missing_metric(current: pd.DataFrame, baseline: pd.DataFrame, metric: str) -> pd.DataFrame:
    """``case_id, tensor`` compared in both runs (a verdict in each) whose ``metric`` the baseline has and the run
    lacks (a tensor missing from the run altogether is :attr:`Coverage.missing_tensors`' to report)."""
    if metric not in baseline.columns:
        return pd.DataFrame(columns=["case_id", "tensor"])
    base = _compared(baseline.loc[baseline[metric].notna()])
    cur = current.loc[(current["tensor"].astype(str) != "") & current["verdict"].notna()]
    has = cur.loc[cur[metric].notna()] if metric in cur.columns else cur.iloc[0:0]
    both = base.merge(_compared(cur), on=["case_id", "tensor"])
    lacking = both.merge(has[["case_id", "tensor"]].drop_duplicates(), on=["case_id", "tensor"], how="left",
                         indicator=True)
    return lacking.loc[lacking["_merge"] == "left_only", ["case_id", "tensor"]].reset_index(drop=True)


def kernel_counts(plans: Iterable[Any]) -> dict[str, int]:
    """``{"stage:provider": cases}`` from the cases' ``plan`` dicts (``{stage: provider}``, one per case): which
    kernel providers each stage ran, counted over the cases (what a baseline's ``env.json`` records as ``kernels``).
    A stage that ran several (``cudnn+torch``: a kernel and its fallback on some calls) counts for each."""
    counts: dict[str, int] = {}
    for plan in plans:
        for stage, providers in (plan if isinstance(plan, dict) else {}).items():
            for provider in sorted(set(str(providers).split("+"))):
                key = f"{stage}:{provider}"
                counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _count(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def stated_provider(row: Mapping[str, Any]) -> Any:
    """The provider a run row (or a baseline's ``env.json``) names: its implementation's resolved one
    (``impl_info.provider``), else the option given (``auto`` included), else None."""
    info = row.get("impl_info") if isinstance(row.get("impl_info"), dict) else {}
    return info.get("provider") or row.get("provider")


def declared_provider(row: Mapping[str, Any]) -> str | None:
    """:func:`stated_provider`, None for ``auto`` or none (resolved per machine)."""
    provider = stated_provider(row)
    return None if provider in (None, "", "auto") else str(provider)


def other_work(run: Mapping[str, Any], kernels: Mapping[str, int], baseline_env: Mapping[str, Any]) -> list[str]:
    """One phrase per way the run (its row ``run`` and its :func:`kernel_counts`) did other work than the baseline
    (its ``env.json``): another ``impl`` or ``against``; another declared provider; a kernel (``stage:provider``,
    the torch provider aside) that ran in the baseline's cases and in none of the run's. A baseline that records no
    ``kernels`` (taken before they were recorded) is checked by its declared provider: a run that declares none and
    whose cases ran only the torch provider did not run it."""
    found = []
    for key in ("impl", "against"):
        theirs, ours = baseline_env.get(key), run.get(key)
        if theirs and ours and theirs != ours:
            found.append(f"{key} {ours!r}, the baseline's {theirs!r}")
    theirs, ours = declared_provider(baseline_env), declared_provider(run)
    if theirs and ours and theirs != ours:
        found.append(f"provider {ours!r}, the baseline's {theirs!r}")
    recorded = baseline_env.get("kernels")
    if isinstance(recorded, dict):
        gone = {str(k): _count(n) for k, n in recorded.items()
                if _count(n) > 0 and str(k).partition(":")[2] != "torch" and not kernels.get(str(k))}
        if gone:
            listed = ", ".join(f"{k} ({n} case(s))" for k, n in list(gone.items())[:EXAMPLES])
            more = f" and {len(gone) - EXAMPLES} more" if len(gone) > EXAMPLES else ""
            found.append(f"{len(gone)} kernel(s) the baseline's cases ran ran in none of its cases: {listed}{more}")
    elif theirs and theirs != "torch" and ours is None:
        ran = {k.partition(":")[2] for k in kernels}
        if ran <= {"torch"}:
            what = f"all {sum(kernels.values())} of its kernel stages ran the torch provider" if ran else \
                "its cases record no kernel provider"
            found.append(f"provider auto: {what}, the baseline ran provider {theirs!r}")
    return found
