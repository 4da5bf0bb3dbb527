"""The decision of the kernel-level checks (:mod:`parity.kernel_checks`): which rule judges each compared tensor,
the metrics it reads (from :mod:`parity.judge.metrics`) and the bounds it applies (policy ``kernels.rules``).

A kernel check compares one GPU provider call with the torch provider on identical inputs and yields, per tensor,
``(stage, tensor name, kernel tensor, torch tensor, mask)``. :func:`rule_for` names the policy rule of that tensor,
:func:`kernel_metrics` measures it and :meth:`KernelRule.check` decides. The same three steps replay a committed
``kernel_parity.csv`` (its metric columns) under the current policy: :func:`judge_row`. Pure logic, CPU-testable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from cases.errors import CaseError

from parity import policy as policy_mod
from parity.judge import metrics

#: Metric columns of a kernel_parity.csv row (besides stage, call, provider, tensor, outcome, message).
METRIC_KEYS = ("n", "max_abs", "max_rel", "rel_l2", "cosine", "mixed", "nan")

#: stage -> tensor -> policy rule (``None``: recorded, not judged). Tensors every stage may emit are in COMMON.
STAGE_RULES: dict[str, dict[str, Optional[str]]] = {
    "indexer_forward": {"scores": "scores"},
    "indexer_top_k": {"selected_values": "exact", "rows_with_other_ids(ties)": None},
    "compactify": {"indices": "exact", "topk_length": "exact"},
    "sparse_attn_fwd": {"out": "attn_out", "lse": "attn_lse"},
    "sparse_attn_bwd": {"dq": "attn_grad", "dkv": "attn_grad", "d_sink": "attn_grad", "dq_padding_rows_zero": "exact",
                        "finite": "exact"},
    "sparse_attn_score_recompute": {"target": "probs"},
    "sparse_indexer_score_recompute": {"predict": "probs"},
    "indexer_backward": {"d_index_q": "indexer_grad", "d_weights": "indexer_grad", "d_index_k": "indexer_grad"},
    "dense_attn_score_recompute": {"out": "dense", "denom": "dense"},
    "dense_indexer_score_recompute": {"out": "dense", "denom": "dense"},
    "dense_indexer_backward": {"d_index_q": "indexer_grad", "d_weights": "indexer_grad",
                               "d_index_k": "indexer_grad"},
}
COMMON = {"inf_pattern": "exact"}     # number of positions whose finiteness differs (must be 0)
INPLACE_PREFIX = "inplace_arg"        # an in-place score gradient (indexer backward): an aggregate gradient rule
INPLACE_RULE = "indexer_grad"


def rule_for(stage: str, tensor: str) -> Optional[str]:
    """The policy rule judging ``tensor`` of a ``stage`` call (``None``: recorded only); unknown pairs raise."""
    if tensor in COMMON:
        return COMMON[tensor]
    if tensor.startswith(INPLACE_PREFIX):
        return INPLACE_RULE
    try:
        return STAGE_RULES[stage][tensor]
    except KeyError:
        raise CaseError("kernel check", f"no rule for tensor {tensor!r} of stage {stage!r} "
                                        f"(parity/judge/kernel_rules.py STAGE_RULES)") from None


@dataclass(frozen=True)
class KernelRule:
    """Pass rule of one tensor: every given bound must hold."""

    name: str
    mixed: Optional[float] = None      # max |a-b| / (1 + |b|) <= mixed
    rel_l2: Optional[float] = None     # ||a-b|| / ||b|| <= rel_l2
    cosine: Optional[float] = None     # cosine(a, b) >= cosine
    exact: bool = False                # max |a-b| == 0

    @classmethod
    def from_policy(cls, name: Optional[str], policy: Optional[policy_mod.Policy] = None) -> "KernelRule":
        """Rule ``name`` of policy ``kernels.rules`` (``None``: the no-bound rule of a recorded-only tensor)."""
        if name is None:
            return cls("recorded")
        entry = (policy or policy_mod.default()).kernel_entry(name)
        return cls(name, **{k: entry[k] for k in ("mixed", "rel_l2", "cosine", "exact") if k in entry})

    def bounds(self, m: Mapping[str, float]) -> list[tuple[str, float, float, bool]]:
        """``(metric, value, bound, held)`` of every bound this rule gives."""
        out = []
        if self.exact:
            out.append(("max_abs", m["max_abs"], 0.0, m["max_abs"] == 0))
        if self.mixed is not None:
            out.append(("mixed", m["mixed"], self.mixed, m["mixed"] <= self.mixed))
        if self.rel_l2 is not None:
            out.append(("rel_l2", m["rel_l2"], self.rel_l2, m["rel_l2"] <= self.rel_l2))
        if self.cosine is not None:
            out.append(("cosine", m["cosine"], self.cosine, m["cosine"] >= self.cosine))
        return out

    def check(self, m: Mapping[str, float]) -> tuple[bool, str]:
        """``(passed, message)``; a NaN in the kernel tensor fails every rule."""
        if m.get("nan"):
            return False, f"{int(m['nan'])} NaN"
        bounds = self.bounds(m)
        failed = [f"{k} {v:.3g} vs {t:g}" for k, v, t, ok in bounds if not ok]
        held = "; ".join(f"{k} {v:.3g} {'>=' if k == 'cosine' else '<='} {t:g}" for k, v, t, _ in bounds)
        return not failed, "; ".join(failed) or held


def kernel_metrics(a: torch.Tensor, b: torch.Tensor, mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Error of the kernel's ``a`` against the torch provider's ``b`` in float64 on their device, over ``mask`` if
    given: :data:`METRIC_KEYS` (``mixed`` = ``max|a-b| / (1+|b|)``, ``nan`` = NaN count of ``a``)."""
    a, b = metrics.upcast(a), metrics.upcast(b)
    if mask is not None:
        a, b = a[mask], b[mask]
    if not a.numel():
        return dict(n=0, max_abs=0.0, max_rel=0.0, rel_l2=0.0, cosine=1.0, mixed=0.0, nan=0)
    return dict(n=a.numel(), max_abs=metrics.max_abs(a, b), max_rel=metrics.max_rel(a, b), rel_l2=metrics.rel_l2(a, b),
                cosine=metrics.cosine(a, b), mixed=metrics.mixed_error(a, b), nan=metrics.nan_count(a))


def judge_row(row: Mapping[str, str], policy: Optional[policy_mod.Policy] = None) -> tuple[bool, str]:
    """Re-decide one measured ``kernel_parity.csv`` row (its metric columns) under ``policy``'s rules."""
    m = {k: float(row[k]) for k in METRIC_KEYS}
    return KernelRule.from_policy(rule_for(row["stage"], row["tensor"]), policy).check(m)
