"""Named, versioned case suites, generated deterministically and stored as JSON under ``cases/suites/<name>.json``.

=============  ========  ===========================================================================================
suite          profile   purpose
=============  ========  ===========================================================================================
``smoke``      tiny      CPU, every PR: float64/float32/bfloat16, layer and core, BSHD and THD, r ∈ {0,4,128},
                         dense mode, loss none/dense/sparse × mean/per-token, every THD packing feature.
``gate``       kernel    GPU PR gate: the shapes the sm90 kernels accept, bf16.
``nightly``    both      broad: many more tiny and kernel cases, every cell of smoke and gate and more.
``production`` flash/pro the production recipes (spec §8) and the layouts of Megatron's native parity tests (§9).
``gate-cpu``   kernel    a subset of ``gate`` (:data:`SUBSETS`): its cases of at most 64 rows (and the smallest with
                         offset compressed ids), same ids, for a CPU.
=============  ========  ===========================================================================================

A suite is ``(version, recipe) → cases`` where the recipe is (profile, seed, count, required cells) per part; the
stored file must equal :func:`render_suite` of the regeneration (checked by the tests; rewrite the files with
``python -m cases.suites --write``). Each suite declares its required coverage cells; :func:`build_suite` raises
:class:`~cases.errors.CaseError` if a declared cell is not hit.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from .case import Case
from .coverage import Cell, cell_name, check_coverage, parse_cell
from .errors import CaseError
from .generator import THD_FEATURES, generate
from .packing import Segment, build_layout, capacity_for
from .layout import BshdLayout
from .profiles import PROFILES, get_profile
from .rng import Rng
from .vocabulary import STORED_SUITES, SUITE_SUBSETS, check_suite

#: Bump when the generator's output for an unchanged recipe changes (the stored files are regenerated then).
GENERATOR_VERSION = 1
SUITES_DIR = Path(__file__).with_name("suites")


def cells(**axes: Sequence) -> list[Cell]:
    """The product of the given feature axes, e.g. ``cells(layout=["bshd", "thd"], ratio=["0", "4"])``."""
    names = list(axes)
    return [tuple(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))]


def _c(*texts: str) -> list[Cell]:
    return [parse_cell(t) for t in texts]


# ---- required cells --------------------------------------------------------------------------------------------------
def _common_cells(ratios_thd: Sequence[str]) -> list[Cell]:
    """Cells every generated suite must hit: kinds × layouts, loss modes, packing features."""
    out = cells(layout=["bshd", "thd"], ratio=["0", "4", "128"])
    out += cells(layout=["bshd", "thd"], loss=["dense", "sparse"], reduction=["mean", "per_token"])
    out += cells(layout=["bshd", "thd"], ratio=["4"], dense_mode=[False], loss=["none"])  # eval, Path C
    out += cells(layout=["bshd", "thd"], dense_mode=[True])
    out += cells(scope=["core"], ratio=["0", "4", "128"])
    out += cells(scope=["core"], layout=["bshd", "thd"])
    out += cells(scope=["core"], loss=["dense", "sparse"])
    for feature in THD_FEATURES:
        out += cells(**{feature: [True]}, ratio=list(ratios_thd))
    out += cells(capacity=["exact", "production", "over"], ratio=list(ratios_thd))
    out += cells(layout=["thd"], sequences=["1", "2-3", "4+"])
    out += cells(layout=["bshd"], sequences=["1", "2-3"])
    out += cells(layout=["thd"], short_segment=[True], ratio=list(ratios_thd))
    out += cells(layout=["thd"], short_segment=[True], loss=["dense", "sparse"])  # zero-key segment in the mean
    out += cells(layout=["bshd", "thd"], topk_saturated=[True], loss=["dense", "sparse"])
    out += cells(partial_block=[True], ratio=list(ratios_thd))
    out += cells(block_aligned=[True], ratio=list(ratios_thd))
    out += cells(window_saturated=[True], ratio=["0"])
    out += cells(loss=["dense", "sparse"], alignment_padding=[True])
    out += cells(loss=["dense", "sparse"], dummy_tail=[True])
    out += cells(loss=["sparse"], reduction=["mean", "per_token"], slack=[True])
    out += cells(loss=["sparse"], cu_capacity_padding=[True], capacity=["production"])
    return out


SMOKE_CELLS = _common_cells(["4", "128"]) + cells(dtype=["float64", "float32", "bfloat16"], ratio=["0", "4", "128"]) \
    + cells(dtype=["float32", "bfloat16"], loss=["dense", "sparse"]) \
    + _c("heads=2", "heads=8", "window=4 ratio=0", "window=16 ratio=4", "topk=2 loss=sparse", "topk=8 loss=dense") \
    + cells(padding_dout=["poison"], scope=["layer", "core"]) + cells(padding_dout=["poison"], ratio=["0", "4", "128"])

GATE_CELLS = _common_cells(["4", "128"]) + cells(heads=["64", "128"], ratio=["0", "4", "128"]) \
    + cells(topk=["128", "256", "512", "1024"], loss=["sparse"]) \
    + cells(heads=["128"], loss=["sparse"], layout=["thd"])

NIGHTLY_TINY_CELLS = SMOKE_CELLS + cells(dtype=["float64", "float32", "bfloat16"], layout=["thd"],
                                         loss=["dense", "sparse"], reduction=["mean", "per_token"]) \
    + [((f, True), ("loss", loss)) for f in THD_FEATURES for loss in ("dense", "sparse", "none")]

PRODUCTION_CELLS = cells(profile=["flash", "pro"], ratio=["0", "4", "128"]) \
    + cells(profile=["flash", "pro"], layout=["thd"], ratio=["0", "4", "128"]) \
    + cells(alignment_padding=[True], dummy_tail=[True], cu_capacity_padding=[True], capacity=["production"],
            ratio=["4", "128"]) \
    + cells(loss=["sparse"], reduction=["mean", "per_token"]) + _c("loss=dense", "ratio=4 loss=none")


# ---- the production suite (explicit: spec §8 shapes × the native tests' layouts, spec §9) ----------------------------
def _padded_thd(reals: Sequence[int], ratio: int, tokens: int, entries: int):
    """Megatron's padded-THD test layout: each segment padded to a multiple of max(r, 4), a dummy tail up to
    ``tokens`` rows, cu_seqlens repeated up to ``entries`` segments, production capacity."""
    align = max(ratio, 4)
    segments = [Segment(L, -(-L // align) * align) for L in reals]
    used = sum(s.padded for s in segments)
    if used < tokens:
        segments.append(Segment(0, tokens - used))
    segments += [Segment(0, 0)] * max(entries - len(segments), 0)
    layout = build_layout(segments)
    return build_layout(segments, capacity=capacity_for(layout, ratio, "production"))


def production_cases(seed: int) -> list[Case]:
    out = []
    for name in ("flash", "pro"):
        profile = get_profile(name)

        def add(ratio, layout, loss="sparse", per_token=False, training=True, label=""):
            config = profile.config(ratio, dsa_indexer_use_sparse_loss=(loss != "dense"),
                                    calculate_per_token_loss=per_token and ratio == 4)
            case_seed = Rng(seed, "production", len(out)).seed()
            out.append(Case(config=config, layout=layout, dtype="bfloat16", training=training, scope="layer",
                            seed=case_seed, device="cuda", profile=name, tags=(label,)))

        multiseg = build_layout([Segment(L, L) for L in (152, 1024, 2345)])
        for ratio in (0, 4, 128):
            add(ratio, BshdLayout(1, 4096), label="native parity S=4096 B=1")
            add(ratio, multiseg, per_token=True, label="native multiseg [152,1024,2345]")
        add(4, BshdLayout(1, 4096), per_token=True, label="native parity per-token")
        add(4, BshdLayout(1, 4096), loss="dense", label="native parity dense loss")
        add(4, BshdLayout(1, 4096), training=False, label="eval (Path C)")
        add(4, BshdLayout(1, 512), label="native parity S=512")
        for ratio in (4, 128):
            for reals, tokens, entries in (([512], 640, 4), ([256, 256], 640, 4), ([200, 150, 912], 2048, 8)):
                add(ratio, _padded_thd(reals, ratio, tokens, entries), per_token=True,
                    label=f"native padded {reals} -> {tokens} tokens, {entries} seqs")
    return out


# ---- production switches: explicit cases appended to smoke and gate (the generated cases are unchanged) ------------
def _switch_case(profile: str, ratio: int, layout, dtype: str, label: str, seed: int, scope: str = "layer",
                 **changes) -> Case:
    prof = get_profile(profile)
    return Case(config=prof.config(ratio, **changes), layout=layout, dtype=dtype, training=True, scope=scope,
                seed=Rng(seed, "switches", label).seed(), device=prof.device, profile=profile, tags=(label,))


def _packed(*segments: tuple[int, int]):
    """A THD layout of ``(real, padded)`` segments, no slack: under context parallelism its ragged segments straddle
    the ranks' row slices at N = 2 and 4."""
    return build_layout([Segment(r, p) for r, p in segments])


def smoke_switch_cases(seed: int) -> list[Case]:
    """``dsa_indexer_loss_coeff = 0`` (a real training value; production's contract: the indexer keeps zero gradients)
    on THD (sparse and dense loss; at ``--cp 2`` / ``4`` too) and BSHD, tiny shapes."""
    return [
        _switch_case("tiny", 4, _packed((13, 16), (30, 32), (21, 24)), "float32", "loss_coeff=0 thd sparse", seed,
                     dsa_indexer_loss_coeff=0.0, dsa_indexer_topk=8),
        _switch_case("tiny", 4, _packed((20, 20), (27, 28)), "bfloat16", "loss_coeff=0 thd dense", seed,
                     dsa_indexer_loss_coeff=0.0, dsa_indexer_use_sparse_loss=False),
        _switch_case("tiny", 4, BshdLayout(2, 20), "float32", "loss_coeff=0 bshd sparse", seed,
                     dsa_indexer_loss_coeff=0.0),
    ]


def gate_switch_cases(seed: int) -> list[Case]:
    """Production's fused MLA RoPE (``apply_rope_fusion``, Triton: the GPU gate only) at r = 0 / 4 / 128, BSHD and THD,
    layer and core scope; ``dsa_indexer_loss_coeff = 0`` on THD and BSHD; kernel shapes, bf16."""
    thd = _packed((700, 704), (1000, 1024), (300, 320))
    out = [_switch_case("kernel", r, thd, "bfloat16", f"apply_rope_fusion thd r={r}", seed, apply_rope_fusion=True)
           for r in (0, 4, 128)]
    out.append(_switch_case("kernel", 4, BshdLayout(1, 1024), "bfloat16", "apply_rope_fusion bshd r=4", seed,
                            apply_rope_fusion=True))
    out.append(_switch_case("kernel", 4, thd, "bfloat16", "apply_rope_fusion thd core r=4", seed, scope="core",
                            apply_rope_fusion=True))
    out.append(_switch_case("kernel", 4, thd, "bfloat16", "loss_coeff=0 thd sparse", seed,
                            dsa_indexer_loss_coeff=0.0))
    out.append(_switch_case("kernel", 4, BshdLayout(1, 1024), "bfloat16", "loss_coeff=0 bshd sparse", seed,
                            dsa_indexer_loss_coeff=0.0))
    return out


SMOKE_SWITCH_CELLS = _c("loss_coeff=zero layout=thd loss=sparse", "loss_coeff=zero layout=thd loss=dense",
                        "loss_coeff=zero layout=bshd")
GATE_SWITCH_CELLS = cells(rope_fusion=[True], ratio=["0", "4", "128"]) + cells(rope_fusion=[True],
                                                                              layout=["bshd", "thd"]) \
    + _c("rope_fusion=true scope=core", "loss_coeff=zero layout=thd", "loss_coeff=zero layout=bshd")


# ---- suite registry --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """``count`` cases of ``profile`` from ``seed``, first covering ``cells``."""

    profile: str
    seed: int
    count: int
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    version: int
    description: str
    parts: tuple[Part, ...] = ()
    build: Optional[Callable[[], list[Case]]] = None  # explicit suites (production)
    extra_cells: tuple[Cell, ...] = ()
    extra: Optional[Callable[[], list[Case]]] = None  # explicit cases appended after the generated parts

    @property
    def required_cells(self) -> list[Cell]:
        seen, out = set(), []
        for cell in [c for p in self.parts for c in p.cells] + list(self.extra_cells):
            if cell not in seen:
                seen.add(cell)
                out.append(cell)
        return out

    def recipe(self) -> list[dict]:
        return [{"profile": p.profile, "seed": p.seed, "count": p.count} for p in self.parts]


SUITES: dict[str, SuiteSpec] = {
    "smoke": SuiteSpec("smoke", 1, "CPU smoke: tiny shapes, every layout / ratio / loss / dtype / packing feature",
                       parts=(Part("tiny", 20240601, 48, tuple(SMOKE_CELLS)),),
                       extra_cells=tuple(SMOKE_SWITCH_CELLS), extra=lambda: smoke_switch_cases(20240601)),
    "gate": SuiteSpec("gate", 1, "GPU PR gate: kernel shapes (sm90), bfloat16",
                      parts=(Part("kernel", 20240602, 220, tuple(GATE_CELLS)),),
                      extra_cells=tuple(GATE_SWITCH_CELLS), extra=lambda: gate_switch_cases(20240602)),
    "nightly": SuiteSpec("nightly", 1, "Nightly: broad tiny and kernel cases",
                         parts=(Part("tiny", 20240603, 320, tuple(NIGHTLY_TINY_CELLS)),
                                Part("kernel", 20240604, 220, tuple(GATE_CELLS)))),
    "production": SuiteSpec("production", 1, "Production shapes (flash / pro, spec §8) and the native tests' layouts",
                            build=lambda: production_cases(20240605), extra_cells=tuple(PRODUCTION_CELLS)),
}


def offsets_compressed_ids(case: Case) -> bool:
    """A THD sparse indexer loss where a later segment with a row that sees two compressed keys (8 real rows) has
    global compressed ids different from its local ones (an earlier segment has compressed keys)."""
    lay, c = case.layout, case.config
    if not (case.is_thd and c.has_indexer and case.training and c.dsa_indexer_use_sparse_loss):
        return False
    comp, real = lay.compressed_lengths(4), lay.real_lengths
    return any(real[i] >= 8 and sum(comp[:i]) > 0 for i in range(1, len(real)))


def _gate_cpu(cases: Sequence[Case]) -> list[Case]:
    """The gate's cases of at most 64 rows, and its smallest case with offset compressed ids (none is that small)."""
    offset = [c for c in cases if offsets_compressed_ids(c)]
    extra = {min(offset, key=lambda c: c.layout.num_tokens).id} if offset else set()
    return [c for c in cases if c.layout.num_tokens <= 64 or c.id in extra]


#: Subsets of a stored suite, by name: ``(parent, description, select)``. Their cases are the parent's own (ids
#: unchanged); nothing is stored for them.
SUBSETS: dict[str, tuple[str, str, Callable[[Sequence[Case]], list[Case]]]] = {
    "gate-cpu": ("gate", "the gate's small cases (at most 64 rows, and its smallest with offset compressed ids): "
                 "the bf16 GPU gate's shapes, runnable on a CPU with `--device cpu`", _gate_cpu),
}


if tuple(SUITES) != STORED_SUITES or tuple(SUBSETS) != SUITE_SUBSETS:  # the names the CLI checks before torch
    raise RuntimeError("cases.vocabulary's suite names differ from cases.suites.SUITES / SUBSETS")


def suite_names() -> list[str]:
    """The stored suites (not their :data:`SUBSETS`)."""
    return list(SUITES)


def _spec(name: str) -> SuiteSpec:
    if name not in SUITES:
        check_suite(name)  # an unknown name: the message lists every suite, subsets included
        raise CaseError("suite", f"{name!r} is a subset of suite {SUBSETS[name][0]!r}, not a stored suite")
    return SUITES[name]


def required_cells(name: str) -> list[Cell]:
    """The coverage cells suite ``name`` declares; a subset (:data:`SUBSETS`) declares none of its own."""
    return [] if name in SUBSETS else _spec(name).required_cells


def build_suite(name: str) -> list[Case]:
    """Regenerate suite ``name`` from its recipe and check its declared coverage."""
    spec = _spec(name)
    cases: list[Case] = []
    if spec.build is not None:
        cases += spec.build()
    for part in spec.parts:
        cases += generate(PROFILES[part.profile], part.seed, part.count, part.cells)
    if spec.extra is not None:
        cases += spec.extra()
    ids = [c.id for c in cases]
    if len(set(ids)) != len(ids):
        raise CaseError(f"suites.{name}", "two cases share an id")
    check_coverage(cases, spec.required_cells, name)
    return cases


def render_suite(name: str, cases: Sequence[Case]) -> str:
    """The stored file: a header, then one canonical case JSON per line (diff-friendly)."""
    spec = _spec(name)
    header = {"name": spec.name, "version": spec.version, "generator": GENERATOR_VERSION,
              "description": spec.description, "recipe": spec.recipe(),
              "required_cells": [cell_name(c) for c in spec.required_cells]}
    head = json.dumps(header, indent=1)[:-2]  # drop the closing "\n}"
    body = ",\n".join("  " + c.to_json() for c in cases)
    return f"{head},\n \"cases\": [\n{body}\n ]\n}}\n"


def suite_path(name: str) -> Path:
    return SUITES_DIR / f"{_spec(name).name}.json"


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[Case, ...]:
    path = suite_path(name)
    if not path.exists():
        raise CaseError("suite", f"suite file {path} is missing; regenerate with `python -m cases.suites --write`")
    data = json.loads(path.read_text())
    cases = []
    for i, item in enumerate(data["cases"]):
        try:
            cases.append(Case.from_dict(item))
        except CaseError as exc:
            raise CaseError(f"suites.{name}.cases[{i}].{exc.field}", exc.message) from None
    return tuple(cases)


def load_suite(name: str) -> list[Case]:
    """The stored cases of suite ``name`` (fast: reads ``cases/suites/<name>.json``), or of a :data:`SUBSETS` entry."""
    if name in SUBSETS:
        parent, _, select = SUBSETS[name]
        return select(_load(parent))
    return list(_load(_spec(name).name))


def find_case(suite: str, case_id: str) -> Case:
    """The case of ``suite`` whose id is ``case_id`` (or starts with it, if unambiguous)."""
    matches = [c for c in load_suite(suite) if c.id == case_id] or \
              [c for c in load_suite(suite) if case_id and c.id.startswith(case_id)]
    if len(matches) != 1:
        why = "no case has" if not matches else f"{len(matches)} cases match"
        raise CaseError("case_id", f"{why} id {case_id!r} in suite {suite!r}")
    return matches[0]


def id_repro(case: Case, suite: str) -> str:
    """The short repro of a suite case: ``dsv4-parity run --case-id ID --suite NAME``."""
    return f"dsv4-parity run --case-id {case.id} --suite {suite}"


def gpu_subset(max_tokens: int = 384, r128: int = 3, suite: str = "gate") -> list[Case]:
    """A device-time-bounded subset of ``suite`` for a GPU runner: every case of at most ``max_tokens`` buffer rows,
    plus the ``r128`` smallest ratio-128 cases above that (a ratio-128 segment needs 128 tokens to have a compressed
    key, so none is small). On the H200 a small case costs a few seconds (kernel JIT dominates), the largest gate
    cases about a minute each in the float64 reference; the subset keeps BSHD and THD, r ∈ {0, 4, 128}, dense and
    sparse loss and the packing features."""
    cases = load_suite(suite)
    small = [c for c in cases if c.layout.num_tokens <= max_tokens]
    big_r128 = sorted((c for c in cases if c.config.compress_ratio == 128 and c.layout.num_tokens > max_tokens),
                      key=lambda c: c.layout.num_tokens)[:r128]
    return small + big_r128


def write_suites(names: Sequence[str] = ()) -> list[Path]:
    SUITES_DIR.mkdir(exist_ok=True)
    written = []
    for name in names or suite_names():
        path = suite_path(name)
        path.write_text(render_suite(name, build_suite(name)))
        written.append(path)
    _load.cache_clear()
    return written


def main(argv: Sequence[str] = ()) -> int:
    """``python -m cases.suites --write [NAME ...]`` regenerates the stored files; ``--check`` compares them."""
    args = list(argv)
    names = [a for a in args if not a.startswith("--")]
    if "--write" in args:
        for path in write_suites(names):
            print(f"wrote {path}")
        return 0
    stale = [n for n in names or suite_names()
             if not suite_path(n).exists() or suite_path(n).read_text() != render_suite(n, build_suite(n))]
    for n in stale:
        print(f"{n}: stored file differs from the regeneration (run python -m cases.suites --write {n})")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
