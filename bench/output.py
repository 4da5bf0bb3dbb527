"""The bench report's forms (``dsv4-parity bench``): the JSON schema check, the rich tables and the PNG plots."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Optional

SCHEMA = "dsv4-parity-bench/1"


STATUSES = {"ok", "oom", "error", "unsupported", "skipped", "absent"}
_E2E_FIELDS = {"profile": str, "tokens": int, "layout": str, "scope": str, "impl": str, "status": str,
               "message": str, "time": dict, "flops": (int, float), "tflops": (int, float, type(None)),
               "peak_fraction": (int, float, type(None)), "peak_mem_bytes": (int, type(None)),
               "inputs_bytes": (int, type(None))}
_STAGE_SIDE = {"status": str, "time_ms": (int, float, type(None)), "tflops": (int, float, type(None)),
               "peak_mem_bytes": (int, type(None))}
_TARGET_STATUSES = {"met", "missed", "not measured", "not judged"}


def check_schema(report: Any) -> list[str]:
    """Problems with a bench JSON document (empty list: it follows ``dsv4-parity-bench/1``)."""
    problems: list[str] = []

    def need(obj: Any, fields: dict, where: str) -> None:
        if not isinstance(obj, dict):
            problems.append(f"{where}: not an object")
            return
        for name, kind in fields.items():
            if name not in obj:
                problems.append(f"{where}.{name}: missing")
            elif not isinstance(obj[name], kind) or isinstance(obj[name], bool):
                problems.append(f"{where}.{name}: {type(obj[name]).__name__} is not {kind}")
        if isinstance(obj.get("status"), str) and obj["status"] not in STATUSES | _TARGET_STATUSES:
            problems.append(f"{where}.status: unknown status {obj['status']!r}")

    need(report, {"schema": str, "created": str, "settings": dict, "env": dict, "machine": dict, "e2e": list,
                  "stages": list, "scaling": dict, "targets": list, "findings": list, "skipped": list}, "report")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"report.schema: {report['schema']!r} is not {SCHEMA!r}")
    for i, row in enumerate(report["e2e"]):
        need(row, _E2E_FIELDS, f"e2e[{i}]")
        if isinstance(row, dict) and isinstance(row.get("time"), dict):
            need(row["time"], {"median_ms": (int, float, type(None)), "repeats": int}, f"e2e[{i}].time")
            if row.get("status") == "ok" and row["time"].get("median_ms") is None:
                problems.append(f"e2e[{i}]: status ok without a time")
    for i, row in enumerate(report.get("side_by_side", [])):  # absent from reports older than --impl
        need(row, {"profile": str, "tokens": int, "scope": str, "impls": dict, "vs_first": dict}, f"side_by_side[{i}]")
        for name, cell in (row.get("impls") or {}).items() if isinstance(row, dict) else ():
            need(cell, {"status": str, "time_ms": (int, float, type(None)),
                        "kernel_sum_ms": (int, float, type(None))}, f"side_by_side[{i}].impls.{name}")
    for i, row in enumerate(report["stages"]):
        need(row, {"profile": str, "tokens": int, "group": str, "fused": dict, "reference": dict}, f"stages[{i}]")
        for side in ("fused", "reference"):
            if isinstance(row, dict) and isinstance(row.get(side), dict):
                need(row[side], {"status": str}, f"stages[{i}].{side}")
                if row[side].get("status") == "ok":
                    need(row[side], _STAGE_SIDE, f"stages[{i}].{side}")
    need(report["scaling"], {"series": list, "fits": list}, "scaling")
    for i, s in enumerate(report["scaling"].get("series", [])):
        need(s, {"name": str, "impl": str, "kind": str, "points": list}, f"scaling.series[{i}]")
        for j, p in enumerate(s.get("points", []) if isinstance(s, dict) else []):
            need(p, {"tokens": int, "status": str}, f"scaling.series[{i}].points[{j}]")
    for i, f in enumerate(report["scaling"].get("fits", [])):
        need(f, {"series": str, "metric": str, "slope": (int, float, type(None)), "verdict": str},
             f"scaling.fits[{i}]")
    for i, row in enumerate(report.get("breakdown", [])):  # absent from reports older than the section
        need(row, {"profile": str, "tokens": int, "status": str}, f"breakdown[{i}]")
        if isinstance(row, dict) and row.get("status") == "ok":
            need(row, {"wall_ms": (int, float), "provider_ms": (int, float), "composition_ms": (int, float),
                       "sites": list}, f"breakdown[{i}]")
    h = report.get("harness")
    if h is not None:
        need(h, {"suite": str, "status": str}, "harness")
        if isinstance(h, dict) and h.get("status") == "ok":
            need(h, {"cases": int, "suite_cases": int, "total_s": (int, float), "cases_per_min": (int, float),
                     "phases": dict, "overhead_share": (int, float), "suite_estimate_s": (int, float),
                     "counts": dict}, "harness")
    ops = report.get("ops")  # absent unless the section ran
    if ops is not None:
        need(ops, {"suite": str, "status": str}, "ops")
        if isinstance(ops, dict) and ops.get("status") in ("ok", "partial"):
            need(ops, {"cases": int, "ops_per_case": (int, float), "phases": dict, "sites": dict, "rows": list}, "ops")
    st = report.get("startup")  # absent from reports older than the section
    if st is not None:
        need(st, {"status": str, "rows": list}, "startup")
        for i, row in enumerate(st.get("rows", []) if isinstance(st, dict) else []):
            need(row, {"command": str, "median_s": (int, float), "ratio": (int, float, type(None))},
                 f"startup.rows[{i}]")
            if isinstance(row, dict) and not isinstance(row.get("torch_loaded"), bool):
                problems.append(f"startup.rows[{i}].torch_loaded: not a bool")
    for i, t in enumerate(report["targets"]):
        need(t, {"name": str, "target": str, "status": str, "note": str}, f"targets[{i}]")
        if isinstance(t, dict) and t.get("status") not in _TARGET_STATUSES:
            problems.append(f"targets[{i}].status: {t.get('status')!r}")
    for i, f in enumerate(report["findings"]):
        need(f, {"kind": str, "message": str}, f"findings[{i}]")
    return problems


# ---- output ------------------------------------------------------------------------------------------------------------
def _ms(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def ms_part(label: str, x: Optional[float]) -> str:
    """``"<label> 12.3 ms"`` for a progress line, or ``""`` where nothing was measured (never ``None ms``)."""
    return "" if x is None else f"{label} {_ms(x)} ms".strip()


def _mib(x: Optional[int]) -> str:
    return "—" if x is None else f"{x / 2 ** 20:,.1f}"


def _tf(x: Optional[float]) -> str:
    return "—" if x is None else (f"{x:.3g}" if x >= 0.01 else f"{x:.2e}")


def _side_ms(side: dict) -> str:
    """A stage side's time, or its status where it has none."""
    return _ms(side.get("time_ms")) if side.get("status") == "ok" else side.get("status", "—")


def render_tables(report: dict, console=None) -> None:
    """The report as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 170)
    env, m = report["env"], report["machine"]
    console.print(f"[bold]dsv4-parity bench[/] — {env.get('gpu') or m.get('processor')} · "
                  f"{m.get('cpus_allowed', m.get('cpu_count'))} cores · load {m.get('load_avg')} · torch "
                  f"{env.get('torch')} · peak {report.get('peak_tflops') or 'n/a'} TFLOP/s · "
                  f"{report.get('duration_s')} s")
    peak = report.get("peak_tflops")
    if report["e2e"]:
        t = Table(title="End to end: forward + backward (time = median; memory = peak above inputs)")
        for col in ("profile", "T", "layout", "scope", "impl", "provider", "status", "ms", "TFLOP/s",
                    "% peak" if peak else "", "MiB", "kernels ms", "ratio"):
            if col:
                t.add_column(col, justify="right" if col not in ("profile", "layout", "scope", "impl", "provider",
                                                                 "status") else "left")
        for r in report["e2e"]:
            cells = [r["profile"], str(r["tokens"]), r["layout"], r["scope"], r["impl"], str(r.get("provider")),
                     r["status"],
                     _ms(r["time"]["median_ms"]), _tf(r["tflops"])]
            if peak:
                cells.append("—" if r["peak_fraction"] is None else f"{100 * r['peak_fraction']:.1f}")
            cells += [_mib(r["peak_mem_bytes"]), _ms(r.get("kernel_sum_ms")),
                      "—" if not r.get("composition_ratio") else f"{r['composition_ratio']:.2f}"]
            t.add_row(*cells)
        console.print(t)
    impls = report["settings"].get("impls") or ["fused"]
    if report.get("side_by_side") and impls != ["fused"]:
        _side_by_side_table(console, report["side_by_side"], impls)
    if report["stages"]:
        others = [n for n in impls if n != "fused"]
        t = Table(title="Stages: fused kernels (in the core-scope run) vs the reference stage alone"
                        + (f"; {', '.join(others)}: its kernels in its core-scope run" if others else ""))
        for col in ("profile", "T", "stage", "fused ms", "fused TFLOP/s", "fused MiB", "ref ms", "ref TFLOP/s",
                    "ref MiB", "ref/fused", *(f"{n} ms" for n in others)):
            t.add_column(col, justify="left" if col in ("profile", "stage") else "right")
        for r in report["stages"]:
            f, g = r["fused"], r["reference"]
            sides = [(r.get("impls") or {}).get(n, {}) for n in others]
            t.add_row(r["profile"], str(r["tokens"]), r["group"], _side_ms(f),
                      _tf(f.get("tflops")), _mib(f.get("peak_mem_bytes")), _side_ms(g),
                      _tf(g.get("tflops")), _mib(g.get("peak_mem_bytes")),
                      "—" if not r.get("speedup") else f"{r['speedup']:.2f}", *(_side_ms(x) for x in sides))
        console.print(t)
    for r in report.get("breakdown", []):
        if r.get("status") != "ok":
            console.print(f"breakdown {r['profile']} T={r['tokens']}: {r.get('status')} {r.get('message')}")
            continue
        idle = "—" if r.get("idle_ms") is None else _ms(r["idle_ms"])
        t = Table(title=f"Breakdown {r['profile']} T={r['tokens']} ({r['provider']}): wall {_ms(r['wall_ms'])} ms = "
                        f"providers {_ms(r['provider_ms'])} + composition {_ms(r['composition_ms'])} + idle {idle}")
        for col in ("site (first repository frame)", "op", "calls", "ms"):
            t.add_column(col, justify="right" if col in ("calls", "ms") else "left", overflow="fold")
        for site in r["sites"][:12]:
            t.add_row(site["site"], site["op"], str(site["calls"]), _ms(site["ms"]))
        console.print(t)
        syncs = r.get("host_syncs")
        if syncs is not None:
            where = ", ".join(f"{s['site']} ×{s['count']}" for s in syncs["sites"][:6])
            console.print(f"host syncs in one step: {syncs['count']}" + (f" ({where})" if where else ""))
        graph = r.get("graph")
        if graph is not None:
            console.print(f"as a CUDA graph: {_ms(graph['ms'])} ms per replay" if graph.get("ms") else
                          f"CUDA-graph capture failed: {graph.get('error')}")
    fits = report["scaling"]["fits"]
    if fits:
        t = Table(title="Scaling with T (log-log slope; 1 = linear, 2 = quadratic)")
        for col in ("series", "metric", "slope", "points", "verdict"):
            t.add_column(col, justify="left" if col in ("series", "metric", "verdict") else "right")
        for f in fits:
            t.add_row(f["series"], f["metric"], "—" if f["slope"] is None else f"{f['slope']:.2f}",
                      str(f["points"]), f["verdict"])
        console.print(t)
    h = report.get("harness")
    if h and h.get("status") == "ok":
        t = Table(title=f"Harness: {h['cases']}/{h['suite_cases']} {h['suite']} cases in {h['total_s']} s — "
                        f"{h['cases_per_min']:.1f} cases/min, overhead {h['overhead_share']:.1%}")
        t.add_column("phase")
        t.add_column("s", justify="right")
        t.add_column("share", justify="right")
        for k, v in h["phases"].items():
            t.add_row(k, f"{v:.3f}", f"{v / h['total_s']:.1%}" if k != "load suite" else "")
        if h.get("report_s") is not None:
            t.add_row("report rendering (after the run)", f"{h['report_s']:.3f}", "")
        console.print(t)
    elif h:
        console.print(f"harness: {h.get('status')} {h.get('message')}")
    _ops_tables(report.get("ops"), console)
    st = report.get("startup")
    if st and st.get("rows"):
        t = Table(title=f"Start-up: each command a fresh process, median of {st['repeats']}, against python -c pass")
        for col in ("command", "ms", "ratio", "exit", "torch loaded"):
            t.add_column(col, justify="left" if col == "command" else "right")
        for r in st["rows"]:
            t.add_row(r["command"], _ms(1000 * r["median_s"]), "—" if r["ratio"] is None else f"{r['ratio']:.2f}",
                      str(r["exit_code"]), "yes" if r["torch_loaded"] else "no")
        console.print(t)
    if report["targets"]:
        t = Table(title="Targets (reported, never asserted)")
        for col in ("target", "goal", "measured", "status", "note"):
            t.add_column(col, overflow="fold")
        for x in report["targets"]:
            style = {"met": "green", "missed": "red"}.get(x["status"], "yellow")
            t.add_row(x["name"], x["target"], f"{x['measured']} {x['unit']}" if x["measured"] is not None else "—",
                      f"[{style}]{x['status']}[/]", x["note"])
        console.print(t)
    for f in report["findings"]:
        console.print(f"[bold red]finding[/] {f['function'] or ''} {f['where'] or ''}: {f['message']}")
    if report["skipped"]:
        console.print(f"skipped: {len(report['skipped'])} item(s) (see the JSON)")


def _ops_tables(ops: Optional[dict], console) -> None:
    """The ``ops`` section: ATen ops per case by phase (most first), then the reference's sites."""
    if not ops:
        return
    from rich.table import Table

    if ops.get("status") not in ("ok", "partial"):
        console.print(f"ops: {ops.get('status')} {ops.get('message')}")
        return
    t = Table(title=f"ATen ops per case ({ops['cases']}/{ops['suite_cases']} {ops['suite']} cases, {ops['device']}"
                    f"{', cut by the budget' if ops['status'] == 'partial' else ''}): "
                    f"{ops['ops_per_case']:.0f} a case")
    for col in ("phase", "per case", "max", "max case", "host reads", "most frequent"):
        t.add_column(col, justify="right" if col in ("per case", "max", "host reads") else "left")
    for phase, p in sorted(ops["phases"].items(), key=lambda kv: -kv[1]["ops"]):
        t.add_row(phase, f"{p['ops_per_case']:.0f}", str(p["max_per_case"]), p["max_case"],
                  f"{p.get('host_reads_per_case', 0):.0f}", ", ".join(f"{name} {n}" for name, n in p["top"][:4]))
    console.print(t)
    for phase, where in ops.get("sites", {}).items():
        t = Table(title=f"{phase}: ops by site (the innermost frame of the phase's own code)")
        t.add_column("site")
        t.add_column("ops", justify="right")
        t.add_column("share", justify="right")
        total = ops["phases"].get(phase, {}).get("ops") or 1
        for site, n in where:
            t.add_row(site, str(n), f"{n / total:.1%}")
        console.print(t)


def _side_by_side_table(console, rows: list, impls: list) -> None:
    """The ``side_by_side`` rows (:mod:`bench.side_by_side`): per implementation fwd+bwd ms, kernel sum, ratio."""
    from rich.table import Table

    from bench.side_by_side import cells, header, reasons

    t = Table(title="Implementations side by side: forward + backward / the sum of its observed kernels")
    for col in header(impls):
        t.add_column(col, justify="left" if col in ("profile", "layout", "scope") else "right")
    for r in rows:
        t.add_row(*cells(r, impls))
    console.print(t)
    for what, why in reasons(rows).items():
        console.print(f"{what}: {why}")


def write_plot(report: dict, path: Path) -> Optional[Path]:
    """Log-log plots (scaling: reference time and memory vs T; e2e: fused vs reference time) as one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for s in report["scaling"]["series"]:
        pts = [p for p in s["points"] if p.get("status") == "ok"]
        if s["kind"] == "forward+backward":
            xs = [p["tokens"] for p in pts if p.get("time_ms")]
            axes[0].plot(xs, [p["time_ms"] for p in pts if p.get("time_ms")], "o-", label=s["name"])
        metric = "retained_bytes" if "retained" in s["name"] else "peak_mem_bytes"
        mp = [p for p in pts if p.get(metric)]
        axes[1].plot([p["tokens"] for p in mp], [p[metric] / 2 ** 20 for p in mp], "o-", label=s["name"])
    for (profile, scope, impl) in sorted({(r["profile"], r["scope"], r["impl"]) for r in report["e2e"]}):
        pts = [r for r in report["e2e"] if (r["profile"], r["scope"], r["impl"]) == (profile, scope, impl)
               and r["status"] == "ok" and r["layout"] == report["settings"]["layout"]]
        if pts:
            axes[2].plot([r["tokens"] for r in pts], [r["time"]["median_ms"] for r in pts],
                         "o-" if impl == "fused" else "s--", label=f"{impl} {profile} {scope}")
    for ax in axes:  # a dotted "∝ T" guide through the first point of the first line
        lines = ax.get_lines()
        if lines and len(lines[0].get_xdata()) > 1:
            xs, ys = list(lines[0].get_xdata()), list(lines[0].get_ydata())
            ax.plot([xs[0], xs[-1]], [ys[0], ys[0] * xs[-1] / xs[0]], ":", color="gray", label="∝ T")
    titles = ("reference fwd+bwd time vs T", "memory vs T (MiB)", "end to end fwd+bwd time vs T")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("tokens T")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("ms")
    axes[2].set_ylabel("ms")
    fig.suptitle(f"dsv4-parity bench — {report['env'].get('gpu') or report['machine'].get('processor')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
