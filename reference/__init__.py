"""dsv4-parity: the pure-PyTorch reference of DSv4 hybrid attention (spec §1-§6), written from the equations.

Autograd supplies every gradient; no custom backward, no fused kernel (row blocks are recomputed in
backward by ``torch.utils.checkpoint``, see ``numerics``). One module per concept:
``rope``, ``norms``, ``hadamard``, ``compressor``, ``indexer``, ``sparse_attention``, ``indexer_loss``,
``core_attention``, ``layer``, ``thd`` (packed layout), ``numerics`` (precision policy, row chunking), ``params``.

Public API (identical names and signatures in ``fused``; see ARCHITECTURE.md)::

    attention_layer(hidden, params, config, packed_seq_params=None, *, training=True, topk_indices=None)
    core_attention(query, kv, hidden, q_latent, params, config, packed_seq_params=None, *, training=True,
                   topk_indices=None)
    compressor(hidden, params, prefix, config, packed_seq_params=None, *, rotate=False)
    indexer(hidden, q_latent, params, config, packed_seq_params=None)
    query_latent(hidden, params, config, packed_seq_params=None)

Beyond it, ``use_activation_pattern(active, window, scores=None)`` (parity's sign- and score-split hook,
:mod:`reference.activation`).
``TOPK_TIE_RULE``: the declared top-k tie behaviour the parity engine enforces on exactly tied rows
(``parity/impls.py``): among equal scores the lower compressed index wins, always (a stable sort).
"""

from .activation import use_activation_pattern
from .compressor import compressor
from .core_attention import core_attention
from .indexer import indexer
from .layer import attention_layer, query_latent

TOPK_TIE_RULE = "lower-index"

__all__ = ["attention_layer", "compressor", "core_attention", "indexer", "query_latent"]  # the mirrored API (not the sign-split hook; TOPK_TIE_RULE: a declaration)
