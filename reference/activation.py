"""Sign-split: the indexer's ``ReLU(qI·kI)`` differentiated at a given activation pattern (parity's split mode), and
score-split: the indexer KL differentiated at the implementation's index scores.

``ReLU``'s derivative jumps at 0. A bf16 implementation computes ``qI·kI`` from rounded ``qI``/``kI``, so for the
products within its rounding error of 0 the *sign* it sees is a coin toss, and each flipped product moves an indexer
gradient by a whole term ``σI·w·g·k`` (or ``·q``). To compare only arithmetic, parity runs the reference with the
implementation's pattern (``active [rows, nI, n_comp]``: ``qI·kI > 0`` as the implementation saw it), the way split
mode hands it the implementation's top-k.

The pattern is only *adopted where the sign is ambiguous*: where the reference's own product satisfies
``|qI·kI| <= window · sqrt(Σ_i qI_i² kI_i²)`` (``window`` = ULPs × the case dtype's epsilon; the square root is the
scale of the rounding error of a dot product whose terms each carry a relative error). Elsewhere the reference keeps
its own sign, so a wrong pattern cannot move the reference by more than a few near-zero products. The forward value
stays ``ReLU(qI·kI)`` of the reference: only the derivative takes the pattern.

Score-split (``scores`` given): the KL's gradient with respect to the indexer scores is ``Σ_s T[s] · softmax(I) - T``,
evaluated at the forward scores. With few rows that see two compressed keys every indexer gradient is a multiple of a
handful of ``softmax(I) - T`` differences, which cancel (``I ≈ 0.8`` with ``I_0 - I_1 ≈ 0.06``, ``q ≈ T ≈ 0.5`` with
``q - T ≈ 0.05``): a bf16 forward rounding of ``I`` is amplified ~20x into the gradient, as one random draw per run,
and the noise run's draw then sets the noise floor. With ``scores`` (the implementation's, compared on their own as
``index_scores``) the reference's ``log_softmax`` of the student takes its derivative at ``softmax(scores)``
(:func:`log_softmax_at`); its forward value, the loss, stays the reference's own. Only the backward's arithmetic
and the teacher remain in the indexer gradients' noise floor.

Usage (outside the public API, whose signatures mirror ``fused``)::

    with use_activation_pattern(active, window, scores) as handle:
        out = reference.attention_layer(...)      # or core_attention
        ... backward ...
    handle.record   # {"relu_adopted": products whose derivative took the pattern, "relu_rejected": disagreements
                    #  outside the window (kept the reference's own sign), "relu_window_usage": the largest
                    #  |qI·kI| / (window · scale) among the disagreements}
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


@dataclass
class ActivationPattern:
    """``active``: bool ``[B, S, nI, n_comp]`` (BSHD) or ``[T, nI, width]`` (THD, by local compressed id), the
    implementation's ``qI·kI > 0``; ``window``: the ambiguity half-width in units of ``sqrt(Σ qI_i² kI_i²)``;
    ``scores``: the implementation's index scores ``[B, S, n_comp]`` / ``[T, width]`` (score-split), or None."""

    active: torch.Tensor
    window: float
    scores: Optional[torch.Tensor] = None
    record: dict = field(default_factory=lambda: {"relu_adopted": 0, "relu_rejected": 0, "relu_window_usage": 0.0})

    def rows(self, rows: slice, n_comp: int) -> "ActivationPattern":
        """The pattern of one THD segment as a B=1 sequence ``[1, s, nI, n_comp]`` (scores ``[1, s, n_comp]``),
        sharing this record."""
        scores = None if self.scores is None else self.scores[rows][None, ..., :n_comp]
        return ActivationPattern(self.active[rows][None, ..., :n_comp], self.window, scores, self.record)


_PATTERN: contextvars.ContextVar[Optional[ActivationPattern]] = contextvars.ContextVar("relu_pattern", default=None)


@contextlib.contextmanager
def use_activation_pattern(active: torch.Tensor, window: float,
                           scores: Optional[torch.Tensor] = None) -> Iterator[ActivationPattern]:
    """Differentiate the indexer's ReLU at ``active`` (where ambiguous) and, with ``scores``, the indexer KL at those
    scores inside the block; yields the pattern, whose ``record`` counts what was adopted."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if scores is not None and tuple(scores.shape) != tuple(active.shape[:-2]) + tuple(active.shape[-1:]):
        raise ValueError(f"scores has shape {tuple(scores.shape)}, expected the pattern's without its head axis "
                         f"{tuple(active.shape[:-2]) + tuple(active.shape[-1:])}")
    pattern = ActivationPattern(active.detach().to(torch.bool), float(window),
                                None if scores is None else scores.detach())
    token = _PATTERN.set(pattern)
    try:
        yield pattern
    finally:
        _PATTERN.reset(token)
        _read_back(pattern.record)


def _read_back(record: dict) -> None:
    """The record's counters as Python numbers. :func:`relu` accumulates them on the device (a ``float()`` per row
    block would wait for the device every time); they are read back here, once."""
    live = [k for k, v in record.items() if isinstance(v, torch.Tensor)]
    if live:
        values = torch.stack([record[k].to(torch.float64) for k in live]).tolist()
        record.update({k: int(v) if k != "relu_window_usage" else v for k, v in zip(live, values)})


def current_pattern() -> Optional[ActivationPattern]:
    return _PATTERN.get()


def _recomputing() -> bool:
    """True while autograd's backward runs (``numerics.per_block`` recomputes the block then: count once)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _ReluAtSlope(torch.autograd.Function):
    """``ReLU(x)`` forward, ``grad · slope`` backward (``slope`` a 0/1 tensor like ``x``)."""

    @staticmethod
    def forward(ctx, x, slope):
        ctx.save_for_backward(slope)
        return torch.relu(x)

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return grad * slope, None


def relu(dots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, active: Optional[torch.Tensor], window: float,
         record: Optional[dict] = None, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``ReLU(dots)`` with ``dots = q @ k^T`` (``q [B, s, nI, dI]``, ``k [B, 1, n_comp, dI]``); with ``active``
    (bool like ``dots``) its derivative takes ``active`` where ``|dots|`` is within the window (module docstring).
    ``record`` counts the differing products where ``counted`` (bool, broadcast like ``dots``: the causally valid
    ones, whose score is used) holds; its counters stay 0-d device tensors until :func:`use_activation_pattern`
    reads them back on exit."""
    if active is None:
        return torch.relu(dots)
    with torch.no_grad():
        own = dots > 0
        scale = torch.sqrt(q.square().to(k.dtype) @ k.square().transpose(-1, -2))
        ambiguous = dots.abs() <= window * scale
        differ = (active != own) if counted is None else (active != own) & counted
        if record is not None and not _recomputing() and dots.numel():  # read back at the end (_read_back)
            record["relu_adopted"] = record["relu_adopted"] + (differ & ambiguous).sum()
            record["relu_rejected"] = record["relu_rejected"] + (differ & ~ambiguous).sum()
            # how far from 0 the farthest disagreement is, in windows (0 without one)
            usage = dots.abs() / (window * scale).clamp_min(torch.finfo(scale.dtype).tiny)
            farthest = torch.where(differ, usage, torch.zeros_like(usage)).max().to(torch.float64)
            so_far = record["relu_window_usage"]
            so_far = so_far if isinstance(so_far, torch.Tensor) else torch.full_like(farthest, so_far)
            record["relu_window_usage"] = torch.fmax(so_far, farthest)
        slope = torch.where(ambiguous, active, own).to(dots.dtype)
    return _ReluAtSlope.apply(dots, slope)


class _LogSoftmaxAt(torch.autograd.Function):
    """``log_softmax(x)`` forward; backward the derivative of ``log_softmax`` at ``at``: ``g - softmax(at) · Σ g``."""

    @staticmethod
    def forward(ctx, x, at):
        ctx.save_for_backward(torch.softmax(at, dim=-1))
        return torch.log_softmax(x, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        (prob,) = ctx.saved_tensors
        return grad - prob * grad.sum(dim=-1, keepdim=True), None


def log_softmax_at(x: torch.Tensor, at: Optional[torch.Tensor]) -> torch.Tensor:
    """``log_softmax(x, -1)`` whose derivative is taken at ``at`` (score-split; like ``x``, same ``-inf`` entries).
    Entries where ``at`` is not finite but ``x`` is take ``x``'s own value. ``at`` None: plain ``log_softmax``."""
    if at is None:
        return torch.log_softmax(x, dim=-1)
    with torch.no_grad():
        at = at.to(x.dtype)
        at = torch.where(torch.isfinite(at) | ~torch.isfinite(x), at, x)
    return _LogSoftmaxAt.apply(x, at)
