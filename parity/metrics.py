"""Error metrics of one tensor against a float64 reference, all computed in float64 (on the device the tensors are
on: :func:`as_f64` moves to the CPU, :func:`upcast` keeps the device, so a GPU run compares on the GPU).

Notation: ``a`` is the implementation's tensor, ``r`` the float64 reference ("truth") and ``p`` the reference run in
the implementation's own dtype (the *noise-floor* run, FlashAttention's ``out_pt``). Every function takes tensors
of the same shape that the caller has already restricted to the compared elements (real rows, finite scores) and
upcast with :func:`as_f64`.

The noise-floor ratio (FlashAttention's rule, spec parity-anchors §2.2, §12)::

    noise_floor_ratio = max|a - r| / (max|p - r| + ulp_floor)

``ulp_floor = ulps · eps(dtype) · max|r|`` is a few units in the last place of the largest reference element, so a
float64 case (where ``p`` *is* ``r``) and a tensor the low-precision reference happens to get exactly right still
have a non-zero, dtype-sized floor; ``dtype`` is the case's working precision (an fp32 sink gradient of a bf16 case
carries bf16 error). A tiny ``atol`` absorbs underflow noise where the reference is exactly zero. Scalar-like
tensors (a per-head sink gradient, the loss) get FA4's dSink allowance per element on top::

    noise_floor_ratio = max_i |a_i - r_i| / (max|p - r| + ulp_floor + atol + scalar_ulps · ulp(|r_i|))
"""

from __future__ import annotations

import math
from typing import Optional

import torch

EPS = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def eps(dtype: torch.dtype) -> float:
    """Spacing of 1.0 in ``dtype`` (machine epsilon)."""
    return EPS.get(dtype, 2.0 ** -52)


def as_f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float64)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64 on its own device (a CUDA run's comparisons stay on the GPU)."""
    return x.detach().to(dtype=torch.float64)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element spacing of ``dtype`` at ``|x|`` (``2**floor(log2|x|) · eps``; the smallest normal for 0)."""
    tiny = torch.finfo(dtype).tiny if dtype.is_floating_point else 2.0 ** -1022
    mag = x.abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * eps(dtype)


# ---- plain error metrics ---------------------------------------------------------------------------------------------
def max_abs(a: torch.Tensor, r: torch.Tensor) -> float:
    return float((a - r).abs().max()) if a.numel() else 0.0


def max_rel(a: torch.Tensor, r: torch.Tensor, floor_fraction: float = 1e-3) -> float:
    """``max |a - r| / |r|`` over elements with ``|r| >= floor_fraction · max|r|`` (near-zeros would dominate)."""
    if not a.numel():
        return 0.0
    scale = float(r.abs().max())
    if scale == 0.0:
        return 0.0 if float((a - r).abs().max()) == 0.0 else math.inf
    keep = r.abs() >= floor_fraction * scale
    return float(((a - r).abs()[keep] / r.abs()[keep]).max())


def rmse(a: torch.Tensor, r: torch.Tensor) -> float:
    return float((a - r).pow(2).mean().sqrt()) if a.numel() else 0.0


def rel_l2(a: torch.Tensor, r: torch.Tensor) -> float:
    """``‖a - r‖ / ‖r‖`` (0 when both are 0, inf when only ``r`` is)."""
    num, den = float(torch.linalg.vector_norm(a - r)), float(torch.linalg.vector_norm(r))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def cosine(a: torch.Tensor, r: torch.Tensor) -> float:
    """Cosine similarity; 1 for two all-zero tensors, 0 when exactly one is zero (an all-zero gradient fails)."""
    na, nr = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(r))
    if na == 0.0 and nr == 0.0:
        return 1.0
    if na == 0.0 or nr == 0.0:
        return 0.0
    return float((a * r).sum()) / (na * nr)


def tensor_sim(a: torch.Tensor, r: torch.Tensor) -> float:
    """Megatron's scale-sensitive similarity ``2⟨a,r⟩ / (‖a‖² + ‖r‖²)``; 1 for two all-zero tensors."""
    den = float(a.pow(2).sum() + r.pow(2).sum())
    if den == 0.0:
        return 1.0
    return 2.0 * float((a * r).sum()) / den


def scale_error(a: torch.Tensor, r: torch.Tensor) -> float:
    """``|‖a‖/‖r‖ - 1|``: first order in a systematic scale bias, ~noise/√N for unbiased noise."""
    na, nr = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(r))
    if nr == 0.0:
        return 0.0 if na == 0.0 else math.inf
    return abs(na / nr - 1.0)


def mixed_error(a: torch.Tensor, r: torch.Tensor) -> float:
    """``max |a - r| / (1 + |r|)``: absolute below ``|r| = 1``, relative above (an ``atol = rtol`` test's metric)."""
    return float(((a - r).abs() / (1 + r.abs())).max()) if a.numel() else 0.0


def nan_count(x: torch.Tensor) -> int:
    return int(torch.isnan(x).sum()) if x.is_floating_point() else 0


# ---- noise-floor metrics ---------------------------------------------------------------------------------------------
def ulp_floor(r: torch.Tensor, dtype: torch.dtype, ulps: float) -> float:
    """``ulps · eps(dtype) · max|r|``: the tensor-wide absolute floor."""
    if not r.numel():
        return 0.0
    return ulps * eps(dtype) * float(r.abs().max())


def noise_floor_ratio(a: torch.Tensor, r: torch.Tensor, p: torch.Tensor, dtype: torch.dtype, ulps: float,
                      per_element: bool = False, scalar_ulps: float = 0.0, atol: float = 0.0) -> tuple[float, float]:
    """``(ratio, floor)``: the implementation's max error in units of the noise floor (module docstring).

    ``floor = max|p - r| + ulps·eps·max|r| + atol``. With ``per_element`` each element also gets
    ``scalar_ulps · ulp(|r_i|)`` on top (never stricter than the tensor-wide rule); ``floor`` then reports the
    smallest per-element value.
    """
    if not a.numel():
        return 0.0, 0.0
    den = max_abs(p, r) + ulp_floor(r, dtype, ulps) + atol
    err = (a - r).abs()
    if per_element:
        dens = den + scalar_ulps * ulp(r, dtype)
        ratio = torch.where(err == 0, torch.zeros_like(err), err / dens)
        return float(ratio.max()), float(dens.min())
    if den == 0.0:
        return (0.0 if float(err.max()) == 0.0 else math.inf), 0.0
    return float(err.max()) / den, den


def ratio_to_floor(value: float, ref_value: float, floor: float) -> float:
    """``value / (ref_value + floor)`` with 0/0 = 0: an aggregate metric in units of the noise run's own one."""
    den = ref_value + floor
    if den == 0.0:
        return 0.0 if value == 0.0 else math.inf
    return value / den


def frac_outside(a: torch.Tensor, r: torch.Tensor, tolerance: float) -> float:
    """Fraction of elements whose error exceeds ``tolerance`` (the noise-floor unit)."""
    if not a.numel():
        return 0.0
    return float(((a - r).abs() > tolerance).double().mean())


def compute(a: torch.Tensor, r: torch.Tensor, p: Optional[torch.Tensor], dtype: torch.dtype, ulps: float,
            per_element: bool = False, scalar_ulps: float = 0.0, scale_floor: float = 0.25,
            atol: float = 0.0) -> dict[str, float]:
    """Every metric of ``a`` vs the float64 truth ``r`` (and the noise run ``p``; ``None`` means ``p = r``).

    ``dtype`` is the working precision whose epsilon sizes the floors; ``ulps`` the tensor-wide ULP floor,
    ``scalar_ulps`` the per-element allowance (with ``per_element``), ``scale_floor`` the free systematic scale bias
    in units of epsilon, ``atol`` an absolute floor. Keys: ``max_abs max_rel rmse rel_l2 cosine tensor_sim
    frac_outside noise_floor_ratio ref_error ulp_floor rmse_ratio ref_rmse scale_error scale_ratio ref_scale_error
    ref_cosine ref_tensor_sim``. ``a``, ``r``, ``p`` must be finite float64 tensors of one shape (the caller counts
    and removes non-finite elements).
    """
    p = r if p is None else p
    if atol > 0:  # magnitudes below atol are underflow noise: an exactly-zero reference is matched by 1e-46
        a, r, p = (torch.where(x.abs() <= atol, torch.zeros_like(x), x) for x in (a, r, p))
    floor = ulp_floor(r, dtype, ulps)
    nfr, _ = noise_floor_ratio(a, r, p, dtype, ulps, per_element, scalar_ulps, atol)
    out = {
        "max_abs": max_abs(a, r),
        "max_rel": max_rel(a, r),
        "rmse": rmse(a, r),
        "rel_l2": rel_l2(a, r),
        "cosine": cosine(a, r),
        "tensor_sim": tensor_sim(a, r),
        "noise_floor_ratio": nfr,
        "ref_error": max_abs(p, r),
        "ulp_floor": floor,
        "ref_rmse": rmse(p, r),
        "scale_error": scale_error(a, r),
        "ref_scale_error": scale_error(p, r),
        "ref_cosine": cosine(p, r),
        "ref_tensor_sim": tensor_sim(p, r),
    }
    rms_floor = ulps * eps(dtype) * (float(r.pow(2).mean().sqrt()) if r.numel() else 0.0)
    out["rmse_ratio"] = ratio_to_floor(out["rmse"], out["ref_rmse"], rms_floor + atol)
    # a systematic scale bias below scale_floor·eps is free: unbiased rounding moves the norm far less than that
    out["scale_ratio"] = ratio_to_floor(out["scale_error"], out["ref_scale_error"], scale_floor * eps(dtype))
    out["frac_outside"] = frac_outside(a, r, out["ref_error"] + floor + atol)
    return out
