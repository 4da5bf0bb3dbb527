"""The padding-row output-gradient contract: THD padding rows pass no gradient (ARCHITECTURE.md, "Padding rows").

Two checks of it, both structural (no tolerance: a masking implementation never reads those values):

* ``dsv4-parity run``, on every case whose ``dO`` is non-zero on some padding row (alignment padding, dummy tail,
  slack past the last boundary: core scope, and ``padding_dout="poison"`` cases): the implementation runs once
  more with ``dO`` **zeroed on the real rows** (kept on the padding rows) and the indexer loss left out of the
  objective. Gradients are linear in ``dO``, so what that run returns is exactly what the padding rows leak: every
  gradient must be exactly 0 (or absent). Sums of zeros are zero in any order, so this holds bitwise even for
  kernels that accumulate non-deterministically (the cuDNN sparse backward on sm90). Tensor
  ``contract/padding_dout``, rule ``contract``: a leak is reported as a contract violation, never as a numerics
  difference.
* the ``padding-dout`` metamorphic oracle (:mod:`parity.oracles.metamorphic`): a huge random ``dO`` on every padding row vs
  none, every real-row result bit-identical (:func:`compared` says what is compared).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cases.tensors import CaseTensors

from parity.judge.snapshot import Snapshot, is_row_tensor, read_flags, real_rows

TENSOR = "contract/padding_dout"


def padding_dout_nonzero(tensors: CaseTensors) -> bool:
    """Whether ``dO`` is non-zero on some non-real row."""
    mask = tensors.real_rows
    if bool(mask.all()):
        return False
    return bool((real_rows(tensors.grad_output, ~mask) != 0).any())


def padding_dout_only(tensors: CaseTensors) -> CaseTensors:
    """The same tensors with ``dO`` zeroed on the real rows (its padding rows kept)."""
    dout = tensors.grad_output
    mask = tensors.real_rows.reshape(tensors.real_rows.shape + (1,) * (dout.dim() - tensors.real_rows.dim()))
    zeroed = torch.where(mask.to(dout.device), torch.zeros((), dtype=dout.dtype, device=dout.device), dout)
    return dataclasses.replace(tensors, grad_output=zeroed)


def compared(name: str, x: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """What the oracle compares of tensor ``name``: gradients in full, other row tensors on real rows only."""
    if x is None or name.startswith("grad/") or not is_row_tensor(name):
        return x
    return real_rows(x, mask)


def leaks(snapshot: Snapshot) -> list[tuple[str, int, float]]:
    """``(gradient, non-zero elements, max |value|)`` of each gradient of a padding-dO-only run that is not all 0."""
    grads = {name: snapshot[name].detach() for name in snapshot.names
             if name.startswith("grad/") and snapshot[name] is not None}
    flags = read_flags({name: (g != 0).any() for name, g in grads.items()})  # NaN counts; one wait for the GPU
    out = []
    for name, g in grads.items():
        if flags[name]:
            nonzero = g != 0
            out.append((name, int(nonzero.sum()), float(g.double().abs().nan_to_num(float("inf")).max())))
    return out


def verdict_message(found: list[tuple[str, int, float]]) -> str:
    """One line naming the first leaking gradient (empty when none)."""
    if not found:
        return ""
    name, n, size = found[0]
    more = f" (+{len(found) - 1} more gradients)" if len(found) > 1 else ""
    return (f"{TENSOR}: the output gradient of the padding rows alone reaches {name} ({n} non-zero elements, "
            f"max |g| {size:.3g}){more}; padding rows must pass no gradient")


__all__ = ["TENSOR", "compared", "leaks", "padding_dout_nonzero", "padding_dout_only", "verdict_message"]
