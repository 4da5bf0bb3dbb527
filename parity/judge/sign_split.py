"""Sign-split: the implementation's indexer activation pattern, handed to the reference runs (spec §3, §5.3).

The indexer gradients come only through ``ReLU(qI·kI)``. Where bf16 rounding puts a product within its rounding
error of 0, the sign an implementation sees is a coin toss and the derivative jumps there: one flipped product
moves a gradient by a whole term. Split mode already hands the reference the implementation's top-k; sign-split
hands it the implementation's ReLU pattern too, so only arithmetic error remains to be judged.

The pattern is *observed*, through the implementation's public API only: for each indexer head ``h``, one
eval-mode forward of the case's own entry point (``attention_layer`` / ``core_attention``, ``training=False``, in
the implementation's provider context) with every row of ``core_attention.indexer.linear_weights_proj.weight``
but row ``h`` set to 0. Its ``index_scores`` are then ``wI[t, h] · σI · ReLU(qI[t, h]·kI[s])``, computed from the
implementation's own ``qI`` / ``kI`` (its own query latent in layer scope), so ``score != 0`` is exactly its
``qI[t, h]·kI[s] > 0`` wherever ``wI[t, h] != 0`` (where it is 0 the product sends no gradient anyway).

A case whose implementation also exposes the public ``indexer`` (same signature as the reference's) is probed
through it, since the scores are the indexer's alone and the attention the case's forward also runs is most of its
work. A core case hands it its own ``q_latent``; a layer case the implementation's own, from its public
``query_latent`` (what its layer hands the core attention; an implementation without it keeps the layer forward).
Head 0 alone and then every head at once are observed both ways first, and only if both pairs of
``index_scores`` agree bit for bit do the other heads go through ``indexer``; otherwise (or if ``indexer`` or
``query_latent`` raises) the case's forward observes them. ``Pattern.probe`` names the entry point that observed
heads 1...

The reference adopts the pattern only where its own product is within ``window_ulps`` × the case dtype's epsilon
(× the dot's rounding scale) of 0 (:mod:`reference.activation`), so a wrong pattern cannot hide a real error.
float64 cases (no rounding to speak of), eval cases and cases without an indexer loss skip it; so do cases whose
pattern (rows × heads × compressed ids booleans) exceeds ``max_elements``.

Score-split rides along: the pattern carries the implementation's ``index_scores`` (its forward output, compared on
its own), and the reference differentiates the indexer KL at them (:func:`reference.activation.log_softmax_at`).
The gradient of the KL is ``softmax(I) - T``; where few rows see two compressed keys, it cancels to a few percent
of its terms, so each run's bf16 forward rounding of ``I`` (one random draw) becomes a few-percent
scale error of every indexer gradient, and the noise run's draw set the floor (gate e7f61d0aa0bb: 3.4%, against
0.58% with score-split). With the scores split, the floor is the backward's arithmetic and the teacher's rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

from cases.case import Case
from cases.tensors import CaseTensors

WEIGHTS = "core_attention.indexer.linear_weights_proj.weight"


@dataclass(frozen=True)
class Pattern:
    """An observed pattern, the reference's ambiguity window for it (case-dtype eps × ``window_ulps``), and the
    implementation's index scores for score-split (None: the KL keeps its own derivative)."""

    active: torch.Tensor
    window: float
    scores: Optional[torch.Tensor] = None
    probe: str = "core_attention"


@dataclass(frozen=True)
class Settings:
    """``window_ulps``: ambiguity half-width in case-dtype epsilons; ``max_elements``: largest pattern probed."""

    window_ulps: float = 8.0
    max_elements: int = 1 << 28


def applies(case: Case) -> bool:
    """Sign-split runs for training cases of an indexer layer with a loss, in float32 / bf16."""
    c = case.config
    return (case.training and c.has_indexer and c.dsa_indexer_loss_coeff > 0 and case.dtype != "float64")


def window(case: Case, settings: Settings) -> float:
    return settings.window_ulps * torch.finfo(case.torch_dtype).eps


def _eval_scores(api, case: Case, tensors: CaseTensors, params: dict) -> torch.Tensor:
    inputs, psp = tensors.inputs, tensors.packed_seq_params
    if case.scope == "layer":
        out = api.attention_layer(inputs["hidden"], params, case.config, psp, training=False)
    else:
        out = api.core_attention(inputs["query"], inputs["kv"], inputs["hidden"], inputs["q_latent"], params,
                                 case.config, psp, training=False)
    return out.index_scores


def _indexer_scores(api, case: Case, tensors: CaseTensors, params: dict, q_latent=None) -> torch.Tensor:
    """The public ``indexer``'s scores on the case's ``hidden`` and ``q_latent`` (a core case's own input, else the
    one given: a layer case's, from the implementation's ``query_latent``)."""
    inputs = tensors.inputs
    q_latent = inputs["q_latent"] if q_latent is None else q_latent
    return api.indexer(inputs["hidden"], q_latent, params, case.config, tensors.packed_seq_params)[0]


def same_bits(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Equal shape, dtype and values, NaN nowhere (``torch.equal`` on both)."""
    return (a is not None and b is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a, b))


def entry_points(api, case: Case, tensors: CaseTensors) -> tuple:
    """``(name, scores_fn)`` of the entry point that observes heads after the first: the public ``indexer`` where the
    implementation has one (at layer scope, with its own ``query_latent`` too), else the case's own entry point. A
    layer case's ``scores_fn`` carries the implementation's query latent, read here once (call inside the
    implementation's context; a ``query_latent`` that raises leaves the layer forward)."""
    if not callable(getattr(api, "indexer", None)):
        return entry_point(case), _eval_scores
    if case.scope == "core":
        return "indexer", _indexer_scores
    if not callable(getattr(api, "query_latent", None)):
        return entry_point(case), _eval_scores
    try:
        q_latent = api.query_latent(tensors.inputs["hidden"], dict(tensors.params), case.config,
                                    tensors.packed_seq_params)
    except Exception:  # noqa: BLE001 — an optional entry point that fails is not used; the layer forward decides
        return entry_point(case), _eval_scores
    return "indexer", functools.partial(_indexer_scores, q_latent=q_latent)


def entry_point(case: Case) -> str:
    return "attention_layer" if case.scope == "layer" else "core_attention"


def _indexer_agrees(api, case: Case, tensors: CaseTensors, scores_of, params_head0: dict,
                    head0: torch.Tensor) -> bool:
    """Whether the public ``indexer`` (``scores_of``) gives the case forward's ``index_scores`` bit for bit, with head
    0 alone (``head0``: the forward's) and with every head's weights (one more forward): the first shows each
    product of a head, the second every head's query and weight at once. An ``indexer`` that raises, or returns
    something else, does not agree."""
    try:
        if not same_bits(scores_of(api, case, tensors, params_head0), head0):
            return False
        return same_bits(scores_of(api, case, tensors, dict(tensors.params)),
                         _eval_scores(api, case, tensors, dict(tensors.params)))
    except Exception:  # noqa: BLE001 — an optional entry point that fails is not used; the core forward decides
        return False


def observe(api, case: Case, tensors: CaseTensors, context: Callable[[], ContextManager],
            settings: Settings = Settings()) -> Optional[tuple]:
    """``(active, probe)``: the implementation's ``qI·kI > 0`` as bool ``[B, S, nI, n_comp]`` (BSHD) / ``[T, nI,
    width]`` (THD) on the tensors' device, and the entry point that observed heads 1.. (``indexer`` only where every
    one of them went through it; see the module docstring); ``None`` if the pattern would exceed
    ``settings.max_elements`` or the implementation returns no index scores (production runs no indexer when no
    sequence has a compressed row: nothing to split)."""
    heads = case.config.dsa_indexer_n_heads
    weights = tensors.params[WEIGHTS]
    per_head = []
    with torch.no_grad(), context():
        for h in range(heads):
            isolated = torch.zeros_like(weights)
            isolated[h] = weights[h]
            params = dict(tensors.params)
            params[WEIGHTS] = isolated
            scores = None
            if h == 0:
                scores = _eval_scores(api, case, tensors, params)
                if scores is None or scores.numel() * heads > settings.max_elements:
                    return None
                probe, scores_of = entry_points(api, case, tensors)  # after head 0: nothing read for a case skipped
                if scores_of is not _eval_scores and not _indexer_agrees(api, case, tensors, scores_of, params,
                                                                             scores):
                    probe, scores_of = entry_point(case), _eval_scores
            elif scores_of is not _eval_scores:
                try:
                    scores = scores_of(api, case, tensors, params)
                except Exception:  # noqa: BLE001 — the core forward observes this head and the rest
                    scores = None
                if scores is None:
                    probe, scores_of = entry_point(case), _eval_scores
            if scores is None:
                scores = _eval_scores(api, case, tensors, params)
                if scores is None:
                    return None
            per_head.append(torch.isfinite(scores) & (scores != 0))
    return torch.stack(per_head, dim=-2), probe


def split_scores(active: torch.Tensor, scores: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The implementation's ``index_scores`` for score-split when they are laid out like ``active`` without its head
    axis (``[B, S, n_comp]`` / ``[T, width]``); else None (a malformed output is the structure rule's to report)."""
    if scores is None or not scores.is_floating_point():
        return None
    expected = tuple(active.shape[:-2]) + tuple(active.shape[-1:])
    return scores.detach() if tuple(scores.shape) == expected else None
