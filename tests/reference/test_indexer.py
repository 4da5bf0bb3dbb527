"""Lightning indexer (spec §3): scores, causal rule, deterministic top-k, detached inputs, THD placement."""

from __future__ import annotations

import torch

from reference import indexer
from reference.hadamard import hadamard_matrix
from reference.indexer import index_scores, select_topk
from reference.rope import layer_inv_freq

from .helpers import bshd, case_of, materialized, thd_layout, tiny_config
from .test_compressor import oracle as compressor_oracle
from .test_rope_norm_hadamard import complex_rope_oracle


def scores_oracle(q, k, w, scale, ratio=4):
    """Loop over rows, entries and heads of one sequence: q [S,nI,dI], k [n_comp,dI], w [S,nI]."""
    S, nI, _ = q.shape
    n_comp = k.shape[0]
    out = torch.full((S, n_comp), float("-inf"), dtype=torch.float64)
    for t in range(S):
        for s in range(min((t + 1) // ratio, n_comp)):
            out[t, s] = sum(float(w[t, h]) * scale * max(float(q[t, h] @ k[s]), 0.0) for h in range(nI))
    return out


def test_index_scores_match_loop_oracle_and_causal_rule():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 19, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    w = torch.randn(2, 19, 3, generator=g, dtype=torch.float64)
    got = index_scores(q, k, w, 0.25)
    for b in range(2):
        want = scores_oracle(q[b], k[b], w[b], 0.25)
        assert torch.equal(torch.isinf(got[b]), torch.isinf(want))
        assert torch.allclose(got[b], want, rtol=0, atol=1e-13)
    # row t sees min(floor((t+1)/4), 4) entries: rows 0-2 none, rows 3-6 one, ..., rows >= 15 all four
    visible = torch.isfinite(got[0]).sum(-1)
    assert visible.tolist() == [min((t + 1) // 4, 4) for t in range(19)]
    assert not torch.equal(visible, torch.tensor([min(t // 4, 4) for t in range(19)]))  # control: off by one


def test_topk_ties_lower_index_wins_sorted_and_padded():
    inf = float("-inf")
    scores = torch.tensor([[[0.0, 1.0, 1.0, 1.0, inf],      # three-way tie for two slots
                            [2.0, inf, inf, inf, inf],      # one valid entry, K=2 -> one -1
                            [inf, inf, inf, inf, inf],      # none
                            [0.0, 0.0, 3.0, 0.0, 0.0]]])    # tie at zero for the second slot
    got = select_topk(scores, 2)
    assert got.tolist() == [[[1, 2], [0, -1], [-1, -1], [0, 2]]]
    assert select_topk(scores, 7).tolist()[0][0] == [0, 1, 2, 3, -1, -1, -1]  # width K > n_comp
    # negative control: the opposite tie rule picks differently on these rows
    flipped = select_topk(scores.flip(-1), 2)
    higher = torch.sort(torch.where(flipped >= 0, 4 - flipped, 99), -1).values
    assert higher[0, 0].tolist() == [2, 3] and higher[0, 0].tolist() != got[0, 0].tolist()


def test_topk_selects_the_largest_valid_scores():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 40, 9, generator=g, dtype=torch.float64)
    scores = scores.masked_fill(torch.rand(3, 40, 9, generator=g) < 0.3, float("-inf"))
    got = select_topk(scores, 4)
    for row, ids in zip(scores.reshape(-1, 9), got.reshape(-1, 4)):
        real = ids[ids >= 0]
        assert real.numel() == min(4, int(torch.isfinite(row).sum()))
        assert torch.equal(real, torch.sort(real).values) and bool((ids[real.numel():] == -1).all())
        expect = torch.sort(row[torch.isfinite(row)], descending=True).values[: real.numel()]
        assert torch.equal(torch.sort(row[real], descending=True).values, expect)


def test_indexer_end_to_end_matches_oracle_and_detaches_inputs():
    config = tiny_config(4)
    t = materialized(case_of(config, bshd(1, 13)))
    hidden = torch.randn(1, 13, 16, dtype=torch.float64, requires_grad=True)
    q_latent = torch.randn(1, 13, 8, dtype=torch.float64, requires_grad=True)
    scores, topk = indexer(hidden, q_latent, t.params, config)
    p = {k.split("core_attention.indexer.")[1]: v.detach() for k, v in t.params.items() if ".indexer." in k}
    inv = layer_inv_freq(config)
    qI = (q_latent[0].detach() @ p["linear_wq_b.weight"].T).view(13, 2, 16)
    qI = complex_rope_oracle(qI, torch.arange(13).view(13, 1), inv, 8) @ hadamard_matrix(16) / 4.0
    kI = compressor_oracle(hidden[0].detach(), p["compressor.linear_wkv.weight"], p["compressor.linear_wgate.weight"],
                           p["compressor.ape"], p["compressor.norm.weight"], ratio=4, d=16, inv_freq=inv, rotate=True)
    wI = hidden[0].detach() @ p["linear_weights_proj.weight"].T * 2 ** -0.5
    want = scores_oracle(qI, kI, wI, 16 ** -0.5)
    assert torch.allclose(scores[0], want, rtol=0, atol=1e-13)
    assert torch.equal(topk, select_topk(scores, 2))
    scores[torch.isfinite(scores)].sum().backward()
    assert hidden.grad is None and q_latent.grad is None  # inputs detached: no gradient into the backbone
    assert t.params["core_attention.indexer.linear_wq_b.weight"].grad is not None


def test_thd_indexer_places_segment_rows_by_local_id():
    config = tiny_config(4)
    layout = thd_layout([9, 0, 2, 14], [12, 0, 2, 16], slack=3)
    t = materialized(case_of(config, layout))
    hidden, q_latent = t.inputs["hidden"], torch.randn(layout.total_tokens, 8, dtype=torch.float64)
    scores, topk = indexer(hidden, q_latent, t.params, config, t.packed_seq_params)
    assert scores.shape == (33, 16 // 4) and topk.shape == (33, 2)
    for a, b in ((0, 12), (12, 14), (14, 30)):
        s, k = indexer(hidden[a:b][None], q_latent[a:b][None], t.params, config)
        width = s.shape[-1]
        assert torch.equal(scores[a:b, :width], s[0]) and bool(torch.isneginf(scores[a:b, width:]).all())
        assert torch.equal(topk[a:b], k[0])
    assert bool(torch.isneginf(scores[30:]).all()) and bool((topk[30:] == -1).all())  # slack rows


def test_gradcheck_index_scores():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 9, 2, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, w: index_scores(q, k, w, 0.5).masked_fill(~torch.isfinite(index_scores(q, k, w, 0.5)), 0.0)
    assert torch.autograd.gradcheck(fn, (q, k, w))
