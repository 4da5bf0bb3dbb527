"""Model hyper-parameters of one DSv4 hybrid-attention layer, under Megatron-LM's names (spec §0, §1.2, §8).

Symbols used in docstrings across the project:
    Hd = hidden_size, n = num_attention_heads, D = v_head_dim, Dr = qk_pos_emb_head_dim, Dn = D - Dr,
    Rq = q_lora_rank, G = o_groups, Ro = o_lora_rank, r = compress_ratio, W = csa_window_size,
    nI = dsa_indexer_n_heads, dI = dsa_indexer_head_dim, K = dsa_indexer_topk.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import CaseError, require

COMPRESS_RATIOS = (0, 4, 128)
#: Production switches that select which of production's code runs, not the math (the reference and ``fused``
#: ignore them; ``--impl megatron`` passes them to its config). Serialised only when not at their default, so the ids
#: of the cases that leave them alone are unchanged.
PRODUCTION_SWITCHES = {"apply_rope_fusion": False}
#: The CSA ratio: the only one with a lightning indexer (whose own compressor runs at it too) and an overlapping
#: compressor (channel factor 2).
INDEXER_RATIO = 4


def overlap_factor(ratio: int) -> int:
    """Compressor channel factor ``coff`` of a compressor of ``ratio``: 2 (overlapping blocks) at
    :data:`INDEXER_RATIO`, else 1."""
    return 2 if ratio == INDEXER_RATIO else 1


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_attention_heads: int
    v_head_dim: int
    qk_pos_emb_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratio: int
    csa_window_size: int
    dsa_indexer_n_heads: int
    dsa_indexer_head_dim: int
    dsa_indexer_topk: int
    dsa_indexer_loss_coeff: float = 1e-2
    dsa_indexer_use_sparse_loss: bool = True
    calculate_per_token_loss: bool = False
    csa_dense_mode: bool = False
    rotary_base: float = 10000.0
    csa_compress_rotary_base: float = 40000.0
    rotary_scaling_factor: float = 4.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    layernorm_epsilon: float = 1e-6
    #: production's fused MLA RoPE (a Triton kernel: CUDA only), a :data:`PRODUCTION_SWITCHES` entry
    apply_rope_fusion: bool = False

    # ---- derived quantities (spec §0) -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Dn = D - Dr: the leading, un-rotated ("nope") dims of a head."""
        return self.v_head_dim - self.qk_pos_emb_head_dim

    @property
    def has_compressor(self) -> bool:
        return self.compress_ratio > 1

    @property
    def has_indexer(self) -> bool:
        """Only ratio-4 layers outside dense mode have a lightning indexer."""
        return self.compress_ratio == INDEXER_RATIO and not self.csa_dense_mode

    @property
    def coff(self) -> int:
        """Compressor channel factor: 2 for the overlapping r=4 compressor, else 1."""
        return overlap_factor(self.compress_ratio)

    @property
    def softmax_scale(self) -> float:
        """σ = D**-0.5."""
        return self.v_head_dim ** -0.5

    @property
    def indexer_softmax_scale(self) -> float:
        """σI = dI**-0.5."""
        return self.dsa_indexer_head_dim ** -0.5

    @property
    def uses_yarn(self) -> bool:
        """Compressed layers (r > 1) use YaRN with csa_compress_rotary_base; window-only layers plain RoPE."""
        return self.compress_ratio > 1

    # ---- validation / serialisation ---------------------------------------------------------------------------
    def validate(self, prefix: str = "config") -> "ModelConfig":
        def f(name: str) -> str:
            return f"{prefix}.{name}"

        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int":
                require(isinstance(value, int) and not isinstance(value, bool), f(field.name),
                        f"must be an integer, got {value!r}")
            elif field.type == "bool":
                require(isinstance(value, bool), f(field.name), f"must be true or false, got {value!r}")
            elif field.type == "float":
                require(isinstance(value, (int, float)) and not isinstance(value, bool), f(field.name),
                        f"must be a number, got {value!r}")
                require(math.isfinite(value), f(field.name), f"must be finite, got {value!r}")
        for name in ("layernorm_epsilon", "rotary_base", "csa_compress_rotary_base", "rotary_scaling_factor",
                     "original_max_position_embeddings"):
            require(getattr(self, name) > 0, f(name), f"must be positive, got {getattr(self, name)}")
        require(self.compress_ratio in COMPRESS_RATIOS, f("compress_ratio"),
                f"must be one of {COMPRESS_RATIOS}, got {self.compress_ratio}")
        for name in ("hidden_size", "num_attention_heads", "v_head_dim", "qk_pos_emb_head_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "csa_window_size", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
                     "dsa_indexer_topk"):
            require(getattr(self, name) > 0, f(name), f"must be positive, got {getattr(self, name)}")
        require(self.qk_pos_emb_head_dim % 2 == 0, f("qk_pos_emb_head_dim"), "RoPE dims must be even")
        require(self.qk_pos_emb_head_dim <= self.v_head_dim, f("qk_pos_emb_head_dim"),
                f"RoPE dims {self.qk_pos_emb_head_dim} exceed the head dim {self.v_head_dim}")
        require(self.qk_pos_emb_head_dim <= self.dsa_indexer_head_dim, f("qk_pos_emb_head_dim"),
                f"RoPE dims {self.qk_pos_emb_head_dim} exceed the indexer head dim {self.dsa_indexer_head_dim}")
        dI = self.dsa_indexer_head_dim
        require(dI & (dI - 1) == 0, f("dsa_indexer_head_dim"), f"the Hadamard rotation needs a power of two, got {dI}")
        n, G = self.num_attention_heads, self.o_groups
        require(n % G == 0, f("o_groups"), f"num_attention_heads {n} is not divisible by o_groups {G}")
        require(not (self.csa_dense_mode and self.compress_ratio != 4), f("csa_dense_mode"),
                "dense mode applies only to compress_ratio 4")
        return self

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name, default in PRODUCTION_SWITCHES.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prefix: str = "config") -> "ModelConfig":
        if not isinstance(data, Mapping):
            raise CaseError(prefix, f"must be an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise CaseError(f"{prefix}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(names))})")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise CaseError(f"{prefix}.{missing[0]}", "missing required field")
        values = dict(data)
        for f in dataclasses.fields(cls):  # JSON has no int/float distinction for whole numbers
            if f.type == "float" and isinstance(values.get(f.name), int) and not isinstance(values[f.name], bool):
                values[f.name] = float(values[f.name])
        return cls(**values).validate(prefix)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes).validate()
