"""Public API contract, clear errors, split mode, precision policy, chunking and memory growth."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import reference
from cases.errors import CaseError
from reference import attention_layer, compressor, core_attention, indexer

from .helpers import bshd, case_of, materialized, run_with_grads, thd_layout, tiny_config

numerics = importlib.import_module("reference.numerics")

SIGNATURES = {
    "attention_layer": "(hidden, params, config, packed_seq_params=None, *, training=True, topk_indices=None)",
    "core_attention": "(query, kv, hidden, q_latent, params, config, packed_seq_params=None, *, training=True, "
                      "topk_indices=None)",
    "compressor": "(hidden, params, prefix, config, packed_seq_params=None, *, rotate=False)",
    "indexer": "(hidden, q_latent, params, config, packed_seq_params=None)",
    "query_latent": "(hidden, params, config, packed_seq_params=None)",
}


def plain_signature(fn) -> str:
    sig = inspect.signature(fn)
    return str(sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                           return_annotation=inspect.Signature.empty))


def test_public_api_matches_architecture():
    assert sorted(reference.__all__) == sorted(SIGNATURES)
    for name, want in SIGNATURES.items():
        assert plain_signature(getattr(reference, name)) == want, name
    assert plain_signature(lambda hidden, params: None) != SIGNATURES["indexer"]  # control


def test_bad_inputs_raise_case_errors_naming_the_field():
    config = tiny_config(4)
    t = materialized(case_of(config, bshd(1, 9)))
    h = t.inputs["hidden"]
    with pytest.raises(CaseError, match=r"^hidden"):
        attention_layer(h[0], t.params, config)  # THD-shaped input without packed_seq_params
    missing = {k: v for k, v in t.params.items() if k != "core_attention.attn_sink"}
    with pytest.raises(CaseError, match=r"params\.core_attention\.attn_sink"):
        attention_layer(h, missing, config)
    with pytest.raises(CaseError, match="topk_indices"):
        attention_layer(h, t.params, config, topk_indices=torch.zeros(1, 9, dtype=torch.int64))
    with pytest.raises(CaseError, match="topk_indices"):
        attention_layer(h, t.params, tiny_config(0), topk_indices=torch.zeros(1, 9, 2, dtype=torch.int64))
    thd_case = case_of(config, thd_layout([5, 4]))
    tt = materialized(thd_case)
    psp = tt.packed_seq_params
    psp.cu_seqlens_q_padded = torch.tensor([0, 6, 5], dtype=torch.int32)
    with pytest.raises(CaseError, match=r"cu_seqlens_q_padded\[2\]"):
        attention_layer(tt.inputs["hidden"], tt.params, config, psp)
    psp.cu_seqlens_q_padded = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(CaseError, match="cu_seqlens_q_padded"):
        attention_layer(tt.inputs["hidden"], tt.params, config, psp)
    with pytest.raises(CaseError, match="indexer"):
        indexer(h, h[..., :8], t.params, tiny_config(128))


def test_split_mode_uses_the_given_ids_for_attention_and_sparse_loss_only():
    config = tiny_config(4, dsa_indexer_topk=2)
    t = materialized(case_of(config, bshd(1, 24)))
    h = t.inputs["hidden"]
    own = attention_layer(h, t.params, config)
    same = attention_layer(h, t.params, config, topk_indices=own.topk_indices)
    assert torch.equal(own.out, same.out) and torch.equal(own.indexer_loss, same.indexer_loss)
    other_ids = torch.full_like(own.topk_indices, -1)
    other_ids[..., 0] = torch.where(own.topk_indices[..., 0] >= 0, 0, -1)  # always entry 0 only
    other = attention_layer(h, t.params, config, topk_indices=other_ids)
    assert torch.equal(other.index_scores, own.index_scores) and torch.equal(other.topk_indices, own.topk_indices)
    assert not torch.allclose(other.out, own.out) and not torch.allclose(other.indexer_loss, own.indexer_loss)
    dense = config.replace(dsa_indexer_use_sparse_loss=False)  # the dense loss does not depend on the selection
    assert torch.equal(attention_layer(h, t.params, dense).indexer_loss,
                       attention_layer(h, t.params, dense, topk_indices=other_ids).indexer_loss)


def test_eval_mode_has_no_loss_and_layers_without_indexer_no_topk():
    t = materialized(case_of(tiny_config(4), bshd(1, 9)))
    res = attention_layer(t.inputs["hidden"], t.params, tiny_config(4), training=False)
    assert res.indexer_loss is None and res.topk_indices is not None
    t0 = materialized(case_of(tiny_config(128), bshd(1, 9)))
    res0 = attention_layer(t0.inputs["hidden"], t0.params, tiny_config(128))
    assert res0.indexer_loss is None and res0.topk_indices is None and res0.index_scores is None


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 6e-2)])
def test_low_precision_follows_the_precision_policy(dtype, tol):
    config = tiny_config(4, sparse=False)  # dense loss: no top-k flips between precisions
    layout = bshd(1, 24)
    ref = materialized(case_of(config, layout, scope="core"))
    low_case = case_of(config, layout, scope="core", dtype=dtype)
    low = materialized(low_case)
    with torch.no_grad():
        i, r, o = low.inputs, ref.inputs, materialized(case_of(config, layout, scope="core", seed=1))
        res = core_attention(i["query"], i["kv"], i["hidden"], i["q_latent"], low.params, config)
        want = core_attention(r["query"], r["kv"], r["hidden"], r["q_latent"], ref.params, config)
        far = core_attention(o.inputs["query"], o.inputs["kv"], o.inputs["hidden"], o.inputs["q_latent"], o.params,
                             config)  # control: the float64 result of another seed
    assert res.out.dtype == low_case.torch_dtype
    assert res.lse.dtype == res.indexer_loss.dtype == res.index_scores.dtype == torch.float32
    scale = float(want.out.abs().max())
    assert float((res.out.double() - want.out).abs().max()) <= tol * scale
    assert float((res.lse.double() - want.lse).abs().max()) <= tol * 10
    assert float((far.out - want.out).abs().max()) > tol * scale


@pytest.mark.parametrize("ratio,sparse", [(4, True), (4, False), (128, True)])
def test_results_do_not_depend_on_row_chunking(ratio, sparse, monkeypatch):
    config = tiny_config(ratio, sparse=sparse)
    case = case_of(config, thd_layout([0, 31, 5, 134 if ratio == 128 else 19], slack=2))
    t = materialized(case)
    base = run_with_grads(attention_layer, case, t)
    monkeypatch.setattr(numerics, "ROW_CHUNK", 3)
    assert len(list(numerics.row_chunks(10))) == 4  # the patch takes effect
    chunked = run_with_grads(attention_layer, case, materialized(case))
    for key, value in base.items():
        other = chunked[key]
        if value.is_floating_point():
            assert torch.allclose(value, other, rtol=1e-13, atol=1e-14, equal_nan=True), key
        else:
            assert torch.equal(value, other), key


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def dense_attention_probe(query, kv):
    """A planted dense implementation: the [T, T] score matrix the reference must never build."""
    return torch.softmax(query[:, 0] @ kv.T, dim=-1) @ kv


@pytest.mark.parametrize("ratio", [0, 128])
def test_memory_grows_with_rows_times_keys_not_rows_squared(ratio):
    T = 1536
    config = tiny_config(ratio)
    case = case_of(config, thd_layout([T]), scope="core")
    t = materialized(case)
    i = t.inputs
    with LargestTensor() as probe:
        res = core_attention(i["query"], i["kv"], i["hidden"], i["q_latent"], t.params, config,
                             t.packed_seq_params)
        res.objective(t.grad_output).backward()
    keys = config.csa_window_size + (T // ratio if ratio else 0)
    per_row = max(config.num_attention_heads * config.v_head_dim, keys * config.v_head_dim, config.hidden_size)
    assert probe.largest <= 2 * T * per_row < T * T
    with LargestTensor() as control:  # negative control: a dense [T, T] implementation trips the same bound
        dense_attention_probe(i["query"].detach(), i["kv"].detach())
    assert control.largest >= T * T


def test_compressor_and_indexer_public_shapes():
    config = tiny_config(4)
    t = materialized(case_of(config, bshd(2, 11)))
    h = t.inputs["hidden"]
    assert compressor(h, t.params, "core_attention.compressor", config).shape == (2, 2, 16)
    assert compressor(h, t.params, "core_attention.indexer.compressor", config, rotate=True).shape == (2, 2, 16)
    scores, topk = indexer(h, torch.randn(2, 11, 8, dtype=torch.float64), t.params, config)
    assert scores.shape == (2, 11, 2) and topk.shape == (2, 11, 2) and topk.dtype == torch.int64
