"""Rotary position embedding of DSv4 hybrid attention (spec §1.4).

* Partial: only the **last** ``Dr`` dims of a head vector rotate; the leading ``d - Dr`` ("nope") dims pass through.
* Pair-interleaved: with ``u = x[..., d-Dr:]``, the pair ``(u[2j], u[2j+1])`` rotates by ``phi_j = p * omega_j``::

      u'[2j]   = u[2j] cos phi - u[2j+1] sin phi
      u'[2j+1] = u[2j] sin phi + u[2j+1] cos phi

* Inverse: the same with ``sin -> -sin``. No magnitude scaling (mscale is 1).
* Frequencies: plain RoPE ``omega_j = base**(-2j/Dr)`` for window-only layers (r = 0, ``rotary_base``); YaRN for
  compressed layers (r > 1, ``csa_compress_rotary_base``): a linear ramp over ``j`` blends the original frequency
  (``j <= low``) into the frequency divided by ``rotary_scaling_factor`` (``j >= high``).

Angles and cos/sin are evaluated in float64 and then cast to the activation dtype, so the rotation itself runs in
the activation dtype.
"""

from __future__ import annotations

import functools
import math

import torch

from cases.config import ModelConfig


def plain_inv_freq(dim: int, base: float) -> torch.Tensor:
    """``omega_j = base**(-2j/dim)`` for ``j = 0 .. dim/2 - 1`` (float64, CPU)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return 1.0 / (base ** exponents)


def yarn_correction_dim(num_rotations: float, dim: int, base: float, original_max_position: int) -> float:
    """The (fractional) pair index whose wavelength fits ``num_rotations`` times into the original context."""
    return dim * math.log(original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp(dim: int, base: float, original_max_position: int, beta_fast: float, beta_slow: float) -> torch.Tensor:
    """Blend weight ``ramp_j`` in [0, 1] of the interpolated frequency, for ``j = 0 .. dim/2 - 1`` (float64)."""
    low = max(math.floor(yarn_correction_dim(beta_fast, dim, base, original_max_position)), 0)
    high = min(math.ceil(yarn_correction_dim(beta_slow, dim, base, original_max_position)), dim - 1)
    if low == high:
        high += 0.001  # production's guard against a zero-width ramp
    j = torch.arange(dim // 2, dtype=torch.float64)
    return ((j - low) / (high - low)).clamp(0.0, 1.0)


def yarn_inv_freq(dim: int, base: float, scaling_factor: float, original_max_position: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """YaRN frequencies: ``omega_j = extra_j * (1 - ramp_j) + (extra_j / scaling_factor) * ramp_j`` (float64)."""
    extra = plain_inv_freq(dim, base)
    ramp = yarn_ramp(dim, base, original_max_position, beta_fast, beta_slow)
    return extra / scaling_factor * ramp + extra * (1.0 - ramp)


@functools.lru_cache(maxsize=None)
def layer_inv_freq(config: ModelConfig, device=None) -> torch.Tensor:
    """The layer's frequencies (float64, on ``device``; default the CPU): YaRN with ``csa_compress_rotary_base`` iff
    ``compress_ratio > 1``, else plain RoPE.

    The same table serves Q, K, the inverse on O, both compressors (at positions ``g*r``) and the indexer query. A
    constant of the config, made once per ``(config, device)`` (read-only: no caller writes to it), so a rotation on
    the GPU copies no table from the host.
    """
    c = config
    if c.uses_yarn:
        freq = yarn_inv_freq(c.qk_pos_emb_head_dim, c.csa_compress_rotary_base, c.rotary_scaling_factor,
                             c.original_max_position_embeddings, c.beta_fast, c.beta_slow)
    else:
        freq = plain_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base)
    return freq.to(device) if device is not None else freq


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``Dr = 2 * len(inv_freq)`` dims of ``x`` pair-interleaved (spec §1.4).

    ``x``: ``[..., d]``; ``positions``: integer or float tensor broadcastable to ``x.shape[:-1]`` (e.g. ``[B, S, 1]``
    for ``x = [B, S, n, d]``). Returns a new tensor of the shape and dtype of ``x``.
    """
    rope_dim = 2 * inv_freq.numel()
    # split / unbind, not slices: backward then joins the pieces' gradients once instead of zero-filling a copy of x
    # for each slice (same values)
    nope, u = x.split([x.shape[-1] - rope_dim, rope_dim], dim=-1)
    angles = positions.to(device=x.device, dtype=torch.float64).unsqueeze(-1) * inv_freq.to(x.device)
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    if inverse:
        sin = -sin
    even, odd = u.unflatten(-1, (-1, 2)).unbind(-1)  # u[..., 0::2], u[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)
