"""The kernel calls of production's fused path, as one seam: what ``cudnn.DSA`` and ``flash_mla_sparse_fwd`` resolve
to inside production's module, and the observers that see each call.

Production's fused module (``csa_utils/fused_sparse_attention.py``; ``csa_kernels.py`` / ``dsa_kernels.py`` in older
API generations, :mod:`adapters.megatron.generations`) resolves its kernels lazily into two module globals, ``_DSA``
(the ``cudnn.DSA`` namespace: ``<stage>_wrapper`` functions) and ``_flash_mla_sparse_fwd``, and reads them at every
call. :func:`installed` sets both for a block (restored after), to the real kernels (``cudnn`` provider) or to the
torch stand-ins (``emulated``), each behind a thin proxy that runs the call inside every open
:func:`observe_kernels` observer — the bench's kernel timer attaches there, as it does to fused's dispatcher
(``fused.observe_kernels``, same signature). No production value passes through anything but the kernel itself.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator

from . import loader
from .recorders import patched

#: ``cudnn.DSA`` wrapper -> the kernel stage it runs (the stage names of ``fused.kernels``: the torch provider's
#: method of the same name is the wrapper's contract-exact stand-in)
WRAPPERS = {
    "indexer_forward_wrapper": "indexer_forward",
    "indexer_top_k_wrapper": "indexer_top_k",
    "compactify_wrapper": "compactify",
    "sparse_attention_backward_wrapper": "sparse_attn_bwd",
    "sparse_attn_score_recompute_wrapper": "sparse_attn_score_recompute",
    "sparse_indexer_score_recompute_wrapper": "sparse_indexer_score_recompute",
    "dense_attn_score_recompute_wrapper": "dense_attn_score_recompute",
    "dense_indexer_score_recompute_wrapper": "dense_indexer_score_recompute",
    "indexer_backward_wrapper": "indexer_backward",
    "dense_indexer_backward_wrapper": "dense_indexer_backward",
}
FLASH_STAGE = "sparse_attn_fwd"

_OBSERVERS: list[Callable[[str, str], ContextManager]] = []


@contextlib.contextmanager
def observe_kernels(observer: Callable[[str, str], ContextManager]) -> Iterator[None]:
    """Within the block every kernel call of production's fused path runs inside ``observer(stage, provider)``
    (``provider``: ``cudnn`` / ``flashmla`` for the real kernels, ``torch`` for the emulated ones). Same contract
    as ``fused.observe_kernels``; blocks nest, the innermost observer is entered last."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def observed(function: Callable, stage: str, provider: str) -> Callable:
    """``function`` called inside the open observers (directly when there are none)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _OBSERVERS:
            return function(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for observer in list(_OBSERVERS):
                stack.enter_context(observer(stage, provider))
            return function(*args, **kwargs)

    return call


class ObservedDSA:
    """A ``cudnn.DSA`` namespace whose ``<stage>_wrapper`` functions are :func:`observed`; every other attribute is
    the namespace's own (``inspect.signature`` of a wrapper still reads the original through ``functools.wraps``)."""

    def __init__(self, namespace: Any, provider: str):
        self._namespace = namespace
        self._provider = provider

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._namespace, name)
        stage = WRAPPERS.get(name)
        if stage is not None and callable(value):
            # production reads _DSA.<x>_wrapper at every call: wrap once per namespace (one installed() block)
            value = self.__dict__[name] = observed(value, stage, self._provider)
        return value


@contextlib.contextmanager
def installed(dsa_namespace: Any, dsa_provider: str, flash_fwd: Callable, flash_provider: str) -> Iterator[None]:
    """Production's fused module calls ``dsa_namespace`` and ``flash_fwd`` (both observed) inside the block."""
    mg = loader.loaded()
    if mg is None:
        raise RuntimeError("production's kernels are installed before Megatron-LM is imported (providers.megatron())")
    fused = mg.fused()  # the API generation's fused module (csa_utils/fused_sparse_attention.py, csa_kernels.py, ...)
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(fused, "_DSA", ObservedDSA(dsa_namespace, dsa_provider)))
        stack.enter_context(patched(fused, "_flash_mla_sparse_fwd", observed(flash_fwd, FLASH_STAGE, flash_provider)))
        # read from the device capability in force (real or declared); not cached at every revision
        clear = getattr(fused._get_topk_alignment, "cache_clear", lambda: None)
        clear()
        try:
            yield
        finally:
            clear()
