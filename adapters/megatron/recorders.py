"""Recorders on production functions: what production itself computed, captured while it runs.

Each recorder replaces one name in the module namespace where production *calls* it (``csa``, ``dsa``, the API
generation's fused module) by a wrapper that calls the original and keeps a detached copy of its result;
:func:`recording` installs them for one call and restores the originals after. Which names exist depends on the
revision's API generation (:mod:`adapters.megatron.generations`). Nothing here recomputes a production value;
conversions are layout only (global / ``kv_full`` -> local compressed ids, a sort and ``-1`` padding to width ``K``,
per-segment score blocks placed at their rows) plus one convention: a pick whose own recorded score is ``-inf`` reads
``-1`` (:func:`drop_masked`).

Recorded (the last forward call wins):

* ``scores`` / ``topk`` — ``fused_qk_topk_naive`` (unfused paths; ``dsa.py``): the masked index scores and the
  selected ids, cloned at once (``compute_dsa_indexer_loss`` later adds masks to the score tensor in place);
* ``topk_local`` — ``_compressed_thd_topk_to_local`` (THD, ``to_local`` generations): segment-local ids;
  ``compressed_offsets`` — ``_build_compressed_thd_indexer_metadata``'s per-row compressed offset, to read THD scores
  by local id;
* ``thd_kv_full_ids`` / ``thd_cu_seqlens_q`` / ``thd_cu_seqlens_kv`` — ``build_flat_topk_idxs`` and
  ``build_cu_seqlens_kv_full`` (THD, ``kv_full`` generation): the selection as production hands it to its sparse
  attention; ``segment_scores`` — the inner ``fused_qk_topk_naive`` calls of production's per-segment THD loops
  (``fused_qk_topk_naive_thd``, ``fwd_fused_indexer_loss_naive_thd``) with the loop's own offsets;
* ``loss`` — ``DSAIndexerLossAutoScaler.apply(output, indexer_loss)``: the loss production attaches to the output;
* ``lse`` — the fused module's FlashMLA adapter (``_csa_fwd_flash_mla`` / ``_dsa_fwd_flash_mla``); ``fused_topk`` /
  ``fused_scores`` — its ``_indexer_topk_core`` (fused paths; with ``stop_after_scores`` that call ends the forward,
  :class:`ScoresRecorded`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from unittest import mock
from typing import Any, Iterator, Optional

import torch

from .loader import Megatron

class Record(dict):
    """``{name: tensor}`` of one production call (detached). ``segments``: while a per-segment THD loop of
    production runs (:func:`_wrap_segment_loop`), the scores of each inner ``fused_qk_topk_naive`` call, in order."""

    segments: Optional[list] = None

    def keep(self, name: str, value: Any) -> None:
        self[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value


def _wrap_topk(original, record: Record):
    def fused_qk_topk_naive(*args, **kwargs):
        scores, topk = original(*args, **kwargs)
        if record.segments is not None:  # one segment of a THD loop (kv_full generation)
            record.segments.append(scores.detach().clone())
            return scores, topk
        record.keep("scores", scores)
        record.keep("topk", topk)
        return scores, topk

    return fused_qk_topk_naive


def _wrap_segment_loop(original, record: Record, kv_arg: str):
    """A per-segment THD loop of production (``fused_qk_topk_naive_thd``, ``fwd_fused_indexer_loss_naive_thd``:
    one ``fused_qk_topk_naive`` call per segment with rows and compressed keys, as its ``cu_seqlens_q`` / ``kv_arg``
    say): keeps its inner calls' scores with those offsets (``segment_scores``)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def loop(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        outer, record.segments = record.segments, []
        try:
            out = original(*args, **kwargs)
            calls = record.segments
        finally:
            record.segments = outer
        record.keep("segment_scores", (calls, bound.arguments["cu_seqlens_q"].detach().clone(),
                                       bound.arguments[kv_arg].detach().clone(), int(bound.arguments["q"].shape[0])))
        return out

    return loop


def _wrap_to_local(original, record: Record):
    def _compressed_thd_topk_to_local(topk_indices, compressed_offset_per_row):
        out = original(topk_indices, compressed_offset_per_row)
        record.keep("topk_local", out)
        return out

    return _compressed_thd_topk_to_local


def _wrap_metadata(original, record: Record):
    def _build_compressed_thd_indexer_metadata(*args, **kwargs):
        out = original(*args, **kwargs)
        record.keep("compressed_offsets", out[3])
        return out

    return _build_compressed_thd_indexer_metadata


def _wrap_autoscaler(original, record: Record):
    class RecordingAutoScaler:
        """``DSAIndexerLossAutoScaler`` with its ``apply`` recording the indexer loss."""

        main_loss_backward_scale = None

        @staticmethod
        def apply(output, indexer_loss):
            record.keep("loss", indexer_loss)
            return original.apply(output, indexer_loss)

        def __getattr__(self, name):  # pragma: no cover - class-level access goes through the original
            return getattr(original, name)

    return RecordingAutoScaler


def _wrap_flash(original, record: Record):
    def flash_forward(*args, **kwargs):  # _csa_fwd_flash_mla / _dsa_fwd_flash_mla (per API generation)
        out, lse, lse_indexer = original(*args, **kwargs)
        record.keep("lse", lse)
        return out, lse, lse_indexer

    return flash_forward


def _wrap_flat_ids(original, record: Record):
    def build_flat_topk_idxs(*groups, **kwargs):
        if kwargs.get("cu_seqlens_q") is not None:  # THD: the selection in per-segment kv_full space
            record.keep("thd_kv_full_ids", torch.cat(groups, dim=-1))
            record.keep("thd_cu_seqlens_q", kwargs["cu_seqlens_q"])
        return original(*groups, **kwargs)

    return build_flat_topk_idxs


def _wrap_kv_full(original, record: Record):
    def build_cu_seqlens_kv_full(cu_seqlens_kv, cu_seqlens_compressed):
        record.keep("thd_cu_seqlens_kv", cu_seqlens_kv)
        return original(cu_seqlens_kv, cu_seqlens_compressed)

    return build_cu_seqlens_kv_full


class ScoresRecorded(Exception):
    """Raised by the fused path's top-k recorder in a :func:`recording` with ``stop_after_scores``: production has
    scored its indexer (``fused_topk`` / ``fused_scores`` are kept) and nothing after that call is wanted."""


def _wrap_topk_core(original, record: Record, stop: bool = False):
    def _indexer_topk_core(*args, **kwargs):
        topk, length, scores = original(*args, **kwargs)
        record.keep("fused_topk", topk)
        record.keep("fused_scores", scores)
        if stop:
            raise ScoresRecorded
        return topk, length, scores

    return _indexer_topk_core


def patched(module, name: str, value):
    """``module.name = value`` inside the block (restored after, also on error)."""
    return mock.patch.object(module, name, value)


@contextlib.contextmanager
def recording(mg: Megatron, *, stop_after_scores: bool = False) -> Iterator[Record]:
    """Install the recorders for one production call; yields the :class:`Record` they fill. ``stop_after_scores``:
    the fused path's ``_indexer_topk_core`` raises :class:`ScoresRecorded` once its result is kept."""
    record = Record()
    csa, dsa, generation = mg.module("csa"), mg.module("dsa"), mg.generation
    with contextlib.ExitStack() as stack:
        for module in (csa, dsa):
            stack.enter_context(patched(module, "fused_qk_topk_naive",
                                        _wrap_topk(module.fused_qk_topk_naive, record)))
        if generation.thd_topk == "to_local":
            stack.enter_context(patched(csa, "_compressed_thd_topk_to_local",
                                        _wrap_to_local(csa._compressed_thd_topk_to_local, record)))
            stack.enter_context(patched(csa, "_build_compressed_thd_indexer_metadata",
                                        _wrap_metadata(csa._build_compressed_thd_indexer_metadata, record)))
        else:  # kv_full: the THD selection as production hands it to its sparse attention
            stack.enter_context(patched(csa, "build_flat_topk_idxs",
                                        _wrap_flat_ids(csa.build_flat_topk_idxs, record)))
            stack.enter_context(patched(csa, "build_cu_seqlens_kv_full",
                                        _wrap_kv_full(csa.build_cu_seqlens_kv_full, record)))
            for module in (csa, dsa):  # the THD indexer's per-segment loop (eval), as csa and dsa call it
                stack.enter_context(patched(module, "fused_qk_topk_naive_thd",
                                            _wrap_segment_loop(module.fused_qk_topk_naive_thd, record,
                                                               "cu_seqlens_kv")))
            stack.enter_context(patched(dsa, "fwd_fused_indexer_loss_naive_thd",  # the THD training loss loop
                                        _wrap_segment_loop(dsa.fwd_fused_indexer_loss_naive_thd, record,
                                                           "cu_seqlens_compressed_idx")))
        stack.enter_context(patched(csa, "DSAIndexerLossAutoScaler",
                                    _wrap_autoscaler(csa.DSAIndexerLossAutoScaler, record)))
        fused = mg.fused()  # read on the fused path (emulated / cudnn providers)
        flash = generation.flash_forward
        stack.enter_context(patched(fused, flash, _wrap_flash(getattr(fused, flash), record)))
        stack.enter_context(patched(fused, "_indexer_topk_core",
                                    _wrap_topk_core(fused._indexer_topk_core, record, stop_after_scores)))
        yield record


# ---- layout conversions ---------------------------------------------------------------------------------------------
def contract_topk(ids: torch.Tensor, k: int) -> torch.Tensor:
    """Production's selection (any order, ``-1`` for invalid picks, width ``min(K, n)``) in the contract's form:
    int64, real ids ascending, ``-1`` padding at the end, width ``K``."""
    ids = ids.to(torch.int64)
    big = torch.iinfo(torch.int64).max
    ordered = torch.where(ids >= 0, ids, big).sort(dim=-1).values
    ordered = torch.where(ordered == big, -1, ordered)
    if ordered.shape[-1] < k:
        pad = ordered.new_full(ordered.shape[:-1] + (k - ordered.shape[-1],), -1)
        ordered = torch.cat([ordered, pad], -1)
    return ordered[..., :k]


def drop_masked(ids: torch.Tensor, scores: Optional[torch.Tensor]) -> torch.Tensor:
    """``-1`` for every pick whose own recorded score is ``-inf`` (a masked, non-causal key). The oldest API generation's
    ``fused_qk_topk_naive`` returns such picks and its caller drops them before the attention (``csa.py``'s causal
    post-filter); later ones mark them ``-1`` themselves (then this changes nothing). ``scores``: ``[..., sk]``
    production's masked index scores, ids ``[..., k]``."""
    if scores is None or ids.numel() == 0:
        return ids
    ids64 = ids.to(torch.int64)
    picked = torch.gather(scores.reshape(ids.shape[:-1] + scores.shape[-1:]), -1, ids64.clamp_min(0))
    return torch.where((ids64 >= 0) & torch.isneginf(picked), torch.full_like(ids64, -1), ids64)


def thd_kv_full_to_local(ids: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor) -> torch.Tensor:
    """THD selection in per-segment ``kv_full`` space (``[T, W + K]``: window ids ``< L_b`` then compressed ids
    ``L_b + j``, ``-1`` invalid; ``L_b`` the segment's KV length from ``cu_seqlens_kv``) -> segment-local compressed
    ids ``j`` (``-1`` elsewhere), ``[T, W + K]``; rows past ``cu_seqlens_q[-1]`` belong to the last segment."""
    cu_q, cu_kv = cu_seqlens_q.to(torch.int64), cu_seqlens_kv.to(torch.int64)
    rows = torch.arange(ids.shape[0], device=ids.device)
    seg = (torch.searchsorted(cu_q[1:], rows, right=True)).clamp_max(cu_q.numel() - 2)
    length = (cu_kv[1:] - cu_kv[:-1])[seg].view(-1, 1)
    ids64 = ids.to(torch.int64)
    return torch.where(ids64 >= length, ids64 - length, torch.full_like(ids64, -1))


def thd_segment_scores_to_local(segment_scores: tuple, width: int) -> torch.Tensor:
    """The scores of a per-segment THD loop (``(calls, cu_seqlens_q, cu_seqlens_k, total_q)``, one call per segment
    with rows and keys, each ``[1, sq_b, sk_b]`` by segment-local key) -> ``[total_q, width]`` at the rows the loop
    wrote them to; ``-inf`` elsewhere. Raises when the calls do not match the segments (a changed loop)."""
    calls, cu_q, cu_k, total = segment_scores
    dtype = calls[0].dtype if calls else torch.float32
    device = calls[0].device if calls else cu_q.device
    cu_q, cu_k = [int(v) for v in cu_q.tolist()], [int(v) for v in cu_k.tolist()]
    out = torch.full((total, width), float("-inf"), dtype=dtype, device=device)
    spans = [(cu_q[b], cu_q[b + 1], cu_k[b + 1] - cu_k[b]) for b in range(len(cu_q) - 1)
             if cu_q[b + 1] > cu_q[b] and cu_k[b + 1] > cu_k[b]]
    if len(spans) != len(calls):
        raise RuntimeError(f"production's per-segment THD loop made {len(calls)} top-k calls for {len(spans)} "
                           "segments with rows and keys (recorders.thd_segment_scores_to_local)")
    for (start, end, keys), scores in zip(spans, calls):
        block = scores.reshape(end - start, -1)[:, :width]
        out[start:end, : min(keys, width)] = block[:, : min(keys, width)]
    return out


def thd_scores_to_local(scores: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """THD index scores ``[1, T, total_comp]`` by global compressed row -> ``[T, width]`` by segment-local id
    (``offsets[t]`` = row ``t``'s first compressed row); columns past the buffer read ``-inf``."""
    flat = scores.reshape(scores.shape[-2], scores.shape[-1])
    total = flat.shape[-1]
    cols = offsets.to(torch.int64).view(-1, 1) + torch.arange(width, device=flat.device).view(1, -1)
    inside = cols < total
    picked = torch.gather(flat, 1, cols.clamp_max(max(total - 1, 0))) if total else \
        flat.new_full(cols.shape, float("-inf"))
    return torch.where(inside, picked, torch.full_like(picked, float("-inf")))


def optional(record: Record, name: str) -> Optional[torch.Tensor]:
    return record.get(name)
