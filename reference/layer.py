"""The whole DSv4 hybrid attention layer (spec §1.3): projections, norms, RoPE, core attention, grouped output.

::

    qr = RMSNorm_q(x @ Wq_down^T)                    q = head_rms((qr @ Wq_up^T).view(.., n, D))
    kv = RMSNorm_kv(x @ Wkv^T)                       q[..., Dn:], kv[..., Dn:] = RoPE(.., position t)
    o  = core_attention(q, kv, x, qr)                o[..., Dn:] = RoPE^-1(o[..., Dn:], position t)
    o  = einsum('..gd,grd->..gr', o.view(.., G, n*D/G), Wo_group.view(G, Ro, n*D/G)).reshape(.., G*Ro)
    y  = o @ Wproj^T

Positions restart at 0 in every THD segment. THD padding rows keep their forward values but pass no gradient.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from cases.config import ModelConfig
from cases.errors import CaseError
from cases.layout import PackedSeqParams
from cases.outputs import AttentionOutput

from . import thd
from .core_attention import core_attention
from .norms import head_rms_norm, rms_norm
from .params import get_param
from .rope import apply_rope, layer_inv_freq


def query_latent(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
                 packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """Public API (ARCHITECTURE.md): the layer's query latent ``qr = RMSNorm_q(x @ Wq_down^T)`` ``[B, S, Rq]`` /
    ``[T, Rq]`` — what :func:`attention_layer` hands its core attention (and the indexer) as ``q_latent``."""
    c = config
    return rms_norm(hidden @ get_param(params, "linear_q_down_proj.weight", (c.q_lora_rank, c.hidden_size)).t(),
                    get_param(params, "q_layernorm.weight", (c.q_lora_rank,)), c.layernorm_epsilon)


def attention_layer(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], config: ModelConfig,
                    packed_seq_params: Optional[PackedSeqParams] = None, *, training: bool = True,
                    topk_indices: Optional[torch.Tensor] = None) -> AttentionOutput:
    """Public API (ARCHITECTURE.md): ``hidden [B, S, Hd]`` (BSHD) or ``[T, Hd]`` (THD) -> ``out`` of the same shape.

    ``lse``, ``indexer_loss``, ``topk_indices`` and ``index_scores`` are those of :func:`core_attention`.
    """
    c = config
    n, D, Hd, Rq, G, Ro = (c.num_attention_heads, c.v_head_dim, c.hidden_size, c.q_lora_rank, c.o_groups,
                           c.o_lora_rank)
    packed = packed_seq_params is not None
    if hidden.dim() != (2 if packed else 3) or hidden.shape[-1] != Hd:
        want = "[T, Hd]" if packed else "[B, S, Hd]"
        raise CaseError("hidden", f"must be {want} with Hd={Hd}, got shape {tuple(hidden.shape)}")
    if packed:
        packed_seq_params = thd.on_host(packed_seq_params)
        T = hidden.shape[0]
        segs = thd.segments(packed_seq_params, T)
        positions = thd.token_positions(segs, T, hidden.device)       # [T]
        real = thd.real_row_mask(segs, T, hidden.device)
    else:
        positions = torch.arange(hidden.shape[1], device=hidden.device).view(1, -1)  # [1, S]
        real = None
    head_positions = positions.unsqueeze(-1)                         # broadcast over the head dim
    inv_freq = layer_inv_freq(c, hidden.device)
    eps = c.layernorm_epsilon

    q_latent = query_latent(hidden, params, c, packed_seq_params)
    query = (q_latent @ get_param(params, "linear_q_up_proj.weight", (n * D, Rq)).t())
    query = head_rms_norm(query.view(*query.shape[:-1], n, D), eps)
    kv = rms_norm(hidden @ get_param(params, "linear_kv_proj.weight", (D, Hd)).t(),
                  get_param(params, "kv_layernorm.weight", (D,)), eps)
    query = apply_rope(query, head_positions, inv_freq)
    kv = apply_rope(kv, positions, inv_freq)

    core = core_attention(query, kv, hidden, q_latent, params, c, packed_seq_params, training=training,
                          topk_indices=topk_indices)

    o = apply_rope(core.out, head_positions, inv_freq, inverse=True)
    w_group = get_param(params, "linear_o_group_proj", (G * Ro, n * D // G)).view(G, Ro, n * D // G)
    o = torch.einsum("...gd,grd->...gr", o.reshape(*o.shape[:-2], G, n * D // G), w_group)
    out = o.reshape(*o.shape[:-2], G * Ro) @ get_param(params, "linear_proj.weight", (Hd, G * Ro)).t()
    if real is not None:
        out = torch.where(real.unsqueeze(-1), out, out.detach())
    return AttentionOutput(out=out, lse=core.lse, indexer_loss=core.indexer_loss, topk_indices=core.topk_indices,
                           index_scores=core.index_scores)
