"""THD packings: building a :class:`~cases.layout.ThdLayout` from segments, the capacity rule, and a weighted sampler.

The sampler covers the packing space of spec §6.2–§6.4 and the issue's list:

* segment count 1 … many; lengths from a mixture of classes (tiny, shorter than ``r``, shorter than ``W``, exact
  multiples of ``r``, non-multiples, long, and explicit edge values such as ``r±1``, ``W±1``, ``r·K``);
* zero-length segments (interior, or ``cu_seqlens`` padded to a fixed capacity by repeating the last entry);
* per-segment alignment padding (``cu_seqlens`` ≠ ``cu_seqlens_padded``) and a dummy tail segment (no real token);
* buffer slack past the last boundary;
* a compressed-row capacity: none, the exact count, production's rule, or larger;
* identical segments.

Rare features are drawn with boosted probabilities (the cudnn-frontend fuzzer's approach) so that a few dozen cases
hit each of them. Any feature can be forced on or off (``force``); the generator checks the result and retries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from .layout import ThdLayout
from .rng import Rng

CAPACITY_CHOICES = ("none", "exact", "production", "over")

#: Weighted classes of segment lengths (see :func:`sample_length`).
LENGTH_CLASSES = (("tiny", 2), ("below_ratio", 3), ("below_window", 3), ("ratio_multiple", 3),
                  ("ratio_non_multiple", 3), ("long", 3), ("edge", 4))


@dataclass(frozen=True)
class Segment:
    """One packed sequence: ``real`` tokens stored at the head of ``padded`` physical rows (``real ≤ padded``)."""

    real: int
    padded: int


def build_layout(segments: Sequence[Segment], *, slack: int = 0, capacity: Optional[int] = None) -> ThdLayout:
    """The THD layout of ``segments`` packed back to back, ``slack`` extra rows after the last boundary."""
    cu, cu_padded = [0], [0]
    for seg in segments:
        cu.append(cu[-1] + seg.real)
        cu_padded.append(cu_padded[-1] + seg.padded)
    total = cu_padded[-1] + slack
    return ThdLayout(cu_seqlens=tuple(cu), cu_seqlens_padded=tuple(cu_padded), total_tokens=max(total, 1),
                     compressed_capacity=capacity).validate()


def segments_of(layout: ThdLayout) -> list[Segment]:
    return [Segment(real, padded) for real, padded in zip(layout.real_lengths, layout.padded_lengths)]


def slack_of(layout: ThdLayout) -> int:
    return layout.total_tokens - layout.cu_seqlens_padded[-1]


def production_capacity(layout: ThdLayout, ratio: int) -> int:
    """Spec §6.4 (``_get_csa_compressed_capacity``): ``min(T // r, N_seqs * (max_seqlen_q // r))``.

    ``N_seqs`` counts every segment, zero-length and dummy ones included; ``max_seqlen_q`` is the largest padded
    length. It is always ≥ the true compressed row count.
    """
    if ratio <= 1:
        return 0
    return min(layout.total_tokens // ratio, layout.num_segments * (layout.max_seqlen // ratio))


def capacity_for(layout: ThdLayout, ratio: int, choice: str, extra: int = 0) -> Optional[int]:
    """The compressed capacity for ``choice`` ∈ :data:`CAPACITY_CHOICES` (``"over"`` adds ``extra`` ≥ 1 rows)."""
    if ratio <= 1 or choice == "none":
        return None
    true_rows = layout.cu_seqlens_compressed(ratio)[-1]
    if choice == "exact":
        return true_rows
    if choice == "production":
        return production_capacity(layout, ratio)
    if choice == "over":
        return max(production_capacity(layout, ratio), true_rows) + max(extra, 1)
    raise ValueError(f"unknown capacity choice {choice!r}")


def capacity_kind(layout: ThdLayout, ratio: int) -> str:
    """Classify a layout's capacity: ``n/a`` (no compressor), ``none``, ``exact``, ``production`` or ``over``."""
    if ratio <= 1:
        return "n/a"
    cap = layout.compressed_capacity
    if cap is None:
        return "none"
    if cap == production_capacity(layout, ratio):
        return "production"
    if cap == layout.cu_seqlens_compressed(ratio)[-1]:
        return "exact"
    return "over"


# ---- lengths ---------------------------------------------------------------------------------------------------------
def edge_lengths(ratio: int, window: int, topk: int) -> list[int]:
    """Explicit edge values: around one compressed block, one window, and the point where top-k starts to select."""
    r = ratio if ratio > 1 else 4
    values = {1, 2, r - 1, r, r + 1, 2 * r, 2 * r + 1, window - 1, window, window + 1, 2 * window}
    if ratio == 4:
        values |= {4 * topk, 4 * topk + 3, 4 * topk + 4, 4 * (topk + 1) + 1}
    return sorted(v for v in values if v >= 1)


def sample_length(rng: Rng, klass: str, *, ratio: int, window: int, topk: int, cap: int) -> int:
    """A segment length of class ``klass`` in ``[1, cap]`` (falls back to ``[1, cap]`` if the class cannot fit)."""
    r = ratio if ratio > 1 else 4
    cap = max(cap, 1)
    lo, hi = 1, cap
    if klass == "tiny":
        hi = 3
    elif klass == "below_ratio":
        hi = r - 1
    elif klass == "below_window":
        hi = window - 1
    elif klass == "ratio_multiple":
        blocks = cap // r
        if blocks >= 1:
            return r * rng.between(1, blocks)
    elif klass == "ratio_non_multiple":
        blocks = (cap - 1) // r
        if blocks >= 1:
            b = rng.between(1, blocks)
            return r * b + rng.between(1, min(r - 1, cap - r * b))
        hi = min(cap, r - 1)
    elif klass == "long":
        lo = window + 1
    elif klass == "topk_long":  # enough compressed keys that the indexer must choose (r = 4 only)
        lo = 4 * topk + 4
    elif klass == "edge":
        options = [v for v in edge_lengths(ratio, window, topk) if v <= cap]
        if options:
            return rng.choice(options)
    else:
        raise ValueError(f"unknown length class {klass!r}")
    hi = min(hi, cap)
    if lo > hi:
        lo, hi = 1, cap
    return rng.between(lo, hi)


# ---- the packing sampler ---------------------------------------------------------------------------------------------
Force = Mapping[str, Union[bool, str]]

#: Base rates (percent) of the optional packing features.
RATES = {"identical_segments": 15, "zero_length_segment": 20, "alignment_padding": 35, "dummy_tail": 20,
         "cu_capacity_padding": 25, "slack": 20}
SEGMENT_BUCKETS = (("1", 3), ("2-3", 5), ("4+", 3))


def segment_bucket(n: int) -> str:
    return "1" if n <= 1 else "2-3" if n <= 3 else "4+"


def _rate(force: Force, name: str) -> int:
    if name in force:
        return 100 if force[name] else 0
    return RATES[name]


def sample_packing(rng: Rng, *, ratio: int, window: int, topk: int, budget: int, force: Force = {}) -> ThdLayout:
    """Draw one THD layout with at most ``budget`` buffer rows and at least one real token.

    ``force`` maps feature names of :func:`cases.coverage.features` to required values; this function biases its
    draws toward them (it does not guarantee them: the generator checks the features and draws again).
    """
    r = ratio if ratio > 1 else 4
    bucket = force.get("sequences") or rng.weighted(SEGMENT_BUCKETS)
    n_real = {"1": 1, "2-3": rng.between(2, 3), "4+": rng.between(4, 7)}[bucket]
    extras = any(_rate(force, k) == 100 for k in ("alignment_padding", "dummy_tail", "slack"))
    real_budget = max(n_real, budget * 2 // 3 if extras else budget)

    # Lengths: forced classes first, then the weighted mixture; each bounded by what the budget still allows.
    wanted = []
    if force.get("short_segment") and ratio > 1:
        wanted.append("below_ratio")
    if force.get("topk_saturated") and ratio == 4:
        wanted.append("topk_long")
    if force.get("window_saturated"):
        wanted.append("long")
    if force.get("partial_block"):
        wanted.append("ratio_non_multiple")
    if force.get("block_aligned"):
        wanted.append("ratio_multiple")
    if ratio == 128 and not force.get("short_segment") and rng.chance(85):
        wanted.append("ratio_multiple" if rng.chance(40) else "ratio_non_multiple")  # r=128 needs ≥128 rows
    identical = rng.chance(_rate(force, "identical_segments")) and n_real >= 2
    lengths: list[int] = []
    lengths_copied: list[int] = []
    for i in range(n_real):
        if identical and i == n_real - 1:
            lengths.append(rng.choice(lengths))
            lengths_copied.append(lengths[-1])
            break
        left = n_real - i - 1
        cap = real_budget - sum(lengths) - left
        klass = wanted[i] if i < len(wanted) else rng.weighted(LENGTH_CLASSES)
        lengths.append(sample_length(rng, klass, ratio=ratio, window=window, topk=topk, cap=cap))
    order = list(range(n_real))
    for i in range(n_real - 1, 0, -1):  # Fisher–Yates with our own stream
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    lengths = [lengths[i] for i in order]

    # Alignment padding: round each segment up to a multiple of A (production pads to multiples of max(r, 4)),
    # or add a few ragged rows to some segments.
    segments = [Segment(L, L) for L in lengths]
    if rng.chance(_rate(force, "alignment_padding")):
        if rng.chance(70):
            align = rng.choice(sorted({max(r, 4), 4, 8, 16}))
            segments = [Segment(s.real, -(-s.real // align) * align) for s in segments]
        if all(s.real == s.padded for s in segments):
            k = rng.below(len(segments))
            segments[k] = Segment(segments[k].real, segments[k].padded + rng.between(1, 3))
        if identical:  # keep the copies identical: every segment of the duplicated length takes one padding
            dup = lengths_copied[0]
            widest = max((s for s in segments if s.real == dup), key=lambda s: s.padded)
            segments = [widest if s.real == dup else s for s in segments]
    if rng.chance(_rate(force, "zero_length_segment")):
        segments.insert(rng.below(len(segments)), Segment(0, 0))  # interior or leading empty segment
    if rng.chance(_rate(force, "dummy_tail")):
        used = sum(s.padded for s in segments)
        static = -(-(used + 1) // 16) * 16  # fill up to a "static" token count
        segments.append(Segment(0, rng.choice([static - used, rng.between(1, 8)])))
    if rng.chance(_rate(force, "cu_capacity_padding")):
        segments.extend([Segment(0, 0)] * rng.between(1, 3))
    slack = rng.between(1, 8) if rng.chance(_rate(force, "slack")) else 0

    layout = build_layout(segments, slack=slack)
    choice = force.get("capacity")
    if choice in (None, "n/a"):
        choice = rng.weighted((("none", 4), ("production", 3), ("exact", 1), ("over", 1)))
    cap = capacity_for(layout, ratio, choice, extra=rng.between(1, 3))
    return build_layout(segments, slack=slack, capacity=cap)
