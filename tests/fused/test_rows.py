"""The row space of a fused call (``fused.rows.RowSpace``): per-row metadata computed once, checked against hand
values and against the data model's own real-row mask (an independent implementation in ``cases``)."""

from __future__ import annotations

import torch

from cases.layout import ThdLayout
from fused.rows import RowSpace
from fused.thd import ThdMeta

I32 = torch.int32


def packed(layout: ThdLayout) -> RowSpace:
    return RowSpace.packed(ThdMeta.from_params(layout.packed_seq_params(4), layout.total_tokens))


def test_thd_row_metadata_by_hand():
    # segments: padded [0,4) real 3, [4,4) empty, [4,9) real 5; slack rows 9, 10
    rows = packed(ThdLayout(cu_seqlens=(0, 3, 3, 8), cu_seqlens_padded=(0, 4, 4, 9), total_tokens=11))
    assert rows.rows == 11 and rows.is_thd
    assert rows.segment.tolist() == [0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2]
    assert rows.offset.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]
    assert rows.inside.tolist() == [True] * 9 + [False] * 2
    assert rows.seg_len.tolist() == [4] * 4 + [5] * 7
    assert rows.padding.tolist() == [False, False, False, True] + [False] * 5 + [True, True]
    assert rows.window_ids(2).tolist() == [[0, -1], [0, 1], [1, 2], [2, 3], [0, -1], [0, 1], [1, 2], [2, 3],
                                           [3, 4], [-1, -1], [-1, -1]]
    cu_comp = torch.tensor([0, 1, 1, 2], dtype=I32)
    assert rows.visible(4, 2, cu_comp).tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0]
    assert rows.compressed_ids(4, cu_comp, 2)[:, 0].tolist() == [-1, -1, -1, 4, -1, -1, -1, 5, 5, -1, -1]
    local = torch.tensor([[0], [-1]] * 5 + [[0]], dtype=I32)
    cu_full = torch.tensor([0, 5, 5, 11], dtype=I32)
    assert rows.to_global(local, cu_full)[:, 0].tolist() == [0, -1, 0, -1, 5, -1, 5, -1, 5, -1, 5]
    assert set(rows.kernel_kwargs(cu_comp, 2)) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}


def test_padding_rows_match_the_data_models_real_rows():
    layout = ThdLayout(cu_seqlens=(0, 5, 5, 12, 12), cu_seqlens_padded=(0, 8, 8, 16, 16), total_tokens=20)
    rows = packed(layout)
    assert torch.equal(rows.padding, ~layout.real_row_mask())
    other = ThdLayout(cu_seqlens=(0, 8, 8, 16, 16), cu_seqlens_padded=(0, 8, 8, 16, 16), total_tokens=20)
    assert not torch.equal(rows.padding, ~other.real_row_mask())  # control: another packing's mask differs


def test_sbhd_rows_are_s_major_and_have_no_padding():
    rows = RowSpace.sbhd(3, 2, "cpu")
    assert rows.rows == 6 and not rows.is_thd and rows.padding is None and rows.kernel_kwargs(None, 0) == {}
    assert rows.compressed_offset() == 3
    assert rows.visible(2, 1).tolist() == [0, 1, 1, 0, 1, 1]  # b-major: the indexer kernels' order
    local = torch.tensor([[[0], [1], [2]], [[2], [-1], [0]]], dtype=I32)  # (B=2, S=3, K=1)
    assert rows.to_global(local)[:, 0].tolist() == [0, 5, 2, -1, 4, 1]  # row s*B + b: local*B + b
