"""A resumed run tests the Megatron-LM tree its run row recorded, not whatever ``DSV4_MEGATRON`` says now.

The device run of issue 28 resumed a `make parity RUN_ARGS='--impl megatron --megatron TREE'` gate that a deadline
cut: the resume found no tree (``--megatron`` had set ``DSV4_MEGATRON`` for the first command only) and stopped, or
with another ``DSV4_MEGATRON`` set it would have labelled a second revision's cases with the first's run.
"""

from __future__ import annotations

import argparse
import os

import pytest

from cases.errors import CaseError
from parity.run.resume import apply_recorded_options


def _row(root, origin="--megatron", revision="f" * 40):
    return {"type": "run", "options": {"impl": "megatron", "provider": "unfused"},
            "impl_info": {"megatron_root": str(root), "megatron_origin": origin, "revision": revision}}


def _args(**kw):
    return argparse.Namespace(impl="megatron", provider="unfused", megatron=None, threads=None, **kw)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("DSV4_MEGATRON", "/somewhere/else")
    monkeypatch.delenv("DSV4_MEGATRON_ORIGIN", raising=False)
    return monkeypatch


def test_resume_uses_the_recorded_tree(tmp_path, env):
    tree = tmp_path / "m608545cfc6"
    tree.mkdir()
    args = _args()
    apply_recorded_options(args, set(), _row(tree), tmp_path / "run")
    assert args.megatron == str(tree)
    assert os.environ["DSV4_MEGATRON"] == str(tree)
    assert os.environ["DSV4_MEGATRON_ORIGIN"] == "--megatron"


def test_resume_with_the_same_tree_given_is_accepted(tmp_path, env):
    tree = tmp_path / "tree"
    tree.mkdir()
    args = _args()
    args.megatron = str(tree)
    apply_recorded_options(args, {"megatron"}, _row(tree), tmp_path / "run")
    assert args.megatron == str(tree)


def test_resume_with_another_tree_conflicts(tmp_path, env):
    tree, other = tmp_path / "a", tmp_path / "b"
    tree.mkdir()
    other.mkdir()
    args = _args()
    args.megatron = str(other)
    with pytest.raises(CaseError, match="--megatron.*conflicts with the run being resumed"):
        apply_recorded_options(args, {"megatron"}, _row(tree), tmp_path / "run")


def test_resume_of_a_tree_that_is_gone_names_its_revision(tmp_path, env):
    with pytest.raises(CaseError, match="no longer exists") as raised:
        apply_recorded_options(_args(), set(), _row(tmp_path / "gone"), tmp_path / "run")
    assert "revision " + "f" * 40 in str(raised.value)


def test_the_pinned_snapshot_is_found_again_by_default(tmp_path, env):
    """Control: a run of the default tree (the pinned snapshot) sets nothing; neither does a fused run."""
    args = _args()
    apply_recorded_options(args, set(), _row(tmp_path, origin="snapshot"), tmp_path / "run")
    assert args.megatron is None and os.environ["DSV4_MEGATRON"] == "/somewhere/else"
    row = {"type": "run", "options": {"impl": "fused"}}
    apply_recorded_options(args, set(), row, tmp_path / "run")
    assert args.megatron is None
