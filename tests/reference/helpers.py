"""Shared helpers of the reference tests: tiny configs, layouts, and running an implementation with gradients."""

from __future__ import annotations

import pathlib
from typing import Optional, Sequence

import torch

from cases.case import Case
from cases.config import ModelConfig
from cases.layout import BshdLayout, ThdLayout
from cases.tensors import materialize

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN_PATH = REPO_ROOT.parent / "shared" / "golden" / "megatron-native-bshd.pt"


def tiny_config(ratio: int = 4, *, sparse: bool = True, per_token: bool = False, dense_mode: bool = False,
                **changes) -> ModelConfig:
    """A small layer (Hd=16, n=2, D=16, Dr=8, W=4, nI=2, dI=16, K=2) of compress ratio ``ratio``."""
    base = dict(hidden_size=16, num_attention_heads=2, v_head_dim=16, qk_pos_emb_head_dim=8, q_lora_rank=8,
                o_groups=2, o_lora_rank=4, compress_ratio=ratio, csa_window_size=4, dsa_indexer_n_heads=2,
                dsa_indexer_head_dim=16, dsa_indexer_topk=2, dsa_indexer_use_sparse_loss=sparse,
                calculate_per_token_loss=per_token, csa_dense_mode=dense_mode)
    base.update(changes)
    return ModelConfig(**base).validate()


def thd_layout(real: Sequence[int], padded: Optional[Sequence[int]] = None, *, slack: int = 0,
               capacity: Optional[int] = None) -> ThdLayout:
    """Segments with ``real[b]`` real tokens in ``padded[b]`` physical rows, ``slack`` rows after the last one."""
    padded = list(real) if padded is None else list(padded)
    cu, cu_p = [0], [0]
    for r, p in zip(real, padded):
        cu.append(cu[-1] + r)
        cu_p.append(cu_p[-1] + p)
    return ThdLayout(tuple(cu), tuple(cu_p), max(1, cu_p[-1] + slack), capacity).validate()


def bshd(batch: int, seq: int) -> BshdLayout:
    return BshdLayout(batch, seq).validate()


def run_with_grads(impl, case: Case, tensors, **kwargs) -> dict[str, torch.Tensor]:
    """Run ``impl`` (``attention_layer`` or ``core_attention``) on ``tensors``; return the outputs and gradients of
    ``objective = sum(out * dO) + indexer_loss`` keyed ``out``, ``lse``, ``loss``, ``grad/<input or param>``."""
    config = case.config
    if case.scope == "layer":
        res = impl(tensors.inputs["hidden"], tensors.params, config, tensors.packed_seq_params,
                   training=case.training, **kwargs)
    else:
        i = tensors.inputs
        res = impl(i["query"], i["kv"], i["hidden"], i["q_latent"], tensors.params, config,
                   tensors.packed_seq_params, training=case.training, **kwargs)
    leaves = {**tensors.inputs, **tensors.params}
    objective = res.objective(tensors.grad_output)
    grads = torch.autograd.grad(objective, list(leaves.values()), allow_unused=True)
    out = {"out": res.out.detach(), "lse": res.lse.detach()}
    if res.indexer_loss is not None:
        out["loss"] = res.indexer_loss.detach()
    if res.topk_indices is not None:
        out["topk"] = res.topk_indices
    for name, g in zip(leaves, grads):
        out[f"grad/{name}"] = torch.zeros_like(leaves[name]) if g is None else g
    return out


def case_of(config: ModelConfig, layout, *, scope: str = "layer", training: bool = True, seed: int = 0,
            dtype: str = "float64") -> Case:
    return Case(config=config, layout=layout, scope=scope, training=training, seed=seed, dtype=dtype)


def materialized(case: Case, padding_scale: float = 1.0):
    return materialize(case, padding_scale=padding_scale)
