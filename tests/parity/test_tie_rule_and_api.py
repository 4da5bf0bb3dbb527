"""Issue 16, §3 and §4 in ``run``: the declared top-k tie rule, and the public ``compressor()`` / ``indexer()``
compared on every case whose layer has them — each caught when planted (seam mutants), each with its control."""

from __future__ import annotations

import types

import pytest
import torch

import fused
from fused.rows import RowSpace
import reference
from fused.kernels.torch_provider import TorchKernels
from parity import impls
from parity.engine import RunOptions, run_case, snapshots
from parity.mutation.mutants import activate, clear_reached, reached
from tests.parity.helpers import pick

FUSED, REF = impls.load("fused"), impls.load("reference")
API = ("api/indexer.compressor", "api/indexer.index_scores", "api/indexer.topk_indices")


def _tied_case():
    """A smoke case whose own top-k has exactly tied rows at the K boundary (ReLU scores of 0 in float64): the
    first of a few seeds of a saturated-top-k smoke case whose draw gives one (whether a row ties is the draw's)."""
    for features in (dict(dtype="float64", layout="thd", loss="dense", topk_saturated=True),
                     dict(dtype="float32", layout="thd", loss="sparse", topk_saturated=True, sequences="1")):
        base = pick(**features)
        for offset in range(4):
            case = base.replace(seed=base.seed + offset)
            result = run_case(case, FUSED, REF, RunOptions())
            if result.topk and result.topk["exact_tied"]:
                return case, result
    pytest.fail("no smoke case with exactly tied rows")


def test_declared_tie_rules():
    assert REF.tie_rule() == "lower-index"
    assert FUSED.tie_rule({"indexer_top_k": "torch"}) == "lower-index"
    assert FUSED.tie_rule({"indexer_top_k": "cudnn"}) == "arbitrary"  # production radix top-k
    assert FUSED.tie_rule({"indexer_top_k": "torch+cudnn"}) == "arbitrary"
    assert FUSED.tie_rule({}) == "arbitrary"  # no top-k ran
    plain = impls.Implementation("plain", types.SimpleNamespace(attention_layer=None, core_attention=None))
    assert plain.tie_rule() == "arbitrary"  # undeclared: the value-based protocol only
    bad = impls.Implementation("bad", types.SimpleNamespace(TOPK_TIE_RULE="highest"))
    with pytest.raises(impls.ImplError, match="tie rule"):
        bad.tie_rule()


def test_a_tie_break_flip_fails_run_only_because_the_rule_is_declared(monkeypatch):
    case, clean = _tied_case()
    assert clean.outcome == "pass" and clean.topk["tie_rule"] == "lower-index", clean.message
    with activate("topk_tie_to_higher_index"):
        flipped = run_case(case, FUSED, REF, RunOptions())
    assert flipped.outcome == "fail" and flipped.first_failure["tensor"] == "topk_indices", flipped.message
    assert "declared tie rule" in flipped.message
    # control: declared "arbitrary", the same flip is a legitimate choice among exact ties and passes
    monkeypatch.setattr(TorchKernels, "topk_tie_rule", "arbitrary")
    with activate("topk_tie_to_higher_index"):
        loose = run_case(case, FUSED, REF, RunOptions())
    assert loose.outcome == "pass", loose.message


@pytest.mark.parametrize("features", [dict(layout="bshd", loss="sparse"),
                                      dict(layout="thd", ratio="4", capacity="production"),
                                      dict(layout="thd", ratio="128", capacity="over")])
def test_public_compressor_and_indexer_are_compared(features):
    case = pick(**features)
    result = run_case(case, FUSED, REF, RunOptions())
    assert result.outcome == "pass", result.message
    names = {t.name for t in result.tensors}
    assert "api/compressor" in names
    if case.config.has_indexer:
        assert set(API) <= names
        assert next(t for t in result.tensors if t.name == "api/indexer.topk_indices").rule == "tie_margin"
    _, impl, truth, _ = snapshots(case, FUSED, REF, RunOptions())
    if case.is_thd:  # only the true compressed rows, whatever the capacity
        true_rows = case.layout.cu_seqlens_compressed(case.config.compress_ratio)[-1]
        assert impl["api/compressor"].shape[0] == truth["api/compressor"].shape[0] == true_rows


def test_indexer_without_sigma_fails_only_the_api_scores():
    case = pick(ratio="4", dense_mode=False, loss="sparse", layout="thd")
    clear_reached()
    with activate("indexer_api_no_sigma"):
        result = run_case(case, FUSED, REF, RunOptions())
    assert "indexer_api_no_sigma" in reached()
    failed = {t.name for t in result.tensors if t.failed}
    assert result.outcome == "fail" and failed == {"api/indexer.index_scores"}, result.message
    assert result.first_failure["rule"] == "noise_floor"


def test_an_implementation_without_the_public_api_is_compared_on_the_layer_only():
    case = pick(ratio="4", dense_mode=False, loss="sparse", layout="bshd")
    layer_only = impls.Implementation("layer-only", types.SimpleNamespace(
        attention_layer=fused.attention_layer, core_attention=fused.core_attention))
    result = run_case(case, layer_only, REF, RunOptions(impl="layer-only"))
    assert result.outcome == "pass", result.message
    assert not any(t.name.startswith("api/") for t in result.tensors)


def test_contract_mutants_patch_and_restore_named_functions():
    original = fused.layer.padding_rows_pass_no_gradient
    names = ("layer_padding_dout_leaks", "topk_tie_to_higher_index", "indexer_api_no_sigma")
    with activate(*names):
        assert fused.layer.padding_rows_pass_no_gradient is not original
    assert fused.layer.padding_rows_pass_no_gradient is original
    assert reference.TOPK_TIE_RULE == "lower-index"
    with pytest.raises(KeyError, match="unknown mutant"):
        with activate("no_such_seam"):
            pass
    x = torch.zeros(2, 3)
    assert fused.layer.padding_rows_pass_no_gradient(x, RowSpace.sbhd(2, 1, x.device)) is x
