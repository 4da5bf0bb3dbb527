"""The layered verdict per tensor and per case (spec parity-anchors §12).

Rules, evaluated in this order; a tensor fails at the first rule it breaks, and that rule is reported:

1. ``structure``   exact checks (:mod:`parity.judge.structure`);
2. ``noise_floor`` ``max|a - r| / (max|p - r| + ulp floor + atol)`` ≤ factor (FlashAttention's rule; tensors of
                   at most ``scalar_numel`` elements, e.g. the sink gradient and the loss, get FA4's per-element
                   ULP allowance on top);
3. ``similarity``  ``1 - cosine`` and ``1 - tensor_sim`` at most ``min(cap, max(eps, f² · (1 - sim of the noise
                   run)))`` (Megatron's backstop; ``f`` is rule 2's factor, squared because ``1 - sim`` grows with the
                   square of the error, so tiny bf16 cases whose own reference cannot reach ``eps`` stay fair; the
                   policy's ``similarity_cap`` keeps the floor from ever going vacuous);
4. ``aggregate``   RMSE and norm-scale error relative to the same-dtype reference's (dynamo's RMSE rule, plus a
                   first-order detector of a systematic scale bias that the max-abs rule can miss in bf16; not
                   for tensors under the per-element rule, whose "scale" is just their value).

Top-k selections use rule ``tie_margin`` (:mod:`parity.judge.topk`) after ``structure``. Rule ``contract`` (tensor
``contract/padding_dout``, :mod:`parity.judge.padding_dout`) is structural too: the output gradient of the padding rows
alone reached a gradient of the implementation; it ranks right after ``structure``, so a leak decides the case as a contract
violation, not as a numerics difference.

A passing tensor reports the rule that *bound* it (its highest tolerance usage). A case fails if any tensor fails;
its ``decided_by`` is the earliest rule that failed any tensor (else the rule that bound the case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from cases.case import Case
from cases.tensors import CaseTensors

from parity.judge import metrics, topk as topk_protocol
from parity.judge.location import where_worst
from parity.judge.padding_dout import TENSOR, verdict_message
from parity.judge.snapshot import RealRows, Snapshot, is_row_tensor, role, scores_of, tensor_class
from parity.policy import Policy, Tolerance

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
RULES = ("structure", "contract", "noise_floor", "similarity", "aggregate", "tie_margin")

# gating metric -> (rule, policy attribute, kind); kind "max" = value <= threshold, "floor" = value >= 1 - eps
GATES = {
    "noise_floor_ratio": ("noise_floor", "noise_floor_ratio", "max"),
    "cosine": ("similarity", "cosine_eps", "floor"),
    "tensor_sim": ("similarity", "tensor_sim_eps", "floor"),
    "rmse_ratio": ("aggregate", "rmse_ratio", "max"),
    "scale_ratio": ("aggregate", "scale_ratio", "max"),
}


@dataclass
class MetricRow:
    metric: str
    value: float
    threshold: Optional[float] = None
    passed: Optional[bool] = None

    @property
    def usage(self) -> float:
        if self.threshold is None:
            return math.nan
        if self.metric in ("cosine", "tensor_sim"):
            spent, allowed = 1.0 - self.value, 1.0 - self.threshold
        else:
            spent, allowed = self.value, self.threshold
        if math.isnan(spent):
            return math.inf
        if allowed <= 0:
            return 0.0 if spent <= 0 else math.inf
        return max(spent, 0.0) / allowed


@dataclass
class TensorResult:
    name: str
    tensor_class: str
    dtype: str
    shape: list
    verdict: str  # pass / fail
    rule: str
    message: str = ""
    metrics: list = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.verdict == "fail"


def _dtype_name(x: Optional[torch.Tensor]) -> str:
    return "none" if x is None else str(x.dtype).removeprefix("torch.")


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _binding(rows: list) -> tuple[str, float]:
    """(rule, usage) of the gating metric closest to its threshold."""
    best, usage = "", -1.0
    for row in rows:
        if row.metric in GATES and row.threshold is not None and row.usage > usage:
            best, usage = GATES[row.metric][0], row.usage
    return best, usage


@dataclass
class NumericPending:
    """One tensor's metrics made on its device and not yet read back (:func:`numeric_reductions`): what
    :func:`judge_numeric_values` decides from once they are read (many tensors' in one transfer)."""

    name: str
    cls: str
    device: dict
    numel: int          # the reference's elements (the metric row ``numel``)
    computed: int       # the implementation's: its reductions were made only when it has elements
    dtype: torch.dtype
    tol: Tolerance
    per_element: bool
    nan: object = 0
    inf: object = 0


def numeric_reductions(name: str, cls: str, a: torch.Tensor, r: torch.Tensor, p: torch.Tensor, dtype: torch.dtype,
                       tol: Tolerance, scalar_numel: int, nan=0, inf=0,
                       owned: tuple = (False, False, False)) -> NumericPending:
    """The device side of :func:`judge_numeric` (same arguments): the metric reductions, the non-finite counts riding
    along. ``owned``: which of ``a``, ``r``, ``p`` are the caller's copies (:func:`parity.judge.metrics.reductions`
    may overwrite them)."""
    per_element = r.numel() <= scalar_numel
    counts = {k: v for k, v in (("nan", nan), ("inf", inf)) if isinstance(v, torch.Tensor)}
    device = metrics.reductions(a, r, p, dtype, tol.ulps, per_element=per_element, scalar_ulps=tol.scalar_ulps,
                                atol=tol.atol, also=counts, owned=owned)
    return NumericPending(name, cls, device, r.numel(), a.numel(), dtype, tol, per_element, nan, inf)


def judge_numeric(name: str, cls: str, a: torch.Tensor, r: torch.Tensor, p: torch.Tensor, dtype: torch.dtype,
                  tol: Tolerance, scalar_numel: int, nan=0, inf=0) -> tuple[str, str, list]:
    """Rules 2-4 on restricted float64 tensors; returns ``(verdict, rule, metric rows, failure message)``.
    ``nan`` / ``inf``: the counts of non-finite elements of the implementation's tensor, ints or 0-d tensors (read
    back with the metrics, in their one transfer)."""
    pending = numeric_reductions(name, cls, a, r, p, dtype, tol, scalar_numel, nan, inf)
    return judge_numeric_values(pending, metrics.fetch(pending.device))


def judge_numeric_values(pending: NumericPending, read: dict) -> tuple[str, str, list, str]:
    """:func:`judge_numeric`'s decision from the read-back values of ``pending.device`` (``read``)."""
    name, tol, per_element = pending.name, pending.tol, pending.per_element
    counts = {k for k, v in (("nan", pending.nan), ("inf", pending.inf)) if isinstance(v, torch.Tensor)}
    values = metrics.from_reductions(read, pending.computed, pending.dtype, tol.ulps, per_element=per_element,
                                     scale_floor=tol.scale_floor, atol=tol.atol, also=dict.fromkeys(counts))
    nan, inf = int(values.get("nan", pending.nan)), int(values.get("inf", pending.inf))
    rows = []
    for metric in ("max_abs", "max_rel", "rmse", "rel_l2", "cosine", "tensor_sim", "frac_outside",
                   "noise_floor_ratio", "ref_error", "ulp_floor", "rmse_ratio", "ref_rmse", "scale_error",
                   "ref_scale_error", "scale_ratio", "ref_cosine", "ref_tensor_sim"):
        value = values[metric]
        if metric in GATES and not (per_element and metric == "scale_ratio"):  # a scalar's scale is its value
            _, attr, kind = GATES[metric]
            limit = getattr(tol, attr)
            if kind == "floor":
                adaptive = tol.noise_floor_ratio ** 2 * (1.0 - values[f"ref_{metric}"])
                limit = min(tol.similarity_cap, max(limit, adaptive))
            threshold = 1.0 - limit if kind == "floor" else limit
            ok = value >= threshold if kind == "floor" else value <= threshold
            rows.append(MetricRow(metric, value, threshold, bool(ok) and not math.isnan(value)))
        else:
            rows.append(MetricRow(metric, value))
    rows.append(MetricRow("nan", float(nan), 0.0, nan == 0))
    rows.append(MetricRow("inf", float(inf), 0.0, inf == 0))
    rows.append(MetricRow("numel", float(pending.numel)))
    for rule in ("noise_floor", "similarity", "aggregate"):
        bad = [row for row in rows if row.metric in GATES and GATES[row.metric][0] == rule and row.passed is False]
        if bad:
            row = bad[0]
            op = ">=" if row.metric in ("cosine", "tensor_sim") else "<="
            msg = f"{name}: {row.metric} {_fmt(row.value)} fails {op} {_fmt(row.threshold)}"
            if row.metric == "noise_floor_ratio":
                msg += (f" (max_abs {_fmt(values['max_abs'])} vs same-dtype reference error "
                        f"{_fmt(values['ref_error'])} + ulp floor {_fmt(values['ulp_floor'])})")
            return "fail", rule, rows, msg
    rule, _ = _binding(rows)
    return "pass", rule or "noise_floor", rows, ""


def _restrict(name: str, x: torch.Tensor, real: RealRows) -> torch.Tensor:
    x = metrics.upcast(x)
    return real.of(x) if is_row_tensor(name) else x


def _shares(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` is (a view of) ``y``'s memory: not a copy the comparison may overwrite."""
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def judge_case_tensors(case: Case, tensors: CaseTensors, impl: Snapshot, truth: Snapshot, noise: Snapshot,
                       problems: dict, policy: Policy, provider: str,
                       tie_rule: str = "arbitrary", precision: Optional[str] = None, *, padding_grads: bool = False
                       ) -> tuple[list, Optional[topk_protocol.TopkReport]]:
    """One :class:`TensorResult` per tensor name, and the top-k report (None without an indexer).

    ``tie_rule``: the implementation's declared top-k tie rule (:data:`parity.judge.topk.TIE_RULES`). ``precision``: the
    dtype the implementation declares it computes the case in (default the case dtype); the tolerances, ULP floor
    and tie margins are that dtype's (the noise run was made in it). ``padding_grads``: the expected input gradients
    are non-zero on padding rows (a known deviation's model, :mod:`parity.deviations.known_models`): they are compared on every
    row."""
    mask = tensors.real_rows.cpu()
    real = RealRows(mask)
    every = RealRows(torch.ones_like(mask)) if padding_grads else real
    precision = precision or case.dtype
    results, report = [], None
    pending: list[tuple[int, NumericPending, dict, tuple]] = []  # (place in results, reductions, base, for where_worst)
    for name in dict.fromkeys(truth.names + impl.names):
        if name in impl.not_provided:
            continue
        a, r, p = impl[name], truth[name], noise[name]
        cls = tensor_class(name)
        shown = a if a is not None else p
        base = dict(name=name, tensor_class=cls, dtype=_dtype_name(shown),
                    shape=list(shown.shape) if shown is not None else [])
        if problems.get(name):
            results.append(TensorResult(**base, verdict="fail", rule="structure",
                                        message=f"{name}: {problems[name][0]}"))
            continue
        if a is None or r is None:
            continue  # absent in both (checked by structure)
        if role(name) == "topk_indices":
            rep = _judge_topk(case, name, a, truth, noise, impl, real, policy, base, results, tie_rule, precision)
            report = rep if name == "topk_indices" else report  # the case row's summary: the layer's selection
            continue
        row_set = every if padding_grads and name.startswith("grad/") else real
        ar, rr, pr = _restrict(name, a, row_set), _restrict(name, r, row_set), _restrict(name, p, row_set)
        nan = torch.isnan(ar).sum()
        if role(name) == "index_scores":  # compare where causally valid (the -inf pattern is a structure rule)
            keep = torch.isfinite(rr).reshape(-1).nonzero().squeeze(1)  # one sync for the three tensors
            ar, rr, pr = (x.reshape(-1).index_select(0, keep) for x in (ar, rr, pr))
            pr = torch.where(torch.isfinite(pr), pr, rr)
        inf = torch.isinf(ar).sum()
        tol = policy.tolerance(cls, precision, provider)
        dtype = DTYPES[precision]  # the working precision: an fp32 tensor of a bf16 case carries bf16 error
        # the float64 row sets made here (not a snapshot's own tensor) may be overwritten by the atol clamp
        owned = tuple(not _shares(x, y) for x, y in ((ar, a), (rr, r), (pr, p)))
        pending.append((len(results), numeric_reductions(name, cls, ar, rr, pr, dtype, tol, policy.scalar_numel,
                                                         nan, inf, owned), base, (a, r, row_set)))
        results.append(None)  # decided below, once every tensor's metrics are read back
        del ar, rr, pr
    # every numeric tensor's metrics in one transfer: on CUDA one wait for the GPU per case, not one per tensor
    read = metrics.fetch({f"{i}|{k}": v for i, (_, item, _, _) in enumerate(pending) for k, v in item.device.items()})
    for i, (place, item, base, (a, r, row_set)) in enumerate(pending):
        verdict, rule, rows, msg = judge_numeric_values(item, {k: read[f"{i}|{k}"] for k in item.device})
        if verdict == "fail":
            msg += where_worst(case, item.name, a, r, row_set.mask if is_row_tensor(item.name) else None)
        results[place] = TensorResult(**base, verdict=verdict, rule=rule, message=msg, metrics=rows)
    return results, report


def _judge_topk(case, name, a, truth, noise, impl, real: RealRows, policy, base, results, tie_rule, precision):
    k = case.config.dsa_indexer_topk
    scores = truth[scores_of(name)]
    # on the truth's device (a CUDA run's selections are judged on the GPU: sorts of [rows, n_comp] scores)
    device = scores.device

    def f64(x):
        return real.of(metrics.upcast(x).to(device))

    ps = noise[scores_of(name)]
    ims = None if scores_of(name) in impl.not_provided else impl[scores_of(name)]
    knobs = policy.topk(precision)
    score_dtype = torch.float64 if precision == "float64" else torch.float32
    idx = real.of(a.detach().to(device=device, dtype=torch.int64))
    rep = topk_protocol.compare(idx.reshape(idx.shape[0], -1), f64(scores),
                                None if ims is None else f64(ims), None if ps is None else f64(ps),
                                k, score_dtype, ulps=float(knobs.get("ulps", 2)),
                                margin_factor=float(knobs.get("margin_factor", 1.0)), tie_rule=tie_rule)
    rows = [MetricRow("rows", float(rep.rows)), MetricRow("rows_clear", float(rep.clear)),
            MetricRow("rows_tied", float(rep.tied)),
            MetricRow("frac_tied", rep.tied / rep.rows if rep.rows else 0.0),
            MetricRow("mismatched_clear", float(rep.mismatched_clear), 0.0, rep.mismatched_clear == 0),
            MetricRow("mismatched_tied", float(rep.mismatched_tied), 0.0, rep.mismatched_tied == 0),
            MetricRow("tied_gap_ratio", rep.worst_gap_ratio, 1.0, rep.worst_gap_ratio <= 1.0),
            MetricRow("rows_exact_tied", float(rep.exact_tied)),
            MetricRow("mismatched_tie_rule", float(rep.mismatched_tie_rule), 0.0, rep.mismatched_tie_rule == 0)]
    wrong = rep.mismatched_clear + rep.mismatched_tied + rep.mismatched_tie_rule
    rows.append(MetricRow("frac_outside", min(wrong, rep.rows) / rep.rows if rep.rows else 0.0))
    results.append(TensorResult(**base, verdict="pass" if rep.passed else "fail", rule="tie_margin",
                                message="" if rep.passed else f"{name}: {rep.first_failure}", metrics=rows))
    return rep


def contract_tensor(leaks: list) -> TensorResult:
    """Tensor ``contract/padding_dout`` from :func:`parity.judge.padding_dout.leaks` (empty: the contract holds)."""
    rows = [MetricRow("leaking_gradients", float(len(leaks)), 0.0, not leaks),
            MetricRow("nonzero_elements", float(sum(n for _, n, _ in leaks))),
            MetricRow("max_abs", max((size for _, _, size in leaks), default=0.0))]
    return TensorResult(TENSOR, "contract", "none", [], "fail" if leaks else "pass", "contract",
                        verdict_message(leaks), rows)


def contract_tensor_modelled(impl: Snapshot, truth: Snapshot, noise: Snapshot, policy: Policy, provider: str,
                             precision: str) -> TensorResult:
    """Tensor ``contract/padding_dout`` against a known deviation's model of the padding-dO-only run
    (:mod:`parity.deviations.known_models`): a gradient the model expects (non-zero in ``truth``) is judged like the main run's
    gradients (rules 2-4 on the whole tensor, ``noise`` the same-dtype reference); every other gradient must be
    exactly 0 (or absent), as under the contract."""
    leaks, off, compared = [], [], 0
    for name in dict.fromkeys([n for n in impl.names if n.startswith("grad/")] + truth.names):
        a, r = impl[name], truth[name]
        if r is None or not bool((r != 0).any()):
            if a is not None and bool((a.detach() != 0).any()):
                nonzero = a.detach() != 0
                leaks.append((name, int(nonzero.sum()),
                              float(a.detach().double().abs().nan_to_num(float("inf")).max())))
            continue
        compared += 1
        if a is None:
            off.append(f"{name}: missing (the model expects a gradient)")
            continue
        p = noise[name] if noise[name] is not None else r
        cls = tensor_class(name)
        ar, rr, pr = metrics.upcast(a), metrics.upcast(r), metrics.upcast(p)
        verdict, _, _, msg = judge_numeric(name, cls, ar, rr, pr, DTYPES[precision],
                                           policy.tolerance(cls, precision, provider), policy.scalar_numel,
                                           torch.isnan(ar).sum(), torch.isinf(ar).sum())
        if verdict == "fail":
            off.append(msg)
    rows = [MetricRow("leaking_gradients", float(len(leaks)), 0.0, not leaks),
            MetricRow("modelled_gradients", float(compared)),
            MetricRow("mismatched_gradients", float(len(off)), 0.0, not off),
            MetricRow("nonzero_elements", float(sum(n for _, n, _ in leaks))),
            MetricRow("max_abs", max((size for _, _, size in leaks), default=0.0))]
    message = verdict_message(leaks) if leaks else (f"{TENSOR}: {off[0]}" + (f" (+{len(off) - 1} more gradients)"
                                                                             if len(off) > 1 else "") if off else "")
    return TensorResult(TENSOR, "contract", "none", [], "fail" if leaks or off else "pass", "contract", message, rows)


def case_decision(tensor_results: list, case_problems: list) -> tuple[str, str, Optional[dict], str]:
    """``(outcome, decided_by, first_failure, message)`` of a case from its tensors (pass / fail only)."""
    if case_problems:
        msg = case_problems[0]
        return "fail", "structure", {"tensor": None, "rule": "structure", "message": msg}, msg
    failed = [t for t in tensor_results if t.failed]
    if failed:
        worst = min(failed, key=lambda t: RULES.index(t.rule))
        msg = worst.message or f"{worst.name} failed {worst.rule}"
        more = len(failed) - 1
        summary = msg + (f" (+{more} more failing tensor{'s' if more > 1 else ''})" if more else "")
        return "fail", worst.rule, {"tensor": worst.name, "rule": worst.rule, "message": msg}, summary
    rule, usage = "", -1.0
    for t in tensor_results:
        r, u = _binding(t.metrics)
        if r and u > usage:
            rule, usage = r, u
    return "pass", rule or "structure", None, ""
