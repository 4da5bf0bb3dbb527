"""Implementations with planted defects, built by wrapping a real one (``reference`` or ``fused``).

Each wrapper keeps the wrapped implementation's providers (``use_backend`` / ``available_providers``) and
changes exactly one thing, so an engine test can assert that the harness accepts or rejects that one thing:

* ``ulp_noise``: ``out`` moved by ±1 ulp of its dtype, independently per element (gradients untouched);
* ``bias``: ``out`` scaled by ``1 + factor`` (differentiable: the gradients carry the bias too);
* ``raises`` / ``unsupported``: a RuntimeError / NotImplementedError from the forward;
* ``pad_grad_leak``: a non-zero gradient reaches padding rows of ``hidden``;
* ``topk_swap``: the last selected id of every row that chooses is replaced by the best unselected column;
* ``slack_garbage``: slack rows of ``out`` hold 1.0 instead of 0;
* ``mutates_input``: the forward writes into ``hidden``;
* ``crashes``: the process dies (``os._exit(3)``) on THD cases, as on a fatal CUDA fault;
* ``flaky``: raises as ``raises`` while ``DSV4_TEST_FLAKY`` is set in the environment, else is the base;

and, for the metamorphic oracles:

* ``global_row_term``: ``out`` gets a term in the *packed* row index (per-segment runs see other indices);
* ``pad_value_leak``: ``out`` gets a term in the mean of ``hidden`` over padding rows;
* ``capacity_dependent``: ``out`` depends on ``total_comp_capacity``;
* ``nondeterministic``: ``out`` gets fresh unseeded noise of 1e-6 on every call;
* ``pad_dout_leak``: padding rows of ``out`` get a term in ``hidden``, so their dO reaches real rows' gradients;
* ``detached_indexer_loss``: the loss without its graph (at loss coefficient 0: no indexer gradient at all);
* ``cp_exact`` / ``cp_rank_term``: a ``use_context_parallel`` hook (the ``cp`` oracle's); at CP > 1 the first is the
  base unchanged, the second adds a term to the rows of the second half of the pack (a rank-offset bug).
"""

from __future__ import annotations

import importlib
import os

import torch


class Wrapped:
    """Delegates to ``base`` (a module name) and post-processes the :class:`AttentionOutput`."""

    def __init__(self, base: str, **options):
        self._base_name = base
        self.options = options

    @property
    def base(self):
        return importlib.import_module(self._base_name)

    def __getattr__(self, name):  # use_backend, available_providers, ...
        if name.startswith("_") or name == "options":
            raise AttributeError(name)
        return getattr(self.base, name)

    def attention_layer(self, hidden, params, config, packed_seq_params=None, *, training=True, topk_indices=None):
        hidden = self.before(hidden, packed_seq_params)
        res = self.base.attention_layer(hidden, params, config, packed_seq_params, training=training,
                                        topk_indices=topk_indices)
        return self.after(res, hidden, packed_seq_params)

    def core_attention(self, query, kv, hidden, q_latent, params, config, packed_seq_params=None, *, training=True,
                       topk_indices=None):
        hidden = self.before(hidden, packed_seq_params)
        res = self.base.core_attention(query, kv, hidden, q_latent, params, config, packed_seq_params,
                                       training=training, topk_indices=topk_indices)
        return self.after(res, hidden, packed_seq_params)

    def before(self, hidden, psp):
        return hidden

    def after(self, res, hidden, psp):
        return res


def _ulp(x: torch.Tensor) -> torch.Tensor:
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    return up - x


class UlpNoise(Wrapped):
    def after(self, res, hidden, psp):
        gen = torch.Generator().manual_seed(self.options.get("seed", 0))
        sign = (torch.randint(0, 2, res.out.shape, generator=gen) * 2 - 1).to(res.out.device, res.out.dtype)
        out = res.out.detach()
        noisy = torch.where(out != 0, out + sign * _ulp(out.abs()), out)  # zeros (slack rows) stay exact
        res.out = res.out + (noisy - res.out).detach()
        return res


class Bias(Wrapped):
    def after(self, res, hidden, psp):
        res.out = res.out * (1.0 + self.options.get("factor", 0.01))
        return res


class Raises(Wrapped):
    def after(self, res, hidden, psp):
        raise RuntimeError("planted failure: CUDA error: an illegal memory access was encountered")


class Unsupported(Wrapped):
    def after(self, res, hidden, psp):
        raise NotImplementedError("planted: this kernel does not support the case")


class PadGradLeak(Wrapped):
    """Adds ``0 * ... + eps * sum(hidden on padding rows)`` to out: forward unchanged up to eps, padding grads ≠ 0."""

    def after(self, res, hidden, psp):
        if psp is None:
            return res
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        cu, cu_pad = psp.cu_seqlens_q.long(), psp.cu_seqlens_q_padded.long()
        real = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for b in range(cu.numel() - 1):
            n = int(cu[b + 1] - cu[b])
            real |= (rows >= cu_pad[b]) & (rows < cu_pad[b] + n)
        leak = (hidden * (~real).unsqueeze(-1)).sum() * 1e-30
        res.out = res.out + leak.to(res.out.dtype)
        return res


class TopkSwap(Wrapped):
    """Selects differently (and consistently: the output is computed with the swapped selection)."""

    def attention_layer(self, hidden, params, config, packed_seq_params=None, *, training=True, topk_indices=None):
        swapped = None
        if topk_indices is None:
            with torch.no_grad():
                first = self.base.attention_layer(hidden, params, config, packed_seq_params, training=training)
            topk_indices = swapped = self.swap(first.topk_indices, first.index_scores)
        res = self.base.attention_layer(hidden, params, config, packed_seq_params, training=training,
                                        topk_indices=topk_indices)
        if swapped is not None:
            res.topk_indices = swapped  # report the selection the output was computed with
        return res

    @staticmethod
    def swap(idx, scores):
        """Replace the last selected id of every row that had to choose by its best unselected column."""
        if idx is None:
            return None
        idx, scores = idx.detach().clone(), scores.detach()
        flat_i, flat_s = idx.reshape(-1, idx.shape[-1]), scores.reshape(-1, scores.shape[-1])
        for row in range(flat_i.shape[0]):
            chosen = flat_i[row][flat_i[row] >= 0].tolist()
            rest = [c for c in torch.isfinite(flat_s[row]).nonzero().squeeze(1).tolist() if c not in chosen]
            if len(chosen) == flat_i.shape[1] and rest:
                best = max(rest, key=lambda c: float(flat_s[row, c]))
                flat_i[row] = torch.tensor(sorted(chosen[:-1] + [best]), dtype=idx.dtype)
        return flat_i.reshape(idx.shape)


class SlackGarbage(Wrapped):
    def after(self, res, hidden, psp):
        if psp is None:
            return res
        last = int(psp.cu_seqlens_q_padded[-1])
        if last < res.out.shape[0]:
            pad = torch.zeros_like(res.out)
            pad[last:] = 1.0
            res.out = res.out + pad
        return res


class MutatesInput(Wrapped):
    def before(self, hidden, psp):
        with torch.no_grad():
            hidden.view(-1)[0] += 1.0
        return hidden


class Crashes(Wrapped):
    """Dies on packed (THD) cases only, so a run can show that the next case still runs."""

    def after(self, res, hidden, psp):
        if psp is not None:
            os._exit(3)
        return res


def _term(res, values):
    """Add ``values`` (one per row) to every element of the row's ``out``."""
    shape = values.shape + (1,) * (res.out.dim() - values.dim())
    res.out = res.out + values.reshape(shape).to(res.out.dtype)
    return res


def _real_mask(hidden, psp):
    """bool ``[T]``: the real rows of a THD pack."""
    real = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    for b in range(psp.cu_seqlens_q.numel() - 1):
        start = int(psp.cu_seqlens_q_padded[b])
        real[start:start + int(psp.cu_seqlens_q[b + 1] - psp.cu_seqlens_q[b])] = True
    return real


class GlobalRowTerm(Wrapped):
    def after(self, res, hidden, psp):
        rows = torch.arange(hidden.shape[:-1].numel(), device=hidden.device, dtype=torch.float64)
        return _term(res, 1e-3 * rows.reshape(hidden.shape[:-1]))


class PadValueLeak(Wrapped):
    def after(self, res, hidden, psp):
        if psp is None:
            return res
        real = _real_mask(hidden, psp)
        if real.all():
            return res
        leak = hidden[~real].mean() * 1e-2
        return _term(res, leak * torch.ones(hidden.shape[0], device=hidden.device))


class RaisesWhileFlagged(Raises):
    """Raises like :class:`Raises` while the environment variable ``DSV4_TEST_FLAKY`` is set, else the base."""

    def after(self, res, hidden, psp):
        return super().after(res, hidden, psp) if os.environ.get("DSV4_TEST_FLAKY") else res


class CapacityDependent(Wrapped):
    def after(self, res, hidden, psp):
        cap = 0 if psp is None or psp.total_comp_capacity is None else psp.total_comp_capacity
        return _term(res, torch.full(hidden.shape[:-1], 1e-3 * (cap + 1), device=hidden.device))


class Nondeterministic(Wrapped):
    def after(self, res, hidden, psp):
        return _term(res, 1e-6 * torch.rand(hidden.shape[:-1], device=hidden.device))


fused_ulp_noise = UlpNoise("fused")
fused_bias = Bias("fused", factor=0.01)
fused_raises = Raises("fused")
fused_unsupported = Unsupported("fused")
reference_pad_grad_leak = PadGradLeak("reference")
reference_topk_swap = TopkSwap("reference")
reference_slack_garbage = SlackGarbage("reference")
reference_mutates_input = MutatesInput("reference")
reference_crashes = Crashes("reference")
reference_flaky = RaisesWhileFlagged("reference")
reference_global_row_term = GlobalRowTerm("reference")
reference_pad_value_leak = PadValueLeak("reference")
reference_capacity_dependent = CapacityDependent("reference")
reference_nondeterministic = Nondeterministic("reference")


class PadDoutLeak(Wrapped):
    """Padding rows of ``out`` get a term in ``hidden`` (every row): their output gradient reaches ``grad/hidden``
    on real rows too. The forward of real rows is unchanged."""

    def after(self, res, hidden, psp):
        if psp is None:
            return res
        term = torch.where(_real_mask(hidden, psp), 0.0, 1e-3 * hidden.sum())
        return _term(res, term)


reference_pad_dout_leak = PadDoutLeak("reference")


def _gather_term(x):
    """A term whose C++ backward node raises (``GatherBackward0``: its saved index is written after the forward, as
    a kernel check failing inside a backward would): the error's traceback holds no frame of this function."""
    flat = x.reshape(-1, x.shape[-1])
    index = torch.zeros(flat.shape, dtype=torch.long, device=x.device)
    term = torch.gather(flat, 0, index)
    index.add_(0)  # bumps the index's version: the backward refuses the modified saved tensor
    return term.reshape(x.shape)


class _PythonBackwardFails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("planted failure in a Python backward")


class BackwardRaises(Wrapped):
    """``out`` gets ``0 * term`` whose backward raises in a C++ node (``python=False``) or in Python code."""

    def after(self, res, hidden, psp):
        if self.options.get("python"):
            res.out = _PythonBackwardFails.apply(res.out)
        else:
            res.out = res.out + 0.0 * _gather_term(res.out)
        return res


reference_backward_raises = BackwardRaises("reference")
reference_python_backward_raises = BackwardRaises("reference", python=True)


class ContextParallel(Wrapped):
    """The base with a ``use_context_parallel`` hook; at CP > 1, ``term`` is added to ``out``'s second-half rows."""

    def __init__(self, base: str, term: float = 0.0):
        super().__init__(base, term=term)
        self.cp = 1

    def use_context_parallel(self, n):
        import contextlib

        @contextlib.contextmanager
        def block():
            before, self.cp = self.cp, int(n)
            try:
                yield
            finally:
                self.cp = before

        return block()

    def context_parallel_size(self):
        return self.cp

    def after(self, res, hidden, psp):
        if self.cp == 1 or not self.options["term"]:
            return res
        rows = hidden.shape[0]
        return _term(res, torch.where(torch.arange(rows, device=hidden.device) >= rows // 2,
                                      self.options["term"], 0.0))


reference_cp_exact = ContextParallel("reference")
reference_cp_rank_term = ContextParallel("reference", term=1e-3)


class DetachedIndexerLoss(Wrapped):
    """The indexer loss returned without its graph: at coefficient 0 the indexer parameters then get no gradient."""

    def after(self, res, hidden, psp):
        if res.indexer_loss is not None:
            res.indexer_loss = res.indexer_loss.detach()
        return res


reference_detached_indexer_loss = DetachedIndexerLoss("reference")
