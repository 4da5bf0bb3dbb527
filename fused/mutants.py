"""Named planted bugs ("mutants") in the fused composition, switched on only inside :func:`activate`.

A mutation point in the composition reads::

    if mutants.is_active("view_over_batch"):
        grad = grad.view(...)          # the bug
    else:
        grad = grad.permute(...)       # the production code

``is_active`` is a set lookup, so an inactive point costs nothing measurable. Every name must be registered with
:func:`register` (in the module that owns the point) before :func:`activate` accepts it, so a typo in a mutation
suite fails loudly instead of silently testing the unmutated code.

The three bugs found in review of the production feature are registered here; the mutation suite adds more.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

_REGISTRY: dict[str, str] = {}
_ACTIVE: frozenset[str] = frozenset()


def register(name: str, description: str) -> str:
    """Declare mutation point ``name`` (idempotent for the same description); returns ``name``."""
    known = _REGISTRY.get(name)
    if known is not None and known != description:
        raise ValueError(f"mutant {name!r} is already registered with another description: {known!r}")
    _REGISTRY[name] = description
    return name


def registered() -> dict[str, str]:
    """name → one-line description of every registered mutant."""
    return dict(_REGISTRY)


def is_active(name: str) -> bool:
    return name in _ACTIVE


def active() -> frozenset[str]:
    return _ACTIVE


@contextlib.contextmanager
def activate(*names: str) -> Iterator[frozenset[str]]:
    """Switch the named mutants on for the duration of the block (nesting adds to the active set)."""
    global _ACTIVE
    unknown = sorted(set(names) - set(_REGISTRY))
    if unknown:
        raise KeyError(f"unknown mutant(s) {unknown}; registered: {sorted(_REGISTRY)}")
    previous = _ACTIVE
    _ACTIVE = previous | frozenset(names)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = previous


# ---- the three bugs found in review of the production feature ---------------------------------------------------
THD_DENSE_BWD_NO_MAX_SEQLEN = register(
    "thd_dense_bwd_no_max_seqlen",
    "THD dense indexer-backward call made without max_seqlen_q / max_seqlen_k")
VIEW_OVER_BATCH = register(
    "view_over_batch",
    "BSHD->SBHD of the indexer gradients done with .view instead of a permute (right only for batch 1)")
INVALID_COMP_ROWS_OOB = register(
    "invalid_comp_rows_oob",
    "kv_full allocated for the true compressed count, so capacity-padding rows are routed out of bounds")
