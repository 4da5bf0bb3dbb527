"""The torch provider computes what each kernel computes: checked against loop / autograd oracles in float64.

Every check has a negative control: the oracle with one convention flipped (no sink, ``topk_length`` ignored, the
wrong tie rule, …) must disagree with the provider.
"""

from __future__ import annotations

import math

import torch

from fused.kernels.torch_provider import TorchKernels

K = TorchKernels()
F64, I32 = torch.float64, torch.int32


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=gen(seed))


# ---- sparse attention forward / backward -----------------------------------------------------------------------
def attention_oracle(q, kv, idx, length, scale, sink, use_sink=True):
    """Loop oracle: per row and head, softmax over the read slots plus the sink logit (no value)."""
    rows, heads, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((rows, heads), math.inf, dtype=F64)
    for i in range(rows):
        slots = [int(j) for s, j in enumerate(idx[i]) if s < length[i] and 0 <= int(j) < kv.shape[0]]
        if not slots:
            continue
        keys = kv[slots]
        for h in range(heads):
            logits = scale * keys @ q[i, h]
            lse[i, h] = torch.logsumexp(logits, 0)
            denom = torch.exp(logits).sum() + (torch.exp(sink[h]) if use_sink else 0)
            out[i, h] = (torch.exp(logits) / denom) @ keys
    return out, lse


def sparse_setup(seed=0):
    rows, heads, dim, n_kv, width = 7, 3, 8, 10, 64
    q, kv, sink = randn(rows, heads, dim, seed=seed), randn(n_kv, dim, seed=seed + 1), randn(heads, seed=seed + 2)
    idx = torch.full((rows, width), -1, dtype=I32)
    idx[:, :5] = torch.tensor([[0, 3, 5, 9, 12]] * rows, dtype=I32)  # 12 >= n_kv: invalid
    idx[2] = -1                                                        # an empty row
    length = torch.tensor([5, 3, 0, 5, 1, 4, 5], dtype=I32)
    return q, kv, sink, idx, length


def test_sparse_fwd_matches_loop_oracle_with_sink_topk_length_and_empty_rows():
    q, kv, sink, idx, length = sparse_setup()
    out, _, lse = K.sparse_attn_fwd(q, kv.unsqueeze(1), idx.unsqueeze(1), 0.3, d_v=8, attn_sink=sink,
                                    topk_length=length)
    ref_out, ref_lse = attention_oracle(q, kv, idx, length, 0.3, sink)
    torch.testing.assert_close(out, ref_out, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-13, atol=1e-13)
    assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()  # FlashMLA: +inf LSE, zero output
    no_sink, _ = attention_oracle(q, kv, idx, length, 0.3, sink, use_sink=False)
    assert not torch.allclose(out, no_sink)  # negative control: the sink takes mass
    all_slots, _ = attention_oracle(q, kv, idx, torch.full_like(length, 64), 0.3, sink)
    assert not torch.allclose(out, all_slots)  # negative control: topk_length is honoured


def test_sparse_bwd_matches_autograd_of_the_oracle():
    q, kv, sink, idx, length = sparse_setup(seed=3)
    leaves = [t.clone().requires_grad_(True) for t in (q, kv, sink)]
    ref_out, ref_lse = attention_oracle(*leaves[:2], idx, length, 0.3, leaves[2])
    d_out = randn(*q.shape, seed=9)
    ref = torch.autograd.grad((ref_out * d_out).sum(), leaves)
    out, _, lse = K.sparse_attn_fwd(q, kv.unsqueeze(1), idx.unsqueeze(1), 0.3, d_v=8, attn_sink=sink,
                                    topk_length=length)
    res = K.sparse_attn_bwd(q, kv, out, d_out, lse, sink, idx.clamp_min(0), softmax_scale=0.3, topk_length=length)
    for got, want in zip((res["dq"], res["dkv"], res["d_sink"]), ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # negative control: without topk_length the clamped suffix (index 0) would be read
    wrong = K.sparse_attn_bwd(q, kv, out, d_out, lse, sink, idx.clamp_min(0), softmax_scale=0.3)
    assert not torch.allclose(wrong["dkv"], ref[1])


def test_sparse_bwd_masked_padding_row_contributes_nothing():
    """The composition's padding-row mask (``dO = 0``, ``lse = +inf``) removes the row exactly, even when the row
    holds huge values (core-scope padding rows are arbitrary): the same gradients as a row without keys."""
    q, kv, sink, idx, length = sparse_setup(seed=5)
    q[4] = 1e3 * kv[0]  # a poisoned padding row (its one key is kv[0]): logits ~ 1e3, exp(logit) overflows
    out, _, lse = K.sparse_attn_fwd(q, kv.unsqueeze(1), idx.unsqueeze(1), 0.3, d_v=8, attn_sink=sink,
                                    topk_length=length)
    d_out = randn(*q.shape, seed=11)
    base = K.sparse_attn_bwd(q, kv, out, d_out, lse, sink, idx.clamp_min(0), softmax_scale=0.3, topk_length=length)
    d_out[4], lse = 0, lse.clone()
    lse[4] = float("inf")  # the composition's padding-row masking
    masked = K.sparse_attn_bwd(q, kv, out, d_out, lse, sink, idx.clamp_min(0), softmax_scale=0.3, topk_length=length)
    no_keys = length.clone()
    no_keys[4] = 0
    absent = K.sparse_attn_bwd(q, kv, out, d_out, lse, sink, idx.clamp_min(0), softmax_scale=0.3,
                               topk_length=no_keys)
    assert (masked["dq"][4] == 0).all()
    for name in ("dq", "dkv", "d_sink"):
        assert torch.equal(masked[name], absent[name]), name
    assert not torch.allclose(masked["dkv"], base["dkv"])  # the row did contribute before masking
    # negative control: a finite mask value leaves exp(logit - 0), which overflows on the poisoned row
    lse[4] = 0
    finite = K.sparse_attn_bwd(q, kv, out, d_out, lse, sink, idx.clamp_min(0), softmax_scale=0.3, topk_length=length)
    assert not torch.isfinite(finite["dkv"]).all()


# ---- top-k / compactify ------------------------------------------------------------------------------------------
def test_top_k_lower_index_wins_ties_and_pads_short_rows():
    values = torch.tensor([[0.0, 2.0, 0.0, 2.0, 1.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]], dtype=F64)
    seq_lens = torch.tensor([6, 4, 2], dtype=I32)
    res = K.indexer_top_k(values, seq_lens, top_k=3)
    got = [sorted(r) for r in res["indices"].tolist()]
    assert got == [[1, 3, 4], [0, 1, 2], [-1, 0, 1]]
    assert res["values"][2, 2] == -math.inf
    high = K.indexer_top_k(values, seq_lens, top_k=3, tie_break=2)["indices"]
    assert sorted(high[1].tolist()) == [1, 2, 3]  # negative control: the other tie rule picks differently


def test_compactify_is_stable_and_counts_valid_slots():
    idx = torch.tensor([[-1, 7, -1, 3, 5], [-1, -1, -1, -1, -1], [4, 2, 9, -1, 0]], dtype=I32)
    res = K.compactify(idx)
    assert res["indices"].tolist() == [[7, 3, 5, -1, -1], [-1] * 5, [4, 2, 9, 0, -1]]
    assert res["topk_length"].tolist() == [3, 0, 4]
    indices, length = res  # TupleDict unpacks like the wrapper's result
    assert length is res["topk_length"]


# ---- indexer forward ---------------------------------------------------------------------------------------------
def test_indexer_forward_thd_equals_one_bshd_call_per_segment():
    ratio, cu_q, cu_k = 2, [0, 5, 5, 12], [0, 2, 2, 8]
    q, k, w = randn(14, 4, 8, seed=1), randn(9, 1, 8, seed=2), randn(14, 4, seed=3)  # 2 slack rows, 1 spare key
    thd = K.indexer_forward(q, k, w, ratio, sm_scale=0.5, cu_seqlens_q=torch.tensor(cu_q, dtype=I32),
                            cu_seqlens_k=torch.tensor(cu_k, dtype=I32), max_seqlen_q=7, max_seqlen_k=6)["scores"]
    assert thd.shape == (14, 6)
    for b in range(3):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        one = K.indexer_forward(q[None, qs:qe], k[None, ks:ke], w[None, qs:qe], ratio, sm_scale=0.5)["scores"][0]
        torch.testing.assert_close(thd[qs:qe, : ke - ks], one, rtol=1e-13, atol=1e-13)
        assert torch.isneginf(thd[qs:qe, ke - ks:]).all()
    assert torch.isneginf(thd[12:]).all()  # rows outside every segment
    # the ratio-causal mask: row i sees column s iff s < (i + 1) // ratio
    row = thd[5:12]
    assert [int(torch.isfinite(r).sum()) for r in row] == [min((i + 1) // ratio, 6) for i in range(7)]


def test_indexer_forward_matches_the_formula():
    q, k, w = randn(1, 6, 3, 8, seed=4), randn(1, 3, 1, 8, seed=5), randn(1, 6, 3, seed=6)
    scores = K.indexer_forward(q, k, w, ratio=2, sm_scale=0.7)["scores"][0]
    for i in range(6):
        for s in range(3):
            want = 0.7 * sum(w[0, i, h] * torch.relu(q[0, i, h] @ k[0, s, 0]) for h in range(3))
            if s < (i + 1) // 2:
                assert abs(float(scores[i, s] - want)) < 1e-13
            else:
                assert scores[i, s] == -math.inf


# ---- loss kernels -----------------------------------------------------------------------------------------------
def test_sparse_target_is_l1_normalised_head_sum():
    args = dict(q_attn=randn(1, 4, 3, 8, seed=7), k_attn=randn(1, 5, 8, seed=8), lse=randn(1, 4, 3, seed=9) + 3)
    topk = torch.tensor([[[0, 4, -1], [1, -1, -1], [-1, -1, -1], [3, 2, 0]]], dtype=I32)
    target = K.sparse_attn_score_recompute(**args, topk_indices=topk, softmax_scale=0.4)["target"][0]
    for i, row in enumerate(topk[0].tolist()):
        mass = [float(torch.exp(0.4 * args["k_attn"][0, j] @ args["q_attn"][0, i].T - args["lse"][0, i]).sum())
                if j >= 0 else 0.0 for j in row]
        total = sum(mass)
        want = [m / total if total else 0.0 for m in mass]
        torch.testing.assert_close(target[i], torch.tensor(want, dtype=F64), rtol=1e-13, atol=1e-13)
    glob = K.sparse_attn_score_recompute(**args, topk_indices=topk, softmax_scale=0.4, topk_indices_global=True)
    torch.testing.assert_close(glob["target"][0], target, rtol=0, atol=0)  # batch 1: global == local


def kl_autograd_grads(q, w, k, target, topk, sm_scale, coeff, rows):
    """Autograd of ``coeff / rows * KL(target || softmax(logits over the valid slots))``."""
    leaves = [t.clone().requires_grad_(True) for t in (q, w, k)]
    keys = leaves[2][0][topk.clamp(min=0).long()[0]]                     # (S, K, D)
    z = torch.einsum("shd,skd->shk", leaves[0][0], keys)
    logits = sm_scale * torch.einsum("sh,shk->sk", leaves[1][0], torch.relu(z))
    logits = logits.masked_fill(topk[0] < 0, -math.inf)
    logp = torch.log_softmax(logits, -1)
    valid = topk[0] >= 0
    kl = torch.where(valid, target[0] * (torch.log(target[0].clamp_min(1e-300)) - logp), 0.0).sum()
    return torch.autograd.grad(coeff / rows * kl, leaves)


def test_indexer_backward_matches_autograd_of_the_kl_and_overwrites_attn_score():
    s, h, d, n_k = 5, 3, 8, 6
    q, w, k = randn(1, s, h, d, seed=12), randn(1, s, h, seed=13), randn(1, n_k, d, seed=14)
    topk = torch.tensor([[[0, 2, 5], [1, -1, -1], [4, 3, -1], [0, 1, 2], [5, 4, 3]]], dtype=I32)
    target = torch.rand(1, s, 3, dtype=F64, generator=gen(15)).masked_fill(topk < 0, 0)
    target = target / target.sum(-1, keepdim=True)
    z = torch.einsum("bshd,bskd->bshk", q, k[0][topk.clamp(min=0).long()])
    logits = 0.5 * torch.einsum("bsh,bshk->bsk", w, torch.relu(z))
    predict = torch.softmax(logits.masked_fill(topk < 0, torch.finfo(torch.float32).min), -1)
    attn = target.clone()
    res = K.indexer_backward(q, w, k, attn, predict.clone(), topk, torch.ones((), dtype=torch.float32), sm_scale=0.5,
                             loss_coeff=0.3)
    want = kl_autograd_grads(q, w, k, target, topk, 0.5, 0.3, s)
    for got, ref in zip((res["d_index_q"], res["d_weights"], res["d_index_k"]), want):
        torch.testing.assert_close(got, ref, rtol=1e-11, atol=1e-14)
    assert not torch.equal(attn, target)  # kernel 1 wrote the score gradient into attn_score
    doubled = K.indexer_backward(q, w, k, target.clone(), predict.clone(), topk, torch.full((), 2.0), sm_scale=0.5,
                                 loss_coeff=0.3)
    torch.testing.assert_close(doubled["d_index_q"], 2 * res["d_index_q"])  # grad_loss scales linearly


def test_dense_indexer_backward_matches_autograd_of_the_dense_kl():
    s, h, d, n_k, ratio = 6, 3, 8, 3, 2
    q, w, k = randn(1, s, h, d, seed=21), randn(1, s, h, seed=22), randn(1, n_k, d, seed=23)
    scores = K.dense_indexer_score_recompute(q, k.unsqueeze(2), w, sm_scale=0.5, ratio=ratio)
    attn = torch.rand(1, s, n_k, dtype=F64, generator=gen(24))
    valid = torch.isfinite(scores["out"])
    attn = attn.masked_fill(~valid, 0)
    l1 = attn.sum(-1)
    res = K.dense_indexer_backward(q, w, k, attn, l1, scores["out"].clone(), scores["denom"],
                                   torch.ones((), dtype=torch.float32), sm_scale=0.5, loss_coeff=0.2, ratio=ratio)
    leaves = [t.clone().requires_grad_(True) for t in (q, w, k)]
    z = torch.einsum("bshd,bkd->bshk", leaves[0], leaves[2])
    logits = 0.5 * torch.einsum("bsh,bshk->bsk", leaves[1], torch.relu(z))
    logp = torch.log_softmax(logits.masked_fill(~valid, -math.inf), -1)
    t = attn / l1.clamp_min(1e-300).unsqueeze(-1)
    kl = torch.where(valid, t * (torch.log(t.clamp_min(1e-300)) - logp), 0.0).sum()
    want = torch.autograd.grad(0.2 / s * kl, leaves)
    for got, ref in zip((res["d_index_q"], res["d_weights"], res["d_index_k"]), want):
        torch.testing.assert_close(got, ref, rtol=1e-11, atol=1e-14)


def test_teacher_lse_is_window_sink_and_every_causal_compressed_key():
    ratio, cu_q, cu_k = 2, [0, 4, 9], [0, 2, 4]
    q, kv, comp, sink = randn(10, 2, 8, seed=31), randn(12, 8, seed=32), randn(5, 8, seed=33), randn(2, seed=34)
    window = torch.tensor([[i, i - 1 if i else -1] for i in range(10)], dtype=I32)
    out = K.csa_teacher_lse(q, kv, comp, sink, window, 0.4, ratio, cu_seqlens_q=torch.tensor(cu_q, dtype=I32),
                            cu_seqlens_k=torch.tensor(cu_k, dtype=I32), max_seqlen_q=5, max_seqlen_k=2)
    for t in range(9):
        b = 0 if t < 4 else 1
        local = t - cu_q[b]
        n_vis = min((local + 1) // ratio, cu_k[b + 1] - cu_k[b])
        for h in range(2):
            terms = [sink[h]] + [0.4 * q[t, h] @ kv[j] for j in window[t].tolist() if j >= 0] + \
                    [0.4 * q[t, h] @ comp[cu_k[b] + g] for g in range(n_vis)]
            assert abs(float(out[t, h] - torch.logsumexp(torch.stack(terms), 0))) < 1e-13
    assert torch.isnan(out[9]).all()  # a row outside every segment is never written
