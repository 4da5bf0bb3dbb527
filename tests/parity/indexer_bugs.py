"""Planted indexer-gradient bugs (issue 17), each applied from outside ``fused`` (no switch inside it).

* ``scale_0.8`` / ``scale_1.22`` / ``shrink_8`` / ``one_over_rows``: fused whose gradients of the indexer parameters
  (``core_attention.indexer.*``) come back multiplied by 0.8, 1.22, 1/8, or 1/(query rows) — the implementation
  object is wrapped so every such parameter passes through an identity whose backward scales;
* ``thd_local_ids_as_global``: fused's THD sparse indexer backward receives the *local* compressed ids while told they
  are global (``fused.rows.RowSpace.to_global`` replaced so that its call for the backward — the repeat
  of the identical call made for the score recompute just before it — returns its input unchanged).

:func:`kill_margin` is how far a killed case is past the threshold that kills it (its strongest failing metric);
:func:`deciding_margin` how far it is past the threshold of the rule that decides it (the earliest failing rule).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional

import torch

import fused
from fused.rows import RowSpace
from cases.suites import offsets_compressed_ids
from parity.impls import Implementation
from parity.judge.verdict import GATES

INDEXER = "core_attention.indexer."


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class IndexerGradScaled:
    """``fused`` with the indexer parameters' gradients times ``factor(rows)`` (``rows``: query rows of the call)."""

    def __init__(self, factor: Callable[[int], float]):
        self.factor = factor
        self.use_backend = fused.use_backend
        self.available_providers = fused.available_providers

    def _params(self, params: dict, rows: int) -> dict:
        f = self.factor(rows)
        return {n: _ScaleGrad.apply(p, f) if n.startswith(INDEXER) and p.requires_grad else p
                for n, p in params.items()}

    @staticmethod
    def _rows(x: torch.Tensor, packed) -> int:
        return x.shape[0] if packed is not None else x.shape[0] * x.shape[1]

    def attention_layer(self, hidden, params, config, packed_seq_params=None, **kw):
        return fused.attention_layer(hidden, self._params(params, self._rows(hidden, packed_seq_params)), config,
                                     packed_seq_params, **kw)

    def core_attention(self, query, kv, hidden, q_latent, params, config, packed_seq_params=None, **kw):
        return fused.core_attention(query, kv, hidden, q_latent,
                                    self._params(params, self._rows(hidden, packed_seq_params)), config,
                                    packed_seq_params, **kw)


@contextlib.contextmanager
def thd_local_ids_as_global() -> Iterator[None]:
    """While active, fused's THD sparse indexer backward gets local ids flagged as global (module docstring)."""
    real = RowSpace.to_global
    last: list = [None]

    def planted(self, ids, *args):
        key = (id(ids),) + tuple(id(a) for a in args)
        repeat, last[0] = last[0] == key, key
        return ids if repeat else real(self, ids, *args)

    RowSpace.to_global = planted
    try:
        yield
    finally:
        RowSpace.to_global = real


BUGS: dict[str, tuple[Callable[[], Implementation], Callable[[], contextlib.AbstractContextManager]]] = {
    "scale_0.8": (lambda: Implementation("fused*0.8", IndexerGradScaled(lambda rows: 0.8)), contextlib.nullcontext),
    "scale_1.22": (lambda: Implementation("fused*1.22", IndexerGradScaled(lambda rows: 1.22)),
                   contextlib.nullcontext),
    "shrink_8": (lambda: Implementation("fused/8", IndexerGradScaled(lambda rows: 1 / 8)), contextlib.nullcontext),
    "one_over_rows": (lambda: Implementation("fused/rows", IndexerGradScaled(lambda rows: 1 / rows)),
                      contextlib.nullcontext),
    "thd_local_ids_as_global": (lambda: Implementation("fused", fused), thd_local_ids_as_global),
}


def reaches(bug: str, case) -> bool:
    """Whether ``bug`` can show on ``case``: the id mix-up needs a later THD segment whose global compressed ids
    differ from its local ones (:func:`cases.suites.offsets_compressed_ids`)."""
    if bug == "thd_local_ids_as_global":
        return offsets_compressed_ids(case)
    return True


def kill_margin(result, rule: Optional[str] = None) -> Optional[tuple[float, str]]:
    """How far past its threshold the strongest failing gating metric of the case is: ``(usage, "tensor metric")``
    (usage = value / threshold, for similarities ``(1 - sim) / (1 - floor)``); the case would still fail with that
    metric's threshold loosened by ``usage``. ``rule``: only that rule's metrics. None if no such metric failed."""
    best = None
    for t in result.tensors:
        for m in t.metrics:
            if m.metric in GATES and m.passed is False and rule in (None, GATES[m.metric][0]):
                usage = m.usage
                if best is None or usage > best[0] or math.isnan(best[0]):
                    best = (usage, f"{t.name} {m.metric}")
    return best


def deciding_margin(result) -> Optional[tuple[float, str]]:
    """:func:`kill_margin` over the metrics of the rule that decided the case (``result.decided_by``): the case would
    still fail, and be decided by the same rule, with every threshold of that rule loosened by the usage."""
    return kill_margin(result, result.decided_by)
