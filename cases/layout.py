"""Token layouts: BSHD (``[B, S, ...]``) and packed THD (``[T, ...]``), spec §6.

THD conventions (Megatron ``PackedSeqParams`` / TransformerEngine):
    * ``cu_seqlens_padded`` ([N+1], int) are the physical segment boundaries in the packed buffer. **Every** offset
      (RoPE positions, window, compressor blocks, compressed ids, kv_full) is computed from them.
    * ``cu_seqlens`` ([N+1], int) are cumulative *real* lengths: segment ``b`` has ``cu_seqlens[b+1]-cu_seqlens[b]``
      real tokens, stored at physical rows ``[cu_seqlens_padded[b], cu_seqlens_padded[b] + real_len_b)``. The rest of
      the padded segment is alignment padding: those rows still compute (garbage) outputs, but they are excluded from
      the loss and carry no gradient.
    * Repeating the last entry of both arrays adds zero-length segments (``cu_seqlens`` padded to a fixed capacity).
    * ``total_tokens`` ≥ ``cu_seqlens_padded[-1]``: rows past the last boundary are buffer slack ("orphan" rows): no
      keys, output 0, no gradient.
    * Compressed rows: segment ``b`` contributes ``floor(L_b / r)`` rows, ``L_b`` its *padded* length;
      ``cu_seqlens_compressed = [0, cumsum(...)]``. ``compressed_capacity`` (host-known, CUDA-graph static shapes) may
      exceed the true count ``cu_seqlens_compressed[-1]``; the extra rows are garbage no valid index reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch

from .errors import CaseError, require


@dataclass(frozen=True)
class BshdLayout:
    """Dense batch: ``batch`` sequences of ``seq_len`` tokens, tensors ``[B, S, ...]``."""

    batch: int
    seq_len: int

    kind = "bshd"

    def validate(self, prefix: str = "layout") -> "BshdLayout":
        for name in ("batch", "seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0, f"{prefix}.{name}",
                    f"must be a positive integer, got {value!r}")
        return self

    @property
    def num_tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def max_seqlen(self) -> int:
        return self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "bshd", "batch": self.batch, "seq_len": self.seq_len}


@dataclass(frozen=True)
class ThdLayout:
    """Packed segments in one ``[T, ...]`` buffer (see the module docstring for the conventions)."""

    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]
    total_tokens: int
    compressed_capacity: Optional[int] = None

    kind = "thd"

    # ---- validation -----------------------------------------------------------------------------------------------
    def validate(self, prefix: str = "layout") -> "ThdLayout":
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            values = getattr(self, name)
            field = f"{prefix}.{name}"
            require(isinstance(values, tuple) and len(values) >= 2, field, "needs at least two entries [0, ...]")
            for i, v in enumerate(values):
                require(isinstance(v, int) and not isinstance(v, bool), f"{field}[{i}]", f"must be an integer, got {v!r}")
            require(values[0] == 0, f"{field}[0]", f"must start at 0, got {values[0]}")
            for i in range(1, len(values)):
                require(values[i] >= values[i - 1], f"{field}[{i}]",
                        f"not monotone: {values[i]} < {values[i - 1]}")
        require(len(self.cu_seqlens) == len(self.cu_seqlens_padded), f"{prefix}.cu_seqlens",
                f"has {len(self.cu_seqlens)} entries but cu_seqlens_padded has {len(self.cu_seqlens_padded)}")
        for b in range(self.num_segments):
            real, padded = self.real_lengths[b], self.padded_lengths[b]
            require(real <= padded, f"{prefix}.cu_seqlens",
                    f"segment {b} has {real} real tokens but only {padded} padded rows")
        t = self.total_tokens
        require(isinstance(t, int) and not isinstance(t, bool) and t > 0, f"{prefix}.total_tokens",
                f"must be a positive integer, got {t!r}")
        require(t >= self.cu_seqlens_padded[-1], f"{prefix}.total_tokens",
                f"buffer of {t} rows is shorter than the last boundary {self.cu_seqlens_padded[-1]}")
        cap = self.compressed_capacity
        require(cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0),
                f"{prefix}.compressed_capacity", f"must be null or a non-negative integer, got {cap!r}")
        return self

    def validate_for_ratio(self, ratio: int, prefix: str = "layout") -> None:
        """Capacity must hold every true compressed row of this ratio."""
        if ratio > 1 and self.compressed_capacity is not None:
            true_rows = self.cu_seqlens_compressed(ratio)[-1]
            require(self.compressed_capacity >= true_rows, f"{prefix}.compressed_capacity",
                    f"{self.compressed_capacity} rows cannot hold the {true_rows} compressed rows of ratio {ratio}")

    # ---- derived host-side metadata -----------------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        return len(self.cu_seqlens_padded) - 1

    @property
    def num_tokens(self) -> int:
        return self.total_tokens

    @property
    def real_lengths(self) -> tuple[int, ...]:
        c = self.cu_seqlens
        return tuple(c[b + 1] - c[b] for b in range(len(c) - 1))

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        c = self.cu_seqlens_padded
        return tuple(c[b + 1] - c[b] for b in range(len(c) - 1))

    @property
    def max_seqlen(self) -> int:
        """Largest padded segment length (Megatron's host ``max_seqlen_q``), at least 1."""
        return max(max(self.padded_lengths, default=0), 1)

    def compressed_lengths(self, ratio: int) -> tuple[int, ...]:
        return tuple(L // ratio for L in self.padded_lengths) if ratio > 1 else tuple(0 for _ in self.padded_lengths)

    def cu_seqlens_compressed(self, ratio: int) -> tuple[int, ...]:
        out = [0]
        for n in self.compressed_lengths(ratio):
            out.append(out[-1] + n)
        return tuple(out)

    def row_kinds(self) -> list[str]:
        """Per physical row: ``"real"``, ``"pad"`` (alignment padding inside a segment) or ``"slack"``."""
        kinds = ["slack"] * self.total_tokens
        for b in range(self.num_segments):
            start = self.cu_seqlens_padded[b]
            for pos in range(self.padded_lengths[b]):
                kinds[start + pos] = "real" if pos < self.real_lengths[b] else "pad"
        return kinds

    def real_row_mask(self, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        return torch.tensor([k == "real" for k in self.row_kinds()], dtype=torch.bool, device=device)

    @property
    def num_real_rows(self) -> int:
        return sum(self.real_lengths)

    def packed_seq_params(self, ratio: int = 0, device: Union[str, torch.device] = "cpu") -> "PackedSeqParams":
        return PackedSeqParams(
            cu_seqlens_q=torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device),
            cu_seqlens_q_padded=torch.tensor(self.cu_seqlens_padded, dtype=torch.int32, device=device),
            max_seqlen_q=self.max_seqlen,
            total_comp_capacity=self.compressed_capacity,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "thd", "cu_seqlens": list(self.cu_seqlens), "cu_seqlens_padded": list(self.cu_seqlens_padded),
                "total_tokens": self.total_tokens, "compressed_capacity": self.compressed_capacity}


Layout = Union[BshdLayout, ThdLayout]


@dataclass
class PackedSeqParams:
    """Runtime THD metadata handed to ``attention_layer`` / ``core_attention`` (Megatron's ``PackedSeqParams``).

    ``cu_seqlens_q`` / ``cu_seqlens_q_padded`` are int32 ``[N+1]`` tensors on the compute device (self-attention:
    the kv ones are the same tensors). ``max_seqlen_q`` is a host int (required by the kernels). A CUDA-graph replay
    may overwrite the cu tensors in place with another packing of the same capacity.
    ``total_comp_capacity``: host-known compressed-row capacity, or None for the exact count.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    max_seqlen_q: int
    total_comp_capacity: Optional[int] = None
    qkv_format: str = "thd"

    @property
    def cu_seqlens_kv(self) -> torch.Tensor:
        return self.cu_seqlens_q

    @property
    def cu_seqlens_kv_padded(self) -> torch.Tensor:
        return self.cu_seqlens_q_padded

    @property
    def max_seqlen_kv(self) -> int:
        return self.max_seqlen_q


def layout_from_dict(data: Mapping[str, Any], prefix: str = "layout") -> Layout:
    if not isinstance(data, Mapping):
        raise CaseError(prefix, f"must be an object, got {type(data).__name__}")
    kind = data.get("kind")
    fields = {"bshd": {"kind", "batch", "seq_len"},
              "thd": {"kind", "cu_seqlens", "cu_seqlens_padded", "total_tokens", "compressed_capacity"}}
    if not isinstance(kind, str) or kind not in fields:
        raise CaseError(f"{prefix}.kind", f"must be 'bshd' or 'thd', got {kind!r}")
    unknown = sorted(set(data) - fields[kind])
    if unknown:
        raise CaseError(f"{prefix}.{unknown[0]}", f"unknown field for a {kind} layout")
    if kind == "bshd":
        for name in ("batch", "seq_len"):
            if name not in data:
                raise CaseError(f"{prefix}.{name}", "missing required field")
        return BshdLayout(batch=data["batch"], seq_len=data["seq_len"]).validate(prefix)
    for name in ("cu_seqlens", "total_tokens"):
        if name not in data:
            raise CaseError(f"{prefix}.{name}", "missing required field")
    for name in ("cu_seqlens", "cu_seqlens_padded"):
        if name in data and not isinstance(data[name], (list, tuple)):
            raise CaseError(f"{prefix}.{name}", f"must be a list of integers, got {type(data[name]).__name__}")
    cu = tuple(data["cu_seqlens"])
    return ThdLayout(cu_seqlens=cu, cu_seqlens_padded=tuple(data.get("cu_seqlens_padded", cu)),
                     total_tokens=data["total_tokens"],
                     compressed_capacity=data.get("compressed_capacity")).validate(prefix)
