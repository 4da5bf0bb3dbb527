"""Index construction around the kernels: segment lookup, compressed boundaries, the ratio-causal rule, window /
compressed key ids of the SBHD layout, the packed ``kv_full``. The per-row maps of a call (both layouts) are
:class:`fused.rows.RowSpace`'s, built on these.

Production computes these with small torch ops (Megatron ``csa.py`` / ``fused_sparse_attention.py``); so does this
module. Conventions:

* SBHD-flat (BSHD public inputs): FlashMLA rows are ``s * B + b`` and a key's global id is ``local * B + b``.
* THD: rows are packed; a key's global id is ``cu_seqlens_kv_full[b] + local``, ``local`` in the per-segment full
  space ``[0, len_kv_b + len_comp_b)`` (window keys first, then compressed keys).
* ``-1`` marks an invalid slot everywhere; index tensors are int32 like production's.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def batch_of_row(cu_seqlens: Tensor, total: int) -> Tensor:
    """Segment of each of ``total`` rows (int64); rows past the last boundary map to the last segment."""
    n_seg = cu_seqlens.shape[0] - 1
    rows = torch.arange(total, device=cu_seqlens.device, dtype=torch.int64)
    return torch.bucketize(rows, cu_seqlens[1:].long(), right=True).clamp(max=max(n_seg - 1, 0))


def cu_seqlens_compressed(cu_seqlens: Tensor, ratio: int) -> Tensor:
    """``[0, cumsum(L_b // ratio)]`` over the padded segment lengths ``L_b`` (int32)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]) // ratio
    return torch.cat([cu_seqlens.new_zeros(1), lengths.cumsum(0).to(cu_seqlens.dtype)])


def cu_seqlens_kv_full(cu_kv: Tensor, cu_comp: Tensor) -> Tensor:
    lengths = (cu_kv[1:] - cu_kv[:-1]) + (cu_comp[1:] - cu_comp[:-1])
    return torch.cat([cu_kv.new_zeros(1), lengths.cumsum(0).to(cu_kv.dtype)])


def causal_visible(pos: Tensor, ratio: int) -> Tensor:
    """Compressed keys visible to the query at segment position ``pos``: ``(pos + 1) // r`` (key ``g`` pools tokens
    ``[g r, (g + 1) r)``, so it is causal once its last token ``g r + r - 1 <= pos``). Same dtype as ``pos``."""
    return torch.div(pos + 1, ratio, rounding_mode="floor")


# ---- window / compressed ids ------------------------------------------------------------------------------------
def window_matrix(pos: Tensor, window: int) -> Tensor:
    """Row with position ``p`` sees ``[max(0, p-W+1), p]``; slots past ``p`` (only when ``p < W-1``) are -1."""
    offsets = torch.arange(window, device=pos.device, dtype=pos.dtype)
    ids = (pos - window + 1).clamp(min=0).unsqueeze(-1) + offsets
    return torch.where(ids > pos.unsqueeze(-1), torch.full_like(ids, -1), ids)


def window_idxs_sbhd(window: int, batch: int, seqlen: int, device) -> Tensor:
    """``(B, S, W)`` local window ids."""
    pos = torch.arange(seqlen, device=device, dtype=torch.int32)
    return window_matrix(pos, window).unsqueeze(0).expand(batch, -1, -1)


def compress_idxs_sbhd(ratio: int, batch: int, seqlen: int, offset: int, device) -> Tensor:
    """``(B, S, S // r)``: column ``g`` holds ``offset + g`` iff ``g < (s + 1) // r``, else -1."""
    g = torch.arange(seqlen // ratio, device=device, dtype=torch.int32)
    visible = causal_visible(torch.arange(seqlen, device=device, dtype=torch.int32), ratio).unsqueeze(-1)
    ids = torch.where(g < visible, g + offset, torch.full_like(g, -1))
    return ids.unsqueeze(0).expand(batch, -1, -1)


# ---- packed kv_full -----------------------------------------------------------------------------------------------
def cat_per_segment(kv: Tensor, compressed: Optional[Tensor], cu_kv: Tensor, cu_comp: Tensor,
                    cu_full: Tensor, kv_segment: Tensor) -> Tensor:
    """``kv_full`` of the THD layout: per segment, its kv rows then its compressed rows (spec §6.2, §6.4).
    ``kv_segment``: the segment of each kv row (self-attention: the query rows', :class:`fused.rows.RowSpace`).

    ``compressed`` may have capacity rows past the true count ``cu_comp[-1]``. The buffer has
    ``total_kv + capacity`` rows: valid rows land in ``[0, cu_full[-1])``, invalid kv rows (slack) in the last slot,
    invalid compressed row ``j`` in slot ``total_kv + j`` — tail slots that no valid index reaches. Slots nothing is
    written to are NaN (production leaves them uninitialised), so any read of a tail slot poisons the result.
    """
    if compressed is None:
        return kv
    total_kv, capacity = kv.shape[0], compressed.shape[0]
    rows = kv_full_rows(total_kv, capacity, cu_comp)
    out = torch.full((rows,) + tuple(kv.shape[1:]), float("nan"), dtype=kv.dtype, device=kv.device)

    seg = kv_segment
    src = torch.arange(total_kv, device=kv.device)
    dst = cu_full.long()[seg] + (src - cu_kv.long()[seg])
    out[torch.where(src < cu_kv.long()[-1], dst, rows - 1)] = kv

    if capacity > 0:
        seg = batch_of_row(cu_comp, capacity)
        src = torch.arange(capacity, device=kv.device)
        kv_len = (cu_kv[1:] - cu_kv[:-1]).long()[seg]
        dst = cu_full.long()[seg] + kv_len + (src - cu_comp.long()[seg])
        out[torch.where(src < cu_comp.long()[-1], dst, invalid_compressed_slots(src, total_kv))] = compressed
    return out


def kv_full_rows(total_kv: int, capacity: int, cu_comp: Tensor) -> int:
    """Rows of the packed ``kv_full``: every kv row plus every compressed **capacity** row. Never sized by the true
    count ``cu_comp[-1]``: that is a device value (a host read breaks graph capture) and the invalid compressed rows
    need slots of their own (:func:`invalid_compressed_slots`)."""
    return total_kv + capacity


def invalid_compressed_slots(src: Tensor, total_kv: int) -> Tensor:
    """Where compressed row ``src`` goes when it is past the true count: tail slot ``total_kv + src``, which no valid
    index reaches (never a valid key's row)."""
    return total_kv + src
