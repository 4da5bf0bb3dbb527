"""Shared plumbing of the GPU kernel providers (``cudnn``, ``flashmla``): device checks for
``check_support``, and the zero-cost padding production applies around the kernels.

Padding never changes the result: padded heads get zero queries (and zero indexer weights, an LSE of ``+inf`` or a
sink of ``-inf``) so they add nothing to any sum over heads, and padded index slots hold ``-1`` (with scores 0)
so no kernel reads them. Everything here is shape arithmetic or device-side work: no host synchronisation, so the
providers stay CUDA-graph capturable.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

Tensor = torch.Tensor

#: Compute-capability majors the cudnn-frontend 1.32.0 DSA wrappers and sgl-flash-mla dispatch kernels for:
#: 9 = Hopper (sm90a), 10 = datacenter Blackwell (sm100 family).
KERNEL_MAJORS = (9, 10)


def cuda_unavailable_reason() -> Optional[str]:
    """``None`` if a CUDA device of a supported architecture is current, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if major not in KERNEL_MAJORS:
        return f"the kernels are built for sm90 / sm100, this device is sm{major}{minor}"
    return None


def device_major(t: Tensor) -> int:
    return torch.cuda.get_device_capability(t.device)[0]


def on_device(t: Tensor):
    """``torch.cuda.device(t.device)`` for a CUDA tensor (the wrappers pick their kernel from the current device),
    a no-op context otherwise."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def placement_reason(*tensors: Optional[Tensor]) -> Optional[str]:
    """Why these tensors cannot go to a CUDA kernel (not on CUDA, mixed devices, unsupported arch), or None."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    device = present[0].device
    if device.type != "cuda":
        return f"inputs are on {device}, the kernel needs CUDA tensors"
    if any(t.device != device for t in present):
        return f"inputs on several devices: {sorted({str(t.device) for t in present})}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in KERNEL_MAJORS:
        return f"no kernel for sm{major}{minor} (built for sm90 / sm100)"
    return None


def dtype_reason(name: str, t: Optional[Tensor], allowed: tuple) -> Optional[str]:
    if t is None or t.dtype in allowed:
        return None
    names = " or ".join(str(d).replace("torch.", "") for d in allowed)
    return f"{name} must be {names}, got {str(t.dtype).replace('torch.', '')}"


def first_reason(*reasons: Optional[str]) -> Optional[str]:
    return next((r for r in reasons if r), None)


# ---- padding ------------------------------------------------------------------------------------------------------
def round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple


def pad_dim(t: Tensor, dim: int, size: int, value: float = 0.0) -> Tensor:
    """``t`` extended along ``dim`` to ``size`` entries filled with ``value`` (``t`` itself if already that long)."""
    dim = dim % t.dim()
    extra = size - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def into(dst: Optional[Tensor], value: Tensor) -> Tensor:
    """Caller-provided output buffer semantics: copy into ``dst`` when given, else return ``value``."""
    if dst is None or dst is value:
        return value
    return dst.copy_(value)
