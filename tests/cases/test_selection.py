"""The split-mode ``topk_indices`` contract (``cases/selection.py``): one validation, the same error from both
implementations, naming the argument, the row and the offending value."""

from __future__ import annotations

import pytest
import torch

import fused
import reference
from cases.errors import CaseError
from cases.selection import check_topk_selection, compressed_columns
from cases.tensors import materialize
from tests.fused.helpers import bshd_case, run, thd_case

K = 3


def _bshd():
    case = bshd_case(4, 2, 17, dsa_indexer_topk=K)  # n_comp = 4 per sequence
    return case, materialize(case)


def _thd():
    case = thd_case(4, [(9, 12), (5, 8)], slack=3, dsa_indexer_topk=K)  # n_comp 3 and 2; 3 slack rows
    return case, materialize(case)


def _bad_selections(valid: torch.Tensor) -> dict:
    """name -> (selection, a fragment the message must contain)."""
    wide = torch.cat([valid, torch.full_like(valid[..., :2], -1)], -1)
    minus5 = valid.clone()
    minus5.view(-1, K)[3, 0] = -5
    high = valid.clone()
    high.view(-1, K)[5] = torch.tensor([0, 1, 40])
    padded_first = valid.clone()
    padded_first.view(-1, K)[6] = torch.tensor([-1, 0, 1])
    unsorted = valid.clone()
    unsorted.view(-1, K)[7] = torch.tensor([1, 0, -1])
    duplicate = valid.clone()
    duplicate.view(-1, K)[8] = torch.tensor([1, 1, -1])
    return {
        "width K+2": (wide, f"width {K + 2}, expected K = {K}"),
        "id -5": (minus5, "row"),
        "int32": (valid.int(), "dtype int32"),
        "out of range": (high, "id 40 is out of range"),
        "-1 before a real id": (padded_first, "follows -1 padding"),
        "descending": (unsorted, "strictly ascending"),
        "duplicate": (duplicate, "strictly ascending"),
        "floating": (valid.double(), "float64"),
        "wrong rows": (valid[..., :1, :] if valid.dim() == 3 else valid[:1], "must be int64"),
    }


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_both_implementations_raise_the_same_error_for_each_bad_selection(layout):
    case, t = _bshd() if layout == "bshd" else _thd()
    own, _ = run(reference, case, t)
    valid = own.topk_indices
    # negative control: the implementation's own selection is accepted by both
    for impl in (reference, fused):
        run(impl, case, t, topk_indices=valid)
    for name, (bad, fragment) in _bad_selections(valid).items():
        messages = []
        for impl in (reference, fused):
            with pytest.raises(CaseError) as info:
                run(impl, case, t, topk_indices=bad)
            messages.append(str(info.value))
        assert messages[0] == messages[1], (name, messages)
        assert messages[0].startswith("topk_indices"), (name, messages[0])
        assert fragment in messages[0], (name, messages[0])


def test_the_message_names_the_row_and_the_value():
    case, t = _bshd()
    ids = reference.attention_layer(t.inputs["hidden"], t.params, case.config).topk_indices
    bad = ids.clone()
    bad[1, 5, 0] = -5
    with pytest.raises(CaseError, match=r"topk_indices: row \[1, 5\]: id -5 is below -1"):
        check_topk_selection(bad, case.config, (2, 17))
    bad = ids.clone()
    bad[0, 16] = torch.tensor([0, 1, 4])
    with pytest.raises(CaseError, match=r"row \[0, 16\]: id 4 is out of range: the row's sequence has 4"):
        check_topk_selection(bad, case.config, (2, 17))


def test_thd_columns_per_row_follow_the_padded_segments_and_slack_has_none():
    case, t = _thd()
    cols = compressed_columns((t.inputs["hidden"].shape[0],), t.packed_seq_params)
    assert cols.tolist() == [3] * 12 + [2] * 8 + [0] * 3
    ids = torch.full((23, K), -1, dtype=torch.int64)
    check_topk_selection(ids, case.config, (23,), t.packed_seq_params)
    ids[21, 0] = 0  # a slack row selecting anything
    with pytest.raises(CaseError, match=r"row 21: id 0 is out of range"):
        check_topk_selection(ids, case.config, (23,), t.packed_seq_params)


def test_a_layer_without_indexer_refuses_a_selection():
    case = bshd_case(0, 1, 8)
    t = materialize(case)
    ids = torch.full((1, 8, case.config.dsa_indexer_topk), -1, dtype=torch.int64)
    for impl in (reference, fused):
        with pytest.raises(CaseError, match="no indexer"):
            run(impl, case, t, topk_indices=ids)
