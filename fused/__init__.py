"""dsv4-parity: the fused implementation — the composition Megatron-LM's fused DSv4 path performs around the
cuDNN DSA and FlashMLA kernels, with pluggable kernel providers.

Public API (identical names and signatures in ``reference``; ARCHITECTURE.md)::

    attention_layer(hidden, params, config, packed_seq_params=None, *, training=True, topk_indices=None)
    core_attention(query, kv, hidden, q_latent, params, config, packed_seq_params=None, *, training=True,
                   topk_indices=None)
    compressor(hidden, params, prefix, config, packed_seq_params=None, *, rotate=False)
    indexer(hidden, q_latent, params, config, packed_seq_params=None)
    query_latent(hidden, params, config, packed_seq_params=None)

Kernel providers are chosen with a context manager, never with extra arguments::

    with fused.use_backend(provider="torch") as plan:      # "auto" (default), "torch", "cudnn", {stage: name}
        out = fused.core_attention(...)
    plan.record                                            # {stage: provider that ran it}

``"cudnn"`` selects the production kernels (cuDNN DSA + FlashMLA, both required; ``fused.plan.SELECTIONS``).

Parity-engine hooks (``parity/impls.py``), so that ``--impl fused --provider auto|torch|cudnn`` works as is:
``use_backend(provider=..., require=...)``, ``available_providers()`` (``{name: None or why not}``, best first: the
usable names on a CPU machine are ``["torch"]``) and ``executed()`` (``{stage: provider}`` of the last block), and
``topk_tie_rule(record)`` (the declared top-k tie rule of the providers that ran ``indexer_top_k``: ``lower-index``
for ``torch``, ``arbitrary`` for ``cudnn``).

Observation: ``with fused.observe_kernels(observer): ...`` runs every kernel call inside
``observer(stage, provider_name)`` (a context manager) — timers, counters and profiler ranges attach there.

Modules: ``kernels`` (interface, contracts, torch provider), ``plan`` (selection), ``ops`` / ``compressor`` /
``indexer`` / ``layer`` (eager parts), ``rows`` (the query-row space of a call, both layouts, computed once and
passed down), ``index_maps`` and ``thd`` (index and layout plumbing), ``sparse_attention``
(Paths A/C), ``indexer_loss`` (Path B), ``core_attention`` (dispatch).
"""

from .core_attention import compressor, core_attention
from .indexer import indexer
from .layer import attention_layer, query_latent
from .plan import (BackendError, BackendUnavailable, Plan, StageUnsupported, available_providers, current_plan,
                   executed, observe_kernels, register_provider, topk_tie_rule, use_backend)

__all__ = ["BackendError", "BackendUnavailable", "Plan", "StageUnsupported", "attention_layer", "available_providers",
           "compressor", "core_attention", "current_plan", "executed", "indexer", "observe_kernels",
           "query_latent", "register_provider", "topk_tie_rule", "use_backend"]
