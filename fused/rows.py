"""The query-row space of one fused call, computed once and passed down (FlashAttention ``unpad_input``-style).

Flat query rows are SBHD-flat ``s * B + b`` for BSHD public inputs (``rows = S * B``, FlashMLA's row order) and the
packed rows for THD (``rows = T``). For THD every per-row quantity the composition needs is derived here, from one
segment lookup: the row's segment, its offset from the segment's **padded** start, whether it lies before the last
boundary (``inside``), its segment's padded length, and whether it is a padding row (alignment padding, dummy
segments, slack). The maps built on them live here too, once for both layouts:

* :meth:`RowSpace.window_ids` — local sliding-window ids, ``(B, S, W)`` / ``(T, W)``;
* :meth:`RowSpace.visible` — ratio-causal compressed keys per row (indexer kernel order: BSHD b-major / THD);
* :meth:`RowSpace.compressed_ids` — every visible compressed key as a local id (Path A);
* :meth:`RowSpace.compressed_offset` — where compressed keys start in a row's local key space (``[window | comp]``);
* :meth:`RowSpace.to_global` — local ids to flat-global ``kv_full`` ids (``-1`` stays ``-1``);
* :meth:`RowSpace.kernel_kwargs` — the THD varlen keywords of the indexer / dense-loss kernels.

The composition never branches on the packing's values here (a CUDA graph captured on one packing is replayed on
others): every THD quantity is a device tensor; only host ints (``max_seqlen``, capacity) are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .index_maps import causal_visible, compress_idxs_sbhd, window_idxs_sbhd, window_matrix
from .thd import ThdMeta

Tensor = torch.Tensor


@dataclass(frozen=True)
class RowSpace:
    """Flat query rows of one call. SBHD: ``batch``, ``seqlen``; THD: ``thd`` and the per-row tensors (int64 /
    bool, ``(T,)``). Rows past the last boundary (slack) belong to the last segment, with ``inside`` False."""

    rows: int
    device: torch.device
    batch: int = 1
    seqlen: int = 0
    thd: Optional[ThdMeta] = None
    segment: Optional[Tensor] = None    # the row's segment
    offset: Optional[Tensor] = None     # row - padded start of its segment
    inside: Optional[Tensor] = None     # row < last padded boundary
    seg_len: Optional[Tensor] = None    # padded length of the row's segment
    padding: Optional[Tensor] = None    # not a real token (THD); None for SBHD (every row is real)

    @classmethod
    def sbhd(cls, seqlen: int, batch: int, device) -> "RowSpace":
        return cls(rows=seqlen * batch, device=torch.device(device), batch=batch, seqlen=seqlen)

    @classmethod
    def packed(cls, thd: ThdMeta) -> "RowSpace":
        cu = thd.cu.long()
        seg = thd.segment
        rows = torch.arange(thd.total, device=thd.cu.device, dtype=torch.int64)
        offset = rows - cu[seg]
        inside = rows < cu[-1]
        real = inside & (offset < (thd.cu_real.long()[1:] - thd.cu_real.long()[:-1])[seg])
        return cls(rows=thd.total, device=thd.cu.device, thd=thd, segment=seg, offset=offset, inside=inside,
                   seg_len=(thd.cu[1:] - thd.cu[:-1]).long()[seg], padding=~real)

    @property
    def is_thd(self) -> bool:
        return self.thd is not None

    def window_ids(self, window: int) -> Tensor:
        """Local window ids: row at offset ``p`` sees ``[max(0, p-W+1), p]``; ``-1`` past ``p`` and on slack rows."""
        if not self.is_thd:
            return window_idxs_sbhd(window, self.batch, self.seqlen, self.device)
        ids = window_matrix(torch.where(self.inside, self.offset, 0), window)
        return torch.where(self.inside.unsqueeze(-1), ids, torch.full_like(ids, -1)).int()

    def visible(self, ratio: int, n_comp: int, cu_comp: Optional[Tensor] = None) -> Tensor:
        """Ratio-causal compressed keys per row (int64), capped by the segment's compressed count: ``(B*S,)``
        b-major (the indexer kernels' order; ``n_comp`` keys per sequence) or ``(T,)`` (``cu_comp``; 0 on slack)."""
        if not self.is_thd:
            per_q = causal_visible(torch.arange(self.seqlen, device=self.device), ratio).clamp(max=n_comp)
            return per_q.repeat(self.batch)
        n_seg = (cu_comp[1:] - cu_comp[:-1]).long()[self.segment]
        return torch.where(self.inside, torch.minimum(causal_visible(self.offset, ratio), n_seg), 0)

    def compressed_offset(self) -> Union[int, Tensor]:
        """First compressed key in a row's local key space: ``S`` (SBHD: kv rows, then the compressed ones) or the
        row's padded segment length ``(T, 1)`` (THD: per segment, its kv rows then its compressed rows)."""
        return self.seg_len.unsqueeze(-1) if self.is_thd else self.seqlen

    def compressed_ids(self, ratio: int, cu_comp: Optional[Tensor], width: int) -> Tensor:
        """Every ratio-causal compressed key as a local id: ``(B, S, S // r)`` / ``(T, width)``, ``-1`` elsewhere."""
        if not self.is_thd:
            return compress_idxs_sbhd(ratio, self.batch, self.seqlen, self.seqlen, self.device)
        g = torch.arange(width, device=self.device, dtype=torch.int64)
        ids = torch.where(g < self.visible(ratio, width, cu_comp).unsqueeze(-1), g + self.compressed_offset(),
                          torch.full_like(g, -1))
        return ids.int()

    def to_global(self, local: Tensor, cu_keys: Optional[Tensor] = None) -> Tensor:
        """Local ids to flat-global ids (int32, ``-1`` stays ``-1``). SBHD: ``(B, S, K)`` -> ``(S*B, K)``,
        ``local * B + b``. THD: ``(T, K)``, ``cu_keys[segment] + local`` (``cu_keys``: the per-segment key space,
        ``cu_seqlens_kv_full`` for ``kv_full`` or ``cu_seqlens_compressed`` for the compressed keys alone)."""
        if not self.is_thd:
            b, s, k = local.shape
            rows = local.permute(1, 0, 2).reshape(s * b, k)
            batch_ids = (torch.arange(s * b, device=local.device) % b).unsqueeze(-1)
            return torch.where(rows >= 0, rows * b + batch_ids, rows).int()
        offset = cu_keys.long()[self.segment].unsqueeze(-1)
        return torch.where(local >= 0, local + offset, local).int()

    def kernel_kwargs(self, cu_seqlens_k: Optional[Tensor], max_seqlen_k: int) -> dict:
        """The varlen keywords of a THD kernel call (``max_seqlen_*`` are host ints: required); ``{}`` for SBHD."""
        if not self.is_thd:
            return {}
        return dict(cu_seqlens_q=self.thd.cu, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=self.thd.max_seqlen,
                    max_seqlen_k=max_seqlen_k)
