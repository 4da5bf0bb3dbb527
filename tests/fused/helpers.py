"""Shared helpers of the fused tests: tiny cases, running an implementation on a case, relative errors."""

from __future__ import annotations

from typing import Optional

import torch

from cases.case import Case
from cases.layout import BshdLayout
from cases.packing import Segment, build_layout
from cases.profiles import TINY_CONFIG
from cases.tensors import CaseTensors

TOL = 1e-10


def tiny_config(ratio: int, **changes):
    return TINY_CONFIG.replace(compress_ratio=ratio, **changes)


def bshd_case(ratio: int, batch: int, seqlen: int, *, scope: str = "layer", training: bool = True, seed: int = 0,
              dtype: str = "float64", **config) -> Case:
    return Case(config=tiny_config(ratio, **config), layout=BshdLayout(batch, seqlen), dtype=dtype, training=training,
                scope=scope, seed=seed)


def thd_case(ratio: int, segments: list[tuple[int, int]], *, slack: int = 0, capacity: Optional[int] = None,
             scope: str = "layer", training: bool = True, seed: int = 0, dtype: str = "float64", **config) -> Case:
    """``segments``: ``(real, padded)`` lengths; ``capacity``: compressed-row capacity (None: the exact count)."""
    layout = build_layout([Segment(r, p) for r, p in segments], slack=slack, capacity=capacity)
    return Case(config=tiny_config(ratio, **config), layout=layout, dtype=dtype, training=training, scope=scope,
                seed=seed)


def run(impl, case: Case, tensors: CaseTensors, topk_indices=None):
    """``impl``'s output record and the gradients of the objective w.r.t. every input and parameter (by name)."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in tensors.params.items()}
    inputs = {k: v.detach().clone().requires_grad_(True) for k, v in tensors.inputs.items()}
    psp = tensors.packed_seq_params
    if case.scope == "layer":
        res = impl.attention_layer(inputs["hidden"], params, case.config, psp, training=case.training,
                                   topk_indices=topk_indices)
    else:
        res = impl.core_attention(inputs["query"], inputs["kv"], inputs["hidden"], inputs["q_latent"], params,
                                  case.config, psp, training=case.training, topk_indices=topk_indices)
    leaves = {**inputs, **params}
    grads = torch.autograd.grad(res.objective(tensors.grad_output), list(leaves.values()), allow_unused=True)
    return res, dict(zip(leaves, grads))


def rel_err(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    """``max|a-b| / max|b|`` over finite entries; ``inf`` if the non-finite patterns differ or one side is missing."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)) or not torch.equal(a[~fin], b[~fin]):
        return float("inf")
    if not bool(fin.any()):
        return 0.0
    num, den = (a[fin] - b[fin]).abs().max(), b[fin].abs().max()
    return float(num / den) if den > 0 else float(num)


def compare(fused_out, fused_grads, ref_out, ref_grads) -> dict[str, float]:
    """Relative error of every output and gradient (missing gradients count as zero)."""
    errs = {"out": rel_err(fused_out.out, ref_out.out), "lse": rel_err(fused_out.lse, ref_out.lse),
            "indexer_loss": rel_err(fused_out.indexer_loss, ref_out.indexer_loss),
            "index_scores": rel_err(fused_out.index_scores, ref_out.index_scores)}
    errs["topk_indices"] = 0.0 if (fused_out.topk_indices is None and ref_out.topk_indices is None) else (
        0.0 if (fused_out.topk_indices is not None and ref_out.topk_indices is not None
                and torch.equal(fused_out.topk_indices, ref_out.topk_indices)) else float("inf"))
    for name in ref_grads:
        a, b = fused_grads[name], ref_grads[name]
        if a is None and b is None:
            continue
        errs[f"grad/{name}"] = rel_err(a if a is not None else torch.zeros_like(b),
                                       b if b is not None else torch.zeros_like(a))
    return errs


def failures(errs: dict[str, float], tol: float = TOL) -> dict[str, str]:
    return {k: f"{v:.2e}" for k, v in errs.items() if not v <= tol}
