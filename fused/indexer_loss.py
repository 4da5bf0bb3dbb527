"""Path B: indexer top-k + sparse attention + indexer KL loss in one autograd function
(``FusedCSAIndexerSparseAttnFunc`` of Megatron ``csa_utils/fused_sparse_attention.py``).

Forward, in production's order:

1. indexer scores and top-k (kernels), ids ``[compressed K | window W]`` made flat-global and compacted;
2. sparse attention forward (FlashMLA convention) and the padding-row mask;
3. the teacher: sparse loss -> ``target`` (score-recompute kernel, denominator ``logaddexp(lse, sink)``) and
   ``predict`` = softmax of the gathered indexer scores; dense loss -> full teacher LSE (window + sink + every causal
   compressed key), dense attention scores, and the indexer scores' own LSE;
4. the KL loss value, and the indexer gradients computed **eagerly** by the indexer-backward kernel with
   ``grad_loss = 1`` (padding rows zeroed).

Backward: the sparse-attention backward kernel for ``query, kv_full, attn_sink``, and the precomputed indexer
gradients times the incoming gradient of the loss.

Reduction (ARCHITECTURE.md): ``mean`` divides the summed KL by the number of **real** rows (production's fused THD
path divides by all physical rows, spec §5.3 [GAP]). The kernels normalise by their physical row count, so they get
``loss_coeff = coeff * physical_rows`` and ``grad_loss = 1``, and the real-row divisor (a device tensor for THD: no
host read) is applied to their gradients afterwards (:func:`kernel_loss_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .indexer import fold_indexer_scale, mask_split_topk, select_topk
from .plan import kernels
from .rows import RowSpace
from .sparse_attention import backward_index_state, compact, flash_mla_forward, sparse_attention_backward
from .thd import ThdMeta

Tensor = torch.Tensor
FP32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class LossSpec:
    """Static arguments of one Path B call."""

    topk: int
    ratio: int
    scale: float
    indexer_scale: float
    coeff: float
    sparse: bool
    per_token: bool
    real_rows: Union[int, Tensor]       # divisor of the mean reduction (THD: a device tensor, graph-safe)
    rows: RowSpace                      # the call's query rows (both layouts)
    cu_kv_full: Optional[Tensor] = None
    cu_comp: Optional[Tensor] = None
    max_comp: int = 0

    @property
    def thd(self) -> Optional[ThdMeta]:
        return self.rows.thd

    @property
    def padding_rows(self) -> Optional[Tensor]:
        return self.rows.padding


def _fake_bshd(*tensors: Tensor) -> tuple[Tensor, ...]:
    """THD tensors with a prepended batch of 1, for the wrappers that take BSHD only."""
    return tuple(t.unsqueeze(0) for t in tensors)


def _drop_fake_batch(t: Tensor) -> Tensor:
    if t.shape[0] != 1:
        raise RuntimeError(f"expected a fake batch of 1, got leading dim {t.shape[0]}")
    return t[0]


def bshd_to_sbhd(t: Tensor) -> Tensor:
    """``(B, S, ...)`` kernel result -> ``(S, B, ...)`` for the SBHD composition."""
    return t.transpose(0, 1).contiguous()


def kl_from_target_predict(target: Tensor, predict: Tensor, topk: Tensor) -> Tensor:
    """Per-row ``KL(target || predict)`` over the top-k slots, both clamped at fp32 ``tiny``; rows without a valid
    slot give 0 (``_kl_loss_from_target_predict`` before its reduction)."""
    t, p = target.clamp(min=FP32_TINY), predict.clamp(min=FP32_TINY)
    kl = (t * (torch.log(t) - torch.log(p))).sum(-1)
    return torch.where((topk >= 0).any(-1), kl, torch.zeros_like(kl))


def kl_from_dense_scores(attn_score: Tensor, attn_l1: Tensor, index_score: Tensor, index_lse: Tensor) -> Tensor:
    """Per-row dense ``KL(attn_score / L1 || softmax(index_score))`` over the finite indexer columns; rows without a
    visible key give 0 (``_kl_loss_from_dense_scores`` before its reduction)."""
    row_valid = (attn_l1 > FP32_TINY) & torch.isfinite(index_lse)
    target = (attn_score / attn_l1.clamp(min=FP32_TINY).unsqueeze(-1)).clamp(min=FP32_TINY)
    col_valid = torch.isfinite(index_score)
    log_predict = torch.where(col_valid, index_score, 0.0) - torch.where(row_valid, index_lse, 0.0).unsqueeze(-1)
    terms = torch.where(col_valid, target * (torch.log(target) - log_predict), 0.0)
    return torch.where(row_valid, terms.sum(-1), torch.zeros_like(row_valid, dtype=terms.dtype))


def reduce_kl(kl_rows: Tensor, spec: LossSpec) -> Tensor:
    total = kl_rows.sum()
    if spec.per_token:
        return spec.coeff * total
    divisor = spec.real_rows if torch.is_tensor(spec.real_rows) else max(spec.real_rows, 1)
    return spec.coeff * (total / divisor)


def kernel_loss_scale(spec: LossSpec, physical_rows: int, device) -> tuple[Tensor, float, Optional[Tensor]]:
    """``(grad_loss, loss_coeff, divisor)`` for the indexer-backward kernels, which scale by
    ``loss_coeff / physical_rows * grad_loss``. ``grad_loss`` stays the unit tensor (production); a device-tensor
    mean divisor (THD, no host read, CUDA-graph safe) is returned as ``divisor`` and applied to the kernels' gradients
    afterwards, in their dtype — folding it into the fp32 ``grad_loss`` would round ``1 / rows`` to fp32 and cost
    float64 runs their exactness."""
    unit = torch.ones((), dtype=torch.float32, device=device)
    if not spec.per_token and torch.is_tensor(spec.real_rows):
        return unit, spec.coeff * physical_rows, spec.real_rows.to(device=device)
    return unit, kernel_loss_coeff(spec, physical_rows), None


def kernel_loss_coeff(spec: LossSpec, physical_rows: int) -> float:
    """``loss_coeff`` for the indexer-backward kernels, which scale by ``loss_coeff / physical_rows``."""
    if spec.per_token:
        return spec.coeff * physical_rows
    return spec.coeff * physical_rows / max(spec.real_rows, 1)


@dataclass
class PathB:
    """What the four steps of Path B hand each other (one forward call). ``rows`` = flat query rows: ``S*B``
    (SBHD-flat, row ``s*B + b``) or ``T`` (THD). Indexer tensors are in the kernels' layout: BSHD ``(B, S, ...)`` or
    THD ``(T, ...)``."""

    spec: LossSpec
    n: int                                   # attention heads
    q_flat: Tensor                           # (rows, n, D)
    kv_flat: Tensor                          # (n_kv, D)
    q_i: Tensor
    k_i: Tensor
    w_i: Tensor
    batch: int = 1                           # SBHD only
    seqlen: int = 0                          # SBHD only
    # 1. selection
    own_topk: Optional[Tensor] = None        # the indexer's own ids (kernel slot order)
    raw_scores: Optional[Tensor] = None      # the indexer's scores as the kernel returned them
    topk_cmp: Optional[Tensor] = None        # local compressed ids the step uses (own or split mode), -1 padded
    comp_ids: Optional[Tensor] = None        # their ids in the per-segment full key space
    window_global: Optional[Tensor] = None   # (rows, W) flat-global window ids
    global_idxs: Optional[Tensor] = None     # (rows, K + W) compacted flat-global ids
    topk_length: Optional[Tensor] = None
    # 2. attention
    out_flat: Optional[Tensor] = None
    lse: Optional[Tensor] = None             # (rows, n), KV-only (no sink)
    # 3. teacher / student
    q_det: Optional[Tensor] = None           # detached query, kernel layout
    k_comp_det: Optional[Tensor] = None      # detached compressed keys, kernel layout

    @property
    def thd(self) -> Optional[ThdMeta]:
        return self.spec.thd

    @property
    def physical_rows(self) -> int:
        return self.q_flat.shape[0]

    def thd_kwargs(self) -> dict:
        """The varlen keywords of the THD dense-loss kernels (``{}`` for SBHD)."""
        return self.spec.rows.kernel_kwargs(self.spec.cu_comp, self.spec.max_comp)


def path_b_inputs(query: Tensor, kv_full: Tensor, q_indexer: Tensor, k_indexer: Tensor, weights: Tensor,
                  spec: LossSpec) -> PathB:
    """The flat attention tensors and the indexer tensors in the kernels' layout (SBHD -> BSHD permutes)."""
    if spec.thd is not None:
        n = query.shape[1]
        return PathB(spec, n, query, kv_full, q_indexer, k_indexer, weights)
    seqlen, batch, n, d = query.shape
    return PathB(spec, n, query.reshape(seqlen * batch, n, d), kv_full.reshape(-1, d),
                 q_indexer.permute(1, 0, 2, 3).contiguous(), k_indexer.permute(1, 0, 2).contiguous(),
                 weights.permute(1, 0, 2).contiguous(), batch=batch, seqlen=seqlen)


def select_keys(st: PathB, window_idxs: Tensor, split_topk: Optional[Tensor]) -> None:
    """Step 1: indexer scores + top-k; ids ``[compressed K | window W]`` made flat-global and compacted."""
    spec, rows = st.spec, st.spec.rows
    w_scaled = fold_indexer_scale(st.w_i, spec.indexer_scale)
    st.own_topk, st.raw_scores, visible = select_topk(st.q_i, st.k_i, w_scaled, spec.topk, spec.ratio, rows,
                                                      spec.cu_comp, spec.max_comp)
    st.topk_cmp = st.own_topk if split_topk is None else mask_split_topk(split_topk, visible, spec.topk)
    st.comp_ids = torch.where(st.topk_cmp >= 0, st.topk_cmp + rows.compressed_offset(), -1)
    global_idxs = rows.to_global(torch.cat([st.comp_ids, window_idxs], -1), spec.cu_kv_full)
    st.window_global = global_idxs[:, spec.topk:]
    st.global_idxs, st.topk_length = compact(global_idxs)


def attend(st: PathB, attn_sink: Tensor) -> None:
    """Step 2: the sparse attention forward (FlashMLA convention)."""
    st.out_flat, st.lse = flash_mla_forward(st.q_flat, st.kv_flat, st.global_idxs, st.spec.scale, attn_sink,
                                            st.topk_length)


def teacher_lse(st: PathB, sink: Tensor) -> Tensor:
    """Step 3a, the teacher's normaliser: the LSE over every key the attention saw **and the sink**.

    Sparse loss: ``logaddexp(lse, sink)`` of the attention's own LSE, ``(rows, n)``. Dense loss: the full teacher
    LSE (window keys, every causal compressed key and the sink) from the teacher-LSE kernel.
    """
    if st.spec.sparse:
        return torch.logaddexp(st.lse, sink.to(st.lse.dtype).view(1, st.n))
    spec, thd = st.spec, st.thd
    q, kv = st.q_flat.detach(), st.kv_flat.detach()
    if thd is not None:
        return kernels.csa_teacher_lse(q, kv, st.k_comp_det, sink, st.window_global, spec.scale, spec.ratio,
                                       **st.thd_kwargs())
    return kernels.csa_teacher_lse(q, kv, st.k_comp_det, sink, st.window_global, spec.scale, spec.ratio,
                                   batch_size=st.batch, seqlen_q=st.seqlen)


def detach_teacher_inputs(st: PathB, query: Tensor, kv_full: Tensor, compressed_kv: Optional[Tensor]) -> None:
    """The teacher's query and compressed keys, detached, in the kernels' layout."""
    if st.thd is not None:
        st.q_det, st.k_comp_det = query.detach(), compressed_kv.detach()
    else:
        st.q_det = query.detach().permute(1, 0, 2, 3).contiguous()
        st.k_comp_det = kv_full[st.spec.rows.compressed_offset():].detach().permute(1, 0, 2).contiguous()


def kl_rows_and_grads(st: PathB, teacher: Tensor, scores: Tensor, topk_cmp: Tensor) -> tuple[Tensor, list]:
    """Steps 3b and 4: the per-row KL, and the indexer gradients computed **eagerly** by the indexer-backward kernel
    with ``grad_loss = 1`` (padding rows already masked out of ``scores`` / ``topk_cmp``)."""
    spec, thd, n = st.spec, st.thd, st.n
    padding = spec.padding_rows
    unit_grad, coeff_k, grad_divisor = kernel_loss_scale(spec, st.physical_rows, st.q_flat.device)
    if spec.sparse:
        sparse_teacher = teacher if thd is not None else \
            teacher.reshape(st.seqlen, st.batch, n).permute(1, 0, 2).contiguous()
        picked = torch.gather(scores, -1, topk_cmp.clamp(min=0).long())
        predict = torch.softmax(torch.where(topk_cmp >= 0, picked, torch.finfo(torch.float32).min), dim=-1)
        topk_target = spec.rows.to_global(topk_cmp, spec.cu_comp) if thd is not None else topk_cmp
        args = (st.q_det, st.k_comp_det, sparse_teacher, topk_target)
        if thd is not None:
            args = _fake_bshd(*args)
        target = kernels.sparse_attn_score_recompute(*args, spec.scale, qhead_per_kv_head=n,
                                                     topk_indices_global=thd is not None)["target"]
        if thd is not None:
            target = _drop_fake_batch(target)
        kl_rows = kl_from_target_predict(target, predict, topk_cmp)
        if spec.coeff <= 0:
            return kl_rows, None
        bwd = (st.q_i, st.w_i, st.k_i, target.clone(), predict.clone(), topk_cmp)
        if thd is not None:
            bwd = _fake_bshd(*bwd[:5], spec.rows.to_global(topk_cmp, spec.cu_comp))
        ig = kernels.indexer_backward(*bwd, grad_loss=unit_grad, sm_scale=spec.indexer_scale, loss_coeff=coeff_k,
                                      block_I=128, topk_indices_global=thd is not None)
        grads = [ig["d_index_q"], ig["d_weights"], ig["d_index_k"]]
        grads = [_drop_fake_batch(g) for g in grads] if thd is not None else [bshd_to_sbhd(g) for g in grads]
    else:
        index_lse = torch.logsumexp(scores, dim=-1)
        thd_kwargs = st.thd_kwargs()
        res = kernels.dense_attn_score_recompute(st.q_det, st.k_comp_det.unsqueeze(1 if thd is not None else 2),
                                                 teacher, spec.scale, qhead_per_kv_head=n, ratio=spec.ratio,
                                                 **thd_kwargs)
        attn_score, attn_l1 = res["out"], res["denom"]
        if padding is not None:
            attn_score = attn_score.masked_fill(padding.unsqueeze(-1), 0)
            attn_l1 = attn_l1.masked_fill(padding, 0)
        kl_rows = kl_from_dense_scores(attn_score, attn_l1, scores, index_lse)
        if spec.coeff <= 0:
            return kl_rows, None
        index_for_bwd, lse_for_bwd = scores.clone(), index_lse
        if padding is not None:  # score - lse = -inf: predict 0 and the log-clip mask 0, so g = 0 exactly
            index_for_bwd = index_for_bwd.masked_fill(padding.unsqueeze(-1), 0)
            lse_for_bwd = index_lse.masked_fill(padding, float("inf"))
        ig = kernels.dense_indexer_backward(st.q_i, st.w_i, st.k_i, attn_score.clone(), attn_l1, index_for_bwd,
                                            lse_for_bwd, unit_grad, sm_scale=spec.indexer_scale,
                                            loss_coeff=coeff_k, ratio=spec.ratio, block_I=128, **thd_kwargs)
        grads = [ig["d_index_q"], ig["d_weights"], ig["d_index_k"]]
        if thd is None:
            grads = [bshd_to_sbhd(g) for g in grads]
    if grad_divisor is not None:
        grads = [g / grad_divisor.to(g.dtype if g.dtype == torch.float64 else torch.float32) for g in grads]
    return kl_rows, mask_padding_grads(grads, padding)


def mask_padding_grads(grads: list, padding: Optional[Tensor]) -> list:
    """Padding rows send no gradient: the indexer query and weight gradients ``[d_q (rows,nI,dI), d_w (rows,nI),
    d_k]`` zeroed there (rows a kernel never wrote are not read)."""
    if padding is None:
        return grads
    return [grads[0].masked_fill(padding.view(-1, 1, 1), 0), grads[1].masked_fill(padding.view(-1, 1), 0), grads[2]]


class IndexerSparseAttnFunc(torch.autograd.Function):
    """Path B. Inputs: ``query`` SBHD ``(S,B,n,D)`` / THD ``(T,n,D)``; ``kv_full`` ``(S+n_comp,B,D)`` /
    ``(rows,D)``; ``attn_sink (n,)``; local ``window_idxs`` ``(B,S,W)`` / ``(T,W)``; ``q_indexer``, ``k_indexer``,
    ``weights`` in the layer layout (differentiable); ``compressed_kv`` (THD); ``split_topk`` (or None).

    Outputs: ``out`` like ``query``, the 0-d ``loss``, and non-differentiable ``lse (rows, n)`` (flat, FlashMLA
    convention), the indexer's own ids (int32, kernel slot order) and its scores. The steps are the module
    docstring's: :func:`select_keys`, :func:`attend`, :func:`teacher_lse` + :func:`kl_rows_and_grads`.
    """

    @staticmethod
    def forward(ctx, query, kv_full, attn_sink, window_idxs, q_indexer, k_indexer, weights, compressed_kv,
                spec: LossSpec, split_topk):
        st = path_b_inputs(query, kv_full, q_indexer, k_indexer, weights, spec)
        select_keys(st, window_idxs, split_topk)                                    # 1.
        attend(st, attn_sink)                                                       # 2.
        bwd_idxs, bwd_length = backward_index_state(st.global_idxs, st.topk_length, spec.padding_rows)
        detach_teacher_inputs(st, query, kv_full, compressed_kv)                           # 3.
        teacher = teacher_lse(st, attn_sink.detach())
        scores, topk_cmp = st.raw_scores, st.topk_cmp
        if spec.padding_rows is not None:
            topk_cmp = topk_cmp.masked_fill(spec.padding_rows.unsqueeze(-1), -1)
            scores = scores.masked_fill(spec.padding_rows.unsqueeze(-1), float("-inf"))
        kl_rows, grads = kl_rows_and_grads(st, teacher, scores, topk_cmp)           # 3b. and 4.
        loss = reduce_kl(kl_rows, spec) if spec.coeff > 0 else kl_rows.new_zeros(())
        if grads is None:
            grads = [torch.zeros_like(q_indexer), torch.zeros_like(weights), torch.zeros_like(k_indexer)]

        ctx.save_for_backward(st.q_flat, st.kv_flat, attn_sink, bwd_idxs, st.out_flat, st.lse, *grads)
        ctx.topk_length, ctx.spec, ctx.query_shape, ctx.kv_shape = bwd_length, spec, query.shape, kv_full.shape
        out = st.out_flat.view(query.shape)
        ctx.mark_non_differentiable(st.lse, st.raw_scores)
        return out, loss, st.lse, st.own_topk, st.raw_scores

    @staticmethod
    def backward(ctx, d_out, d_loss, *_unused):
        q_flat, kv_flat, sink, idxs, out_flat, lse, g_q, g_w, g_k = ctx.saved_tensors
        spec = ctx.spec
        d_out_flat = d_out.reshape(out_flat.shape)
        dq, dkv, d_sink = sparse_attention_backward(q_flat, kv_flat, out_flat, d_out_flat, lse, sink, idxs,
                                                    spec.scale, ctx.topk_length, spec.padding_rows)
        scale = d_loss if d_loss is not None else torch.zeros((), dtype=g_q.dtype, device=g_q.device)
        return (dq.view(ctx.query_shape), dkv.view(ctx.kv_shape), d_sink, None, g_q * scale, g_k * scale,
                g_w * scale, None, None, None)
