"""Deviation models: what an implementation computes instead of the contract, derived from the reference's own runs.

A known deviation (:mod:`parity.deviations.known`) is not a mask over tensor names: its registry entry names a **model** from
:data:`MODELS`, a small function that turns the contract's expectation of a case (the reference's float64 ``truth``
and same-dtype ``noise`` snapshots, and what the padding-row contract run must return) into the documented deviant
one. The engine then judges the implementation against that expectation with the normal policy and rules: ``known``
only where it matches the model within tolerance (:func:`parity.deviations.known.apply`).

An :class:`Expectation` holds

* ``truth`` / ``noise``: the snapshots the implementation's run is compared with (``noise`` *is* ``truth`` for a
  float64 case judged at float64; a model then changes it once);
* ``contract``: ``(truth, noise)`` gradients expected of the implementation's run with ``dO`` on the padding rows only
  and no loss term (tensor ``contract/padding_dout``, :mod:`parity.judge.padding_dout`); ``None`` is the contract: every
  gradient exactly 0;
* ``padding_grads``: gradients on padding rows are expected (a model that keeps the padding rows' ``dO``): the input
  gradients are then judged numerically on every row instead of "exactly 0 on padding rows" plus real rows only;
* ``slack_forward_free``: the forward values of slack rows (past the last boundary, in no sequence) are not the
  contract's ``0`` / ``-inf`` (rows nothing reads; forward tensors are judged on real rows); what those rows inject
  into the gradients is modelled exactly;
* ``slack_keys``: where a model frees them, the one key row each slack row attends (``[T, D]``, the case's ``kv``
  row, zeros on other rows; core scope), which bounds the freed ``out``: a weight in ``(0, 1]`` times that row
  (:func:`parity.judge.structure.slack_out_outside`). None: only their finiteness is checked (layer scope: the
  output projection mixes the row).

A model gets the expectation and a :class:`ModelContext` (the case, its tensors, and ``reference(tensors,
with_loss)``: the reference's truth and noise runs on other tensors, with the implementation's top-k, in the case's
judging precision). Models commute with each other where two apply to one case (an entry's model is applied once
however many entries name it). Conventions: THD rows ``[T, ...]`` (``cases/layout.py``); gradient names
``grad/<input|parameter>`` (:mod:`parity.judge.snapshot`); the indexer's own parameters ``grad/core_attention.indexer.*``
receive gradient only from the KL loss (spec §5: its inputs are detached).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from cases.case import Case
from cases.tensors import CaseTensors

from parity.judge.padding_dout import padding_dout_only
from parity.judge.snapshot import Snapshot

#: the indexer's own parameters: trained by the KL loss alone
INDEXER_GRADS = "grad/core_attention.indexer."
#: the indexer's outputs (a model that removes the indexer removes these and its parameters' gradients)
INDEXER_OUTPUTS = ("index_scores", "topk_indices", "indexer_loss")


def _copy(snap: Snapshot) -> Snapshot:
    return Snapshot(dict(snap.tensors), list(snap.mutated), snap.record, dict(snap.not_provided))


@dataclass
class Expectation:
    """What a case's implementation run is expected to give (see the module docstring)."""

    truth: Snapshot
    noise: Snapshot
    contract: Optional[tuple[Snapshot, Snapshot]] = None
    padding_grads: bool = False
    slack_forward_free: bool = False
    models: tuple[str, ...] = ()
    slack_keys: Optional[torch.Tensor] = None

    @classmethod
    def of_contract(cls, truth: Snapshot, noise: Snapshot) -> "Expectation":
        return cls(truth, noise)

    def copy(self) -> "Expectation":
        truth = _copy(self.truth)
        noise = truth if self.noise is self.truth else _copy(self.noise)
        contract = None
        if self.contract is not None:
            ct = _copy(self.contract[0])
            contract = (ct, ct if self.contract[1] is self.contract[0] else _copy(self.contract[1]))
        return Expectation(truth, noise, contract, self.padding_grads, self.slack_forward_free, self.models,
                           self.slack_keys)

    def main(self) -> list[Snapshot]:
        """The distinct main-run snapshots (one when ``noise`` is ``truth``)."""
        return [self.truth] if self.noise is self.truth else [self.truth, self.noise]

    def contract_runs(self) -> list[Snapshot]:
        if self.contract is None:
            return []
        t, n = self.contract
        return [t] if n is t else [t, n]

    def ensure_contract(self) -> tuple[Snapshot, Snapshot]:
        """The contract expectation, created empty (every gradient 0) when the contract's own."""
        if self.contract is None:
            t = Snapshot({})
            self.contract = (t, t if self.noise is self.truth else Snapshot({}))
        return self.contract


@dataclass
class ModelContext:
    """What a model may use: the case, its materialised tensors, and ``reference(tensors, with_loss) -> (truth,
    noise)`` (the reference's runs on other tensors, with the implementation's top-k). ``cache`` keeps a model's
    reference runs across the entry subsets :func:`parity.deviations.known.apply` tries. ``cp_layout``: how the implementation
    partitioned the pack over context-parallel ranks (``{"size", "local", "d_window"}``: rank ``r`` holds rows
    ``[r·local, (r+1)·local)`` of a buffer padded to ``size·local`` rows, its key buffer starting ``d_window`` rows
    before them; :meth:`parity.impls.Implementation.cp_layout`), None without CP."""

    case: Case
    tensors: CaseTensors
    reference: Callable[..., tuple[Snapshot, Snapshot]]
    cache: dict = field(default_factory=dict)
    cp_layout: Optional[dict] = None

    def once(self, key: str, make: Callable[[], object]):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


def _scale(snap: Snapshot, names, factor: float) -> None:
    for name in names:
        value = snap[name]
        if value is not None:
            snap.tensors[name] = value * factor


def _add(snap: Snapshot, extra: Snapshot) -> None:
    """Add ``extra``'s gradients to ``snap``'s (linearity of the backward in ``dO``)."""
    for name in extra.names:
        g = extra[name]
        if not name.startswith("grad/") or g is None:
            continue
        mine = snap[name]
        snap.tensors[name] = g.to(device=mine.device, dtype=mine.dtype) + mine if mine is not None else g.clone()


# ---- the models -----------------------------------------------------------------------------------------------------
def indexer_loss_over_physical_rows(exp: Expectation, ctx: ModelContext) -> None:
    """The mean indexer loss divided by every packed row (padding and slack included) instead of the real rows: the
    loss and every indexer-parameter gradient (main run, and the contract run's where a model put the loss gradient
    there) times ``real rows / packed rows`` (docs/findings/001)."""
    layout = ctx.case.layout
    factor = sum(layout.real_lengths) / layout.total_tokens
    for snap in exp.main() + exp.contract_runs():
        _scale(snap, [n for n in snap.names if n == "indexer_loss" or n.startswith(INDEXER_GRADS)], factor)


def padding_rows_as_real(tensors: CaseTensors) -> CaseTensors:
    """The same tensors with every padded segment row declared real (``cu_seqlens_q := cu_seqlens_q_padded``): the
    reference then computes the same forward (each padded segment runs as one sequence either way) but masks no
    padding row's ``dO``. Slack rows past the last boundary stay outside every segment."""
    psp = tensors.packed_seq_params
    if psp is None:
        return tensors
    return dataclasses.replace(tensors, packed_seq_params=dataclasses.replace(
        psp, cu_seqlens_q=psp.cu_seqlens_q_padded.clone(), cu_seqlens_q_padded=psp.cu_seqlens_q_padded.clone()))


def padding_dout_kept(exp: Expectation, ctx: ModelContext) -> None:
    """The output gradient of THD padding rows is not masked: the reference's run with those rows' ``dO`` kept.
    Gradients are linear in ``dO``, so that is the contract's gradients plus those of the reference run with the
    padding rows declared real (:func:`padding_rows_as_real`), ``dO`` on the padding rows only and no loss term —
    which is also exactly what the padding-row contract run must then return. Padding-row input gradients are
    expected (``padding_grads``)."""
    extra_truth, extra_noise = ctx.once("padding-dout-kept", lambda: ctx.reference(
        padding_rows_as_real(padding_dout_only(ctx.tensors)), with_loss=False))
    for snap in exp.main():
        _add(snap, extra_truth if snap is exp.truth else extra_noise)
    ct, cn = exp.ensure_contract()
    _add(ct, extra_truth)
    if cn is not ct:
        _add(cn, extra_noise)
    exp.padding_grads = True


def index_scores_unscaled(exp: Expectation, ctx: ModelContext) -> None:
    """Eval index scores without the ``dI^-0.5`` scale: the contract's scores times ``sqrt(dsa_indexer_head_dim)``
    (a positive factor: the same top-k, the same ``-inf`` pattern)."""
    factor = float(ctx.case.config.dsa_indexer_head_dim) ** 0.5
    for snap in exp.main():
        _scale(snap, ["index_scores"], factor)


def no_indexer_output(exp: Expectation, ctx: ModelContext) -> None:
    """No indexer runs at all: no top-k, no index scores, no loss, and so no indexer-parameter gradient (where the
    contract returns an all ``-1`` top-k, an empty score matrix and a zero loss)."""
    for snap in exp.main() + exp.contract_runs():
        for name in snap.names:
            if name in INDEXER_OUTPUTS or name.startswith(INDEXER_GRADS):
                snap.tensors[name] = None


def loss_gradient_in_every_backward(exp: Expectation, ctx: ModelContext) -> None:
    """The indexer KL loss's gradient is injected into every backward of the attention output, whatever the
    objective: the contract run (``dO`` on padding rows only, no loss term) returns, on the indexer's parameters,
    the loss gradient of the main run (those parameters get nothing else); its other gradients are unchanged."""
    ct, cn = exp.ensure_contract()
    for source, target in ((exp.truth, ct), (exp.noise, cn)):
        for name in source.names:
            if name.startswith(INDEXER_GRADS) and source[name] is not None:
                target.tensors[name] = source[name]


def indexer_loss_over_cp_buffer_rows(exp: Expectation, ctx: ModelContext) -> None:
    """Under context parallelism the mean indexer loss divided by every row of the CP buffer (``size × local``:
    padding, slack and the buffer's own padding to equal rank slices included) instead of the real rows: the loss
    and every indexer-parameter gradient times ``real rows / (size × local)`` (finding 001 in the CP branch)."""
    lay = ctx.cp_layout
    if not lay:
        raise ValueError("indexer-loss-over-cp-buffer-rows needs the implementation's CP layout (a --cp N run)")
    factor = sum(ctx.case.layout.real_lengths) / (int(lay["size"]) * int(lay["local"]))
    for snap in exp.main() + exp.contract_runs():
        _scale(snap, [n for n in snap.names if n == "indexer_loss" or n.startswith(INDEXER_GRADS)], factor)


def slack_row_key(row: int, lay: dict) -> int:
    """The global row of key 0 of the key buffer of the rank holding ``row`` (``rank·local - d_window``; negative:
    rank 0's boundary, zero rows before the pack)."""
    return (row // int(lay["local"])) * int(lay["local"]) - int(lay["d_window"])


def _slack_attention(q, key, sink, scale: float):
    """One slack row attending one key and the sink: ``q [H, D]``, ``key [D]``, ``sink [H]`` -> ``out [H, D]``
    (``V = K``), ``lse [H]`` (without the sink)."""
    logit = (q @ key) * scale
    weight = torch.sigmoid(logit - sink)  # exp(l) / (exp(l) + exp(sink))
    return weight.unsqueeze(-1) * key, logit


def cp_slack_rows_attend_rank_key_0(exp: Expectation, ctx: ModelContext) -> None:
    """Under context parallelism a slack row (past the last boundary) attends key 0 of its rank's key buffer (the
    global row :func:`slack_row_key`) and the sink, with length 1, where the contract gives it no key: its forward
    values are not the contract's (``slack_forward_free``), and the ``dO`` it carries (core scope: random) flows,
    exactly, into ``grad/query`` of the slack row, ``grad/kv`` of that key row and the sink's gradient —
    ``out = sigmoid(l - sink) · kv[g]``, ``l = softmax_scale · q·kv[g]`` in float64, differentiated at the case's
    ``dO`` (added to the main run's gradients and to the padding-row contract run's, which carries the same ``dO``).
    At layer scope the slack rows' ``dO`` is 0 and the gradients stay the contract's."""
    lay = ctx.cp_layout
    if not lay:
        raise ValueError("cp-slack-rows-attend-rank-key-0 needs the implementation's CP layout (a --cp N run)")
    exp.slack_forward_free = True
    kinds = ctx.tensors.row_kinds or []
    slack = [i for i, kind in enumerate(kinds) if kind == "slack"]
    if slack and ctx.case.scope == "core":
        exp.slack_keys = _slack_keys(ctx.tensors.inputs["kv"].detach(), slack, lay)
    d_out = ctx.tensors.grad_output
    if not slack or ctx.case.scope != "core" or not bool((d_out[slack] != 0).any()):
        return
    extra = ctx.once("cp-slack-rows", lambda: _slack_gradients(ctx, slack, lay))
    for snap in exp.main():
        _add(snap, extra)
    ct, cn = exp.ensure_contract()
    _add(ct, extra)
    if cn is not ct:
        _add(cn, extra)
    exp.padding_grads = True


def _slack_keys(kv: torch.Tensor, slack: list[int], lay: dict) -> torch.Tensor:
    """``[T, D]``: row ``t`` the ``kv`` row slack row ``t`` attends (:func:`slack_row_key`; zeros before the pack and
    on every other row)."""
    keys = torch.zeros_like(kv)
    for row in slack:
        g = slack_row_key(row, lay)
        if g >= 0:
            keys[row] = kv[g]
    return keys


def _slack_gradients(ctx: ModelContext, slack: list[int], lay: dict) -> Snapshot:
    """The gradients the slack rows' ``dO`` injects (:func:`cp_slack_rows_attend_rank_key_0`), float64."""
    inputs, params = ctx.tensors.inputs, ctx.tensors.params
    sink_name = "core_attention.attn_sink" if "core_attention.attn_sink" in params else "attn_sink"
    query = inputs["query"].detach().to(torch.float64).requires_grad_(True)
    kv = inputs["kv"].detach().to(torch.float64).requires_grad_(True)
    sink = params[sink_name].detach().to(torch.float64).requires_grad_(True)
    d_out = ctx.tensors.grad_output.detach().to(torch.float64)
    scale = float(ctx.case.config.softmax_scale)
    objective = query.new_zeros(())
    for row in slack:
        g = slack_row_key(row, lay)
        key = kv[g] if g >= 0 else kv.new_zeros(kv.shape[-1])
        out, _ = _slack_attention(query[row], key, sink, scale)
        objective = objective + (out * d_out[row]).sum()
    gq, gkv, gsink = torch.autograd.grad(objective, (query, kv, sink))
    return Snapshot({"grad/query": gq, "grad/kv": gkv, f"grad/{sink_name}": gsink})


@dataclass(frozen=True)
class Model:
    name: str
    apply: Callable[[Expectation, ModelContext], None]

    @property
    def doc(self) -> str:
        return " ".join((self.apply.__doc__ or "").split())


#: every model a registry entry can name (``expect.model``), in the order they are applied to one case
MODELS: dict[str, Model] = {m.name: m for m in (
    Model("no-indexer-output", no_indexer_output),
    Model("index-scores-unscaled", index_scores_unscaled),
    Model("padding-dout-kept", padding_dout_kept),
    Model("loss-gradient-in-every-backward", loss_gradient_in_every_backward),
    Model("indexer-loss-over-physical-rows", indexer_loss_over_physical_rows),
    Model("indexer-loss-over-cp-buffer-rows", indexer_loss_over_cp_buffer_rows),
    Model("cp-slack-rows-attend-rank-key-0", cp_slack_rows_attend_rank_key_0),
)}


def expectation(base: Expectation, names, ctx: ModelContext) -> Expectation:
    """``base`` (the contract's) with the models ``names`` applied, each once, in :data:`MODELS` order."""
    exp = base.copy()
    chosen = [n for n in MODELS if n in set(names)]
    for name in chosen:
        MODELS[name].apply(exp, ctx)
    exp.models = tuple(chosen)
    return exp


__all__ = ["Expectation", "MODELS", "Model", "ModelContext", "expectation", "padding_rows_as_real"]
