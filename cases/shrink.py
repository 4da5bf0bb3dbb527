"""Shrinking a failing case: find a smaller case on which the same predicate still holds ("still fails").

A greedy delta-debugging loop. From the current case, :func:`candidates` proposes simpler cases, biggest steps first:
drop chunks of THD segments (halves, quarters, …, single ones — Zeller's ddmin), drop padding / slack / capacity /
zero-length entries, shorten sequences (halve, then −1), make a single plain segment BSHD, then shrink the model
(heads, groups, window, top-k, indexer heads, ranks, head dims), then prefer float64, core scope, eval. The first
candidate that is strictly smaller by :func:`size` and still fails replaces the current case, and the loop restarts;
it ends when no candidate fails (a 1-minimal case for these moves) or after ``max_calls`` predicate calls.

THD capacity is re-derived after a layout change with the same rule (none / exact / production / over), so a case
keeps its capacity kind while it shrinks.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from .case import Case
from .config import ModelConfig
from .errors import CaseError
from .layout import BshdLayout, ThdLayout
from .packing import (Segment, build_layout, capacity_for, capacity_kind, production_capacity, segments_of,
                      slack_of)

Predicate = Callable[[Case], bool]
_DTYPE_RANK = {"float64": 0, "float32": 1, "bfloat16": 2}


def size(case: Case) -> int:
    """A size measure every shrinking move strictly decreases (so the loop terminates)."""
    c, layout = case.config, case.layout
    if isinstance(layout, ThdLayout):
        shape = (layout.total_tokens + 2 * layout.num_segments + (layout.compressed_capacity is not None) + 1
                 + sum(p - r for r, p in zip(layout.real_lengths, layout.padded_lengths)))
    else:
        shape = layout.batch * layout.seq_len + 2 * layout.batch
    model = (c.num_attention_heads + c.o_groups + c.csa_window_size + c.dsa_indexer_topk + c.dsa_indexer_n_heads
             + c.hidden_size + c.q_lora_rank + c.o_lora_rank + c.v_head_dim + c.qk_pos_emb_head_dim
             + c.dsa_indexer_head_dim)
    flags = _DTYPE_RANK[case.dtype] + (case.scope == "layer") + case.training
    return 1000 * shape + 10 * model + flags


def _with_layout(case: Case, segments: list[Segment], slack: int) -> Optional[Case]:
    r = case.config.compress_ratio
    if not any(s.real for s in segments):
        return None  # keep at least one real token
    kind = capacity_kind(case.layout, r)
    plain = build_layout(segments, slack=slack)
    extra = 0
    if kind == "over":
        true_rows = case.layout.cu_seqlens_compressed(r)[-1]
        extra = case.layout.compressed_capacity - max(production_capacity(case.layout, r), true_rows)
    cap = capacity_for(plain, r, {"n/a": "none"}.get(kind, kind), extra=extra)
    return case.replace(layout=build_layout(segments, slack=slack, capacity=cap))


def _layout_moves(case: Case) -> Iterator[tuple[str, Callable[[], Optional[Case]]]]:
    """Layout moves as (label, thunk): building a candidate may raise CaseError, which the caller skips."""
    layout = case.layout
    if isinstance(layout, BshdLayout):
        B, S = layout.batch, layout.seq_len
        if B > 1:
            yield "batch 1", lambda: case.replace(layout=BshdLayout(1, S))
            yield f"batch {B - 1}", lambda: case.replace(layout=BshdLayout(B - 1, S))
        if S > 1:
            yield f"seq_len {S // 2}", lambda: case.replace(layout=BshdLayout(B, max(S // 2, 1)))
            yield f"seq_len {S - 1}", lambda: case.replace(layout=BshdLayout(B, S - 1))
        return
    segs, slack = segments_of(layout), slack_of(layout)
    n = len(segs)
    chunk = n // 2
    while chunk >= 1:  # ddmin: remove complements of growing granularity
        for start in range(0, n, chunk):
            kept = segs[:start] + segs[start + chunk:]
            if kept:
                yield f"drop segments {start}..{start + chunk - 1}", lambda: _with_layout(case, kept, slack)
        chunk //= 2
    if slack:
        yield "drop slack", lambda: _with_layout(case, segs, 0)
    if layout.compressed_capacity is not None:
        yield "drop capacity", lambda: case.replace(layout=build_layout(segs, slack=slack))
    if any(s.padded > s.real for s in segs):
        yield "drop all padding", lambda: _with_layout(case, [Segment(s.real, s.real) for s in segs], slack)
    for b, s in enumerate(segs):
        def with_seg(new: Segment) -> Optional[Case]:
            return _with_layout(case, segs[:b] + [new] + segs[b + 1:], slack)
        pad = s.padded - s.real
        if pad:
            yield f"segment {b}: padding {pad // 2}", lambda: with_seg(Segment(s.real, s.real + pad // 2))
            yield f"segment {b}: padding {pad - 1}", lambda: with_seg(Segment(s.real, s.padded - 1))
        if s.real > 1:
            yield f"segment {b}: length {s.real // 2}", lambda: with_seg(Segment(s.real // 2, s.real // 2 + pad))
            yield f"segment {b}: length {s.real - 1}", lambda: with_seg(Segment(s.real - 1, s.padded - 1))
    if n == 1 and not slack and segs[0].padded == segs[0].real and layout.compressed_capacity is None:
        yield "bshd", lambda: case.replace(layout=BshdLayout(1, segs[0].real))


#: Smallest values the shrinker halves a dimension down to: below these the model degenerates (e.g. no un-rotated
#: head dims) and a "still fails" would more likely be a different failure.
FLOORS = {"csa_window_size": 1, "dsa_indexer_topk": 1, "dsa_indexer_n_heads": 1, "hidden_size": 16,
          "q_lora_rank": 8, "o_lora_rank": 8, "v_head_dim": 16, "dsa_indexer_head_dim": 8, "qk_pos_emb_head_dim": 4}


def _config_moves(config: ModelConfig) -> Iterator[tuple[str, dict]]:
    c = config
    n, G = c.num_attention_heads, c.o_groups
    if n > 1:
        yield f"heads {n // 2}", {"num_attention_heads": n // 2, "o_groups": min(G, n // 2)}
    if G > 1:
        yield f"o_groups {G // 2}", {"o_groups": G // 2}
    for name, floor in FLOORS.items():
        value = getattr(c, name)
        if value // 2 >= floor and not (name == "v_head_dim" and value // 2 <= c.qk_pos_emb_head_dim):
            yield f"{name} {value // 2}", {name: value // 2}
    for name in ("csa_window_size", "dsa_indexer_topk"):
        value = getattr(c, name)
        if value > 1:
            yield f"{name} {value - 1}", {name: value - 1}


def candidates(case: Case) -> Iterator[tuple[str, Case]]:
    """Simpler variants of ``case`` with a label each; invalid variants are skipped.

    Moves are (label, thunk) pairs; each thunk is called at once, before the move generator advances (so the
    thunks may close over loop variables), and a :class:`CaseError` it raises just skips that move.
    """
    def moves() -> Iterator[tuple[str, Callable[[], Optional[Case]]]]:
        yield from _layout_moves(case)
        for label, changes in _config_moves(case.config):
            yield label, lambda: case.replace(config=case.config.replace(**changes))
        if case.dtype != "float64":
            yield "float64", lambda: case.replace(dtype="float64")
        if case.scope != "core":
            yield "core scope", lambda: case.replace(scope="core")
        if case.training:
            yield "eval (no loss)", lambda: case.replace(training=False)

    for label, thunk in moves():
        try:
            cand = thunk()
        except CaseError:
            continue  # the move makes an invalid case (e.g. heads not divisible by o_groups)
        if cand is not None:
            yield label, cand


def shrink(case: Case, predicate: Predicate, *, max_calls: int = 1000,
           log: Optional[Callable[[str], None]] = None) -> Case:
    """The smallest case reachable from ``case`` by :func:`candidates` moves on which ``predicate`` is True.

    ``predicate(case)`` returns True when the case still fails; an exception inside it counts as False (a different
    failure). ``log`` (e.g. ``print``) receives one line per accepted step and a closing line (the caller prints the
    repro: only it knows the options that reproduce the failure).
    """
    if not _holds(predicate, case):
        raise CaseError("predicate", f"does not hold on the case to shrink ({case.id}); nothing to shrink")
    current, calls, seen = case, 0, {case.id}
    progress = True
    while progress and calls < max_calls:
        progress = False
        for label, cand in candidates(current):
            if cand.id in seen or size(cand) >= size(current):
                continue
            seen.add(cand.id)
            calls += 1
            if _holds(predicate, cand):
                current, progress = cand, True
                if log:
                    log(f"shrink: {label} -> {cand.id}")
                break
            if calls >= max_calls:
                break
    if current is not case:
        current = current.replace(tags=(f"shrunk from {case.id}",))
    if log:
        log(f"shrink: {case.id} -> {current.id} after {calls} predicate calls")
    return current


def _holds(predicate: Predicate, case: Case) -> bool:
    try:
        return bool(predicate(case))
    except Exception:  # noqa: BLE001 — a crash in the predicate is "not this failure"
        return False
