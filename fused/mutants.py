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
_REACHED: set[str] = set()  # active mutants whose point has executed (for "survived" vs "unreachable")


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
    if name in _ACTIVE:  # only an active mutant pays for the bookkeeping
        _REACHED.add(name)
        return True
    return False


def reached() -> frozenset[str]:
    """Active mutants whose mutation point executed since :func:`clear_reached`."""
    return frozenset(_REACHED)


def clear_reached() -> None:
    _REACHED.clear()


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


# ---- the mutation suite's catalogue (``dsv4-parity mutants``; points in the module named) -------------------------
INVALID_COMP_ROWS_ONTO_VALID = register(
    "invalid_comp_rows_onto_valid",
    "index_maps: capacity-padding compressed rows scattered onto kv_full row 0 (a valid key) instead of a tail slot")
COMPRESSOR_REAL_OFFSETS = register(
    "compressor_real_offsets",
    "core_attention: the attention compressor segments the pack with cu_seqlens (real) instead of cu_seqlens_padded")
GLOBAL_ROPE_POSITIONS = register(
    "global_rope_positions",
    "thd: RoPE positions global across the pack instead of restarting at each padded segment start")
CAUSAL_OFF_BY_ONE = register(
    "compressed_causal_off_by_one",
    "index_maps / indexer: compressed key g visible iff g <= (i+1)//r (one block into the future)")
OVERLAP_CROSSES_SEGMENTS = register(
    "overlap_crosses_segments",
    "compressor: the r=4 overlap half of a segment's first block taken from the previous segment's last block")
SINK_DROPPED_FORWARD = register(
    "sink_dropped_forward",
    "sparse_attention: attention sink not passed to the forward kernel (softmax without the sink term)")
SINK_DROPPED_TEACHER = register(
    "sink_dropped_teacher",
    "indexer_loss: the teacher denominator without the sink (sparse: lse alone; dense: teacher LSE with sink -inf)")
TEACHER_COMPRESSED_ONLY = register(
    "teacher_compressed_only",
    "indexer_loss: the teacher normalised over the compressed keys only (no window, no sink in its LSE)")
MINUS_ONE_AS_ZERO_BWD = register(
    "minus_one_as_zero_bwd",
    "sparse_attention: -1 top-k slots become id 0 in the backward (clamped, topk_length dropped)")
PADDING_GRADS_NOT_ZEROED = register(
    "padding_grads_not_zeroed",
    "sparse_attention / indexer_loss: padding rows' dO, LSE and indexer gradients not masked")
LOSS_OVER_PHYSICAL_ROWS = register(
    "loss_over_physical_rows",
    "core_attention: THD mean indexer loss divided by all physical rows instead of the real rows")
TOPK_WIDTH_K_SHORT = register(
    "topk_width_k_short",
    "indexer: n_comp < K taken as K real entries (the K - n_comp tail slots hold id 0 instead of -1)")
INDEXER_GRAD_LEAKS = register(
    "indexer_grad_leaks",
    "core_attention: indexer inputs not detached, so the indexer-loss gradient leaks into the attention branch")
KL_FULL_WIDTH_NAN = register(
    "kl_full_width_nan",
    "indexer_loss: sparse KL summed over all K slots, -1 slots included, unclamped (0*(-inf): NaN loss, finite grads)")
