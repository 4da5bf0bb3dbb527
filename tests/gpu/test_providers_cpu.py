"""The GPU providers' logic, checked on the CPU: optional imports, plan fallback / requirement, kernel shape support,
and the production padding (heads, index width), exercised by routing the provider's wrapper calls to the torch
provider (which has the same signatures) and comparing with the torch provider on the unpadded inputs."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import fused
from fused import plan as plan_mod
from fused.kernels import cudnn_provider, device_support, flashmla_provider
from fused.kernels.cudnn_provider import SM90_DENSE_REFUSAL, CudnnKernels
from fused.kernels.flashmla_provider import FlashMLAKernels, padded_heads
from fused.kernels.torch_provider import TorchKernels

NO_CUDA = not torch.cuda.is_available()
TK = TorchKernels()
WRAPPERS = {
    "indexer_forward_wrapper": "indexer_forward", "indexer_top_k_wrapper": "indexer_top_k",
    "compactify_wrapper": "compactify", "sparse_attention_backward_wrapper": "sparse_attn_bwd",
    "sparse_attn_score_recompute_wrapper": "sparse_attn_score_recompute",
    "sparse_indexer_score_recompute_wrapper": "sparse_indexer_score_recompute",
    "dense_attn_score_recompute_wrapper": "dense_attn_score_recompute",
    "dense_indexer_score_recompute_wrapper": "dense_indexer_score_recompute",
    "indexer_backward_wrapper": "indexer_backward", "dense_indexer_backward_wrapper": "dense_indexer_backward",
}


def g(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.fixture
def sm90(monkeypatch):
    """The cudnn / flashmla providers on the CPU as on an sm90 device, their wrappers served by the torch provider."""
    calls = []

    def wrapper(stage):
        def call(*args, **kwargs):
            calls.append((stage, args, kwargs))
            return getattr(TK, stage)(*args, **kwargs)
        return call

    fake_dsa = types.SimpleNamespace(**{w: wrapper(s) for w, s in WRAPPERS.items()})

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False):
        calls.append(("flash_mla", (q, kv, indices), {"use_legacy": use_legacy}))
        return TK.sparse_attn_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)

    monkeypatch.setattr(cudnn_provider, "dsa_wrappers", lambda: fake_dsa)
    monkeypatch.setattr(flashmla_provider, "_flash_mla",
                        lambda: types.SimpleNamespace(flash_mla_sparse_fwd=flash_mla_sparse_fwd))
    for module in (cudnn_provider, flashmla_provider):
        monkeypatch.setattr(module, "device_major", lambda t: 9)
        monkeypatch.setattr(module, "placement_reason", lambda *t: None)
    return calls


# ---- optional imports, availability, plan -------------------------------------------------------------------------
@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_gpu_providers_unavailable_on_cpu_with_reason():
    reasons = fused.available_providers()
    assert reasons["torch"] is None
    for name in ("cudnn", "flashmla"):
        assert reasons[name] and "CUDA" in reasons[name]
    assert [name for name, why in reasons.items() if why is None] == ["torch"]


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_required_gpu_provider_fails_the_run_instead_of_falling_back():
    with pytest.raises(fused.BackendUnavailable, match="cudnn"):
        with fused.use_backend("auto", require=("cudnn",)):
            pass
    with pytest.raises(fused.BackendUnavailable):  # the parity hook: "cudnn" = cudnn + flashmla required
        with fused.use_backend("cudnn"):
            pass
    with fused.use_backend("auto", require=("torch",)):  # control: an available requirement is fine
        pass


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only behaviour")
def test_auto_falls_back_per_stage_and_records_it():
    ids = torch.tensor([[3, -1, 1], [-1, -1, 2]], dtype=torch.int32)
    with fused.use_backend("auto") as p:
        res = plan_mod.kernels.compactify(ids)
    assert p.record == {"compactify": "torch"} and fused.executed() == {"compactify": "torch"}
    assert res["indices"].tolist() == [[3, 1, -1], [2, -1, -1]]


def test_plan_is_seen_from_threads_that_do_not_inherit_the_context():
    """Autograd runs CUDA backward passes on its own threads: the open plan must be the one they select with."""
    seen = {}
    with fused.use_backend("torch") as p:
        t = threading.Thread(target=lambda: seen.setdefault("plan", fused.current_plan()))
        t.start()
        t.join()
    assert seen["plan"] is p
    t = threading.Thread(target=lambda: seen.__setitem__("after", fused.current_plan()))
    t.start()
    t.join()
    assert seen["after"] is not p  # control: closed blocks are not visible


# ---- kernel shape support ----------------------------------------------------------------------------------------
def test_support_declines_with_reasons(sm90):
    ck = CudnnKernels()
    q, k, w = g(1, 8, 64, 128, dtype=torch.bfloat16), g(1, 2, 1, 128, dtype=torch.bfloat16), g(1, 8, 64)
    assert ck.check_support("indexer_forward", q, k, w, ratio=4) is None
    assert "bfloat16" in ck.check_support("indexer_forward", q.float(), k, w, ratio=4)
    assert "head dim" in ck.check_support("indexer_forward", q[..., :64], k[..., :64], w, ratio=4)
    q128 = g(1, 8, 128, 128, dtype=torch.bfloat16)
    assert "at most 64" in ck.check_support("indexer_forward", q128, k, g(1, 8, 128), ratio=4)
    assert "no sparse_attn_fwd" in ck.check_support("sparse_attn_fwd", q, k, w, 1.0)


def test_sm90_dense_loss_is_refused_like_production(sm90, monkeypatch):
    q, k, lse = g(1, 8, 64, 512, dtype=torch.bfloat16), g(1, 2, 1, 512, dtype=torch.bfloat16), g(1, 8, 64)
    assert CudnnKernels().check_support("dense_attn_score_recompute", q, k, lse, 0.1, ratio=4) == SM90_DENSE_REFUSAL
    assert CudnnKernels().check_support("dense_attn_score_recompute", q, k, lse, 0.1, ratio=1) is None  # DSA V3.2
    assert CudnnKernels(sm90_dense_loss=True).check_support("dense_attn_score_recompute", q, k, lse, 0.1,
                                                            ratio=4) is None
    monkeypatch.setattr(cudnn_provider, "device_major", lambda t: 10)
    assert CudnnKernels().check_support("dense_attn_score_recompute", q, k, lse, 0.1, ratio=4) is None  # sm100


def test_required_provider_decline_raises_stage_unsupported(monkeypatch):
    monkeypatch.setattr(CudnnKernels, "unavailable_reason", classmethod(lambda cls: None))
    monkeypatch.setattr(plan_mod, "_INSTANCES", {})
    monkeypatch.setattr(plan_mod, "_UNAVAILABLE", {})
    ids = torch.tensor([[1, -1]], dtype=torch.int32)
    with fused.use_backend("auto", require=("cudnn",)):
        with pytest.raises(fused.StageUnsupported, match="cpu"):  # CPU tensors: the kernel declines
            plan_mod.kernels.compactify(ids)
    with fused.use_backend("auto") as p:  # control: unrequired, the same call falls back and says so
        plan_mod.kernels.compactify(ids)
    assert p.record == {"compactify": "torch"}


def test_flashmla_head_padding_table():
    assert [padded_heads(h, 9) for h in (1, 16, 32, 48, 64, 96, 128, 192)] == [64, 64, 64, None, 64, None, 128, None]
    assert [padded_heads(h, 10) for h in (16, 64, 96, 128)] == [64, 64, None, 128]


# ---- padding is exact ---------------------------------------------------------------------------------------------
def _close(a, b):
    return torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-5)


def test_indexer_forward_head_padding(sm90):
    q, k, w = g(2, 16, 8, 128), g(2, 4, 1, 128, seed=1), g(2, 16, 8, seed=2)
    got = CudnnKernels().indexer_forward(q, k, w, ratio=4)["scores"]
    padded_q = [a for s, a, _ in sm90 if s == "indexer_forward"][0][0]
    assert padded_q.shape[2] == 16  # 8 heads -> the sm90 kernel's 16
    assert torch.equal(got.isfinite(), TK.indexer_forward(q, k, w, ratio=4)["scores"].isfinite())
    ref = TK.indexer_forward(q, k, w, ratio=4)["scores"]
    assert _close(got.nan_to_num(neginf=0), ref.nan_to_num(neginf=0))


def _attn(h=32, t=12, kk=24, n_kv=40):
    q, kv = g(t, h, 512, seed=3), g(n_kv, 512, seed=4)
    ids = torch.stack([torch.randperm(n_kv, generator=torch.Generator().manual_seed(i))[:kk] for i in range(t)]).int()
    ids[2, 10:] = -1
    length = (ids >= 0).sum(-1).int()
    ids = TK.compactify(ids)["indices"]
    sink = g(h, seed=5)
    out, _, lse = TK.sparse_attn_fwd(q, kv.unsqueeze(1), torch.nn.functional.pad(ids, (0, 64 - kk), value=-1)
                                     .unsqueeze(1), 0.05, attn_sink=sink, topk_length=length)
    return q, kv, out, g(t, h, 512, seed=6), lse, sink, ids.clamp(min=0), length


def test_sparse_attn_bwd_head_padding(sm90):
    *args, length = _attn()
    got = CudnnKernels().sparse_attn_bwd(*args, softmax_scale=0.05, topk_length=length)
    ref = TK.sparse_attn_bwd(*args, softmax_scale=0.05, topk_length=length)
    padded = [a for s, a, _ in sm90 if s == "sparse_attn_bwd"][0]
    assert padded[0].shape[1] == 64 and torch.isneginf(padded[5][32:]).all()
    for name in ("dq", "dkv", "d_sink"):
        assert got[name].shape == ref[name].shape and _close(got[name], ref[name]), name


def _path_a_ids(t=12, kk=37, n_kv=40):
    """Path A style ids: no ``topk_length``, ``-1`` holes the kernel must skip, a width that is no multiple of 128."""
    ids = torch.randint(-1, n_kv, (t, kk), generator=torch.Generator().manual_seed(21)).int()
    ids[:, -3:] = -1
    return ids


@pytest.mark.parametrize("with_length", [False, True])
def test_sparse_attn_bwd_index_width_bucketed_to_128(sm90, with_length):
    """sm90: the backward's ids are padded with -1 to a multiple of 128 (its compile key holds the width); the
    gradients equal the unpadded call's exactly (the padded slots are ignored)."""
    q, kv, out, dout, lse, sink, ids, length = _attn(h=64, kk=24)
    if not with_length:
        ids, length = _path_a_ids(), None
    got = CudnnKernels().sparse_attn_bwd(q, kv, out, dout, lse, sink, ids, softmax_scale=0.05, topk_length=length)
    ref = TK.sparse_attn_bwd(q, kv, out, dout, lse, sink, ids, softmax_scale=0.05, topk_length=length)
    sent = [a for s, a, _ in sm90 if s == "sparse_attn_bwd"][0][6]
    assert sent.shape[-1] == 128 and torch.equal(sent[:, :ids.shape[-1]], ids) and (sent[:, ids.shape[-1]:] == -1).all()
    for name in ("dq", "dkv", "d_sink"):
        assert torch.equal(got[name], ref[name]), name


def test_sparse_attn_bwd_index_bucket_check_has_teeth(sm90, monkeypatch):
    """Negative control: padding the ids with 0 (a real key) instead of -1 changes the Path A gradients."""
    def zero_pad(t, dim, size, value=0.0):
        return device_support.pad_dim(t, dim, size, 0 if value == -1 else value)

    monkeypatch.setattr(cudnn_provider, "pad_dim", zero_pad)
    q, kv, out, dout, lse, sink, _, _ = _attn(h=64, kk=24)
    ids = _path_a_ids()
    got = CudnnKernels().sparse_attn_bwd(q, kv, out, dout, lse, sink, ids, softmax_scale=0.05)
    ref = TK.sparse_attn_bwd(q, kv, out, dout, lse, sink, ids, softmax_scale=0.05)
    assert not torch.equal(got["dkv"], ref["dkv"])


def test_sparse_attn_fwd_head_and_index_padding(sm90):
    q, kv, _, _, _, sink, _, _ = _attn(h=16)
    raw = torch.randint(0, 40, (12, 24), generator=torch.Generator().manual_seed(2)).int()
    raw[3, 5:] = -1
    packed = TK.compactify(raw)
    ids, length = torch.nn.functional.pad(packed["indices"], (0, 40), value=-1), packed["topk_length"]  # width 64
    o, m, l = FlashMLAKernels().sparse_attn_fwd(q, kv.unsqueeze(1), ids.unsqueeze(1), 0.05, attn_sink=sink,
                                                topk_length=length)
    ref = TK.sparse_attn_fwd(q, kv.unsqueeze(1), ids.unsqueeze(1), 0.05, attn_sink=sink, topk_length=length)
    (_, (qp, _, ip), kw), = [c for c in sm90 if c[0] == "flash_mla"]
    assert qp.shape[1] == 64 and ip.shape[-1] == 128 and kw["use_legacy"]
    assert o.shape == ref[0].shape and _close(o, ref[0]) and _close(l, ref[2])


def test_score_recompute_and_indexer_backward_padding(sm90):
    b, s, s_k, kk = 1, 16, 8, 200
    qa, ka, lse = g(b, s, 1, 64, seed=7), g(b, s_k, 64, seed=8), g(b, s, 1, seed=9) + 3
    ids = torch.randint(-1, s_k, (b, s, kk), generator=torch.Generator().manual_seed(1)).int()
    got = CudnnKernels().sparse_attn_score_recompute(qa, ka, lse, ids, 0.1)["target"]  # H = 1 -> 64
    assert _close(got, TK.sparse_attn_score_recompute(qa, ka, lse, ids, 0.1)["target"])

    qi, wi, ki = g(b, s, 32, 128, seed=10), g(b, s, 32, seed=11, scale=0.1), g(b, s_k, 128, seed=12)
    target = torch.softmax(g(b, s, kk, seed=13), -1)
    predict = torch.softmax(g(b, s, kk, seed=14), -1)
    unit = torch.ones(())
    t1, t2 = target.clone(), target.clone()
    got = CudnnKernels().indexer_backward(qi, wi, ki, t1, predict, ids, unit, sm_scale=0.3, loss_coeff=16.0)
    ref = TK.indexer_backward(qi, wi, ki, t2, predict, ids, unit, sm_scale=0.3, loss_coeff=16.0)
    padded = [a for s_, a, _ in sm90 if s_ == "indexer_backward"][0]
    assert padded[0].shape[2] == 64 and padded[5].shape[-1] == 256 and (padded[5][..., kk:] == -1).all()
    for name in ("d_index_q", "d_weights", "d_index_k"):
        assert got[name].shape == ref[name].shape and _close(got[name], ref[name]), name
    assert _close(t1, t2)  # the in-place score gradient reaches the caller's (unpadded) tensor


def test_padding_checks_have_teeth(sm90, monkeypatch):
    """Negative control: padding with the wrong fill value (0 ids / 0 sink instead of -1 / -inf, 0 LSE instead of
    +inf, nonzero target) changes the results the tests above compare."""
    def wrong_pad(t, dim, size, value=0.0):
        return device_support.pad_dim(t, dim, size, 1.0 if value == 0.0 else 0.0)

    monkeypatch.setattr(cudnn_provider, "pad_dim", wrong_pad)
    monkeypatch.setattr(flashmla_provider, "pad_dim", wrong_pad)
    b, s, s_k, kk = 1, 16, 8, 200
    qi, wi, ki = g(b, s, 32, 128, seed=10), g(b, s, 32, seed=11, scale=0.1), g(b, s_k, 128, seed=12)
    ids = torch.randint(-1, s_k, (b, s, kk), generator=torch.Generator().manual_seed(1)).int()
    target, predict, unit = torch.softmax(g(b, s, kk, seed=13), -1), torch.softmax(g(b, s, kk, seed=14), -1), \
        torch.ones(())
    got = CudnnKernels().indexer_backward(qi, wi, ki, target.clone(), predict, ids, unit, sm_scale=0.3)
    ref = TK.indexer_backward(qi, wi, ki, target.clone(), predict, ids, unit, sm_scale=0.3)
    assert not _close(got["d_index_q"], ref["d_index_q"])
    q, kv, *_ = _attn(h=16)
    ids2 = torch.nn.functional.pad(TK.compactify(torch.randint(0, 40, (12, 24)).int())["indices"], (0, 40), value=-1)
    o = FlashMLAKernels().sparse_attn_fwd(q, kv.unsqueeze(1), ids2.unsqueeze(1), 0.05)[0]
    assert not _close(o, TK.sparse_attn_fwd(q, kv.unsqueeze(1), ids2.unsqueeze(1), 0.05)[0])
