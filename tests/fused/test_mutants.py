"""The planted-bug registry: names must be registered, activation is scoped and nests, inactive costs a set lookup."""

from __future__ import annotations

import pytest

from fused import mutants


def test_review_bugs_are_registered():
    names = mutants.registered()
    for name in (mutants.THD_DENSE_BWD_NO_MAX_SEQLEN, mutants.VIEW_OVER_BATCH, mutants.INVALID_COMP_ROWS_OOB):
        assert name in names and names[name]


def test_activate_is_scoped_and_nests():
    a, b = mutants.VIEW_OVER_BATCH, mutants.INVALID_COMP_ROWS_OOB
    assert not mutants.is_active(a)
    with mutants.activate(a):
        assert mutants.is_active(a) and not mutants.is_active(b)
        with mutants.activate(b):
            assert mutants.is_active(a) and mutants.is_active(b)
        assert not mutants.is_active(b)
    assert mutants.active() == frozenset()


def test_activation_is_undone_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with mutants.activate(mutants.VIEW_OVER_BATCH):
            raise RuntimeError("boom")
    assert not mutants.is_active(mutants.VIEW_OVER_BATCH)


def test_unknown_names_are_refused():
    """Negative control: a typo in a mutation suite must not silently test the unmutated code."""
    with pytest.raises(KeyError, match="unknown mutant"):
        with mutants.activate("view_over_bacth"):
            pass


def test_register_is_idempotent_but_refuses_a_conflicting_description(monkeypatch):
    monkeypatch.setattr(mutants, "_REGISTRY", dict(mutants._REGISTRY))  # keep the real registry clean
    name = mutants.register("test_only_mutant", "a test")
    assert mutants.register(name, "a test") == name
    with pytest.raises(ValueError, match="already registered"):
        mutants.register(name, "something else")
