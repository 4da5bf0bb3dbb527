"""Argument contracts of the production kernel wrappers, enforced once for every provider by the dispatcher.

Each ``check_<stage>`` raises where the real wrapper raises, with the same exception type and the gist of its
message (cudnn-frontend 1.32.0 ``cudnn/deepseek_sparse_attention``; FlashMLA ``csrc/api/sparse_fwd.h``, ``nv_dev``
b7643bd for ``indexer_topk``, whose ``TORCH_CHECK`` raises ``RuntimeError``; Megatron ``csa_teacher_lse.py``). Only
the *argument* contract lives here (ranks, index dtypes, required arguments, cross-argument shapes, contiguity where
the wrapper does not copy);
data dtypes and kernel sizes (bf16, D = 512, H >= 64, K % 128 ...) are per-provider ``check_support`` business.

Where this module is stricter than the wrapper it says so:

* THD calls must pass ``max_seqlen_q`` / ``max_seqlen_k``. The SM90 indexer forward raises without them; the dense
  wrappers would instead read ``cu_seqlens`` on the host — a blocking device-to-host copy that fails under CUDA
  graph capture, which is how production runs. Megatron always passes them; a call site that forgets is a bug.
* ``flash_mla_sparse_fwd`` index width must be a multiple of 64 (the kernel's ``B_TOPK`` tile). The kernel does not
  check it; Megatron's adapter pads with ``-1`` to 128 (sm90) / 64 (sm100).
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

FLASH_MLA_B_TOPK = 64


def _fail(exc: type, message: str) -> None:
    raise exc(message)


def _require(condition: bool, exc: type, message: str) -> None:
    if not condition:
        _fail(exc, message)


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def _check_cu_seqlens(t: Tensor, name: str, exc: type = AssertionError) -> None:
    _require(isinstance(t, torch.Tensor), exc, f"{name} must be a tensor")
    _require(t.dtype == torch.int32, exc, f"{name} must be int32")
    _require(t.ndim == 1, exc, f"{name} must be 1D")
    _require(t.stride(0) == 1, exc, f"{name} must be contiguous")


def _check_thd_max_seqlen(max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], what: str) -> None:
    _require(max_seqlen_q is not None and max_seqlen_k is not None, ValueError,
             f"THD {what} requires max_seqlen_q and max_seqlen_k (host ints); without them the wrapper reads "
             "cu_seqlens on the host, a blocking device-to-host copy that breaks CUDA graph capture")
    for name, v in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, ValueError,
                 f"{name} must be a non-negative host int, got {v!r}")


def _check_grad_loss(grad_loss: Tensor, device: torch.device) -> None:
    _require(torch.is_tensor(grad_loss), TypeError, "grad_loss must be a torch.Tensor")
    _require(grad_loss.numel() == 1 and grad_loss.dtype == torch.float32 and grad_loss.device == device, ValueError,
             f"grad_loss must be a single-element float32 tensor on {device}")


# ---- 1. indexer forward (indexer_forward/_interface_sm90.py::indexer_fwd) ---------------------------------------
def check_indexer_forward(q, k, w, ratio, qhead_per_kv_head, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          q_causal_offsets) -> None:
    _require(ratio >= 1, ValueError, f"ratio must be >= 1, got {ratio}")
    _require((cu_seqlens_q is None) == (cu_seqlens_k is None), ValueError,
             "THD input requires both cu_seqlens_q and cu_seqlens_k")
    if cu_seqlens_q is not None:
        for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
            _check_cu_seqlens(t, name)
        _require(q.ndim == 3, AssertionError, f"THD q must be 3D, got {q.ndim}D")
        _require(k.ndim == 3, AssertionError, f"THD k must be 3D, got {k.ndim}D")
        _require(w.ndim == 2, AssertionError, f"THD w must be 2D, got {w.ndim}D")
        batch = cu_seqlens_q.shape[0] - 1
        _require(_shape(cu_seqlens_k) == (batch + 1,), AssertionError,
                 f"cu_seqlens_k must have shape {(batch + 1,)}, got {_shape(cu_seqlens_k)}")
        if max_seqlen_q is None or max_seqlen_k is None:
            _fail(ValueError, "THD input requires max_seqlen_q and max_seqlen_k")
        _check_thd_max_seqlen(max_seqlen_q, max_seqlen_k, "indexer forward")
        _require(_shape(w) == _shape(q)[:2], AssertionError, f"THD w shape must be {_shape(q)[:2]}, got {_shape(w)}")
        n_heads_q, head_dim = q.shape[1], q.shape[2]
        n_heads_kv, head_dim_k = k.shape[1], k.shape[2]
    else:
        _require(q.ndim == 4, AssertionError, f"q must be 4D BSHD, got {q.ndim}D")
        _require(k.ndim == 4, AssertionError, f"k must be 4D BSHD, got {k.ndim}D")
        _require(w.ndim == 3, AssertionError, f"w must be 3D BSH, got {w.ndim}D")
        b, s_q, n_heads_q, head_dim = q.shape
        _require(k.shape[0] == b, AssertionError, f"q batch ({b}) != k batch ({k.shape[0]})")
        _require(_shape(w) == (b, s_q, n_heads_q), AssertionError,
                 f"w shape must be {(b, s_q, n_heads_q)}, got {_shape(w)}")
        n_heads_kv, head_dim_k = k.shape[2], k.shape[3]
        batch = b
    _require(head_dim == head_dim_k, AssertionError, f"q head_dim ({head_dim}) != k head_dim ({head_dim_k})")
    _require(n_heads_kv == 1, AssertionError, f"SM90 direct fwd currently supports num_head_kv == 1, got {n_heads_kv}")
    if qhead_per_kv_head is not None:
        _require(qhead_per_kv_head == n_heads_q // n_heads_kv, AssertionError,
                 f"qhead_per_kv_head ({qhead_per_kv_head}) != num_heads_q // num_heads_kv ({n_heads_q // n_heads_kv})")
    if q_causal_offsets is not None:
        _require(q_causal_offsets.dtype == torch.int32, ValueError, "q_causal_offsets must be int32")
        _require(q_causal_offsets.ndim == 1 and q_causal_offsets.shape[0] == batch, ValueError,
                 f"q_causal_offsets must have shape ({batch},), got {_shape(q_causal_offsets)}")


# ---- 3. top-k (indexer_top_k/api.py::IndexerTopK.check_support) -------------------------------------------------
def check_indexer_top_k(input_values, seq_lens, top_k, next_n, tie_break) -> None:
    _require(seq_lens.dtype == torch.int32, ValueError,
             f"seq_lens dtype mismatch: expected torch.int32, got {seq_lens.dtype}")
    _require(input_values.ndim == 2, ValueError,
             f"input_values must be 2-D (n_rows, num_cols), got {_shape(input_values)}")
    _require(seq_lens.ndim == 1, ValueError, f"seq_lens must be 1-D, got {_shape(seq_lens)}")
    _require(0 < top_k <= 2048, ValueError, f"top_k must be in (0, 2048], got {top_k}")
    _require(tie_break in (0, 1, 2), ValueError, "tie_break must be 0 (none), 1 (small), or 2 (large)")
    n_rows, batch = input_values.shape[0], seq_lens.shape[0]
    _require(n_rows == batch * next_n, ValueError,
             f"n_rows ({n_rows}) must equal seq_lens.numel() * next_n ({batch} * {next_n} = {batch * next_n}). "
             "For independent top-K over equal-length rows use next_n=1 and seq_lens of shape (n_rows,).")


# ---- 3a. compactify (indexer_top_k/compactify.py) ----------------------------------------------------------------
def check_compactify(indices) -> None:
    _require(indices.dtype == torch.int32, TypeError, f"idxs must be int32, got {indices.dtype}")
    _require(indices.ndim in (2, 3), ValueError, "idxs must be a 2D or 3D CUDA tensor")


# ---- 4. FlashMLA sparse forward (csrc/api/sparse_fwd.h::sparse_attn_prefill_interface) ---------------------------
#: ``indexer_topk`` values FlashMLA ``nv_dev`` accepts (b7643bd, the branch head Megatron builds; 1024 since b7643bd)
INDEXER_TOPKS = (0, 512, 1024, 2048)


def check_indexer_topk(h_q: int, d_qk: int, indexer_topk: int) -> None:
    """FlashMLA ``nv_dev`` b7643bd's ``TORCH_CHECK``s on ``indexer_topk`` (``sparse_attn_prefill_interface``): one of
    :data:`INDEXER_TOPKS`; with ``h_q == 128`` only ``d_qk == 512`` and not 2048 (the sm100 small-top-k kernel
    instantiates 512 / 1024; sm90 runs both head counts)."""
    _require(indexer_topk in INDEXER_TOPKS, RuntimeError,
             f"indexer_topk must be 0, 512, 1024, or 2048, got {indexer_topk}")
    _require(not (h_q == 128 and d_qk == 576 and indexer_topk > 0), RuntimeError,
             "indexer_topk > 0 with h_q == 128 currently requires d_qk == 512")
    _require(not (h_q == 128 and indexer_topk == 2048), RuntimeError,
             "indexer_topk == 2048 is not supported for h_q == 128 (small-topk only instantiates 512/1024)")


def check_sparse_attn_fwd(q, kv, indices, d_v, attn_sink, topk_length, indexer_topk) -> None:
    for t, name, nd in ((q, "q", 3), (kv, "kv", 3), (indices, "indices", 3), (attn_sink, "attn_sink", 1),
                        (topk_length, "topk_length", 1)):
        if t is not None:
            _require(t.ndim == nd, RuntimeError, f"{name} must have {nd} dimensions, got {t.ndim}")
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv = kv.shape[0], kv.shape[1]
    check_indexer_topk(h_q, d_qk, indexer_topk)
    _require(indices.dtype == torch.int32, RuntimeError, f"indices must have dtype int32, got {indices.dtype}")
    if topk_length is not None:
        _require(topk_length.dtype == torch.int32, RuntimeError,
                 f"topk_length must have dtype int32, got {topk_length.dtype}")
    _require(kv.dtype == q.dtype, RuntimeError, f"kv must have the dtype of q ({q.dtype}), got {kv.dtype}")
    _require(_shape(kv) == (s_kv, h_kv, d_qk), RuntimeError,
             f"kv must have shape {(s_kv, h_kv, d_qk)}, got {_shape(kv)}")
    topk = indices.shape[2]
    _require(_shape(indices) == (s_q, h_kv, topk), RuntimeError,
             f"indices must have shape {(s_q, h_kv, topk)}, got {_shape(indices)}")
    if attn_sink is not None:
        _require(_shape(attn_sink) == (h_q,), RuntimeError,
                 f"attn_sink must have shape {(h_q,)}, got {_shape(attn_sink)}")
    if topk_length is not None:
        _require(_shape(topk_length) == (s_q,), RuntimeError,
                 f"topk_length must have shape {(s_q,)}, got {_shape(topk_length)}")
    for t, name in ((q, "q"), (kv, "kv"), (indices, "indices"), (attn_sink, "attn_sink"), (topk_length, "topk_length")):
        if t is not None and t.shape[-1] > 1:
            _require(t.stride(-1) == 1, RuntimeError, f"{name} must have contiguous last dimension")
    _require(d_v <= d_qk, RuntimeError, f"Invalid d_v {d_v} for d_qk {d_qk}")
    _require(topk % FLASH_MLA_B_TOPK == 0, RuntimeError,
             f"topk ({topk}) must be a multiple of {FLASH_MLA_B_TOPK} (the kernel's B_TOPK tile); pad indices with -1")


# ---- 5. sparse attention backward (sparse_attention_backward/api.py::SparseAttentionBackward.check_support) -------
def check_sparse_attn_bwd(q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, q_cluster_mode) -> None:
    _require(q_cluster_mode in ("off", "adaptive_pair"), ValueError,
             f"q_cluster_mode must be 'off' or 'adaptive_pair', got {q_cluster_mode!r}")
    _require(torch.is_tensor(attn_sink), ValueError, "attn_sink is required (pass -inf for no sink)")
    _require(q.ndim == 3, ValueError, f"Q must be 3-D (total_S_q, H, D), got {_shape(q)}")
    _require(kv.ndim == 2, ValueError, f"KV must be 2-D (total_S_kv, D), got {_shape(kv)}")
    for t, name in ((kv, "KV"), (out, "out"), (dout, "dout")):
        _require(t.dtype == q.dtype, ValueError,
                 f"{name} dtype mismatch: expected {q.dtype}, got {t.dtype}: {name} must have same dtype as Q")
    _require(topk_idxs.dtype == torch.int32, ValueError,
             f"topk_idxs dtype mismatch: expected torch.int32, got {topk_idxs.dtype}")
    if topk_length is not None:
        _require(topk_length.dtype == torch.int32, ValueError,
                 f"topk_length dtype mismatch: expected torch.int32, got {topk_length.dtype}")
    tensors = [("q", q), ("kv", kv), ("out", out), ("dout", dout), ("lse", lse), ("attn_sink", attn_sink),
               ("topk_idxs", topk_idxs)] + ([("topk_length", topk_length)] if topk_length is not None else [])
    _require(all(t.device == q.device for _, t in tensors), ValueError,
             f"All inputs must share Q's device {q.device}, got {[t.device for _, t in tensors]}")
    total_s_q, num_heads, head_dim = q.shape
    _require(kv.shape[1] == head_dim, ValueError, f"KV must have shape (total_S_kv, {head_dim}), got {_shape(kv)}")
    expected_o = (total_s_q, num_heads, head_dim)
    _require(_shape(out) == expected_o, ValueError, f"out must have shape {expected_o}, got {_shape(out)}")
    _require(_shape(dout) == expected_o, ValueError, f"dout must have shape {expected_o}, got {_shape(dout)}")
    _require(_shape(lse) == (total_s_q, num_heads), ValueError,
             f"LSE must have shape {(total_s_q, num_heads)}, got {_shape(lse)}")
    _require(_shape(attn_sink) == (num_heads,), ValueError,
             f"attn_sink must have shape {(num_heads,)}, got {_shape(attn_sink)}")
    _require(topk_idxs.ndim == 2 and topk_idxs.shape[0] == total_s_q, ValueError,
             f"topk_idxs must have shape ({total_s_q}, topk_max), got {_shape(topk_idxs)}")
    if topk_length is not None:
        _require(_shape(topk_length) == (total_s_q,), ValueError,
                 f"topk_length must have shape {(total_s_q,)}, got {_shape(topk_length)}")


# ---- 6/7. sparse score recompute (score_recompute/api.py::_check_sparse_score_shapes) ----------------------------
def check_sparse_score_recompute(q, k, aux, topk_indices, topk_length, aux_name: str, qhead_per_kv_head) -> None:
    _require(q.ndim == 4, ValueError, f"Q must be 4-D (B, S_q, H_q, D), got {_shape(q)}")
    _require(k.ndim == 3, ValueError, f"K must be 3-D (B, S_k, D) MQA, got {_shape(k)}")
    _require(aux.ndim == 3, ValueError, f"{aux_name} must be 3-D (B, S_q, H_q), got {_shape(aux)}")
    _require(topk_indices.ndim == 3, ValueError, f"topk_indices must be 3-D (B, S_q, topk), got {_shape(topk_indices)}")
    _require(not topk_indices.is_floating_point(), ValueError,
             f"topk_indices dtype mismatch: expected torch.int32, got {topk_indices.dtype}")
    b, s_q, h_q, d = q.shape
    _require(k.shape[0] == b, ValueError, f"K batch dim {k.shape[0]} must match Q batch dim {b}")
    _require(k.shape[2] == d, ValueError, f"K head dim {k.shape[2]} must match Q head dim {d}")
    _require(_shape(aux) == (b, s_q, h_q), ValueError, f"{aux_name} shape must be {(b, s_q, h_q)}, got {_shape(aux)}")
    _require(_shape(topk_indices)[:2] == (b, s_q), ValueError,
             f"topk_indices leading dims must be {(b, s_q)}, got {_shape(topk_indices)[:2]}")
    if qhead_per_kv_head is not None:
        _require(qhead_per_kv_head == h_q, ValueError,
                 f"qhead_per_kv_head must equal H_q ({h_q}) for MQA sparse score, got {qhead_per_kv_head}")
    if topk_length is not None:
        _require(topk_length.dtype == torch.int32, ValueError,
                 f"topk_length dtype mismatch: expected torch.int32, got {topk_length.dtype}")
        _require(_shape(topk_length) == (b, s_q), ValueError,
                 f"topk_length must be shape {(b, s_q)}, got {_shape(topk_length)}")


# ---- 8/9. dense score recompute (score_recompute/api.py::_dense_sample_shapes / _check_dense_score_shapes) --------
def check_dense_score_recompute(q, k, aux, aux_name, qhead_per_kv_head, ratio, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k) -> None:
    _require((cu_seqlens_q is None) == (cu_seqlens_k is None), ValueError,
             "THD dense score requires both cu_seqlens_q and cu_seqlens_k")
    _require(ratio >= 1, ValueError, f"ratio must be >= 1, got {ratio}")
    if cu_seqlens_q is not None:
        _require(q.ndim == 3 and k.ndim == 3, ValueError, "THD dense score expects q/k with shape (total, heads, dim)")
        for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
            _check_cu_seqlens(t, name, ValueError)
        _check_thd_max_seqlen(max_seqlen_q, max_seqlen_k, "dense score recompute")
        total_q, h_q, d = q.shape
        _, h_kv, d_k = k.shape
        _require(aux.ndim == 2, ValueError, f"THD {aux_name} must be 2-D (total_q, H_q), got {_shape(aux)}")
        _require(_shape(aux) == (total_q, h_q), ValueError,
                 f"THD {aux_name} shape must be {(total_q, h_q)}, got {_shape(aux)}")
    else:
        _require(q.ndim == 4 and k.ndim == 4, ValueError, "BSHD dense score expects q/k with shape (B, S, H, D)")
        b, s_q, h_q, d = q.shape
        b_k, _, h_kv, d_k = k.shape
        _require(aux.ndim == 3, ValueError, f"BSHD {aux_name} must be 3-D (B, S_q, H_q), got {_shape(aux)}")
        _require(b_k == b, ValueError, f"K batch dim {b_k} must match Q batch dim {b}")
        _require(_shape(aux) == (b, s_q, h_q), ValueError,
                 f"{aux_name} shape must be {(b, s_q, h_q)}, got {_shape(aux)}")
    _require(d_k == d, ValueError, f"K head dim {d_k} must match Q head dim {d}")
    _require(h_kv > 0 and h_q % h_kv == 0, ValueError, f"H_q ({h_q}) must be divisible by H_kv ({h_kv})")
    if qhead_per_kv_head is not None:
        _require(h_q == h_kv * qhead_per_kv_head, ValueError,
                 f"H_q ({h_q}) must equal H_kv ({h_kv}) * qhead_per_kv_head ({qhead_per_kv_head})")


# ---- 10. sparse indexer backward (indexer_backward/api.py) -------------------------------------------------------
def check_indexer_backward(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss) -> None:
    _require(index_q.ndim == 4, ValueError,
             f"indexer_backward index_q must be 4D (B, S_q, H, D), got {index_q.ndim}D shape {_shape(index_q)}")
    _require(index_k.ndim == 3, ValueError,
             f"indexer_backward index_k must be 3D (B, S_k, D), got {index_k.ndim}D shape {_shape(index_k)}")
    _require(topk_indices.ndim == 3, ValueError,
             f"indexer_backward topk_indices must be 3D (B, S_q, topk), got {topk_indices.ndim}D shape "
             f"{_shape(topk_indices)}")
    _require(topk_indices.dtype == torch.int32, ValueError,
             f"topk_indices dtype mismatch: expected torch.int32, got {topk_indices.dtype}")
    for t, name in ((attn_score, "attn_score"), (index_score, "index_score")):
        _require(t.dtype in (torch.float32, torch.float64), ValueError,
                 f"{name} dtype mismatch: expected torch.float32, got {t.dtype}")
    b, s_q, h, d = index_q.shape
    s_k, topk = index_k.shape[1], topk_indices.shape[-1]
    for t, name, expected in ((weights, "weights", (b, s_q, h)), (index_k, "index_k", (b, s_k, d)),
                              (attn_score, "attn_score", (b, s_q, topk)), (index_score, "index_score", (b, s_q, topk)),
                              (topk_indices, "topk_indices", (b, s_q, topk))):
        _require(_shape(t) == expected, ValueError,
                 f"IndexerBackward {name} shape mismatch: expected {expected}, got {_shape(t)}")
    for t, name in ((index_q, "index_q"), (weights, "weights"), (index_k, "index_k"), (attn_score, "attn_score"),
                    (index_score, "index_score"), (topk_indices, "topk_indices")):
        _require(t.is_contiguous(), ValueError,
                 f"IndexerBackward requires contiguous (compact row-major) tensors; {name} has shape {_shape(t)} "
                 f"with non-compact stride {tuple(t.stride())}")
    _check_grad_loss(grad_loss, index_q.device)


# ---- 11. dense indexer backward (indexer_backward/api.py::_dense_shapes, DenseIndexerBackward) ---------------------
def check_dense_indexer_backward(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss,
                                 ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    _require((cu_seqlens_q is None) == (cu_seqlens_k is None), ValueError,
             "DenseIndexerBackward THD mode requires both cu_seqlens_q and cu_seqlens_k")
    _require(ratio >= 1, ValueError, f"ratio must be >= 1, got {ratio}")
    if cu_seqlens_q is not None:
        _require(index_q.ndim == 3 and weights.ndim == 2 and index_k.ndim == 2, ValueError,
                 "THD dense indexer backward expects q=(T_q,H,D), w=(T_q,H), k=(T_k,D)")
        for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
            _require(t.dtype == torch.int32 and t.ndim == 1, ValueError, f"{name} must be a 1D int32 tensor")
        if max_seqlen_q is None or max_seqlen_k is None:
            _fail(ValueError, "THD dense indexer backward requires batch and max_seqlen_q/k (host ints); without them "
                              "the wrapper reads cu_seqlens on the host, a blocking device-to-host copy that breaks "
                              "CUDA graph capture")
        _check_thd_max_seqlen(max_seqlen_q, max_seqlen_k, "dense indexer backward")
        total_q, heads, head_dim = index_q.shape
        _require(index_k.shape[1] == head_dim, ValueError, "index_q and index_k head dimensions must match")
        score_shape, denom_shape = (total_q, max_seqlen_k), (total_q,)
        _require(_shape(weights) == (total_q, heads), ValueError,
                 f"weights shape mismatch: expected {(total_q, heads)}, got {_shape(weights)}")
        layout = "THD"
    else:
        _require(index_q.ndim == 4 and weights.ndim == 3 and index_k.ndim == 3, ValueError,
                 "BSHD dense indexer backward expects q=(B,S_q,H,D), w=(B,S_q,H), k=(B,S_k,D)")
        b, s_q, heads, head_dim = index_q.shape
        _require(index_k.shape[0] == b and index_k.shape[2] == head_dim, ValueError,
                 "index_q and index_k batch/head dimensions must match")
        _require(_shape(weights) == (b, s_q, heads), ValueError,
                 f"weights shape mismatch: expected {(b, s_q, heads)}, got {_shape(weights)}")
        score_shape, denom_shape = (b, s_q, index_k.shape[1]), (b, s_q)
        layout = "BSHD"
    _require(_shape(attn_score) == score_shape and _shape(index_score) == score_shape, ValueError,
             f"{layout} dense score tensors must have shape {score_shape}, got {_shape(attn_score)} and "
             f"{_shape(index_score)}")
    _require(_shape(attn_l1norm) == denom_shape and _shape(index_lse) == denom_shape, ValueError,
             f"{layout} dense denom tensors must have shape {denom_shape}, got {_shape(attn_l1norm)} and "
             f"{_shape(index_lse)}")
    # the kernel takes the scores, L1 norms and LSE in fp32 (float64 only in the torch provider's float64 mode)
    wide = torch.float64 if index_q.dtype == torch.float64 else torch.float32
    for t, name in ((attn_score, "attn_score"), (attn_l1norm, "attn_l1norm"), (index_score, "index_score"),
                    (index_lse, "index_lse")):
        _require(t.dtype == wide, ValueError, f"{name} dtype mismatch: expected {wide}, got {t.dtype}")
    _check_grad_loss(grad_loss, index_q.device)


# ---- 12. Triton teacher LSE (Megatron csa_utils/csa_teacher_lse.py::fused_csa_teacher_lse) ------------------------
def check_csa_teacher_lse(query, full_kv, compressed_kv, attn_sink, window_indices, ratio, batch_size, seqlen_q,
                          cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    _require(ratio > 0, ValueError, f"ratio must be positive, got {ratio}")
    layout_ok = (query.ndim == 3 and full_kv.ndim == 2 and compressed_kv.ndim in (2, 3)
                 and query.shape[-1] == full_kv.shape[-1] == compressed_kv.shape[-1]
                 and attn_sink.ndim == 1 and attn_sink.numel() == query.shape[1]
                 and window_indices.ndim == 2 and window_indices.shape[0] == query.shape[0]
                 and window_indices.dtype in (torch.int32, torch.int64)
                 and full_kv.dtype == query.dtype and compressed_kv.dtype == query.dtype)
    _require(layout_ok, ValueError, "unsupported tensor layout or dtype for fused CSA teacher LSE")
    if cu_seqlens_q is None:
        _require(batch_size is not None and seqlen_q is not None, ValueError,
                 "SBHD fused CSA teacher LSE requires batch_size and seqlen_q")
        _require(compressed_kv.ndim == 3 and compressed_kv.shape[0] == batch_size, ValueError,
                 "SBHD compressed_kv must have shape [batch, seqlen_k, dim]")
        _require(query.shape[0] == batch_size * seqlen_q, ValueError,
                 "flat query length must equal batch_size * seqlen_q")
    else:
        _require(not any(v is None for v in (cu_seqlens_k, max_seqlen_q, max_seqlen_k)), ValueError,
                 "THD fused CSA teacher LSE requires packed-sequence metadata")
        _require(compressed_kv.ndim == 2, ValueError, "THD compressed_kv must have shape [total_k, dim]")
        _require(cu_seqlens_q.shape == cu_seqlens_k.shape, ValueError,
                 "THD query and compressed-KV cumulative lengths must match")


# ---- the dispatcher's entry point ------------------------------------------------------------------------------------
def _arguments(*names: str):
    return lambda a: tuple(a[n] for n in names)


_THD = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")

#: stage -> (its ``check_<stage>`` function, the call's arguments that function takes, in order).
_CHECKS = {
    "indexer_forward": (check_indexer_forward, lambda a: (a["q"], a["k"], a["w"], a["ratio"], a["qhead_per_kv_head"],
                                                          *_arguments(*_THD)(a), a["q_causal_offsets"])),
    "indexer_top_k": (check_indexer_top_k, _arguments("input_values", "seq_lens", "top_k", "next_n", "tie_break")),
    "compactify": (check_compactify, _arguments("indices")),
    "sparse_attn_fwd": (check_sparse_attn_fwd, _arguments("q", "kv", "indices", "d_v", "attn_sink", "topk_length",
                                                          "indexer_topk")),
    "sparse_attn_bwd": (check_sparse_attn_bwd, _arguments("q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs",
                                                          "topk_length", "q_cluster_mode")),
    "sparse_attn_score_recompute": (check_sparse_score_recompute, lambda a: (
        a["q_attn"], a["k_attn"], a["lse"], a["topk_indices"], a["topk_length"], "LSE", a["qhead_per_kv_head"])),
    "sparse_indexer_score_recompute": (check_sparse_score_recompute, lambda a: (
        a["q_indexer"], a["k_indexer"], a["weights"], a["topk_indices"], a["topk_length"], "W",
        a["qhead_per_kv_head"])),
    "dense_attn_score_recompute": (check_dense_score_recompute, lambda a: (
        a["q"], a["k"], a["lse"], "LSE", a["qhead_per_kv_head"], a["ratio"], *_arguments(*_THD)(a))),
    "dense_indexer_score_recompute": (check_dense_score_recompute, lambda a: (
        a["q"], a["k"], a["weights"], "W", a["qhead_per_kv_head"], a["ratio"], *_arguments(*_THD)(a))),
    "indexer_backward": (check_indexer_backward, _arguments("index_q", "weights", "index_k", "attn_score",
                                                            "index_score", "topk_indices", "grad_loss")),
    "dense_indexer_backward": (check_dense_indexer_backward, _arguments(
        "index_q", "weights", "index_k", "attn_score", "attn_l1norm", "index_score", "index_lse", "grad_loss",
        "ratio", *_THD)),
    "csa_teacher_lse": (check_csa_teacher_lse, _arguments("query", "full_kv", "compressed_kv", "attn_sink",
                                                          "window_indices", "ratio", "batch_size", "seqlen_q",
                                                          *_THD)),
}


def check(stage: str, arguments: dict) -> None:
    """Enforce ``stage``'s argument contract on a call's arguments by name (``fused.kernels.base.bind_arguments``).
    The dispatcher (``fused.plan.kernels``) calls it once per kernel call, before it chooses a provider, so no
    provider can skip it."""
    checker, take = _CHECKS[stage]
    checker(*take(arguments))
