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

import functools
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


# ---- one host transfer ---------------------------------------------------------------------------------------------
def fetch(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{name: float(value)}`` of 0-d tensors in ONE host transfer per device: on CUDA every ``float(t)`` is a
    device sync, so the metrics of a tensor are reduced on its device first and read back together. float64 holds
    every value exactly (counts up to 2**53 included)."""
    if not values:
        return {}
    per_device: dict[torch.device, list[str]] = {}
    for name, value in values.items():
        per_device.setdefault(value.device, []).append(name)
    read: dict[str, float] = {}
    for names in per_device.values():  # one transfer per device (one in a run: its tensors share a device)
        stacked = torch.stack([values[n].detach().reshape(()).to(torch.float64) for n in names])
        read.update(zip(names, stacked.tolist()))
    return {name: read[name] for name in values}


class _Truth:
    """The reference ``r``'s own intermediates, made once and shared by every pair compared with it (the
    implementation's and the noise run's): ``|r|``, ``max|r|``, ``Σr²`` and ``mean(r²)`` (of one ``r²``), ``‖r‖`` —
    each the very tensor the single metric computes, so sharing it changes no value."""

    def __init__(self, r: torch.Tensor):
        self.r = r

    @functools.cached_property
    def abs(self) -> torch.Tensor:
        return self.r.abs()

    @functools.cached_property
    def abs_max(self) -> torch.Tensor:
        return self.abs.max()

    @functools.cached_property
    def _square_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        square = self.r.pow(2)  # not kept: only its sum and mean are (a tensor of r's size less held by a compare)
        return square.sum(), square.mean()

    @property
    def square_sum(self) -> torch.Tensor:
        return self._square_stats[0]

    @property
    def square_mean(self) -> torch.Tensor:
        return self._square_stats[1]

    @functools.cached_property
    def norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self.r)


class _Pair:
    """``a`` vs ``r`` with their elementwise intermediates and maxima made once (``|d| = |a - r|``, ``max|d|``;
    ``r``'s own in ``truth``, which pairs against the same ``r`` share): the reductions of a metric set share them,
    each the very tensor the single metric computes.

    Only ``|d|`` is kept, made in place over ``a - r``: ``Σd²`` and ``‖d‖`` are the same numbers from ``|d|``
    (``(-x)² = x²`` exactly, the same elements in the same layout), and one tensor of the compared size fewer is
    held — the comparison's peak memory is set by its largest tensor's intermediates."""

    def __init__(self, a: torch.Tensor, r: torch.Tensor, truth: Optional[_Truth] = None):
        self.a, self.r = a, r
        self.truth = truth if truth is not None else _Truth(r)

    @functools.cached_property
    def ad(self) -> torch.Tensor:
        return (self.a - self.r).abs_()

    def release(self) -> None:
        """Make ``max|d|`` (kept) and drop ``|d|``: a pair whose reductions are all made holds no tensor of the
        compared size any more."""
        _ = self.ad_max
        self.__dict__.pop("ad", None)

    @property
    def ar(self) -> torch.Tensor:
        return self.truth.abs

    @functools.cached_property
    def ad_max(self) -> torch.Tensor:
        return self.ad.max()

    @property
    def ar_max(self) -> torch.Tensor:
        return self.truth.abs_max


def _reductions(x: _Pair, *names: str) -> dict[str, torch.Tensor]:
    """The named 0-d reductions of ``x.a`` vs ``x.r`` on their device (not yet read back), for non-empty tensors.

    ``err_max = max|a-r|``, ``ref_max = max|r|``, ``rel_max`` (max ``|a-r|/|r|`` where ``|r| >= 1e-3·max|r|``, 0
    elsewhere: ratios are >= 0 and the largest ``|r|`` always counts, so the maximum is that of the kept elements),
    ``rmse``, ``norm_diff = ‖a-r‖``, ``norm_a``, ``norm_r``, ``dot = Σ a·r``, ``squares = Σa² + Σr²``."""
    a, r = x.a, x.r
    out = {}
    for name in names:
        if name == "err_max":
            out[name] = x.ad_max
        elif name == "ref_max":
            out[name] = x.ar_max
        elif name == "rel_max":
            keep = x.ar >= MAX_REL_FLOOR * x.ar_max  # a maximum: exact in any layout, so filled in place
            out[name] = (x.ad / x.ar).masked_fill_(keep.logical_not_(), 0.0).max()
        elif name == "rmse":
            out[name] = x.ad.pow(2).mean().sqrt()
        elif name == "norm_diff":
            out[name] = torch.linalg.vector_norm(x.ad)
        elif name == "norm_a":
            out[name] = torch.linalg.vector_norm(a)
        elif name == "norm_r":
            out[name] = x.truth.norm
        elif name == "dot":
            out[name] = (a * r).sum()
        elif name == "squares":
            out[name] = a.pow(2).sum() + x.truth.square_sum
        else:
            raise KeyError(name)
    return out


def _read(a: torch.Tensor, r: torch.Tensor, *names: str) -> dict[str, float]:
    """:func:`_reductions` read back (one transfer); all 0.0 for empty tensors."""
    if not a.numel():
        return dict.fromkeys(names, 0.0)
    return fetch(_reductions(_Pair(a, r), *names))


# ---- plain error metrics: the scalar rule of each, from its read-back reductions --------------------------------------
MAX_REL_FLOOR = 1e-3


def _max_rel(v: dict) -> float:
    if v["ref_max"] == 0.0:
        return 0.0 if v["err_max"] == 0.0 else math.inf
    return v["rel_max"]


def _rel_l2(v: dict) -> float:
    num, den = v["norm_diff"], v["norm_r"]
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _cosine(v: dict) -> float:
    na, nr = v["norm_a"], v["norm_r"]
    if na == 0.0 and nr == 0.0:
        return 1.0
    if na == 0.0 or nr == 0.0:
        return 0.0
    return v["dot"] / (na * nr)


def _tensor_sim(v: dict) -> float:
    if v["squares"] == 0.0:
        return 1.0
    return 2.0 * v["dot"] / v["squares"]


def _scale_error(v: dict) -> float:
    na, nr = v["norm_a"], v["norm_r"]
    if nr == 0.0:
        return 0.0 if na == 0.0 else math.inf
    return abs(na / nr - 1.0)


def max_abs(a: torch.Tensor, r: torch.Tensor) -> float:
    return _read(a, r, "err_max")["err_max"]


def max_rel(a: torch.Tensor, r: torch.Tensor) -> float:
    """``max |a - r| / |r|`` over elements with ``|r| >= 1e-3 · max|r|`` (near-zeros would dominate)."""
    return _max_rel(_read(a, r, "err_max", "ref_max", "rel_max"))


def rmse(a: torch.Tensor, r: torch.Tensor) -> float:
    return _read(a, r, "rmse")["rmse"]


def rel_l2(a: torch.Tensor, r: torch.Tensor) -> float:
    """``‖a - r‖ / ‖r‖`` (0 when both are 0, inf when only ``r`` is)."""
    return _rel_l2(_read(a, r, "norm_diff", "norm_r"))


def cosine(a: torch.Tensor, r: torch.Tensor) -> float:
    """Cosine similarity; 1 for two all-zero tensors, 0 when exactly one is zero (an all-zero gradient fails)."""
    return _cosine(_read(a, r, "norm_a", "norm_r", "dot"))


def tensor_sim(a: torch.Tensor, r: torch.Tensor) -> float:
    """Megatron's scale-sensitive similarity ``2⟨a,r⟩ / (‖a‖² + ‖r‖²)``; 1 for two all-zero tensors."""
    return _tensor_sim(_read(a, r, "dot", "squares"))


def scale_error(a: torch.Tensor, r: torch.Tensor) -> float:
    """``|‖a‖/‖r‖ - 1|``: first order in a systematic scale bias, ~noise/√N for unbiased noise."""
    return _scale_error(_read(a, r, "norm_a", "norm_r"))


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


def _noise_floor_reductions(x: _Pair, ref: _Pair, dtype: torch.dtype, ulps: float, per_element: bool,
                            scalar_ulps: float, atol: float) -> dict[str, torch.Tensor]:
    """The device side of :func:`noise_floor_ratio` (non-empty tensors; ``x`` = ``a`` vs ``r``, ``ref`` = ``p`` vs
    ``r``): ``den = max|p-r| + ulps·eps·max|r| + atol`` (summed in this order like the scalar rule), ``err_max``, and
    with ``per_element`` the per-element ``ratio_max`` / ``den_min``."""
    r, err = x.r, x.ad
    den = ref.ad_max + ulps * eps(dtype) * x.ar_max + atol
    out = {"den": den, "err_max": x.ad_max}
    if per_element:
        dens = den + scalar_ulps * ulp(r, dtype)
        out["ratio_max"] = (err / dens).masked_fill_(err == 0, 0.0).max()  # 0/0 where both are 0
        out["den_min"] = dens.min()
    return out


def _noise_floor_ratio(v: dict, per_element: bool) -> tuple[float, float]:
    if per_element:
        return v["ratio_max"], v["den_min"]
    if v["den"] == 0.0:
        return (0.0 if v["err_max"] == 0.0 else math.inf), 0.0
    return v["err_max"] / v["den"], v["den"]


def noise_floor_ratio(a: torch.Tensor, r: torch.Tensor, p: torch.Tensor, dtype: torch.dtype, ulps: float,
                      per_element: bool = False, scalar_ulps: float = 0.0, atol: float = 0.0) -> tuple[float, float]:
    """``(ratio, floor)``: the implementation's max error in units of the noise floor (module docstring).

    ``floor = max|p - r| + ulps·eps·max|r| + atol``. With ``per_element`` each element also gets
    ``scalar_ulps · ulp(|r_i|)`` on top (never stricter than the tensor-wide rule); ``floor`` then reports the
    smallest per-element value.
    """
    if not a.numel():
        return 0.0, 0.0
    v = fetch(_noise_floor_reductions(_Pair(a, r), _Pair(p, r), dtype, ulps, per_element, scalar_ulps, atol))
    return _noise_floor_ratio(v, per_element)


def ratio_to_floor(value: float, ref_value: float, floor: float) -> float:
    """``value / (ref_value + floor)`` with 0/0 = 0: an aggregate metric in units of the noise run's own one."""
    den = ref_value + floor
    if den == 0.0:
        return 0.0 if value == 0.0 else math.inf
    return value / den


def frac_outside(a: torch.Tensor, r: torch.Tensor, tolerance) -> float:
    """Fraction of elements whose error exceeds ``tolerance`` (the noise-floor unit; a float or a 0-d tensor)."""
    if not a.numel():
        return 0.0
    return float(_frac_outside(_Pair(a, r), tolerance))


def _frac_outside(x: _Pair, tolerance) -> torch.Tensor:
    return (x.ad > tolerance).double().mean()


#: the reductions :func:`reductions` makes of both pairs (``a.*`` the implementation's, ``p.*`` the noise run's)
_BOTH_PAIRS = ("err_max", "rmse", "norm_a", "norm_r", "dot", "squares")


def compute(a: torch.Tensor, r: torch.Tensor, p: Optional[torch.Tensor], dtype: torch.dtype, ulps: float,
            per_element: bool = False, scalar_ulps: float = 0.0, scale_floor: float = 0.25,
            atol: float = 0.0, also: Optional[dict] = None) -> dict[str, float]:
    """Every metric of ``a`` vs the float64 truth ``r`` (and the noise run ``p``; ``None`` means ``p = r``).

    ``dtype`` is the working precision whose epsilon sizes the floors; ``ulps`` the tensor-wide ULP floor,
    ``scalar_ulps`` the per-element allowance (with ``per_element``), ``scale_floor`` the free systematic scale bias
    in units of epsilon, ``atol`` an absolute floor. Keys: ``max_abs max_rel rmse rel_l2 cosine tensor_sim
    frac_outside noise_floor_ratio ref_error ulp_floor rmse_ratio ref_rmse scale_error scale_ratio ref_scale_error
    ref_cosine ref_tensor_sim``. ``a``, ``r``, ``p`` must be finite float64 tensors of one shape (the caller counts
    and removes non-finite elements).

    Every reduction is made on the tensors' device and read back in ONE transfer (:func:`fetch`), with the values of
    the single metrics above (same float64 operations, same order). ``also``: further 0-d tensors of the caller (e.g.
    NaN counts) that ride along that transfer; they come back as floats under their own keys. A caller judging many
    tensors makes :func:`reductions` of each and reads them all in one transfer, then :func:`from_reductions`.
    """
    device = reductions(a, r, p, dtype, ulps, per_element, scalar_ulps, atol, also)
    return from_reductions(fetch(device), a.numel(), dtype, ulps, per_element, scale_floor, atol, also)


def reductions(a: torch.Tensor, r: torch.Tensor, p: Optional[torch.Tensor], dtype: torch.dtype, ulps: float,
               per_element: bool = False, scalar_ulps: float = 0.0, atol: float = 0.0,
               also: Optional[dict] = None, owned: tuple = (False, False, False)) -> dict[str, torch.Tensor]:
    """The device side of :func:`compute`: its 0-d reductions (and ``also``), not yet read back. ``owned``: which
    of ``a``, ``r``, ``p`` are the caller's own copies, which the ``atol`` clamp may then overwrite in place (the
    same values in the same layout, one tensor of their size fewer held each)."""
    if p is None:
        p, owned = r, owned[:2] + (False,)
    if atol > 0:  # magnitudes below atol are underflow noise: an exactly-zero reference is matched by 1e-46
        a, r, p = (x.masked_fill_(x.abs() <= atol, 0.0) if mine
                   else torch.where(x.abs() <= atol, torch.zeros_like(x), x)  # a copy in x's layout
                   for x, mine in zip((a, r, p), owned))
    both = _BOTH_PAIRS
    device: dict[str, torch.Tensor] = dict(also or {})
    if a.numel():
        mine = _Pair(a, r)
        ref = _Pair(p, r, mine.truth)  # the same r: its |r|, r², Σr², ‖r‖ made once
        # the noise run's pair first, its |p - r| dropped once reduced (the floor needs only its maximum): at most
        # |r|, one |d| and one temporary of the compared size are held at a time
        device.update({f"p.{k}": v for k, v in _reductions(ref, *both).items()})
        ref.release()
        device.update({f"a.{k}": v for k, v in _reductions(mine, *both, "ref_max", "rel_max", "norm_diff").items()})
        device.update({f"nf.{k}": v for k, v in _noise_floor_reductions(mine, ref, dtype, ulps, per_element,
                                                                        scalar_ulps, atol).items()})
        device["rms_r"] = mine.truth.square_mean.sqrt()
        # frac_outside's tolerance is the noise-floor unit: ref_error + floor + atol (nf.den, summed in that order)
        device["frac_outside"] = _frac_outside(mine, device["nf.den"])
        del mine, ref  # the intermediates
    return device


def from_reductions(values: dict[str, float], numel: int, dtype: torch.dtype, ulps: float,
                    per_element: bool = False, scale_floor: float = 0.25, atol: float = 0.0,
                    also: Optional[dict] = None) -> dict[str, float]:
    """The host side of :func:`compute`: its metrics from the read-back ``values`` of :func:`reductions` for
    tensors of ``numel`` elements (the same arguments)."""
    values = dict(values)
    both = _BOTH_PAIRS
    if not numel:  # empty: every reduction is 0 (the single metrics' convention)
        names = [f"{w}.{k}" for w in "ap" for k in both] + ["a.ref_max", "a.rel_max", "a.norm_diff", "rms_r",
                                                             "frac_outside", "nf.den", "nf.err_max"]
        values.update(dict.fromkeys(names, 0.0))
    mine = {k[2:]: v for k, v in values.items() if k.startswith("a.")}
    ref = {k[2:]: v for k, v in values.items() if k.startswith("p.")}
    nf = {k[3:]: v for k, v in values.items() if k.startswith("nf.")}
    floor = ulps * eps(dtype) * mine["ref_max"]
    nfr = _noise_floor_ratio(nf, per_element)[0] if numel else 0.0
    out = {
        "max_abs": mine["err_max"],
        "max_rel": _max_rel(mine),
        "rmse": mine["rmse"],
        "rel_l2": _rel_l2(mine),
        "cosine": _cosine(mine),
        "tensor_sim": _tensor_sim(mine),
        "noise_floor_ratio": nfr,
        "ref_error": ref["err_max"],
        "ulp_floor": floor,
        "ref_rmse": ref["rmse"],
        "scale_error": _scale_error(mine),
        "ref_scale_error": _scale_error(ref),
        "ref_cosine": _cosine(ref),
        "ref_tensor_sim": _tensor_sim(ref),
    }
    rms_floor = ulps * eps(dtype) * values["rms_r"]
    out["rmse_ratio"] = ratio_to_floor(out["rmse"], out["ref_rmse"], rms_floor + atol)
    # a systematic scale bias below scale_floor·eps is free: unbiased rounding moves the norm far less than that
    out["scale_ratio"] = ratio_to_floor(out["scale_error"], out["ref_scale_error"], scale_floor * eps(dtype))
    out["frac_outside"] = values["frac_outside"]
    out.update({k: values[k] for k in (also or {})})
    return out
