"""The ``cudnn`` provider: production's fused path (``dsa_kernel_backend="cudnn"``) over the real kernels —
cudnn-frontend's ``cudnn.DSA`` wrappers and FlashMLA's sparse prefill forward — on a CUDA device (sm90 / sm100).

Production runs as it is, with one recorded stand-in, the **FlashMLA bridge**: Megatron ``dev`` calls
``flash_mla_sparse_fwd(..., indexer_topk=0)``, FlashMLA's ``nv_dev`` API. ``sgl-flash-mla 1.0.0`` (the build this
project's GPU runners carry) has no ``indexer_topk`` keyword, and its default sparse prefill is sm100-only: on sm90
the Hopper kernels are behind ``use_legacy=True``. The bridge drops ``indexer_topk`` when it is 0 (every DSv4 call
site passes 0: ``csa.py`` calls ``csa_sparse_attn`` without it) and adds ``use_legacy=True`` on sm90; any other
``indexer_topk`` is refused (:class:`BridgeRefused`), never emulated. Everything else — the wrappers, the head /
index padding, the Triton teacher LSE, config validation (which refuses the r = 4 dense loss on sm90) — is
production's own.

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
from fused.kernels.cudnn_provider import CudnnKernels, dsa_wrappers
from fused.kernels.device_support import first_reason
from fused.kernels.flashmla_provider import FlashMLAKernels

from . import kernel_calls

STANDINS = ("flash_mla bridge: nv_dev's indexer_topk=0 dropped (sgl-flash-mla 1.0.0 has no such keyword), "
            "use_legacy=True on sm90 (the default sparse prefill is sm100-only)",)


class BridgeRefused(Unsupported):
    """A FlashMLA call the bridge cannot make with sgl-flash-mla (``indexer_topk > 0``)."""


def unavailable_reason() -> Optional[str]:
    """None when the real kernels can run here, else why not: the same checks as ``--impl fused``'s ``cudnn`` and
    ``flashmla`` providers (a CUDA device of a kernel architecture, the packages import, FlashMLA's sm90 kernels)."""
    return first_reason(CudnnKernels.unavailable_reason(), FlashMLAKernels.unavailable_reason())


def flash_mla_bridge(forward: Callable, legacy: bool) -> Callable:
    """``forward`` (sgl-flash-mla's ``flash_mla_sparse_fwd``) with the ``nv_dev`` signature production calls."""

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, indexer_topk=0):
        if indexer_topk:
            raise BridgeRefused(f"flash_mla_sparse_fwd(indexer_topk={indexer_topk}): sgl-flash-mla 1.0.0 has no "
                                "indexer_topk (FlashMLA nv_dev API); the bridge passes only indexer_topk=0")
        extra = {"use_legacy": True} if legacy else {}
        return forward(q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink, topk_length=topk_length, **extra)

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
