"""KV compressor: gated per-channel softmax pooling of ``r`` (or ``2r``) tokens into one entry (spec §2).

For one sequence of ``L`` tokens and ``n_comp = L // r`` entries (the ``L mod r`` tail is dropped)::

    KV = x @ Wkv^T, SC = x @ Wgate^T + ape            both viewed [n_comp, r, coff*d], ape [r, coff*d]
    r = 4 (overlap, coff = 2): entry g pools 2r positions -- the previous block's first channel half
        (KV[g-1, :, :d], SC[g-1, :, :d]) then its own block's second half (KV[g, :, d:], SC[g, :, d:]);
        entry 0 has no predecessor: kv 0, score -inf.
    r = 128 (coff = 1): entry g pools its own r tokens.
    w = softmax(SC2 over the pooled positions, per channel);  c = sum(KV2 * w)
    c = RMSNorm(c); c[..., d-Dr:] = RoPE(c[..., d-Dr:], position g*r); c = Hadamard(c)/sqrt(d) if rotate

Entry ``g`` depends only on tokens ``< (g+1) r``; query ``i`` may see it iff ``g < floor((i+1)/r)``.
Precision: KV and the output in the activation dtype, the gate softmax and the pooled sum in float32 (rounded once).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from cases.config import INDEXER_RATIO, ModelConfig, overlap_factor
from cases.errors import CaseError
from cases.layout import PackedSeqParams

from . import thd
from .hadamard import rotate_activation
from .norms import rms_norm
from .numerics import compute_dtype
from .params import get_param
from .rope import apply_rope, layer_inv_freq

ATTENTION_PREFIX = "core_attention.compressor"
INDEXER_PREFIX = "core_attention.indexer.compressor"


def visible_compressed_count(seq_len: int, ratio: int, n_comp: int, device=None) -> torch.Tensor:
    """The causal rule of compressed entries, the one place it is written: query row ``i`` (``0 .. seq_len-1``) sees
    the entries ``g < min(floor((i+1)/ratio), n_comp)`` (module docstring); returns those counts ``[seq_len]``."""
    i = torch.arange(seq_len, device=device)
    return torch.clamp((i + 1) // ratio, max=n_comp)


def compressor_geometry(prefix: str, config: ModelConfig) -> tuple[int, int]:
    """``(ratio, head_dim)`` of the compressor named ``prefix``: the attention one (r, D) or the indexer's
    (:data:`INDEXER_RATIO`, dI)."""
    if prefix == ATTENTION_PREFIX:
        if not config.has_compressor:
            raise CaseError("config.compress_ratio", f"a ratio-{config.compress_ratio} layer has no compressor")
        return config.compress_ratio, config.v_head_dim
    if prefix == INDEXER_PREFIX:
        if not config.has_indexer:
            raise CaseError("config.compress_ratio",
                            "only ratio-4 layers outside dense mode have an indexer compressor")
        return INDEXER_RATIO, config.dsa_indexer_head_dim
    raise CaseError("prefix", f"must be {ATTENTION_PREFIX!r} or {INDEXER_PREFIX!r}, got {prefix!r}")


def _with_predecessor(blocks: torch.Tensor, fill: float) -> torch.Tensor:
    """``[B, n, r, c] -> [B, n, r, c]``: entry g holds block g-1, entry 0 holds ``fill``."""
    B, _, r, c = blocks.shape
    first = blocks.new_full((B, 1, r, c), fill)
    return torch.cat((first, blocks), dim=1)[:, : blocks.shape[1]]


def compress_sequence(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
                      norm_weight: torch.Tensor, *, ratio: int, head_dim: int, inv_freq: torch.Tensor, eps: float,
                      rotate: bool) -> torch.Tensor:
    """Compress each sequence of ``x [B, L, Hd]`` into ``[B, L // ratio, head_dim]`` entries (module docstring)."""
    B, L, _ = x.shape
    n_comp, d = L // ratio, head_dim
    coff = overlap_factor(ratio)
    overlap = coff == 2
    work = compute_dtype(x.dtype)

    tokens = x[:, : n_comp * ratio]
    kv = (tokens @ wkv.t()).view(B, n_comp, ratio, coff * d)
    score = (tokens @ wgate.t()).view(B, n_comp, ratio, coff * d).to(work)
    score = score + ape.to(work)  # ape [r, coff*d] added per position, before the overlap shift
    if overlap:
        kv_first, kv_second = kv.split(d, dim=-1)  # channels [:d] and [d:] (a split's backward fills nothing)
        score_first, score_second = score.split(d, dim=-1)
        kv = torch.cat((_with_predecessor(kv_first, 0.0), kv_second), dim=2)
        score = torch.cat((_with_predecessor(score_first, float("-inf")), score_second), dim=2)
    weights = torch.softmax(score, dim=2)  # per channel, over the pooled positions
    pooled = (kv.to(work) * weights).sum(dim=2).to(x.dtype)

    c = rms_norm(pooled, norm_weight, eps)
    positions = torch.arange(n_comp, device=x.device) * ratio
    c = apply_rope(c, positions, inv_freq)
    return rotate_activation(c) if rotate else c


def compress_with_params(x: torch.Tensor, params: Mapping[str, torch.Tensor], prefix: str, config: ModelConfig, *,
                         rotate: bool) -> torch.Tensor:
    """:func:`compress_sequence` with the weights of compressor ``prefix`` taken from ``params``."""
    ratio, d = compressor_geometry(prefix, config)
    coff, Hd = overlap_factor(ratio), config.hidden_size
    return compress_sequence(
        x,
        get_param(params, f"{prefix}.linear_wkv.weight", (coff * d, Hd)),
        get_param(params, f"{prefix}.linear_wgate.weight", (coff * d, Hd)),
        get_param(params, f"{prefix}.ape", (ratio, coff * d)),
        get_param(params, f"{prefix}.norm.weight", (d,)),
        ratio=ratio, head_dim=d, inv_freq=layer_inv_freq(config, x.device), eps=config.layernorm_epsilon, rotate=rotate)


def compressor(hidden: torch.Tensor, params: Mapping[str, torch.Tensor], prefix: str, config: ModelConfig,
               packed_seq_params: Optional[PackedSeqParams] = None, *, rotate: bool = False) -> torch.Tensor:
    """Public API: compressed entries of compressor ``prefix`` (ARCHITECTURE.md).

    * BSHD ``hidden [B, S, Hd]`` -> ``[B, S // r, d]``.
    * THD ``hidden [T, Hd]`` -> ``[rows, d]``: each padded segment ``b`` contributes ``L_b // r`` rows in segment
      order (``cu_seqlens_compressed``); ``rows = total_comp_capacity`` when set (the extra capacity rows are
      unspecified: :func:`thd.capacity_fill`), else the true count.
    """
    if packed_seq_params is None:
        if hidden.dim() != 3:
            raise CaseError("hidden", f"BSHD hidden must be [B, S, Hd], got shape {tuple(hidden.shape)}")
        return compress_with_params(hidden, params, prefix, config, rotate=rotate)
    if hidden.dim() != 2:
        raise CaseError("hidden", f"THD hidden must be [T, Hd], got shape {tuple(hidden.shape)}")
    ratio, d = compressor_geometry(prefix, config)
    packed_seq_params = thd.on_host(packed_seq_params)
    segments = thd.segments(packed_seq_params, hidden.shape[0])
    # a segment shorter than the ratio has no entries: nothing to compute, its piece would be empty (where no segment
    # has any, every one runs: the weights and hidden then get a zero gradient, not none)
    runs = [s.length >= ratio for s in segments]
    runs = runs if any(runs) else [True] * len(segments)
    pieces = [compress_with_params(rows.unsqueeze(0), params, prefix, config, rotate=rotate)[0]
              for run, rows in zip(runs, thd.segment_rows(hidden, segments)) if run]
    return thd.pack_compressed(pieces, packed_seq_params.total_comp_capacity, ratio, segments,
                               like=hidden.new_empty(0, d))
