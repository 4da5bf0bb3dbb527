"""The DSv4 hybrid-attention layer around the core (``DSv4HybridAttention`` / ``DSv4HybridSelfAttention``):
projections, norms, RoPE, inverse RoPE on the output and the grouped output projection — eager PyTorch, as
production runs them (TE supplies only linears and norms; the fused RoPE is the same math)."""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from cases.config import ModelConfig
from cases.errors import CaseError
from cases.layout import PackedSeqParams
from cases.outputs import AttentionOutput
from cases.selection import check_topk_selection

from . import ops
from .core_attention import public_output, run_core
from .rows import RowSpace
from .thd import ThdMeta

Tensor = torch.Tensor


def _query_latent(x: Tensor, params: Mapping[str, Tensor], eps: float) -> Tensor:
    return ops.rms_norm(ops.linear(x, params["linear_q_down_proj.weight"]), params["q_layernorm.weight"], eps)


def query_latent(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
                 packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """The layer's query latent ``qr`` ``[B, S, Rq]`` / ``[T, Rq]``, computed as :func:`attention_layer` computes it
    (BSHD in production's SBHD, returned as a transposed view): what the layer hands its core attention and indexer."""
    if packed_seq_params is not None:
        return _query_latent(hidden, params, config.layernorm_epsilon)
    return _query_latent(hidden.transpose(0, 1), params, config.layernorm_epsilon).transpose(0, 1)


def attention_layer(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
                    packed_seq_params: Optional[PackedSeqParams] = None, *, training: bool = True,
                    topk_indices: Optional[torch.Tensor] = None) -> AttentionOutput:
    """The whole layer on ``hidden`` BSHD ``[B, S, Hd]`` or THD ``[T, Hd]``; ``out`` has the shape of ``hidden``."""
    c = config
    packed = packed_seq_params is not None
    lead = tuple(hidden.shape[:1] if packed else hidden.shape[:2])
    if hidden.dim() != len(lead) + 1 or hidden.shape[-1] != c.hidden_size:
        raise CaseError("hidden", f"has shape {tuple(hidden.shape)}, expected [{'T' if packed else 'B, S'}, "
                                  f"{c.hidden_size}]")
    check_topk_selection(topk_indices, c, lead, packed_seq_params)
    if packed:
        thd = ThdMeta.from_params(packed_seq_params, hidden.shape[0])
        x, rows_pos = hidden, thd.positions()
        rows = RowSpace.packed(thd)
    else:
        thd = None
        x = hidden.transpose(0, 1)  # production's SBHD
        rows_pos = torch.arange(x.shape[0], device=x.device).view(-1, 1)
        rows = RowSpace.sbhd(x.shape[0], x.shape[1], x.device)
    n, d, eps = c.num_attention_heads, c.v_head_dim, c.layernorm_epsilon
    head_pos = rows_pos.unsqueeze(-1)  # one position per row, shared by the heads

    qr = _query_latent(x, params, eps)
    q = ops.linear(qr, params["linear_q_up_proj.weight"])
    q = ops.rms_norm(q.view(q.shape[:-1] + (n, d)), None, eps)
    kv = ops.rms_norm(ops.linear(x, params["linear_kv_proj.weight"]), params["kv_layernorm.weight"], eps)
    q = ops.apply_rope(q, head_pos, c)
    kv = ops.apply_rope(kv, rows_pos, c)

    res = run_core(q, kv, x, qr, params, c, rows, training, topk_indices, head_pos)

    o = ops.apply_rope(res.out, head_pos, c, inverse=True)  # out of place: the backward keeps the core output
    groups, rank = c.o_groups, c.o_lora_rank
    o = o.reshape(o.shape[:-2] + (groups, n * d // groups))
    w_group = params["linear_o_group_proj"].view(groups, rank, n * d // groups).to(o.dtype)
    o = torch.einsum("...gd,grd->...gr", o, w_group).reshape(o.shape[:-2] + (groups * rank,))
    y = padding_rows_pass_no_gradient(ops.linear(o, params["linear_proj.weight"]), rows)
    return public_output(res, y if packed else y.transpose(0, 1), q, thd)


def padding_rows_pass_no_gradient(y: Tensor, rows: RowSpace) -> Tensor:
    """The layer output ``y [T, Hd]`` with THD padding rows (alignment padding, dummy tail, slack) detached: they
    keep their forward values, but an output gradient on them reaches no weight (``linear_proj``,
    ``linear_o_group_proj``) and no input. A ``where`` on the device mask, no host branch (CUDA-graph safe). BSHD
    has no padding rows: ``y`` as is."""
    if rows.padding is None:
        return y
    return torch.where(rows.padding.unsqueeze(-1), y.detach(), y)
