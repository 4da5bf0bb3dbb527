"""Production API generations: what each range of Megatron-LM ``dev`` revisions offers the adapter, and the probe
that recognises it.

The adapter never keys on commit ids. After importing a tree, :func:`detect` runs each generation's probe (newest
first) over the imported modules: a generation is the tree's when every one of its :class:`Need` s is present. The
rest of the adapter reads what differs from the chosen :class:`Generation`: the config switch of the fused path
(``build.py``), where the fused module lives and which of its functions return the LSE (``recorders.py``,
``kernel_calls.py``), how the unfused THD top-k is read (``recorders.py``), how the fused path's config validation is
shimmed on a CPU (``emulated.py``), and the ``cudnn.DSA`` wrappers production calls (read from the fused module's
source; the emulated stand-in must provide each).

A tree no probe recognises is refused before any case runs (:func:`refusal`): one line naming the first missing or
changed symbol of the closest generation and the nearest revision the adapter drives.

=================  =====================================  ===========================================================
generation         revisions (upstream ids)               recognised by
=================  =====================================  ===========================================================
``dsa-kernels``    PR #5011's THD commits ``9cb9867c3a``  ``apply_dsa_kernel_fusion: bool``; fused kernels in
                   .. ``e1bdcccfff``; ``dev``             ``dsa_kernels.py`` (``_DSA``, ``_dsa_fwd_flash_mla``);
                   ``056d9c0f24`` .. ``caf2da2054``       ``dsa.fused_qk_topk_naive_thd``; THD top-k read from
                                                          ``csa.build_flat_topk_idxs`` (no THD scores);
                   (= ``6888385fc7^``)                    the fused-path check inline in ``__post_init__``
``csa-kernels``    ``6888385fc7`` .. ``43124b60c2``       ``dsa_kernel_backend: "none" | "cudnn"``; fused kernels in
                   (= ``1c44a57092^``)                    ``csa_kernels.py`` (``_csa_fwd_flash_mla``);
                                                          ``csa._compressed_thd_topk_to_local``;
                                                          ``transformer_config._validate_dsa_kernel_backend_dependencies``
``csa-utils``      ``1c44a57092`` .. ``d48bd6be0a``       as ``csa-kernels``, fused kernels in
                   (the pinned snapshot)                  ``csa_utils/fused_sparse_attention.py``
=================  =====================================  ===========================================================

Common to all (:data:`COMMON`): the DSv4 classes, the THD path of ``CompressedSparseAttention`` (``_forward_thd``;
revisions before PR #5011 have none and are refused), the recorders' targets ``fused_qk_topk_naive`` /
``DSAIndexerLossAutoScaler``, the spec builder, the config, process groups and ``PackedSeqParams``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Mapping, Optional

VARIANT = "megatron.core.transformer.experimental_attention_variant"
CONFIG = "megatron.core.transformer.transformer_config"


@dataclass(frozen=True)
class Need:
    """One feature a generation needs. ``kind``: ``attr`` — module ``module`` has the (dotted) attribute ``name``;
    ``field`` — ``MLATransformerConfig`` has the dataclass field ``name``; ``kwarg`` — the callable ``name`` of
    ``module`` takes the keyword ``detail``; ``module`` — module ``module`` imports. ``module`` is a short name
    under :data:`VARIANT` (``csa``, ``csa_utils.fused_sparse_attention``) or a full dotted name."""

    kind: str
    module: str
    name: str = ""
    detail: str = ""

    @property
    def full_module(self) -> str:
        return self.module if self.module.startswith("megatron.") else f"{VARIANT}.{self.module}"

    def __str__(self) -> str:
        short = self.full_module.replace(f"{VARIANT}.", "")
        if self.kind == "module":
            return f"module {short}"
        if self.kind == "field":
            return f"MLATransformerConfig.{self.name}"
        if self.kind == "kwarg":
            return f"{short}.{self.name}({self.detail}=...)"
        return f"{short}.{self.name}"

    def present(self, modules: Mapping[str, Optional[ModuleType]]) -> bool:
        module = modules.get(self.full_module)
        if module is None:
            return False
        if self.kind == "module":
            return True
        if self.kind == "field":
            cls = getattr(module, "MLATransformerConfig", None)
            return cls is not None and self.name in {f.name for f in dataclasses.fields(cls)}
        obj = module
        for part in self.name.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        if self.kind == "kwarg":
            try:
                return self.detail in inspect.signature(obj).parameters
            except (TypeError, ValueError):
                return False
        return True


def attr(module: str, *names: str) -> tuple[Need, ...]:
    return tuple(Need("attr", module, n) for n in names)


#: what every generation has (and revisions before PR #5011's THD support lack: ``_forward_thd``)
COMMON: tuple[Need, ...] = (
    *attr("deepseek_v4_hybrid_attention", "DSv4HybridSelfAttention", "_q_rms_norm"),
    Need("kwarg", "deepseek_v4_hybrid_attention", "DSv4HybridSelfAttention.forward", "packed_seq_params"),
    *attr("csa", "CompressedSparseAttention", "CompressedSparseAttention._forward_thd", "Compressor", "CSAIndexer",
          "DSAIndexerLossAutoScaler", "fused_qk_topk_naive", "FusedDSAIndexerLoss",
          "unfused_compressed_sparse_attn", "rotate_activation"),
    Need("kwarg", "csa", "CompressedSparseAttention.forward", "packed_seq_params"),
    Need("kwarg", "csa", "CompressedSparseAttention.forward", "qr"),
    *attr("dsa", "DSAIndexerLossAutoScaler", "fused_qk_topk_naive", "compute_dsa_indexer_loss"),
    *attr("megatron.core.models.gpt.experimental_attention_variant_module_specs",
          "get_dsv4_hybrid_module_spec_for_backend"),
    *attr("megatron.core.models.backends", "LocalSpecProvider"),
    *attr(CONFIG, "MLATransformerConfig"),
    *attr("megatron.core.process_groups_config", "ProcessGroupCollection"),
    *attr("megatron.core.packed_seq_params", "PackedSeqParams"),
)

#: functions of the fused module the adapter reads or patches, in every generation
FUSED_NAMES = ("_DSA", "_flash_mla_sparse_fwd", "_get_topk_alignment", "_indexer_topk_core")


@dataclass(frozen=True)
class Generation:
    """One production API generation (module docstring table).

    ``switch``: the config field selecting the fused path — ``apply_dsa_kernel_fusion`` (bool) or
    ``dsa_kernel_backend`` (``"none"`` / ``"cudnn"``); ``fused_module``: where ``_DSA`` / ``_flash_mla_sparse_fwd``
    live (short name under :data:`VARIANT`); ``flash_forward``: that module's FlashMLA adapter returning
    ``(out, lse, lse_indexer)`` (the LSE recorder); ``thd_topk``: the unfused THD top-k recorder —
    ``to_local`` (``csa._compressed_thd_topk_to_local`` + ``_build_compressed_thd_indexer_metadata``: segment-local
    ids and per-row offsets of a packed score matrix) or ``kv_full`` (``csa.build_flat_topk_idxs``: the selection in
    per-segment ``kv_full`` space as production hands it to its sparse attention, with ``build_cu_seqlens_kv_full``'s
    KV lengths; production's THD indexer surfaces no scores there, so THD ``index_scores`` are not provided);
    ``validation``: the fused-path config check —
    ``function`` (``transformer_config._validate_dsa_kernel_backend_dependencies``, replaced on a CPU) or ``inline``
    (``torch.cuda.is_available()`` + SM100 asserted in ``__post_init__``: read as a CUDA SM100 device while the
    config is built on a CPU). ``first`` / ``last``: upstream ids of the revisions it spans (documentation and the
    nearest drivable revision in a refusal)."""

    name: str
    first: str
    last: str
    switch: str
    fused_module: str
    flash_forward: str
    thd_topk: str
    validation: str
    needs: tuple[Need, ...]

    @property
    def fused_module_name(self) -> str:
        return f"{VARIANT}.{self.fused_module}"

    def switch_kwargs(self, fused: bool) -> dict:
        """The config keyword selecting production's fused (``True``) or PyTorch path."""
        if self.switch == "apply_dsa_kernel_fusion":
            return {"apply_dsa_kernel_fusion": bool(fused)}
        return {"dsa_kernel_backend": "cudnn" if fused else "none"}

    def missing(self, modules: Mapping[str, Optional[ModuleType]]) -> list[Need]:
        """The needs of this generation (and :data:`COMMON`) the imported tree lacks, in table order."""
        return [need for need in COMMON + self.needs if not need.present(modules)]

    def modules(self) -> tuple[str, ...]:
        """Every module its probe reads (the loader imports them; an optional one may fail to import)."""
        return tuple(dict.fromkeys(n.full_module for n in COMMON + self.needs))


def _fused(module: str, flash: str) -> tuple[Need, ...]:
    return (Need("module", module), *attr(module, *FUSED_NAMES, flash))


#: newest first (detection order)
GENERATIONS: tuple[Generation, ...] = (
    Generation(
        name="csa-utils", first="1c44a57092", last="d48bd6be0a", switch="dsa_kernel_backend",
        fused_module="csa_utils.fused_sparse_attention", flash_forward="_csa_fwd_flash_mla", thd_topk="to_local",
        validation="function",
        needs=(Need("field", CONFIG, "dsa_kernel_backend"),
               *attr(CONFIG, "_validate_dsa_kernel_backend_dependencies"),
               *_fused("csa_utils.fused_sparse_attention", "_csa_fwd_flash_mla"),
               *attr("csa", "_compressed_thd_topk_to_local", "_build_compressed_thd_indexer_metadata"))),
    Generation(
        name="csa-kernels", first="6888385fc7", last="43124b60c2", switch="dsa_kernel_backend",
        fused_module="csa_kernels", flash_forward="_csa_fwd_flash_mla", thd_topk="to_local", validation="function",
        needs=(Need("field", CONFIG, "dsa_kernel_backend"),
               *attr(CONFIG, "_validate_dsa_kernel_backend_dependencies"),
               *_fused("csa_kernels", "_csa_fwd_flash_mla"),
               *attr("csa", "_compressed_thd_topk_to_local", "_build_compressed_thd_indexer_metadata"))),
    Generation(
        name="dsa-kernels", first="9cb9867c3a", last="caf2da2054", switch="apply_dsa_kernel_fusion",
        fused_module="dsa_kernels", flash_forward="_dsa_fwd_flash_mla", thd_topk="kv_full", validation="inline",
        needs=(Need("field", CONFIG, "apply_dsa_kernel_fusion"),
               *_fused("dsa_kernels", "_dsa_fwd_flash_mla"),
               *attr("dsa", "fused_qk_topk_naive_thd"),
               *attr("csa", "build_flat_topk_idxs", "build_cu_seqlens_kv_full"))),
)
OLDEST, NEWEST = GENERATIONS[-1], GENERATIONS[0]
#: every module any probe reads
PROBED_MODULES = tuple(dict.fromkeys(m for g in GENERATIONS for m in g.modules()))


def detect(modules: Mapping[str, Optional[ModuleType]]) -> Optional[Generation]:
    """The first generation (newest first) whose every need is present, else None."""
    return next((g for g in GENERATIONS if not g.missing(modules)), None)


def closest(modules: Mapping[str, Optional[ModuleType]]) -> tuple[Generation, list[Need]]:
    """The generation with the fewest missing needs (the newer one on a tie) and what it misses."""
    scored = [(len(g.missing(modules)), i, g) for i, g in enumerate(GENERATIONS)]
    _, _, best = min(scored)
    return best, best.missing(modules)


def nearest_revision(generation: Generation, missing: list[Need]) -> str:
    """The drivable revision nearest to a tree that ``generation`` came closest to: the oldest generation's first
    revision when a common need is missing there (an older tree), the newest's last when it is the newest
    generation (a newer tree), else the generation's range."""
    if generation is OLDEST and any(n in COMMON for n in missing):
        return f"{OLDEST.first} (the first THD revision, PR #5011; dev: 056d9c0f24)"
    if generation is NEWEST:
        return f"{NEWEST.last} (the newest revision known to this adapter)"
    return f"{generation.first}..{generation.last} (API generation {generation.name})"


def refusal(modules: Mapping[str, Optional[ModuleType]], where: str) -> str:
    """One line for a tree no generation recognises: the first missing / changed symbol of the closest generation
    and the nearest drivable revision."""
    generation, missing = closest(modules)
    shown = ", ".join(str(n) for n in missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
    return (f"Megatron-LM at {where} is not a revision this adapter can drive: it lacks {shown} (closest API "
            f"generation: {generation.name}, {generation.first}..{generation.last}); the nearest revision it drives "
            f"is {nearest_revision(generation, missing)}")


_WRAPPER_CALL = re.compile(r"_DSA\.(\w+_wrapper)\b")


def wrapper_calls(fused: ModuleType) -> tuple[str, ...]:
    """The ``cudnn.DSA`` wrappers production's fused module calls (``_DSA.<name>_wrapper`` in its source), sorted;
    empty when the source cannot be read."""
    try:
        text = inspect.getsource(fused)
    except (OSError, TypeError):
        return ()
    return tuple(sorted(set(_WRAPPER_CALL.findall(text))))


def table() -> list[dict]:
    """The table as rows (what the README's table shows; the tests read it)."""
    return [{"generation": g.name, "revisions": f"{g.first}..{g.last}", "switch": g.switch,
             "fused_module": g.fused_module, "lse_from": g.flash_forward, "thd_topk": g.thd_topk,
             "validation": g.validation, "probe": [str(n) for n in g.needs]} for g in GENERATIONS]
