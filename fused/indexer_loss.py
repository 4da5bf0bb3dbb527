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

from . import mutants
from .index_maps import batch_of_row, local_to_global_flat
from .indexer import fold_indexer_scale, mask_split_topk, select_topk
from .plan import kernels
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
    kv_offset: int = 0                  # SBHD: first compressed row of kv_full
    thd: Optional[ThdMeta] = None
    cu_kv_full: Optional[Tensor] = None
    cu_comp: Optional[Tensor] = None
    max_comp: int = 0
    padding_rows: Optional[Tensor] = None


def _fake_bshd(*tensors: Tensor) -> tuple[Tensor, ...]:
    """THD tensors with a prepended batch of 1, for the wrappers that take BSHD only."""
    return tuple(t.unsqueeze(0) for t in tensors)


def _drop_fake_batch(t: Tensor) -> Tensor:
    if t.shape[0] != 1:
        raise RuntimeError(f"expected a fake batch of 1, got leading dim {t.shape[0]}")
    return t[0]


def bshd_to_sbhd(t: Tensor) -> Tensor:
    """``(B, S, ...)`` kernel result -> ``(S, B, ...)`` for the SBHD composition."""
    if mutants.is_active(mutants.VIEW_OVER_BATCH):
        return t.reshape((t.shape[1], t.shape[0]) + tuple(t.shape[2:]))
    return t.transpose(0, 1).contiguous()


def kl_from_target_predict(target: Tensor, predict: Tensor, topk: Tensor) -> Tensor:
    """Per-row ``KL(target || predict)`` over the top-k slots, both clamped at fp32 ``tiny``; rows without a valid
    slot give 0 (``_kl_loss_from_target_predict`` before its reduction)."""
    if mutants.is_active(mutants.KL_FULL_WIDTH_NAN):  # every slot, unclamped: 0 * (log 0 - log 0) on -1 slots
        return (target * (torch.log(target) - torch.log(predict))).sum(-1)
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


class IndexerSparseAttnFunc(torch.autograd.Function):
    """Path B. Inputs: ``query`` SBHD ``(S,B,n,D)`` / THD ``(T,n,D)``; ``kv_full`` ``(S+n_comp,B,D)`` /
    ``(rows,D)``; ``attn_sink (n,)``; local ``window_idxs`` ``(B,S,W)`` / ``(T,W)``; ``q_indexer``, ``k_indexer``,
    ``weights`` in the layer layout (differentiable); ``compressed_kv`` (THD); ``split_topk`` (or None).

    Outputs: ``out`` like ``query``, the 0-d ``loss``, and non-differentiable ``lse (rows, n)`` (flat, FlashMLA
    convention), the indexer's own ids (int32, kernel slot order) and its scores.
    """

    @staticmethod
    def forward(ctx, query, kv_full, attn_sink, window_idxs, q_indexer, k_indexer, weights, compressed_kv,
                spec: LossSpec, split_topk):
        thd = spec.thd
        if thd is not None:
            total_q, n, d = query.shape
            q_i, k_i, w_i = q_indexer, k_indexer, weights
        else:
            seqlen, batch, n, d = query.shape
            q_i = q_indexer.permute(1, 0, 2, 3).contiguous()
            k_i = k_indexer.permute(1, 0, 2).contiguous()
            w_i = weights.permute(1, 0, 2).contiguous()
        w_scaled = fold_indexer_scale(w_i, spec.indexer_scale)

        # 1. indexer scores + top-k; ids [compressed K | window W], flat-global, compacted
        own_topk, raw_scores, visible = select_topk(q_i, k_i, w_scaled, spec.topk, spec.ratio, thd, spec.cu_comp,
                                                    spec.max_comp)
        scores = raw_scores
        topk_cmp = own_topk if split_topk is None else mask_split_topk(split_topk, visible, spec.topk)
        if thd is not None:
            kv_len = (thd.cu[1:] - thd.cu[:-1]).long()[batch_of_row(thd.cu, total_q)].unsqueeze(-1)
            comp_ids = torch.where(topk_cmp >= 0, topk_cmp + kv_len, -1)
            global_idxs = local_to_global_flat(torch.cat([comp_ids, window_idxs], -1), -1, thd.cu, spec.cu_kv_full)
            q_flat, kv_flat = query, kv_full
        else:
            comp_ids = torch.where(topk_cmp >= 0, topk_cmp + spec.kv_offset, -1)
            global_idxs = local_to_global_flat(torch.cat([comp_ids, window_idxs], -1), batch)
            q_flat, kv_flat = query.reshape(seqlen * batch, n, d), kv_full.reshape(-1, d)
        window_global = global_idxs[:, spec.topk:]
        global_idxs, topk_length = compact(global_idxs)

        # 2. sparse attention forward
        out_flat, lse = flash_mla_forward(q_flat, kv_flat, global_idxs, spec.scale, attn_sink, topk_length)
        padding = spec.padding_rows
        bwd_idxs, bwd_length = backward_index_state(global_idxs, topk_length, padding)

        # 3. teacher and student
        sink = attn_sink.detach()
        full_lse = torch.logaddexp(lse, sink.to(lse.dtype).view(1, n))
        if mutants.is_active(mutants.SINK_DROPPED_TEACHER):
            full_lse = lse
        if mutants.is_active(mutants.TEACHER_COMPRESSED_ONLY):  # the LSE of the selected compressed keys alone
            comp_global = local_to_global_flat(comp_ids, -1, thd.cu, spec.cu_kv_full) if thd is not None else \
                local_to_global_flat(comp_ids, batch)
            comp_idxs, comp_length = compact(comp_global)
            full_lse = flash_mla_forward(q_flat, kv_flat, comp_idxs, spec.scale, None, comp_length)[1]
        if thd is not None:
            q_det, k_comp_det, sparse_teacher = query.detach(), compressed_kv.detach(), full_lse
        else:
            q_det = query.detach().permute(1, 0, 2, 3).contiguous()
            k_comp_det = kv_full[spec.kv_offset:].detach().permute(1, 0, 2).contiguous()
            sparse_teacher = full_lse.reshape(seqlen, batch, n).permute(1, 0, 2).contiguous()
        if padding is not None:
            topk_cmp = topk_cmp.masked_fill(padding.unsqueeze(-1), -1)
            scores = scores.masked_fill(padding.unsqueeze(-1), float("-inf"))
        physical = total_q if thd is not None else batch * seqlen
        unit_grad, coeff_k, grad_divisor = kernel_loss_scale(spec, physical, query.device)

        if spec.sparse:
            picked = torch.gather(scores, -1, topk_cmp.clamp(min=0).long())
            predict = torch.softmax(torch.where(topk_cmp >= 0, picked, torch.finfo(torch.float32).min), dim=-1)
            topk_target = local_to_global_flat(topk_cmp, -1, thd.cu, spec.cu_comp) if thd is not None else topk_cmp
            args = (q_det, k_comp_det, sparse_teacher, topk_target)
            if thd is not None:
                args = _fake_bshd(*args)
            target = kernels.sparse_attn_score_recompute(*args, spec.scale, qhead_per_kv_head=n,
                                                         topk_indices_global=thd is not None)["target"]
            if thd is not None:
                target = _drop_fake_batch(target)
            kl_rows = kl_from_target_predict(target, predict, topk_cmp)
        else:
            index_lse = torch.logsumexp(scores, dim=-1)
            thd_kwargs = {}
            if mutants.is_active(mutants.SINK_DROPPED_TEACHER) or mutants.is_active(mutants.TEACHER_COMPRESSED_ONLY):
                sink = torch.full_like(sink, float("-inf"))
            if mutants.is_active(mutants.TEACHER_COMPRESSED_ONLY):
                window_global = torch.full_like(window_global, -1)
            if thd is not None:
                thd_kwargs = dict(cu_seqlens_q=thd.cu, cu_seqlens_k=spec.cu_comp, max_seqlen_q=thd.max_seqlen,
                                  max_seqlen_k=spec.max_comp)
                teacher = kernels.csa_teacher_lse(q_flat.detach(), kv_flat.detach(), k_comp_det, sink, window_global,
                                                  spec.scale, spec.ratio, **thd_kwargs)
            else:
                teacher = kernels.csa_teacher_lse(q_flat.detach(), kv_flat.detach(), k_comp_det, sink, window_global,
                                                  spec.scale, spec.ratio, batch_size=batch, seqlen_q=seqlen)
            res = kernels.dense_attn_score_recompute(q_det, k_comp_det.unsqueeze(1 if thd is not None else 2), teacher,
                                                     spec.scale, qhead_per_kv_head=n, ratio=spec.ratio, **thd_kwargs)
            attn_score, attn_l1 = res["out"], res["denom"]
            if padding is not None:
                attn_score = attn_score.masked_fill(padding.unsqueeze(-1), 0)
                attn_l1 = attn_l1.masked_fill(padding, 0)
            kl_rows = kl_from_dense_scores(attn_score, attn_l1, scores, index_lse)
        loss = reduce_kl(kl_rows, spec) if spec.coeff > 0 else kl_rows.new_zeros(())

        # 4. indexer gradients, eagerly, with grad_loss = 1
        if spec.coeff > 0 and spec.sparse:
            bwd = (q_i, w_i, k_i, target.clone(), predict.clone(), topk_cmp)
            if thd is not None:
                bwd = _fake_bshd(*bwd[:5], local_to_global_flat(topk_cmp, -1, thd.cu, spec.cu_comp))
            ig = kernels.indexer_backward(*bwd, grad_loss=unit_grad, sm_scale=spec.indexer_scale, loss_coeff=coeff_k,
                                          block_I=128, topk_indices_global=thd is not None)
            grads = [ig["d_index_q"], ig["d_weights"], ig["d_index_k"]]
            grads = [_drop_fake_batch(g) for g in grads] if thd is not None else [bshd_to_sbhd(g) for g in grads]
        elif spec.coeff > 0:
            index_for_bwd, lse_for_bwd = scores.clone(), index_lse
            if padding is not None:  # score - lse = -inf: predict 0 and the log-clip mask 0, so g = 0 exactly
                index_for_bwd = index_for_bwd.masked_fill(padding.unsqueeze(-1), 0)
                lse_for_bwd = index_lse.masked_fill(padding, float("inf"))
            kwargs = dict(thd_kwargs)
            if thd is not None and mutants.is_active(mutants.THD_DENSE_BWD_NO_MAX_SEQLEN):
                kwargs.pop("max_seqlen_q"), kwargs.pop("max_seqlen_k")
            ig = kernels.dense_indexer_backward(q_i, w_i, k_i, attn_score.clone(), attn_l1, index_for_bwd,
                                                lse_for_bwd, unit_grad, sm_scale=spec.indexer_scale,
                                                loss_coeff=coeff_k, ratio=spec.ratio, block_I=128, **kwargs)
            grads = [ig["d_index_q"], ig["d_weights"], ig["d_index_k"]]
            if thd is None:
                grads = [bshd_to_sbhd(g) for g in grads]
        else:
            grads = [torch.zeros_like(q_indexer), torch.zeros_like(weights), torch.zeros_like(k_indexer)]
        if grad_divisor is not None and spec.coeff > 0:
            grads = [g / grad_divisor.to(g.dtype if g.dtype == torch.float64 else torch.float32) for g in grads]
        # padding rows send no gradient (and rows a kernel never wrote are not read)
        if padding is not None and not mutants.is_active(mutants.PADDING_GRADS_NOT_ZEROED):
            grads[0] = grads[0].masked_fill(padding.view(-1, 1, 1), 0)
            grads[1] = grads[1].masked_fill(padding.view(-1, 1), 0)

        ctx.save_for_backward(q_flat, kv_flat, attn_sink, bwd_idxs, out_flat, lse, *grads)
        ctx.topk_length, ctx.spec, ctx.query_shape, ctx.kv_shape = bwd_length, spec, query.shape, kv_full.shape
        out = out_flat.view(query.shape)
        ctx.mark_non_differentiable(lse, raw_scores)
        return out, loss, lse, own_topk, raw_scores

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
