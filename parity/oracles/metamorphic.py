"""Metamorphic oracles: properties one implementation must satisfy on its own (no second implementation needed).

=====================  ====================================================================================  =====
oracle                 property                                                                              rule
=====================  ====================================================================================  =====
``thd-pack``           a THD pack equals its real segments run one by one as BSHD ``B=1`` (out, lse, top-k,  ulp
                       scores, input gradients row by row; parameter gradients and the loss summed, the
                       per-segment loss coefficient scaled by ``L_b / ΣL`` for the mean reduction)
``padding-poison``     scaling every padding / slack row of the inputs by 1e3 changes nothing on real rows   exact
                       (forward, loss, every gradient), and padding-row input gradients stay exactly 0
``padding-dout``       a huge random output gradient on every padding row (alignment padding, dummy tail,     exact
                       slack) changes nothing: real-row forward tensors, the loss and every gradient (in
                       full) bit-identical to the run with dO zeroed there (:mod:`parity.judge.padding_dout`)
``unpadded``           the poisoned padded pack equals the same segments packed without padding or slack     ulp
``capacity``           a compressed-row capacity (``total_comp_capacity``) equals the exact count            ulp
``identical-segments`` segments whose leading rows are equal give equal rows (causality: equal prefixes →     ulp
                       equal forward rows; fully equal segments → equal input gradients too)
``determinism``        two runs on the same tensors are bit-identical, padding rows included                 exact
``cp``                 the implementation with N context-parallel ranks (``--cp N``; N = 2 without it) equals  noise
                       itself at CP = 1, dO zero on padding rows (their contract has its own oracles): real-
                       row forward tensors (top-k exact), the loss and every gradient in full
``graph-replay``       a forward + backward captured in a CUDA graph on the case's packing, replayed after   graph
                       overwriting cu_seqlens / dO in place with other packings of the buffer, equals an eager
                       run on each packing; control: it differs from the capture packing's eager result
                       (CUDA only: ``unsupported`` elsewhere)
=====================  ====================================================================================  =====

Rule ``noise`` (``cp``): ``max|a - b| / (max|noise - truth| + ulps·eps·max|truth| + atol) <=`` the tensor class's
``noise_floor_ratio`` (``parity/policy.json``; per element for scalar-like tensors, as the verdict), where ``truth``
/ ``noise`` are the reference's float64 / working-precision runs with ``b``'s top-k: a CP run may only differ from
the 1-rank run by what the reference itself loses to rounding (reductions cut across ranks, gradients summed
over them). A tensor on which the 1-rank run itself fails that rule against ``truth`` is no baseline: it is not
compared (rule ``baseline``, the ratio recorded; ``run`` judges it against the reference), and a case whose 1-rank
run raises is ``unsupported`` (e.g. a registered production crash at CP = 1). Top-k ids must be equal on real rows,
except where the 1-rank run's index scores tie exactly at the K boundary (``torch.topk`` picks either): then the
two runs legitimately differ downstream, the top-k passes with rule ``tie`` and every float tensor of the CP run is
judged by the same rule against the reference run with the CP run's own selection. On a case that a registered
CP-only deviation matches (an entry whose ``cp`` sizes exclude 1: a CP run differing from the 1-rank one by
construction) a failure defers to the CP run against the reference, where the entry's model is checked: ``known``
only where production matches it there.

Rule ``exact``: every compared element bit-identical (``n_diff == 0``). Rule ``ulp``: ``max|a - b|`` at most
``ulps · eps(dtype) · max|b|`` (policy ``metamorphic.<dtype>.ulps``) — the two runs differ only in buffer shapes
and packing, so only reduction-order noise is allowed. Rule ``graph``: top-k ids exact, every other tensor exact or
``rel_l2 <=`` policy ``kernels.graph_replay.rel_l2`` (a replayed backward reorders fp32 atomics; bf16 rounding
follows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from cases.case import Case
from cases.coverage import features
from cases.layout import BshdLayout, ThdLayout
from cases.tensors import DOUT_POISON, CaseTensors, materialize

from parity import policy as policy_mod
from parity.deviations import known
from parity.engine import RunOptions, _where, one_line, reference_runs, run_case
from parity.impls import Implementation, is_unsupported, load, policy_provider
from parity.judge import metrics
from parity.judge.padding_dout import compared
from parity.judge.snapshot import INPUT_ORDER, Snapshot, is_row_tensor, take_snapshot, tensor_class
from parity.judge.verdict import MetricRow, TensorResult
from parity.names import ORACLE_SUMMARIES
from parity.oracles import graph_replay
from parity.run.results import CaseResult

POISON = 1e3


@dataclass(frozen=True)
class Oracle:
    name: str
    summary: str
    applies: Callable[[Case], bool]
    check: Callable  # (case, impl, runner, ulps) -> list[TensorResult]


# ---- comparing two runs ----------------------------------------------------------------------------------------------
def compare(name: str, case: Case, a: Optional[torch.Tensor], b: Optional[torch.Tensor], mode: str,
            ulps: float) -> TensorResult:
    """``a`` (variant) against ``b`` (base), restricted by the caller; ``mode`` is ``exact`` or ``ulp``."""
    cls = tensor_class(name.split(":")[-1])
    shown = b if b is not None else a
    base = dict(name=name, tensor_class=cls, dtype="none" if shown is None else str(shown.dtype).removeprefix("torch."),
                shape=[] if shown is None else list(shown.shape))
    if (a is None) != (b is None):
        present = a if a is not None else b
        if cls.startswith("grad") and not bool((present != 0).any()):
            a, b = (torch.zeros_like(present) if x is None else x for x in (a, b))  # None = an all-zero gradient
        else:
            return TensorResult(**base, verdict="fail", rule="structure",
                                message=f"{name}: present in only one of the two runs")
    if a is None:
        return TensorResult(**base, verdict="pass", rule=mode)
    if tuple(a.shape) != tuple(b.shape):
        return TensorResult(**base, verdict="fail", rule="structure",
                            message=f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    a, b = a.detach().cpu(), b.detach().cpu()
    if not a.is_floating_point():
        diff = int((a != b).sum())
        rows = [MetricRow("n_diff", float(diff), 0.0, diff == 0)]
        ok = diff == 0
        return TensorResult(**base, verdict="pass" if ok else "fail", rule="exact" if mode == "exact" else mode,
                            message="" if ok else f"{name}: {diff} entries differ", metrics=rows)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    n_diff = int((~same).sum())
    fa, fb = metrics.as_f64(a), metrics.as_f64(b)
    finite = torch.isfinite(fa) & torch.isfinite(fb)
    pattern = int((torch.isfinite(fa) != torch.isfinite(fb)).sum())
    err = metrics.max_abs(fa[finite], fb[finite]) if finite.any() else 0.0
    scale = float(fb[finite].abs().max()) if finite.any() else 0.0
    unit = metrics.eps(case.torch_dtype) * scale  # ULPs of the working precision (an fp32 sink grad of a bf16 case)
    in_ulps = err / unit if unit > 0 else (0.0 if err == 0 else float("inf"))
    rows = [MetricRow("n_diff", float(n_diff), 0.0 if mode == "exact" else None,
                      (n_diff == 0) if mode == "exact" else None),
            MetricRow("max_abs", err), MetricRow("rel_l2", metrics.rel_l2(fa[finite], fb[finite])),
            MetricRow("nonfinite_mismatch", float(pattern), 0.0, pattern == 0)]
    if mode == "exact":
        ok = n_diff == 0
        msg = "" if ok else (f"{name}: {n_diff} elements differ (max_abs {err:.3g}"
                             + (f", {pattern} finite vs non-finite" if pattern else "") + "); expected bit-identical")
    else:
        rows.append(MetricRow("ulps", in_ulps, ulps, in_ulps <= ulps))
        ok = in_ulps <= ulps and pattern == 0
        msg = "" if ok else (f"{name}: max_abs {err:.3g} = {in_ulps:.3g} ulps of max|ref| > {ulps:g}" if pattern == 0
                             else f"{name}: finite pattern differs on {pattern} elements")
    return TensorResult(**base, verdict="pass" if ok else "fail", rule=mode, message=msg, metrics=rows)


def _rows(x: Optional[torch.Tensor], index: torch.Tensor) -> Optional[torch.Tensor]:
    """Rows ``index`` of a THD row tensor ``[T, ...]``."""
    return None if x is None else x[index.to(x.device)]


# ---- helpers on tensors ----------------------------------------------------------------------------------------------
def _segments(case: Case) -> list[tuple[int, int]]:
    """``(physical start, real length)`` of each THD segment with real tokens."""
    lay = case.layout
    return [(lay.cu_seqlens_padded[b], lay.real_lengths[b]) for b in range(lay.num_segments) if lay.real_lengths[b]]


def _real_index(case: Case) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + L) for s, L in _segments(case)]) if _segments(case) else \
        torch.zeros(0, dtype=torch.int64)


def _tensors_like(base: CaseTensors, inputs: dict, grad_output: torch.Tensor, psp, real_rows: torch.Tensor,
                  kinds: list) -> CaseTensors:
    return CaseTensors(params=base.params, inputs=inputs, grad_output=grad_output, packed_seq_params=psp,
                       real_rows=real_rows, row_kinds=kinds)


# ---- the oracles -----------------------------------------------------------------------------------------------------
def _thd_pack(case: Case, runner, ulps: float) -> list:
    device = runner.device
    T = materialize(case, device)
    packed = runner(case, T)
    segs = _segments(case)
    total_real = sum(L for _, L in segs)
    out, summed = [], {}
    loss_sum = None
    cfg = case.config
    for b, (start, L) in enumerate(segs):
        weight = 1.0 if case.loss_reduction == "per_token" else L / total_real
        sub = case.replace(layout=BshdLayout(1, L),
                           config=cfg.replace(dsa_indexer_loss_coeff=cfg.dsa_indexer_loss_coeff * weight))
        rows = slice(start, start + L)
        inputs = {n: t.detach()[rows].unsqueeze(0) for n, t in T.inputs.items()}
        ST = _tensors_like(T, inputs, T.grad_output[rows].unsqueeze(0), None,
                           torch.ones(1, L, dtype=torch.bool, device=device), [])
        seg = runner(sub, ST)
        for name in seg.names:
            a, p = seg[name], packed[name]
            if name.startswith("grad/") and name[5:] not in INPUT_ORDER or name == "indexer_loss":
                summed.setdefault(name, None)
                if a is not None:  # None is an all-zero gradient (a segment that does not reach the parameter)
                    summed[name] = a.double() if summed[name] is None else summed[name] + a.double()
                continue
            if a is None or p is None:
                out.append(compare(f"seg{b}:{name}", case, None if a is None else a.squeeze(0),
                                   None if p is None else p[rows], "ulp", ulps))
                continue
            a = a.squeeze(0)
            p = p[rows]
            if name == "index_scores":  # packed width max_seqlen//4 ≥ the segment's L//4
                width = a.shape[-1]
                tail = p[:, width:]
                if tail.numel() and torch.isfinite(tail).any():
                    out.append(TensorResult(f"seg{b}:{name}", "index_scores", str(p.dtype).removeprefix("torch."),
                                            list(p.shape), "fail", "structure",
                                            f"seg{b}:{name}: finite scores past the segment's compressed length"))
                    continue
                p = p[:, :width]
            out.append(compare(f"seg{b}:{name}", case, a, p, "ulp", ulps))
    for name, total in summed.items():
        p = packed[name]
        out.append(compare(f"sum:{name}", case, None if total is None else total.to(p.dtype if p is not None
                                                                                      else total.dtype), p, "ulp",
                           ulps))
    return out


def _padding_poison(case: Case, runner, ulps: float) -> list:
    clean_T = materialize(case, runner.device)
    poison_T = materialize(case, runner.device, padding_scale=POISON)
    clean, poison = runner(case, clean_T), runner(case, poison_T)
    mask = clean_T.real_rows.reshape(-1).cpu()
    out = []
    for name in clean.names:
        a, b = poison[name], clean[name]
        if is_row_tensor(name):
            if name.startswith("grad/"):
                out.append(compare(name, case, a, b, "exact", ulps))  # padding-row gradients are 0 in both
                if a is not None and (a.reshape(mask.numel(), -1)[~mask.to(a.device)] != 0).any():
                    out[-1] = TensorResult(name, "grad_input", out[-1].dtype, out[-1].shape, "fail", "structure",
                                           f"{name}: non-zero gradient on poisoned padding rows")
                continue
            idx = mask.nonzero().squeeze(1)
            a, b = _rows(a, idx), _rows(b, idx)
        out.append(compare(name, case, a, b, "exact", ulps))
    return out


def _padding_dout(case: Case, runner, ulps: float) -> list:
    clean_T = materialize(case, runner.device, dout_padding_scale=0.0)
    poison_T = materialize(case, runner.device, dout_padding_scale=DOUT_POISON)
    clean, poison = runner(case, clean_T), runner(case, poison_T)
    mask = clean_T.real_rows.cpu()
    return [compare(name, case, compared(name, poison[name], mask), compared(name, clean[name], mask), "exact", ulps)
            for name in dict.fromkeys(clean.names + poison.names)]


def _unpadded(case: Case, runner, ulps: float) -> list:
    lay = case.layout
    real = _real_index(case)
    flat = ThdLayout(cu_seqlens=lay.cu_seqlens, cu_seqlens_padded=lay.cu_seqlens, total_tokens=max(len(real), 1),
                     compressed_capacity=None)
    flat_case = case.replace(layout=flat)
    poison_T = materialize(case, runner.device, padding_scale=POISON)
    padded = runner(case, poison_T)
    inputs = {n: t.detach()[real.to(t.device)] for n, t in poison_T.inputs.items()}
    FT = _tensors_like(poison_T, inputs, poison_T.grad_output[real.to(poison_T.grad_output.device)],
                       flat.packed_seq_params(case.config.compress_ratio, device=runner.device),
                       torch.ones(len(real), dtype=torch.bool, device=runner.device), flat.row_kinds())
    unpadded = runner(flat_case, FT)
    out = []
    for name in padded.names:
        a, b = unpadded[name], padded[name]
        if is_row_tensor(name) and b is not None:
            b = _rows(b, real)
            if name == "index_scores" and a is not None:  # widths: max padded vs max real length, // 4
                width = min(a.shape[-1], b.shape[-1])
                a, b = a[:, :width], b[:, :width]
        out.append(compare(name, case, a, b, "ulp", ulps))
    return out


def _capacity(case: Case, runner, ulps: float) -> list:
    lay = case.layout
    true_rows = lay.cu_seqlens_compressed(case.config.compress_ratio)[-1]
    other = true_rows if lay.compressed_capacity in (None,) or lay.compressed_capacity > true_rows else None
    variant = case.replace(layout=dataclasses.replace(lay, compressed_capacity=other))
    T = materialize(case, runner.device)
    base = runner(case, T)
    VT = dataclasses.replace(T, packed_seq_params=variant.layout.packed_seq_params(case.config.compress_ratio,
                                                                                    device=runner.device))
    var = runner(variant, VT)
    idx = _real_index(case)
    out = []
    for name in base.names:
        a, b = var[name], base[name]
        if is_row_tensor(name):
            a, b = _rows(a, idx), _rows(b, idx)
        out.append(compare(name, case, a, b, "ulp", ulps))
    return out


def _identical_segments(case: Case, runner, ulps: float) -> list:
    segs = _segments(case)
    T = materialize(case, runner.device)
    s0, L0 = segs[0]
    inputs = {n: t.detach().clone() for n, t in T.inputs.items()}
    d_out = T.grad_output.clone()
    for s, L in segs[1:]:
        m = min(L, L0)
        for t in list(inputs.values()) + [d_out]:
            t[s:s + m] = t[s0:s0 + m]
    IT = dataclasses.replace(T, inputs=inputs, grad_output=d_out)
    snap = runner(case, IT)
    out = []
    for b, (s, L) in enumerate(segs[1:], start=1):
        m = min(L, L0)
        first, other = torch.arange(s0, s0 + m), torch.arange(s, s + m)
        for name in snap.names:
            x = snap[name]
            if x is None or not is_row_tensor(name):
                continue
            if name.startswith("grad/") and L != L0:
                continue  # a row's gradient depends on later rows: equal only for fully equal segments
            out.append(compare(f"seg{b}:{name}", case, _rows(x, other), _rows(x, first), "ulp", ulps))
    return out


def _determinism(case: Case, runner, ulps: float) -> list:
    T = materialize(case, runner.device)
    first, second = runner(case, T), runner(case, T)
    return [compare(name, case, second[name], first[name], "exact", ulps) for name in first.names]


def _replay_result(name: str, case: Case, replayed: Optional[torch.Tensor], eager: Optional[torch.Tensor],
                   limit: float) -> TensorResult:
    """Rule ``graph``: bit-identical, or (float tensors but top-k) ``rel_l2 <= limit``, infinities as 0."""
    exact = compare(name, case, replayed, eager, "exact", 0.0)
    if exact.verdict == "pass" or exact.rule == "structure" or not replayed.is_floating_point():
        return exact
    a, b = (torch.nan_to_num(metrics.as_f64(x), posinf=0.0, neginf=0.0) for x in (replayed, eager))
    rel = metrics.rel_l2(a, b)
    ok = rel <= limit
    return TensorResult(name, exact.tensor_class, exact.dtype, exact.shape, "pass" if ok else "fail", "graph",
                        "" if ok else f"{name}: replay vs eager rel_l2 {rel:.3g} > {limit:g}",
                        [exact.metrics[0], MetricRow("rel_l2", rel, limit, ok)])


def _graph_replay(case: Case, runner, ulps: float, capture: Optional[Callable] = None) -> list:
    """``capture``: ``fn -> (graph, static result)``; the CUDA graph capture unless a test passes a stand-in."""
    if capture is None:
        if runner.device != "cuda":
            raise NotImplementedError("graph-replay captures a CUDA graph: it needs a CUDA device")
        capture = graph_replay.capture_graph
    limit = float(runner.policy.kernel_entry("graph_replay")["rel_l2"])
    device = runner.device
    layouts = [graph_replay.static_layout(lay, case.config.compress_ratio)
               for lay in [case.layout] + graph_replay.repackings(case.layout)]
    T = materialize(case, device)
    with runner.block():
        # fresh buffers: no aliasing
        eager = [graph_replay.GraphStep(runner.impl.api, case, T, lay).run() for lay in layouts]
        step = graph_replay.GraphStep(runner.impl.api, case, T, layouts[0])
        graph, static = capture(step.run)
    reals = [lay.real_row_mask("cpu") for lay in layouts]
    out = []
    for i, lay in enumerate(layouts):
        step.set_packing(lay)
        graph.replay()
        if device == "cuda":
            torch.cuda.synchronize()
        replayed = {k: v.clone() for k, v in static.items()}
        for name in sorted(set(eager[i]) | set(replayed)):
            a, b = replayed.get(name), eager[i].get(name)
            if is_row_tensor(name):
                index = reals[i].nonzero().squeeze(1)
                a, b = _rows(a, index), _rows(b, index)
            out.append(_replay_result(f"pack{i}:{name}", case, a, b, limit))
        if i:  # control: the packings must be told apart, else a replay that ignored the new boundaries would pass
            index = reals[i].nonzero().squeeze(1)
            same = [_replay_result(name, case, _rows(e, index) if is_row_tensor(name) else e,
                                   _rows(eager[0].get(name), index) if is_row_tensor(name) else eager[0].get(name),
                                   limit).verdict == "pass" for name, e in eager[i].items()]
            differs = not all(same)
            out.append(TensorResult(f"pack{i}:control", "out", "none", [], "pass" if differs else "fail", "control",
                                    "" if differs else f"pack{i}: its eager result equals the capture packing's on its "
                                    f"rows: the check cannot tell a replay that kept the old boundaries",
                                    [MetricRow("differs_from_capture_packing", float(differs), 1.0, differs)]))
    return out


# ---- context parallelism ------------------------------------------------------------------------------------------
CP_DEFAULT = 2


def _noise_result(name: str, case: Case, a: Optional[torch.Tensor], b: Optional[torch.Tensor],
                  truth: Optional[torch.Tensor], noise: Optional[torch.Tensor], dtype: torch.dtype, tol,
                  scalar_numel: int) -> TensorResult:
    """Rule ``noise`` (module docstring) of the CP run ``a`` against the 1-rank run ``b`` (already restricted)."""
    cls = tensor_class(name)
    shown = b if b is not None else a
    base = dict(name=name, tensor_class=cls, dtype="none" if shown is None else str(shown.dtype).removeprefix("torch."),
                shape=[] if shown is None else list(shown.shape))
    if a is None or b is None or truth is None or noise is None or not a.is_floating_point():
        return compare(name, case, a, b, "exact", 0.0)  # missing on one side, an integer tensor: exact
    if tuple(a.shape) != tuple(b.shape):
        return TensorResult(**base, verdict="fail", rule="structure",
                            message=f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    fa, fb, ft, fn = (metrics.as_f64(x) for x in (a, b, truth, noise))
    finite = torch.isfinite(fb) & torch.isfinite(ft) & torch.isfinite(fn)
    pattern = int((torch.isfinite(fa) != torch.isfinite(fb)).sum())
    err = (fa - fb).abs()[finite]
    ref = ft[finite]
    den = float((fn - ft).abs()[finite].max()) if finite.any() else 0.0
    den += tol.ulps * metrics.eps(dtype) * (float(ref.abs().max()) if ref.numel() else 0.0) + tol.atol
    if err.numel() == 0:
        ratio = 0.0
    elif b.numel() <= scalar_numel:  # per element, with FA4's dSink allowance (as the verdict's rule)
        dens = den + tol.scalar_ulps * metrics.ulp(ref, dtype)
        ratio = float(torch.where(err == 0, torch.zeros_like(err), err / dens).max())
    else:
        ratio = float(err.max()) / den if den > 0 else (0.0 if float(err.max()) == 0 else float("inf"))
    limit = tol.noise_floor_ratio
    ok = ratio <= limit and pattern == 0
    rows = [MetricRow("max_abs", float(err.max()) if err.numel() else 0.0),
            MetricRow("noise_floor_ratio", ratio, limit, ratio <= limit),
            MetricRow("nonfinite_mismatch", float(pattern), 0.0, pattern == 0)]
    msg = "" if ok else (f"{name}: CP vs 1-rank max_abs {float(err.max()):.3g} = {ratio:.3g} x the reference's noise "
                         f"floor > {limit:g}" if pattern == 0 else f"{name}: finite pattern differs on {pattern} "
                                                                    "elements")
    return TensorResult(**base, verdict="pass" if ok else "fail", rule="noise", message=msg, metrics=rows)


def _cp(case: Case, runner, ulps: float) -> list:
    """Oracle ``cp``: the run at CP = N (the ambient ``--cp``, else :data:`CP_DEFAULT`) against CP = 1."""
    use = runner.impl.optional_hook("use_context_parallel")
    if use is None:
        raise NotImplementedError(f"{runner.impl.name} has no context parallelism (use_context_parallel)")
    current = runner.impl.optional_hook("context_parallel_size")
    n = int(current()) if current is not None else 1
    n = n if n > 1 else CP_DEFAULT
    T = materialize(case, runner.device, dout_padding_scale=0.0)
    with use(1):
        try:
            base = runner(case, T)
        except Exception as exc:  # noqa: BLE001 — the baseline itself cannot run: nothing to compare with
            raise _Unjudged(f"cp: the 1-rank baseline cannot run ({one_line(exc)})") from None
    with use(n):
        var = runner(case, T)
    precision = runner.impl.precision(case)
    reference = load("reference")
    truth, noise, _ = reference_runs(case, reference, T, base["topk_indices"], None, precision)
    dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
    provider = policy_provider(runner.plan, runner.provider)
    idx = T.real_rows.reshape(-1).nonzero().squeeze(1)
    tied = _tie_rows(_rows(var["topk_indices"], idx), _rows(base["topk_indices"], idx),
                     _rows(base["index_scores"], idx))
    if tied:  # selections differ only at exact ties: the CP run against the reference with its own selection
        own_truth, own_noise, _ = reference_runs(case, reference, T, var["topk_indices"], None, precision)
    out = []
    for name in dict.fromkeys(base.names + var.names):
        a, b, t, p = var[name], base[name], truth[name], noise[name]
        if name in base.not_provided or name in var.not_provided:
            if (name in base.not_provided) != (name in var.not_provided):
                out.append(TensorResult(name, tensor_class(name), "none", [], "fail", "structure",
                                        f"{name}: provided at only one of CP = 1 and CP = {n}"))
            continue
        if is_row_tensor(name) and not name.startswith("grad/"):
            a, b, t, p = (_rows(x, idx) for x in (a, b, t, p))
        if name == "topk_indices":
            if tied:
                out.append(TensorResult(f"cp{n}:{name}", "topk", str(a.dtype).removeprefix("torch."), list(a.shape),
                                        "pass", "tie", f"{tied} real rows select differently among exactly tied "
                                                       "scores at the K boundary",
                                        [MetricRow("rows_tied", float(tied))]))
            else:
                out.append(compare(f"cp{n}:{name}", case, a, b, "exact", ulps))
            continue
        tol = runner.policy.tolerance(tensor_class(name), precision, provider)
        if tied:
            t2, p2 = own_truth[name], own_noise[name]
            if is_row_tensor(name) and not name.startswith("grad/"):
                t2, p2 = _rows(t2, idx), _rows(p2, idx)
            out.append(_noise_result(f"cp{n}:{name}", case, a, t2, t2, p2, dtype, tol, runner.policy.scalar_numel))
            continue
        anchor = _noise_result(name, case, b, t, t, p, dtype, tol, runner.policy.scalar_numel)
        if anchor.verdict == "fail" and anchor.rule == "noise":
            ratio = next(m.value for m in anchor.metrics if m.metric == "noise_floor_ratio")
            out.append(TensorResult(f"cp{n}:{name}", anchor.tensor_class, anchor.dtype, anchor.shape, "pass",
                                    "baseline", f"not compared: the 1-rank run deviates from the reference here "
                                                f"({ratio:.3g} x its noise floor; `run` judges it)",
                                    [MetricRow("baseline_noise_floor_ratio", ratio)]))
            continue
        out.append(_noise_result(f"cp{n}:{name}", case, a, b, t, p, dtype, tol, runner.policy.scalar_numel))
    return out


def _tie_rows(a: Optional[torch.Tensor], b: Optional[torch.Tensor], scores: Optional[torch.Tensor]) -> int:
    """The number of rows on which selections ``a`` and ``b`` (``[R, K]``, -1 padded) differ, when every difference
    is among ids whose ``scores`` (``b``'s run, ``[R, C]``) equal exactly the lowest score ``b`` selected; 0 when they
    agree, or when some row differs otherwise (the caller then compares them exactly)."""
    if a is None or b is None or scores is None or a.shape != b.shape:
        return 0
    rows = (a != b).any(-1).nonzero().flatten().tolist()
    for r in rows:
        ids_a, ids_b = set(a[r][a[r] >= 0].tolist()), set(b[r][b[r] >= 0].tolist())
        if len(ids_a) != len(ids_b) or not ids_b or max(ids_a | ids_b) >= scores.shape[-1]:
            return 0
        boundary = min(float(scores[r, i]) for i in ids_b)
        if any(float(scores[r, i]) != boundary for i in ids_a ^ ids_b):
            return 0
    return len(rows)


class _Unjudged(NotImplementedError):
    """An oracle that cannot judge the case (reported ``unsupported`` with the reason)."""


def _thd(case: Case) -> bool:
    return isinstance(case.layout, ThdLayout)


def _has_padding(case: Case) -> bool:
    return case.has_padding_rows


def _multi(case: Case) -> bool:
    return _thd(case) and len(_segments(case)) >= 2


_ORACLE_CHECKS = {
    "thd-pack": (_thd, _thd_pack),
    "padding-poison": (_has_padding, _padding_poison),
    "padding-dout": (_has_padding, _padding_dout),
    "unpadded": (_has_padding, _unpadded),
    "capacity": (lambda c: _thd(c) and c.config.compress_ratio > 1, _capacity),
    "identical-segments": (_multi, _identical_segments),
    "determinism": (lambda c: True, _determinism),
    "cp": (_thd, _cp),
    "graph-replay": (lambda c: _thd(c) and bool(graph_replay.repackings(c.layout)), _graph_replay),
}
#: every oracle, named and summarised in :data:`parity.names.ORACLE_SUMMARIES` (what the CLI lists without torch)
ORACLES = {name: Oracle(name, summary, *_ORACLE_CHECKS[name]) for name, summary in ORACLE_SUMMARIES.items()}


def applicable(name: str, case: Case) -> bool:
    return ORACLES[name].applies(case)


class _Runner:
    """Runs the implementation under test (its provider context) on given tensors."""

    def __init__(self, impl: Implementation, provider: str, device: str, require: Optional[str] = None,
                 policy: Optional[policy_mod.Policy] = None):
        self.impl, self.provider, self.device, self.require = impl, provider, device, require
        self.policy = policy or policy_mod.default()
        self.plan: dict = {}

    @contextlib.contextmanager
    def block(self):
        """The implementation's provider context around code that calls it directly; records what ran."""
        with self.impl.context(self.provider, self.require)() as handle:
            yield handle
        for stage, provider in (getattr(handle, "record", None) or {}).items():
            self.plan.setdefault(stage, provider)

    def __call__(self, case: Case, tensors: CaseTensors) -> Snapshot:
        snap = take_snapshot(self.impl.api, case, tensors, context=self.impl.context(self.provider, self.require))
        for stage, provider in (snap.record or {}).items():
            self.plan.setdefault(stage, provider)
        return snap


def run_oracle(name: str, case: Case, impl: Implementation, options: RunOptions,
               policy: Optional[policy_mod.Policy] = None) -> CaseResult:
    """Check oracle ``name`` on ``case`` with ``impl``; never raises for a problem of the case or the impl."""
    policy = policy or (policy_mod.load(options.policy_path) if options.policy_path else policy_mod.default())
    oracle = ORACLES[name]
    start = time.perf_counter()
    provider = impl.resolve_provider(options.provider)
    result = CaseResult(case=case, outcome="error", decided_by="error", features=features(case),
                        repro=options.repro(case) + f" --oracle {name}")
    device = options.torch_device()

    def finish(outcome, decided_by, message, first=None):
        result.outcome, result.decided_by, result.message, result.first_failure = outcome, decided_by, message, first
        result.duration_s = time.perf_counter() - start
        return result

    if case.device == "cuda" and device != "cuda":
        return finish("unsupported", "device", "the case needs a CUDA device")
    if not oracle.applies(case):
        return finish("unsupported", "oracle", f"oracle {name} does not apply to this case")
    runner = _Runner(impl, provider, device, options.require, policy)
    try:
        tensors = oracle.check(case, runner, policy.metamorphic_ulps(case.dtype))
    except Exception as exc:  # noqa: BLE001
        if is_unsupported(exc):
            return finish("unsupported", "unsupported", one_line(exc))
        message = f"{name}: {one_line(exc)} [{_where(exc)}]"
        finish("error", "error", message, {"tensor": None, "rule": "error", "message": message})
        return _cp_known(result, impl, options) if name == "cp" else result
    result.tensors, result.plan = tensors, runner.plan
    failed = [t for t in tensors if t.failed]
    if failed:
        worst = failed[0]
        more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
        finish("fail", worst.rule, worst.message + more,
               {"tensor": worst.name, "rule": worst.rule, "message": worst.message})
        return _cp_known(result, impl, options) if name == "cp" else result
    return finish("pass", "exact" if all(t.rule == "exact" for t in tensors) else "ulp", "")


def _cp_known(result: CaseResult, impl: Implementation, options: RunOptions) -> CaseResult:
    """A failed / errored ``cp`` oracle on a case that a registered CP-only deviation matches (an entry whose ``cp``
    sizes exclude 1: the CP run differs from the 1-rank one by construction). Its model is stated against the
    contract, not against the 1-rank run, so the oracle defers to the comparison that can check it: the CP run
    against the reference under the registry (:func:`parity.engine.run_case`). ``known`` only where production
    matches the entry's model there; otherwise the oracle's failure stands, with that comparison's verdict added."""
    entries = [e for e in known.registry_for(impl) if 1 not in e.get("cp", [1])]
    provider = impl.provider_name(impl.resolve_provider(options.provider))
    arch = known.architecture(options.torch_device())
    feats = known.case_features(result.case)
    if not [e for e in entries if known.matches_case(e, feats, provider, arch)]:
        return result
    judged = run_case(result.case, impl, load(options.against), options)
    cp_only = {e["id"] for e in entries}
    if judged.outcome == "known" and judged.known and cp_only & set(str(judged.known.get("id", "")).split("+")):
        result.outcome, result.decided_by, result.known = "known", "known", judged.known
        result.message = f"cp oracle deferred to the reference comparison at CP = {options.cp}: {judged.message}"
    else:
        result.message += f" [the reference comparison at CP = {options.cp}: {judged.outcome}: {judged.message}]"
    return result
