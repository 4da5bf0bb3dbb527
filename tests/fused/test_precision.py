"""Low-precision mimicry: bf16 activations, fp32 accumulation / scores / LSE / loss, bf16 outputs (production)."""

from __future__ import annotations

import pytest
import torch

import fused
from cases.tensors import materialize
from fused.kernels.torch_provider import TorchKernels
from fused.plan import kernels

from .helpers import bshd_case, rel_err, run, thd_case

reference = pytest.importorskip("reference")
K = TorchKernels()


def cosine(a, b):
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def test_sparse_forward_accumulates_in_fp32_and_rounds_once_to_bf16():
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(5, 4, 32, generator=g).bfloat16(), torch.randn(9, 32, generator=g).bfloat16()
    sink = torch.randn(4, generator=g)
    idx = torch.full((5, 1, 64), -1, dtype=torch.int32)
    idx[:, 0, :6] = torch.arange(6, dtype=torch.int32)
    out, _, lse = K.sparse_attn_fwd(q, kv.unsqueeze(1), idx, 0.2, d_v=32, attn_sink=sink)
    ref, _, ref_lse = K.sparse_attn_fwd(q.float(), kv.float().unsqueeze(1), idx, 0.2, d_v=32, attn_sink=sink)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, ref.bfloat16()) and torch.equal(lse, ref_lse)
    bf16_math = torch.softmax((q.float() @ kv.float()[:6].T * 0.2).bfloat16(), -1)  # negative control
    assert not torch.equal(bf16_math.float(), torch.softmax(q.float() @ kv.float()[:6].T * 0.2, -1))


@pytest.mark.parametrize("case", [bshd_case(4, 2, 21, dtype="bfloat16"),
                                  thd_case(4, [(9, 12), (0, 0), (13, 16)], slack=2, capacity=9, dtype="bfloat16",
                                           dsa_indexer_use_sparse_loss=False, scope="core")],
                         ids=["bshd_sparse_layer", "thd_dense_core"])
def test_bf16_case_runs_in_production_dtypes_and_tracks_the_reference(case):
    t = materialize(case)
    got, got_grads = run(fused, case, t)
    want, want_grads = run(reference, case, t)
    assert got.out.dtype == torch.bfloat16
    assert got.lse.dtype == got.indexer_loss.dtype == got.index_scores.dtype == torch.float32
    assert cosine(got.out, want.out) > 0.999
    got_loss, want_loss = float(got.indexer_loss.detach()), float(want.indexer_loss.detach())
    assert abs(got_loss - want_loss) <= 0.05 * abs(want_loss) + 1e-6
    for name, ref in want_grads.items():
        if ref is not None and float(ref.abs().sum()) > 0:
            assert got_grads[name].dtype == ref.dtype
            assert cosine(got_grads[name], ref) > 0.98, name


def test_float32_case_is_close_to_the_reference():
    case = thd_case(4, [(9, 12), (13, 16)], slack=1, capacity=9, dtype="float32")
    t = materialize(case)
    got, got_grads = run(fused, case, t)
    want, want_grads = run(reference, case, t)
    assert rel_err(got.out, want.out) < 1e-5 and rel_err(got.indexer_loss, want.indexer_loss) < 1e-5
    assert max(rel_err(got_grads[k], want_grads[k]) for k in want_grads if want_grads[k] is not None) < 1e-4


# ---- the dense indexer backward: fp32 intermediates, bf16 outputs rounded once ---------------------------------------
def _bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| in units of the bf16 spacing at each element of ``ref`` (float64)."""
    ref = ref.double()
    spacing = torch.where(ref == 0, torch.full_like(ref, 2.0 ** -133), 2.0 ** (torch.floor(torch.log2(ref.abs())) - 7))
    return float(((got.double() - ref).abs() / spacing).max())


def _dense_backward_inputs(dtype):
    """bf16 indexer / attention activations (upcast for float64) and the recompute kernels' fp32 outputs."""
    g = torch.Generator().manual_seed(3)
    b, s, h, d, n_k = 2, 24, 4, 32, 6
    q, k = torch.randn(b, s, h, d, generator=g).bfloat16(), torch.randn(b, n_k, d, generator=g).bfloat16()
    w = (torch.randn(b, s, h, generator=g) * 0.3).bfloat16()
    qa, ka = torch.randn(b, s, 8, 16, generator=g).bfloat16(), torch.randn(b, n_k, 1, 16, generator=g).bfloat16()
    if dtype == torch.float64:
        q, w, k, qa, ka = (t.double() for t in (q, w, k, qa, ka))
    index = K.dense_indexer_score_recompute(q, k.unsqueeze(2), w, sm_scale=0.2, ratio=4)
    teacher_lse = torch.full((b, s, 8), 1.5, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    attn = K.dense_attn_score_recompute(qa, ka, teacher_lse, 0.25, ratio=4)
    return [q, w, k, attn["out"], attn["denom"], index["out"], index["denom"]]


def _dense_backward(args, round_to_bf16=None):
    args = [a.clone() for a in args]
    if round_to_bf16 is not None:
        args[round_to_bf16] = args[round_to_bf16].bfloat16().float()
    with fused.use_backend("torch"):  # through the dispatcher, which enforces the kernel contract
        return kernels.dense_indexer_backward(*args, torch.ones((), dtype=torch.float32), sm_scale=0.2,
                                              loss_coeff=0.5, ratio=4)


def test_dense_indexer_backward_keeps_target_l1_scores_and_lse_in_fp32():
    """As the cuDNN kernel (fp32 attn_score / attn_l1norm / index_score / index_lse, bf16 gradients): on the same
    bf16 inputs the bf16 result is the float64 result rounded once (<= 1 bf16 ULP); rounding any fp32
    intermediate to bf16 first (negative control) is far off."""
    bf16_args = _dense_backward_inputs(torch.bfloat16)
    assert all(a.dtype == torch.float32 for a in bf16_args[3:])
    exact = _dense_backward(_dense_backward_inputs(torch.float64))
    got = _dense_backward(bf16_args)
    names = ("d_index_q", "d_weights", "d_index_k")
    assert max(_bf16_ulps(got[n], exact[n]) for n in names) <= 1.0
    for i, what in enumerate(("attn_score", "attn_l1norm", "index_score", "index_lse"), start=3):
        rounded = _dense_backward(bf16_args, round_to_bf16=i)
        assert max(_bf16_ulps(rounded[n], exact[n]) for n in names) > 8, what


def test_bf16_composition_hands_the_dense_backward_fp32_intermediates(monkeypatch):
    seen = {}
    real = TorchKernels.dense_indexer_backward

    def spy(self, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, *args, **kwargs):
        seen.update(q=index_q.dtype, w=weights.dtype, k=index_k.dtype, attn=attn_score.dtype, l1=attn_l1norm.dtype,
                    score=index_score.dtype, lse=index_lse.dtype)
        return real(self, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, *args,
                    **kwargs)

    monkeypatch.setattr(TorchKernels, "dense_indexer_backward", spy)
    case = thd_case(4, [(9, 12), (13, 16)], dtype="bfloat16", scope="core", dsa_indexer_use_sparse_loss=False)
    with fused.use_backend("torch"):
        run(fused, case, materialize(case))
    assert seen == dict(q=torch.bfloat16, w=torch.bfloat16, k=torch.bfloat16, attn=torch.float32,
                        l1=torch.float32, score=torch.float32, lse=torch.float32)
    # negative control: the kernel contract (as cuDNN's) refuses an fp32 intermediate handed over in bf16
    args = _dense_backward_inputs(torch.bfloat16)
    args[6] = args[6].bfloat16()
    with pytest.raises(ValueError, match="index_lse dtype mismatch"):
        _dense_backward(args)
