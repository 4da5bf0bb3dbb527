"""What ``dsv4-parity bench`` runs: workloads (profile × tokens × layout), their tensors, one forward + backward of
an implementation, and the reference's stages in isolation.

A :class:`Workload` is one sequence of ``T`` tokens (``seq``: BSHD ``B=1, S=T``) or a THD pack of ``T`` tokens in
segments of ``segment_len`` (``pack``; production's compressed capacity), at a profile's production shapes
(:mod:`cases.profiles`), compress ratio ``r`` and loss. Values are random with the distributions of
:mod:`cases.tensors` (parameters exactly its ``initial_value``; inputs drawn on the device, so a 64K-token input
does not go through the host) — performance does not depend on them.

The reference stages (:func:`reference_stages`) call the reference's own stage functions on inputs of the
workload's shapes (``B`` sequences of ``S`` tokens): ``index_scores``, ``select_topk``, ``sparse_attention``
(forward, and its autograd backward), ``indexer_kl_rows`` (the loss: teacher recompute and student KL) and the
backward of scores + loss into the indexer's q / k / w, and the public ``compressor`` (forward + backward, both
implementations).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from cases.case import Case
from cases.config import ModelConfig
from cases.layout import BshdLayout
from cases.packing import Segment, build_layout, capacity_for
from cases.profiles import get_profile
from cases.tensors import (FP32_PARAMETERS, CaseTensors, initial_value, input_shapes, output_shape,
                           parameter_shapes)

from bench.flops import KeyCounts, key_counts, total_flops



@dataclass(frozen=True)
class Workload:
    """One benchmarked shape (see the module docstring)."""

    profile: str
    tokens: int
    layout: str = "seq"
    segment_len: int = 4096
    ratio: int = 4
    loss: str = "sparse"
    dtype: str = "bfloat16"
    scope: str = "layer"

    def with_(self, **changes: Any) -> "Workload":
        return replace(self, **changes)

    @property
    def config(self) -> ModelConfig:
        return get_profile(self.profile).config(self.ratio, dsa_indexer_use_sparse_loss=(self.loss != "dense"))

    @property
    def effective_loss(self) -> str:
        """The loss that is actually computed (only ratio-4 layers with an indexer have one)."""
        return self.loss if self.config.has_indexer else "none"

    def segment_lengths(self) -> list[int]:
        if self.layout == "seq":
            return [self.tokens]
        L = max(1, min(self.segment_len, self.tokens))
        full, rest = divmod(self.tokens, L)
        return [L] * full + ([rest] if rest else [])

    @functools.cached_property
    def case(self) -> Case:
        if self.layout == "seq":
            layout = BshdLayout(1, self.tokens)
        else:
            segments = [Segment(L, L) for L in self.segment_lengths()]
            plain = build_layout(segments)
            layout = build_layout(segments, capacity=capacity_for(plain, self.ratio, "production"))
        profile = get_profile(self.profile)
        return Case(config=self.config, layout=layout, dtype=self.dtype, training=self.loss != "none",
                    scope=self.scope, seed=0, device=profile.device, profile=self.profile, tags=("bench",))

    @functools.cached_property
    def counts(self) -> KeyCounts:
        return key_counts(self.config, self.segment_lengths())

    @property
    def flops(self) -> float:
        return total_flops(self.config, self.counts, scope=self.scope, loss=self.effective_loss)

    def label(self) -> dict:
        return {"profile": self.profile, "tokens": self.tokens, "layout": self.layout,
                "segment_len": self.segment_len if self.layout == "pack" else None, "ratio": self.ratio,
                "loss": self.effective_loss, "dtype": self.dtype, "scope": self.scope}


# ---- tensors ------------------------------------------------------------------------------------------------------
def _layer_params(profile: str, ratio: int, loss: str, dtype: str, device: str) -> dict[str, torch.Tensor]:
    """Every layer parameter (``cases.tensors.initial_value``, seed 0); they depend on neither ``T`` nor the loss."""
    return _cached_params(profile, ratio, dtype, device)


@functools.lru_cache(maxsize=3)
def _cached_params(profile: str, ratio: int, dtype: str, device: str) -> dict[str, torch.Tensor]:
    w = Workload(profile, 1, ratio=ratio, dtype=dtype)
    case = w.case
    out = {}
    for name, shape in parameter_shapes(case.config, "layer").items():
        value = initial_value(0, name, shape)
        target = torch.float32 if (case.torch_dtype == torch.bfloat16 and name in FP32_PARAMETERS) \
            else case.torch_dtype
        out[name] = value.to(target).to(device)
    return out


def clear_caches() -> None:
    _cached_params.cache_clear()


def make_tensors(work: Workload, device: str, seed: int = 0) -> CaseTensors:
    """The workload's parameters, inputs and output gradient on ``device`` (see the module docstring)."""
    case = work.case
    dtype = case.torch_dtype
    full = _layer_params(work.profile, work.ratio, work.loss, work.dtype, device)
    params = {n: full[n] for n in parameter_shapes(case.config, case.scope)}
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    inputs = {name: randn(shape) for name, shape in input_shapes(case).items()}
    psp = case.layout.packed_seq_params(case.config.compress_ratio, device=device) if case.is_thd else None
    rows = (case.layout.total_tokens,) if case.is_thd else (case.layout.batch, case.layout.seq_len)
    return CaseTensors(params=params, inputs=inputs, grad_output=randn(output_shape(case)), packed_seq_params=psp,
                       real_rows=torch.ones(rows, dtype=torch.bool, device=device))


def tensor_bytes(tensors: CaseTensors) -> int:
    every = list(tensors.params.values()) + list(tensors.inputs.values()) + [tensors.grad_output]
    return sum(t.numel() * t.element_size() for t in every)


def forward_backward(api: Any, case: Case, tensors: CaseTensors,
                     context: Callable[[], Any]) -> Callable[[], None]:
    """A closure running ``api``'s ``attention_layer`` / ``core_attention`` forward and the backward of
    ``sum(out · dO) + indexer_loss`` into every input and parameter (what a training step asks of the layer)."""
    leaves_in = {n: t.detach() for n, t in tensors.inputs.items()}
    leaves_p = {n: t.detach() for n, t in tensors.params.items()}
    psp = tensors.packed_seq_params

    def step() -> None:
        inputs = {n: t.requires_grad_(True) for n, t in leaves_in.items()}
        params = {n: t.requires_grad_(True) for n, t in leaves_p.items()}
        with context():
            if case.scope == "layer":
                res = api.attention_layer(inputs["hidden"], params, case.config, psp, training=case.training)
            else:
                res = api.core_attention(inputs["query"], inputs["kv"], inputs["hidden"], inputs["q_latent"],
                                         params, case.config, psp, training=case.training)
            outs, grads = [res.out], [tensors.grad_output]
            if res.indexer_loss is not None and res.indexer_loss.requires_grad:
                outs.append(res.indexer_loss)
                grads.append(torch.ones_like(res.indexer_loss))
            leaves = [t for t in list(inputs.values()) + list(params.values())]
            torch.autograd.grad(outs, leaves, grads, allow_unused=True)

    return step


# ---- reference stages in isolation --------------------------------------------------------------------------------------
@dataclass
class StageCall:
    """One isolated stage: ``prepare()`` (untimed, returns the state) and ``run(state)`` (timed)."""

    name: str
    function: str                       # the reference function measured, ``module:qualname``
    run: Callable[[Any], Any]
    prepare: Optional[Callable[[], Any]] = None
    flops: float = 0.0


def _resolve(path: str) -> Callable:
    module, _, name = path.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def reference_stages(work: Workload, device: str, seed: int = 1) -> list[StageCall]:
    """The reference's stages of ``work`` (ratio 4 with an indexer; else only the compressor / attention)."""
    from bench.flops import compressor_flops, kernel_flops

    c = work.config
    dtype = work.case.torch_dtype
    lengths = work.segment_lengths()
    S = lengths[0]
    B = sum(1 for L in lengths if L == S)       # the equal segments (a shorter trailing one is left out)
    n, D, W = c.num_attention_heads, c.v_head_dim, c.csa_window_size
    nI, dI, K = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim, c.dsa_indexer_topk
    gen = torch.Generator(device=device).manual_seed(seed)
    flops = kernel_flops(c, key_counts(c, [S] * B), loss=work.effective_loss)

    def randn(*shape, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    f_index = _resolve("reference.indexer:index_scores")
    f_topk = _resolve("reference.indexer:select_topk")
    f_attn = _resolve("reference.sparse_attention:sparse_attention")
    f_window = _resolve("reference.sparse_attention:window_indices")
    f_selected = _resolve("reference.sparse_attention:selected_compressed_indices")
    f_all = _resolve("reference.sparse_attention:all_compressed_indices")
    f_kl = _resolve("reference.indexer_loss:indexer_kl_rows")

    stages: list[StageCall] = []
    hidden = randn(B, S, c.hidden_size)
    params = {k: v for k, v in _layer_params(work.profile, work.ratio, work.loss, work.dtype, device).items()}
    if c.has_compressor:
        prefix = "core_attention.compressor"

        def compress_fwd_bwd(api_path: str) -> Callable[[Any], Any]:
            api = _resolve(api_path)

            def run(_state):
                x = hidden.detach().requires_grad_(True)
                ps = {k: v.detach().requires_grad_(True) for k, v in params.items() if k.startswith(prefix + ".")}
                out = api(x, ps, prefix, c)
                if not out.requires_grad:  # no entry (T < r): nothing to differentiate
                    return out
                return torch.autograd.grad(out, [x] + list(ps.values()), torch.ones_like(out), allow_unused=True)

            return run

        stages.append(StageCall("compressor", "reference:compressor", compress_fwd_bwd("reference:compressor"),
                                flops=compressor_flops(c, B * S)))

    query, kv = randn(B, S, n, D), randn(B, S, D)
    sink = torch.randn((n,), generator=gen, device=device, dtype=torch.float32)
    n_comp = S // c.compress_ratio if c.has_compressor else 0
    compressed = randn(B, n_comp, D)
    window = f_window(S, W, device).expand(B, S, W)
    topk = None
    if c.has_indexer and n_comp:
        q_i, k_i = randn(B, S, nI, dI), randn(B, n_comp, dI)
        w_i = randn(B, S, nI, scale=nI ** -0.5)
        scale_i = c.indexer_softmax_scale
        with torch.no_grad():
            scores = f_index(q_i, k_i, w_i, scale_i, ratio=4)
            topk = f_topk(scores, K)
        stages.append(StageCall("indexer_forward", "reference.indexer:index_scores",
                                lambda _s: f_index(q_i, k_i, w_i, scale_i, ratio=4),
                                flops=flops.get("indexer_forward", 0.0)))
        stages.append(StageCall("indexer_top_k", "reference.indexer:select_topk", lambda _s: f_topk(scores, K)))
        ids = f_selected(topk, S, 4, n_comp)
    elif n_comp:
        ids = f_all(S, c.compress_ratio, n_comp, device).expand(B, S, n_comp)
    else:
        ids = None
    indices = window if ids is None else torch.cat((window, ids), dim=-1)
    kv_full = torch.cat((kv, compressed), dim=1)
    scale = c.softmax_scale
    stages.append(StageCall("sparse_attn_fwd", "reference.sparse_attention:sparse_attention",
                            lambda _s: f_attn(query, kv_full, indices, sink, scale),
                            flops=flops.get("sparse_attn_fwd", 0.0)))
    d_out = randn(B, S, n, D)

    def attn_forward():
        leaves = [query.detach().requires_grad_(True), kv_full.detach().requires_grad_(True),
                  sink.detach().requires_grad_(True)]
        out, _lse = f_attn(leaves[0], leaves[1], indices, leaves[2], scale)
        return out, leaves

    stages.append(StageCall("sparse_attn_bwd", "reference.sparse_attention:sparse_attention (autograd backward)",
                            lambda state: torch.autograd.grad(state[0], state[1], d_out), prepare=attn_forward,
                            flops=flops.get("sparse_attn_bwd", 0.0)))
    if c.has_indexer and n_comp and work.effective_loss != "none":
        sparse = work.effective_loss == "sparse"
        recompute = sum(v for k, v in flops.items() if "recompute" in k or k == "csa_teacher_lse")
        stages.append(StageCall("score_recompute", "reference.indexer_loss:indexer_kl_rows",
                                lambda _s: f_kl(scores, topk if sparse else None, query, kv, compressed, sink, c),
                                flops=recompute))

        def loss_forward():
            leaves = [q_i.detach().requires_grad_(True), k_i.detach().requires_grad_(True),
                      w_i.detach().requires_grad_(True)]
            s = f_index(leaves[0], leaves[1], leaves[2], scale_i, ratio=4)
            kl = f_kl(s, topk if sparse else None, query, kv, compressed, sink, c).sum()
            return kl, leaves

        stages.append(StageCall("indexer_backward", "reference.indexer:index_scores + indexer_kl_rows "
                                                    "(autograd backward)",
                                lambda state: torch.autograd.grad(state[0], state[1]), prepare=loss_forward,
                                flops=flops.get("indexer_backward", flops.get("dense_indexer_backward", 0.0))))
    return stages


def fused_compressor_stage(work: Workload, device: str, seed: int = 1) -> Optional[StageCall]:
    """The fused public ``compressor`` (forward + backward) on the inputs :func:`reference_stages` uses."""
    from bench.flops import compressor_flops

    c = work.config
    if not c.has_compressor:
        return None
    lengths = work.segment_lengths()
    S = lengths[0]
    B = sum(1 for L in lengths if L == S)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn((B, S, c.hidden_size), generator=gen, device=device,
                         dtype=torch.float32).to(work.case.torch_dtype)
    prefix = "core_attention.compressor"
    params = {k: v for k, v in _layer_params(work.profile, work.ratio, work.loss, work.dtype, device).items()
              if k.startswith(prefix + ".")}
    api = _resolve("fused:compressor")

    def run(_state):
        x = hidden.detach().requires_grad_(True)
        ps = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        out = api(x, ps, prefix, c)
        if not out.requires_grad:  # no entry (T < r): nothing to differentiate
            return out
        return torch.autograd.grad(out, [x] + list(ps.values()), torch.ones_like(out), allow_unused=True)

    return StageCall("compressor", "fused:compressor", run, flops=compressor_flops(c, B * S))
