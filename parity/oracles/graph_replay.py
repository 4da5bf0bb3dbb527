"""CUDA-graph replay under re-packing: the machinery of the ``graph-replay`` oracle (:mod:`parity.oracles.metamorphic`).

Production captures the layer once per static shape: a THD buffer of ``T`` rows, ``cu_seqlens*`` of a fixed number
of entries, a fixed compressed capacity and a host ``max_seqlen``. Each step then **overwrites the cu_seqlens
tensors in place** with the step's packing and replays. Any boundary the composition read on the host at capture
time (a ``.item()``, a Python branch on a tensor, a size taken from a device value) is baked into the graph and is
wrong for every other packing — a known bug class.

* :func:`static_layout` — the case's packing with the static envelope (compressed capacity ``T // ratio``);
* :func:`repackings` — other packings of the same buffer and segment count (reversed, rotated, merged into the
  first segment, real lengths halved), each a valid :class:`~cases.layout.ThdLayout` differing from the case's;
* :class:`GraphStep` — static buffers and one forward + backward of an implementation on them (what a graph
  captures); :meth:`GraphStep.set_packing` overwrites the cu_seqlens tensors and dO in place;
* :func:`capture_graph` — ``(graph, static result)`` of a function captured in a CUDA graph (GPU only).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from cases.case import Case
from cases.layout import ThdLayout
from cases.tensors import CaseTensors, materialize

from parity.judge.snapshot import FORWARD_NAMES, INPUT_ORDER, _call


def capture_graph(fn: Callable[[], Any], warmups: int = 1) -> tuple:
    """``(graph, static result)`` of ``fn()`` captured in a CUDA graph, after ``warmups`` calls on a side stream
    (JIT compiles and plan caches happen there, as capture requires); replaying the graph refills the result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def _packing(real: list[int], padded: list[int], like: ThdLayout) -> ThdLayout:
    cu, cup = [0], [0]
    for r, p in zip(real, padded):
        cu.append(cu[-1] + r)
        cup.append(cup[-1] + p)
    return ThdLayout(cu_seqlens=tuple(cu), cu_seqlens_padded=tuple(cup), total_tokens=like.total_tokens,
                     compressed_capacity=like.compressed_capacity).validate()


def static_layout(layout: ThdLayout, ratio: int) -> ThdLayout:
    """``layout`` with the capacity every packing of its buffer fits: ``total_tokens // ratio`` compressed rows
    (ratio > 1; none without a compressor). The ``capacity`` oracle shows a capacity equals the exact count."""
    capacity = layout.total_tokens // ratio if ratio > 1 else None
    return dataclasses.replace(layout, compressed_capacity=capacity).validate()


def repackings(layout: ThdLayout) -> list[ThdLayout]:
    """Other packings of ``layout``'s buffer (same ``total_tokens``, segment count and capacity), each different from
    ``layout`` and from one another: segments reversed, rotated by one, merged into the first (zero-length rest),
    real lengths halved, rounded up (other real-token totals, more padding)."""
    real, padded = list(layout.real_lengths), list(layout.padded_lengths)
    candidates = [(real[::-1], padded[::-1]), (real[1:] + real[:1], padded[1:] + padded[:1]),
                  ([sum(real)] + [0] * (len(real) - 1), [sum(padded)] + [0] * (len(padded) - 1)),
                  ([(r + 1) // 2 for r in real], padded)]
    seen = {(tuple(real), tuple(padded))}
    out = []
    for r, p in candidates:
        if (tuple(r), tuple(p)) not in seen:
            seen.add((tuple(r), tuple(p)))
            out.append(_packing(r, p, layout))
    return out


def packing_grad_output(case: Case, layout: ThdLayout, device) -> torch.Tensor:
    """The dO of ``case`` on ``layout``: the case's seeded dO, zero on non-real rows at layer scope."""
    return materialize(case.replace(layout=layout), device).grad_output


class GraphStep:
    """Static buffers of one forward + backward of ``api`` (``attention_layer`` / ``core_attention``) on the case's
    tensors under ``layout`` with the static ``max_seqlen`` envelope (the buffer length); :meth:`run` returns the
    snapshot tensors (names of :mod:`parity.judge.snapshot`), all produced on the step's own buffers."""

    def __init__(self, api: Any, case: Case, tensors: CaseTensors, layout: ThdLayout):
        self.api, self.case = api, case
        self.inputs = {n: v.detach().clone().requires_grad_(True) for n, v in tensors.inputs.items()}
        self.params = {n: v.detach().clone().requires_grad_(True) for n, v in tensors.params.items()}
        device = tensors.grad_output.device
        psp = layout.packed_seq_params(case.config.compress_ratio, device=device)
        self.psp = dataclasses.replace(psp, max_seqlen_q=layout.total_tokens)
        self.d_out = packing_grad_output(case, layout, device)
        self.names = [n for n in INPUT_ORDER if n in self.inputs]
        self.leaves = [self.inputs[n] for n in self.names] + list(self.params.values())
        self.names = [f"grad/{n}" for n in self.names] + [f"grad/{n}" for n in self.params]

    def set_packing(self, layout: ThdLayout, d_out: Optional[torch.Tensor] = None) -> None:
        """Overwrite the cu_seqlens tensors and dO **in place** (a graph keeps their addresses)."""
        fresh = layout.packed_seq_params(self.case.config.compress_ratio, device=self.d_out.device)
        self.psp.cu_seqlens_q.copy_(fresh.cu_seqlens_q)
        self.psp.cu_seqlens_q_padded.copy_(fresh.cu_seqlens_q_padded)
        self.d_out.copy_(packing_grad_output(self.case, layout, self.d_out.device) if d_out is None else d_out)

    def run(self) -> dict[str, torch.Tensor]:
        result = _call(self.api, self.case, self.inputs, self.params, self.psp, None)
        grads = torch.autograd.grad(result.objective(self.d_out), self.leaves, allow_unused=True)
        out = {n: getattr(result, n).detach() for n in FORWARD_NAMES if getattr(result, n) is not None}
        out.update({n: g.detach() for n, g in zip(self.names, grads) if g is not None})
        return out
