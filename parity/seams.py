"""Planted bugs applied from outside the implementation ("seam" mutants): each replaces one named function of
``fused`` for the duration of a block, the way the tests replace ``reference.thd.capacity_fill``. ``fused`` itself
carries no switch for them.

A :class:`Seam` names the module, the attribute (``"Class.method"`` for a method) and ``make(original)``, which returns
the buggy stand-in. :func:`activate` installs the stand-ins, wrapped so that a call marks the mutant *reached*
(:func:`reached`, like ``fused.mutants.reached``), and restores the originals afterwards. The mutation suite
(:mod:`parity.mutants_cmd`) runs these next to the switch mutants of :mod:`fused.mutants`.

The replaced function must be looked up through its module at call time (a module-level name, or a method), which
every target below is.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Iterator

_REACHED: set[str] = set()


@dataclass(frozen=True)
class Seam:
    name: str
    description: str
    module: str
    attribute: str      # "function" or "Class.method"
    make: Callable[[Callable], Callable]

    def owner_and_name(self) -> tuple[object, str]:
        owner: object = importlib.import_module(self.module)
        *path, leaf = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, leaf


def _detach_nothing(original: Callable) -> Callable:
    def padding_rows_keep_gradient(y, thd):
        return y
    return padding_rows_keep_gradient


def _tie_break_to_higher(original: Callable) -> Callable:
    def indexer_top_k(self, *args, **kwargs):
        kwargs["tie_break"] = 2  # the larger column wins among equal scores
        return original(self, *args, **kwargs)
    return indexer_top_k


def _scale_not_folded(original: Callable) -> Callable:
    def fold_indexer_scale(w, scale):
        return w  # the indexer scores without sigma_I (the top-k is unchanged: a positive scale)
    return fold_indexer_scale


SEAMS: dict[str, Seam] = {s.name: s for s in (
    Seam("layer_padding_dout_leaks",
         "layer: THD padding rows' output gradient not detached (reaches linear_proj / linear_o_group_proj)",
         "fused.layer", "padding_rows_pass_no_gradient", _detach_nothing),
    Seam("topk_tie_to_higher_index",
         "torch provider top-k: among equal scores the higher compressed index wins (declared: the lower one)",
         "fused.kernels.torch_provider", "TorchKernels.indexer_top_k", _tie_break_to_higher),
    Seam("indexer_api_no_sigma",
         "public fused.indexer(): scores without the indexer softmax scale sigma_I (same top-k)",
         "fused.indexer", "fold_indexer_scale", _scale_not_folded),
)}


def registered() -> dict[str, str]:
    """name → one-line description of every seam mutant."""
    return {name: seam.description for name, seam in SEAMS.items()}


def reached() -> frozenset[str]:
    """Active seam mutants whose stand-in was called since :func:`clear_reached`."""
    return frozenset(_REACHED)


def clear_reached() -> None:
    _REACHED.clear()


@contextlib.contextmanager
def activate(*names: str) -> Iterator[None]:
    """Install the stand-ins of the named seam mutants for the duration of the block."""
    unknown = sorted(set(names) - set(SEAMS))
    if unknown:
        raise KeyError(f"unknown seam mutant(s) {unknown}; registered: {sorted(SEAMS)}")
    saved = []
    try:
        for name in names:
            seam = SEAMS[name]
            owner, leaf = seam.owner_and_name()
            original = owner.__dict__[leaf]
            stand_in = seam.make(original)

            @functools.wraps(stand_in)
            def marked(*args, _stand_in=stand_in, _name=name, **kwargs):
                _REACHED.add(_name)
                return _stand_in(*args, **kwargs)

            saved.append((owner, leaf, original))
            setattr(owner, leaf, marked)
        yield
    finally:
        for owner, leaf, original in reversed(saved):
            setattr(owner, leaf, original)


__all__ = ["SEAMS", "Seam", "activate", "clear_reached", "reached", "registered"]
