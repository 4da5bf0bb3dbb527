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
import contextvars
import os
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

ENV = "DSV4_MEGATRON_PROMOTE"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _wide(value):
    return torch.float64 if value is torch.float32 else value


_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_promote", default=False)


class _Promote(TorchFunctionMode):
    """float32 requests -> float64 while :func:`float64_case` is active (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not _ACTIVE.get():
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float and args and args[0].dtype == torch.float64:
            return args[0]
        if "dtype" in kwargs:
            kwargs["dtype"] = _wide(kwargs["dtype"])
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(_wide(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def mode() -> Iterator[None]:
    """The promoting mode for a provider block (forward and backward), when the diagnostic is on; it acts only while
    :func:`float64_case` marks a float64 case."""
    if not enabled():
        yield
        return
    with _Promote():
        yield


@contextlib.contextmanager
def float64_case(active: bool) -> Iterator[None]:
    """Mark the block as a float64 case's production call (build and forward; the backward follows the mark set
    for the whole provider block by :func:`mark`)."""
    token = _ACTIVE.set(bool(active and enabled()))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def mark(active: bool) -> None:
    """Set the mark for the rest of the provider block (the backward runs after the forward's context closed)."""
    _ACTIVE.set(bool(active and enabled()))
