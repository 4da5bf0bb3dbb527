"""The eager PyTorch pieces production runs around the kernels on sm90: norms, RoPE / YaRN, Hadamard rotation.

Precision policy (ARCHITECTURE.md): float64 activations compute in float64; otherwise norms, RoPE and the Hadamard
rotation compute in fp32 and round once to the activation dtype, as TE's RMSNorm, the fused RoPE kernel and
``fast_hadamard_transform`` do.
"""

from __future__ import annotations

import functools
import math
from typing import Union

import torch

from cases.config import ModelConfig

Tensor = torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in the activation dtype (no bias anywhere in the layer)."""
    return torch.matmul(x, weight.to(x.dtype).t())


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim, with an optional learnable weight (TENorm / ``_q_rms_norm``)."""
    c = x.to(compute_dtype(x.dtype))
    y = c * torch.rsqrt(c.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(c.dtype)
    return y.to(x.dtype)


# ---- RoPE ---------------------------------------------------------------------------------------------------------
def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


@functools.lru_cache(maxsize=32)
def _inv_freq(rope_dim: int, yarn: bool, base: float, scaling: float, max_pos: int, beta_fast: float,
              beta_slow: float) -> tuple[float, ...]:
    j = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    extra = base ** (-j / rope_dim)
    if not yarn:
        return tuple(extra.tolist())
    low = max(math.floor(_yarn_correction_dim(beta_fast, rope_dim, base, max_pos)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, rope_dim, base, max_pos)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # YaRN: pure rotation (mscale forced to 1), frequencies blended between extrapolation and interpolation
    return tuple((extra / scaling * ramp + extra * (1 - ramp)).tolist())


@functools.lru_cache(maxsize=64)
def _constant(values: tuple, device: torch.device) -> Tensor:
    """A float64 host constant on ``device``, made once: no host-to-device copy inside a CUDA-graph capture."""
    return torch.tensor(values, dtype=torch.float64, device=device)


def inv_freq(config: ModelConfig, device: Union[str, torch.device] = "cpu") -> Tensor:
    """ω_j, j < Dr/2 (float64): plain RoPE for window-only layers, YaRN for compressed layers (spec §1.4)."""
    yarn = config.uses_yarn
    base = config.csa_compress_rotary_base if yarn else config.rotary_base
    return _constant(_inv_freq(config.qk_pos_emb_head_dim, yarn, float(base), float(config.rotary_scaling_factor),
                               int(config.original_max_position_embeddings), float(config.beta_fast),
                               float(config.beta_slow)), torch.device(device))


def apply_rope(x: Tensor, positions: Tensor, config: ModelConfig, *, inverse: bool = False) -> Tensor:
    """Rotate the last ``Dr`` dims of ``x`` pairwise (``(u[2j], u[2j+1])`` by ``positions * ω_j``), out of place.

    ``positions`` broadcasts against ``x.shape[:-1]`` after the caller's reshape (one entry per row; heads share it).
    """
    rope_dim = config.qk_pos_emb_head_dim
    cdt = compute_dtype(x.dtype)
    angle = positions.to(torch.float64).unsqueeze(-1) * inv_freq(config, positions.device)
    cos, sin = torch.cos(angle).to(cdt), torch.sin(angle).to(cdt)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].to(cdt)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


# ---- Hadamard -----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _sylvester(d: int) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=16)
def _sylvester_on(d: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``_sylvester(d)`` on ``device``, made once (no host-to-device copy inside a CUDA-graph capture)."""
    return _sylvester(d).to(device=device, dtype=dtype)


def hadamard(x: Tensor) -> Tensor:
    """``rotate_activation``: Sylvester-ordered Walsh–Hadamard transform of the last dim, scaled by ``d**-0.5``."""
    d = x.shape[-1]
    cdt = compute_dtype(x.dtype)
    return (torch.matmul(x.to(cdt), _sylvester_on(d, x.device, cdt)) * d ** -0.5).to(x.dtype)
