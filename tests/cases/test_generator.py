"""The generator: pinned cells are realised, contradictions are reported, results are pure functions of inputs."""

import pytest

from cases import CaseError
from cases.coverage import features, parse_cell
from cases.generator import Unsatisfiable, generate, sample_case
from cases.profiles import PROFILES, get_profile
from cases.rng import Rng

TINY, KERNEL = PROFILES["tiny"], PROFILES["kernel"]


@pytest.mark.parametrize("text", [
    "layout=thd ratio=4 loss=sparse reduction=per_token alignment_padding=true",
    "layout=thd ratio=128 dummy_tail=true capacity=production",
    "layout=bshd loss=dense reduction=mean topk_saturated=true",
    "layout=thd short_segment=true loss=sparse zero_length_segment=true",
    "scope=core dtype=bfloat16 ratio=0 slack=true",
    "dense_mode=true layout=thd identical_segments=true",
    "ratio=4 dense_mode=false loss=none",
])
@pytest.mark.parametrize("profile", [TINY, KERNEL])
def test_pinned_cell_is_realised(text, profile):
    cell = parse_cell(text)
    for i in range(3):
        case = sample_case(Rng(i, text), profile, dict(cell))
        f = features(case)
        assert all(f[k] == v for k, v in cell), (text, f)
        assert case.layout.num_tokens <= profile.max_tokens[case.config.compress_ratio]
        assert case.profile == profile.name and case.device == profile.device


def test_contradictory_cell_is_unsatisfiable():
    # negative control for the pinning: a loss needs the ratio-4 indexer
    with pytest.raises(Unsatisfiable) as err:
        sample_case(Rng(0), TINY, dict(parse_cell("ratio=0 loss=sparse")), attempts=20)
    assert err.value.field == "pins" and "ratio=0 loss=sparse" in str(err.value)
    with pytest.raises(CaseError) as err:
        sample_case(Rng(0), TINY, {"colour": "red"})
    assert err.value.field == "pins.colour"


def test_generate_is_deterministic_and_covers_cells():
    cells = [parse_cell("layout=thd slack=true ratio=128"), parse_cell("dtype=float32 loss=dense")]
    a = generate(TINY, 5, 12, cells)
    b = generate(TINY, 5, 12, cells)
    assert [c.to_json() for c in a] == [c.to_json() for c in b] and len(a) == 12
    assert len({c.id for c in a}) == 12
    for cell in cells:
        assert any(all(features(c)[k] == v for k, v in cell) for c in a)
    assert [c.id for c in generate(TINY, 6, 12, cells)] != [c.id for c in a]  # the seed matters


def test_loss_flags_are_canonical_without_a_loss():
    for case in generate(TINY, 1, 60):
        if case.loss_mode == "none":
            assert case.config.calculate_per_token_loss is False
            assert case.config.dsa_indexer_use_sparse_loss is True


def test_rng_is_stable():
    # pinned values: if this changes, every stored suite changes (bump GENERATOR_VERSION and regenerate)
    r = Rng(1, "x")
    assert [r.below(1000) for _ in range(5)] == [192, 129, 508, 513, 797]
    assert Rng(0).next64() == 14582661058120652371
    assert Rng(1, "x").next64() != Rng(1, "y").next64()  # labels give independent streams
    r = Rng(3)
    draws = [r.weighted([("a", 1), ("b", 3)]) for _ in range(400)]
    assert 0.15 < draws.count("a") / 400 < 0.35


def test_unknown_profile():
    with pytest.raises(CaseError) as err:
        get_profile("huge")
    assert err.value.field == "profile"
