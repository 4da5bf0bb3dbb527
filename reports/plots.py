"""Matplotlib figures of the HTML report, returned as inline ``data:image/png;base64`` URIs (no files, no network).

* :func:`tensor_distributions` — per tensor: box plot of ``max_rel`` in ulps of the tensor's dtype (so float64 and
  bfloat16 cases share one axis) beside a box plot of the noise-floor ratio with its threshold marked.
* :func:`noise_floor_histograms` — per tensor class: histogram of the noise-floor ratio, threshold line.
* :func:`drift_plot` — per tensor class: distribution of current/baseline ratios, gate factor lines.
"""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from cases.vocabulary import TENSOR_CLASSES  # noqa: E402

from .drift import DriftResult  # noqa: E402
from .schema import dtype_eps  # noqa: E402

CLASS_COLORS = dict(zip(TENSOR_CLASSES, ("#1f77b4", "#9467bd", "#17becf", "#7f7f7f", "#bcbd22", "#2ca02c",
                                         "#ff7f0e", "#d62728")))
MAX_TENSORS = 40
plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "figure.dpi": 96})


def to_data_uri(fig: plt.Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")  # each figure sets its own margins: no layout pass here
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _margins(fig: plt.Figure, labels: list[str]) -> None:
    """Fixed margins for a figure of horizontal rows labelled ``labels`` on the left and an x label below: room for
    the longest label and the x axis, computed from the font size (``tight_layout`` measured every tick label's
    extent: over a second of a report drawn after a run's last case)."""
    height = fig.get_figheight()
    label_in = max((len(n) for n in labels), default=0) * 0.62 * plt.rcParams["font.size"] / 72 + 0.2
    fig.subplots_adjust(left=min(0.45, label_in / fig.get_figwidth()), right=0.975, wspace=0.04,
                        bottom=min(0.45, 0.5 / height), top=1 - min(0.2, 0.12 / height))


def _class_rank(name: str) -> int:
    return TENSOR_CLASSES.index(name) if name in TENSOR_CLASSES else len(TENSOR_CLASSES)


def _boxes(ax: plt.Axes, groups: list[np.ndarray], colors: list[str]) -> None:
    positions = np.arange(len(groups))
    data = [g if len(g) else np.array([np.nan]) for g in groups]
    parts = ax.boxplot(data, positions=positions, orientation="horizontal", widths=0.6, patch_artist=True,
                       showfliers=True, flierprops={"markersize": 2, "alpha": 0.5})
    for patch, color in zip(parts["boxes"], colors):
        patch.set_facecolor(color)
        patch.set_alpha(0.55)


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

    fig, (left, right) = plt.subplots(1, 2, sharey=True, figsize=(11, 1.2 + 0.24 * len(names)))
    for ax, column, label in ((left, "ulps", "max_rel  [ulp of the tensor's dtype]"),
                              (right, "noise_floor_ratio", "noise-floor ratio  (kernel error / reference noise)")):
        groups = []
        for name in names:
            values = by_tensor[name][column].to_numpy(dtype=float)
            groups.append(values[np.isfinite(values) & (values > 0)])
        _boxes(ax, groups, colors)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(label)
        ax.grid(axis="x", which="major", alpha=0.3)
    for i, name in enumerate(names):
        thr = nfr_thr.get(name)
        if thr is not None and np.isfinite(thr):
            right.plot([thr, thr], [i - 0.4, i + 0.4], color="#d62728", linewidth=1.5)
    right.plot([], [], color="#d62728", label="threshold")
    right.legend(loc="lower right", fontsize=7)
    left.set_yticks(range(len(names)), names)
    left.invert_yaxis()
    _margins(fig, names)
    return to_data_uri(fig)


def noise_floor_histograms(table: pd.DataFrame, metrics: pd.DataFrame) -> str | None:
    rows = table.loc[(table["tensor"] != "") & (table["noise_floor_ratio"] > 0)]
    classes = sorted(rows["tensor_class"].dropna().unique(), key=_class_rank)
    if not classes:
        return None
    thresholds = metrics.loc[metrics["metric"] == "noise_floor_ratio"].groupby("tensor_class")["threshold"].median()
    values = np.log10(rows["noise_floor_ratio"].to_numpy(dtype=float))
    bins = np.linspace(np.floor(values.min() * 2) / 2, np.ceil(values.max() * 2) / 2 + 1e-9, 40)
    cols = min(4, len(classes))
    nrows = -(-len(classes) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 2.0 * nrows), squeeze=False)
    for ax, klass in zip(axes.flat, classes):
        data = np.log10(rows.loc[rows["tensor_class"] == klass, "noise_floor_ratio"].to_numpy(dtype=float))
        ax.hist(data, bins=bins, color=CLASS_COLORS.get(klass, "#999999"), alpha=0.8, histtype="stepfilled")
        thr = thresholds.get(klass)
        if thr is not None and np.isfinite(thr) and thr > 0:
            ax.axvline(np.log10(thr), color="#d62728", linewidth=1.2)
        ax.set_title(f"{klass}  (n={len(data)})")
        ax.set_xlabel("log10 noise-floor ratio")
    for ax in list(axes.flat)[len(classes):]:
        ax.axis("off")
    height = fig.get_figheight()  # 2 inches a row: title above, tick labels and x label below each
    fig.subplots_adjust(left=0.04, right=0.99, wspace=0.22, bottom=0.45 / height, top=1 - 0.25 / height,
                        hspace=0.75 / 1.4)
    return to_data_uri(fig)


MAX_TICKS = 12


def _ratio_tick(log2_ratio: float) -> str:
    """An axis label for ``2**log2_ratio``: plain from 1/1024 to 8192, else scientific (``3e+14×``)."""
    value = 2.0 ** log2_ratio
    return f"{value:g}×" if -10 <= log2_ratio <= 13 else f"{value:.0e}×"


def drift_plot(drift: DriftResult) -> str | None:
    pairs = drift.pairs
    classes = [c for c in drift.classes["tensor_class"] if (pairs["tensor_class"] == c).any()]
    if not classes:
        return None
    status = dict(zip(drift.classes["tensor_class"], drift.classes["status"]))
    groups = [np.log2(pairs.loc[pairs["tensor_class"] == c, "ratio"].to_numpy(dtype=float)) for c in classes]
    colors = ["#d62728" if status[c] == "regression" else "#2ca02c" if status[c] == "improvement" else "#7f7f7f"
              for c in classes]
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.28 * len(classes)))
    _boxes(ax, groups, colors)
    factor = np.log2(drift.config.factor)
    for x, style in ((0.0, "-"), (factor, "--"), (-factor, "--")):
        ax.axvline(x, color="#444444", linestyle=style, linewidth=0.8)
    lo = min(-factor - 0.5, min(g.min() for g in groups if len(g)) - 0.25)
    hi = max(factor + 0.5, max(g.max() for g in groups if len(g)) + 0.25)
    ax.set_xlim(lo, hi)
    step = max(1.0, np.ceil((np.ceil(hi) - np.floor(lo)) / MAX_TICKS))  # at most ~12 labels, however wide
    ticks = np.arange(np.floor(lo), np.ceil(hi) + 1, step)
    ax.set_xticks(ticks, [_ratio_tick(t) for t in ticks])
    ax.set_yticks(range(len(classes)), classes)
    ax.invert_yaxis()
    ax.set_xlabel(f"current / baseline {drift.config.metric} per matched pair (log scale); "
                  f"dashed: the {drift.config.factor:g}× gate")
    _margins(fig, classes)
    return to_data_uri(fig)
