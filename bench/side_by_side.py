"""The implementations of ``dsv4-parity bench --impl a,b`` side by side: per workload, each one's forward + backward
time, the sum of its observed kernels and the ratio of the two — the JSON's ``side_by_side`` list and its
README-style markdown table (written next to the JSON).

A row of :func:`side_by_side` is the workload label (``profile tokens layout segment_len ratio loss dtype scope``)
and ``impls``: ``{name: {provider status message time_ms kernel_sum_ms composition_ratio kernels_note}}`` plus
``vs_first``: ``{name: its time / the first implementation's}`` where both were measured.
"""

from __future__ import annotations

from typing import Optional, Sequence

LABEL = ("profile", "tokens", "layout", "segment_len", "ratio", "loss", "dtype", "scope")
_CELL = ("provider", "status", "message", "kernel_sum_ms", "composition_ratio", "kernels_note")


def side_by_side(e2e: Sequence[dict], impls: Sequence[str]) -> list[dict]:
    """The e2e rows of ``impls`` grouped by workload, in the order measured (module docstring)."""
    rows: dict[tuple, dict] = {}
    for r in e2e:
        if r.get("impl") not in impls:
            continue
        key = tuple(r.get(k) for k in LABEL)
        row = rows.setdefault(key, dict(zip(LABEL, key), impls={}, vs_first={}))
        cell = {k: r.get(k) for k in _CELL}
        cell["time_ms"] = (r.get("time") or {}).get("median_ms")
        row["impls"][r["impl"]] = cell
    for row in rows.values():
        first = row["impls"].get(impls[0], {}).get("time_ms")
        for name, cell in row["impls"].items():
            if first and cell["time_ms"]:
                row["vs_first"][name] = cell["time_ms"] / first
    return list(rows.values())


def _num(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}g}" if x < 1000 else f"{x:,.0f}"


def cell_text(cell: Optional[dict]) -> tuple[str, str, str]:
    """``(time ms, kernel sum ms, ratio)`` of one implementation's cell as text; a row that did not run shows its
    status in the time column, a run without observed kernels shows ``none`` as its kernel sum."""
    if not cell:
        return "not run", "–", "–"
    if cell["status"] != "ok":
        return cell["status"], "–", "–"
    kernels = "none" if cell.get("kernel_sum_ms") is None else _num(cell["kernel_sum_ms"])
    ratio = "–" if not cell.get("composition_ratio") else f"{cell['composition_ratio']:.2f}"
    return _num(cell["time_ms"]), kernels, ratio


def header(impls: Sequence[str]) -> list[str]:
    """Column names of the table: the label, then time / kernel sum / ratio per implementation, then each later
    implementation's time over the first's."""
    cols = ["profile", "T", "layout", "scope"]
    for name in impls:
        cols += [f"{name} fwd+bwd ms", f"{name} kernels ms", f"{name} ratio"]
    return cols + [f"{name} / {impls[0]}" for name in impls[1:]]


def cells(row: dict, impls: Sequence[str]) -> list[str]:
    """One side-by-side row as the text of the :func:`header` columns."""
    out = [row["profile"], str(row["tokens"]), row["layout"], row["scope"]]
    for name in impls:
        out += list(cell_text(row["impls"].get(name)))
    return out + ["–" if row["vs_first"].get(name) is None else f"{row['vs_first'][name]:.2f}" for name in impls[1:]]


def reasons(rows: Sequence[dict]) -> dict[str, str]:
    """``{"<impl>: <status or 'no kernels'>": why}``, the first of each: why a cell has no time or no kernel sum."""
    found: dict[str, str] = {}
    for r in rows:
        for name, cell in r["impls"].items():
            if cell.get("status") != "ok" and cell.get("message"):
                found.setdefault(f"{name}: {cell['status']}", cell["message"])
            elif cell.get("status") == "ok" and cell.get("kernels_note"):
                found.setdefault(f"{name}: no kernels", cell["kernels_note"])
    return found


def markdown(rows: Sequence[dict], impls: Sequence[str], device: str = "") -> str:
    """The side-by-side rows as a README-style markdown table, then why a cell is empty."""
    head = header(impls)
    lines = [f"Forward + backward, median{f' ({device})' if device else ''}; kernels = the sum of the kernel calls "
             "observed through the implementation's observe_kernels hook; ratio = fwd+bwd / kernels.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells(r, impls)) + " |" for r in rows]
    lines += [""] + [f"- {what}: {why}" for what, why in reasons(rows).items()]
    return "\n".join(lines).rstrip() + "\n"
