"""Indexer KL loss (spec §5.3) against a plain triple-loop oracle; detach points; NaN safety; reductions."""

from __future__ import annotations

import math

import pytest
import torch

from reference import compressor, core_attention
from reference.indexer import select_topk
from reference.indexer_loss import indexer_kl_rows, reduce_loss

from .helpers import bshd, case_of, materialized, tiny_config

TINY = torch.finfo(torch.float32).tiny


def loss_oracle(scores, topk, q, kv, comp, sink, *, window, scale, coeff, per_token, variant=None):
    """Triple loop (rows x keys x heads) of spec §5.3 for one sequence, in Python floats.

    ``variant`` plants a known bug for negative controls: ``"no_window_sink"`` (teacher normalised over the
    compressed keys only, the pre-059c16cd11 behaviour), ``"padded_width"`` (KL over the whole top-k width,
    0 * -inf on -1 slots), ``"visible_rows_mean"`` (mean over rows that see a key instead of all rows).
    """
    S, n, _ = q.shape
    n_comp = comp.shape[0]
    total, rows_with_keys = 0.0, 0
    for t in range(S):
        valid = [s for s in range(n_comp) if s < min((t + 1) // 4, n_comp)]
        chosen = valid if topk is None else [s for s in topk[t].tolist() if s >= 0 and s in valid]
        if variant == "padded_width" and topk is not None:
            chosen = topk[t].tolist()
        if not [s for s in chosen if s >= 0]:
            continue
        rows_with_keys += 1
        target = {s: 0.0 for s in chosen}
        for h in range(n):
            win = [scale * float(q[t, h] @ kv[j]) for j in range(max(0, t - window + 1), t + 1)]
            logit = {s: scale * float(q[t, h] @ comp[s]) for s in chosen if s >= 0}
            mass = sum(math.exp(x) for x in logit.values())
            if variant != "no_window_sink":
                mass += sum(math.exp(x) for x in win) + math.exp(float(sink[h]))
            for s in logit:
                target[s] += math.exp(logit[s]) / mass
        l1 = max(sum(target.values()), TINY)
        pred_lse = math.log(sum(math.exp(float(scores[t, s])) for s in chosen if s >= 0))
        for s in chosen:
            tgt = target[s] / l1
            log_q = float(scores[t, s]) - pred_lse if s >= 0 else float("-inf")
            total += tgt * (math.log(max(tgt, TINY)) - log_q)
    divisor = 1 if per_token else (rows_with_keys if variant == "visible_rows_mean" else S)
    return coeff * total / divisor


def random_inputs(S=23, n=2, D=8, n_comp=5, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, n, D, generator=g, dtype=torch.float64)
    kv = torch.randn(1, S, D, generator=g, dtype=torch.float64)
    comp = torch.randn(1, n_comp, D, generator=g, dtype=torch.float64)
    sink = torch.randn(n, generator=g, dtype=torch.float64)
    scores = torch.randn(1, S, n_comp, generator=g, dtype=torch.float64)
    visible = torch.clamp((torch.arange(S) + 1) // 4, max=n_comp).view(S, 1)
    scores = scores.masked_fill(torch.arange(n_comp) >= visible, float("-inf"))
    return scores, select_topk(scores, K), q, kv, comp, sink


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
def test_loss_matches_triple_loop_oracle(sparse, per_token):
    config = tiny_config(4, sparse=sparse, per_token=per_token, csa_window_size=4)
    scores, topk, q, kv, comp, sink = random_inputs()
    kl = indexer_kl_rows(scores, topk if sparse else None, q, kv, comp, sink, config)
    got = float(reduce_loss(kl.sum(), kl.numel(), config))
    kw = dict(window=4, scale=config.softmax_scale, coeff=config.dsa_indexer_loss_coeff, per_token=per_token)
    want = loss_oracle(scores[0], topk[0] if sparse else None, q[0], kv[0], comp[0], sink, **kw)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert math.isfinite(got) and float(kl[0, :3].abs().max()) == 0.0  # rows 0-2 see no entry: KL 0
    # negative controls: each planted bug changes the value (or makes it NaN)
    for variant in ("no_window_sink", "visible_rows_mean") + (("padded_width",) if sparse else ()):
        if variant == "visible_rows_mean" and per_token:
            continue
        wrong = loss_oracle(scores[0], topk[0] if sparse else None, q[0], kv[0], comp[0], sink, variant=variant,
                            **kw)
        assert not (wrong == pytest.approx(got, rel=1e-6)), variant


def test_sparse_loss_filters_noncausal_and_padding_ids():
    """A caller's ids (split mode) may hold -1 and entries a row cannot see: St = topk ∩ Vt."""
    config = tiny_config(4, csa_window_size=4)
    scores, _, q, kv, comp, sink = random_inputs(seed=1)
    topk = torch.tensor([[4, 0, -1]] * 23).view(1, 23, 3)  # entry 4 is visible only from row 19 on
    kl = indexer_kl_rows(scores, topk, q, kv, comp, sink, config)
    kw = dict(window=4, scale=config.softmax_scale, coeff=config.dsa_indexer_loss_coeff, per_token=True)
    want = loss_oracle(scores[0], topk[0], q[0], kv[0], comp[0], sink, **kw)
    assert float(kl.sum()) * config.dsa_indexer_loss_coeff == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_core_attention_loss_equals_oracle_and_trains_only_the_indexer(sparse):
    config = tiny_config(4, sparse=sparse)
    case = case_of(config, bshd(2, 19), scope="core")
    t = materialized(case)
    i = t.inputs
    res = core_attention(i["query"], i["kv"], i["hidden"], i["q_latent"], t.params, config)
    comp = compressor(i["hidden"], t.params, "core_attention.compressor", config).detach()
    sink = t.params["core_attention.attn_sink"].detach()
    total = 0.0
    for b in range(2):
        total += loss_oracle(res.index_scores[b].detach(), res.topk_indices[b] if sparse else None,
                             i["query"][b].detach(), i["kv"][b].detach(), comp[b], sink, window=4,
                             scale=config.softmax_scale, coeff=config.dsa_indexer_loss_coeff, per_token=True)
    assert float(res.indexer_loss.detach()) == pytest.approx(total / (2 * 19), rel=1e-12)
    leaves = {**i, **t.params}
    grads = dict(zip(leaves, torch.autograd.grad(res.indexer_loss, list(leaves.values()), allow_unused=True)))
    for name, g in grads.items():
        trained = name.startswith("core_attention.indexer.")
        if trained:
            assert g is not None and float(g.abs().max()) > 0, name
        else:
            assert g is None or float(g.abs().max()) == 0, f"the loss must not train {name}"


def test_no_visible_entry_gives_zero_loss_with_zero_indexer_grads():
    config = tiny_config(4)
    t = materialized(case_of(config, bshd(1, 3), scope="core"))  # S < r: no compressed entry
    i = t.inputs
    res = core_attention(i["query"], i["kv"], i["hidden"], i["q_latent"], t.params, config)
    assert float(res.indexer_loss.detach()) == 0.0 and res.index_scores.shape == (1, 3, 0)
    assert (res.topk_indices == -1).all()
    g = torch.autograd.grad(res.indexer_loss, t.params["core_attention.indexer.linear_wq_b.weight"])[0]
    assert float(g.abs().max()) == 0.0


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_gradcheck_loss_wrt_indexer_scores(sparse):
    config = tiny_config(4, sparse=sparse, csa_window_size=3)
    scores, topk, q, kv, comp, sink = random_inputs(S=13, n=2, D=4, n_comp=3, K=2, seed=2)
    finite = torch.isfinite(scores)
    base = scores.masked_fill(~finite, 0.0).requires_grad_(True)
    fn = lambda s: indexer_kl_rows(s.masked_fill(~finite, float("-inf")), topk if sparse else None, q, kv, comp,
                                   sink, config)
    assert torch.autograd.gradcheck(fn, (base,))


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_score_split_differentiates_at_the_given_scores_and_keeps_the_loss(sparse):
    """Score-split (``at_scores``): the loss value is the reference's own; its gradient with respect to the scores
    is the plain gradient evaluated at ``at_scores``. Negative controls: at the own scores nothing changes, and other
    scores do move the gradient."""
    config = tiny_config(4, sparse=sparse, csa_window_size=3)
    scores, topk, q, kv, comp, sink = random_inputs(S=13, n=2, D=4, n_comp=3, K=2, seed=3)
    ids = topk if sparse else None
    other = scores + 0.3 * torch.randn(scores.shape, generator=torch.Generator().manual_seed(4), dtype=scores.dtype)

    def loss_and_grad(at_point, at_scores=None):
        s = at_point.clone().requires_grad_(True)
        kl = indexer_kl_rows(s, ids, q, kv, comp, sink, config, at_scores=at_scores).sum()
        return float(kl.detach()), torch.autograd.grad(kl, s)[0]

    plain_loss, plain_grad = loss_and_grad(scores)
    split_loss, split_grad = loss_and_grad(scores, other)
    _, grad_at_other = loss_and_grad(other)
    assert split_loss == plain_loss
    torch.testing.assert_close(split_grad, grad_at_other, rtol=1e-12, atol=1e-15)
    assert float((split_grad - plain_grad).abs().max()) > 1e-3
    _, same = loss_and_grad(scores, scores)
    torch.testing.assert_close(same, plain_grad, rtol=1e-12, atol=1e-15)
