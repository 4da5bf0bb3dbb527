"""Scale profiles: the model shapes, dtypes, devices and token budgets a generated case may use.

* ``tiny``   — CPU-sized, the golden data's configuration (spec: hidden 64, n=4, D=64, Dr=16, Rq=32, G=2, Ro=16,
  W=8, nI=4, dI=32, K=4), with W / K / n varied a little. Token budgets keep the reference fast on CPU.
* ``kernel`` — shapes the cuDNN DSA / FlashMLA kernels accept on sm90 (D=512, Dr=64, n ∈ {64,128}, nI=64 × dI=128,
  K a multiple of 128, W=128), bfloat16, device ``cuda``.
* ``flash`` / ``pro`` — the production recipes of spec §8, bfloat16, device ``cuda``.

A profile is pure data; :mod:`cases.generator` draws from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import ModelConfig
from .errors import CaseError

#: The golden data's model (``/work/shared/golden``): every ``tiny`` case starts from it.
TINY_CONFIG = ModelConfig(hidden_size=64, num_attention_heads=4, v_head_dim=64, qk_pos_emb_head_dim=16,
                          q_lora_rank=32, o_groups=2, o_lora_rank=16, compress_ratio=0, csa_window_size=8,
                          dsa_indexer_n_heads=4, dsa_indexer_head_dim=32, dsa_indexer_topk=4)

#: Kernel-sized model: the attention shapes production uses, with small projections (the kernels never see them).
KERNEL_CONFIG = ModelConfig(hidden_size=1024, num_attention_heads=64, v_head_dim=512, qk_pos_emb_head_dim=64,
                            q_lora_rank=512, o_groups=8, o_lora_rank=256, compress_ratio=0, csa_window_size=128,
                            dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=512)

#: Spec §8, DeepSeek-V4 Flash (``gb200/mxfp8_SL4K_128GPU_TP1PP1EP64.yaml``).
FLASH_CONFIG = ModelConfig(hidden_size=4096, num_attention_heads=64, v_head_dim=512, qk_pos_emb_head_dim=64,
                           q_lora_rank=1024, o_groups=8, o_lora_rank=1024, compress_ratio=0, csa_window_size=128,
                           dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=512)

#: Spec §8, DeepSeek-V4 Pro (``gb300/mxfp8_SL4K_256GPU_TP1PP4EP64.yaml``).
PRO_CONFIG = ModelConfig(hidden_size=7168, num_attention_heads=128, v_head_dim=512, qk_pos_emb_head_dim=64,
                         q_lora_rank=1536, o_groups=16, o_lora_rank=1024, compress_ratio=0, csa_window_size=128,
                         dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=1024)


@dataclass(frozen=True)
class Profile:
    """What a generated case of this scale may look like.

    ``*_choices`` are ``(value, weight)`` pairs for weighted sampling; the first value is the profile's default.
    ``max_tokens[r]`` bounds the buffer rows (THD ``total_tokens``, BSHD ``B*S``) of a ratio-``r`` case.
    """

    name: str
    base: ModelConfig
    device: str
    dtypes: tuple[tuple[str, int], ...]
    heads: tuple[tuple[int, int], ...]
    windows: tuple[tuple[int, int], ...]
    topks: tuple[tuple[int, int], ...]
    indexer_heads: tuple[tuple[int, int], ...]
    max_tokens: dict[int, int] = field(default_factory=dict)
    ratios: tuple[tuple[int, int], ...] = ((0, 2), (4, 5), (128, 2))
    scopes: tuple[tuple[str, int], ...] = (("layer", 3), ("core", 2))
    losses: tuple[tuple[str, int], ...] = (("sparse", 5), ("dense", 3), ("none", 2))  # r=4 with indexer

    def config(self, ratio: int, **changes) -> ModelConfig:
        return self.base.replace(compress_ratio=ratio, **changes)


PROFILES: dict[str, Profile] = {
    "tiny": Profile(
        name="tiny", base=TINY_CONFIG, device="any",
        dtypes=(("float64", 4), ("float32", 3), ("bfloat16", 3)),
        heads=((4, 6), (2, 1), (8, 1)),
        windows=((8, 6), (4, 1), (16, 2)),
        topks=((4, 6), (2, 2), (8, 2)),
        indexer_heads=((4, 6), (2, 1)),
        max_tokens={0: 96, 4: 96, 128: 300},
    ),
    "kernel": Profile(
        name="kernel", base=KERNEL_CONFIG, device="cuda",
        dtypes=(("bfloat16", 1),),
        heads=((64, 3), (128, 2)),
        windows=((128, 1),),
        topks=((512, 3), (128, 2), (256, 2), (1024, 1)),
        indexer_heads=((64, 1),),
        losses=(("sparse", 6), ("dense", 2), ("none", 2)),  # fused dense loss is rejected on sm90 (spec §7)
        max_tokens={0: 4096, 4: 4096, 128: 4096},
    ),
    "flash": Profile(
        name="flash", base=FLASH_CONFIG, device="cuda",
        dtypes=(("bfloat16", 1),), heads=((64, 1),), windows=((128, 1),), topks=((512, 1),),
        indexer_heads=((64, 1),),
        max_tokens={0: 8192, 4: 8192, 128: 8192},
        scopes=(("layer", 1),),
    ),
    "pro": Profile(
        name="pro", base=PRO_CONFIG, device="cuda",
        dtypes=(("bfloat16", 1),), heads=((128, 1),), windows=((128, 1),), topks=((1024, 1),),
        indexer_heads=((64, 1),),
        max_tokens={0: 8192, 4: 8192, 128: 8192},
        scopes=(("layer", 1),),
    ),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise CaseError("profile", f"unknown profile {name!r} (known: {', '.join(PROFILES)})")
    return PROFILES[name]
