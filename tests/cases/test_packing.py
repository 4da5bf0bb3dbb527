"""THD packing: the production capacity rule, and the sampler's validity, budget and forced features."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cases.coverage import features
from cases.packing import (Segment, build_layout, capacity_for, capacity_kind, edge_lengths, production_capacity,
                           sample_packing)
from cases.rng import Rng
from cases.suites import _padded_thd

from .strategies import thd_layouts


def test_production_capacity_on_the_native_padded_layout():
    # spec §9: segments [200, 150, 912], padded to multiples of 128, dummy tail to 2048 tokens, 8 sequences
    layout = _padded_thd([200, 150, 912], 128, 2048, 8)
    assert layout.padded_lengths == (256, 256, 1024, 512, 0, 0, 0, 0)
    assert layout.real_lengths == (200, 150, 912, 0, 0, 0, 0, 0)
    # min(T // r, N * (max_seqlen // r)) = min(2048 // 128, 8 * (1024 // 128)) = 16; the true count is 2+2+8+4
    assert production_capacity(layout, 128) == 16 == layout.compressed_capacity
    assert layout.cu_seqlens_compressed(128)[-1] == 16
    r4 = _padded_thd([200, 150, 912], 4, 2048, 8)
    assert r4.compressed_capacity == min(2048 // 4, 8 * (912 // 4)) == 512


def test_production_capacity_is_the_smaller_term():
    # N * (max_seqlen // r) binds: one long-ish segment in a big buffer
    layout = build_layout([Segment(10, 10)], slack=90)
    assert production_capacity(layout, 4) == 1 * (10 // 4) == 2


@settings(max_examples=200, deadline=None)
@given(thd_layouts())
def test_every_capacity_choice_holds_the_true_rows(layout):
    true_rows = layout.cu_seqlens_compressed(4)[-1]
    assert production_capacity(layout, 4) >= true_rows
    for choice in ("exact", "production", "over"):
        assert capacity_for(layout, 4, choice) >= true_rows
    assert capacity_for(layout, 4, "exact") == true_rows
    assert capacity_for(layout, 4, "over") > max(true_rows, production_capacity(layout, 4))
    assert capacity_kind(layout, 0) == "n/a"


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2 ** 32), st.sampled_from([0, 4, 128]), st.sampled_from([4, 8, 16]),
       st.sampled_from([2, 4, 8]))
def test_sampler_gives_valid_layouts_within_budget(seed, ratio, window, topk):
    budget = 300 if ratio == 128 else 96
    layout = sample_packing(Rng(seed), ratio=ratio, window=window, topk=topk, budget=budget)
    layout.validate()
    layout.validate_for_ratio(ratio)
    assert layout.num_real_rows >= 1


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_sampler_overshoot_is_the_exception(ratio):
    """The sampler may overshoot its budget (the generator rejects those layouts), but rarely, and far overshoot
    (> 3x: many short segments each aligned up to 128) rarely again. Measured over seeds 0..999 x 2 shapes:
    > budget 15 % (r 0, 4) / 26 % (r 128); > 3x budget 0 / 0 / 0.85 %. A fixed seed range, so the rate is exact:
    a per-example 3x bound made this a random failure (seed 62859, r 128: 1152 rows for a budget of 300)."""
    budget = 300 if ratio == 128 else 96
    totals = [sample_packing(Rng(seed), ratio=ratio, window=window, topk=topk, budget=budget).total_tokens
              for seed in range(1000) for window, topk in ((4, 2), (16, 8))]
    assert sum(t > budget for t in totals) / len(totals) <= 1 / 3
    assert sum(t > 3 * budget for t in totals) / len(totals) <= 0.02


@pytest.mark.parametrize("feature", ["alignment_padding", "zero_length_segment", "dummy_tail",
                                     "cu_capacity_padding", "slack"])
def test_forcing_a_feature_on_and_off(feature):
    on = [sample_packing(Rng(i, feature), ratio=4, window=8, topk=4, budget=96, force={feature: True})
          for i in range(20)]
    off = [sample_packing(Rng(i, feature), ratio=4, window=8, topk=4, budget=96, force={feature: False})
           for i in range(20)]
    case_feature = lambda layout: _features(layout)[feature]  # noqa: E731
    assert all(case_feature(x) for x in on)
    assert not any(case_feature(x) for x in off)


def _features(layout):
    from cases import Case
    from cases.profiles import TINY_CONFIG
    return features(Case(config=TINY_CONFIG.replace(compress_ratio=4), layout=layout))


def test_unforced_sampling_hits_rare_features_often():
    layouts = [sample_packing(Rng(i), ratio=4, window=8, topk=4, budget=96) for i in range(200)]
    feats = [_features(x) for x in layouts]
    for name in ("alignment_padding", "zero_length_segment", "dummy_tail", "cu_capacity_padding", "slack",
                 "identical_segments"):
        share = sum(f[name] for f in feats) / len(feats)
        assert 0.05 < share < 0.8, (name, share)
    assert {f["capacity"] for f in feats} == {"none", "exact", "production", "over"}


def test_edge_lengths():
    assert edge_lengths(4, 8, 4) == [1, 2, 3, 4, 5, 7, 8, 9, 16, 19, 20, 21]
    assert {127, 128, 129, 256, 257} <= set(edge_lengths(128, 8, 4))
