"""Coverage: features are computed right, every declared cell of every suite is hit, a missed cell is an error."""

import pytest

from cases import BshdLayout, Case, CaseError
from cases.coverage import (FEATURES, cell_name, check_coverage, coverage_counts, features, format_table,
                            missing_cells, parse_cell)
from cases.packing import Segment, build_layout, capacity_for
from cases.profiles import TINY_CONFIG
from cases.suites import SUITES, load_suite, suite_names


def thd_case(segments, slack=0, capacity="none", ratio=4, **kw):
    plain = build_layout(segments, slack=slack)
    layout = build_layout(segments, slack=slack, capacity=capacity_for(plain, ratio, capacity))
    return Case(config=TINY_CONFIG.replace(compress_ratio=ratio), layout=layout, **kw)


@pytest.mark.parametrize("name", suite_names())
def test_every_declared_cell_is_hit(name):
    cases = load_suite(name)
    counts = coverage_counts(cases, SUITES[name].required_cells)
    assert [cell_name(c) for c, n in counts if n == 0] == []
    check_coverage(cases, SUITES[name].required_cells, name)


def test_a_missing_cell_is_an_error_naming_it():
    # negative control: drop every case that hits one declared cell
    cells = SUITES["smoke"].required_cells
    cell = parse_cell("layout=thd dense_mode=true")
    assert cell in cells
    kept = [c for c in load_suite("smoke") if not (c.is_thd and c.config.csa_dense_mode)]
    assert missing_cells(load_suite("smoke"), cells) == []
    assert cell in missing_cells(kept, cells)
    with pytest.raises(CaseError) as err:
        check_coverage(kept, cells, "smoke")
    assert err.value.field == "suites.smoke.required_cells"
    assert "layout=thd dense_mode=true" in str(err.value)


def test_plain_packing_has_no_packing_feature():
    f = features(thd_case([Segment(20, 20), Segment(9, 9)]))
    for name in ("alignment_padding", "zero_length_segment", "cu_capacity_padding", "dummy_tail", "slack",
                 "identical_segments"):
        assert f[name] is False, name
    assert f["capacity"] == "none" and f["sequences"] == "2-3" and f["layout"] == "thd"
    assert f["partial_block"] and not f["short_segment"] and f["window_saturated"]
    assert set(f) == set(FEATURES)


def test_each_packing_feature_is_detected():
    def f(segments, **kw):
        return features(thd_case(segments, **kw))

    assert f([Segment(5, 8)])["alignment_padding"]
    assert f([Segment(0, 0), Segment(5, 5)])["zero_length_segment"]
    assert not f([Segment(5, 5), Segment(0, 0)])["zero_length_segment"]
    assert f([Segment(5, 5), Segment(0, 0)])["cu_capacity_padding"]
    assert f([Segment(5, 5), Segment(0, 7)])["dummy_tail"]
    assert not f([Segment(5, 5), Segment(0, 7)])["alignment_padding"]  # a dummy segment is not alignment padding
    assert f([Segment(5, 5)], slack=3)["slack"]
    assert f([Segment(5, 8), Segment(5, 8)])["identical_segments"]
    assert not f([Segment(5, 8), Segment(5, 9)])["identical_segments"]
    assert f([Segment(3, 3), Segment(8, 8)])["short_segment"]
    assert f([Segment(8, 8)])["block_aligned"]
    assert f([Segment(40, 40)], capacity="production")["capacity"] == "production"
    assert f([Segment(40, 40), Segment(3, 3), Segment(3, 3)], capacity="exact")["capacity"] == "exact"
    assert f([Segment(40, 40)], capacity="over")["capacity"] == "over"
    assert f([Segment(40, 40)], ratio=0)["capacity"] == "n/a"


def test_loss_and_topk_features():
    case = thd_case([Segment(4 * 4 + 4, 4 * 4 + 4)])  # K=4: 5 compressed keys at the last row
    assert features(case)["topk_saturated"] and features(case)["loss"] == "sparse"
    assert not features(thd_case([Segment(16, 16)]))["topk_saturated"]  # exactly K keys: nothing to choose
    assert features(case.replace(training=False))["loss"] == "none"
    assert features(case.replace(training=False))["reduction"] == "n/a"
    bshd = Case(config=TINY_CONFIG.replace(compress_ratio=4, calculate_per_token_loss=True),
                layout=BshdLayout(2, 9))
    fb = features(bshd)
    assert (fb["layout"], fb["reduction"], fb["sequences"], fb["capacity"]) == ("bshd", "per_token", "2-3", "n/a")


def test_cells_parse_and_print():
    cell = parse_cell("layout=thd slack=true ratio=4")
    assert cell == (("layout", "thd"), ("slack", True), ("ratio", "4"))
    assert cell_name(cell) == "layout=thd slack=true ratio=4"
    for bad in ("colour=red", "layout", ""):
        with pytest.raises(CaseError) as err:
            parse_cell(bad)
        assert err.value.field == "cell"


def test_format_table_marks_missing_cells():
    cases = load_suite("smoke")[:3]
    text = format_table(cases, SUITES["smoke"].required_cells)
    assert "MISSING" in text and "feature values" in text
    assert "MISSING" not in format_table(load_suite("smoke"), SUITES["smoke"].required_cells)
