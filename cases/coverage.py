"""Coverage accounting: the feature cells a case hits, and which of a suite's required cells its cases cover.

:func:`features` maps a case to a flat ``{feature: value}`` dict (values are strings or booleans). The parity engine
records it per case (results JSONL field ``features``); the mutation suite uses it to name the cell a suite misses.

A *cell* is a conjunction of feature values, written ``"layout=thd ratio=4 loss=sparse"``. A suite declares the
cells it must hit (:mod:`cases.suites`); :func:`check_coverage` raises :class:`~cases.errors.CaseError` when one is not.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence, Union

from .case import Case
from .layout import ThdLayout
from .errors import CaseError
from .packing import capacity_kind, segment_bucket

Value = Union[str, bool]
Cell = tuple[tuple[str, Value], ...]

#: Every feature name :func:`features` returns, in display order, with a one-line meaning.
FEATURES: dict[str, str] = {
    "profile": "scale profile (tiny / kernel / flash / pro)",
    "device": "any (CPU ok) or cuda",
    "layout": "bshd or thd",
    "ratio": "compress_ratio: 0 window-only, 4 CSA, 128 HCA",
    "dense_mode": "csa_dense_mode (r=4 without indexer)",
    "loss": "indexer loss: none / dense / sparse",
    "reduction": "loss reduction: mean / per_token (n/a without loss)",
    "training": "training (loss computed) or eval (Path C)",
    "dtype": "float64 / float32 / bfloat16",
    "scope": "layer or core",
    "heads": "num_attention_heads",
    "window": "csa_window_size",
    "topk": "dsa_indexer_topk",
    "sequences": "number of real sequences (BSHD batch, THD segments with tokens): 1 / 2-3 / 4+",
    "short_segment": "a sequence with 0 < length < r (no compressed key visible)",
    "partial_block": "a sequence longer than r whose length is not a multiple of r",
    "block_aligned": "a sequence whose length is a positive multiple of r",
    "window_saturated": "a sequence longer than the window W",
    "topk_saturated": "r=4 with indexer and a row with more than K visible compressed keys (top-k must choose)",
    "alignment_padding": "THD: a segment with padding rows after its real tokens (cu_seqlens != cu_seqlens_padded)",
    "zero_length_segment": "THD: an empty segment followed by a non-empty one",
    "cu_capacity_padding": "THD: cu_seqlens padded to a fixed capacity by repeating the last entry",
    "dummy_tail": "THD: a segment with padding rows only",
    "slack": "THD: buffer rows past the last boundary",
    "identical_segments": "THD: two segments of identical real and padded length",
    "capacity": "THD compressed-row capacity: n/a / none / exact / production / over",
    "padding_dout": "output gradient on THD padding rows: n/a (none) / zero (layer) / random (core) / poison (huge)",
    "loss_coeff": "indexer loss coefficient: zero (a real training value: the indexer keeps zero gradients) / positive "
                  "/ n/a (no loss)",
    "rope_fusion": "production's apply_rope_fusion (its fused Triton MLA RoPE: CUDA only)",
}


def features(case: Case) -> dict[str, Value]:
    """The coverage features of ``case`` (keys: :data:`FEATURES`)."""
    c = case.config
    r, W, K = c.compress_ratio, c.csa_window_size, c.dsa_indexer_topk
    layout = case.layout
    if isinstance(layout, ThdLayout):
        reals = [L for L in layout.real_lengths if L > 0]
    else:
        reals = [layout.seq_len] * layout.batch
    f: dict[str, Value] = {
        "profile": case.profile,
        "device": case.device,
        "layout": "thd" if case.is_thd else "bshd",
        "ratio": str(r),
        "dense_mode": c.csa_dense_mode,
        "loss": case.loss_mode,
        "reduction": case.loss_reduction if case.loss_mode != "none" else "n/a",
        "training": case.training,
        "dtype": case.dtype,
        "scope": case.scope,
        "heads": str(c.num_attention_heads),
        "window": str(W),
        "topk": str(K),
        "sequences": segment_bucket(len(reals)),
        "short_segment": r > 1 and any(L < r for L in reals),
        "partial_block": r > 1 and any(L > r and L % r for L in reals),
        "block_aligned": r > 1 and any(L % r == 0 for L in reals),
        "window_saturated": any(L > W for L in reals),
        "topk_saturated": c.has_indexer and any(L // 4 > K for L in reals),
    }
    f.update(_packing_features(layout, r))
    f["padding_dout"] = _padding_dout(case)
    f["loss_coeff"] = "n/a" if case.loss_mode == "none" else ("zero" if c.dsa_indexer_loss_coeff == 0 else "positive")
    f["rope_fusion"] = c.apply_rope_fusion
    return f


def _padding_dout(case: Case) -> str:
    if not case.has_padding_rows:
        return "n/a"
    if case.padding_dout == "poison":
        return "poison"
    return "zero" if case.scope == "layer" else "random"


def _packing_features(layout, ratio: int) -> dict[str, Value]:
    if not isinstance(layout, ThdLayout):
        return {"alignment_padding": False, "zero_length_segment": False, "cu_capacity_padding": False,
                "dummy_tail": False, "slack": False, "identical_segments": False, "capacity": "n/a"}
    real, padded = layout.real_lengths, layout.padded_lengths
    nonempty = [b for b, L in enumerate(padded) if L > 0]
    last = nonempty[-1] if nonempty else -1
    pairs = [(real[b], padded[b]) for b in range(len(real)) if real[b] > 0]
    return {
        "alignment_padding": any(0 < R < P for R, P in zip(real, padded)),
        "zero_length_segment": any(padded[b] == 0 for b in range(last)),
        "cu_capacity_padding": layout.num_segments > last + 1,
        "dummy_tail": any(R == 0 < P for R, P in zip(real, padded)),
        "slack": layout.total_tokens > layout.cu_seqlens_padded[-1],
        "identical_segments": len(set(pairs)) < len(pairs),
        "capacity": capacity_kind(layout, ratio),
    }


# ---- cells -----------------------------------------------------------------------------------------------------------
def _format_value(value: Value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else value


def cell_name(cell: Union[Cell, Mapping[str, Value]]) -> str:
    items = cell.items() if isinstance(cell, Mapping) else cell
    return " ".join(f"{k}={_format_value(v)}" for k, v in items)


def parse_cell(text: str) -> Cell:
    """``"layout=thd slack=true"`` → ``(("layout", "thd"), ("slack", True))``; names the bad part on error."""
    items = []
    for part in text.split():
        key, sep, raw = part.partition("=")
        if not sep or key not in FEATURES:
            raise CaseError("cell", f"{part!r} in {text!r} is not feature=value (features: {', '.join(FEATURES)})")
        items.append((key, True if raw == "true" else False if raw == "false" else raw))
    if not items:
        raise CaseError("cell", "empty cell")
    return tuple(items)


def hits(feats: Mapping[str, Value], cell: Cell) -> bool:
    return all(feats.get(k) == v for k, v in cell)


def coverage_counts(cases: Iterable[Case], cells: Sequence[Cell]) -> list[tuple[Cell, int]]:
    """How many cases hit each cell."""
    all_feats = [features(c) for c in cases]
    return [(cell, sum(hits(f, cell) for f in all_feats)) for cell in cells]


def missing_cells(cases: Iterable[Case], cells: Sequence[Cell]) -> list[Cell]:
    return [cell for cell, n in coverage_counts(cases, cells) if n == 0]


def check_coverage(cases: Sequence[Case], cells: Sequence[Cell], suite: str = "suite") -> None:
    """Raise :class:`CaseError` naming every required cell no case of ``suite`` hits."""
    missing = missing_cells(cases, cells)
    if missing:
        listed = "; ".join(cell_name(c) for c in missing)
        raise CaseError(f"suites.{suite}.required_cells",
                        f"{len(missing)} of {len(cells)} declared cells are not hit by any case: {listed}")


def marginals(cases: Iterable[Case]) -> dict[str, Counter]:
    """Per feature, how many cases take each value."""
    table: dict[str, Counter] = {name: Counter() for name in FEATURES}
    for case in cases:
        for name, value in features(case).items():
            table[name][_format_value(value)] += 1
    return table


def format_table(cases: Sequence[Case], cells: Sequence[Cell] = ()) -> str:
    """A plain-text coverage report: required cells with hit counts, then every feature's value counts."""
    lines = []
    if cells:
        counts = coverage_counts(cases, cells)
        width = max(len(cell_name(c)) for c in cells)
        lines.append(f"required cells ({sum(n > 0 for _, n in counts)}/{len(cells)} hit, {len(cases)} cases)")
        for cell, n in counts:
            lines.append(f"  {cell_name(cell):<{width}}  {n:>5}{'' if n else '  MISSING'}")
    lines.append("feature values")
    for name, counter in marginals(cases).items():
        values = ", ".join(f"{v}: {n}" for v, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"  {name:<20} {values}")
    return "\n".join(lines)
