"""Low-precision mimicry: bf16 activations, fp32 accumulation / scores / LSE / loss, bf16 outputs (production)."""

from __future__ import annotations

import pytest
import torch

import fused
from cases.tensors import materialize
from fused.kernels.torch_provider import TorchKernels

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
