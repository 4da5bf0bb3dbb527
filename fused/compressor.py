"""The KV compressor as production runs it on sm90: eager PyTorch (the cudnn-frontend fused compressor is sm100-only).

SBHD follows ``Compressor._forward_sbhd`` (view into blocks, overlap by shifting whole blocks); THD follows the
vectorised gather of ``Compressor._forward_thd``: one ``(rows, r)`` gather index over the packed buffer, the overlap
taken from the previous gathered row and blanked where a row starts its segment, and an output of ``capacity`` rows
whose tail rows (past the true count) gather tokens ``[0, r)`` and are garbage no valid index reads.
"""

from __future__ import annotations

from typing import Optional

import torch

from cases.config import ModelConfig

from . import ops
from .index_maps import batch_of_row, cu_seqlens_compressed

Tensor = torch.Tensor


def _pool(kv: Tensor, score: Tensor, ape: Tensor, ratio: int, head_dim: int, overlap_first: Optional[Tensor]) -> Tensor:
    """Gated softmax pooling of gathered blocks ``kv, score: (rows, r, ..., coff*d)`` -> ``(rows, ..., d)``.

    ``overlap_first``: for r = 4, bool ``(rows,)`` marking rows with no predecessor block (``None`` for r = 128).
    """
    extra = (1,) * (kv.dim() - 3)
    score = score + ape.view((1, ratio) + extra + (-1,))  # fp32 ape: the score is promoted to fp32
    if overlap_first is not None:
        kv = _overlap(kv, overlap_first, 0.0, head_dim)
        score = _overlap(score, overlap_first, float("-inf"), head_dim)
    weights = torch.softmax(score, dim=1, dtype=ops.compute_dtype(kv.dtype)).to(kv.dtype)
    return (kv * weights).sum(dim=1)


def segment_first_blocks(local_block: Tensor) -> Tensor:
    """Bool ``(rows,)``: the blocks with no overlap predecessor, i.e. the first block of each segment (r = 4's window
    never reaches into the previous segment). ``local_block``: each compressed row's block index in its segment."""
    return local_block == 0


def _overlap(t: Tensor, first: Tensor, fill: float, d: int) -> Tensor:
    """r = 4 window of 2r tokens: slots ``[0, r)`` from the previous block's first channel half, ``[r, 2r)`` from the
    own block's second half; the previous half is ``fill`` on rows that start a sequence / segment."""
    return _OverlapWindow.apply(t, first.view((-1,) + (1,) * (t.dim() - 1)), fill, d)


class _OverlapWindow(torch.autograd.Function):
    """``t (rows, r, ..., 2d)`` -> ``(rows, 2r, ..., d)``, written in place of a roll + where + cat (and their
    backward: two zero-filled slice gradients and a sum), which cost more than the window itself.

    Row ``i``'s previous block is row ``i - 1`` (row 0 wraps to the last row, as a roll does; it always starts a
    sequence, so it is ``fill`` either way). ``first`` is bool, broadcastable to one window half.
    """

    @staticmethod
    def forward(ctx, t: Tensor, first: Tensor, fill: float, d: int) -> Tensor:
        r = t.shape[1]
        window = t.new_empty((t.shape[0], 2 * r) + tuple(t.shape[2:-1]) + (d,))
        window[:, r:] = t[..., d:]
        window[1:, :r] = t[:-1, ..., :d]
        window[:1, :r] = t[-1:, ..., :d]
        window[:, :r].masked_fill_(first, fill)
        ctx.save_for_backward(first)
        return window

    @staticmethod
    def backward(ctx, grad: Tensor):
        (first,) = ctx.saved_tensors
        r, d = grad.shape[1] // 2, grad.shape[-1]
        prev = grad[:, :r].masked_fill(first, 0)
        g = grad.new_empty((grad.shape[0], r) + tuple(grad.shape[2:-1]) + (2 * d,))
        g[..., d:] = grad[:, r:]
        g[:-1, ..., :d] = prev[1:]
        g[-1:, ..., :d] = prev[:1]
        return g, None, None, None


def _finish(c: Tensor, positions: Tensor, params: dict, prefix: str, config: ModelConfig, rotate: bool,
            dtype: torch.dtype) -> Tensor:
    c = ops.rms_norm(c.to(dtype), params[f"{prefix}.norm.weight"], config.layernorm_epsilon)
    c = ops.apply_rope(c, positions, config)
    return ops.hadamard(c) if rotate else c


def compress_sbhd(x: Tensor, params: dict, prefix: str, config: ModelConfig, ratio: int, *,
                  rotate: bool) -> Optional[Tensor]:
    """``x (S, B, Hd)`` -> ``(S // r, B, d)``, or ``None`` when ``S < r`` (the partial last block is dropped)."""
    seqlen, batch = x.shape[:2]
    if seqlen < ratio:
        return None
    head_dim = params[f"{prefix}.norm.weight"].shape[0]
    n_comp = seqlen // ratio
    # the partial last block is dropped from the (narrow) projections, not from x: the backward of a slice of x
    # would zero-fill and copy a full-width gradient of x
    kv = ops.linear(x, params[f"{prefix}.linear_wkv.weight"])[: n_comp * ratio].view(n_comp, ratio, batch, -1)
    score = ops.linear(x, params[f"{prefix}.linear_wgate.weight"])[: n_comp * ratio].view(n_comp, ratio, batch, -1)
    first = segment_first_blocks(torch.arange(n_comp, device=x.device)) if ratio == 4 else None
    c = _pool(kv, score, params[f"{prefix}.ape"], ratio, head_dim, first)
    positions = (torch.arange(n_comp, device=x.device) * ratio).view(n_comp, 1)
    return _finish(c, positions, params, prefix, config, rotate, x.dtype)


def compress_thd(x: Tensor, params: dict, prefix: str, config: ModelConfig, ratio: int, cu_seqlens: Tensor,
                 capacity: Optional[int], *, rotate: bool) -> tuple[Optional[Tensor], Tensor]:
    """``x (T, Hd)`` with padded boundaries ``cu_seqlens`` -> ``(compressed (rows, d) or None, cu_seqlens_compressed)``.

    ``rows`` = ``capacity`` if given, else the true count (a host read, as production does without capacity).
    """
    cu_comp = cu_seqlens_compressed(cu_seqlens, ratio)
    rows = int(capacity) if capacity is not None else int(cu_comp[-1])
    if rows == 0:
        return None, cu_comp
    head_dim = params[f"{prefix}.norm.weight"].shape[0]
    kv = ops.linear(x, params[f"{prefix}.linear_wkv.weight"])
    score = ops.linear(x, params[f"{prefix}.linear_wgate.weight"])

    row = torch.arange(rows, device=x.device)
    seg = batch_of_row(cu_comp, rows)
    valid = row < cu_comp.long()[-1]
    local = row - cu_comp.long()[seg]
    gather_local = torch.where(valid, local, 0)
    base = torch.where(valid, cu_seqlens.long()[seg] + gather_local * ratio, 0)
    # tail rows read tokens [0, r); clamped so that a buffer shorter than r cannot index past its end
    gather = (base.unsqueeze(-1) + torch.arange(ratio, device=x.device)).clamp(max=max(x.shape[0] - 1, 0))
    first = segment_first_blocks(gather_local) if ratio == 4 else None
    c = _pool(kv[gather], score[gather], params[f"{prefix}.ape"], ratio, head_dim, first)
    return _finish(c, local * ratio, params, prefix, config, rotate, x.dtype), cu_comp
