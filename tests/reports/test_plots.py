"""The report's SVG figures: box statistics as stated, every value drawn where the axis says, text escaped, and the
figures well-formed SVG (each is parsed as XML here)."""

import base64
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd

from reports.plots import Axis, Svg, box_stats, noise_floor_histograms, tensor_distributions

NS = "{http://www.w3.org/2000/svg}"


def parse(uri: str) -> ET.Element:
    assert uri.startswith("data:image/svg+xml;base64,")
    return ET.fromstring(base64.b64decode(uri.split(",", 1)[1]))


def test_box_stats_are_the_quartiles_and_tukey_whiskers():
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 100.0])
    stats = box_stats(values)
    assert (stats["q1"], stats["median"], stats["q3"]) == (3.0, 5.0, 7.0)
    assert (stats["low"], stats["high"]) == (1.0, 8.0)  # 100 lies beyond q3 + 1.5 × IQR = 13
    assert list(stats["beyond"]) == [100.0]
    assert box_stats(np.array([])) is None
    same = box_stats(np.array([2.0, 2.0, 2.0]))
    assert same["low"] == same["high"] == 2.0 and len(same["beyond"]) == 0


def test_the_axis_maps_its_range_onto_its_pixels_and_clips_outside():
    axis = Axis(-2.0, 2.0, 100.0, 500.0)
    assert (axis.x(-2.0), axis.x(0.0), axis.x(2.0)) == (100.0, 300.0, 500.0)
    assert axis.x(-9.0) == 100.0 and axis.x(9.0) == 500.0


def test_text_is_escaped():
    svg = Svg(100, 20)
    svg.text(0, 10, "a<b & c>d")
    root = parse(svg.uri())
    assert root.find(f"{NS}text").text == "a<b & c>d"


def table_of(values: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, metrics = [], []
    for tensor, (klass, ratios) in values.items():
        for i, ratio in enumerate(ratios):
            rows.append({"case_id": f"c{i}", "tensor": tensor, "tensor_class": klass, "dtype": "bfloat16",
                         "max_rel": ratio * 1e-3, "noise_floor_ratio": ratio})
            metrics.append({"case_id": f"c{i}", "tensor": tensor, "tensor_class": klass,
                            "metric": "noise_floor_ratio", "value": ratio, "threshold": 4.0})
    return pd.DataFrame(rows), pd.DataFrame(metrics)


def test_the_figures_name_every_tensor_and_class_and_mark_the_thresholds():
    table, metrics = table_of({"out": ("out", [0.1, 0.2, 0.3, 0.5]), "grad/q<x>": ("grad_input", [0.01, 1.0, 2.0])})
    root = parse(tensor_distributions(table, metrics))
    texts = ["".join(t.itertext()) for t in root.iter(f"{NS}text")]
    assert "out" in texts and "grad/q<x>" in texts  # every tensor labelled, escaped
    red = [e for e in root.iter(f"{NS}line") if e.get("stroke") == "#d62728"]
    assert len(red) == 2 + 1  # one threshold mark per tensor, and the legend's
    assert len([e for e in root.iter(f"{NS}rect") if e.get("fill-opacity") == "0.55"]) == 4  # two boxes a panel
    hist = parse(noise_floor_histograms(table, metrics))
    titles = ["".join(t.itertext()) for t in hist.iter(f"{NS}text")]
    assert "out  (n=4)" in titles and "grad_input  (n=3)" in titles
    bars = [e for e in hist.iter(f"{NS}rect") if e.get("fill-opacity") == "0.8"]
    assert 2 <= len(bars) <= 7  # each value in a bar (some share one)
    # nothing to draw: no figure (the page says so instead)
    empty = table.assign(max_rel=np.nan, noise_floor_ratio=np.nan)
    assert tensor_distributions(empty, metrics) is None and noise_floor_histograms(empty, metrics) is None
    # a run whose every case was declined: the column holds no number at all (object dtype)
    declined = table.assign(max_rel=None, noise_floor_ratio=None).astype({"noise_floor_ratio": object})
    assert noise_floor_histograms(declined, metrics) is None


def test_a_threshold_outside_the_data_widens_the_histogram_axis_and_infinite_ratios_are_left_out():
    table, metrics = table_of({"out": ("out", [0.01, 0.05, 0.2, 0.5])})
    metrics["threshold"] = 3.0
    table = pd.concat([table, table.iloc[:1].assign(noise_floor_ratio=np.inf)])  # read back from a results file
    root = parse(noise_floor_histograms(table, metrics))
    red = [e for e in root.iter(f"{NS}line") if e.get("stroke") == "#d62728"]
    assert len(red) == 1
    ticks = {"".join(t.itertext()): float(t.get("x")) for t in root.iter(f"{NS}text")}
    # the line sits at log10(3) = 0.48 on the axis: right of the 0 tick, not clipped onto it
    assert float(red[0].get("x1")) > ticks["0"] + 5
    assert "out  (n=4)" in ticks  # the infinite ratio is not counted


def test_a_narrow_range_still_gets_axis_labels():
    table, metrics = table_of({"out": ("out", [0.35, 0.4, 0.45])})  # log10: -0.46 .. -0.35, inside half a decade
    metrics["threshold"] = 0.48
    root = parse(noise_floor_histograms(table, metrics))
    labels = ["".join(t.itertext()) for t in root.iter(f"{NS}text")]
    assert "-0.5" in labels and "0" in labels
