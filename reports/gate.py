"""A gate's verdict over its runs: every production path against its own baseline, reported side by side.

``dsv4-parity gate`` (``make parity``) runs one parity run per **path** — the implementation's production paths
(``--impl megatron``: its unfused path and its fused path; ``--impl fused``: the one provider) — plus any metamorphic
oracle runs, and ends with :func:`print_summary`: one row per run, the line naming what each compared (providers,
cases, unsupported reasons against the baseline's), why each failed, the gate's verdict, and the one report to open.

A path **passes** when its run ended complete with no ``fail`` / ``error`` case and its drift gate — coverage included
(:mod:`reports.coverage_gate`) — passed against its baseline (``auto``: :func:`reports.baselines.default_name` under
the run's arch). A path whose ``auto`` baseline is not committed **fails** (nothing checked its coverage): record one
from a trusted run (``dsv4-parity compare RUN --update``), or name ``--baseline none`` to gate on the run alone. An
oracle run has no baseline: it passes when complete without a ``fail`` / ``error`` case.

Layout (:data:`MANIFEST`): with one path, ``--out`` is that path's run directory (as a plain ``run``); with several,
``--out`` is a gate directory holding ``gate.json`` (the manifest: ``paths`` ``[{name, dir}]``, ``oracles``, the
``argv`` it was started with), ``index.html`` (the side-by-side page, linking each run's own report) and one run
directory per path (``unfused/``, ``emulated/`` ...). ``dsv4-parity report`` / ``compare`` accept a gate directory
too (:func:`read_manifest`).
"""

from __future__ import annotations

import datetime as _dt
import html as _html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .baselines import BASELINES_ROOT, arch_of, default_name, load_baseline
from .coverage_gate import stated_provider
from .errors import ReportError
from .load import RESULTS_NAME
from .render import Rendered, render_run
from .summary import plan_counts

MANIFEST = "gate.json"
INDEX = "index.html"
FAILING_SHOWN = 8
VERDICT_CHARS = 90


# ---- the manifest ------------------------------------------------------------------------------------------------
def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """The gate manifest of ``directory``, or None when it is not a gate directory."""
    path = Path(directory) / MANIFEST
    if not path.is_file() or (Path(directory) / RESULTS_NAME).is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(str(path), f"not a gate manifest: {exc}") from None
    if not isinstance(data, dict) or data.get("type") != "gate" or not isinstance(data.get("paths"), list):
        raise ReportError(str(path), "not a gate manifest (type 'gate' with a list of paths)")
    return data


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"type": "gate", **manifest}, indent=2) + "\n")
    tmp.replace(path)
    return path


def manifest_runs(directory: Path, manifest: Mapping[str, Any]) -> list[tuple[str, str, Path]]:
    """``(kind, name, run directory)`` of every run a manifest lists, paths first, then oracles."""
    runs = [("path", str(p["name"]), directory / str(p.get("dir") or p["name"])) for p in manifest["paths"]]
    runs += [("oracle", str(o["name"]), (directory / str(o["dir"])).resolve()) for o in manifest.get("oracles", [])]
    return runs


def parse_baselines(value: str | None, names: Sequence[str]) -> dict[str, str | None]:
    """``--baseline`` of a gate: ``auto`` / ``none`` for every path, a NAME for a gate of one path, or
    ``PATH=NAME[,PATH=NAME]`` (a path left out: auto). ``{path: name | 'auto' | None}``."""
    value = (value or "auto").strip()
    if value in ("auto", "none", ""):
        return {n: (None if value == "none" else "auto") for n in names}
    if "=" not in value:
        if len(names) != 1:
            raise ReportError("--baseline", f"this gate runs {len(names)} paths ({', '.join(names)}): name one "
                                            f"baseline per path, e.g. {names[0]}=NAME,{names[-1]}=NAME, or auto")
        return {names[0]: value}
    chosen: dict[str, str | None] = {n: "auto" for n in names}
    for item in value.split(","):
        path, _, name = item.partition("=")
        if path.strip() not in chosen or not name.strip():
            raise ReportError("--baseline", f"{item!r}: expected PATH=NAME with PATH one of {', '.join(names)}")
        chosen[path.strip()] = None if name.strip() == "none" else name.strip()
    return chosen


# ---- one run's verdict -------------------------------------------------------------------------------------------
@dataclass
class RunVerdict:
    """One run of a gate: ``kind`` path / oracle, its name, directory, what rendering it gave (None: no readable
    results), the baseline asked for and the one used, and why it failed (``reasons``, empty when it passed)."""

    kind: str
    name: str
    directory: Path
    rendered: Rendered | None
    asked: str | None
    baseline: str | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.reasons

    @property
    def report(self) -> Path:
        return self.directory / INDEX

    def counts(self) -> dict[str, int]:
        return self.rendered.data.counts if self.rendered else {}


def failing_tensors(rendered: Rendered) -> list[tuple[str, int]]:
    """``(tensor, cases)`` of the failing tensors of the failing cases, most cases first."""
    data = rendered.data
    failed = set(data.cases.loc[data.cases["outcome"] == "fail", "case_id"])
    rows = data.tensors.loc[(data.tensors["verdict"] == "fail") & data.tensors["case_id"].isin(failed)]
    counts = rows.groupby("tensor")["case_id"].nunique().sort_values(ascending=False, kind="stable")
    return [(str(t), int(n)) for t, n in counts.items()]


def judge(kind: str, name: str, directory: Path, baseline: str | None = "auto", *, console: Console | None = None,
          baselines_root: Path = BASELINES_ROOT) -> RunVerdict:
    """Render one run of a gate (``results.csv``, ``index.html``, the terminal view when ``console``) against its
    baseline (``auto`` / a name / None) and say whether it passed (module docstring)."""
    verdict = RunVerdict(kind=kind, name=name, directory=directory, rendered=None, asked=baseline)
    if not (directory / RESULTS_NAME).is_file():
        verdict.reasons.append(f"no results ({directory / RESULTS_NAME} missing: the run did not start)")
        return verdict
    try:
        rendered = render_run(directory, baseline=baseline if kind == "path" else None, console=console,
                              baselines_root=baselines_root)
    except ReportError as error:
        verdict.reasons.append(f"cannot be judged: {error}")
        return verdict
    verdict.rendered = rendered
    data = rendered.data
    counts = data.counts
    if counts.get("fail"):
        shown = failing_tensors(rendered)
        listed = ", ".join(f"{t} ({n})" for t, n in shown[:FAILING_SHOWN])
        more = f", +{len(shown) - FAILING_SHOWN} more" if len(shown) > FAILING_SHOWN else ""
        verdict.reasons.append(f"{counts['fail']} case(s) failed" + (f": {listed}{more}" if listed else ""))
    if counts.get("error"):
        verdict.reasons.append(f"{counts['error']} case(s) errored")
    gated = kind == "path" and baseline is not None and rendered.baseline is not None
    if not gated:  # a gated run's coverage says it (coverage lost: the run is incomplete: ...)
        verdict.reasons += [f"incomplete: {why}" for why in data.incompleteness()]
    if kind == "path" and baseline is not None:
        if rendered.baseline is None:
            wanted = f"{arch_of(data.env)}/{default_name(data)}"
            verdict.reasons.append(f"no baseline {wanted}: coverage and drift not checked; record one from a trusted "
                                   f"run (dsv4-parity compare {directory} --update) or pass --baseline none")
        else:
            verdict.baseline = rendered.baseline.name
            drift = rendered.drift
            verdict.reasons += [f"coverage lost: {p}" for p in drift.coverage.problems()]
            rest = [r for r in drift.reasons() if not r.startswith("coverage")]
            if rest:
                verdict.reasons.append(f"drift vs {rendered.baseline.name}: " + "; ".join(rest))
    return verdict


def providers_text(rendered: Rendered) -> str:
    """``provider P`` of the run row, then the kernel providers its cases ran, with their case counts."""
    data = rendered.data
    plans = plan_counts(data)
    ran: dict[str, int] = {}
    for row in plans.itertuples():
        ran[row.provider] = max(ran.get(row.provider, 0), int(row.cases))
    stages = ", ".join(f"{p} ({n})" for p, n in sorted(ran.items(), key=lambda kv: -kv[1]))
    return f"provider {stated_provider(data.run)}" + (f", kernels {stages}" if stages else "")


def summary_line(verdict: RunVerdict) -> str:
    """What one run compared: providers, the cases, and (against a baseline) the coverage line."""
    if verdict.rendered is None:
        return "no results"
    rendered = verdict.rendered
    counts = rendered.data.counts
    text = f"{providers_text(rendered)}; {len(rendered.data.cases)} cases: " + \
        ", ".join(f"{n} {o}" for o, n in counts.items() if n or o in ("pass", "fail"))
    if rendered.drift is not None:
        text += f"; vs {rendered.baseline.name}: {rendered.drift.coverage.line()}"
    elif verdict.kind == "path" and verdict.asked is None:
        text += "; not gated against a baseline (--baseline none)"
    return text


# ---- the gate ----------------------------------------------------------------------------------------------------
def gate_passed(verdicts: Sequence[RunVerdict]) -> bool:
    return bool(verdicts) and all(v.passed for v in verdicts)


def verdict_text(verdicts: Sequence[RunVerdict]) -> str:
    if gate_passed(verdicts):
        return "PASS"
    failed = [f"{v.name}: " + "; ".join(_clip(r, VERDICT_CHARS) for r in v.reasons) for v in verdicts if not v.passed]
    return "FAIL — " + " | ".join(failed) if failed else "FAIL — nothing ran"


def print_summary(verdicts: Sequence[RunVerdict], console: Console, *, title: str, report: Path) -> None:
    """The gate's closing summary: the side-by-side table, each run's line and reasons, the verdict, the report."""
    grid = Table(title=title, title_justify="left", header_style="bold")
    for column in ("run", "cases", "pass", "known", "fail", "error", "unsupported", "baseline", "coverage", "drift",
                   "verdict"):
        grid.add_column(column, justify="right" if column in ("cases", "pass", "known", "fail", "error",
                                                              "unsupported") else "left")
    for v in verdicts:
        counts = v.counts()
        drift = v.rendered.drift if v.rendered else None
        coverage = ("-" if drift is None else "lost" if drift.coverage.lost else
                    f"= ({drift.coverage.compared}/{drift.coverage.baseline_ran} cases)")
        drift_state = "-" if drift is None else ("FAIL" if (drift.regressions or len(drift.new_failures)
                                                            or drift.pairs.empty) else "steady")
        grid.add_row(f"{v.kind if v.kind == 'oracle' else 'path'} {v.name}",
                     str(len(v.rendered.data.cases)) if v.rendered else "-",
                     *(str(counts.get(o, 0)) if v.rendered else "-" for o in ("pass", "known", "fail", "error",
                                                                            "unsupported")),
                     v.baseline or ("none" if v.asked is None or v.kind == "oracle" else "missing"),
                     Text(coverage, style="bold red" if coverage == "lost" else ""),
                     Text(drift_state, style="bold red" if drift_state == "FAIL" else ""),
                     Text("PASS" if v.passed else "FAIL", style="bold green" if v.passed else "bold red"))
    console.print(grid)
    for v in verdicts:
        console.print(f"{v.name}: ", end="", style="bold", highlight=False)
        console.print(summary_line(v), highlight=False, markup=False)
        for reason in v.reasons:
            console.print(f"  {v.name} FAIL: ", end="", style="bold red", highlight=False)
            console.print(reason, highlight=False, markup=False)
    passed = gate_passed(verdicts)
    console.print("gate: ", end="", style="bold")
    console.print(verdict_text(verdicts), style="bold green" if passed else "bold red", highlight=False,
                  markup=False)
    console.print(f"report: {report}", highlight=False, markup=False, soft_wrap=True)


def markdown_summary(verdicts: Sequence[RunVerdict], *, title: str) -> str:
    """The side-by-side block of a gate's markdown summary (each run's own summary follows it)."""
    lines = [f"## dsv4-parity gate: **{'PASS' if gate_passed(verdicts) else 'FAIL'}**", "", title, "",
             "| run | cases | pass | known | fail | error | unsupported | baseline | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for v in verdicts:
        counts = v.counts()
        cells = [str(counts.get(o, 0)) if v.rendered else "-" for o in ("pass", "known", "fail", "error",
                                                                       "unsupported")]
        lines.append(f"| {v.kind} `{v.name}` | {len(v.rendered.data.cases) if v.rendered else '-'} | "
                     + " | ".join(cells) + f" | {v.baseline or '-'} | {'PASS' if v.passed else '**FAIL**'} |")
    lines.append("")
    for v in verdicts:
        lines.append(f"- `{v.name}`: {_md(summary_line(v))}")
        lines += [f"  - **FAIL:** {_md(r)}" for r in v.reasons]
    return "\n".join(lines) + "\n"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _md(text: str, width: int = 1500) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def write_index(directory: Path, verdicts: Sequence[RunVerdict], *, title: str) -> Path:
    """``index.html`` of a gate directory: the side-by-side table, each run's line and reasons, links to each run's
    report. Self-contained (no network: the same CSP as a run's report)."""
    def link(v: RunVerdict) -> str:
        try:
            target = v.report.resolve().relative_to(directory.resolve())
        except ValueError:
            target = v.report.resolve()
        return f'<a href="{_html.escape(str(target))}">{_html.escape(v.name)}</a>'

    rows = []
    for v in verdicts:
        counts = v.counts()
        cells = "".join(f'<td class="n">{counts.get(o, 0) if v.rendered else "-"}</td>'
                        for o in ("pass", "known", "fail", "error", "unsupported"))
        reasons = "".join(f"<li>{_html.escape(r)}</li>" for r in v.reasons)
        rows.append(f'<tr class="{"ok" if v.passed else "bad"}"><td>{v.kind} {link(v)}</td>'
                    f'<td class="n">{len(v.rendered.data.cases) if v.rendered else "-"}</td>{cells}'
                    f'<td>{_html.escape(v.baseline or "-")}</td><td><b>{"PASS" if v.passed else "FAIL"}</b></td>'
                    f'<td>{_html.escape(summary_line(v))}{f"<ul>{reasons}</ul>" if reasons else ""}</td></tr>')
    passed = gate_passed(verdicts)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>dsv4-parity gate · {"PASS" if passed else "FAIL"}</title>
<style>body{{font:13px/1.45 system-ui,sans-serif;margin:20px;color:#1d2330}} table{{border-collapse:collapse}}
td,th{{border:1px solid #dde1e8;padding:4px 8px;vertical-align:top;text-align:left}} td.n{{text-align:right}}
tr.bad td{{background:#fce8e6}} tr.ok td{{background:#e6f4ea}} .verdict{{font-size:18px;font-weight:700}}</style>
</head><body>
<h1>dsv4-parity gate</h1>
<p>{_html.escape(title)}</p>
<p class="verdict" id="gate-verdict">{_html.escape(verdict_text(verdicts))}</p>
<table id="gate-table"><thead><tr><th>run</th><th>cases</th><th>pass</th><th>known</th><th>fail</th><th>error</th>
<th>unsupported</th><th>baseline</th><th>verdict</th><th>what it compared</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<p>Each run's own report (drift, coverage, cases): the links above. Rendered
{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}.</p>
</body></html>
"""
    path = directory / INDEX
    path.write_text(page, encoding="utf-8")
    return path


def judge_gate_dir(directory: Path, manifest: Mapping[str, Any], *, baseline: str | None = "auto",
                   console: Console | None = None, baselines_root: Path = BASELINES_ROOT) -> list[RunVerdict]:
    """Judge every run a gate directory lists (``baseline``: as :func:`parse_baselines` reads it)."""
    runs = manifest_runs(directory, manifest)
    chosen = parse_baselines(baseline, [name for kind, name, _ in runs if kind == "path"])
    return [judge(kind, name, path, chosen.get(name) if kind == "path" else None, console=console,
                  baselines_root=baselines_root) for kind, name, path in runs]


def title_of(manifest: Mapping[str, Any]) -> str:
    paths = [str(p["name"]) for p in manifest["paths"]]
    if len(paths) == 1:
        return f"gate: {manifest.get('impl')} on {manifest.get('suite')}, path {paths[0]}, against its baseline"
    return (f"gate: {manifest.get('impl')} on {manifest.get('suite')}, {len(paths)} paths ({', '.join(paths)}), "
            f"each against its own baseline")


__all__ = ["INDEX", "MANIFEST", "RunVerdict", "failing_tensors", "gate_passed", "judge", "judge_gate_dir",
           "manifest_runs", "markdown_summary", "parse_baselines", "print_summary",
           "read_manifest", "summary_line", "title_of", "verdict_text", "write_index", "write_manifest"]
