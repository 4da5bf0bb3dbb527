"""Import Megatron-LM's DSv4 code from a located tree, with the stand-ins this machine needs, once per process.

:func:`load` returns a :class:`Megatron` handle: the imported production modules, the tree's revision and the
stand-ins installed at import time and the tree's API generation (:mod:`adapters.megatron.generations`). It raises
:class:`~adapters.megatron.source.MegatronSourceError` when the tree cannot be imported or no generation's probe
recognises it (one line: the missing symbol and the nearest revision the adapter drives).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

from . import generations, standins
from .source import MegatronSource, MegatronSourceError, locate

VARIANT = generations.VARIANT


@dataclass
class Megatron:
    """The imported production code, its API generation and what was needed to import it."""

    source: MegatronSource
    modules: dict[str, ModuleType]
    generation: generations.Generation
    standins: list[str] = field(default_factory=list)
    has_te: bool = False

    def module(self, short: str) -> ModuleType:
        """``"csa"`` / ``"dsa"`` / ``"deepseek_v4_hybrid_attention"`` or a full module name."""
        return self.modules.get(short) or self.modules[f"{VARIANT}.{short}"]

    def fused(self) -> ModuleType:
        """Production's fused-kernel module of this generation (``_DSA``, ``_flash_mla_sparse_fwd``, ...)."""
        return self.modules[self.generation.fused_module_name]


_LOADED: Optional[Megatron] = None


def loaded() -> Optional[Megatron]:
    """The Megatron-LM this process imported, or None before :func:`load`."""
    return _LOADED


def _import_all(source: MegatronSource) -> dict[str, Optional[ModuleType]]:
    """Every module a probe reads: the common ones must import; a generation's own module that the tree does not
    have (or cannot import) reads None."""
    required = {n.full_module for n in generations.COMMON}
    modules: dict[str, Optional[ModuleType]] = {}
    for name in generations.PROBED_MODULES:
        if name in required:
            try:
                modules[name] = importlib.import_module(name)
            except ImportError as exc:
                raise MegatronSourceError(f"cannot import {exc.name or exc} from Megatron-LM at {source.root} "
                                          f"({source.revision}): {exc}") from None
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        try:
            modules[name] = importlib.import_module(name) if found else None
        except ImportError:
            modules[name] = None
    return modules


def _detect(modules: dict[str, Optional[ModuleType]], source: MegatronSource) -> generations.Generation:
    generation = generations.detect(modules)
    if generation is None:
        raise MegatronSourceError(generations.refusal(modules, f"{source.root} ({source.revision})"))
    return generation


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
    modules = _import_all(source)
    generation = _detect(modules, source)
    has_te = bool(getattr(modules[f"{VARIANT}.deepseek_v4_hybrid_attention"], "HAVE_TE", False))
    _LOADED = Megatron(source, {k: v for k, v in modules.items() if v is not None}, generation, used, has_te)
    return _LOADED
