"""Diagnostic: production's float32 islands promoted to float64 (``DSV4_MEGATRON_PROMOTE=1``).

Production computes parts of a float64 run in float32 (RoPE ``inv_freq`` and the YaRN ramp, ``.float()`` attention /
indexer / loss math, ``attn_sink.to(float32)``, ``dtype=torch.float32`` buffers). Inside :func:`promoted`, a
``TorchFunctionMode`` rewrites exactly those requests while a float64 case runs: ``Tensor.float()`` of a float64
tensor stays float64, ``.to(torch.float32)`` / ``dtype=torch.float32`` (factories, ``softmax``, ...) become float64.
Megatron's code is untouched; with the islands promoted production matches the float64 reference to rounding, which
shows the float32-level differences of a normal float64 run are the islands and nothing else.

The precision declaration follows: with the mode on, float64 cases are judged at float64 level.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

ENV = "DSV4_MEGATRON_PROMOTE"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _wide(value):
    return torch.float64 if value is torch.float32 else value


class _Promote(TorchFunctionMode):
    """float32 requests -> float64 (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float and args and args[0].dtype == torch.float64:
            return args[0]
        if "dtype" in kwargs:
            kwargs["dtype"] = _wide(kwargs["dtype"])
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(_wide(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def promoted(active: bool) -> Iterator[None]:
    """Promote the islands inside the block when ``active`` (a float64 case with the diagnostic on)."""
    if not active:
        yield
        return
    with _Promote():
        yield
