"""Argument contracts: every bad call raises what the production wrapper raises (type and message gist).

Each stage has a valid baseline call (negative control: it is accepted) and a list of single-defect variants, made
through the dispatcher (``fused.plan.kernels``), which enforces the contract once for every provider.
Messages follow cudnn-frontend 1.32.0 / FlashMLA ``sparse_fwd.h`` / Megatron ``csa_teacher_lse.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from fused import plan as plan_mod
from fused.kernels import contracts
from fused.kernels.base import STAGES
from fused.kernels.torch_provider import TorchKernels

K = TorchKernels()
F64 = torch.float64
I32 = torch.int32


def cu(*v, dtype=I32):
    return torch.tensor(v, dtype=dtype)


def randn(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(sum(shape) + len(shape)))


# ---- baselines: one valid call per stage (small shapes; THD: segments of 5 and 3 rows, ratio 1) ------------------
def indexer_forward_args():
    return dict(q=randn(8, 4, 8), k=randn(8, 1, 8), w=randn(8, 4), ratio=1, cu_seqlens_q=cu(0, 5, 8),
                cu_seqlens_k=cu(0, 5, 8), max_seqlen_q=5, max_seqlen_k=5)


def indexer_forward_bshd_args():
    return dict(q=randn(2, 6, 4, 8), k=randn(2, 3, 1, 8), w=randn(2, 6, 4), ratio=2)


def top_k_args():
    return dict(input_values=randn(6, 10), seq_lens=torch.tensor([10, 3, 0, 7, 10, 1], dtype=I32), top_k=4)


def sparse_fwd_args():
    idx = torch.full((6, 1, 64), -1, dtype=I32)
    idx[:, 0, :3] = torch.tensor([0, 2, 4], dtype=I32)
    return dict(q=randn(6, 4, 16), kv=randn(9, 1, 16), indices=idx, sm_scale=0.25, d_v=16,
                attn_sink=randn(4), topk_length=torch.full((6,), 3, dtype=I32))


def sparse_bwd_args():
    q, kv = randn(6, 4, 16), randn(9, 16)
    idx = torch.tensor([[0, 2, 4, -1]] * 6, dtype=I32)
    return dict(q=q, kv=kv, out=randn(6, 4, 16), dout=randn(6, 4, 16), lse=randn(6, 4), attn_sink=randn(4),
                topk_idxs=idx, softmax_scale=0.25)


def sparse_target_args():
    return dict(q_attn=randn(1, 6, 4, 16), k_attn=randn(1, 5, 16), lse=randn(1, 6, 4),
                topk_indices=torch.tensor([[[0, 1, -1]] * 6], dtype=I32), softmax_scale=0.25, qhead_per_kv_head=4)


def sparse_predict_args():
    return dict(q_indexer=randn(1, 6, 4, 8), k_indexer=randn(1, 5, 8), weights=randn(1, 6, 4),
                topk_indices=torch.tensor([[[0, 1, -1]] * 6], dtype=I32))


def dense_target_args():
    return dict(q=randn(8, 4, 16), k=randn(4, 1, 16), lse=randn(8, 4), softmax_scale=0.25, ratio=2,
                cu_seqlens_q=cu(0, 5, 8), cu_seqlens_k=cu(0, 2, 4), max_seqlen_q=5, max_seqlen_k=2)


def dense_predict_args():
    return dict(q=randn(8, 4, 8), k=randn(4, 1, 8), weights=randn(8, 4), ratio=2, cu_seqlens_q=cu(0, 5, 8),
                cu_seqlens_k=cu(0, 2, 4), max_seqlen_q=5, max_seqlen_k=2)


def indexer_bwd_args():
    topk = torch.tensor([[[0, 1, -1]] * 6], dtype=I32)
    return dict(index_q=randn(1, 6, 4, 8), weights=randn(1, 6, 4), index_k=randn(1, 5, 8),
                attn_score=torch.rand(1, 6, 3, dtype=F64), index_score=torch.rand(1, 6, 3, dtype=F64),
                topk_indices=topk, grad_loss=torch.ones((), dtype=torch.float32))


def dense_bwd_args():
    return dict(index_q=randn(8, 4, 8), weights=randn(8, 4), index_k=randn(4, 8),
                attn_score=torch.rand(8, 2, dtype=F64),
                attn_l1norm=torch.rand(8, dtype=F64) + 1, index_score=randn(8, 2), index_lse=randn(8),
                grad_loss=torch.ones((), dtype=torch.float32), ratio=2, cu_seqlens_q=cu(0, 5, 8),
                cu_seqlens_k=cu(0, 2, 4), max_seqlen_q=5, max_seqlen_k=2)


def teacher_args():
    return dict(query=randn(8, 4, 16), full_kv=randn(12, 16), compressed_kv=randn(4, 16), attn_sink=randn(4),
                window_indices=torch.tensor([[0, 1, -1]] * 8, dtype=I32), softmax_scale=0.25, ratio=2,
                cu_seqlens_q=cu(0, 5, 8), cu_seqlens_k=cu(0, 2, 4), max_seqlen_q=5, max_seqlen_k=2)


BASELINES = {
    "indexer_forward": indexer_forward_args, "indexer_forward_bshd": indexer_forward_bshd_args,
    "indexer_top_k": top_k_args, "compactify": lambda: dict(indices=torch.tensor([[3, -1, 1]], dtype=I32)),
    "sparse_attn_fwd": sparse_fwd_args, "sparse_attn_bwd": sparse_bwd_args,
    "sparse_attn_score_recompute": sparse_target_args, "sparse_indexer_score_recompute": sparse_predict_args,
    "dense_attn_score_recompute": dense_target_args, "dense_indexer_score_recompute": dense_predict_args,
    "indexer_backward": indexer_bwd_args, "dense_indexer_backward": dense_bwd_args, "csa_teacher_lse": teacher_args,
}


def call(stage: str, args: dict, provider: str = "torch"):
    with plan_mod.use_backend(provider):
        return getattr(plan_mod.kernels, stage.replace("_bshd", ""))(**args)


@pytest.mark.parametrize("stage", sorted(BASELINES))
def test_valid_baseline_call_is_accepted(stage):
    call(stage, BASELINES[stage]())


def _with(stage, **changes):
    args = BASELINES[stage]()
    for k, v in changes.items():
        if v is _DROP:
            args.pop(k)
        else:
            args[k] = v(args) if callable(v) else v
    return args


_DROP = object()

# (stage, changes, exception, message regex) — one defect each
VIOLATIONS = [
    # indexer forward (SM90 indexer_fwd)
    ("indexer_forward", dict(max_seqlen_q=None, max_seqlen_k=None), ValueError,
     "THD input requires max_seqlen_q and max_seqlen_k"),
    ("indexer_forward", dict(cu_seqlens_q=cu(0, 5, 8, dtype=torch.int64)), AssertionError,
     "cu_seqlens_q must be int32"),
    ("indexer_forward", dict(cu_seqlens_k=None), ValueError, "requires both cu_seqlens_q and cu_seqlens_k"),
    ("indexer_forward", dict(k=lambda a: a["k"][:, 0]), AssertionError, "THD k must be 3D"),
    ("indexer_forward", dict(ratio=0), ValueError, "ratio must be >= 1"),
    ("indexer_forward_bshd", dict(k=lambda a: a["k"][:, :, 0]), AssertionError, "k must be 4D BSHD"),
    ("indexer_forward_bshd", dict(k=lambda a: a["k"].expand(-1, -1, 2, -1)), AssertionError, "num_head_kv == 1"),
    ("indexer_forward_bshd", dict(w=lambda a: a["w"][:, :, :3]), AssertionError, "w shape must be"),
    # top-k
    ("indexer_top_k", dict(seq_lens=lambda a: a["seq_lens"].long()), ValueError, "seq_lens dtype mismatch"),
    ("indexer_top_k", dict(top_k=0), ValueError, r"top_k must be in \(0, 2048\]"),
    ("indexer_top_k", dict(top_k=4096), ValueError, r"top_k must be in \(0, 2048\]"),
    ("indexer_top_k", dict(seq_lens=lambda a: a["seq_lens"][:5]), ValueError, r"n_rows \(6\) must equal"),
    ("indexer_top_k", dict(input_values=lambda a: a["input_values"].view(2, 3, 10)), ValueError,
     "input_values must be 2-D"),
    # compactify
    ("compactify", dict(indices=torch.tensor([[3, -1, 1]])), TypeError, "idxs must be int32"),
    ("compactify", dict(indices=torch.tensor([3, -1, 1], dtype=I32)), ValueError, "idxs must be a 2D or 3D"),
    # FlashMLA forward (TORCH_CHECK -> RuntimeError)
    ("sparse_attn_fwd", dict(kv=lambda a: a["kv"][:, 0]), RuntimeError, "kv must have 3 dimensions"),
    ("sparse_attn_fwd", dict(indices=lambda a: a["indices"][:, 0]), RuntimeError, "indices must have 3 dimensions"),
    ("sparse_attn_fwd", dict(indices=lambda a: a["indices"].long()), RuntimeError, "indices must have dtype int32"),
    ("sparse_attn_fwd", dict(indices=lambda a: a["indices"][..., :60]), RuntimeError, "multiple of 64"),
    ("sparse_attn_fwd", dict(topk_length=lambda a: a["topk_length"].long()), RuntimeError,
     "topk_length must have dtype int32"),
    ("sparse_attn_fwd", dict(attn_sink=lambda a: a["attn_sink"][:3]), RuntimeError, "attn_sink must have shape"),
    ("sparse_attn_fwd", dict(indexer_topk=128), RuntimeError, "indexer_topk must be 0, 512, 1024, or 2048"),
    ("sparse_attn_fwd", dict(q=lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)), RuntimeError,
     "q must have contiguous last dimension"),
    # cuDNN sparse attention backward
    ("sparse_attn_bwd", dict(kv=lambda a: a["kv"].unsqueeze(1)), ValueError, r"KV must be 2-D \(total_S_kv, D\)"),
    ("sparse_attn_bwd", dict(topk_idxs=lambda a: a["topk_idxs"].unsqueeze(1)), ValueError,
     r"topk_idxs must have shape \(6, topk_max\)"),
    ("sparse_attn_bwd", dict(topk_idxs=lambda a: a["topk_idxs"].long()), ValueError, "topk_idxs dtype mismatch"),
    ("sparse_attn_bwd", dict(q=lambda a: a["q"].unsqueeze(0)), ValueError, r"Q must be 3-D \(total_S_q, H, D\)"),
    ("sparse_attn_bwd", dict(lse=lambda a: a["lse"][:, :3]), ValueError, "LSE must have shape"),
    ("sparse_attn_bwd", dict(attn_sink=None), ValueError, "attn_sink is required"),
    ("sparse_attn_bwd", dict(kv=lambda a: a["kv"].float()), ValueError, "KV must have same dtype as Q"),
    ("sparse_attn_bwd", dict(topk_length=torch.full((6,), 2)), ValueError, "topk_length dtype mismatch"),
    # sparse score recompute (BSHD only: THD callers need the fake batch of 1)
    ("sparse_attn_score_recompute", dict(q_attn=lambda a: a["q_attn"][0]), ValueError, r"Q must be 4-D"),
    ("sparse_attn_score_recompute", dict(k_attn=lambda a: a["k_attn"].unsqueeze(2)), ValueError, "K must be 3-D"),
    ("sparse_attn_score_recompute", dict(qhead_per_kv_head=2), ValueError, "qhead_per_kv_head must equal H_q"),
    ("sparse_attn_score_recompute", dict(topk_length=torch.ones(1, 6)), ValueError, "topk_length dtype mismatch"),
    ("sparse_indexer_score_recompute", dict(weights=lambda a: a["weights"][0]), ValueError, "W must be 3-D"),
    # dense score recompute
    ("dense_attn_score_recompute", dict(max_seqlen_q=None, max_seqlen_k=None), ValueError,
     "THD dense score recompute requires max_seqlen_q and max_seqlen_k"),
    ("dense_attn_score_recompute", dict(cu_seqlens_k=None), ValueError, "requires both cu_seqlens_q and cu_seqlens_k"),
    ("dense_attn_score_recompute", dict(k=lambda a: a["k"][:, 0]), ValueError, r"THD dense score expects q/k"),
    ("dense_indexer_score_recompute", dict(cu_seqlens_q=cu(0, 5, 8, dtype=torch.int64)), ValueError,
     "cu_seqlens_q must be int32"),
    ("dense_indexer_score_recompute", dict(weights=lambda a: a["weights"][:, :2]), ValueError, "THD W shape must be"),
    # sparse indexer backward
    ("indexer_backward", dict(index_q=lambda a: a["index_q"][0]), ValueError, "index_q must be 4D"),
    ("indexer_backward", dict(topk_indices=lambda a: a["topk_indices"].long()), ValueError,
     "topk_indices dtype mismatch"),
    ("indexer_backward", dict(attn_score=lambda a: a["attn_score"][..., :2]), ValueError,
     "attn_score shape mismatch"),
    ("indexer_backward", dict(index_q=lambda a: a["index_q"].transpose(1, 2).contiguous().transpose(1, 2)),
     ValueError, "requires contiguous"),
    ("indexer_backward", dict(grad_loss=torch.ones((), dtype=F64)), ValueError, "single-element float32 tensor"),
    ("indexer_backward", dict(grad_loss=1.0), TypeError, "grad_loss must be a torch.Tensor"),
    # dense indexer backward
    ("dense_indexer_backward", dict(max_seqlen_q=None, max_seqlen_k=None), ValueError,
     "THD dense indexer backward requires batch and max_seqlen_q/k"),
    ("dense_indexer_backward", dict(cu_seqlens_q=None), ValueError,
     "THD mode requires both cu_seqlens_q and cu_seqlens_k"),
    ("dense_indexer_backward", dict(index_k=lambda a: a["index_k"].unsqueeze(1)), ValueError,
     r"THD dense indexer backward expects q=\(T_q,H,D\), w=\(T_q,H\), k=\(T_k,D\)"),
    ("dense_indexer_backward", dict(index_score=lambda a: a["index_score"][:, :1]), ValueError,
     "THD dense score tensors must have shape"),
    # Triton teacher LSE
    ("csa_teacher_lse", dict(max_seqlen_q=None), ValueError, "requires packed-sequence metadata"),
    ("csa_teacher_lse", dict(ratio=0), ValueError, "ratio must be positive"),
    ("csa_teacher_lse", dict(full_kv=lambda a: a["full_kv"].unsqueeze(1)), ValueError, "unsupported tensor layout"),
    ("csa_teacher_lse", dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None),
     ValueError, "SBHD fused CSA teacher LSE requires batch_size and seqlen_q"),
]


@pytest.mark.parametrize("stage,changes,exc,message", VIOLATIONS,
                         ids=[f"{v[0]}-{re.sub(r'[^a-z0-9]+', '_', v[3].lower())[:40]}" for v in VIOLATIONS])
def test_contract_violation_raises_the_wrappers_error(stage, changes, exc, message):
    with pytest.raises(exc, match=message):
        call(stage, _with(stage, **changes))


def test_every_stage_has_violations_covered():
    stages = {v[0].replace("_bshd", "") for v in VIOLATIONS}
    assert stages == set(K.stages), sorted(set(K.stages) - stages)


def test_torch_provider_accepts_tiny_shapes_the_gpu_kernels_reject():
    """Kernel shape support is per provider: head dim 16, 4 indexer heads and K = 3 are fine for torch."""
    for stage in K.stages:
        assert K.check_support(stage) is None
    call("indexer_backward", indexer_bwd_args())  # 4 heads < 64, K = 3 not a multiple of block_I = 128


class LaxKernels(TorchKernels):
    """A provider that checks nothing itself and records whether it ran."""

    name = "lax"
    ran: list = []

    def execute(self, stage, arguments):
        LaxKernels.ran.append(stage)
        return super().execute(stage, arguments)


class DecliningKernels(TorchKernels):
    """A provider whose kernel shape support declines every indexer forward."""

    name = "declining"

    def support_indexer_forward(self, arguments):
        return "declines everything"


@pytest.fixture()
def test_providers(monkeypatch):
    monkeypatch.setattr(plan_mod, "PROVIDERS", dict(plan_mod.PROVIDERS))
    for cls in (LaxKernels, DecliningKernels):
        plan_mod.register_provider(cls.name, cls)
    LaxKernels.ran.clear()
    yield
    for cls in (LaxKernels, DecliningKernels):
        plan_mod._INSTANCES.pop(cls.name, None)


@pytest.mark.parametrize("stage,changes,exc,message", VIOLATIONS[:1] + VIOLATIONS[-1:])
def test_a_provider_cannot_skip_the_contract(test_providers, stage, changes, exc, message):
    """The dispatcher checks the contract before it chooses a provider: a provider whose methods check nothing
    never sees a bad call (negative control: the same provider runs the valid baseline)."""
    call(stage, BASELINES[stage](), provider="lax")
    assert LaxKernels.ran == [stage.replace("_bshd", "")]
    with pytest.raises(exc, match=message):
        call(stage, _with(stage, **changes), provider="lax")
    assert LaxKernels.ran == [stage.replace("_bshd", "")]


def test_the_contract_is_checked_before_provider_selection(test_providers):
    """A contract violation is the wrapper's error even where the chosen provider would decline the call; a valid
    call is declined (negative control)."""
    stage, changes, exc, message = VIOLATIONS[0]
    assert stage == "indexer_forward"
    with pytest.raises(plan_mod.StageUnsupported, match="declines everything"):
        call(stage, BASELINES[stage](), provider="declining")
    with pytest.raises(exc, match=message):
        call(stage, _with(stage, **changes), provider="declining")


def test_every_stage_has_a_contract_check():
    assert set(contracts._CHECKS) == set(STAGES)
