"""Structural invariants of the composition: packed kv_full, flat-global ids, padding rows, the fake batch of 1."""

from __future__ import annotations

import pytest
import torch

import fused
from cases.layout import PackedSeqParams
from cases.tensors import materialize
from fused import index_maps, indexer_loss, sparse_attention
from fused.rows import RowSpace
from fused.thd import ThdMeta

from .helpers import run, thd_case

I32 = torch.int32


def test_cat_per_segment_routes_capacity_rows_to_tail_slots_no_valid_id_reaches():
    cu_kv = torch.tensor([0, 6, 6, 13], dtype=I32)        # a zero-length segment; 2 slack kv rows (15 total)
    cu_comp = index_maps.cu_seqlens_compressed(cu_kv, 4)  # [0, 1, 1, 2]: 2 true rows
    cu_full = index_maps.cu_seqlens_kv_full(cu_kv, cu_comp)
    kv = torch.arange(15, dtype=torch.float64).unsqueeze(-1)
    comp = 100 + torch.arange(6, dtype=torch.float64).unsqueeze(-1)  # capacity 6: rows 2..5 are padding
    rows = RowSpace.packed(ThdMeta.from_params(PackedSeqParams(cu_kv, cu_kv, 7), 15))
    full = index_maps.cat_per_segment(kv, comp, cu_kv, cu_comp, cu_full, rows.segment)
    assert full.shape[0] == 15 + 6
    n_valid = int(cu_full[-1])
    assert full[:n_valid, 0].tolist() == [0, 1, 2, 3, 4, 5, 100, 6, 7, 8, 9, 10, 11, 12, 101]
    tail = full[n_valid:, 0]
    assert tail[-4:].tolist() == [102, 103, 104, 105]          # invalid compressed row j -> slot total_kv + j
    assert torch.isnan(tail[:-4]).all()                          # slots nothing writes: NaN poison
    window = rows.window_ids(4)
    comp_ids = rows.compressed_ids(4, cu_comp, 3)
    ids = rows.to_global(torch.cat([window, comp_ids], -1), cu_full)
    assert int(ids.max()) < n_valid  # no valid id reaches a tail slot
    assert (ids[13:] == -1).all()     # slack rows have no key at all


def test_sbhd_flat_ids_are_local_times_batch_plus_b():
    local = torch.tensor([[[0, 2], [1, -1]], [[3, 0], [-1, 1]]], dtype=I32)  # (B=2, S=2, K=2)
    flat = RowSpace.sbhd(2, 2, "cpu").to_global(local)
    assert flat.tolist() == [[0, 4], [7, 1], [2, -1], [-1, 3]]  # rows s*B + b


def test_fake_batch_must_be_one():
    assert indexer_loss._drop_fake_batch(torch.zeros(1, 3)).shape == (3,)
    with pytest.raises(RuntimeError, match="fake batch of 1"):
        indexer_loss._drop_fake_batch(torch.zeros(2, 3))


def test_padding_rows_compute_values_but_send_no_gradient(monkeypatch):
    case = thd_case(4, [(9, 12), (0, 0), (13, 16)], slack=2, capacity=9, scope="core")  # random dO on padding rows
    t = materialize(case)
    pad = ~t.real_rows
    res, grads = run(fused, case, t)
    assert torch.isneginf(res.lse[-2:]).all() and (res.out[-2:] == 0).all()        # slack: no key
    assert (res.out[pad][:-2].abs().sum(-1) > 0).all()                               # alignment padding computed
    for name in ("query", "kv", "hidden"):  # q_latent only feeds the (detached) indexer
        assert (grads[name][pad] == 0).all(), name
    # negative control: without the dO / LSE masking a padding row's gradient is not zero
    original = sparse_attention.sparse_attention_backward
    monkeypatch.setattr(indexer_loss, "sparse_attention_backward",
                        lambda *a: original(*a[:-1], None))
    _, leaky = run(fused, case, t)
    assert not (leaky["query"][pad] == 0).all()
