"""Padding rows (THD alignment padding, dummy tails, slack) contribute exactly nothing, however large they are.

At core scope the padding rows of ``query`` / ``kv`` / ``dO`` are random, so the composition's own masking is what
keeps them out: before the backward kernels a padding row gets ``dO = 0`` and ``lse = +inf`` (the kernels' "no mass"
value: ``P = 0``, ``p_sink = 0``), and in the dense indexer backward ``index_lse = +inf`` (``predict = 0`` and the
log-clip mask 0, so its score gradient is exactly 0). Scaling those rows by 1e3 must leave every real-row output,
the loss and every gradient bit-identical, and padding-row input gradients exactly 0.

Negative controls: a *finite* mask value (the LSE set to 0, as the composition once did) lets ``exp(logit - 0)``
overflow on the poisoned rows, and ``0 · inf = NaN`` reaches real gradients; a finite dense ``index_lse`` mask leaves
``exp(-100)``-sized clip terms in the padding rows' score gradient (not exactly zero).
"""

from __future__ import annotations

import pytest
import torch

import fused
from cases.tensors import materialize
from fused.kernels.torch_provider import TorchKernels

from .helpers import run, thd_case

POISON = 1e3
PACK = [(9, 12), (13, 16), (5, 8)]  # (real, padded): alignment padding in every segment


def _case(dtype: str, sparse: bool):
    return thd_case(4, PACK, slack=3, scope="core", dtype=dtype, dsa_indexer_use_sparse_loss=sparse)


def _run(case, scale: float):
    tensors = materialize(case, padding_scale=scale)
    with fused.use_backend("torch"):
        res, grads = run(fused, case, tensors)
    return tensors.real_rows, res, grads


def _differences(case) -> list[str]:
    """Names of the tensors whose real-row values (or padding-row input gradients) change under the poison."""
    real, clean, clean_grads = _run(case, 1.0)
    _, poison, poison_grads = _run(case, POISON)
    bad = []
    for name in ("out", "lse", "index_scores"):
        a, b = getattr(poison, name)[real], getattr(clean, name)[real]
        if not torch.equal(a, b):
            bad.append(name)
    if not torch.equal(poison.indexer_loss, clean.indexer_loss):
        bad.append("indexer_loss")
    for name, b in clean_grads.items():
        a = poison_grads[name]
        if b is None and a is None:
            continue
        if name in ("query", "kv", "hidden", "q_latent"):
            if bool((a[~real] != 0).any()) or bool(a.isnan().any()):
                bad.append(f"grad/{name} (padding rows)")
            a, b = a[real], b[real]
        if not torch.equal(a, b):
            bad.append(f"grad/{name}")
    return bad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_poisoned_padding_rows_change_nothing(dtype, sparse):
    assert _differences(_case(dtype, sparse)) == []


def test_a_finite_attention_lse_mask_lets_poisoned_padding_reach_real_gradients(monkeypatch):
    real_bwd = TorchKernels.sparse_attn_bwd

    def finite_mask(self, q, kv, out, dout, lse, *args, **kwargs):  # +inf (masked rows) -> 0, the old mask
        return real_bwd(self, q, kv, out, dout, lse.nan_to_num(posinf=0.0), *args, **kwargs)

    monkeypatch.setattr(TorchKernels, "sparse_attn_bwd", finite_mask)
    bad = _differences(_case("float32", sparse=True))
    assert "grad/kv" in bad and "grad/query (padding rows)" in bad, bad


def _dense_padding_score_grads(finite_mask: bool) -> torch.Tensor:
    """The score gradients the dense indexer backward writes on padding rows (kernel 1 overwrites ``index_score``),
    float64; ``finite_mask``: the composition's ``+inf`` index-LSE mask replaced by 0."""
    case = _case("float64", sparse=False)
    seen = []
    real_bwd = TorchKernels.dense_indexer_backward

    def spy(self, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, *args, **kwargs):
        if finite_mask:
            index_lse = index_lse.nan_to_num(posinf=0.0)
        out = real_bwd(self, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, *args,
                       **kwargs)
        seen.append(index_score.detach().clone())
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchKernels, "dense_indexer_backward", spy)
        real, _, _ = _run(case, POISON)
    assert len(seen) == 1
    return seen[0][~real]


def test_dense_indexer_backward_gives_padding_rows_exactly_zero_score_gradient():
    assert torch.count_nonzero(_dense_padding_score_grads(finite_mask=False)) == 0
    # negative control: with a finite mask the exp(-100) clip terms of the padding rows survive (too small to move
    # a real gradient's bits here, but not zero)
    assert torch.count_nonzero(_dense_padding_score_grads(finite_mask=True)) > 0
