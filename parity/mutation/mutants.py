"""The planted bugs ("mutants") of the mutation suite: one record each — name, description, the feature cells of the
cases that can reach it, and the patch that plants it — in this one place.

A mutant is planted from outside: each :class:`Patch` replaces one named function (or method) of the fused
composition, for the duration of :func:`activate`, by a variant written here — ``planted(original)`` returns the
replacement, usually a thin change around the original. ``fused/`` holds production code only; every decision a
mutant changes is a named function there (``causal_visible``, ``teacher_lse``, ``mask_padding_rows``, ...).

A module-level function is replaced wherever ``fused`` holds it (its own module and every module that imported it
by name), a method on its class, an attribute of an object (``fused.plan:kernels.<stage>``) on that object. A
planted function records that it ran (:func:`reached`): the suite tells "survived" (ran, nothing failed) from
"unreachable" (never ran).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

#: reach cell of a mutant every case executes
ANY = ("",)


@dataclass(frozen=True)
class Patch:
    """``target`` = ``"module:attribute"`` or ``"module:Class.method"`` / ``"module:object.attribute"``;
    ``planted(original) -> replacement``. ``only_here``: replace a module-level function in its own module only
    (a bug of that module's callers, not of every importer)."""

    target: str
    planted: Callable[[Callable], Callable]
    only_here: bool = False


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    reach: tuple[str, ...]       # feature cells (cases.coverage) of the cases that can expose it; the first is named
    patches: tuple[Patch, ...]   # when a suite misses them all


# ---- the planted variants (each reads like the bug it is) ------------------------------------------------------------
def _drop_max_seqlen(original: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        if "cu_seqlens_q" in kwargs:  # the THD call
            kwargs = {k: v for k, v in kwargs.items() if k not in ("max_seqlen_q", "max_seqlen_k")}
        return original(*args, **kwargs)
    return call


def _teacher_without_sink(original: Callable) -> Callable:
    def teacher(st, sink):
        return st.lse if st.spec.sparse else original(st, torch.full_like(sink, float("-inf")))
    return teacher


def _teacher_compressed_only(original: Callable) -> Callable:
    """The teacher normalised over the compressed keys alone: no window keys, no sink."""
    def teacher(st, sink):
        if not st.spec.sparse:
            no_window = dataclasses.replace(st, window_global=torch.full_like(st.window_global, -1))
            return original(no_window, torch.full_like(sink, float("-inf")))
        attention = sys.modules["fused.sparse_attention"]
        comp_global = st.spec.rows.to_global(st.comp_ids, st.spec.cu_kv_full)
        ids, length = attention.compact(comp_global)
        return attention.flash_mla_forward(st.q_flat, st.kv_flat, ids, st.spec.scale, None, length)[1]
    return teacher


def _kl_unclamped(original: Callable) -> Callable:
    def kl(target, predict, topk):  # every slot, -1 ones included: 0 * (log 0 - log 0) = NaN
        return (target * (torch.log(target) - torch.log(predict))).sum(-1)
    return kl


def _tie_break_to_higher(original: Callable) -> Callable:
    def indexer_top_k(self, *args, **kwargs):
        kwargs["tie_break"] = 2  # the larger column wins among equal scores
        return original(self, *args, **kwargs)
    return indexer_top_k


def _replace(value: Callable) -> Callable[[Callable], Callable]:
    """A variant that ignores the original."""
    return lambda original: value


MUTANTS: dict[str, Mutant] = {m.name: m for m in (
    # ---- the three bugs found in review of the production feature
    Mutant("thd_dense_bwd_no_max_seqlen",
           "THD dense indexer-backward call made without max_seqlen_q / max_seqlen_k",
           ("layout=thd loss=dense",),
           (Patch("fused.plan:kernels.dense_indexer_backward", _drop_max_seqlen),)),
    Mutant("view_over_batch",
           "BSHD->SBHD of the indexer gradients done with .view instead of a permute (right only for batch 1)",
           ("layout=bshd loss=sparse sequences=2-3", "layout=bshd loss=sparse sequences=4+",
            "layout=bshd loss=dense sequences=2-3", "layout=bshd loss=dense sequences=4+"),
           (Patch("fused.indexer_loss:bshd_to_sbhd",
                  _replace(lambda t: t.reshape((t.shape[1], t.shape[0]) + tuple(t.shape[2:])))),)),
    Mutant("invalid_comp_rows_oob",
           "kv_full allocated for the true compressed count, so capacity-padding rows are routed out of bounds",
           ("layout=thd capacity=over", "layout=thd capacity=production"),
           (Patch("fused.index_maps:kv_full_rows",
                  _replace(lambda total_kv, capacity, cu_comp: total_kv + int(cu_comp[-1]))),)),
    # ---- the catalogue of bug classes (ARCHITECTURE.md, README "Mutation suite")
    Mutant("invalid_comp_rows_onto_valid",
           "index_maps: capacity-padding compressed rows scattered onto kv_full row 0 (a valid key) instead of a tail "
           "slot",
           ("layout=thd capacity=over", "layout=thd capacity=production"),
           (Patch("fused.index_maps:invalid_compressed_slots", _replace(lambda src, total_kv: torch.zeros_like(src))),)),
    Mutant("compressor_real_offsets",
           "thd: the compressors segment the pack with cu_seqlens (real) instead of cu_seqlens_padded",
           ("alignment_padding=true ratio=4", "alignment_padding=true ratio=128"),
           (Patch("fused.thd:ThdMeta.compressor_boundaries", _replace(lambda self: self.cu_real)),)),
    Mutant("global_rope_positions",
           "thd: RoPE positions global across the pack instead of restarting at each padded segment start",
           ("layout=thd ratio=4 sequences=2-3", "layout=thd ratio=4 sequences=4+",
            "layout=thd ratio=128 sequences=2-3", "layout=thd ratio=128 sequences=4+"),
           (Patch("fused.thd:ThdMeta.positions", _replace(lambda self: torch.arange(self.total, device=self.cu.device))),)),
    Mutant("compressed_causal_off_by_one",
           "index_maps / indexer: compressed key g visible iff g <= (i+1)//r (one block into the future)",
           ("ratio=4", "ratio=128"),
           (Patch("fused.index_maps:causal_visible", lambda original: lambda pos, ratio: original(pos, ratio) + 1),)),
    Mutant("overlap_crosses_segments",
           "compressor: the r=4 overlap half of a segment's first block taken from the previous segment's last block",
           ("layout=thd ratio=4 sequences=2-3", "layout=thd ratio=4 sequences=4+"),
           (Patch("fused.compressor:segment_first_blocks",
                  _replace(lambda local: torch.arange(local.shape[0], device=local.device) == 0)),)),
    Mutant("sink_dropped_forward",
           "sparse_attention: attention sink not passed to the forward kernel (softmax without the sink term)",
           ANY,
           (Patch("fused.sparse_attention:flash_mla_forward",
                  lambda original: lambda q, kv, ids, scale, sink, length: original(q, kv, ids, scale, None, length)),)),
    Mutant("sink_dropped_teacher",
           "indexer_loss: the teacher denominator without the sink (sparse: lse alone; dense: teacher LSE with sink "
           "-inf)",
           ("loss=sparse", "loss=dense"),
           (Patch("fused.indexer_loss:teacher_lse", _teacher_without_sink),)),
    Mutant("teacher_compressed_only",
           "indexer_loss: the teacher normalised over the compressed keys only (no window, no sink in its LSE)",
           ("loss=sparse", "loss=dense"),
           (Patch("fused.indexer_loss:teacher_lse", _teacher_compressed_only),)),
    Mutant("minus_one_as_zero_bwd",
           "sparse_attention: -1 top-k slots become id 0 in the backward (clamped, topk_length dropped)",
           ANY,
           (Patch("fused.sparse_attention:backward_index_state",
                  _replace(lambda indices, topk_length, padding_rows: (indices.clamp_min(0), None))),)),
    Mutant("padding_grads_not_zeroed",
           "sparse_attention / indexer_loss: padding rows' dO, LSE and indexer gradients not masked",
           ("alignment_padding=true", "dummy_tail=true"),  # slack rows alone see no key: they cannot show it
           (Patch("fused.sparse_attention:mask_padding_rows", _replace(lambda d_out, lse, padding_rows: (d_out, lse))),
            Patch("fused.indexer_loss:mask_padding_grads", _replace(lambda grads, padding: grads)))),
    Mutant("loss_over_physical_rows",
           "core_attention: THD mean indexer loss divided by all physical rows instead of the real rows",
           ("layout=thd reduction=mean alignment_padding=true", "layout=thd reduction=mean dummy_tail=true",
            "layout=thd reduction=mean slack=true"),
           (Patch("fused.thd:ThdMeta.real_row_count",
                  _replace(lambda self: torch.full((), float(self.total), device=self.cu.device))),)),
    Mutant("topk_width_k_short",
           "indexer: n_comp < K taken as K real entries (the K - n_comp tail slots hold id 0 instead of -1)",
           ("ratio=4 dense_mode=false topk_saturated=false",),
           (Patch("fused.indexer:pad_topk",
                  _replace(lambda ids, topk: torch.cat([ids, ids.new_zeros((ids.shape[0], topk - ids.shape[1]))],
                                                       dim=-1))),)),
    Mutant("indexer_grad_leaks",
           "core_attention: indexer inputs not detached, so the indexer-loss gradient leaks into the attention branch",
           ("loss=sparse", "loss=dense"),
           (Patch("fused.core_attention:indexer_branch_inputs", _replace(lambda x, qr: (x, qr))),)),
    Mutant("kl_full_width_nan",
           "indexer_loss: sparse KL summed over all K slots, -1 slots included, unclamped (0*(-inf): NaN loss, finite "
           "grads)",
           ("loss=sparse",),
           (Patch("fused.indexer_loss:kl_from_target_predict", _kl_unclamped),)),
    # ---- the padding-row, tie-rule and public-API contracts (README "What it checks")
    Mutant("layer_padding_dout_leaks",
           "layer: THD padding rows' output gradient not detached (reaches linear_proj / linear_o_group_proj)",
           ("scope=layer padding_dout=poison",),
           (Patch("fused.layer:padding_rows_pass_no_gradient", _replace(lambda y, rows: y)),)),
    Mutant("topk_tie_to_higher_index",
           "torch provider top-k: among equal scores the higher compressed index wins (declared: the lower one)",
           ("ratio=4 dense_mode=false topk_saturated=true dtype=float64", "ratio=4 dense_mode=false topk_saturated=true"),
           (Patch("fused.kernels.torch_provider:TorchKernels.indexer_top_k", _tie_break_to_higher),)),
    Mutant("indexer_api_no_sigma",
           "public fused.indexer(): scores without the indexer softmax scale sigma_I (same top-k)",
           ("ratio=4 dense_mode=false",),
           (Patch("fused.indexer:fold_indexer_scale", _replace(lambda w, scale: w), only_here=True),)),
)}

_ACTIVE: frozenset[str] = frozenset()
_REACHED: set[str] = set()


def registered() -> dict[str, str]:
    """name -> one-line description of every mutant."""
    return {name: m.description for name, m in MUTANTS.items()}


def reach_cells(name: str) -> tuple[str, ...]:
    return MUTANTS[name].reach


def reached() -> frozenset[str]:
    """Active mutants whose planted code ran since :func:`clear_reached`."""
    return frozenset(_REACHED)


def clear_reached() -> None:
    _REACHED.clear()


def active() -> frozenset[str]:
    return _ACTIVE


def _resolve(target: str) -> tuple[Any, str]:
    """``"module:a.b"`` -> (the object holding ``b``, ``"b"``)."""
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def _holders(owner: Any, attr: str, original: Any) -> list[tuple[Any, str]]:
    """Every place the planted value must go: for a module-level function, each loaded ``fused`` module holding that
    very function (``from .x import f`` copies the reference); else the owner itself."""
    if not isinstance(owner, type(sys)):
        return [(owner, attr)]
    return [(module, name) for module_name, module in list(sys.modules.items())
            if module is not None and (module_name == "fused" or module_name.startswith("fused."))
            for name, value in list(vars(module).items()) if value is original]


@contextlib.contextmanager
def _planted(mutant: Mutant) -> Iterator[None]:
    undo: list[tuple[Any, str, bool, Any]] = []
    try:
        for patch in mutant.patches:
            owner, attr = _resolve(patch.target)
            original = getattr(owner, attr)
            variant = patch.planted(original)

            def replacement(*args: Any, _variant: Callable = variant, **kwargs: Any) -> Any:
                _REACHED.add(mutant.name)
                return _variant(*args, **kwargs)

            holders = [(owner, attr)] if patch.only_here else _holders(owner, attr, original)
            for holder, name in holders:
                had = name in vars(holder)
                undo.append((holder, name, had, vars(holder).get(name)))
                setattr(holder, name, replacement)
        yield
    finally:
        for holder, name, had, value in reversed(undo):
            if had:
                setattr(holder, name, value)
            else:
                delattr(holder, name)


@contextlib.contextmanager
def activate(*names: str) -> Iterator[frozenset[str]]:
    """Plant the named mutants for the duration of the block (nesting adds to the active set)."""
    global _ACTIVE
    unknown = sorted(set(names) - set(MUTANTS))
    if unknown:
        raise KeyError(f"unknown mutant(s) {unknown}; registered: {sorted(MUTANTS)}")
    previous = _ACTIVE
    with contextlib.ExitStack() as stack:
        for name in names:
            if name not in previous:
                stack.enter_context(_planted(MUTANTS[name]))
        _ACTIVE = previous | frozenset(names)
        try:
            yield _ACTIVE
        finally:
            _ACTIVE = previous
