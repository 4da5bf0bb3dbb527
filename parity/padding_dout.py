"""The padding-row output-gradient contract: THD padding rows pass no gradient (ARCHITECTURE.md, "Padding rows").

An implementation run with a non-zero output gradient ``dO`` on padding rows (alignment padding, dummy tail, slack
past the last boundary) must give **bit-identical** results to the same run with ``dO`` zeroed there: every
gradient in full (padding rows of the input gradients included) and, on real rows, every forward tensor. The check
is structural, not numeric: a masking implementation never reads those values, so no rounding can differ; any
difference is a leak, whatever its size.

Used twice: by ``dsv4-parity run`` on every case whose ``dO`` is non-zero on some padding row (the implementation
is run a second time with it zeroed; the result is tensor ``contract/padding_dout``, rule ``contract``, so a leak
is never mistaken for a numerics difference), and by the ``padding-dout`` metamorphic oracle (a huge random ``dO``
on every padding row vs none, per tensor).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cases.tensors import CaseTensors

from .snapshot import Snapshot, is_row_tensor, real_rows

TENSOR = "contract/padding_dout"


def padding_dout_nonzero(tensors: CaseTensors) -> bool:
    """Whether ``dO`` is non-zero on some non-real row."""
    mask = tensors.real_rows
    if bool(mask.all()):
        return False
    return bool((real_rows(tensors.grad_output, ~mask) != 0).any())


def without_padding_dout(tensors: CaseTensors) -> CaseTensors:
    """The same tensors with ``dO`` zeroed on non-real rows."""
    mask = tensors.real_rows.reshape(tensors.real_rows.shape + (1,) * (tensors.grad_output.dim()
                                                                       - tensors.real_rows.dim()))
    zeroed = torch.where(mask.to(tensors.grad_output.device), tensors.grad_output,
                         torch.zeros((), dtype=tensors.grad_output.dtype, device=tensors.grad_output.device))
    return dataclasses.replace(tensors, grad_output=zeroed)


def compared(name: str, x: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """What the contract compares of tensor ``name``: gradients in full, other row tensors on real rows only."""
    if x is None or name.startswith("grad/") or not is_row_tensor(name):
        return x
    return real_rows(x, mask)


def differences(poisoned: Snapshot, clean: Snapshot, mask: torch.Tensor) -> list[tuple[str, int, float]]:
    """``(tensor, elements that differ, max |difference|)`` for each tensor that is not bit-identical."""
    out = []
    for name in dict.fromkeys(clean.names + poisoned.names):
        a, b = compared(name, poisoned[name], mask), compared(name, clean[name], mask)
        if a is None and b is None:
            continue
        if a is None or b is None:
            present = a if a is not None else b
            if name.startswith("grad/") and not bool((present != 0).any()):
                continue  # no gradient and an all-zero one are the same value
            out.append((name, int(present.numel()), float("inf")))
            continue
        a, b = a.detach().cpu(), b.detach().cpu()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
        n_diff = int((~same).sum())
        if n_diff:
            d = (a.double() - b.double()).abs()
            out.append((name, n_diff, float(d[~same].nan_to_num(float("inf")).max())))
    return out


def verdict_message(diffs: list[tuple[str, int, float]]) -> str:
    """One line naming the first leaked tensor (empty when none)."""
    if not diffs:
        return ""
    name, n, err = diffs[0]
    more = f" (+{len(diffs) - 1} more tensors)" if len(diffs) > 1 else ""
    return (f"{TENSOR}: the output gradient on padding rows changed {name} ({n} elements, max |diff| {err:.3g}){more}"
            f"; padding rows must pass no gradient")


__all__ = ["TENSOR", "compared", "differences", "padding_dout_nonzero", "verdict_message", "without_padding_dout"]
