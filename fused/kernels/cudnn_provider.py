"""``cudnn`` provider: the cudnn-frontend 1.32.0 ``cudnn.DSA`` wrappers Megatron-LM ``dev`` calls on Hopper.

Stages: indexer forward, radix top-k, compactify, sparse attention backward, sparse and dense score recompute,
sparse and dense indexer backward (spec ``kernels.md`` §1 rows 1, 3, 3a, 5-11). Not here: the sparse attention
forward (no sm90 cuDNN kernel; :mod:`.flashmla_provider`) and the Triton teacher LSE (the ``torch`` provider runs it).

Every call (its argument contract already enforced by the dispatcher, :mod:`.contracts`) applies the padding
production applies around the kernel, then calls the wrapper under
``torch.cuda.device(<input device>)`` (the wrappers pick the sm90 / sm100 kernel from the current device):

* heads: the sm90 sparse-attention backward, the sparse / dense indexer backward and the score recomputes work on
  tiles of 64 query heads; a head count that is not a multiple of the tile is padded with zero queries (indexer:
  zero weights; attention: LSE ``+inf`` / sink ``-inf``) and the results sliced back. The sm90 indexer forward
  takes 16, 32 or 64 heads per KV head and is padded up to the next of those.
* index width: the sparse indexer backward needs ``K % 128 == 0`` (``block_I``); ids are padded with ``-1`` and
  both score rows with 0, and the in-place score gradient is copied back into the caller's ``attn_score``.
* compile-key bucketing: the sm90 sparse-attention backward compiles one CuTe-DSL kernel per index width
  (``max_topk`` is in its compile key, 6-11 s each). Its ids are padded with ``-1`` (ignored slots, as past
  ``topk_length``) to a multiple of 128, the width the FlashMLA forward already pads the same ids to on sm90, so
  every width in a bucket shares one compiled kernel; the extra slots add exact zeros.

Kernel shape support (the ``support_<stage>`` methods behind :meth:`~.base.KernelSet.check_support`) declines what
no wrapper on the running architecture accepts — bf16 only, head dims 128 (indexer) / 512 or 576 (attention),
empty inputs, sm100-only options — with a reason, so a plan falls back to ``torch`` (``auto``) or reports
``unsupported`` (a required provider).

Production policy on sm90: Megatron refuses the DSv4 *dense* indexer loss (ratio-4 indexer, dense KL) on SM90
("the cuDNN Frontend SM90 dense DSA kernels are not reliable for this path"). The dense score recompute and dense
indexer backward therefore decline ratio > 1 calls on sm90 unless the provider is built with
``sm90_dense_loss=True`` (the kernel-level checks do that, to measure the kernels themselves).

Imports of ``cudnn`` happen only when a method runs: on a machine without the package the module imports and the
provider reports itself unavailable.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import compile_cache
from .base import KernelSet, Tensor, TupleDict
from .device_support import (cuda_unavailable_reason, device_major, dtype_reason, first_reason, into,
                             on_device, pad_dim, placement_reason, round_up)

BF16 = (torch.bfloat16,)
HEAD_TILE = 64                    # sm90 query-head tile (backward, score recompute, indexer backward)
SM90_INDEXER_QHPKV = (16, 32, 64)  # indexer forward: query heads per KV head on sm90
INDEXER_HEAD_DIM = 128
ATTENTION_HEAD_DIMS = (512, 576)
INDEXER_BWD_BLOCK_I = 128
INDEXER_BWD_MAX_ROWS = 65535       # the sparse indexer backward's grid is (S_q, B)
TOP_K_MAX = 2048
SM90_BWD_INDEX_BUCKET = 128        # sparse-attention backward: index width padded to a multiple of this (compile key)
SM90_DENSE_REFUSAL = ("production refuses the DSv4 dense indexer loss (ratio-4 indexer) on SM90: the cuDNN Frontend "
                      "SM90 dense DSA kernels are not reliable for this path (Megatron transformer_config check)")


def dsa_wrappers():
    """``cudnn.DSA``, with the compiled-kernel caches pointed at the project's directory before the CuTe DSL is
    imported and the wrappers' compile caches made persistent (:mod:`.compile_cache`)."""
    if not _INSTALLED:
        compile_cache.configure_environment()
    from cudnn import DSA  # noqa: PLC0415 - optional dependency, imported on first use
    if not _INSTALLED:
        _INSTALLED.append(compile_cache.install())
    return DSA


_INSTALLED: list = []


def _padded_heads(heads: int) -> int:
    """Head count after padding to the 64-head tile (a multiple of 64; at least 64)."""
    return max(HEAD_TILE, round_up(heads, HEAD_TILE))


def _score_heads(heads: int) -> int:
    """Score recompute: the kernel tiles ``min(H, 64)`` heads and needs ``H > 1`` divisible by the tile."""
    if heads > 1 and heads % min(heads, HEAD_TILE) == 0:
        return heads
    return _padded_heads(heads)


class CudnnKernels(KernelSet):
    """cudnn-frontend DSA wrappers with the production padding. ``sm90_dense_loss``: run the dense-loss kernels on
    sm90 despite production's refusal (measurement only)."""

    name = "cudnn"
    topk_tie_rule = "arbitrary"  # the radix top-k, called with tie_break=0 ("none")
    stages = frozenset({"indexer_forward", "indexer_top_k", "compactify", "sparse_attn_bwd",
                        "sparse_attn_score_recompute", "sparse_indexer_score_recompute", "dense_attn_score_recompute",
                        "dense_indexer_score_recompute", "indexer_backward", "dense_indexer_backward"})

    def __init__(self, sm90_dense_loss: bool = False):
        self.sm90_dense_loss = bool(sm90_dense_loss)

    # ================================================================ availability / support ======================
    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        reason = cuda_unavailable_reason()
        if reason is not None:
            return reason
        try:
            import cudnn  # noqa: F401, PLC0415
            dsa_wrappers().indexer_forward_wrapper  # noqa: B018 - the first DSA attribute imports CuTe DSL / TVM FFI
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
            return f"cudnn-frontend DSA wrappers cannot be imported: {type(exc).__name__}: {exc}"
        return None

    @staticmethod
    def versions() -> dict[str, Any]:
        import cudnn  # noqa: PLC0415
        return {"cudnn_frontend": getattr(cudnn, "__version__", None), "cudnn_backend": cudnn.backend_version()}

    def _dense_refused(self, ratio: int, t: Tensor) -> Optional[str]:
        if ratio > 1 and device_major(t) == 9 and not self.sm90_dense_loss:
            return SM90_DENSE_REFUSAL
        return None

    # ---- per-stage kernel shape support (arguments by name, as the stage method receives them) --------------------
    def support_indexer_forward(self, a: dict) -> Optional[str]:
        q, k, w = a["q"], a["k"], a["w"]
        reason = first_reason(placement_reason(q, k, w, a["cu_seqlens_q"], a["cu_seqlens_k"], a["q_causal_offsets"]),
                              dtype_reason("q", q, BF16), dtype_reason("k", k, BF16),
                              dtype_reason("w", w, (torch.bfloat16, torch.float32)))
        if reason:
            return reason
        if q.shape[-1] != INDEXER_HEAD_DIM:
            return f"indexer head dim must be {INDEXER_HEAD_DIM}, got {q.shape[-1]}"
        if q.numel() == 0 or k.numel() == 0 or (a["cu_seqlens_q"] is not None and not a["max_seqlen_k"]):
            return "empty query or key buffer"
        if device_major(q) == 9 and q.shape[-2] // max(k.shape[-2], 1) > max(SM90_INDEXER_QHPKV):
            return f"sm90 indexer forward takes at most {max(SM90_INDEXER_QHPKV)} query heads per KV head"
        return None

    def support_indexer_top_k(self, a: dict) -> Optional[str]:
        x = a["input_values"]
        reason = first_reason(placement_reason(x, a["seq_lens"]),
                              dtype_reason("input_values", x, (torch.float32, torch.float16, torch.bfloat16)))
        if reason:
            return reason
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            return f"top-k needs a non-empty 2-D score matrix, got {tuple(x.shape)}"
        if not 0 < a["top_k"] <= min(TOP_K_MAX, x.shape[1]):
            return f"top_k must be in (0, min({TOP_K_MAX}, num_cols={x.shape[1]})], got {a['top_k']}"
        if a["deterministic"] and device_major(x) == 12:
            return "deterministic top-k has column limits on sm120"
        return None

    def support_compactify(self, a: dict) -> Optional[str]:
        idx = a["indices"]
        return first_reason(placement_reason(idx), None if idx.numel() > 0 else "empty index tensor")

    def support_sparse_attn_bwd(self, a: dict) -> Optional[str]:
        q, kv = a["q"], a["kv"]
        reason = first_reason(placement_reason(q, kv, a["out"], a["dout"], a["lse"], a["attn_sink"], a["topk_idxs"],
                                               a["topk_length"]),
                              dtype_reason("q", q, (torch.bfloat16, torch.float16)),
                              dtype_reason("lse", a["lse"], (torch.float32,)),
                              dtype_reason("attn_sink", a["attn_sink"], (torch.float32,)))
        if reason:
            return reason
        if q.shape[-1] not in ATTENTION_HEAD_DIMS:
            return f"head dim must be one of {ATTENTION_HEAD_DIMS}, got {q.shape[-1]}"
        if q.shape[0] == 0 or kv.shape[0] == 0 or a["topk_idxs"].shape[-1] == 0:
            return "empty query, key or index buffer"
        if device_major(q) == 9 and (a["deterministic"] or a["q_cluster_mode"] != "off"):
            return "deterministic / q_cluster_mode='adaptive_pair' backward is SM100-only"
        return None

    def _sparse_score_support(self, q, k, aux, aux_name, aux_dtypes, topk) -> Optional[str]:
        reason = first_reason(placement_reason(q, k, aux, topk), dtype_reason("q", q, BF16), dtype_reason("k", k, BF16),
                              dtype_reason(aux_name, aux, aux_dtypes),
                              None if topk.dtype == torch.int32 else "topk_indices must be int32")
        if reason:
            return reason
        if q.numel() == 0 or k.numel() == 0 or topk.shape[-1] == 0:
            return "empty query, key or index buffer"
        return None

    def support_sparse_attn_score_recompute(self, a: dict) -> Optional[str]:
        return self._sparse_score_support(a["q_attn"], a["k_attn"], a["lse"], "lse", (torch.float32,),
                                          a["topk_indices"])

    def support_sparse_indexer_score_recompute(self, a: dict) -> Optional[str]:
        return self._sparse_score_support(a["q_indexer"], a["k_indexer"], a["weights"], "weights", BF16,
                                          a["topk_indices"])

    def _dense_score_support(self, a: dict, aux_name: str, aux_dtypes: tuple) -> Optional[str]:
        q, k, aux = a["q"], a["k"], a[aux_name]
        reason = first_reason(placement_reason(q, k, aux, a["cu_seqlens_q"], a["cu_seqlens_k"]),
                              dtype_reason("q", q, BF16), dtype_reason("k", k, BF16),
                              dtype_reason(aux_name, aux, aux_dtypes), self._dense_refused(a["ratio"], q))
        if reason:
            return reason
        if a["q_causal_offsets"] is not None:
            return "q_causal_offsets is not passed through by this provider"
        if q.numel() == 0 or k.numel() == 0 or (a["cu_seqlens_q"] is not None and not a["max_seqlen_k"]):
            return "empty query or key buffer"
        return None

    def support_dense_attn_score_recompute(self, a: dict) -> Optional[str]:
        return self._dense_score_support(a, "lse", (torch.float32,))

    def support_dense_indexer_score_recompute(self, a: dict) -> Optional[str]:
        return self._dense_score_support(a, "weights", BF16)

    def support_indexer_backward(self, a: dict) -> Optional[str]:
        q, w, k = a["index_q"], a["weights"], a["index_k"]
        reason = first_reason(placement_reason(q, w, k, a["attn_score"], a["index_score"], a["topk_indices"],
                                               a["grad_loss"]),
                              dtype_reason("index_q", q, BF16), dtype_reason("weights", w, BF16),
                              dtype_reason("index_k", k, BF16),
                              dtype_reason("attn_score", a["attn_score"], (torch.float32,)),
                              dtype_reason("index_score", a["index_score"], (torch.float32,)))
        if reason:
            return reason
        if q.shape[-1] != INDEXER_HEAD_DIM:
            return f"indexer head dim must be {INDEXER_HEAD_DIM}, got {q.shape[-1]}"
        if q.shape[0] * q.shape[1] == 0 or k.shape[1] == 0 or a["topk_indices"].shape[-1] == 0:
            return "empty query, key or index buffer"
        if q.shape[1] > INDEXER_BWD_MAX_ROWS:
            return f"S_q = {q.shape[1]} exceeds the kernel grid limit {INDEXER_BWD_MAX_ROWS} (production chunks rows)"
        if a["block_I"] != INDEXER_BWD_BLOCK_I:
            return f"block_I must be {INDEXER_BWD_BLOCK_I}"
        return None

    def support_dense_indexer_backward(self, a: dict) -> Optional[str]:
        q, w, k = a["index_q"], a["weights"], a["index_k"]
        reason = first_reason(placement_reason(q, w, k, a["attn_score"], a["index_score"], a["cu_seqlens_q"],
                                               a["cu_seqlens_k"], a["grad_loss"]),
                              dtype_reason("index_q", q, BF16), dtype_reason("weights", w, BF16),
                              dtype_reason("index_k", k, BF16),
                              dtype_reason("attn_score", a["attn_score"], (torch.float32,)),
                              dtype_reason("index_score", a["index_score"], (torch.float32,)),
                              self._dense_refused(a["ratio"], q))
        if reason:
            return reason
        if a["q_causal_offsets"] is not None:
            return "q_causal_offsets is not passed through by this provider"
        if q.numel() == 0 or k.numel() == 0 or a["attn_score"].numel() == 0:
            return "empty query, key or score buffer"
        return None

    # ================================================================ indexer forward / top-k / compactify ========
    def indexer_forward(self, q, k, w, ratio=4, qhead_per_kv_head=None, sm_scale=1.0, *, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None):
        heads = q.shape[-2]
        if device_major(q) == 9 and heads not in SM90_INDEXER_QHPKV:
            if heads > max(SM90_INDEXER_QHPKV):
                raise NotImplementedError(f"sm90 indexer forward takes at most {max(SM90_INDEXER_QHPKV)} heads")
            padded = next(h for h in SM90_INDEXER_QHPKV if h >= heads)
            q, w = pad_dim(q, -2, padded), pad_dim(w, -1, padded)  # zero weights: padded heads add 0
            qhead_per_kv_head = None if qhead_per_kv_head is None else padded
        thd = {}
        if cu_seqlens_q is not None:
            thd = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                       max_seqlen_k=int(max_seqlen_k))
        if q_causal_offsets is not None:
            thd["q_causal_offsets"] = q_causal_offsets
        with on_device(q):
            res = dsa_wrappers().indexer_forward_wrapper(q.contiguous(), k.contiguous(), w.contiguous(), ratio=ratio,
                                                 qhead_per_kv_head=qhead_per_kv_head, sm_scale=sm_scale, **thd)
        return TupleDict(scores=res["scores"])

    def indexer_top_k(self, input_values, seq_lens, top_k, next_n=1, return_val=True, num_copy_bits=256, stream=None,
                      tie_break=0, deterministic=False):
        with on_device(input_values):
            res = dsa_wrappers().indexer_top_k_wrapper(input_values, seq_lens, top_k, next_n=next_n, return_val=return_val,
                                               num_copy_bits=num_copy_bits, stream=stream, tie_break=tie_break,
                                               deterministic=deterministic)
        return TupleDict(indices=res["indices"], values=res["values"])

    def compactify(self, indices, stream=None):
        with on_device(indices):
            res = dsa_wrappers().compactify_wrapper(indices, stream=stream)
        return TupleDict(indices=res["indices"], topk_length=res["topk_length"])

    # ================================================================ sparse attention backward ===================
    def sparse_attn_bwd(self, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None,
                        dq=None, dkv=None, block_tile=64, deterministic=False, stream=None, workspace=None,
                        q_cluster_mode="off"):
        heads = q.shape[1]
        padded = _padded_heads(heads) if device_major(q) == 9 else heads
        if padded != heads:
            # zero q / out / dO and LSE 0 with a -inf sink: the padded heads' P·(dP - D) and P·dO are exactly 0
            q, out, dout = (pad_dim(t, 1, padded) for t in (q, out, dout))
            lse, attn_sink = pad_dim(lse, 1, padded), pad_dim(attn_sink, 0, padded, float("-inf"))
        if device_major(q) == 9:  # one compiled kernel per width bucket; -1 slots are ignored by the kernel
            topk_idxs = pad_dim(topk_idxs, -1, round_up(topk_idxs.shape[-1], SM90_BWD_INDEX_BUCKET), -1)
        direct = padded == heads
        with on_device(q):
            res = dsa_wrappers().sparse_attention_backward_wrapper(
                q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=softmax_scale, topk_length=topk_length,
                dq=dq if direct else None, dkv=dkv, block_tile=block_tile, deterministic=deterministic, stream=stream,
                workspace=workspace, q_cluster_mode=q_cluster_mode)
        if direct:
            return TupleDict(dq=res["dq"], dkv=res["dkv"], d_sink=res["d_sink"])
        return TupleDict(dq=into(dq, res["dq"][:, :heads]), dkv=res["dkv"], d_sink=res["d_sink"][:heads])

    # ================================================================ score recompute =============================
    def sparse_attn_score_recompute(self, q_attn, k_attn, lse, topk_indices, softmax_scale, qhead_per_kv_head=None,
                                    topk_length=None, topk_indices_global=False, out=None, stream=None):
        heads = q_attn.shape[2]
        padded = _score_heads(heads)
        if padded != heads:  # LSE +inf: exp(q.k - inf) = 0 for every padded head
            q_attn, lse = pad_dim(q_attn, 2, padded), pad_dim(lse, 2, padded, float("inf"))
            qhead_per_kv_head = None if qhead_per_kv_head is None else padded
        with on_device(q_attn):
            res = dsa_wrappers().sparse_attn_score_recompute_wrapper(
                q_attn, k_attn, lse, topk_indices, softmax_scale, qhead_per_kv_head=qhead_per_kv_head,
                topk_length=topk_length, topk_indices_global=topk_indices_global, out=out, stream=stream)
        return TupleDict(target=res["target"])

    def sparse_indexer_score_recompute(self, q_indexer, k_indexer, weights, topk_indices, qhead_per_kv_head=None,
                                       topk_length=None, topk_indices_global=False, out=None, stream=None):
        heads = q_indexer.shape[2]
        padded = _score_heads(heads)
        if padded != heads:  # zero weights: relu(0) * 0 = 0
            q_indexer, weights = pad_dim(q_indexer, 2, padded), pad_dim(weights, 2, padded)
            qhead_per_kv_head = None if qhead_per_kv_head is None else padded
        with on_device(q_indexer):
            res = dsa_wrappers().sparse_indexer_score_recompute_wrapper(
                q_indexer, k_indexer, weights, topk_indices, qhead_per_kv_head=qhead_per_kv_head,
                topk_length=topk_length, topk_indices_global=topk_indices_global, out=out, stream=stream)
        return TupleDict(predict=res["predict"])

    def _dense(self, wrapper: str, q, k, aux, aux_fill, qhead_per_kv_head, out, denom_out, ratio, thd, **extra):
        heads, kv_heads = q.shape[-2], k.shape[-2]
        per_kv = heads // kv_heads
        padded = _score_heads(per_kv) * kv_heads
        if padded != heads:
            q, aux = pad_dim(q, -2, padded), pad_dim(aux, -1, padded, aux_fill)
            qhead_per_kv_head = None if qhead_per_kv_head is None else padded // kv_heads
        with on_device(q):
            res = getattr(dsa_wrappers(), wrapper)(q, k, aux, qhead_per_kv_head=qhead_per_kv_head, out=out,
                                           denom_out=denom_out, ratio=ratio, **thd, **extra)
        return TupleDict(out=res["out"], denom=res["denom"])

    @staticmethod
    def _thd_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
        if cu_seqlens_q is None:
            return {}
        return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                    max_seqlen_k=int(max_seqlen_k))

    def dense_attn_score_recompute(self, q, k, lse, softmax_scale, qhead_per_kv_head=None, out=None, denom_out=None,
                                   ratio=1, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                   max_seqlen_k=None, q_causal_offsets=None):
        thd = self._thd_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return self._dense("dense_attn_score_recompute_wrapper", q, k, lse, float("inf"), qhead_per_kv_head, out,
                           denom_out, ratio, thd, softmax_scale=softmax_scale)

    def dense_indexer_score_recompute(self, q, k, weights, qhead_per_kv_head=None, out=None, denom_out=None,
                                      sm_scale=1.0, ratio=1, *, cu_seqlens_q=None, cu_seqlens_k=None,
                                      max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None):
        thd = self._thd_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return self._dense("dense_indexer_score_recompute_wrapper", q, k, weights, 0.0, qhead_per_kv_head, out,
                           denom_out, ratio, thd, sm_scale=sm_scale)

    # ================================================================ indexer backward ============================
    def indexer_backward(self, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                         sm_scale=1.0, loss_coeff=1.0, block_I=128, topk_indices_global=False, d_index_q=None,
                         d_weights=None, d_index_k=None, stream=None):
        heads, topk = index_q.shape[2], topk_indices.shape[-1]
        padded_heads, padded_topk = _padded_heads(heads), round_up(topk, block_I)
        q, w = pad_dim(index_q, 2, padded_heads), pad_dim(weights, 2, padded_heads)
        # padded slots: id -1, target 0, predict 0 -> clip mask 0, score gradient 0, no key read
        target = pad_dim(attn_score, 2, padded_topk)
        predict = pad_dim(index_score, 2, padded_topk)
        ids = pad_dim(topk_indices, 2, padded_topk, -1)
        direct = padded_heads == heads
        with on_device(index_q):
            res = dsa_wrappers().indexer_backward_wrapper(
                q, w, index_k, target, predict, ids, grad_loss, sm_scale=sm_scale, loss_coeff=loss_coeff,
                block_I=block_I, topk_indices_global=topk_indices_global, d_index_q=d_index_q if direct else None,
                d_weights=d_weights if direct else None, d_index_k=d_index_k, stream=stream)
        if target is not attn_score:  # the kernel's in-place score gradient, into the caller's tensor
            attn_score.copy_(target[..., :topk])
        if direct:
            return TupleDict(d_index_q=res["d_index_q"], d_weights=res["d_weights"], d_index_k=res["d_index_k"])
        return TupleDict(d_index_q=into(d_index_q, res["d_index_q"][:, :, :heads]),
                         d_weights=into(d_weights, res["d_weights"][..., :heads]),
                         d_index_k=res["d_index_k"])

    def dense_indexer_backward(self, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                               grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128, ratio=1, cu_seqlens_q=None,
                               cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
                               d_index_q=None, d_weights=None, d_index_k=None, stream=None, workspace=None):
        heads = index_q.shape[-2]
        padded = _padded_heads(heads)
        q, w = pad_dim(index_q, -2, padded), pad_dim(weights, -1, padded)  # zero weights: no score contribution
        direct = padded == heads
        thd = self._thd_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        with on_device(index_q):
            res = dsa_wrappers().dense_indexer_backward_wrapper(
                q, w, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale=sm_scale,
                loss_coeff=loss_coeff, block_I=block_I, ratio=ratio, d_index_q=d_index_q if direct else None,
                d_weights=d_weights if direct else None, d_index_k=d_index_k, stream=stream, workspace=workspace,
                **thd)
        if direct:
            return TupleDict(d_index_q=res["d_index_q"], d_weights=res["d_weights"], d_index_k=res["d_index_k"])
        return TupleDict(d_index_q=into(d_index_q, res["d_index_q"][..., :heads, :]),
                         d_weights=into(d_weights, res["d_weights"][..., :heads]),
                         d_index_k=res["d_index_k"])
