"""RMS norms (spec §1.3, §2): ``y = x * rsqrt(mean(x**2) + eps) [* weight]`` over the last dim.

float64 inputs are normalised in float64; lower precisions are normalised in float32 and rounded back once (as the
TransformerEngine norm and the compiled per-head norm do).
"""

from __future__ import annotations

from typing import Optional

import torch

from .numerics import compute_dtype


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., d]`` with learnable ``weight [d]`` (or none); output in ``x.dtype``."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def head_rms_norm(query: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMS norm of the attention query ``[..., n, D]``, no weight (``_q_rms_norm``)."""
    return rms_norm(query, None, eps)
