"""Host/device metadata of one packed (THD) call, derived once from ``PackedSeqParams`` as production does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cases.errors import CaseError
from cases.layout import PackedSeqParams

from .index_maps import batch_of_row

Tensor = torch.Tensor


@dataclass(frozen=True)
class ThdMeta:
    """``cu``: the **padded** boundaries (every offset uses them); ``cu_real``: real lengths (masking only);
    ``total``: packed rows; ``max_seqlen``: host int; ``capacity``: host compressed-row capacity or None;
    ``segment``: the segment of each of the ``total`` rows (int64, looked up once; slack rows: the last segment)."""

    cu: Tensor
    cu_real: Tensor
    total: int
    max_seqlen: int
    capacity: Optional[int]
    segment: Tensor

    @classmethod
    def from_params(cls, psp: PackedSeqParams, total: int) -> "ThdMeta":
        if psp.max_seqlen_q is None:
            raise CaseError("packed_seq_params.max_seqlen_q",
                            "is required for THD (a host int; production never reads cu_seqlens on the host)")
        cu = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
        for name, t in (("cu_seqlens_q", psp.cu_seqlens_q), ("cu_seqlens_q_padded", cu)):
            if t.dtype != torch.int32 or t.ndim != 1:
                raise CaseError(f"packed_seq_params.{name}", f"must be a 1-D int32 tensor, got {t.dtype} "
                                                             f"{tuple(t.shape)}")
        return cls(cu=cu, cu_real=psp.cu_seqlens_q, total=int(total), max_seqlen=int(psp.max_seqlen_q),
                   capacity=None if psp.total_comp_capacity is None else int(psp.total_comp_capacity),
                   segment=batch_of_row(cu, int(total)))

    def positions(self) -> Tensor:
        """RoPE position of every row: its offset from its padded segment's start (restarts per segment)."""
        rows = torch.arange(self.total, device=self.cu.device)
        return rows - self.cu.long()[self.segment]

    def compressor_boundaries(self) -> Tensor:
        """The boundaries the compressors segment the pack by: the **padded** ones (a segment's blocks start at its
        padded start, like every other offset; the real boundaries only mark padding rows)."""
        return self.cu

    def num_real_rows(self) -> int:
        return int(self.cu_real[-1])

    def real_row_count(self) -> Tensor:
        """Number of real rows as a 0-d fp32 device tensor, at least 1 (the mean divisor; no host read)."""
        return self.cu_real[-1].clamp(min=1).float()
