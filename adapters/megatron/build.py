"""Build production's ``DSv4HybridSelfAttention`` for a :class:`cases.config.ModelConfig`, once per
(config, dtype, provider, options) in a process.

The config maps field by field (this project's ``ModelConfig`` uses Megatron's names); ``num_layers = 1`` and
``csa_compress_ratios = [r]``. The spec comes from Megatron's own ``get_dsv4_hybrid_module_spec_for_backend`` with
its ``LocalSpecProvider``, whose missing ``linear()`` is TE's ``TELinear`` when TE is importable, else the
:class:`~adapters.megatron.standins.PlainLinear` stand-in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import torch

from cases.config import ModelConfig
from cases.vocabulary import Unsupported

from . import standins
from .loader import Megatron

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Built:
    """A production layer ready for ``functional_call``: ``module`` (eval/train set per call) and its parameter
    names (production's ``named_parameters()``)."""

    module: torch.nn.Module
    names: tuple[str, ...]
    standins: tuple[str, ...]


#: the last few layers built (least recently used first): a gate case's runs (its training run, the padding-dO re-run,
#: the sign-split probes) share one; keeping every case's layer would hold each one's weights on the device
_CACHE: dict[tuple, Built] = {}
CACHE_SIZE = 4

#: the process groups of a context-parallel rank process (:mod:`adapters.megatron.cp_rank` sets it once at start,
#: an object with ``tp``, ``cp`` groups and ``config_fields()``); None: the 1-rank group of a normal process
PARALLEL = None


class ConfigRefused(Unsupported):
    """Production's own config validation declines the case (e.g. the r = 4 dense indexer loss on sm90 with the
    fused kernels, ``transformer_config.py``): reported ``unsupported`` with production's message."""


def transformer_config(mg: Megatron, config: ModelConfig, dtype: torch.dtype, backend: str):
    """Production's ``MLATransformerConfig`` for one layer of ``config``; ``backend`` ``"cudnn"`` selects the fused
    path through the generation's switch (``dsa_kernel_backend="cudnn"`` or ``apply_dsa_kernel_fusion=True``)."""
    c = config
    cls = mg.modules["megatron.core.transformer.transformer_config"].MLATransformerConfig
    kwargs = dict(
        num_layers=1, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        multi_latent_attention=True, experimental_attention_variant="dsv4_hybrid",
        csa_compress_ratios=[c.compress_ratio], csa_window_size=c.csa_window_size, csa_dense_mode=c.csa_dense_mode,
        q_lora_rank=c.q_lora_rank, v_head_dim=c.v_head_dim, qk_head_dim=c.qk_head_dim,
        qk_pos_emb_head_dim=c.qk_pos_emb_head_dim, kv_channels=c.v_head_dim, o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank, dsa_indexer_n_heads=c.dsa_indexer_n_heads,
        dsa_indexer_head_dim=c.dsa_indexer_head_dim, dsa_indexer_topk=c.dsa_indexer_topk,
        dsa_indexer_loss_coeff=float(c.dsa_indexer_loss_coeff),
        dsa_indexer_use_sparse_loss=c.dsa_indexer_use_sparse_loss,
        calculate_per_token_loss=c.calculate_per_token_loss, rotary_base=c.rotary_base,
        csa_compress_rotary_base=c.csa_compress_rotary_base, rotary_scaling_factor=c.rotary_scaling_factor,
        original_max_position_embeddings=c.original_max_position_embeddings, beta_fast=c.beta_fast,
        beta_slow=c.beta_slow, layernorm_epsilon=c.layernorm_epsilon, normalization="RMSNorm", qk_layernorm=True,
        add_bias_linear=False, apply_rope_fusion=c.apply_rope_fusion, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        # every parameter is the harness's (functional_call by name, checked by layer.py): production's random
        # initialisation of the linears would only be overwritten (stand-in ``no-weight-init``)
        perform_initialization=False,
        **mg.generation.switch_kwargs(backend == "cudnn"),
    )
    if PARALLEL is not None:  # a CP rank: production's CP config fields (and the stand-in its TE check needs)
        kwargs.update(PARALLEL.config_fields())
        with PARALLEL.config_context(mg):
            return cls(**kwargs)
    return cls(**kwargs)


def _backend(mg: Megatron):
    """Megatron's ``LocalSpecProvider`` plus ``linear()`` (TE's ``TELinear`` when importable)."""
    base = mg.modules["megatron.core.models.backends"].LocalSpecProvider
    if mg.has_te:
        from megatron.core.extensions.transformer_engine import TELinear  # noqa: PLC0415 — only with TE
        linear = TELinear
    else:
        # the layer accepts only TELinear for linear_q_down_proj: the stand-in takes that name in its module
        mg.module("deepseek_v4_hybrid_attention").TELinear = standins.PlainLinear
        linear = standins.PlainLinear
    return type("DSv4ParityBackend", (base,), {"linear": lambda self: linear})()


def pg_collection(mg: Megatron):
    cls = mg.modules["megatron.core.process_groups_config"].ProcessGroupCollection
    pgs = cls()
    if PARALLEL is not None:
        pgs.tp, pgs.cp = PARALLEL.tp, PARALLEL.cp
        return pgs
    group = standins.one_rank_group()
    pgs.tp = group
    pgs.cp = group
    return pgs


def build(mg: Megatron, config: ModelConfig, dtype: torch.dtype, backend: str, device: str,
          promoted: bool = False) -> Built:
    """The layer for ``config`` in ``dtype`` on production's PyTorch (``backend="none"``) or fused (``"cudnn"``) path,
    cached;
    ``promoted``: built with the float32 islands promoted (RoPE tables; :mod:`adapters.megatron.promote`)."""
    key = (config, dtype, backend, device, promoted)
    if key in _CACHE:
        _CACHE[key] = _CACHE.pop(key)  # most recently used last
        return _CACHE[key]
    if config.apply_rope_fusion and (device != "cuda" or not standins.has_module("triton")):
        raise Unsupported("apply_rope_fusion: production's fused MLA RoPE is a Triton kernel "
                          "(megatron/core/fusions/fused_mla_yarn_rope_apply.py): it needs CUDA and triton")
    used = []
    specs = mg.modules["megatron.core.models.gpt.experimental_attention_variant_module_specs"]
    spec_utils = __import__("megatron.core.transformer.spec_utils", fromlist=["build_module"])
    with standins.cpu_device_calls(device == "cpu"):
        try:
            cfg = transformer_config(mg, config, dtype, backend)
        except (ValueError, AssertionError) as exc:  # production's __post_init__ validation (raise / assert)
            raise ConfigRefused(f"production's config validation refuses this case: {exc}") from None
        spec = specs.get_dsv4_hybrid_module_spec_for_backend(cfg, _backend(mg))
        module = spec_utils.build_module(spec, config=cfg, layer_number=1, pg_collection=pg_collection(mg))
    if not mg.has_te:
        used.append("plain-linear (no TransformerEngine)")
    used += ["process-group (1-rank gloo)"]
    if device == "cpu":
        used.append("cpu-device (torch.cuda.current_device)")
    module.to(device)
    names = tuple(n for n, _ in module.named_parameters())
    built = Built(module, names, tuple(used))
    while len(_CACHE) >= CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = built
    return built


def fields_of(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)
