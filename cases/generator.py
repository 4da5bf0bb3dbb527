"""The case generator: weighted random cases of a profile, optionally *pinned* to a coverage cell.

``sample_case(rng, profile, pins)`` draws every choice (ratio, dense mode, loss mode and reduction, dtype, scope,
heads / window / top-k, layout and packing) from the profile's weights, except those fixed by ``pins`` — a mapping
of :data:`cases.coverage.FEATURES` names to values, i.e. a cell. The draw is repeated until the case's features
match the pins and its buffer fits the profile's token budget; :class:`Unsatisfiable` is raised if that never happens.

``generate(profile, seed, count, cells)`` first draws one pinned case for every cell no earlier case hits, then
random cases up to ``count``. Every case has its own random stream labelled by (seed, profile, purpose, index), so
the result is a pure function of the arguments.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from .case import Case
from .config import ModelConfig
from .coverage import FEATURES, Cell, Value, cell_name, features, hits
from .errors import CaseError
from .layout import BshdLayout
from .packing import LENGTH_CLASSES, SEGMENT_BUCKETS, sample_length, sample_packing
from .profiles import Profile
from .rng import Rng

#: Features that only a THD layout can have (pinning one of them to true/non-n/a implies layout=thd).
THD_FEATURES = ("alignment_padding", "zero_length_segment", "cu_capacity_padding", "dummy_tail", "slack",
                "identical_segments")
#: ``padding_dout`` pins that need padding rows (a THD layout).
PADDING_DOUT_PINS = ("zero", "random", "poison")
#: Features decided by sequence lengths (both layouts).
LENGTH_FEATURES = ("short_segment", "partial_block", "block_aligned", "window_saturated", "topk_saturated")


class Unsatisfiable(CaseError):
    """No case of this profile has the pinned features (a contradictory cell, or one the budget cannot fit)."""


def _pick(rng: Rng, pins: Mapping[str, Value], name: str, choices, convert=lambda v: v):
    return convert(pins[name]) if name in pins else rng.weighted(choices)


def _draw_config(rng: Rng, profile: Profile, pins: Mapping[str, Value]) -> tuple[ModelConfig, bool]:
    """The model config and the ``training`` flag."""
    loss = pins.get("loss")
    needs_indexer = loss in ("dense", "sparse") or pins.get("topk_saturated") is True
    if "ratio" in pins:
        ratio = int(pins["ratio"])
    elif needs_indexer or pins.get("dense_mode") is True:
        ratio = 4
    else:
        ratio = rng.weighted(profile.ratios)
    dense_mode = pins["dense_mode"] if "dense_mode" in pins else (
        ratio == 4 and not needs_indexer and rng.chance(15))
    has_indexer = ratio == 4 and not dense_mode
    if loss is None:
        loss = rng.weighted(profile.losses) if has_indexer else "none"
        if has_indexer and pins.get("training") is True and loss == "none":
            loss = "sparse"
        if pins.get("training") is False:
            loss = "none"
    if has_indexer:
        training = loss != "none"
    else:
        training = pins["training"] if "training" in pins else rng.chance(80)
    with_loss = has_indexer and training
    reduction = pins.get("reduction")
    if with_loss and reduction in (None, "n/a"):
        reduction = rng.weighted((("mean", 1), ("per_token", 1)))
    base = profile.base
    n = _pick(rng, pins, "heads", profile.heads, int)
    W = _pick(rng, pins, "window", profile.windows, int)
    K = _pick(rng, pins, "topk", profile.topks, int) if has_indexer or "topk" in pins else base.dsa_indexer_topk
    nI = rng.weighted(profile.indexer_heads) if has_indexer else base.dsa_indexer_n_heads
    config = profile.config(
        ratio, num_attention_heads=n, csa_window_size=W, dsa_indexer_topk=K, dsa_indexer_n_heads=nI,
        csa_dense_mode=bool(dense_mode),
        # loss flags only matter with a loss: canonical defaults otherwise, so equal cases get equal ids
        dsa_indexer_use_sparse_loss=(loss != "dense") if with_loss else base.dsa_indexer_use_sparse_loss,
        calculate_per_token_loss=(reduction == "per_token") if with_loss else False)
    return config, training


def _draw_layout(rng: Rng, profile: Profile, config: ModelConfig, pins: Mapping[str, Value]):
    r, W, K = config.compress_ratio, config.csa_window_size, config.dsa_indexer_topk
    budget = profile.max_tokens[r]
    force = {k: v for k, v in pins.items() if k in THD_FEATURES + LENGTH_FEATURES + ("sequences", "capacity")}
    thd_pinned = any(pins.get(k) is True for k in THD_FEATURES) or pins.get("capacity", "n/a") != "n/a" \
        or pins.get("padding_dout") in PADDING_DOUT_PINS
    kind = pins.get("layout") or ("thd" if thd_pinned else rng.weighted((("bshd", 2), ("thd", 3))))
    if kind == "thd":
        return sample_packing(rng, ratio=r, window=W, topk=K, budget=budget, force=force)
    bucket = pins.get("sequences") or rng.weighted(SEGMENT_BUCKETS)
    batch = {"1": 1, "2-3": rng.between(2, 3), "4+": rng.between(4, 6)}[bucket]
    klass = rng.weighted(LENGTH_CLASSES)
    for name, wanted in (("short_segment", "below_ratio"), ("topk_saturated", "topk_long"),
                         ("window_saturated", "long"), ("partial_block", "ratio_non_multiple"),
                         ("block_aligned", "ratio_multiple")):
        if pins.get(name) is True:
            klass = wanted
    if r == 128 and klass not in ("below_ratio",) and rng.chance(85):
        klass = rng.choice(["ratio_multiple", "ratio_non_multiple"])
    seq_len = sample_length(rng, klass, ratio=r, window=W, topk=K, cap=max(budget // batch, 1))
    return BshdLayout(batch=batch, seq_len=seq_len)


def _compresses(rng: Rng, case: Case, pins: Mapping[str, Value]) -> bool:
    """Most compressed-layer cases must have a sequence with at least one full block: always for r=128 (whose
    shortest block is long enough that random lengths often miss it), 90% for r=4. A pinned short_segment is exempt."""
    r = case.config.compress_ratio
    if r <= 1 or pins.get("short_segment") is True:
        return True
    layout = case.layout
    longest = layout.seq_len if isinstance(layout, BshdLayout) else max(layout.real_lengths)
    return longest >= r or (r == 4 and rng.chance(10))


def sample_case(rng: Rng, profile: Profile, pins: Mapping[str, Value] = {}, *, seed: Optional[int] = None,
                attempts: int = 400, tags: tuple[str, ...] = ()) -> Case:
    """One case of ``profile`` whose features equal ``pins`` (see the module docstring)."""
    unknown = sorted(set(pins) - set(FEATURES))
    if unknown:
        raise CaseError(f"pins.{unknown[0]}", f"unknown feature (known: {', '.join(FEATURES)})")
    for _ in range(attempts):
        try:
            config, training = _draw_config(rng, profile, pins)
            layout = _draw_layout(rng, profile, config, pins)
            case = Case(config=config, layout=layout,
                        dtype=pins["dtype"] if "dtype" in pins else rng.weighted(profile.dtypes),
                        training=training,
                        scope=pins["scope"] if "scope" in pins else rng.weighted(profile.scopes),
                        seed=rng.seed() if seed is None else seed, device=profile.device, profile=profile.name,
                        tags=tags)
            if pins.get("padding_dout") == "poison":  # only when pinned: unpinned draws (and case ids) are unchanged
                case = case.replace(padding_dout="poison")
        except CaseError:
            continue  # a pin the config cannot take (e.g. heads not divisible by o_groups): draw again
        if (layout.num_tokens <= profile.max_tokens[config.compress_ratio]
                and hits(features(case), tuple(pins.items())) and _compresses(rng, case, pins)):
            return case
    raise Unsatisfiable("pins", f"no {profile.name} case with {cell_name(pins)} in {attempts} draws")


def generate(profile: Profile, seed: int, count: int, cells: Sequence[Cell] = ()) -> list[Case]:
    """Pinned cases for the cells not yet hit, then random ones up to ``count`` cases in all (no duplicate ids)."""
    cases: list[Case] = []
    ids: set[str] = set()

    def add(case: Case) -> None:
        if case.id not in ids:
            ids.add(case.id)
            cases.append(case)

    for cell in cells:
        if any(hits(features(c), cell) for c in cases):
            continue
        name = cell_name(cell)
        add(sample_case(Rng(seed, profile.name, "cell", name), profile, dict(cell), tags=(name,)))
    i = 0
    while len(cases) < count:
        add(sample_case(Rng(seed, profile.name, "random", i), profile, tags=("random",)))
        i += 1
    return cases
