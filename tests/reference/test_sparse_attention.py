"""Sparse attention over window ∪ compressed ∪ sink (spec §4): oracle, LSE convention, empty rows, chunking."""

from __future__ import annotations

import math

import pytest
import torch

import reference.numerics as numerics
from reference.sparse_attention import (all_compressed_indices, selected_compressed_indices, sparse_attention,
                                        window_indices)


def attention_oracle(q, kv_full, key_sets, sink, scale, *, with_sink=True, sink_in_lse=False):
    """Loop over rows and heads; ``key_sets[i]`` is the set of kv_full rows of query row ``i`` (one sequence)."""
    S, n, D = q.shape
    out = torch.zeros(S, n, D, dtype=torch.float64)
    lse = torch.full((S, n), float("-inf"), dtype=torch.float64)
    for i in range(S):
        keys = sorted(key_sets[i])
        for h in range(n):
            logits = [scale * float(q[i, h] @ kv_full[k]) for k in keys]
            denom = sum(math.exp(x) for x in logits) + (math.exp(float(sink[h])) if with_sink else 0.0)
            for k, x in zip(keys, logits):
                out[i, h] += math.exp(x) / denom * kv_full[k]
            mass = sum(math.exp(x) for x in logits) + (math.exp(float(sink[h])) if sink_in_lse else 0.0)
            if mass > 0:
                lse[i, h] = math.log(mass)
    return out, lse


def key_sets_of(S, W, ratio, n_comp, selected=None):
    """Window ∪ compressed sets written from the definitions of spec §4.1 (independent of the index helpers)."""
    sets = []
    for i in range(S):
        keys = set(range(max(0, i - W + 1), i + 1))
        visible = [g for g in range(n_comp) if g < (i + 1) // ratio]
        if selected is not None:
            visible = [g for g in visible if g in selected[i]]
        sets.append(keys | {S + g for g in visible})
    return sets


def setup(S=21, n=2, D=8, W=4, ratio=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_comp = S // ratio
    q = torch.randn(1, S, n, D, generator=g, dtype=torch.float64)
    kv_full = torch.randn(1, S + n_comp, D, generator=g, dtype=torch.float64)
    sink = torch.randn(n, generator=g, dtype=torch.float64)
    return q, kv_full, sink, n_comp


@pytest.mark.parametrize("mode", ["all", "selected", "window_only"])
def test_sparse_attention_matches_loop_oracle(mode):
    S, W, ratio = 21, 4, 4
    q, kv_full, sink, n_comp = setup(S=S, W=W, ratio=ratio)
    win = window_indices(S, W)
    if mode == "all":
        idx, selected = torch.cat((win, all_compressed_indices(S, ratio, n_comp)), -1), None
    elif mode == "selected":
        topk = torch.tensor([[g for g in (1, 3, 4) if g < n_comp] + [-1] for _ in range(S)])
        idx = torch.cat((win, selected_compressed_indices(topk[None], S, ratio, n_comp)[0]), -1)
        selected = [set(r.tolist()) for r in topk]
    else:
        idx, selected, n_comp = win, None, 0
    out, lse = sparse_attention(q, kv_full, idx[None], sink, 0.3)
    want_out, want_lse = attention_oracle(q[0], kv_full[0], key_sets_of(S, W, ratio, n_comp, selected), sink, 0.3)
    assert torch.allclose(out[0], want_out, rtol=0, atol=1e-13)
    assert torch.allclose(lse[0], want_lse, rtol=0, atol=1e-13)
    # negative controls: dropping the sink, or putting it into the LSE, are different conventions
    no_sink, _ = attention_oracle(q[0], kv_full[0], key_sets_of(S, W, ratio, n_comp, selected), sink, 0.3,
                                  with_sink=False)
    _, lse_with_sink = attention_oracle(q[0], kv_full[0], key_sets_of(S, W, ratio, n_comp, selected), sink, 0.3,
                                        sink_in_lse=True)
    assert not torch.allclose(out[0], no_sink, atol=1e-6) and not torch.allclose(lse[0], lse_with_sink, atol=1e-6)


def test_index_helpers():
    assert window_indices(5, 3).tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert all_compressed_indices(9, 4, 2).tolist() == [[-1, -1]] * 3 + [[9, -1]] * 4 + [[9, 10]] * 2
    topk = torch.tensor([[[1, 0], [1, -1], [0, 1]] + [[0, 1]] * 5])  # a sequence of 8 (n_comp 2), ratio 4
    got = selected_compressed_indices(topk, 8, 4, 2)[0]
    assert got[:3].tolist() == [[-1, -1]] * 3  # rows 0..2 see no entry
    assert got[3].tolist() == [8, -1] and got[7].tolist() == [8, 9]  # causal post-filter, ids offset by S


def test_row_without_keys_gives_zero_output_minus_inf_lse_and_finite_gradients():
    q, kv_full, sink, _ = setup(S=3)
    q.requires_grad_(True)
    kv_full.requires_grad_(True)
    sink.requires_grad_(True)
    idx = torch.tensor([[[0, -1], [-1, -1], [1, 2]]])
    out, lse = sparse_attention(q, kv_full, idx, sink, 0.5)
    assert bool((out[0, 1] == 0).all()) and bool(torch.isneginf(lse[0, 1]).all())
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for t in (q, kv_full, sink):
        assert bool(torch.isfinite(t.grad).all())
    assert bool((q.grad[0, 1] == 0).all())
    # control: a row with keys does get a gradient
    assert bool((q.grad[0, 2] != 0).any())


def test_result_does_not_depend_on_row_chunking(monkeypatch):
    q, kv_full, sink, n_comp = setup(S=37)
    idx = torch.cat((window_indices(37, 4), all_compressed_indices(37, 4, n_comp)), -1)[None]
    base = sparse_attention(q, kv_full, idx, sink, 0.3)
    monkeypatch.setattr(numerics, "ROW_CHUNK", 5)
    chunked = sparse_attention(q, kv_full, idx, sink, 0.3)
    for a, b in zip(base, chunked):
        assert torch.allclose(a, b, rtol=0, atol=1e-15)


def test_gradcheck_sparse_attention():
    q, kv_full, sink, n_comp = setup(S=10, n=2, D=4, seed=3)
    idx = torch.cat((window_indices(10, 4), all_compressed_indices(10, 4, n_comp)), -1)[None]
    idx[0, 5, 1] = -1  # a hole inside a row
    args = tuple(t.requires_grad_(True) for t in (q, kv_full, sink))
    fn = lambda q, kv, s: sparse_attention(q, kv, idx, s, 0.7)
    assert torch.autograd.gradcheck(fn, args)
