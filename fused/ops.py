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
    cdt = compute_dtype(x.dtype)
    angle = positions.to(torch.float64).unsqueeze(-1) * inv_freq(config, positions.device)
    turn = torch.complex(torch.cos(angle).to(cdt), torch.sin(angle).to(cdt))
    return _Rotate.apply(x, turn.conj() if inverse else turn)


def _rotate(x: Tensor, turn: Tensor) -> Tensor:
    """A copy of ``x`` whose last ``2 * turn.shape[-1]`` dims, read as pairs ``(re, im)``, are multiplied by the unit
    complex numbers ``turn`` (``cos + i sin``) in ``turn``'s precision and rounded once to ``x.dtype``."""
    rope_dim = 2 * turn.shape[-1]
    out = torch.empty_like(x)
    out[..., :-rope_dim] = x[..., :-rope_dim]
    pairs = x[..., -rope_dim:].to(turn.real.dtype).contiguous().unflatten(-1, (-1, 2))
    out[..., -rope_dim:] = torch.view_as_real(torch.view_as_complex(pairs) * turn).flatten(-2)
    return out


class _Rotate(torch.autograd.Function):
    """RoPE as one op each way: the gradient of a rotation is the inverse rotation of the gradient (``turn`` ->
    its conjugate), so the backward is one more :func:`_rotate` instead of the slice / stack / cat / cast chain
    autograd would build."""

    @staticmethod
    def forward(ctx, x: Tensor, turn: Tensor) -> Tensor:
        ctx.save_for_backward(turn)
        return _rotate(x, turn)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (turn,) = ctx.saved_tensors
        return _rotate(grad, turn.conj()), None


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
    return _Hadamard.apply(x)


def _transform(x: Tensor) -> Tensor:
    """``(x @ H) * d**-0.5`` accumulated in fp32 (float64 for float64), rounded once to ``x.dtype``.

    On CUDA, 16-bit ``x`` goes straight into a 16-bit GEMM whose epilogue applies the scale to the fp32 accumulator
    and rounds once to ``x.dtype``: ``H`` is ±1, so every product is exact and the sums are fp32 as in the fp32 GEMM
    (only their order differs), with no fp32 copy of ``x`` or of the result. Split-K partial sums are kept in fp32
    (cuBLAS may otherwise reduce them in 16 bits).
    """
    d = x.shape[-1]
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        flags = torch.backends.cuda.matmul
        previous = flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction
        flags.allow_bf16_reduced_precision_reduction = flags.allow_fp16_reduced_precision_reduction = False
        try:
            y = torch.addmm(x.new_empty(()), x.reshape(-1, d), _sylvester_on(d, x.device, x.dtype), beta=0,
                            alpha=d ** -0.5)
        finally:
            flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = previous
        return y.view(x.shape)
    cdt = compute_dtype(x.dtype)
    return torch.matmul(x.to(cdt), _sylvester_on(d, x.device, cdt)).mul_(d ** -0.5).to(x.dtype)


class _Hadamard(torch.autograd.Function):
    """``H`` is symmetric, so the gradient of ``x H c`` is ``g H c``: the same transform, one GEMM each way."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return _transform(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _transform(grad)
