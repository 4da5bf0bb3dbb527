"""``torch`` provider: a contract-exact PyTorch implementation of every production kernel call (CPU or GPU).

Each method (its argument contract already enforced by the dispatcher, :mod:`fused.kernels.contracts`) computes
what the kernel computes, with the kernel's conventions (``+inf`` LSE for empty rows, in-place score-gradient outputs, rows
a kernel never writes poisoned with NaN so that a composition that reads them is caught).

Precision: float64 inputs are computed entirely in float64, so that a fused-vs-reference comparison in float64 has
no precision floor. Otherwise the kernels' numerics are mimicked: fp32 accumulation and fp32 scores / LSEs /
probabilities, outputs in the input dtype (bf16). One kernel constant guards fp32 arithmetic only and is dropped in
float64 mode: the ``+1e-10`` in the dense score-gradient's target denominator (it would move float64 gradients by
``1e-10 / L1``). The ``exp(-100)`` probability clips are kept in every mode (they never bind on finite float64 data).

Kernel shape support: this provider accepts every shape and dtype (float64 / float32 / bfloat16), so it
has no ``support_<stage>`` method: ``check_support`` accepts every call of a stage it implements.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .base import STAGES, KernelSet, Tensor, TupleDict

CLIP_LOG_MIN = -100.0
CLIP_PROB_MIN = math.exp(CLIP_LOG_MIN)
DENSE_L1_EPS_FP32 = 1e-10
_CHUNK_ELEMENTS = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(rows: int, per_row: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _thd_rows(cu_q: Tensor, cu_k: Tensor, total_q: int, max_seqlen_q: int, max_seqlen_k: int, ratio: int,
              q_causal_offsets: Optional[Tensor] = None):
    """Per packed query row: ``(computed, key_start, visible)``.

    ``computed``: the row lies inside a segment and within the kernel's ``max_seqlen_q`` grid; ``key_start``: the
    segment's first key row; ``visible``: number of ratio-causal key columns ``min(len_k, (off + i + 1) // ratio,
    max_seqlen_k)`` (0 for rows not computed).
    """
    device = cu_q.device
    cq, ck = cu_q.long(), cu_k.long()
    n_seg = cq.numel() - 1
    rows = torch.arange(total_q, device=device)
    seg = torch.bucketize(rows, cq[1:], right=True).clamp(max=max(n_seg - 1, 0))
    local = rows - cq[seg]
    computed = (rows >= cq[seg]) & (rows < cq[seg + 1]) & (local < max_seqlen_q)
    offset = q_causal_offsets.long()[seg] if q_causal_offsets is not None else torch.zeros_like(local)
    key_len = ck[seg + 1] - ck[seg]
    visible = torch.minimum(torch.div(offset + local + 1, ratio, rounding_mode="floor"), key_len)
    visible = visible.clamp(min=0, max=max_seqlen_k)
    visible = torch.where(computed, visible, torch.zeros_like(visible))
    return computed, ck[seg], visible


def _bshd_visible(batch: int, s_q: int, s_k: int, ratio: int, device, q_causal_offsets: Optional[Tensor] = None):
    """``(B, S_q)`` count of ratio-causal key columns ``min(S_k, (off + i + 1) // ratio)``."""
    i = torch.arange(s_q, device=device).view(1, s_q)
    if q_causal_offsets is not None:
        off = q_causal_offsets.long().view(batch, 1)
    else:
        off = torch.zeros(batch, 1, device=device, dtype=torch.long)
    return torch.div(off + i + 1, ratio, rounding_mode="floor").clamp(min=0, max=s_k).expand(batch, s_q)


def _gather_rows(buf: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
    """``buf[ids]`` with invalid ids read as row 0 (callers mask them)."""
    if buf.shape[0] == 0:
        return buf.new_zeros(ids.shape + buf.shape[1:])
    safe = torch.where(valid, ids, torch.zeros_like(ids)).clamp(0, buf.shape[0] - 1)
    return buf[safe]


def _relu_scores(q: Tensor, k: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """``z[..., h, s] = q[..., h, :] . k[..., s, :]`` and ``sum_h w[..., h] relu(z)`` (inputs in compute dtype)."""
    z = torch.einsum("...hd,...sd->...hs", q, k)
    return z, torch.einsum("...h,...hs->...s", w, torch.relu(z))


class TorchKernels(KernelSet):
    """Reference-grade PyTorch kernels with the production wrappers' contracts."""

    name = "torch"
    stages = frozenset(STAGES)
    topk_alignment = 128  # as on sm90 (Megatron ``_get_topk_alignment``)
    topk_tie_rule = "lower-index"  # a stable sort: the smaller column wins among equal scores

    # ================================================================ indexer forward / top-k / compactify ========
    def indexer_forward(self, q, k, w, ratio=4, qhead_per_kv_head=None, sm_scale=1.0, *, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None):
        cdt = compute_dtype(q.dtype)
        if cu_seqlens_q is None:
            b, s_q, h = q.shape[:3]
            s_k = k.shape[1]
            keys = k[:, :, 0].to(cdt).unsqueeze(1)
            visible = _bshd_visible(b, s_q, s_k, ratio, q.device, q_causal_offsets)
            cols = torch.arange(s_k, device=q.device)
            scores = torch.empty((b, s_q, s_k), dtype=cdt, device=q.device)
            for rs in _chunks(s_q, b * s_k * (h + 1)):
                _, s = _relu_scores(q[:, rs].to(cdt), keys, w[:, rs].to(cdt))
                scores[:, rs] = s * sm_scale
            return TupleDict(scores=scores.masked_fill(cols >= visible.unsqueeze(-1), float("-inf")))
        total_q = q.shape[0]
        computed, key_start, visible = _thd_rows(cu_seqlens_q, cu_seqlens_k, total_q, max_seqlen_q, max_seqlen_k,
                                                 ratio, q_causal_offsets)
        cols = torch.arange(max_seqlen_k, device=q.device)
        valid = cols < visible.unsqueeze(-1)
        out = torch.full((total_q, max_seqlen_k), float("-inf"), dtype=cdt, device=q.device)
        k2 = k[:, 0].to(cdt)
        for rs in _chunks(total_q, max_seqlen_k * (q.shape[1] + q.shape[2])):
            keys = _gather_rows(k2, key_start[rs].unsqueeze(-1) + cols, valid[rs])
            _, s = _relu_scores(q[rs].to(cdt), keys, w[rs].to(cdt))
            out[rs] = torch.where(valid[rs], s * sm_scale, out[rs])
        return TupleDict(scores=out)

    def indexer_top_k(self, input_values, seq_lens, top_k, next_n=1, return_val=True, num_copy_bits=256, stream=None,
                      tie_break=0, deterministic=False):
        n_rows, n_cols = input_values.shape
        row = torch.arange(n_rows, device=input_values.device)
        # next_n > 1: speculative-decoding stagger within each group of next_n rows
        length = (seq_lens.long().repeat_interleave(next_n) - next_n + row % next_n + 1).clamp(0, n_cols)
        cols = torch.arange(n_cols, device=input_values.device)
        keys = input_values.masked_fill(cols >= length.unsqueeze(-1), float("-inf"))
        if tie_break == 2:  # larger column wins among equal keys
            order = torch.sort(keys.flip(-1), dim=-1, descending=True, stable=True).indices
            order = n_cols - 1 - order
        else:  # 0 ("arbitrary") resolves like 1: the smaller column wins
            order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
        width = min(top_k, n_cols)
        indices = torch.full((n_rows, top_k), -1, dtype=torch.int32, device=input_values.device)
        indices[:, :width] = order[:, :width].int()
        taken = torch.arange(top_k, device=input_values.device) < length.clamp(max=top_k).unsqueeze(-1)
        indices = indices.masked_fill(~taken, -1)
        values = None
        if return_val:
            values = torch.gather(input_values, 1, indices.clamp(min=0).long()).masked_fill(~taken, float("-inf"))
        return TupleDict(indices=indices, values=values)

    def compactify(self, indices, stream=None):
        flat = indices.reshape(-1, indices.shape[-1])
        valid = flat >= 0
        order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices
        return TupleDict(indices=torch.gather(flat, 1, order).contiguous(),
                         topk_length=valid.sum(-1).to(torch.int32))

    # ================================================================ sparse attention ============================
    def sparse_attn_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, indexer_topk=0):
        if kv.shape[1] != 1:
            raise NotImplementedError("torch sparse_attn_fwd implements h_kv == 1 (MQA) only")
        cdt = compute_dtype(q.dtype)
        s_q, h_q, _ = q.shape
        kv2, idx = kv[:, 0].to(cdt), indices[:, 0].long()
        valid = self._slot_valid(idx, kv2.shape[0], topk_length)
        out = torch.empty((s_q, h_q, d_v), dtype=q.dtype, device=q.device)
        max_logits = torch.empty((s_q, h_q), dtype=cdt, device=q.device)
        lse = torch.empty((s_q, h_q), dtype=cdt, device=q.device)
        sink = attn_sink.to(cdt) if attn_sink is not None else None
        for rs in _chunks(s_q, idx.shape[1] * (q.shape[2] + h_q)):
            keys = _gather_rows(kv2, idx[rs], valid[rs])
            logits = torch.einsum("thd,tkd->thk", q[rs].to(cdt), keys) * sm_scale
            logits = logits.masked_fill(~valid[rs].unsqueeze(1), float("-inf"))
            row_lse = torch.logsumexp(logits, dim=-1)
            empty = torch.isneginf(row_lse)
            p = torch.exp(logits - row_lse.unsqueeze(-1)).nan_to_num(0.0)
            o = torch.einsum("thk,tkd->thd", p, keys[..., :d_v])
            if sink is not None:  # out *= exp(lse) / (exp(lse) + exp(sink))
                o = o * torch.sigmoid(row_lse - sink).unsqueeze(-1)
            out[rs] = o.masked_fill(empty.unsqueeze(-1), 0.0).to(q.dtype)
            max_logits[rs] = logits.amax(dim=-1)
            lse[rs] = row_lse.masked_fill(empty, float("inf"))
        return out, max_logits, lse

    def sparse_attn_bwd(self, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None,
                        dq=None, dkv=None, block_tile=64, deterministic=False, stream=None, workspace=None,
                        q_cluster_mode="off"):
        cdt = compute_dtype(q.dtype)
        t_q, h, d = q.shape
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        kv2, idx = kv.to(cdt), topk_idxs.long()
        valid = self._slot_valid(idx, kv.shape[0], topk_length)
        full_lse = torch.logaddexp(lse.to(cdt), attn_sink.to(cdt).view(1, h))  # sink-aware normaliser
        dq_acc = torch.zeros((t_q, h, d), dtype=cdt, device=q.device)
        dkv_acc = torch.zeros((kv.shape[0], d), dtype=cdt, device=q.device)
        delta = (dout.to(cdt) * out.to(cdt)).sum(-1)  # D = dO . O, (T, H)
        for rs in _chunks(t_q, idx.shape[1] * (d + h)):
            keys = _gather_rows(kv2, idx[rs], valid[rs])
            q_r, do_r = q[rs].to(cdt), dout[rs].to(cdt)
            logits = torch.einsum("thd,tkd->thk", q_r, keys) * scale
            p = torch.exp(logits - full_lse[rs].unsqueeze(-1)).masked_fill(~valid[rs].unsqueeze(1), 0.0)
            dp = torch.einsum("thd,tkd->thk", do_r, keys)
            ds = p * (dp - delta[rs].unsqueeze(-1))
            dq_acc[rs] = scale * torch.einsum("thk,tkd->thd", ds, keys)
            dkey = scale * torch.einsum("thk,thd->tkd", ds, q_r) + torch.einsum("thk,thd->tkd", p, do_r)
            dkey = dkey.masked_fill(~valid[rs].unsqueeze(-1), 0.0)
            if kv.shape[0] > 0:
                dkv_acc.index_add_(0, torch.where(valid[rs], idx[rs], 0).reshape(-1), dkey.reshape(-1, d))
        p_sink = torch.exp(attn_sink.to(cdt).view(1, h) - full_lse)
        d_sink = -(p_sink * delta).sum(0)
        dq_res = dq_acc.to(q.dtype) if dq is None else dq.copy_(dq_acc)
        dkv_res = dkv_acc.to(kv.dtype) if dkv is None else dkv.copy_(dkv_acc)
        return TupleDict(dq=dq_res, dkv=dkv_res, d_sink=d_sink.to(cdt))

    @staticmethod
    def _slot_valid(idx: Tensor, n_keys: int, topk_length: Optional[Tensor]) -> Tensor:
        """Slots read by the kernel: inside ``[0, n_keys)`` and, with ``topk_length``, before it."""
        valid = (idx >= 0) & (idx < n_keys)
        if topk_length is not None:
            slot = torch.arange(idx.shape[-1], device=idx.device)
            valid &= slot < topk_length.long().clamp(0, idx.shape[-1]).unsqueeze(-1)
        return valid

    # ================================================================ score recompute =============================
    def _sparse_keys(self, k: Tensor, topk_indices: Tensor, topk_length: Optional[Tensor], topk_indices_global: bool,
                     cdt: torch.dtype) -> tuple[Tensor, Tensor]:
        b, s_k = k.shape[:2]
        idx = topk_indices.long()
        if topk_indices_global:
            flat = k.reshape(b * s_k, -1).to(cdt)
            valid = self._slot_valid(idx, b * s_k, topk_length)
            return _gather_rows(flat, idx, valid), valid
        valid = self._slot_valid(idx, s_k, topk_length)
        keys = torch.stack([_gather_rows(k[i].to(cdt), idx[i], valid[i]) for i in range(b)]) if b else \
            k.new_zeros(idx.shape + (k.shape[-1],), dtype=cdt)
        return keys, valid

    def sparse_attn_score_recompute(self, q_attn, k_attn, lse, topk_indices, softmax_scale, qhead_per_kv_head=None,
                                    topk_length=None, topk_indices_global=False, out=None, stream=None):
        cdt = compute_dtype(q_attn.dtype)
        keys, valid = self._sparse_keys(k_attn, topk_indices, topk_length, topk_indices_global, cdt)
        logits = torch.einsum("bshd,bskd->bshk", q_attn.to(cdt), keys) * softmax_scale
        mass = torch.exp(logits - lse.to(cdt).unsqueeze(-1)).sum(2).masked_fill(~valid, 0.0)
        denom = mass.sum(-1, keepdim=True)
        target = torch.where(denom > 0, mass / torch.where(denom > 0, denom, torch.ones_like(denom)), 0.0)
        return TupleDict(target=target if out is None else out.copy_(target))

    def sparse_indexer_score_recompute(self, q_indexer, k_indexer, weights, topk_indices, qhead_per_kv_head=None,
                                       topk_length=None, topk_indices_global=False, out=None, stream=None):
        cdt = compute_dtype(q_indexer.dtype)
        keys, valid = self._sparse_keys(k_indexer, topk_indices, topk_length, topk_indices_global, cdt)
        _, scores = _relu_scores(q_indexer.to(cdt), keys, weights.to(cdt))
        predict = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
        return TupleDict(predict=predict if out is None else out.copy_(predict))

    def _dense(self, q, k, aux, is_index, scale, ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               q_causal_offsets):
        """Shared dense score recompute: raw scores over ratio-causal columns and the row denominator."""
        cdt = compute_dtype(q.dtype)

        def block(q_r, keys, aux_r, valid):
            if is_index:
                _, s = _relu_scores(q_r, keys, aux_r)
                s = (s * scale).masked_fill(~valid, float("-inf"))
                return s, torch.logsumexp(s, dim=-1)
            logits = torch.einsum("...hd,...sd->...hs", q_r, keys) * scale
            s = torch.exp(logits - aux_r.unsqueeze(-1)).sum(-2).masked_fill(~valid, 0.0)
            return s, s.sum(-1)

        if cu_seqlens_q is None:
            b, s_q, h = q.shape[:3]
            s_k = k.shape[1]
            visible = _bshd_visible(b, s_q, s_k, ratio, q.device, q_causal_offsets)
            valid = torch.arange(s_k, device=q.device) < visible.unsqueeze(-1)
            keys = k[:, :, 0].to(cdt).unsqueeze(1)
            out = torch.empty((b, s_q, s_k), dtype=cdt, device=q.device)
            denom = torch.empty((b, s_q), dtype=cdt, device=q.device)
            for rs in _chunks(s_q, b * s_k * (h + 1)):
                out[:, rs], denom[:, rs] = block(q[:, rs].to(cdt), keys, aux[:, rs].to(cdt), valid[:, rs])
            return out, denom
        total_q = q.shape[0]
        computed, key_start, visible = _thd_rows(cu_seqlens_q, cu_seqlens_k, total_q, max_seqlen_q, max_seqlen_k, ratio,
                                                 q_causal_offsets)
        cols = torch.arange(max_seqlen_k, device=q.device)
        valid = cols < visible.unsqueeze(-1)
        # rows the kernel never visits: scores -inf (pre-filled), denominator unwritten (poisoned)
        out = torch.full((total_q, max_seqlen_k), float("-inf"), dtype=cdt, device=q.device)
        denom = torch.full((total_q,), float("nan"), dtype=cdt, device=q.device)
        k2 = k[:, 0].to(cdt)
        for rs in _chunks(total_q, max_seqlen_k * (q.shape[1] + q.shape[2])):
            keys = _gather_rows(k2, key_start[rs].unsqueeze(-1) + cols, valid[rs])
            s, dn = block(q[rs].to(cdt), keys, aux[rs].to(cdt), valid[rs])
            if not is_index:
                s = s.masked_fill(~valid[rs], float("-inf"))  # THD: unwritten (masked) columns stay -inf
            out[rs] = torch.where(computed[rs].unsqueeze(-1), s, out[rs])
            denom[rs] = torch.where(computed[rs], dn, denom[rs])
        return out, denom

    def dense_attn_score_recompute(self, q, k, lse, softmax_scale, qhead_per_kv_head=None, out=None, denom_out=None,
                                   ratio=1, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                   max_seqlen_k=None, q_causal_offsets=None):
        s, d = self._dense(q, k, lse, False, softmax_scale, ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, q_causal_offsets)
        return TupleDict(out=s, denom=d)

    def dense_indexer_score_recompute(self, q, k, weights, qhead_per_kv_head=None, out=None, denom_out=None,
                                      sm_scale=1.0, ratio=1, *, cu_seqlens_q=None, cu_seqlens_k=None,
                                      max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None):
        s, d = self._dense(q, k, weights, True, sm_scale, ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, q_causal_offsets)
        return TupleDict(out=s, denom=d)

    # ================================================================ indexer backward ============================
    @staticmethod
    def _score_grad(target_eff: Tensor, predict: Tensor, clip_mask: Tensor, valid: Tensor, grad_scale) -> Tensor:
        """The kernels' score gradient ``g - predict * sum(g)`` with ``g = -target_eff * clip_mask * grad_scale``."""
        g = (-target_eff * clip_mask * grad_scale).masked_fill(~valid, 0.0)
        return (g - predict * g.sum(-1, keepdim=True)).masked_fill(~valid, 0.0)

    @staticmethod
    def _push_score_grad(q: Tensor, w: Tensor, keys: Tensor, d_score: Tensor, sm_scale: float):
        """Back-propagate ``d score[..., s]`` through ``score = sm_scale * sum_h w_h relu(q_h . k_s)``."""
        z = torch.einsum("...hd,...sd->...hs", q, keys)
        d_w = sm_scale * torch.einsum("...s,...hs->...h", d_score, torch.relu(z))
        dz = sm_scale * d_score.unsqueeze(-2) * w.unsqueeze(-1) * (z > 0)
        return torch.einsum("...hs,...sd->...hd", dz, keys), d_w, torch.einsum("...hs,...hd->...sd", dz, q)

    def indexer_backward(self, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                         sm_scale=1.0, loss_coeff=1.0, block_I=128, topk_indices_global=False, d_index_q=None,
                         d_weights=None, d_index_k=None, stream=None):
        cdt = compute_dtype(index_q.dtype)
        b, s_q, h, d = index_q.shape
        s_k = index_k.shape[1]
        grad_scale = float(loss_coeff) / (b * s_q) * grad_loss.to(cdt).reshape(())
        target = attn_score.to(cdt)
        predict = index_score.to(cdt)
        target_eff = torch.where(target >= CLIP_PROB_MIN, target, torch.full_like(target, CLIP_PROB_MIN))
        clip = (predict >= CLIP_PROB_MIN).to(cdt)
        d_score = self._score_grad(target_eff, predict, clip, torch.ones_like(clip, dtype=torch.bool), grad_scale)
        attn_score.copy_(d_score)  # kernel 1 overwrites attn_score with the score gradient
        keys, valid = self._sparse_keys(index_k, topk_indices, None, topk_indices_global, cdt)
        dq, dw, dkey = self._push_score_grad(index_q.to(cdt), weights.to(cdt), keys, d_score.masked_fill(~valid, 0.0),
                                             sm_scale)
        dk = torch.zeros((b * s_k, d), dtype=cdt, device=index_q.device)
        ids = topk_indices.long() if topk_indices_global else \
            topk_indices.long() + (torch.arange(b, device=index_q.device) * s_k).view(b, 1, 1)
        if dk.shape[0] > 0:
            dk.index_add_(0, torch.where(valid, ids, 0).reshape(-1),
                          dkey.masked_fill(~valid.unsqueeze(-1), 0).reshape(-1, d))
        return TupleDict(d_index_q=self._into(d_index_q, dq, index_q.dtype),
                         d_weights=self._into(d_weights, dw, weights.dtype),
                         d_index_k=self._into(d_index_k, dk.view(b, s_k, d), index_k.dtype))

    def dense_indexer_backward(self, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                               grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128, ratio=1, cu_seqlens_q=None,
                               cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
                               d_index_q=None, d_weights=None, d_index_k=None, stream=None, workspace=None):
        cdt = compute_dtype(index_q.dtype)
        eps = 0.0 if cdt == torch.float64 else DENSE_L1_EPS_FP32
        is_thd = cu_seqlens_q is not None
        rows = index_q.shape[0] if is_thd else index_q.shape[0] * index_q.shape[1]
        grad_scale = float(loss_coeff) / max(rows, 1) * grad_loss.to(cdt).reshape(())
        if is_thd:
            computed, key_start, visible = _thd_rows(cu_seqlens_q, cu_seqlens_k, rows, max_seqlen_q, max_seqlen_k,
                                                     ratio, q_causal_offsets)
            cols = torch.arange(max_seqlen_k, device=index_q.device)
            key_ids = key_start.unsqueeze(-1) + cols
        else:
            b, s_q = index_q.shape[:2]
            s_k = index_k.shape[1]
            visible = _bshd_visible(b, s_q, s_k, ratio, index_q.device, q_causal_offsets)
            computed = torch.ones((b, s_q), dtype=torch.bool, device=index_q.device)
            cols = torch.arange(s_k, device=index_q.device)
        valid = cols < visible.unsqueeze(-1)
        score_minus_lse = index_score.to(cdt) - index_lse.to(cdt).unsqueeze(-1)
        predict = torch.exp(score_minus_lse).masked_fill(~valid, 0.0)
        target = attn_score.to(cdt) / (attn_l1norm.to(cdt).unsqueeze(-1) + eps)
        target_eff = torch.where(target >= CLIP_PROB_MIN, target, torch.full_like(target, CLIP_PROB_MIN))
        clip = (score_minus_lse >= CLIP_LOG_MIN).to(cdt)
        d_score = self._score_grad(target_eff, predict, clip, valid, grad_scale)
        # kernel 1 overwrites index_score with the score gradient on the rows it visits
        index_score.copy_(torch.where(computed.unsqueeze(-1), d_score, index_score.to(cdt)))
        q, w = index_q.to(cdt), weights.to(cdt)
        if is_thd:
            k2 = index_k.to(cdt)
            dq = torch.full_like(q, float("nan"))   # rows outside every segment: never written
            dw = torch.full_like(w, float("nan"))
            dk = torch.zeros_like(k2)
            for rs in _chunks(rows, max_seqlen_k * (q.shape[1] + q.shape[2])):
                keys = _gather_rows(k2, key_ids[rs], valid[rs])
                dq_r, dw_r, dkey = self._push_score_grad(q[rs], w[rs], keys, d_score[rs], sm_scale)
                dq[rs] = torch.where(computed[rs].view(-1, 1, 1), dq_r, dq[rs])
                dw[rs] = torch.where(computed[rs].view(-1, 1), dw_r, dw[rs])
                if dk.shape[0] > 0:
                    dk.index_add_(0, torch.where(valid[rs], key_ids[rs], 0).reshape(-1),
                                  dkey.masked_fill(~valid[rs].unsqueeze(-1), 0).reshape(-1, dk.shape[1]))
        else:
            k3 = index_k.to(cdt)
            dq, dw, dk = torch.empty_like(q), torch.empty_like(w), torch.zeros_like(k3)
            for rs in _chunks(q.shape[1], q.shape[0] * k3.shape[1] * (q.shape[2] + 1)):
                z = torch.einsum("bshd,bkd->bshk", q[:, rs], k3)
                ds = d_score[:, rs]
                dw[:, rs] = sm_scale * torch.einsum("bsk,bshk->bsh", ds, torch.relu(z))
                dz = sm_scale * ds.unsqueeze(2) * w[:, rs].unsqueeze(-1) * (z > 0)
                dq[:, rs] = torch.einsum("bshk,bkd->bshd", dz, k3)
                dk += torch.einsum("bshk,bshd->bkd", dz, q[:, rs])
        return TupleDict(d_index_q=self._into(d_index_q, dq, index_q.dtype),
                         d_weights=self._into(d_weights, dw, weights.dtype),
                         d_index_k=self._into(d_index_k, dk, index_k.dtype))

    @staticmethod
    def _into(dst: Optional[Tensor], value: Tensor, dtype: torch.dtype) -> Tensor:
        return value.to(dtype) if dst is None else dst.copy_(value)

    # ================================================================ teacher LSE =================================
    def csa_teacher_lse(self, query, full_kv, compressed_kv, attn_sink, window_indices, softmax_scale, ratio, *,
                        batch_size=None, seqlen_q=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                        max_seqlen_k=None, q_causal_offsets=None):
        cdt = compute_dtype(query.dtype)
        total_q, h, _ = query.shape
        q = query.to(cdt)
        kv = full_kv.to(cdt)
        idx = window_indices.long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        window_logits = torch.einsum("thd,tkd->thk", q, _gather_rows(kv, idx, valid)) * softmax_scale
        window_logits = window_logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        sink = attn_sink.to(cdt).view(1, h, 1).expand(total_q, h, 1)
        non_compressed = torch.logsumexp(torch.cat([window_logits, sink], dim=-1), dim=-1)  # (T, H)
        if cu_seqlens_q is None:
            b, s_q = batch_size, seqlen_q
            s_k = compressed_kv.shape[1]
            q_bs = q.view(s_q, b, h, -1).transpose(0, 1)  # flat row s*B + b
            nc = non_compressed.view(s_q, b, h).transpose(0, 1)
            visible = _bshd_visible(b, s_q, s_k, ratio, query.device)
            valid_c = torch.arange(s_k, device=query.device) < visible.unsqueeze(-1)
            logits = torch.einsum("bshd,bkd->bshk", q_bs, compressed_kv.to(cdt)) * softmax_scale
            logits = logits.masked_fill(~valid_c.unsqueeze(2), float("-inf"))
            return torch.logsumexp(torch.cat([logits, nc.unsqueeze(-1)], dim=-1), dim=-1)
        computed, key_start, visible = _thd_rows(cu_seqlens_q, cu_seqlens_k, total_q, max_seqlen_q, max_seqlen_k, ratio,
                                                 q_causal_offsets)
        cols = torch.arange(max_seqlen_k, device=query.device)
        valid_c = cols < visible.unsqueeze(-1)
        keys = _gather_rows(compressed_kv.to(cdt), key_start.unsqueeze(-1) + cols, valid_c)
        logits = torch.einsum("thd,tkd->thk", q, keys) * softmax_scale
        logits = logits.masked_fill(~valid_c.unsqueeze(1), float("-inf"))
        full = torch.logsumexp(torch.cat([logits, non_compressed.unsqueeze(-1)], dim=-1), dim=-1)
        return torch.where(computed.unsqueeze(-1), full, torch.full_like(full, float("nan")))  # unwritten rows

