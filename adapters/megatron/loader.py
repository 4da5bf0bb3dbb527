"""Import Megatron-LM's DSv4 code from a located tree, with the stand-ins this machine needs, once per process.

:func:`load` returns a :class:`Megatron` handle: the imported production modules, the tree's revision and the
stand-ins installed at import time. It raises :class:`~adapters.megatron.source.MegatronSourceError` when the tree
cannot be imported or its API differs from the one this adapter drives (:data:`API`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

from . import standins
from .source import MegatronSource, MegatronSourceError, locate

VARIANT = "megatron.core.transformer.experimental_attention_variant"
#: module -> names the adapter uses; a revision lacking one has a different API
API = {
    f"{VARIANT}.deepseek_v4_hybrid_attention": ("DSv4HybridSelfAttention", "_q_rms_norm"),
    f"{VARIANT}.csa": ("CompressedSparseAttention", "Compressor", "CSAIndexer", "DSAIndexerLossAutoScaler",
                       "fused_qk_topk_naive", "FusedDSAIndexerLoss", "unfused_compressed_sparse_attn",
                       "rotate_activation"),
    f"{VARIANT}.dsa": ("DSAIndexerLossAutoScaler", "fused_qk_topk_naive", "compute_dsa_indexer_loss"),
    "megatron.core.models.gpt.experimental_attention_variant_module_specs": (
        "get_dsv4_hybrid_module_spec_for_backend",),
    "megatron.core.models.backends": ("LocalSpecProvider",),
    "megatron.core.transformer.transformer_config": ("MLATransformerConfig",),
    "megatron.core.process_groups_config": ("ProcessGroupCollection",),
    "megatron.core.packed_seq_params": ("PackedSeqParams",),
}
#: keyword arguments of production entry points the adapter passes by name
SIGNATURES = {
    (f"{VARIANT}.deepseek_v4_hybrid_attention", "DSv4HybridSelfAttention.forward"): ("packed_seq_params",),
    (f"{VARIANT}.csa", "CompressedSparseAttention.forward"): ("x", "qr", "packed_seq_params"),
}


@dataclass
class Megatron:
    """The imported production code and what was needed to import it."""

    source: MegatronSource
    modules: dict[str, ModuleType]
    standins: list[str] = field(default_factory=list)
    has_te: bool = False

    def module(self, short: str) -> ModuleType:
        """``"csa"`` / ``"dsa"`` / ``"deepseek_v4_hybrid_attention"`` or a full module name."""
        return self.modules.get(short) or self.modules[f"{VARIANT}.{short}"]


_LOADED: Optional[Megatron] = None


def _check_api(modules: dict[str, ModuleType], source: MegatronSource) -> None:
    for name, attrs in API.items():
        missing = [a for a in attrs if not hasattr(modules[name], a)]
        if missing:
            raise MegatronSourceError(f"Megatron-LM at {source.root} ({source.revision}) has a different API: "
                                      f"{name} lacks {', '.join(missing)}")
    for (name, qual), kwargs in SIGNATURES.items():
        obj = modules[name]
        for part in qual.split("."):
            obj = getattr(obj, part)
        params = inspect.signature(obj).parameters
        missing = [k for k in kwargs if k not in params]
        if missing:
            raise MegatronSourceError(f"Megatron-LM at {source.root} ({source.revision}) has a different API: "
                                      f"{qual} takes no {', '.join(missing)}")


def load(path: Optional[str] = None) -> Megatron:
    """Import Megatron-LM from ``path`` / ``DSV4_MEGATRON`` / the snapshot (cached per process: a second call with a
    different tree is refused, since Python imports ``megatron`` once)."""
    global _LOADED
    source = locate(path)
    if _LOADED is not None:
        if _LOADED.source.root != source.root:
            raise MegatronSourceError(f"Megatron-LM is already imported from {_LOADED.source.root}; one process tests "
                                      f"one tree (asked for {source.root})")
        return _LOADED
    present = sys.modules.get("megatron")
    places = [str(getattr(present, "__file__", None) or "")] + [str(p) for p in getattr(present, "__path__", [])]
    if present is not None and not any(place.startswith(str(source.root)) for place in places if place):
        where = getattr(present, "__path__", ["?"])
        raise MegatronSourceError(f"another `megatron` package is already imported ({list(where)[0]}); "
                                  f"cannot import {source.root}")
    used: list[str] = []
    standins.install_paged_stash(used)
    if str(source.root) not in sys.path:
        sys.path.insert(0, str(source.root))
    modules = {}
    try:
        for name in API:
            modules[name] = importlib.import_module(name)
    except ImportError as exc:
        raise MegatronSourceError(f"cannot import {exc.name or exc} from Megatron-LM at {source.root} "
                                  f"({source.revision}): {exc}") from None
    _check_api(modules, source)
    has_te = bool(getattr(modules[f"{VARIANT}.deepseek_v4_hybrid_attention"], "HAVE_TE", False))
    _LOADED = Megatron(source, modules, used, has_te)
    return _LOADED
