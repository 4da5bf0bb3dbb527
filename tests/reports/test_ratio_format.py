"""Drift ratios stay readable however large: scientific notation in tables, a bounded number of axis labels."""

import numpy as np
import pandas as pd

from reports.drift import GateConfig, compare_tables
from reports.plots import MAX_TICKS, _ratio_tick
from reports.terminal import ratio_text


def test_ratio_text_switches_to_scientific_outside_the_readable_range():
    assert ratio_text(1.37) == "1.37x" and ratio_text(0.5, "×") == "0.50×"
    assert ratio_text(234798403582311.41, "×") == "2.35e+14×"  # not 234798403582311.41×
    assert ratio_text(2e-5) == "2.00e-05x" and ratio_text(float("nan")) == "-" and ratio_text(None) == "-"
    assert ratio_text(float("inf")) == "infx"


def test_axis_labels_of_a_huge_ratio_are_few_and_short(monkeypatch):
    ticks = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.set_xticks

    def spy(self, values, labels=None, **kw):
        ticks.append((list(values), list(labels or [])))
        return real(self, values, labels, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", spy)
    rows = [{"case_id": f"c{i}", "tensor": "out", "tensor_class": "out", "dtype": "float32", "verdict": "pass",
             "outcome": "pass", "noise_floor_ratio": v} for i, v in enumerate([1.0, 2.0, 3.0])]
    base = pd.DataFrame(rows)
    cur = base.assign(noise_floor_ratio=[1.0, 2.0, 3.0 * 2.3e14])
    from reports.plots import drift_plot

    assert drift_plot(compare_tables(cur, base, GateConfig())) is not None
    values, labels = ticks[-1]
    assert len(values) <= MAX_TICKS + 2 and max(len(label) for label in labels) <= 7, labels
    assert _ratio_tick(np.log2(2.0**40)).endswith("e+12×")
