"""The planted-bug registry (parity/mutation/mutants.py): every patch names a real function of the composition, planting is
scoped and nests, it reaches every ``fused`` module that imported the function, and ``fused`` knows nothing of it."""

from __future__ import annotations

import pathlib

import pytest
import torch

import importlib

import fused.index_maps
import fused.thd
from cases.coverage import parse_cell
from parity.mutation import mutants

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = importlib.import_module("fused.rows")  # imports causal_visible by name


def test_every_mutant_has_cells_and_patches_real_functions():
    assert len(mutants.MUTANTS) >= 17
    for name, mutant in mutants.MUTANTS.items():
        assert mutant.description and mutant.reach and mutant.patches, name
        for text in mutant.reach:
            if text:
                parse_cell(text)
        for patch in mutant.patches:
            owner, attr = mutants._resolve(patch.target)
            assert callable(getattr(owner, attr)), patch.target


def test_a_patch_naming_a_missing_function_is_refused():
    """Negative control: a seam renamed in fused must break the registry, not plant nothing."""
    bad = mutants.Mutant("renamed_seam", "x", mutants.ANY, (mutants.Patch("fused.index_maps:no_such_fn", id),))
    with pytest.raises(AttributeError):
        with mutants._planted(bad):
            pass


def test_planting_reaches_every_importer_and_is_undone():
    original = fused.index_maps.causal_visible
    assert ROWS.causal_visible is original  # imported by name: the patch must reach this copy too
    pos = torch.arange(8)
    with mutants.activate("compressed_causal_off_by_one") as active:
        assert active == {"compressed_causal_off_by_one"}
        assert ROWS.causal_visible is fused.index_maps.causal_visible is not original
        assert torch.equal(ROWS.causal_visible(pos, 4), original(pos, 4) + 1)
    assert ROWS.causal_visible is original and fused.index_maps.causal_visible is original
    assert mutants.active() == frozenset()


def test_methods_and_nesting():
    positions = fused.thd.ThdMeta.positions
    with mutants.activate("global_rope_positions"):
        assert fused.thd.ThdMeta.positions is not positions
        with mutants.activate("view_over_batch"):
            assert mutants.active() == {"global_rope_positions", "view_over_batch"}
        assert mutants.active() == {"global_rope_positions"}
    assert fused.thd.ThdMeta.positions is positions


def test_object_attributes_are_removed_again():
    from fused.plan import kernels

    with mutants.activate("thd_dense_bwd_no_max_seqlen"):
        assert "dense_indexer_backward" in vars(kernels)
    assert "dense_indexer_backward" not in vars(kernels)  # back to the dispatcher's own lookup


def test_activation_is_undone_when_the_block_raises():
    original = fused.index_maps.causal_visible
    with pytest.raises(RuntimeError):
        with mutants.activate("compressed_causal_off_by_one"):
            raise RuntimeError("boom")
    assert fused.index_maps.causal_visible is original and mutants.active() == frozenset()


def test_unknown_names_are_refused():
    """Negative control: a typo in a mutation suite must not silently test the unmutated code."""
    with pytest.raises(KeyError, match="unknown mutant"):
        with mutants.activate("view_over_bacth"):
            pass


def test_reach_is_recorded_only_when_the_planted_code_runs():
    mutants.clear_reached()
    with mutants.activate("compressed_causal_off_by_one"):
        assert mutants.reached() == frozenset()
        fused.index_maps.causal_visible(torch.arange(4), 4)
        assert mutants.reached() == {"compressed_causal_off_by_one"}
    mutants.clear_reached()


def test_fused_holds_no_planted_bug():
    """The composition is production code only: nothing in fused/ refers to the mutation machinery."""
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "fused").rglob("*.py") if "mutants" in p.read_text()]
    assert hits == []
