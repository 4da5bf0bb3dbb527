"""Stand-ins for the CUDA-only parts of production's THD context-parallel branch, each written from production's
documented contract (the docstrings and kernel-contract comments of ``csa_utils/cp_layout_kernels.py`` and
``csa_utils/cp_utils.py``), never from its code, and each recorded in the run row.

* ``cp-compressor-input-compact`` — ``cp_layout_kernels.CompressorInputCompact`` (a CuTeDSL kernel; production raises
  ``RuntimeError`` for CPU tensors). Contract: the rank's rows are the global rows ``[global_start, global_start +
  l_local)``, its left boundary the ``d_window`` rows before them. For every packed sequence (``cu_seqlens``, the
  padded boundaries) that has rows before the rank's end and ends after its start, the *visible* full compression
  groups are those that start at or after ``global_start - d_comp`` and end before the rank's end (a group belongs
  to the rank holding its last token); they are enumerated sequence by sequence, group by group, and group ``j``'s
  ``ratio`` source rows are copied to compact rows ``[j·ratio, (j+1)·ratio)`` (from the boundary rows when before
  ``global_start``), its per-sequence group id to ``comp_ids[j]``. Compact rows past the visible groups are 0, their
  ``comp_ids`` -1; groups beyond ``c_cap`` are dropped (the kernel writes only rows ``< c_cap·ratio``). Backward:
  each compact row's gradient goes back to the one source row it was copied from; every other local / boundary row
  gets 0.
* ``cp-build-attention-indices`` — ``cp_layout_kernels.build_attention_indices`` (CuTeDSL). Contract: the rank's
  key buffer is ``[boundary (d_window) | local (l_local) | rank-major compressed rows]`` (compressed base
  ``d_window + l_local``); a global position ``p`` lives at ``p - (global_start - d_window)`` when ``p <
  global_start``, else at ``d_window + p - global_start``; a sequence-major compressed row ``m`` at ``base +
  seq_to_rank_row[m]`` (invalid when ``m`` is past the map or the map says -1). For the query at global row ``q``
  of the sequence starting at ``s`` the window is ``[max(q - window_size + 1, s), q]``. Three modes:
  ``compressed_topk is None`` (all visible compressed rows: window ids first, then the sequence's compressed rows
  ``0 .. min((q - s + 1) // ratio, compressed_width, its compressed count) - 1``; ``topk_length`` = that count);
  a selection (window ids, then the valid selected ids compacted in their order; ``topk_length`` = the number
  written); ``for_indexer_loss`` (the selected ids in their own columns first, -1 where invalid, then the window
  ids; ``indexer_rank_major`` = the selected ids' rank-major rows; no ``topk_length``). A row outside every
  sequence selects only key 0 (length 1) in the first two modes and nothing in the third. Width
  ``window_size + compressed_width``, -1 padded, int32.
* ``cp-pos-emb-cpu`` — ``rope_utils.get_pos_emb_on_this_cp_rank`` (zigzag CP slicing of a RoPE table: chunks
  ``rank`` and ``2·size - rank - 1`` of ``2·size`` along the sequence dim) builds its chunk index in pinned memory
  and moves it with ``.cuda()``; production's YaRN / RoPE modules call it when built with a CP group (their
  non-packed cos/sin cache; the THD CP path itself asks for packed tables, which skip it). The same selection with
  the index on the table's device.
* ``cp-indexer-layout-eager`` — ``@torch.compile cp_utils._build_cp_indexer_layout`` runs its own body without
  dynamo (compiling needs a C++ toolchain on a CPU and costs seconds per shape; same values).
* ``te-version`` — production's config validation requires TransformerEngine >= 2.9 for a
  ``sequence_packing_scheduler`` (``transformer_config.py``, "SFT sequence packing", a convergence note about TE's
  attention, which this layer does not use); without TE the check reads a satisfied version while the CP config
  (``context_parallel_size``, ``cp_partition_mode="contiguous"``, ``sequence_packing_scheduler="dp_balanced"``, as
  production's own CP tests set them) is built, so the rest of the CP validation runs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

#: stand-in name -> what it replaces (the run row lists the names)
STANDINS = {
    "cp-compressor-input-compact": "cp_layout_kernels.CompressorInputCompact (CuTeDSL) -> torch gather/scatter",
    "cp-build-attention-indices": "cp_layout_kernels.build_attention_indices (CuTeDSL) -> torch index lowering",
    "cp-indexer-layout-eager": "@torch.compile cp_utils._build_cp_indexer_layout run without dynamo",
    "cp-pos-emb-cpu": "rope_utils.get_pos_emb_on_this_cp_rank: its zigzag chunk index on the table's device "
                      "(no pinned memory, no .cuda())",
}
TE_VERSION = "te-version (sequence_packing_scheduler's TE >= 2.9 check, no TransformerEngine)"


# ---- compressor input compaction --------------------------------------------------------------------------------------
def compact_sources(cu_seqlens: torch.Tensor, global_start: int, l_local: int, ratio: int, d_comp: int,
                    c_cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, comp_ids)``: the global source row of each of the ``c_cap·ratio`` compact rows (-1 for an empty row)
    and the per-sequence group id of each of the ``c_cap`` compact groups (-1 past the visible ones)."""
    end = global_start + l_local
    srcs, ids = [], []
    bounds = [int(v) for v in cu_seqlens.tolist()]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        local_stop = min(stop, end)
        if not (start < local_stop and global_start < local_stop):
            continue
        first = -(-max(global_start - d_comp - start, 0) // ratio)
        last = (local_stop - start) // ratio
        for group in range(first, max(last, first)):
            ids.append(group)
            srcs.extend(range(start + group * ratio, start + (group + 1) * ratio))
    ids, srcs = ids[:c_cap], srcs[:c_cap * ratio]
    device = cu_seqlens.device
    src = torch.full((c_cap * ratio,), -1, dtype=torch.int64, device=device)
    comp = torch.full((c_cap,), -1, dtype=torch.int32, device=device)
    if srcs:
        src[:len(srcs)] = torch.tensor(srcs, dtype=torch.int64, device=device)
        comp[:len(ids)] = torch.tensor(ids, dtype=torch.int32, device=device)
    return src, comp


class CompressorInputCompact:
    """``cp_layout_kernels.CompressorInputCompact`` for any device: ``apply(hidden_local [l_local, ...],
    boundary_hidden [d_window, ...], cu_seqlens, global_start, ratio, d_comp, c_cap) -> (hidden_compact
    [c_cap·ratio, ...], comp_ids int32 [c_cap])``; differentiable in both hidden inputs (module docstring)."""

    @staticmethod
    def apply(hidden_local: torch.Tensor, boundary_hidden: torch.Tensor, cu_seqlens: torch.Tensor, global_start: int,
              ratio: int, d_comp: int, c_cap: int):
        l_local, d_window = hidden_local.shape[0], boundary_hidden.shape[0]
        src, comp_ids = compact_sources(cu_seqlens, int(global_start), int(l_local), int(ratio), int(d_comp),
                                        int(c_cap))
        rows = torch.cat((boundary_hidden, hidden_local), dim=0)  # global rows [global_start - d_window, end)
        index = (src - (int(global_start) - d_window)).clamp_min(0)
        picked = rows.index_select(0, index)
        keep = (src >= 0).view((-1,) + (1,) * (rows.dim() - 1))
        return torch.where(keep, picked, torch.zeros_like(picked)), comp_ids


# ---- final index lowering ---------------------------------------------------------------------------------------------
def build_attention_indices(cu_seqlens: torch.Tensor, global_start: int, l_local: int, d_window: int,
                            window_size: int, ratio: int, compressed_width: int,
                            compressed_topk: Optional[torch.Tensor] = None,
                            cu_seqlens_compressed: Optional[torch.Tensor] = None,
                            seq_to_rank_row: Optional[torch.Tensor] = None, for_indexer_loss: bool = False):
    """``cp_layout_kernels.build_attention_indices`` for any device (module docstring):
    ``(topk_idxs [l_local, window_size + compressed_width], topk_length [l_local] or None, indexer_rank_major
    [l_local, compressed_width] or None)``, int32, -1 padded."""
    if for_indexer_loss and compressed_topk is None:
        raise RuntimeError("DSv4 CP indexer-loss indices require compressed_topk.")
    device = cu_seqlens.device
    gs, l_local, d_window, window = int(global_start), int(l_local), int(d_window), int(window_size)
    width_c, total = int(compressed_width), int(window_size) + int(compressed_width)
    if cu_seqlens_compressed is None:
        cu_seqlens_compressed = cu_seqlens
    cu = cu_seqlens.to(torch.int64)
    cuc = cu_seqlens_compressed.to(torch.int64)
    q = torch.arange(gs, gs + l_local, device=device, dtype=torch.int64)
    n_seq = cu.shape[0] - 1
    seq = (torch.bucketize(q, cu[1:], right=True)).clamp_max(max(n_seq - 1, 0))
    found = (q >= cu[seq]) & (q < cu[seq + 1]) if n_seq > 0 else torch.zeros_like(q, dtype=torch.bool)
    seq_start = cu[seq]
    comp_start, comp_len = cuc[seq], cuc[seq + 1] - cuc[seq]
    if not (ratio > 1 and width_c > 0):
        comp_start, comp_len = torch.zeros_like(q), torch.zeros_like(q)
    base = d_window + l_local
    map_rows = seq_to_rank_row.to(torch.int64) if seq_to_rank_row is not None else torch.full((1,), -1,
                                                                                               device=device)

    def physical(pos: torch.Tensor) -> torch.Tensor:
        return torch.where(pos < gs, pos - (gs - d_window), d_window + pos - gs)

    def compressed(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Rank-major row of each per-sequence compressed id (-1 where invalid)."""
        major = comp_start.unsqueeze(1) + ids
        ok = valid & (ids >= 0) & (ids < comp_len.unsqueeze(1)) & (major < map_rows.shape[0])
        rank_major = map_rows[major.clamp(0, map_rows.shape[0] - 1)]
        return torch.where(ok & (rank_major >= 0), rank_major, torch.full_like(rank_major, -1))

    w_start = torch.maximum(q - window + 1, seq_start)
    w_count = q - w_start + 1
    cols_w = torch.arange(window, device=device, dtype=torch.int64).unsqueeze(0)
    w_valid = found.unsqueeze(1) & (cols_w < w_count.unsqueeze(1))
    w_ids = torch.where(w_valid, physical(w_start.unsqueeze(1) + cols_w), torch.full_like(cols_w, -1))

    out = torch.full((l_local, total), -1, dtype=torch.int64, device=device)
    length = torch.zeros(l_local, dtype=torch.int64, device=device)
    if for_indexer_loss or compressed_topk is not None:
        sel = compressed_topk.to(torch.int64)[:, :width_c] if width_c else \
            torch.zeros((l_local, 0), dtype=torch.int64, device=device)
        major = compressed(sel, found.unsqueeze(1))
        ids = torch.where(major >= 0, base + major, torch.full_like(major, -1))
        if for_indexer_loss:
            out[:, :width_c] = ids
            out[:, width_c:] = w_ids
            return out.to(torch.int32), None, major.to(torch.int32)
        # window ids first, then the valid selected ids in their own order, compacted
        merged = torch.cat((w_ids, ids), dim=1)
        valid = merged >= 0
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
        packed = torch.gather(merged, 1, order)
        out[:, :packed.shape[1]] = packed[:, :total]
        length = valid.sum(1)
    else:
        comp_count = torch.zeros_like(q)
        if ratio > 1 and width_c > 0:
            comp_count = torch.minimum(torch.minimum((q - seq_start + 1) // ratio,
                                                     torch.full_like(q, width_c)), comp_len)
        cols_c = torch.arange(width_c, device=device, dtype=torch.int64).unsqueeze(0)
        major = compressed(cols_c.expand(l_local, -1), found.unsqueeze(1) & (cols_c < comp_count.unsqueeze(1)))
        c_ids = torch.where(major >= 0, base + major, torch.full_like(major, -1))
        # window ids, then compressed ids at their columns window_count + j (as the kernel places them)
        row = torch.arange(l_local, device=device).unsqueeze(1)
        out[row.expand_as(w_ids), cols_w.expand_as(w_ids)] = w_ids
        target = w_count.unsqueeze(1) + cols_c
        inside = (cols_c < comp_count.unsqueeze(1)) & found.unsqueeze(1)
        out[row.expand_as(target)[inside], target[inside]] = c_ids[inside]
        length = torch.where(found, w_count + comp_count, torch.zeros_like(q))
    if total > 0:  # a row outside every sequence selects key 0 only
        out[~found] = -1
        out[~found, 0] = 0
        length = torch.where(found, length, torch.ones_like(length))
    return out.to(torch.int32), length.to(torch.int32), None


# ---- RoPE tables under CP --------------------------------------------------------------------------------------------
def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Chunks ``rank`` and ``2·size - rank - 1`` of ``pos_emb`` cut into ``2·size`` along ``seq_dim`` (zigzag)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    n, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * n - rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * n, -1, *pos_emb.shape[seq_dim + 1:])
    picked = chunks.index_select(seq_dim, index)
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])


# ---- installation -----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def te_version_satisfied(mg, active: bool) -> Iterator[None]:
    """``transformer_config.is_te_min_version`` reads a satisfied version inside the block (only when ``active``:
    TE is absent and a CP config is being built)."""
    module = mg.modules["megatron.core.transformer.transformer_config"]
    original = getattr(module, "is_te_min_version", None)
    if not active or original is None:
        yield
        return
    module.is_te_min_version = lambda *_args, **_kwargs: True
    try:
        yield
    finally:
        module.is_te_min_version = original


def install(mg, used: list) -> None:
    """Put the CP stand-ins into production's modules for this (rank) process; appends their names to ``used``."""
    from .loader import VARIANT

    kernels = __import__(f"{VARIANT}.csa_utils.cp_layout_kernels", fromlist=["build_attention_indices"])
    utils = __import__(f"{VARIANT}.csa_utils.cp_utils", fromlist=["prepare_cp_compressor_input"])
    if not getattr(kernels, "_CUTE_AVAILABLE", False) or not torch.cuda.is_available():
        kernels.CompressorInputCompact = CompressorInputCompact
        kernels.build_attention_indices = build_attention_indices
        used += ["cp-compressor-input-compact", "cp-build-attention-indices"]
    if not torch.cuda.is_available():
        for name in ("megatron.core.models.common.embeddings.rope_utils",
                     "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
                     "megatron.core.models.common.embeddings.rotary_pos_embedding"):
            module = __import__(name, fromlist=["get_pos_emb_on_this_cp_rank"])
            if hasattr(module, "get_pos_emb_on_this_cp_rank"):
                module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
        used.append("cp-pos-emb-cpu")
    compiled = utils._build_cp_indexer_layout
    eager = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(compiled, "__wrapped__", None)
    if eager is not None:
        utils._build_cp_indexer_layout = eager
        used.append("cp-indexer-layout-eager")
