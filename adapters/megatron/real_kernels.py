"""The ``cudnn`` provider: production's fused path (``dsa_kernel_backend="cudnn"``) over the real kernels —
cudnn-frontend's ``cudnn.DSA`` wrappers and FlashMLA's sparse prefill forward — on a CUDA device (sm90 / sm100).

Production runs as it is, with one recorded stand-in, the **FlashMLA bridge**: Megatron ``dev`` calls
``flash_mla_sparse_fwd(..., indexer_topk=K)``, FlashMLA's ``nv_dev`` API (branch head b7643bd). ``sgl-flash-mla 1.0.0``
(the build this project's GPU runners carry) has no ``indexer_topk`` keyword, and its default sparse prefill is
sm100-only: on sm90 the Hopper kernels are behind ``use_legacy=True``. No PyPI build has the ``nv_dev`` API for sm90
(README: *The FlashMLA bridge*). The bridge

* adds ``use_legacy=True`` on sm90 and calls sgl-flash-mla for ``out`` / ``max_logits`` / ``lse`` (the real kernel);
* ``indexer_topk = 0`` (every call site from 608545cfc6 on): drops the keyword;
* ``indexer_topk = K > 0`` (revisions before 608545cfc6: Path B's teacher denominator): first ``nv_dev``'s own
  argument checks (:func:`fused.kernels.contracts.check_indexer_topk`; a call nv_dev refuses is
  :class:`KernelRefused`, ``unsupported`` with nv_dev's message: a refusal production itself makes), then
  ``lse_indexer`` computed beside the real kernel by this project's torch kernel math (:func:`lse_indexer`) — a
  **partial stand-in**, listed in the run row.

Everything else — the wrappers, the head / index padding, the Triton teacher LSE, config validation (which refuses the
r = 4 dense loss on sm90) — is production's own.

The compiled CuTe-DSL kernels behind the DSA wrappers persist across processes in this project's kernel cache
(``fused.kernels.compile_cache``: same keys as the wrappers' in-process dicts, keyed by library versions), exactly
as for ``--impl fused --provider cudnn``.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator, Optional

import torch

from cases.vocabulary import Unsupported
from fused.kernels.contracts import check_indexer_topk
from fused.kernels.cudnn_provider import CudnnKernels, dsa_wrappers
from fused.kernels.device_support import first_reason
from fused.kernels.flashmla_provider import FlashMLAKernels
from fused.kernels.torch_provider import TorchKernels

from . import kernel_calls

STANDINS = ("flash_mla bridge: nv_dev's indexer_topk=0 dropped (sgl-flash-mla 1.0.0 has no such keyword), "
            "use_legacy=True on sm90 (the default sparse prefill is sm100-only)",
            "flash_mla bridge, partial stand-in: with indexer_topk=K > 0, nv_dev's lse_indexer (natural-log LSE over "
            "the first K index slots, no sink, +inf on a row without a valid slot) is computed beside sgl-flash-mla's "
            "out / lse by the torch kernel provider (fused.kernels.torch_provider); nv_dev's own indexer_topk checks "
            "(b7643bd) refuse what it refuses")

_INF = float("inf")


class BridgeRefused(Unsupported):
    """A FlashMLA call the bridge cannot model with sgl-flash-mla (``indexer_topk > 0`` together with
    ``topk_length``: nv_dev snapshots a per-row partial sum there; production asserts it never passes both)."""


class KernelRefused(Unsupported):
    """A call FlashMLA ``nv_dev`` itself refuses (its ``TORCH_CHECK`` on ``indexer_topk``): production cannot run the
    case on its kernels. Reported ``unsupported`` with nv_dev's message."""


def unavailable_reason() -> Optional[str]:
    """None when the real kernels can run here, else why not: the same checks as ``--impl fused``'s ``cudnn`` and
    ``flashmla`` providers (a CUDA device of a kernel architecture, the packages import, FlashMLA's sm90 kernels)."""
    return first_reason(CudnnKernels.unavailable_reason(), FlashMLAKernels.unavailable_reason())


def lse_indexer(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                indexer_topk: int) -> torch.Tensor:
    """FlashMLA ``nv_dev``'s ``lse_indexer`` (b7643bd, ``sm90/prefill/sparse/phase1.cuh``): fp32 ``[s_q, h_q]``, the
    natural-log LSE of ``sm_scale * q . k`` over the first ``indexer_topk`` slots of ``indices`` ``[s_q, 1, topk]``
    (slots ``-1`` or ``>= s_kv`` excluded), **without** the sink (the sink scales only ``out``), ``+inf`` on a row with
    no valid slot. The kernel snapshots its running (max, sum) after block ``indexer_topk / 64``; an index buffer
    narrower than ``indexer_topk`` is never snapshotted (every row ``+inf``; production then returns ``lse`` itself).

    Computed by the torch kernel provider's ``sparse_attn_fwd`` (the contract the ``emulated`` provider runs) on the
    sliced indices; its ``lse`` does not depend on ``d_v`` (1 here: no value product)."""
    if indexer_topk > indices.shape[-1]:
        return torch.full(tuple(q.shape[:2]), _INF, dtype=torch.float32, device=q.device)
    _, _, lse = TorchKernels().sparse_attn_fwd(q, kv, indices[..., :indexer_topk].contiguous(), sm_scale, d_v=1)
    return lse.to(torch.float32)


def flash_mla_bridge(forward: Callable, legacy: bool, partial_lse: Callable = lse_indexer) -> Callable:
    """``forward`` (sgl-flash-mla's ``flash_mla_sparse_fwd``) with the ``nv_dev`` signature production calls;
    ``partial_lse`` computes ``lse_indexer`` for ``indexer_topk > 0`` (:func:`lse_indexer`)."""

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, indexer_topk=0):
        indexer_topk = int(indexer_topk)
        if indexer_topk:
            try:  # nv_dev checks its arguments before any kernel runs
                check_indexer_topk(int(q.shape[1]), int(q.shape[2]), indexer_topk)
            except RuntimeError as exc:
                raise KernelRefused(f"flash_mla_sparse_fwd(indexer_topk={indexer_topk}, h_q={q.shape[1]}): "
                                    f"FlashMLA nv_dev refuses it: {exc}") from None
            if topk_length is not None:
                raise BridgeRefused(f"flash_mla_sparse_fwd(indexer_topk={indexer_topk}) with topk_length: nv_dev's "
                                    "per-row partial snapshot is not modelled by the bridge")
        extra = {"use_legacy": True} if legacy else {}
        result = forward(q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink, topk_length=topk_length, **extra)
        if not indexer_topk:
            return result
        out, max_logits, lse = result
        return out, max_logits, lse, partial_lse(q, kv, indices, sm_scale, indexer_topk)

    return flash_mla_sparse_fwd


def versions() -> dict[str, Any]:
    """Kernel package versions (the run row's environment), as the kernel providers report them."""
    return {**CudnnKernels.versions(), **FlashMLAKernels.versions()}


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Production's fused module calls the real ``cudnn.DSA`` and the bridged FlashMLA forward inside the block."""
    dsa = dsa_wrappers()  # the wrappers' compile caches made persistent, as for the fused path
    flash = importlib.import_module("flash_mla").flash_mla_sparse_fwd
    legacy = torch.cuda.get_device_capability()[0] == 9
    with kernel_calls.installed(dsa, "cudnn", flash_mla_bridge(flash, legacy), "flashmla"):
        yield
