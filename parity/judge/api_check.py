"""The mirrored public ``compressor()`` and ``indexer()`` (ARCHITECTURE.md), run on every case whose layer has them.

On the case's ``hidden`` (and ``q_latent``: the case input at core scope, a seeded draw at layer scope,
:func:`cases.tensors.api_inputs`), forward only, with the case's ``packed_seq_params`` (BSHD and THD, compressed
capacity included):

==============================  =====================================================  ================
tensor                          call                                                   class
==============================  =====================================================  ================
``api/compressor``              ``compressor(.., "core_attention.compressor")``        ``out``
``api/indexer.compressor``      ``compressor(.., "core_attention.indexer.compressor",  ``out``
                                rotate=True)``
``api/indexer.index_scores``    ``indexer(..)[0]``                                     ``index_scores``
``api/indexer.topk_indices``    ``indexer(..)[1]``                                     ``topk``
==============================  =====================================================  ================

THD compressor outputs are compared on the true compressed rows only (rows past them, up to the capacity, are
unspecified). The tensors join the case's snapshots, so every rule applies to them as to their layer counterparts
(structure, noise floor against the float64 reference, the top-k protocol and tie rule).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from cases.case import Case
from cases.tensors import CaseTensors, api_inputs

from parity.judge.snapshot import Snapshot

ATTENTION = "core_attention.compressor"
INDEXER = "core_attention.indexer.compressor"


def has_api(api) -> bool:
    return callable(getattr(api, "compressor", None)) and callable(getattr(api, "indexer", None))


def applies(case: Case) -> bool:
    """Whether the case's layer has a compressor (r > 1) or an indexer."""
    return case.config.has_compressor or case.config.has_indexer


def _true_rows(case: Case, out: torch.Tensor, ratio: int) -> torch.Tensor:
    if not case.is_thd:
        return out
    return out[:case.layout.cu_seqlens_compressed(ratio)[-1]]


def run_api(api, case: Case, tensors: CaseTensors, *, upcast: bool = False,
            context: Callable[[], ContextManager] = contextlib.nullcontext) -> Snapshot:
    """``api``'s public compressor / indexer outputs on the case (module docstring); ``upcast``: in float64."""
    c, psp = case.config, tensors.packed_seq_params
    hidden, q_latent = api_inputs(case, tensors)
    params = {n: t.detach() for n, t in tensors.params.items()}
    if upcast:
        hidden, q_latent = hidden.double(), q_latent.double()
        params = {n: t.double() for n, t in params.items()}
    out: dict = {}
    with torch.no_grad(), context() as handle:
        if c.has_compressor:
            out["api/compressor"] = _true_rows(case, api.compressor(hidden, params, ATTENTION, c, psp),
                                               c.compress_ratio)
        if c.has_indexer:
            out["api/indexer.compressor"] = _true_rows(case, api.compressor(hidden, params, INDEXER, c, psp,
                                                                            rotate=True), 4)
            out["api/indexer.index_scores"], out["api/indexer.topk_indices"] = api.indexer(hidden, q_latent, params,
                                                                                          c, psp)
    record = getattr(handle, "record", None)
    return Snapshot({n: t.detach() for n, t in out.items()}, record=dict(record) if record is not None else None)


def merge(into: Snapshot, extra: Snapshot) -> None:
    """Add ``extra``'s tensors to ``into``, and the plan stages it ran that ``into`` did not."""
    into.tensors.update(extra.tensors)
    if extra.record:
        merged = dict(into.record or {})
        for stage, provider in extra.record.items():
            ran = merged.get(stage)
            if ran is None:
                merged[stage] = provider
            else:
                merged[stage] = "+".join(dict.fromkeys(ran.split("+") + provider.split("+")))
        into.record = merged


__all__ = ["applies", "has_api", "merge", "run_api"]
