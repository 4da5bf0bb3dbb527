"""The HTML report's figures, drawn as SVG text and returned as inline ``data:image/svg+xml;base64`` URIs (no files,
no network, no plotting library: a report drawn after a run's last case waited 2.5 s on 2 CPU cores for matplotlib to
lay out and rasterize these three figures of a 227-case gate).

* :func:`tensor_distributions` — per tensor: box plot of ``max_rel`` in ulps of the tensor's dtype (so float64 and
  bfloat16 cases share one axis) beside a box plot of the noise-floor ratio with its threshold marked.
* :func:`noise_floor_histograms` — per tensor class: histogram of the noise-floor ratio, threshold line.
* :func:`drift_plot` — per tensor class: distribution of current/baseline ratios, gate factor lines.

A box spans the quartiles with the median inside; whiskers reach the furthest value within 1.5 × the box's width of
it, measured on the plot's (logarithmic) axis; values beyond are drawn as points. Axes are logarithmic: decades
(10^k) for errors and noise-floor ratios, powers of two (``2×``) for drift ratios.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from html import escape

import numpy as np
import pandas as pd

from cases.vocabulary import TENSOR_CLASSES

from .drift import DriftResult
from .schema import dtype_eps

CLASS_COLORS = dict(zip(TENSOR_CLASSES, ("#1f77b4", "#9467bd", "#17becf", "#7f7f7f", "#bcbd22", "#2ca02c",
                                         "#ff7f0e", "#d62728")))
THRESHOLD_COLOR = "#d62728"
MAX_TENSORS = 40
MAX_TICKS = 12
WIDTH = 1000  # px of every figure
FONT = 11  # px
CHAR = 0.6 * FONT  # px per character of a label (a sans-serif's average advance)
ROW = 18  # px per box row


# ---- drawing ---------------------------------------------------------------------------------------------------------
@dataclass
class Svg:
    """An SVG document of ``width`` × ``height`` px being drawn, element by element."""

    width: float
    height: float
    parts: list = field(default_factory=list)

    def add(self, tag: str, text: str | None = None, **attrs: object) -> None:
        shown = " ".join(f'{k.rstrip("_").replace("_", "-")}="{escape(str(v))}"' for k, v in attrs.items()
                         if v is not None)
        self.parts.append(f"<{tag} {shown}/>" if text is None else f"<{tag} {shown}>{text}</{tag}>")

    def line(self, x1: float, y1: float, x2: float, y2: float, color: str = "#444", width: float = 1.0,
             dash: str | None = None, opacity: float | None = None) -> None:
        self.add("line", x1=_r(x1), y1=_r(y1), x2=_r(x2), y2=_r(y2), stroke=color, stroke_width=width,
                 stroke_dasharray=dash, stroke_opacity=opacity)

    def text(self, x: float, y: float, content: str, anchor: str = "start", size: float = FONT,
             color: str = "#222", markup: bool = False) -> None:
        self.add("text", content if markup else escape(content), x=_r(x), y=_r(y), text_anchor=anchor,
                 font_size=size, fill=color)

    def uri(self) -> str:
        body = "".join(self.parts)
        document = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_r(self.width)}" height="{_r(self.height)}" '
                    f'viewBox="0 0 {_r(self.width)} {_r(self.height)}" font-family="DejaVu Sans, Arial, sans-serif">'
                    f'<rect width="100%" height="100%" fill="white"/>{body}</svg>')
        return "data:image/svg+xml;base64," + base64.b64encode(document.encode("utf-8")).decode("ascii")


def _r(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


@dataclass
class Axis:
    """A horizontal axis from ``lo`` to ``hi`` (axis units: log10 or log2 of the values) over pixels ``x0``..``x1``."""

    lo: float
    hi: float
    x0: float
    x1: float

    def x(self, value: float) -> float:
        span = self.hi - self.lo or 1.0
        return self.x0 + (min(max(value, self.lo), self.hi) - self.lo) / span * (self.x1 - self.x0)


def _decade_label(k: int) -> str:
    """``10^k`` as SVG text markup (the exponent raised)."""
    return f'10<tspan dy="-4" font-size="{FONT - 3}">{k}</tspan>'


def _draw_axis(svg: Svg, axis: Axis, top: float, bottom: float, ticks: list[tuple[float, str]], label: str,
               markup: bool = False) -> None:
    """Grid lines at ``ticks`` (axis position, label) from ``top`` to ``bottom``, their labels and ``label`` below."""
    svg.line(axis.x0, bottom, axis.x1, bottom, "#444")
    for at, text in ticks:
        x = axis.x(at)
        svg.line(x, top, x, bottom, "#000", 0.5, opacity=0.15)
        svg.line(x, bottom, x, bottom + 4, "#444")
        svg.text(x, bottom + 16, text, anchor="middle", size=FONT - 1, markup=markup)
    svg.text((axis.x0 + axis.x1) / 2, bottom + 32, label, anchor="middle")


def whole_ticks(lo: float, hi: float) -> list[int]:
    """Whole axis units (decades on a log10 axis, powers of two on a log2 one) from ``lo`` to ``hi``, every one or
    every few: at most about :data:`MAX_TICKS` labels however wide the range."""
    step = max(1, math.ceil((math.ceil(hi) - math.floor(lo)) / MAX_TICKS))
    return [k for k in range(math.floor(lo), math.ceil(hi) + 1, step) if lo <= k <= hi]


def _log_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Labelled positions from ``lo`` to ``hi`` (log10 units): whole decades, or half decades where fewer than two
    whole ones fall inside."""
    whole = whole_ticks(lo, hi)
    if len(whole) >= 2:
        return [(float(k), str(k)) for k in whole]
    halves = [k / 2 for k in range(math.ceil(lo * 2), math.floor(hi * 2) + 1)]
    return [(k, f"{k:g}") for k in halves]


def _span(groups: list[np.ndarray], pad: float = 0.25) -> tuple[float, float]:
    """The axis range covering every finite value of ``groups`` (axis units), padded; (0, 1) when there is none."""
    values = [g for g in groups if len(g)]
    if not values:
        return 0.0, 1.0
    lo = min(float(g.min()) for g in values)
    hi = max(float(g.max()) for g in values)
    return lo - pad, hi + pad


def box_stats(values: np.ndarray) -> dict[str, object] | None:
    """Quartiles, whisker ends (the furthest values within 1.5 × IQR of the box) and the points beyond them."""
    if not len(values):
        return None
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    reach = 1.5 * (q3 - q1)
    inside = values[(values >= q1 - reach) & (values <= q3 + reach)]
    return {"q1": float(q1), "median": float(median), "q3": float(q3), "low": float(inside.min()),
            "high": float(inside.max()), "beyond": values[(values < q1 - reach) | (values > q3 + reach)]}


def _box(svg: Svg, axis: Axis, y: float, values: np.ndarray, color: str) -> None:
    """One horizontal box plot centred at ``y`` (values in axis units)."""
    stats = box_stats(values)
    if stats is None:
        return
    half = ROW * 0.3
    x = axis.x
    svg.line(x(stats["low"]), y, x(stats["q1"]), y, "#444")
    svg.line(x(stats["q3"]), y, x(stats["high"]), y, "#444")
    for end in (stats["low"], stats["high"]):
        svg.line(x(end), y - half / 2, x(end), y + half / 2, "#444")
    svg.add("rect", x=_r(x(stats["q1"])), y=_r(y - half), width=_r(max(1.0, x(stats["q3"]) - x(stats["q1"]))),
            height=_r(2 * half), fill=color, fill_opacity=0.55, stroke="#444", stroke_width=1)
    svg.line(x(stats["median"]), y - half, x(stats["median"]), y + half, "#ff7f0e", 1.5)
    for value in stats["beyond"]:
        svg.add("circle", cx=_r(x(float(value))), cy=_r(y), r=1.5, fill="none", stroke="#444", stroke_opacity=0.5)


def _label_width(labels: list[str]) -> float:
    return min(0.4 * WIDTH, max((len(n) for n in labels), default=0) * CHAR + 12)


def _class_rank(name: str) -> int:
    return TENSOR_CLASSES.index(name) if name in TENSOR_CLASSES else len(TENSOR_CLASSES)


def _positive_log10(values: np.ndarray) -> np.ndarray:
    values = values[np.isfinite(values) & (values > 0)]
    return np.log10(values)


# ---- the figures -----------------------------------------------------------------------------------------------------
def tensor_distributions(table: pd.DataFrame, metrics: pd.DataFrame) -> str | None:
    """Two panels sharing the tensor axis: ``max_rel`` [ulp of dtype] and noise-floor ratio (log scales)."""
    rows = table.loc[table["tensor"] != ""].copy()
    if rows.empty or (rows["max_rel"].isna().all() and rows["noise_floor_ratio"].isna().all()):
        return None
    rows["ulps"] = rows["max_rel"] / rows["dtype"].map(dtype_eps)
    order = (rows.drop_duplicates("tensor")[["tensor", "tensor_class"]]
             .assign(rank=lambda f: f["tensor_class"].map(_class_rank))
             .sort_values(["rank", "tensor"]).head(MAX_TENSORS))
    names = order["tensor"].tolist()
    colors = [CLASS_COLORS.get(c, "#999999") for c in order["tensor_class"]]
    by_tensor = dict(tuple(rows.groupby("tensor")))
    nfr_thr = metrics.loc[metrics["metric"] == "noise_floor_ratio"].groupby("tensor")["threshold"].median()

    left = _label_width(names)
    top, bottom = 8, 8 + ROW * len(names)
    svg = Svg(WIDTH, bottom + 44)
    gap = 44  # room for the tick labels at the panels' facing edges
    panel = (WIDTH - left - 10 - gap) / 2
    panels = ((left, "ulps", "max_rel  [ulp of the tensor's dtype]"),
              (left + panel + gap, "noise_floor_ratio", "noise-floor ratio  (kernel error / reference noise)"))
    for i, name in enumerate(names):
        svg.text(left - 6, top + ROW * i + ROW / 2 + 4, name, anchor="end")
    for x0, column, label in panels:
        groups = [_positive_log10(by_tensor[name][column].to_numpy(dtype=float)) for name in names]
        thresholds = ([math.log10(t) for t in (nfr_thr.get(n) for n in names) if t is not None and np.isfinite(t)
                       and t > 0] if column == "noise_floor_ratio" else [])
        lo, hi = _span(groups + [np.array(thresholds)], pad=0.1)
        lo, hi = math.floor(lo), max(math.ceil(hi), math.floor(lo) + 1)  # whole decades: at least two labels
        axis = Axis(lo, hi, x0, x0 + panel)
        svg.add("rect", x=_r(x0), y=_r(top), width=_r(panel), height=_r(bottom - top), fill="none", stroke="#bbb")
        _draw_axis(svg, axis, top, bottom, [(k, _decade_label(k)) for k in whole_ticks(lo, hi)], label,
                   markup=True)
        for i, (values, color) in enumerate(zip(groups, colors)):
            _box(svg, axis, top + ROW * i + ROW / 2, values, color)
        if column == "noise_floor_ratio":
            for i, name in enumerate(names):
                thr = nfr_thr.get(name)
                if thr is not None and np.isfinite(thr) and thr > 0:
                    x = axis.x(math.log10(thr))
                    svg.line(x, top + ROW * i + 2, x, top + ROW * (i + 1) - 2, THRESHOLD_COLOR, 1.5)
            svg.line(x0 + panel - 70, bottom - 8, x0 + panel - 56, bottom - 8, THRESHOLD_COLOR, 1.5)
            svg.text(x0 + panel - 52, bottom - 4, "threshold", size=FONT - 1)
    return svg.uri()


def noise_floor_histograms(table: pd.DataFrame, metrics: pd.DataFrame) -> str | None:
    """Per tensor class, the histogram of log10 noise-floor ratios over one shared set of 39 bins; red: the class's
    median threshold."""
    ratios = pd.to_numeric(table["noise_floor_ratio"], errors="coerce")  # a run without one: an object column of NaN
    rows = table.loc[(table["tensor"] != "") & (ratios > 0) & np.isfinite(ratios)]
    classes = sorted(rows["tensor_class"].dropna().unique(), key=_class_rank)
    if not classes:
        return None
    thresholds = metrics.loc[metrics["metric"] == "noise_floor_ratio"].groupby("tensor_class")["threshold"].median()
    marks = {k: math.log10(t) for k, t in thresholds.items() if k in classes and np.isfinite(t) and t > 0}
    values = np.concatenate([np.log10(rows["noise_floor_ratio"].to_numpy(dtype=float)), list(marks.values())])
    edges = np.linspace(np.floor(values.min() * 2) / 2, np.ceil(values.max() * 2) / 2 + 1e-9, 40)  # thresholds in
    cols = min(4, len(classes))
    nrows = -(-len(classes) // cols)
    cell_w, cell_h, pad = WIDTH / cols, 170, 14
    svg = Svg(WIDTH, cell_h * nrows)
    for index, klass in enumerate(classes):
        data = np.log10(rows.loc[rows["tensor_class"] == klass, "noise_floor_ratio"].to_numpy(dtype=float))
        counts, _ = np.histogram(data, bins=edges)
        x0 = cell_w * (index % cols) + 30
        x1 = cell_w * (index % cols + 1) - pad
        y0 = cell_h * (index // cols) + 22
        y1 = cell_h * (index // cols + 1) - 44
        axis = Axis(float(edges[0]), float(edges[-1]), x0, x1)
        tallest = max(1, int(counts.max()))
        svg.text((x0 + x1) / 2, y0 - 8, f"{klass}  (n={len(data)})", anchor="middle")
        color = CLASS_COLORS.get(klass, "#999999")
        for count, a, b in zip(counts, edges[:-1], edges[1:]):
            if count:
                height = (y1 - y0) * count / tallest
                svg.add("rect", x=_r(axis.x(a)), y=_r(y1 - height), width=_r(max(0.5, axis.x(b) - axis.x(a))),
                        height=_r(height), fill=color, fill_opacity=0.8)
        svg.line(x0, y0, x0, y1, "#444")
        svg.text(x0 - 4, y0 + 8, str(tallest), anchor="end", size=FONT - 2)
        svg.text(x0 - 4, y1, "0", anchor="end", size=FONT - 2)
        if klass in marks:
            svg.line(axis.x(marks[klass]), y0, axis.x(marks[klass]), y1, THRESHOLD_COLOR, 1.2)
        _draw_axis(svg, axis, y0, y1, _log_ticks(float(edges[0]), float(edges[-1])), "log10 noise-floor ratio")
    return svg.uri()


def _ratio_tick(log2_ratio: float) -> str:
    """An axis label for ``2**log2_ratio``: plain from 1/1024 to 8192, else scientific (``3e+14×``)."""
    value = 2.0 ** log2_ratio
    return f"{value:g}×" if -10 <= log2_ratio <= 13 else f"{value:.0e}×"


def drift_plot(drift: DriftResult) -> str | None:
    """Per tensor class, the log2 of current / baseline over matched pairs; lines at 1× and at the gate's factor
    both ways. Red: a regression, green: an improvement, grey: steady."""
    pairs = drift.pairs
    classes = [c for c in drift.classes["tensor_class"] if (pairs["tensor_class"] == c).any()]
    if not classes:
        return None
    status = dict(zip(drift.classes["tensor_class"], drift.classes["status"]))
    groups = [np.log2(pairs.loc[pairs["tensor_class"] == c, "ratio"].to_numpy(dtype=float)) for c in classes]
    groups = [g[np.isfinite(g)] for g in groups]
    colors = ["#d62728" if status[c] == "regression" else "#2ca02c" if status[c] == "improvement" else "#7f7f7f"
              for c in classes]
    factor = float(np.log2(drift.config.factor))
    low, high = _span(groups)
    lo, hi = min(-factor - 0.5, low), max(factor + 0.5, high)
    left = _label_width(classes)
    top, bottom = 8, 8 + ROW * len(classes)
    svg = Svg(WIDTH, bottom + 44)
    axis = Axis(lo, hi, left, WIDTH - 10)
    svg.add("rect", x=_r(left), y=_r(top), width=_r(WIDTH - 10 - left), height=_r(bottom - top), fill="none",
            stroke="#bbb")
    _draw_axis(svg, axis, top, bottom, [(t, _ratio_tick(t)) for t in whole_ticks(lo, hi)],
               f"current / baseline {drift.config.metric} per matched pair (log scale); "
               f"dashed: the {drift.config.factor:g}× gate")
    for x, dash in ((0.0, None), (factor, "4 3"), (-factor, "4 3")):
        svg.line(axis.x(x), top, axis.x(x), bottom, "#444", 0.8, dash=dash)
    for i, (name, values, color) in enumerate(zip(classes, groups, colors)):
        y = top + ROW * i + ROW / 2
        svg.text(left - 6, y + 4, name, anchor="end")
        _box(svg, axis, y, values, color)
    return svg.uri()
