"""Kernel-level parity of the GPU providers, their CUDA-graph capturability and per-stage timings (GPU only).

For each production kernel call at a kernel-profile size (and a few small calls that exercise the head / index
padding), the ``cudnn`` or ``flashmla`` provider and the ``torch`` provider run on **identical inputs**; every
output tensor is compared with the rule :mod:`parity.judge.kernel_rules` names for it (bounds in ``parity/policy.json``
``kernels``, from cudnn-frontend's own tests, spec ``kernels.md`` §5). The same call is then captured in a CUDA graph
and replayed (is the wrapper capture-safe?) and timed warm (median of CUDA-event timings) for both providers.

    python -m parity.kernel_checks --out DIR [--only STAGE ...] [--no-timing] [--no-capture]

Writes ``DIR/kernel_parity.csv`` (one row per call and tensor), ``DIR/kernel_timings.csv`` (one row per call) and
``DIR/kernel_env.json``; prints one line per call. Every call runs in its own ``try``: an exception is recorded as
outcome ``error`` (with the message), a provider's decline as ``unsupported`` (with its reason).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from fused.kernels import contracts
from fused.kernels.base import bind_arguments
from fused.kernels.torch_provider import TorchKernels

from parity import policy as policy_mod
from parity.judge import metrics
from parity.judge.kernel_rules import METRIC_KEYS, KernelRule, kernel_metrics, rule_for
from parity.oracles.graph_replay import capture_graph

Tensor = torch.Tensor
BF16 = torch.bfloat16
ATTN_D, IDX_D = 512, 128
SCALE = ATTN_D ** -0.5


# ================================================================ inputs ===============================================
class Inputs:
    """Seeded input factory on the GPU."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape, dtype=BF16, scale: float = 1.0) -> Tensor:
        return (torch.randn(shape, generator=self.gen, device=self.device) * scale).to(dtype)

    def rand(self, *shape) -> Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device)

    def distinct_ids(self, rows: int, width: int, n_keys: int) -> Tensor:
        """``(rows, width)`` int32: distinct key ids per row (``width <= n_keys``)."""
        return torch.argsort(self.rand(rows, n_keys), dim=-1)[:, :width].int()


def thd_layout(lengths: list[int], total: int, ratio: int, device) -> dict:
    """Packed metadata: ``cu`` over ``lengths`` (slack rows up to ``total``), compressed ``cu_k`` (``L // ratio``)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu_k = [0]
    for n in lengths:
        cu_k.append(cu_k[-1] + n // ratio)
    return dict(cu=torch.tensor(cu, dtype=torch.int32, device=device),
                cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device), total=total, rows_k=cu_k[-1],
                max_q=max(lengths), max_k=max(n // ratio for n in lengths))


def visible_bshd(batch: int, seqlen: int, n_keys: int, ratio: int, device) -> Tensor:
    return (torch.arange(1, seqlen + 1, device=device) // ratio).clamp(max=n_keys).repeat(batch).int()


def visible_thd(lay: dict, ratio: int) -> Tensor:
    cu = lay["cu"].long()
    rows = torch.arange(lay["total"], device=cu.device)
    seg = torch.bucketize(rows, cu[1:], right=True).clamp(max=cu.numel() - 2)
    pos = rows - cu[seg]
    n_seg = (lay["cu_k"][1:] - lay["cu_k"][:-1]).long()[seg]
    return torch.where(rows < cu[-1], torch.minimum((pos + 1) // ratio, n_seg), 0).int()


def rows_with_keys(lay: dict) -> Tensor:
    """Rows inside a segment that has at least one compressed key."""
    cu = lay["cu"].long()
    rows = torch.arange(lay["total"], device=cu.device)
    seg = torch.bucketize(rows, cu[1:], right=True).clamp(max=cu.numel() - 2)
    n_seg = (lay["cu_k"][1:] - lay["cu_k"][:-1]).long()[seg]
    return (rows < cu[-1]) & (n_seg > 0)


def causal_topk(gen: Inputs, rows: int, width: int, visible: Tensor) -> Tensor:
    """``(rows, width)`` local ids: distinct random picks among the ``visible[r]`` causal keys, ``-1`` after."""
    n_keys = max(int(visible.max()), 1)
    keys = gen.rand(rows, n_keys).masked_fill(torch.arange(n_keys, device=visible.device) >= visible.unsqueeze(-1), 2.0)
    order = torch.argsort(keys, dim=-1)[:, :width]
    if order.shape[1] < width:
        order = torch.cat([order, order.new_full((rows, width - order.shape[1]), -1)], -1)
    slot = torch.arange(width, device=visible.device)
    return torch.where(slot < visible.clamp(max=width).unsqueeze(-1), order, -1).int()


# ================================================================ calls ================================================
@dataclass
class Call:
    """One kernel call: ``make()`` -> ``(args, kwargs)``; ``compare(kernel_result, torch_result, args)`` -> list of
    ``(tensor name, kernel tensor, torch tensor, mask or None)``; the rule of each is
    :func:`parity.judge.kernel_rules.rule_for` ``(stage, tensor name)``."""

    stage: str
    label: str
    provider: str
    make: Callable[[], tuple]
    compare: Callable[..., list]
    inplace: tuple[int, ...] = ()          # positional args a kernel overwrites (cloned per run)
    compare_inplace: Optional[tuple[int, ...]] = None  # of those, the ones the contract defines (default: all)
    provider_kwargs: dict = field(default_factory=dict)


def _clone(args: tuple, kwargs: dict, inplace: tuple) -> tuple:
    args = tuple(a.clone() if i in inplace and torch.is_tensor(a) else a for i, a in enumerate(args))
    return args, dict(kwargs)


def _finite_both(a: Tensor, b: Tensor) -> Tensor:
    return torch.isfinite(a) & torch.isfinite(b)


def _inf_pattern(a: Tensor, b: Tensor) -> tuple:
    """A pseudo-tensor comparison: number of positions whose finiteness differs (must be 0)."""
    mismatch = (torch.isfinite(a) != torch.isfinite(b)).sum().float().view(1)
    return ("inf_pattern", mismatch, torch.zeros_like(mismatch), None)


def build_calls(dev: torch.device, seed: int = 0, div: int = 1) -> list[Call]:
    """The calls; ``div`` shrinks every token count (a CPU dry run of this script uses it)."""
    g = Inputs(dev, seed)

    def n(tokens: int) -> int:
        return max(tokens // div, 4)

    tk = TorchKernels()
    calls: list[Call] = []

    # ---- indexer forward ------------------------------------------------------------------------------------------
    S, SK, HI = n(4096), n(1024), 64
    qi, ki = g.randn(1, S, HI, IDX_D), g.randn(1, SK, 1, IDX_D)
    wi = g.randn(1, S, HI, scale=HI ** -0.5 * IDX_D ** -0.5)

    def cmp_scores(k, t, _args):
        return [_inf_pattern(k["scores"], t["scores"]),
                ("scores", k["scores"], t["scores"], _finite_both(k["scores"], t["scores"]))]

    calls.append(Call("indexer_forward", "bshd S4096 Sk1024 H64", "cudnn", lambda: ((qi, ki, wi), dict(ratio=4)),
                      cmp_scores))
    lay = thd_layout([n(1000), 1, n(1600), n(1399)], n(4096), 4, dev)
    qt, kt, wt = g.randn(lay["total"], HI, IDX_D), g.randn(lay["rows_k"], 1, IDX_D), g.randn(lay["total"], HI, scale=HI ** -0.5 / 11)
    thd_kw = dict(ratio=4, cu_seqlens_q=lay["cu"], cu_seqlens_k=lay["cu_k"], max_seqlen_q=lay["max_q"],
                  max_seqlen_k=lay["max_k"])
    calls.append(Call("indexer_forward", "thd T4096 segs[1000,1,1600,1399]+slack H64", "cudnn",
                      lambda: ((qt, kt, wt), thd_kw), cmp_scores))
    q8, k8, w8 = g.randn(2, 256, 8, IDX_D), g.randn(2, 64, 1, IDX_D), g.randn(2, 256, 8, scale=0.05)
    calls.append(Call("indexer_forward", "bshd H8 (padded to 16)", "cudnn", lambda: ((q8, k8, w8), dict(ratio=4)),
                      cmp_scores))

    # ---- top-k ----------------------------------------------------------------------------------------------------
    scores = tk.indexer_forward(qi, ki, wi, ratio=4)["scores"].reshape(S, SK).contiguous()
    vis = visible_bshd(1, S, SK, 4, dev)
    scores_thd = tk.indexer_forward(qt, kt, wt, **thd_kw)["scores"].contiguous()
    vis_thd = visible_thd(lay, 4)

    def cmp_topk(src):
        def compare(k, t, args):
            x = args[0]
            ki_, ti_ = k["indices"].long(), t["indices"].long()
            kv_ = torch.gather(x, 1, ki_.clamp(min=0)).masked_fill(ki_ < 0, float("-inf"))
            tv_ = torch.gather(x, 1, ti_.clamp(min=0)).masked_fill(ti_ < 0, float("-inf"))
            kv_, tv_ = kv_.sort(-1, descending=True).values, tv_.sort(-1, descending=True).values
            same_sets = (ki_.sort(-1).values == ti_.sort(-1).values).all(-1)
            tie_rows = (~same_sets).sum().float().view(1)
            return [("selected_values", kv_, tv_, _finite_both(kv_, tv_)), _inf_pattern(kv_, tv_),
                    ("rows_with_other_ids(ties)", tie_rows, torch.zeros_like(tie_rows), None)]
        return compare

    calls.append(Call("indexer_top_k", "bshd rows4096 cols1024 K512", "cudnn",
                      lambda: ((scores, vis, min(512, SK)), dict(return_val=False)), cmp_topk(scores)))
    calls.append(Call("indexer_top_k", "thd rows4096 cols400 K256", "cudnn",
                      lambda: ((scores_thd, vis_thd, min(256, lay["max_k"])), dict(return_val=False)), cmp_topk(scores_thd)))

    # ---- compactify -----------------------------------------------------------------------------------------------
    raw = g.distinct_ids(n(4096), 640, 5120).masked_fill(g.rand(n(4096), 640) < 0.3, -1)

    def cmp_compact(k, t, _args):
        return [("indices", k["indices"], t["indices"], None),
                ("topk_length", k["topk_length"], t["topk_length"], None)]

    calls.append(Call("compactify", "4096x640 30% invalid", "cudnn", lambda: ((raw,), {}), cmp_compact))

    # ---- sparse attention forward / backward ----------------------------------------------------------------------
    def attn_inputs(rows: int, heads: int, width: int, n_kv: int):
        q, kv = g.randn(rows, heads, ATTN_D), g.randn(n_kv, 1, ATTN_D)
        ids = g.distinct_ids(rows, width, n_kv)
        ids = ids.masked_fill(g.rand(rows, width) < 0.15, -1)
        ids[: max(rows // 64, 1)] = -1                              # rows without any key: out 0, lse +inf
        packed = tk.compactify(ids)
        ids, length = packed["indices"], packed["topk_length"]
        sink = g.randn(heads, dtype=torch.float32)
        return q, kv, ids, length, sink

    def cmp_fwd(k, t, _args):
        out_k, _, lse_k = k
        out_t, _, lse_t = t
        return [("out", out_k, out_t, None), _inf_pattern(lse_k, lse_t),
                ("lse", lse_k, lse_t, _finite_both(lse_k, lse_t))]

    def cmp_bwd(k, t, _args):
        return [("dq", k["dq"], t["dq"], None), ("dkv", k["dkv"], t["dkv"], None),
                ("d_sink", k["d_sink"], t["d_sink"], None)]

    def cmp_bwd_masked(masked: Tensor):
        def cmp(k, t, _args):
            dq_rows = k["dq"][masked].float()
            return cmp_bwd(k, t, _args) + [
                ("dq_padding_rows_zero", dq_rows, torch.zeros_like(dq_rows), None),
                ("finite", torch.isfinite(k["dkv"].float()).all().float().view(1),
                 torch.ones(1, device=dev), None)]
        return cmp

    for rows, heads, width, n_kv, note in ((n(4096), 64, 640, 5120, ""), (n(2048), 128, 640, 2560, ""),
                                            (n(512), 16, 192, 1024, " (heads padded to 64, K to 256)")):
        q, kv, ids, length, sink = attn_inputs(rows, heads, width, n_kv)
        label = f"T{rows} H{heads} K{width} Nkv{n_kv}{note}"
        fwd_args = ((q, kv, ids.unsqueeze(1), SCALE), dict(attn_sink=sink, topk_length=length))
        calls.append(Call("sparse_attn_fwd", label, "flashmla", (lambda a=fwd_args: a), cmp_fwd))
        out, _, lse = tk.sparse_attn_fwd(*fwd_args[0], **fwd_args[1])
        dout = g.randn(rows, heads, ATTN_D)
        bwd_heads = heads if heads != 16 else 32
        if bwd_heads != heads:  # backward padding case: H32
            q, out, dout, lse, sink = (q.repeat_interleave(2, 1), out.repeat_interleave(2, 1),
                                       dout.repeat_interleave(2, 1), lse.repeat_interleave(2, 1), sink.repeat_interleave(2))
            label = f"T{rows} H32 K{width} Nkv{n_kv} (heads padded to 64)"
        bwd_args = ((q, kv[:, 0], out, dout, lse, sink, ids.clamp(min=0)), dict(softmax_scale=SCALE,
                                                                                  topk_length=length))
        calls.append(Call("sparse_attn_bwd", label, "cudnn", (lambda a=bwd_args: a), cmp_bwd))
        if heads == 64:  # the composition's padding-row mask: rows WITH valid keys, dO = 0 and LSE = +inf
            masked = torch.zeros(rows, dtype=torch.bool, device=dev)
            masked[rows // 4: rows // 2] = True
            m_dout = dout.masked_fill(masked.view(-1, 1, 1), 0.0)
            m_lse = lse.masked_fill(masked.view(-1, 1), float("inf"))
            m_args = ((q, kv[:, 0], out, m_dout, m_lse, sink, ids.clamp(min=0)), dict(softmax_scale=SCALE,
                                                                                    topk_length=length))
            calls.append(Call("sparse_attn_bwd", label + " padding rows (dO 0, LSE +inf)", "cudnn",
                              (lambda a=m_args: a), cmp_bwd_masked(masked)))

    # ---- sparse loss: score recompute + indexer backward -----------------------------------------------------------
    K = min(512, SK)
    top = tk.indexer_top_k(scores, vis, K, return_val=False)["indices"].view(1, S, K)
    qa, ka = g.randn(1, S, 64, ATTN_D), g.randn(1, SK, ATTN_D)
    keys = ka[0].float()[top[0].clamp(min=0).long()]                                     # (S, 512, D)
    logits = torch.einsum("shd,skd->shk", qa[0].float(), keys) * SCALE
    logits = logits.masked_fill((top[0] < 0).unsqueeze(1), float("-inf"))
    teacher = torch.logaddexp(torch.logsumexp(logits, -1), g.randn(64, dtype=torch.float32)).unsqueeze(0)
    del keys, logits

    def cmp_target(k, t, _args):
        return [("target", k["target"], t["target"], None)]

    def cmp_predict(k, t, _args):
        return [("predict", k["predict"], t["predict"], None)]

    calls.append(Call("sparse_attn_score_recompute", "B1 S4096 H64 D512 K512", "cudnn",
                      lambda: ((qa, ka, teacher, top, SCALE), dict(qhead_per_kv_head=64)), cmp_target))
    q32, k32 = g.randn(1, 256, 1, ATTN_D), g.randn(1, 64, ATTN_D)
    top32 = causal_topk(g, 256, 128, visible_bshd(1, 256, 64, 4, dev)).view(1, 256, 128)
    lse32 = g.randn(1, 256, 1, dtype=torch.float32, scale=0.1) + 3
    calls.append(Call("sparse_attn_score_recompute", "B1 S256 H1 (padded to 64) K128", "cudnn",
                      lambda: ((q32, k32, lse32, top32, SCALE), {}), cmp_target))
    ki3 = ki[:, :, 0].contiguous()
    calls.append(Call("sparse_indexer_score_recompute", "B1 S4096 H64 D128 K512", "cudnn",
                      lambda: ((qi, ki3, wi, top), dict(qhead_per_kv_head=64)), cmp_predict))

    target = tk.sparse_attn_score_recompute(qa, ka, teacher, top, SCALE)["target"]
    picked = torch.gather(scores.view(1, S, SK), -1, top.clamp(min=0).long())
    predict = torch.softmax(torch.where(top >= 0, picked, torch.finfo(torch.float32).min), -1)
    unit = torch.ones((), dtype=torch.float32, device=dev)

    def cmp_ibwd(k, t, args):
        return [("d_index_q", k["d_index_q"], t["d_index_q"], None),
                ("d_weights", k["d_weights"], t["d_weights"], None),
                ("d_index_k", k["d_index_k"], t["d_index_k"], None)]

    calls.append(Call("indexer_backward", "B1 S4096 H64 K512", "cudnn",
                      lambda: ((qi, wi, ki3, target, predict, top, unit),
                               dict(sm_scale=1.0, loss_coeff=float(S), block_I=128)), cmp_ibwd, inplace=(3,)))
    qs, ws, ks = g.randn(1, 256, 32, IDX_D), g.randn(1, 256, 32, scale=0.05), g.randn(1, 64, IDX_D)
    tops = causal_topk(g, 256, 200, visible_bshd(1, 256, 64, 4, dev)).view(1, 256, 200)
    tgt = torch.softmax(g.randn(1, 256, 200, dtype=torch.float32), -1).masked_fill(tops < 0, 0)
    tgt = tgt / tgt.sum(-1, keepdim=True).clamp(min=1e-30)
    prd = torch.softmax(g.randn(1, 256, 200, dtype=torch.float32).masked_fill(tops < 0, -1e30), -1)
    calls.append(Call("indexer_backward", "B1 S256 H32 K200 (heads padded to 64, K to 256)", "cudnn",
                      lambda: ((qs, ws, ks, tgt, prd, tops, unit), dict(sm_scale=0.3, loss_coeff=256.0)), cmp_ibwd,
                      inplace=(3,)))

    # ---- dense loss (refused by production on sm90: measured with sm90_dense_loss=True) -----------------------------
    dense_kw = dict(sm90_dense_loss=True)

    def cmp_dense(k, t, args):
        valid = _finite_both(k["out"], t["out"]) & (t["out"] != 0)
        rows = torch.isfinite(t["denom"])
        if args[0].dim() == 3:  # THD: the SM90 wrapper skips segments without compressed keys (rows unwritten)
            rows = rows & rows_with_keys(layd)
        return [("out", k["out"], t["out"], valid), ("denom", k["denom"], t["denom"], rows)]

    SD, SKD = n(2048), n(512)
    qd, kd = g.randn(1, SD, 64, ATTN_D), g.randn(1, SKD, 1, ATTN_D)
    logit = torch.einsum("bshd,bkd->bshk", qd.float(), kd[:, :, 0].float()) * SCALE
    mask = torch.arange(SKD, device=dev) >= visible_bshd(1, SD, SKD, 4, dev).view(1, SD, 1, 1)
    lse_d = torch.logaddexp(torch.logsumexp(logit.masked_fill(mask, float("-inf")), -1), torch.zeros((), device=dev))
    del logit
    calls.append(Call("dense_attn_score_recompute", "bshd S2048 Sk512 H64 r4", "cudnn",
                      lambda: ((qd, kd, lse_d, SCALE), dict(qhead_per_kv_head=64, ratio=4)), cmp_dense,
                      provider_kwargs=dense_kw))
    qid, kid, wid = g.randn(1, SD, 64, IDX_D), g.randn(1, SKD, 1, IDX_D), g.randn(1, SD, 64, scale=1 / 90)
    calls.append(Call("dense_indexer_score_recompute", "bshd S2048 Sk512 H64 r4", "cudnn",
                      lambda: ((qid, kid, wid), dict(qhead_per_kv_head=64, ratio=4)), cmp_dense,
                      provider_kwargs=dense_kw))
    layd = thd_layout([n(700), 3, n(1000), n(300)], n(2048), 4, dev)
    thd_d = dict(cu_seqlens_q=layd["cu"], cu_seqlens_k=layd["cu_k"], max_seqlen_q=layd["max_q"],
                 max_seqlen_k=layd["max_k"])
    qdt, kdt = g.randn(layd["total"], 64, ATTN_D), g.randn(layd["rows_k"], 1, ATTN_D)
    lse_t = g.randn(layd["total"], 64, dtype=torch.float32, scale=0.5) + 4
    calls.append(Call("dense_attn_score_recompute", "thd T2048 segs[700,3,1000,300]+slack H64 r4", "cudnn",
                      lambda: ((qdt, kdt, lse_t, SCALE), dict(qhead_per_kv_head=64, ratio=4, **thd_d)), cmp_dense,
                      provider_kwargs=dense_kw))
    qit, kit, wit = g.randn(layd["total"], 64, IDX_D), g.randn(layd["rows_k"], 1, IDX_D), g.randn(layd["total"], 64, scale=1 / 90)
    calls.append(Call("dense_indexer_score_recompute", "thd T2048 H64 r4", "cudnn",
                      lambda: ((qit, kit, wit), dict(qhead_per_kv_head=64, ratio=4, **thd_d)), cmp_dense,
                      provider_kwargs=dense_kw))

    att = tk.dense_attn_score_recompute(qd, kd, lse_d, SCALE, ratio=4)
    idx = tk.dense_indexer_score_recompute(qid, kid, wid, ratio=4)
    att_t = tk.dense_attn_score_recompute(qdt, kdt, lse_t, SCALE, ratio=4, **thd_d)
    idx_t = tk.dense_indexer_score_recompute(qit, kit, wit, ratio=4, **thd_d)

    def dense_bwd_args(a, i, q, w, k, thd):
        a_out = torch.nan_to_num(a["out"], neginf=0.0)
        l1, lse = torch.nan_to_num(a["denom"]), torch.nan_to_num(i["denom"])  # rows outside every segment: 0
        return ((q, w, k, a_out, l1, i["out"], lse, unit),
                dict(sm_scale=1.0, loss_coeff=float(q.shape[0] * (q.shape[1] if q.dim() == 4 else 1)), ratio=4,
                     **thd))

    def cmp_dbwd(k, t, args):
        # rows outside every segment are never written by the kernel (torch poisons them): compare written rows
        if args[0].dim() == 3:
            lay_ = layd
            inside = torch.arange(args[0].shape[0], device=dev) < int(lay_["cu"][-1])
            m_q, m_w = inside.view(-1, 1, 1).expand_as(k["d_index_q"]), inside.view(-1, 1).expand_as(k["d_weights"])
        else:
            m_q = m_w = None
        return [("d_index_q", k["d_index_q"], t["d_index_q"], m_q),
                ("d_weights", k["d_weights"], t["d_weights"], m_w),
                ("d_index_k", k["d_index_k"], t["d_index_k"], None)]

    a_b = dense_bwd_args(att, idx, qid, wid, kid[:, :, 0].contiguous(), {})
    calls.append(Call("dense_indexer_backward", "bshd S2048 Sk512 H64 r4", "cudnn", lambda: a_b, cmp_dbwd,
                      inplace=(3, 5), compare_inplace=(5,), provider_kwargs=dense_kw))
    a_t = dense_bwd_args(att_t, idx_t, qit, wit, kit[:, 0].contiguous(), thd_d)
    calls.append(Call("dense_indexer_backward", "thd T2048 H64 r4", "cudnn", lambda: a_t, cmp_dbwd, inplace=(3, 5),
                      compare_inplace=(5,), provider_kwargs=dense_kw))
    return calls


# ================================================================ running =============================================
def _provider(name: str, kwargs: dict):
    # the GPU providers load only when asked for (as fused.plan registers them: by dotted path)
    if name == "flashmla":
        from fused.kernels.flashmla_provider import FlashMLAKernels
        return FlashMLAKernels()
    from fused.kernels.cudnn_provider import CudnnKernels
    return CudnnKernels(**kwargs)


def _time_ms(fn: Callable[[], Any], reps: int = 5, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _flatten(res) -> list[Tensor]:
    values = res.values() if isinstance(res, dict) else (res if isinstance(res, (tuple, list)) else [res])
    return [v for v in values if torch.is_tensor(v)]


def capture_check(call: Call, provider, eager, policy: Optional[policy_mod.Policy] = None) -> str:
    """Capture the call in a CUDA graph (after an eager warm-up on a side stream) and replay it: ``ok`` when the
    replay reproduces the eager result (bit-exact, or within fp32 atomics reordering: rel_l2 <= policy
    ``kernels.capture.rel_l2``), else why not."""
    limit = float((policy or policy_mod.default()).kernel_entry("capture")["rel_l2"])
    args, kwargs = _clone(*call.make(), call.inplace)
    fn = getattr(provider, call.stage)
    try:
        static_args = _clone(args, kwargs, call.inplace)[0]
        graph, out = capture_graph(lambda: fn(*static_args, **kwargs))
        for i in call.inplace:  # restore the overwritten inputs before the replay
            static_args[i].copy_(args[i])
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    worst = 0.0
    for a, b in zip(_flatten(out), _flatten(eager)):
        if call.stage == "indexer_top_k":  # slot order is unspecified: compare each row's selected set
            a, b = a.sort(-1).values, b.sort(-1).values
        a, b = torch.nan_to_num(a.float()), torch.nan_to_num(b.float())
        if not torch.equal(a, b):
            worst = max(worst, metrics.rel_l2(metrics.upcast(a), metrics.upcast(b)))
    if worst == 0.0:
        return "ok (bit-exact)"
    return f"ok (rel_l2 {worst:.2g}, atomics order)" if worst <= limit else \
        f"replay differs from eager (rel_l2 {worst:.3g} > {limit:g})"


def judge_tensor(base: dict, stage: str, name: str, a: Tensor, b: Tensor, mask: Optional[Tensor],
                 policy: Optional[policy_mod.Policy] = None) -> dict:
    """One kernel_parity.csv row: ``base`` + tensor, outcome, message and the metrics of ``a`` vs ``b``."""
    m = kernel_metrics(a, b, mask)
    ok, detail = KernelRule.from_policy(rule_for(stage, name), policy).check(m) if m["n"] else (True, "empty")
    return dict(base, tensor=name, outcome="pass" if ok else "fail", message=detail, **{k: m[k] for k in METRIC_KEYS})


def compare_call(call: Call, base: dict, kernel: tuple, torch_run: tuple,
                 policy: Optional[policy_mod.Policy] = None) -> list[dict]:
    """The kernel_parity.csv rows of one call: ``kernel`` and ``torch_run`` are ``(result, positional args)`` of the
    two providers (the args after the call: in-place outputs included)."""
    (res_k, ka), (res_t, ta) = kernel, torch_run
    rows = [judge_tensor(base, call.stage, name, a, b, mask, policy)
            for name, a, b, mask in call.compare(res_k, res_t, ka)]
    return rows + [judge_tensor(base, call.stage, f"inplace_arg{i}", ka[i], ta[i], _finite_both(ka[i], ta[i]), policy)
                   for i in (call.inplace if call.compare_inplace is None else call.compare_inplace)]


def run_calls(calls: list[Call], timing: bool, capture: bool, log=print,
              policy: Optional[policy_mod.Policy] = None) -> tuple[list[dict], list[dict]]:
    """Pass 1: parity (and timing) of every call. Pass 2: CUDA-graph capture of every call that ran, host-syncing
    wrappers last (a failed capture can leave the context unusable for what follows)."""
    policy = policy or policy_mod.default()
    tk = TorchKernels()
    parity_rows, timing_rows, done = [], [], []
    for call in calls:
        base = dict(stage=call.stage, call=call.label, provider=call.provider)
        t0 = time.perf_counter()
        try:
            prov = _provider(call.provider, call.provider_kwargs)
            args, kwargs = call.make()
            # the wrapper's argument contract, as fused's dispatcher enforces it before any provider runs
            contracts.check(call.stage, bind_arguments(call.stage, args, kwargs))
            reason = prov.check_support(call.stage, *args, **kwargs)
            if reason is not None:
                parity_rows.append(dict(base, tensor="*", outcome="unsupported", message=reason))
                log(f"UNSUPPORTED {call.stage:32s} {call.label}: {reason}")
                continue
            ka, kk = _clone(args, kwargs, call.inplace)
            res_k = getattr(prov, call.stage)(*ka, **kk)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            ta, tk_kw = _clone(args, kwargs, call.inplace)
            res_t = getattr(tk, call.stage)(*ta, **tk_kw)
            rows = compare_call(call, base, (res_k, ka), (res_t, ta), policy)
            parity_rows += rows
            row = dict(base, first_call_s=round(first_s, 3))
            if timing:
                row["kernel_ms"] = _time_ms(lambda: getattr(prov, call.stage)(*_clone(args, kwargs, call.inplace)[0],
                                                                              **kwargs))
                row["torch_ms"] = _time_ms(lambda: getattr(tk, call.stage)(*_clone(args, kwargs, call.inplace)[0],
                                                                           **kwargs), reps=3, warm=1)
            timing_rows.append(row)
            done.append((call, prov, res_k, row))
            verdict = "PASS" if all(r["outcome"] == "pass" for r in rows) else "FAIL"
            log(f"{verdict:11s} {call.stage:32s} {call.label}: " +
                ", ".join(f"{r['tensor']} {r['message']}" for r in rows) +
                (f" | {row['kernel_ms']:.3f} ms vs torch {row['torch_ms']:.2f} ms" if timing else ""))
        except Exception as exc:  # noqa: BLE001 - every call's failure is recorded, never fatal
            torch.cuda.synchronize()
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
            parity_rows.append(dict(base, tensor="*", outcome="error", message=msg))
            log(f"ERROR       {call.stage:32s} {call.label}: {msg}\n{traceback.format_exc(limit=4)}")
    if capture:
        last = lambda d: "thd" in d[0].label and "score_recompute" in d[0].stage  # noqa: E731 - host-syncing
        for call, prov, res_k, row in sorted(done, key=last):
            row["capture"] = capture_check(call, prov, res_k, policy)
            log(f"CAPTURE     {call.stage:32s} {call.label}: {row['capture']}")
    return parity_rows, timing_rows


def environment() -> dict[str, Any]:
    """GPU, driver, torch, CUDA, cuDNN (backend and frontend) and FlashMLA versions."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version(), "host": platform.node()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2 ** 30, 1))
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    for name, getter in (("cudnn", "fused.kernels.cudnn_provider:CudnnKernels"),
                         ("flashmla", "fused.kernels.flashmla_provider:FlashMLAKernels")):
        module, _, cls = getter.partition(":")
        try:
            env.update(getattr(__import__(module, fromlist=[cls]), cls).versions())
        except Exception as exc:  # noqa: BLE001
            env[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    return env


def write_csv(rows: list[dict], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity.kernel_checks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="stages to run (default: all)")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-capture", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    (args.out / "kernel_env.json").write_text(json.dumps(env, indent=2, sort_keys=True) + "\n")
    print(json.dumps(env))
    calls = build_calls(torch.device("cuda"))
    if args.only:
        calls = [c for c in calls if c.stage in args.only]
    parity_rows, timing_rows = run_calls(calls, timing=not args.no_timing, capture=not args.no_capture)
    write_csv(parity_rows, args.out / "kernel_parity.csv")
    write_csv(timing_rows, args.out / "kernel_timings.csv")
    bad = [r for r in parity_rows if r["outcome"] in ("fail", "error")]
    print(f"{len(calls)} calls, {len(parity_rows)} tensor rows, {len(bad)} failing or erroring")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
