"""Packed THD layout helpers (spec §6.2-§6.4, ``cases/layout.py``).

A packed buffer ``[T, ...]`` holds segments back to back. Segment ``b`` occupies the physical rows
``[cu_seqlens_q_padded[b], cu_seqlens_q_padded[b+1])`` (its padded length ``L_b``); its first
``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` rows are real tokens, the rest alignment padding. Rows past the last padded
boundary are slack. The reference runs each padded segment with the sequence math (positions restart at 0) and
places the rows back; compressed entries of segment ``b`` are ``L_b // r`` rows at ``cu_seqlens_compressed[b]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from cases.errors import CaseError, require
from cases.layout import PackedSeqParams


@dataclass(frozen=True)
class Segment:
    """One packed segment: physical rows ``[start, start + length)``, of which the first ``real_length`` are real."""

    start: int
    length: int
    real_length: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


def _host_list(value, field: str) -> list[int]:
    require(isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= 2, field,
            "must be a 1-D integer tensor with at least two entries")
    require(not value.is_floating_point(), field, f"must be an integer tensor, got {value.dtype}")
    return [int(v) for v in value.tolist()]


def on_host(psp: PackedSeqParams) -> PackedSeqParams:
    """``psp`` with its row offsets (``cu_seqlens_q``, ``cu_seqlens_q_padded``) on the host, read from the device in
    one transfer; ``psp`` itself when they are there already. A packing's segments are host arithmetic: each public
    THD function reads them from the host copy it is handed, so a layer's nested calls wait for the GPU once."""
    names = [n for n in ("cu_seqlens_q", "cu_seqlens_q_padded")
             if isinstance(getattr(psp, n), torch.Tensor) and getattr(psp, n).device.type != "cpu"]
    if not names:
        return psp
    tensors = [getattr(psp, n) for n in names]
    if len({(t.dtype, t.shape) for t in tensors}) == 1:
        host = list(torch.stack(tensors).cpu().unbind(0))
    else:  # malformed metadata: copied apart, for segments() to report
        host = [t.cpu() for t in tensors]
    return dataclasses.replace(psp, **dict(zip(names, host)))


def segments(psp: PackedSeqParams, total_tokens: int) -> list[Segment]:
    """The segments of ``psp`` for a buffer of ``total_tokens`` rows (validated; offsets from the padded bounds)."""
    real = _host_list(psp.cu_seqlens_q, "packed_seq_params.cu_seqlens_q")
    padded_src = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
    padded = _host_list(padded_src, "packed_seq_params.cu_seqlens_q_padded")
    require(len(real) == len(padded), "packed_seq_params.cu_seqlens_q",
            f"has {len(real)} entries but cu_seqlens_q_padded has {len(padded)}")
    for name, cu in (("cu_seqlens_q", real), ("cu_seqlens_q_padded", padded)):
        require(cu[0] == 0, f"packed_seq_params.{name}[0]", f"must be 0, got {cu[0]}")
        for i in range(1, len(cu)):
            require(cu[i] >= cu[i - 1], f"packed_seq_params.{name}[{i}]", f"not monotone: {cu[i]} < {cu[i - 1]}")
    require(padded[-1] <= total_tokens, "packed_seq_params.cu_seqlens_q_padded",
            f"last boundary {padded[-1]} exceeds the {total_tokens} packed rows")
    out = []
    for b in range(len(padded) - 1):
        length, real_length = padded[b + 1] - padded[b], real[b + 1] - real[b]
        require(real_length <= length, "packed_seq_params.cu_seqlens_q",
                f"segment {b} has {real_length} real tokens but only {length} padded rows")
        out.append(Segment(padded[b], length, real_length))
    return out


def token_positions(segs: Sequence[Segment], total_tokens: int, device=None) -> torch.Tensor:
    """Position of every packed row within its segment (``t - cu_padded[b]``); slack rows get 0. int64 ``[T]``."""
    pos = torch.zeros(total_tokens, dtype=torch.int64)
    for s in segs:
        pos[s.rows] = torch.arange(s.length)
    return pos.to(device)


def real_row_mask(segs: Sequence[Segment], total_tokens: int, device=None) -> torch.Tensor:
    """bool ``[T]``: True on real rows, False on alignment padding and slack."""
    mask = torch.zeros(total_tokens, dtype=torch.bool)
    for s in segs:
        mask[s.start: s.start + s.real_length] = True
    return mask.to(device)


def num_real_rows(segs: Sequence[Segment]) -> int:
    return sum(s.real_length for s in segs)


def _pieces_from_row_0(packed: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive views of ``sizes`` rows of ``packed`` from row 0 (the rows after them left out), cut by one
    ``split``: for a tensor that carries a gradient, backward joins the pieces' gradients in one ``cat``, where a slice
    per piece makes each piece's gradient a zero-filled copy of the whole tensor and adds them up. Pieces that run
    past ``packed``'s rows are sliced one by one (their short pieces are what callers report)."""
    end = sum(sizes)
    if end > packed.shape[0]:
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        return [packed[start: start + n] for start, n in zip(starts, sizes)]
    return list(packed.split(list(sizes) + [packed.shape[0] - end], dim=0))[:len(sizes)]


def segment_rows(packed: torch.Tensor, segs: Sequence[Segment]) -> list[torch.Tensor]:
    """Each segment's rows of ``packed [T, ...]`` (views, ``packed[s.rows]``), cut by one ``split``
    (:func:`_pieces_from_row_0`). Segments that do not tile ``[0, end)`` in order are sliced one by one (same
    values either way)."""
    ends = [s.start + s.length for s in segs]
    if [s.start for s in segs] != [0] + ends[:-1]:
        return [packed[s.rows] for s in segs]
    return _pieces_from_row_0(packed, [s.length for s in segs])


def cu_seqlens_compressed(segs: Sequence[Segment], ratio: int) -> list[int]:
    """``[0, cumsum(L_b // ratio)]`` over the padded segment lengths."""
    out = [0]
    for s in segs:
        out.append(out[-1] + (s.length // ratio if ratio > 1 else 0))
    return out


def place_rows(pieces: Sequence[torch.Tensor], total_tokens: int, fill_value: float,
               like: torch.Tensor) -> torch.Tensor:
    """Concatenate per-segment row blocks (which tile ``[0, cu_padded[-1])``) and append slack rows of ``fill_value``.

    ``like``: an empty ``[0, ...]`` tensor giving the trailing shape, dtype and device of a row.
    """
    used = sum(p.shape[0] for p in pieces)
    slack = like.new_full((total_tokens - used,) + tuple(like.shape[1:]), fill_value)
    return torch.cat(list(pieces) + [slack], dim=0)


def capacity_fill(rows: int, like: torch.Tensor) -> torch.Tensor:
    """Contents of the unused capacity rows of a packed compressed buffer (unspecified: zeros here).

    Tests replace this function with one returning huge random values to show that no real result reads them.
    """
    return like.new_zeros((rows,) + tuple(like.shape[1:]))


def pack_compressed(pieces: Sequence[torch.Tensor], capacity: Optional[int], ratio: int, segs: Sequence[Segment],
                    like: torch.Tensor) -> torch.Tensor:
    """Concatenate per-segment compressed rows; pad to ``capacity`` rows (if given) with :func:`capacity_fill`."""
    true_rows = cu_seqlens_compressed(segs, ratio)[-1]
    if capacity is None:
        capacity = true_rows
    if capacity < true_rows:
        raise CaseError("packed_seq_params.total_comp_capacity",
                        f"{capacity} rows cannot hold the {true_rows} compressed rows of ratio {ratio}")
    return torch.cat(list(pieces) + [capacity_fill(capacity - true_rows, like)], dim=0)


def segment_compressed(packed: torch.Tensor, segs: Sequence[Segment], ratio: int) -> list[torch.Tensor]:
    """Split a packed compressed buffer back into each segment's rows (ignoring the capacity tail); views, cut by one
    ``split`` (:func:`_pieces_from_row_0`)."""
    cu = cu_seqlens_compressed(segs, ratio)
    return _pieces_from_row_0(packed, [cu[b + 1] - cu[b] for b in range(len(segs))])
