"""Scaling of the reference with the tokens ``T`` (``dsv4-parity bench``, section ``scaling``): the memory of single
reference functions, log-log slopes of every series, and the findings they give.

A function whose memory grows faster than linearly in ``T`` is a finding that names it (``module:function`` and
``file:line``): at fixed window ``W`` and top-k ``K`` every chunked stage is linear, so a slope near 2 means a
``T × T`` tensor is materialised, or kept by autograd for the backward.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from bench.workloads import Workload, _resolve


def function_series(ratio: int) -> list[tuple[str, str, Callable]]:
    """Reference functions whose memory vs T is checked: (series name, function path, builder).

    A builder returns ``(run, output_bytes)``; ``run()`` is measured by a :class:`MemoryMeter` (peak above the
    start, and ``retained``: still in use after it, i.e. its outputs and what autograd saved for the backward)."""
    def inputs(work: Workload, device: str):
        c = work.config
        S, n, D = work.tokens, c.num_attention_heads, c.v_head_dim
        nI, dI = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        n_comp = S // 4
        gen = torch.Generator(device=device).manual_seed(2)
        dt = work.case.torch_dtype

        def r(*shape):
            return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

        return c, S, n, D, nI, dI, n_comp, r

    def teacher(work: Workload, device: str):
        c, S, n, D, nI, dI, n_comp, r = inputs(work, device)
        f = _resolve("reference.indexer_loss:indexer_kl_rows")
        scores = torch.randn((1, S, n_comp), device=device)
        q, kv, comp = r(1, S, n, D), r(1, S, D), r(1, n_comp, D)
        sink = torch.zeros(n, device=device)

        def run():
            with torch.no_grad():
                return f(scores, None, q, kv, comp, sink, c)

        return run, 4 * S

    def scores_saved(work: Workload, device: str):
        c, S, n, D, nI, dI, n_comp, r = inputs(work, device)
        f = _resolve("reference.indexer:index_scores")
        q, k, w = (t.requires_grad_(True) for t in (r(1, S, nI, dI), r(1, n_comp, dI), r(1, S, nI)))
        return (lambda: f(q, k, w, c.indexer_softmax_scale, ratio=4)), 4 * S * n_comp

    def attention_saved(work: Workload, device: str):
        c, S, n, D, nI, dI, n_comp, r = inputs(work, device)
        f = _resolve("reference.sparse_attention:sparse_attention")
        win = _resolve("reference.sparse_attention:window_indices")
        K = c.dsa_indexer_topk
        comp_ids = torch.arange(K, device=device).view(1, 1, K).expand(1, S, K)
        visible = ((torch.arange(S, device=device) + 1) // 4).view(1, S, 1)
        comp_ids = torch.where(comp_ids < visible, comp_ids + S, -1)
        ids = torch.cat((win(S, c.csa_window_size, device).view(1, S, -1), comp_ids), dim=-1)
        q = r(1, S, n, D).requires_grad_(True)
        kv_full = r(1, S + n_comp, D).requires_grad_(True)
        sink = torch.zeros(n, device=device, requires_grad=True)
        return (lambda: f(q, kv_full, ids, sink, c.softmax_scale)), (S * n * D * q.element_size() + 4 * S * n)

    out = [("dense-loss teacher (no grad): peak", "reference.indexer_loss:indexer_kl_rows", teacher)]
    if ratio == 4:
        out.append(("indexer scores with autograd: retained", "reference.indexer:index_scores", scores_saved))
    out.append(("sparse attention with autograd: retained", "reference.sparse_attention:sparse_attention",
                attention_saved))
    return out


def _slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(y) on log(x)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return None if den == 0 else sum((p[0] - mx) * (p[1] - my) for p in pts) / den


def _verdict(slope: Optional[float]) -> str:
    if slope is None:
        return "n/a"
    if slope < 1.25:
        return "linear"
    if slope < 1.75:
        return "superlinear"
    return "quadratic"


def fit_series(series: list[dict]) -> list[dict]:
    """Log-log slope of time and memory of every series over its measured points."""
    fits = []
    for s in series:
        ok = [p for p in s["points"] if p.get("status") == "ok"]
        metrics = ("time_ms", "peak_mem_bytes") if s["kind"] != "function memory" else (
            "retained_bytes" if "retained" in s["name"] else "peak_mem_bytes",)
        for metric in metrics:
            pts = [p for p in ok if p.get(metric)]
            slope = _slope([p["tokens"] for p in pts], [p[metric] for p in pts])
            fits.append({"series": s["name"], "metric": metric, "slope": slope, "points": len(pts),
                         "verdict": _verdict(slope)})
    return fits


def _where(function: str) -> Optional[str]:
    try:
        obj = _resolve(function)
        path = Path(inspect.getsourcefile(obj)).resolve()
        line = inspect.getsourcelines(obj)[1]
        try:
            path = path.relative_to(Path.cwd().resolve())
        except ValueError:
            pass
        return f"{path}:{line}"
    except (ImportError, AttributeError, TypeError, OSError):
        return None


def findings_from_fits(series: list[dict], fits: list[dict]) -> list[dict]:
    """A function whose memory grows faster than linearly in T is a finding (it is not chunked, or autograd keeps
    a ``T × T`` tensor); so is a forward + backward series whose memory is not linear."""
    by_name = {s["name"]: s for s in series}
    out = []
    for fit in fits:
        s = by_name[fit["series"]]
        if fit["metric"] == "time_ms" or fit["slope"] is None or fit["slope"] < 1.5:
            continue
        pts = [p for p in s["points"] if p.get("status") == "ok" and p.get(fit["metric"])]
        last = pts[-1] if pts else {}
        msg = (f"{fit['series']}: {fit['metric']} grows as T^{fit['slope']:.2f} "
               f"({last.get(fit['metric'])} bytes at T={last.get('tokens')})")
        if s.get("function"):
            out.append({"kind": "memory superlinear in T", "function": s["function"],
                        "where": _where(s["function"].split(" ")[0]), "message": msg})
        elif "fixed segments" in s["name"]:
            out.append({"kind": "memory superlinear in T", "function": None, "where": None, "message": msg})
    return out
