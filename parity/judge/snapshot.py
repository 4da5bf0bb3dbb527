"""Run one implementation on one case's tensors and keep every compared tensor: a :class:`Snapshot`.

Tensor names (the ``tensor`` field of the results rows), in report order::

    out, lse, index_scores, topk_indices, indexer_loss,
    grad/<input>   for each input (layer: hidden; core: query, kv, hidden, q_latent),
    grad/<param>   for each parameter by its production name (cases.tensors.parameter_shapes order).

The engine adds the public API's outputs (:mod:`parity.judge.api_check`): ``api/compressor``, ``api/indexer.compressor``,
``api/indexer.index_scores``, ``api/indexer.topk_indices`` (the last two judged like their layer counterparts,
:func:`role`).

A value is ``None`` when the implementation returned none (no indexer, no loss, an unused gradient). The gradients
are those of ``AttentionOutput.objective(dO) = sum(out · dO) + indexer_loss``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch

from cases.case import Case
from cases.outputs import AttentionOutput
from cases.tensors import CaseTensors

from parity.judge import metrics

FORWARD_NAMES = ("out", "lse", "index_scores", "topk_indices", "indexer_loss")
INPUT_ORDER = ("query", "kv", "hidden", "q_latent")


API_INDEXER = "api/indexer."
#: Public-API compressor outputs: activations, judged with the ``out`` tolerances.
API_COMPRESSORS = ("api/compressor", "api/indexer.compressor")


def role(name: str) -> str:
    """The layer tensor a public-API tensor stands for (``api/indexer.topk_indices`` -> ``topk_indices``)."""
    return name[len(API_INDEXER):] if name.startswith(API_INDEXER) else name


def scores_of(topk_name: str) -> str:
    """The scores tensor a selection is judged against (``topk_indices`` -> ``index_scores``, same prefix)."""
    return topk_name[:-len("topk_indices")] + "index_scores"


def tensor_class(name: str) -> str:
    """The policy class of a tensor name: ``out lse index_scores topk loss grad_input grad_param grad_indexer``.

    ``grad_indexer`` holds the gradients of the indexer's own parameters (``core_attention.indexer.*``): they come only
    from the KL loss through ``ReLU(qI·kI)``, whose derivative jumps where bf16 rounding flips the sign of a product
    near 0; the engine removes those flips by sign-split (:mod:`parity.judge.sign_split`), and the class records its own
    measured worst cases in ``parity/policy.json``.
    Public-API tensors take the class of the tensor they stand for (:func:`role`; compressor outputs ``out``).
    """
    if name in API_COMPRESSORS:
        return "out"
    name = role(name)
    if name == "topk_indices":
        return "topk"
    if name == "indexer_loss":
        return "loss"
    if name.startswith("grad/"):
        if name[5:] in INPUT_ORDER:
            return "grad_input"
        return "grad_indexer" if name.startswith("grad/core_attention.indexer.") else "grad_param"
    return name


def is_row_tensor(name: str) -> bool:
    """Tensors whose leading dims are the token rows (``[B, S]`` or ``[T]``)."""
    name = role(name)
    return name in ("out", "lse", "index_scores", "topk_indices") or (
        name.startswith("grad/") and name[5:] in INPUT_ORDER)


@dataclass
class Snapshot:
    """The compared tensors of one run (detached, on the run's device) and what was observed about it."""

    tensors: dict[str, Optional[torch.Tensor]]
    mutated: list[str] = field(default_factory=list)  # inputs / metadata the implementation wrote to
    record: Optional[dict] = None  # {stage: provider} that ran, when the context reports it
    not_provided: dict = field(default_factory=dict)  # {tensor: why the implementation has no such tensor}

    def __getitem__(self, name: str) -> Optional[torch.Tensor]:
        return self.tensors.get(name)

    @property
    def names(self) -> list[str]:
        return list(self.tensors)


def _leaf(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    y = x.detach().clone() if dtype is None else x.detach().to(dtype).clone()
    return y.requires_grad_(True)


def _call(module, case: Case, inputs: dict, params: dict, psp, topk_indices) -> AttentionOutput:
    kwargs = {"training": case.training, "topk_indices": topk_indices}
    if case.scope == "layer":
        return module.attention_layer(inputs["hidden"], params, case.config, psp, **kwargs)
    return module.core_attention(inputs["query"], inputs["kv"], inputs["hidden"], inputs["q_latent"], params,
                                 case.config, psp, **kwargs)


def take_snapshot(module, case: Case, tensors: CaseTensors, *, upcast: bool = False,
                  topk_indices: Optional[torch.Tensor] = None,
                  context: Callable[[], ContextManager] = contextlib.nullcontext, with_loss: bool = True,
                  cast: Optional[torch.dtype] = None) -> Snapshot:
    """Run ``module.attention_layer`` / ``core_attention`` forward and backward on fresh leaves.

    ``upcast``: run on the float64 upcast of the case tensors (the truth run: the case-dtype values, exactly);
    else on copies in the case dtype (``attn_sink`` / ``ape`` stay fp32 in bf16 as materialised).
    ``topk_indices``: split mode (the reference with the implementation's selection).
    ``with_loss=False``: the gradients of ``sum(out · dO)`` alone (the indexer loss left out of the objective).
    ``cast``: run on the case tensors rounded to this dtype (the precision floor of an implementation that computes
    below the case dtype, :func:`parity.impls.Implementation.precision`); the results are upcast back to the case
    dtype (exactly), so their metadata matches the case's.
    """
    dtype = torch.float64 if upcast else cast
    inputs = {n: _leaf(t, dtype) for n, t in tensors.inputs.items()}
    params = {n: _leaf(t, dtype) for n, t in tensors.params.items()}
    d_out = tensors.grad_output.to(dtype) if dtype is not None else tensors.grad_output.clone()
    psp = tensors.packed_seq_params
    if psp is not None:  # a private copy: an implementation that writes to it must not corrupt the next run
        psp = dataclasses.replace(psp, cu_seqlens_q=psp.cu_seqlens_q.clone(),
                                  cu_seqlens_q_padded=psp.cu_seqlens_q_padded.clone())
    originals = {f"input {n}": t.detach().clone() for n, t in inputs.items()}
    originals.update({f"param {n}": t.detach().clone() for n, t in params.items()})
    if psp is not None:
        originals["cu_seqlens_q"] = psp.cu_seqlens_q.clone()
        originals["cu_seqlens_q_padded"] = psp.cu_seqlens_q_padded.clone()
    leaves = [inputs[n] for n in INPUT_ORDER if n in inputs] + list(params.values())
    names = [f"grad/{n}" for n in INPUT_ORDER if n in inputs] + [f"grad/{n}" for n in params]

    with context() as handle:
        result = _call(module, case, inputs, params, psp, topk_indices)
        objective = (result if with_loss else dataclasses.replace(result, indexer_loss=None)).objective(d_out)
        grads = torch.autograd.grad(objective, leaves, allow_unused=True) if objective.requires_grad else \
            [None] * len(leaves)
    record = getattr(handle, "record", None)

    current = {f"input {n}": t for n, t in inputs.items()}
    current.update({f"param {n}": t for n, t in params.items()})
    if psp is not None:
        current["cu_seqlens_q"] = psp.cu_seqlens_q
        current["cu_seqlens_q_padded"] = psp.cu_seqlens_q_padded
    mutated = changed(originals, current)

    out: dict[str, Optional[torch.Tensor]] = {}
    for name in FORWARD_NAMES:
        value = getattr(result, name)
        out[name] = None if value is None else value.detach()
    for name, g in zip(names, grads):
        out[name] = None if g is None else g.detach()
    if cast is not None and not upcast:
        back = case.torch_dtype
        out = {k: v.to(back) if v is not None and v.is_floating_point() and v.dtype == cast else v
               for k, v in out.items()}
    not_provided = dict(getattr(result, "not_provided", None) or {})
    return Snapshot(out, mutated, dict(record) if record is not None else None, not_provided)


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """The names (in ``before``'s order) whose tensor in ``after`` is not ``torch.equal`` to its copy in ``before``:
    other metadata, or some element differs (NaN included, as ``torch.equal``). The element checks are read back in
    one transfer per device instead of one device sync per tensor."""
    flags: dict[str, object] = {}
    for name, old in before.items():
        new = after[name].detach()
        if (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
            flags[name] = True
        else:
            flags[name] = (new != old).any()
    flags.update(read_flags({n: f for n, f in flags.items() if isinstance(f, torch.Tensor)}))
    return [name for name in before if flags[name]]


def read_flags(flags: dict[str, torch.Tensor]) -> dict[str, bool]:
    """``{name: bool}`` of 0-dim bool tensors, read back in one transfer per device (a ``bool()`` each would wait
    for the device once per flag)."""
    return {name: bool(value) for name, value in metrics.fetch(flags).items()}


def on_host(tensors: dict[str, Optional[torch.Tensor]]) -> dict[str, Optional[torch.Tensor]]:
    """Detached host copies of ``tensors`` (``None`` stays ``None``, a CPU tensor is returned as is): the
    device-to-host copies are queued together and waited for once (``.cpu()`` per tensor waits for the device each
    time)."""
    out = {k: None if v is None else v.detach().to("cpu", non_blocking=True) for k, v in tensors.items()}
    if any(v is not None and v.is_cuda for v in tensors.values()):
        torch.cuda.synchronize()
    return out


def real_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The real-token rows of a row tensor as ``[R_real, ...]`` (``mask``: bool ``[B, S]`` or ``[T]``)."""
    flat = x.reshape((mask.numel(),) + tuple(x.shape[mask.dim():]))
    return flat[mask.reshape(-1).to(flat.device)]


class RealRows:
    """:func:`real_rows` by a gather on the tensors' device: the mask's row ids go to each device once per case
    (boolean indexing would copy the mask and count its true entries, a device sync, for every tensor).
    ``mask``: the host's bool ``[B, S]`` / ``[T]``."""

    def __init__(self, mask: torch.Tensor):
        self.mask, self.ids, self._on = mask, mask.reshape(-1).nonzero().squeeze(1), {}

    def of(self, x: torch.Tensor) -> torch.Tensor:
        ids = self._on.get(x.device)
        if ids is None:
            ids = self._on[x.device] = self.ids.to(x.device)
        return x.reshape((self.mask.numel(),) + tuple(x.shape[self.mask.dim():])).index_select(0, ids)


def other_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The non-real rows (padding and slack) of a row tensor as ``[R_pad, ...]``."""
    return real_rows(x, ~mask)
