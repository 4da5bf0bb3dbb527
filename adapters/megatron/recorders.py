"""Recorders on production functions: what production itself computed, captured while it runs.

Each recorder replaces one name in the module namespace where production *calls* it (``csa``, ``dsa``) by a wrapper
that calls the original and keeps a detached copy of its result; :func:`recording` installs them for one call and
restores the originals after. Nothing here recomputes a production value; conversions are layout only (global ->
local compressed ids, a sort and ``-1`` padding to width ``K``).

Recorded (the last forward call wins):

* ``scores`` / ``topk`` — ``fused_qk_topk_naive`` (unfused paths; ``dsa.py``): the masked index scores and the
  selected ids, cloned at once (``compute_dsa_indexer_loss`` later adds masks to the score tensor in place);
* ``topk_local`` — ``_compressed_thd_topk_to_local`` (THD): segment-local ids; ``compressed_offsets`` —
  ``_build_compressed_thd_indexer_metadata``'s per-row compressed offset, to read THD scores by local id;
* ``loss`` — ``DSAIndexerLossAutoScaler.apply(output, indexer_loss)``: the loss production attaches to the output;
* ``lse`` / ``fused_topk`` / ``fused_scores`` — written by the emulated kernel stand-ins (``emulated.py``).
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock
from typing import Any, Iterator, Optional

import torch

from .loader import Megatron

FUSED = "megatron.core.transformer.experimental_attention_variant.csa_utils.fused_sparse_attention"


class Record(dict):
    """``{name: tensor}`` of one production call (detached)."""

    def keep(self, name: str, value: Any) -> None:
        self[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value


def _wrap_topk(original, record: Record):
    def fused_qk_topk_naive(*args, **kwargs):
        scores, topk = original(*args, **kwargs)
        record.keep("scores", scores)
        record.keep("topk", topk)
        return scores, topk

    return fused_qk_topk_naive


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
    def _csa_fwd_flash_mla(*args, **kwargs):
        out, lse, lse_indexer = original(*args, **kwargs)
        record.keep("lse", lse)
        return out, lse, lse_indexer

    return _csa_fwd_flash_mla


def _wrap_topk_core(original, record: Record):
    def _indexer_topk_core(*args, **kwargs):
        topk, length, scores = original(*args, **kwargs)
        record.keep("fused_topk", topk)
        record.keep("fused_scores", scores)
        return topk, length, scores

    return _indexer_topk_core


def patched(module, name: str, value):
    """``module.name = value`` inside the block (restored after, also on error)."""
    return mock.patch.object(module, name, value)


@contextlib.contextmanager
def recording(mg: Megatron) -> Iterator[Record]:
    """Install the recorders for one production call; yields the :class:`Record` they fill."""
    record = Record()
    csa, dsa = mg.module("csa"), mg.module("dsa")
    with contextlib.ExitStack() as stack:
        for module in (csa, dsa):
            stack.enter_context(patched(module, "fused_qk_topk_naive",
                                        _wrap_topk(module.fused_qk_topk_naive, record)))
        stack.enter_context(patched(csa, "_compressed_thd_topk_to_local",
                                    _wrap_to_local(csa._compressed_thd_topk_to_local, record)))
        stack.enter_context(patched(csa, "_build_compressed_thd_indexer_metadata",
                                    _wrap_metadata(csa._build_compressed_thd_indexer_metadata, record)))
        stack.enter_context(patched(csa, "DSAIndexerLossAutoScaler",
                                    _wrap_autoscaler(csa.DSAIndexerLossAutoScaler, record)))
        fused = sys.modules.get(FUSED)
        if fused is not None:  # the fused path (emulated / cudnn providers)
            stack.enter_context(patched(fused, "_csa_fwd_flash_mla", _wrap_flash(fused._csa_fwd_flash_mla, record)))
            stack.enter_context(patched(fused, "_indexer_topk_core", _wrap_topk_core(fused._indexer_topk_core,
                                                                                      record)))
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
