"""Stored suites equal their regeneration, have the promised shape, and are looked up by name and id."""

import json

import pytest

from cases import CaseError
from cases.coverage import features
from cases.suites import (SUITES, build_suite, find_case, gpu_subset, id_repro, load_suite, render_suite,
                          suite_names, suite_path)


@pytest.mark.parametrize("name", suite_names())
def test_stored_file_equals_regeneration(name):
    assert suite_path(name).read_text() == render_suite(name, build_suite(name)), \
        f"stale cases/suites/{name}.json: run `python -m cases.suites --write {name}`"


def test_a_tampered_file_is_detected(tmp_path):
    # negative control for the staleness check: one changed seed makes the rendering differ
    cases = build_suite("smoke")
    tampered = [cases[0].replace(seed=cases[0].seed + 1)] + cases[1:]
    assert render_suite("smoke", tampered) != suite_path("smoke").read_text()


@pytest.mark.parametrize("name", suite_names())
def test_files_are_valid_json_with_a_header(name):
    data = json.loads(suite_path(name).read_text())
    assert data["name"] == name and data["version"] == SUITES[name].version
    assert len(data["cases"]) == len(load_suite(name))
    ids = [c.id for c in load_suite(name)]
    assert len(set(ids)) == len(ids)


def test_smoke_shape():
    cases = load_suite("smoke")
    assert len(cases) >= 40
    assert {c.profile for c in cases} == {"tiny"} and {c.device for c in cases} == {"any"}
    assert {c.dtype for c in cases} == {"float64", "float32", "bfloat16"}
    assert {c.scope for c in cases} == {"layer", "core"}
    assert {c.is_thd for c in cases} == {True, False}
    assert {c.config.compress_ratio for c in cases} == {0, 4, 128}
    assert any(c.config.csa_dense_mode for c in cases)
    assert {(c.loss_mode, c.loss_reduction) for c in cases if c.loss_mode != "none"} == \
        {(m, r) for m in ("dense", "sparse") for r in ("mean", "per_token")}
    assert max(c.layout.num_tokens for c in cases) <= 300
    for c in cases:
        if c.config.compress_ratio == 128:  # HCA cases must compress something
            lengths = c.layout.real_lengths if c.is_thd else (c.layout.seq_len,)
            assert max(lengths) >= 128, c.id


def test_gate_shape_is_what_sm90_kernels_accept():
    cases = load_suite("gate")
    assert len(cases) >= 200
    for c in cases:
        k = c.config
        assert (c.profile, c.device, c.dtype) == ("kernel", "cuda", "bfloat16")
        assert (k.v_head_dim, k.qk_pos_emb_head_dim, k.csa_window_size) == (512, 64, 128)
        assert k.num_attention_heads in (64, 128)
        assert (k.dsa_indexer_n_heads, k.dsa_indexer_head_dim) == (64, 128)
        assert k.dsa_indexer_topk % 128 == 0


def test_nightly_and_production_shapes():
    nightly = load_suite("nightly")
    assert {c.profile for c in nightly} == {"tiny", "kernel"} and len(nightly) > len(load_suite("gate"))
    production = load_suite("production")
    assert {c.profile for c in production} == {"flash", "pro"}
    flash = next(c.config for c in production if c.profile == "flash")
    pro = next(c.config for c in production if c.profile == "pro")
    assert (flash.hidden_size, flash.num_attention_heads, flash.q_lora_rank, flash.dsa_indexer_topk) == \
        (4096, 64, 1024, 512)
    assert (pro.hidden_size, pro.num_attention_heads, pro.o_groups, pro.dsa_indexer_topk) == (7168, 128, 16, 1024)
    padded = [c for c in production if c.is_thd and features(c)["dummy_tail"]]
    assert padded and all(features(c)["capacity"] == "production" for c in padded)


def test_find_case_and_repro():
    case = load_suite("smoke")[5]
    assert find_case("smoke", case.id) == case
    assert find_case("smoke", case.id[:10]) == case
    assert id_repro(case, "smoke") == f"dsv4-parity run --case-id {case.id} --suite smoke"
    with pytest.raises(CaseError) as err:
        find_case("smoke", "000000000000")
    assert err.value.field == "case_id"
    with pytest.raises(CaseError) as err:
        load_suite("no-such-suite")
    assert err.value.field == "suite" and "smoke" in str(err.value)


def test_load_suite_returns_a_fresh_list():
    a = load_suite("smoke")
    a.clear()
    assert load_suite("smoke")


def test_gpu_subset_is_the_small_gate_cases_plus_the_smallest_ratio_128_ones():
    gate = load_suite("gate")
    subset = gpu_subset(256, 2)
    ids = [c.id for c in subset]
    assert len(ids) == len(set(ids)) == 58  # the H200 baseline subset (.ci/h200-gate.sh)
    small = {c.id for c in gate if c.layout.num_tokens <= 256}
    big = sorted((c for c in gate if c.config.compress_ratio == 128 and c.layout.num_tokens > 256),
                 key=lambda c: c.layout.num_tokens)
    assert set(ids) == small | {c.id for c in big[:2]}
    assert big[2].id not in ids and {c.layout.kind for c in subset} == {"bshd", "thd"}
    assert {c.config.compress_ratio for c in subset} == {0, 4, 128}
    assert len(gpu_subset(256, 0)) == len(small)  # control: the ratio-128 extras are exactly r128 cases
