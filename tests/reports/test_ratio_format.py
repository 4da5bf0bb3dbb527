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


def svg_of(uri: str) -> str:
    import base64

    assert uri.startswith("data:image/svg+xml;base64,")
    return base64.b64decode(uri.split(",", 1)[1]).decode("utf-8")


def test_axis_labels_of_a_huge_ratio_are_few_and_short():
    import re

    rows = [{"case_id": f"c{i}", "tensor": "out", "tensor_class": "out", "dtype": "float32", "verdict": "pass",
             "outcome": "pass", "noise_floor_ratio": v} for i, v in enumerate([1.0, 2.0, 3.0])]
    base = pd.DataFrame(rows)
    cur = base.assign(noise_floor_ratio=[1.0, 2.0, 3.0 * 2.3e14])
    from reports.plots import drift_plot

    labels = re.findall(r">([^<>]*×)</text>", svg_of(drift_plot(compare_tables(cur, base, GateConfig()))))
    assert 3 <= len(labels) <= MAX_TICKS + 2 and max(len(label) for label in labels) <= 7, labels
    assert labels[-1].endswith("e+12×"), labels  # up to the largest ratio (2.3e+14: the next label is past it)
    # the control: a small ratio keeps plain labels, one per power of two
    small = re.findall(r">([^<>]*×)</text>", svg_of(drift_plot(compare_tables(base, base, GateConfig()))))
    assert "1×" in small and "2×" in small and not any("e+" in label for label in small), small
    assert _ratio_tick(np.log2(2.0**40)).endswith("e+12×")
