"""Markdown summary of one run, sized for a CI job summary (``$GITHUB_STEP_SUMMARY``) or a PR comment.

``dsv4-parity report RUN --format markdown`` prints it. Plain CommonMark + pipe tables (GitHub-flavoured); it reads
as well in a terminal, a wiki or a merge-request note. Sections, in order:

1. **Verdict** — one line: ``PASS`` or ``FAIL`` with the reasons (cases failed / errored, run incomplete, drift
   regression or new failures), then the run's identity (suite, implementations, provider, GPU, torch, git).
2. **Outcomes** — cases per outcome: the four of ``cases.vocabulary.OUTCOMES`` always, then any other outcome the
   case rows carry (e.g. ``known``, a registered known deviation) with its count; an unknown outcome is counted,
   never fatal. A run stopped by ``--budget-s`` says how many cases it did not start.
3. **Drift** (with a baseline) — per tensor class: pairs, median / p90 / max of the current/baseline ratios, the
   gated statistic against its factor, status; the gate's verdict, and the first :data:`NEW_FAILURES_SHOWN` new
   failures.
4. **Top offenders** — failing cases first, then errors, then the passing cases closest to a threshold (the order of
   :func:`reports.summary.offenders`), one table row each, then their one-line repros in one code block.
5. **Providers and stand-ins** — cases per (stage, provider) from the case rows' ``plan``, and the stand-ins the run
   row lists (``stand_ins``: a list of names or a ``{name: why}`` object, at the top of the run row, in its
   ``env`` or in its ``options``).

**Truncation rule** (the output never exceeds ``limit`` bytes of UTF-8, :data:`MAX_BYTES` = 64 KiB by default —
GitHub's limit for a PR comment is 65,536 characters, and a byte count bounds the characters):

* cell text is clipped to :data:`CELL_CHARS` characters and a repro longer than :data:`REPRO_CHARS` is replaced by
  its short form ``dsv4-parity run --suite SUITE --case-id ID`` (the full one is in ``results.jsonl``);
* if the text is still too long, offenders are dropped from the bottom of the list (with their repros) and a line
  says how many were left out;
* if even no offender fits, the text is cut at the last line that fits and a closing line says so.

Numbers use :func:`reports.terminal.fmt` (the terminal's format), so the two views agree.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import pandas as pd

from cases.vocabulary import OUTCOMES, outcome_counts as vocabulary_counts

from .drift import DriftResult
from .load import RunData
from .summary import offenders, plan_counts
from .terminal import fmt, ratio_text

MAX_BYTES = 64 * 1024
CELL_CHARS = 120
REPRO_CHARS = 2000
NEW_FAILURES_SHOWN = 20
WARNINGS_SHOWN = 5
CUT_NOTE = "\n\n_Summary cut at {limit} bytes; the full report is index.html / results.csv of this run._\n"


def render_markdown(data: RunData, table: pd.DataFrame, *, drift: DriftResult | None = None,
                    baseline_name: str | None = None, top: int = 10, limit: int | None = MAX_BYTES) -> str:
    """The markdown summary of ``data`` (its metrics ``table`` from :func:`reports.table.metrics_table`).

    ``limit``: the size cap in bytes (UTF-8), applied by the truncation rule of the module docstring; None turns
    truncation off (a test's negative control)."""
    head = "\n\n".join(part for part in (_verdict(data, drift), _outcomes(data), _warnings(data)) if part)
    drift_part = _drift(drift, baseline_name) if drift is not None else ""
    tail = _providers(data)
    worst = offenders(data, table, max(top, 0))
    suite = str(data.run.get("suite") or "SUITE")

    def compose(shown: int) -> str:
        parts = [head, drift_part, _offenders(worst.head(shown), omitted=len(worst) - shown, limit=limit, suite=suite),
                 tail]
        return "\n\n".join(part for part in parts if part) + "\n"

    if limit is None:
        return compose(len(worst))
    low, high = 0, len(worst)  # the most offenders that fit: size grows with the count, so bisect it
    while low < high:
        mid = (low + high + 1) // 2
        if _size(compose(mid)) <= limit:
            low = mid
        else:
            high = mid - 1
    return _cut(compose(low), limit)


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _cut(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` bytes, else its longest prefix of whole lines that fits with the note."""
    if _size(text) <= limit:
        return text
    note = CUT_NOTE.format(limit=limit)
    budget = limit - _size(note)
    kept: list[str] = []
    used = 0
    for line in text.splitlines(keepends=True):
        used += _size(line)
        if used > budget:
            break
        kept.append(line)
    body = "".join(kept).rstrip("\n")
    if body.count("```") % 2:  # never leave a code block open
        body += "\n```"
    return body + note


def _cell(value: Any, width: int = CELL_CHARS) -> str:
    """One table cell: text on one line, pipes escaped, clipped to ``width`` characters."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = " ".join(str(value).split())
    if len(text) > width:
        text = text[:width - 1] + "…"
    return text.replace("|", "\\|") or "-"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[str] = ()) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if name in right else "---" for name in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def outcome_counts(data: RunData) -> dict[str, int]:
    """Cases per outcome as every other view counts them (:func:`cases.vocabulary.outcome_counts`: zeros kept but for
    ``known``), then any other outcome found, sorted."""
    found = data.cases["outcome"].astype(str).value_counts()
    counts = vocabulary_counts(found)
    counts.update({outcome: int(found[outcome]) for outcome in sorted(set(found.index) - set(OUTCOMES))})
    return counts


def _verdict(data: RunData, drift: DriftResult | None) -> str:
    counts = outcome_counts(data)
    reasons = [f"{counts[o]} {word}" for o, word in (("fail", "failed"), ("error", "errored")) if counts[o]]
    if not data.complete:
        reasons.append("incomplete")
    if drift is not None and drift.coverage.lost:
        reasons.append(_cell(drift.coverage.headline(), 300))
    if drift is not None and (drift.regressions or len(drift.new_failures) or drift.pairs.empty):
        reasons.append("drift regression")
    verdict = f"**FAIL** ({', '.join(reasons)})" if reasons else "**PASS**"
    run, env = data.run, data.env
    identity = [f"suite `{run.get('suite')}`", f"`{run.get('impl')}` vs `{run.get('against')}`",
                f"provider `{run.get('provider')}`", f"{len(data.cases)} cases"]
    duration = (data.end or {}).get("duration_s")
    if isinstance(duration, (int, float)):
        identity.append(f"{duration:.1f} s")
    identity += [f"{label} {_cell(env.get(key), 60)}" for key, label in
                 (("gpu", "GPU"), ("torch", "torch"), ("cuda", "CUDA"), ("git_rev", "git")) if env.get(key)]
    return f"## dsv4-parity: {verdict}\n\nrun `{_cell(data.run_id, 80)}`: " + " · ".join(identity)


def _outcomes(data: RunData) -> str:
    counts = outcome_counts(data)
    text = _table(["outcome", "cases"], ([_cell(o, 40), str(n)] for o, n in counts.items()), right=["cases"])
    end = data.end
    if end is None:
        text += "\n\n**Incomplete:** no `end` row (the run is still going, or died); counts are the cases so far."
    elif end.get("not_run"):
        not_run = end["not_run"]
        why = (f"the time budget ({fmt(float(end['budget_s']))} s) ran out"
               if isinstance(end.get("budget_s"), (int, float)) else "it stopped early")
        count = len(not_run) if isinstance(not_run, list) else not_run
        text += (f"\n\n**Incomplete:** {count} selected case(s) not run: {why}. Continue it with "
                 f"`dsv4-parity run --out RUN --resume`.")
    return text


def _warnings(data: RunData) -> str:
    if not data.warnings:
        return ""
    shown = [f"- {_cell(w, 200)}" for w in data.warnings[:WARNINGS_SHOWN]]
    if len(data.warnings) > WARNINGS_SHOWN:
        shown.append(f"- … and {len(data.warnings) - WARNINGS_SHOWN} more")
    return "Warnings:\n" + "\n".join(shown)


def _drift(drift: DriftResult, baseline_name: str | None) -> str:
    title = f"### Drift vs baseline `{baseline_name}`" if baseline_name else "### Drift vs baseline"
    parts = [title, f"Gate: {drift.config.describe()}."]
    if drift.classes.empty:
        parts.append("No matched (case, tensor) pairs.")
    else:
        rows = ([_cell(r.tensor_class, 40), str(r.pairs), ratio_text(r.median), ratio_text(r.p90),
                 ratio_text(r.max), ratio_text(r.statistic), f"{r.factor:g}x",
                 f"**{r.status}**" if r.status == "regression" else r.status]
                for r in drift.classes.itertuples(index=False))
        parts.append(_table(["class", "pairs", "median", "p90", "max", "statistic", "factor", "status"], rows,
                            right=["pairs", "median", "p90", "max", "statistic", "factor"]))
    parts.append(f"Matched pairs: {len(drift.pairs)}; only in this run: {drift.only_current}; only in the "
                 f"baseline: {drift.only_baseline}.")
    coverage = drift.coverage
    parts.append(f"Coverage: {_cell(coverage.line(), 2000)}.")
    if coverage.problems():
        parts.append("\n".join(f"- **coverage lost:** {_cell(p, 400)}" for p in coverage.problems()))
    reasons = drift.reasons()
    parts.append(f"**Drift gate: {'PASS' if drift.passed else 'FAIL'}**" + (f" — {_cell('; '.join(reasons), 600)}"
                                                                           if reasons else ""))
    if len(drift.new_failures):
        lines = [f"- `{_cell(r.case_id, 40)}` {_cell(r.tensor or '(case)', 80)}: {r.baseline} → {r.current}"
                 for r in drift.new_failures.head(NEW_FAILURES_SHOWN).itertuples(index=False)]
        if len(drift.new_failures) > NEW_FAILURES_SHOWN:
            lines.append(f"- … and {len(drift.new_failures) - NEW_FAILURES_SHOWN} more")
        parts.append("New failures (worse than in the baseline, or new and failing):\n" + "\n".join(lines))
    return "\n\n".join(parts)


def short_repro(repro: str, case_id: str, suite: str) -> str:
    """``repro`` when at most :data:`REPRO_CHARS` long, else the ``--case-id`` form (same case, from its suite)."""
    if len(repro) <= REPRO_CHARS:
        return repro
    return f"dsv4-parity run --suite {suite} --case-id {case_id}"


def _offenders(worst: pd.DataFrame, *, omitted: int, limit: int | None, suite: str) -> str:
    if worst.empty and not omitted:
        return ""
    parts = [f"### Top offenders ({len(worst)}: failing first, then errors, then closest to a threshold)"]
    if len(worst):
        rows = ([str(i), f"`{_cell(r.case_id, 40)}`", _cell(r.outcome, 20), _cell(r.tensor, 60),
                 _cell(r.worst_metric, 40), fmt(r.value), fmt(r.threshold), fmt(r.worst_usage), _cell(r.message)]
                for i, r in enumerate(worst.itertuples(index=False), 1))
        parts.append(_table(["#", "case", "outcome", "tensor", "metric", "value", "threshold", "usage", "message"],
                            rows, right=["#", "value", "threshold", "usage"]))
    repros = []
    for i, r in enumerate(worst.itertuples(index=False), 1):
        if isinstance(r.repro, str) and r.repro:
            repros.append(f"# {i} {r.case_id}\n{short_repro(r.repro.strip(), r.case_id, suite)}")
    if repros:
        parts.append("Repro, one line per offender:\n\n```sh\n" + "\n".join(repros) + "\n```")
    if omitted:
        parts.append(f"_{omitted} more offender(s) left out to keep this summary under {limit} bytes._")
    return "\n\n".join(parts)


def stand_ins(run: dict[str, Any]) -> list[str]:
    """The stand-ins a run row lists (``stand_ins`` at its top level, in ``env`` or in ``options``), as
    ``name`` or ``name: why`` strings."""
    found: list[str] = []
    for holder in (run, run.get("env"), run.get("options")):
        value = holder.get("stand_ins") if isinstance(holder, dict) else None
        if isinstance(value, dict):
            found += [f"{k}: {v}" if v else str(k) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            found += [str(v) for v in value]
        elif isinstance(value, str) and value:
            found.append(value)
    return list(dict.fromkeys(found))


def _providers(data: RunData) -> str:
    plans = plan_counts(data)
    used = stand_ins(data.run)
    if plans.empty and not used:
        return ""
    parts = ["### Providers and stand-ins"]
    if len(plans):
        parts.append(_table(["stage", "provider", "cases"],
                            ([_cell(r.stage, 40), _cell(r.provider, 40), str(r.cases)] for r in plans.itertuples()),
                            right=["cases"]))
    parts.append("Stand-ins: " + (", ".join(_cell(s, 200) for s in used) if used else "none listed by the run."))
    return "\n\n".join(parts)
