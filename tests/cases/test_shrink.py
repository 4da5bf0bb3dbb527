"""The shrinker reduces planted failures to their minimal form, and only accepts cases that still fail."""

import pytest

from cases import BshdLayout, Case, CaseError
from cases.coverage import features
from cases.packing import Segment, build_layout, capacity_for
from cases.profiles import TINY_CONFIG
from cases.shrink import candidates, shrink, size


def big_thd_case():
    segs = [Segment(30, 32), Segment(0, 0), Segment(7, 7), Segment(19, 24), Segment(19, 24), Segment(0, 9),
            Segment(0, 0)]
    plain = build_layout(segs, slack=5)
    layout = build_layout(segs, slack=5, capacity=capacity_for(plain, 4, "production"))
    config = TINY_CONFIG.replace(compress_ratio=4, num_attention_heads=8, csa_window_size=16, dsa_indexer_topk=8)
    return Case(config=config, layout=layout, dtype="bfloat16", scope="layer", training=True, seed=7)


def planted(case: Case) -> bool:
    """'Fails' iff a THD segment of >= 5 real tokens has alignment padding, with >= 2 heads, at ratio 4."""
    return (case.is_thd and case.config.compress_ratio == 4 and case.config.num_attention_heads >= 2
            and any(r >= 5 and p > r for r, p in zip(case.layout.real_lengths, case.layout.padded_lengths)))


def test_planted_thd_failure_shrinks_to_its_minimal_form():
    case = big_thd_case()
    assert planted(case)
    small = shrink(case, planted)
    assert planted(small)
    assert small.layout.cu_seqlens == (0, 5) and small.layout.cu_seqlens_padded == (0, 6)
    assert small.layout.total_tokens == 6 and small.layout.compressed_capacity is None
    c = small.config
    assert (c.num_attention_heads, c.csa_window_size, c.dsa_indexer_topk) == (2, 1, 1)
    assert (small.dtype, small.scope, small.training) == ("float64", "core", False)
    assert small.tags == (f"shrunk from {case.id}",)
    # 1-minimal: no single move from the result still fails
    assert not any(planted(cand) for _, cand in candidates(small) if size(cand) < size(small))


def test_planted_bshd_failure_shrinks_to_its_minimal_form():
    case = Case(config=TINY_CONFIG.replace(compress_ratio=128), layout=BshdLayout(3, 200), dtype="float32")
    small = shrink(case, lambda c: not c.is_thd and c.layout.batch * c.layout.seq_len >= 10)
    assert small.layout == BshdLayout(1, 10)


def test_shrinking_keeps_the_capacity_kind():
    case = big_thd_case()
    keep_cap = lambda c: planted(c) and features(c)["capacity"] == "production"  # noqa: E731
    small = shrink(case, keep_cap)
    assert features(small)["capacity"] == "production" and small.layout.num_segments == 1


def test_no_progress_without_predicate_calls():
    # negative control: with no predicate calls allowed the case is returned as it was (the minimal-form
    # assertions above would fail on it)
    case = big_thd_case()
    assert shrink(case, planted, max_calls=0) == case


def test_predicate_must_hold_on_the_original():
    with pytest.raises(CaseError) as err:
        shrink(big_thd_case(), lambda c: False)
    assert err.value.field == "predicate"


def test_a_crashing_predicate_counts_as_not_failing():
    case = big_thd_case()

    def predicate(c):
        if c.id != case.id:
            raise RuntimeError("a different failure")
        return True

    assert shrink(case, predicate) == case


def test_log_prints_the_minimal_repro():
    lines = []
    small = shrink(big_thd_case(), planted, log=lines.append)
    assert small.id in lines[-1] and "predicate calls" in lines[-1]
    assert not any(small.repro in line for line in lines)  # the caller prints the repro, with its options
    assert Case.from_json(small.to_json()) == small
