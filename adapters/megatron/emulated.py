"""The ``emulated`` provider: production's fused composition (``dsa_kernel_backend="cudnn"``) over this project's
contract-exact torch kernels (``fused.kernels.torch_provider``) standing in for ``cudnn.DSA`` and ``flash_mla``.

Megatron's own fused code (Paths A/B/C, THD capacity padding, compaction, local -> global, the fused indexer loss)
then runs on a CPU. Shims, all inside :func:`installed` and restored after (none edits Megatron's files):

* ``cudnn`` / ``flash_mla`` modules in ``sys.modules`` when the real packages are not importable: ``cudnn.DSA.<stage>
  _wrapper`` and ``flash_mla.flash_mla_sparse_fwd`` call the torch kernel provider (same argument names). FlashMLA's
  ``d_v`` defaults to 512 and Megatron never passes it: the stand-in reads at most the key width;
  ``indexer_topk > 0`` returns the LSE over the first ``indexer_topk`` slots as a fourth value, as ``nv_dev`` does;
* the backend validation's CUDA test (``transformer_config._validate_dsa_kernel_backend_dependencies``) checks only
  that the two packages import;
* ``torch.cuda.get_device_capability`` reads ``(10, 0)`` on a CPU (sm100: the r = 4 dense loss is allowed and the
  top-k alignment is 64; the H200's ``(9, 0)`` refuses the dense loss in config validation);
* ``torch.cuda.nvtx.range`` is a no-op on a CPU.

Not exercised on a CPU (branches on ``tensor.is_cuda``): the compaction fallback (``fused_sparse_attention.py:629``),
head padding (``dsa_cudnn_kernels.py:397, 1598, 2055``); the fused compressor (``cudnn.csa``) is sm100-only and
production keeps the eager compressor; the Triton teacher LSE falls back to torch for CPU tensors
(``csa_teacher_lse.py:307``).

The LSE and the fused top-k / scores are recorded from production's own functions (``recorders.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
from typing import Iterator

import torch

from fused.kernels.torch_provider import TorchKernels

from . import kernel_calls
from .loader import Megatron
from .recorders import patched

DEVICE_CAPABILITY = (10, 0)


class Kernels:
    """The kernel provider the stand-ins call (a mutant may swap it for one with a planted wrapper behaviour)."""

    provider = TorchKernels()


def _wrapper(method: str):
    target = getattr(TorchKernels, method)

    @functools.wraps(target)
    def call(*args, **kwargs):
        return getattr(Kernels.provider, method)(*args, **kwargs)

    call.__name__ = method + "_wrapper"
    return call


def dsa_namespace() -> types.SimpleNamespace:
    """``cudnn.DSA``'s stand-in: one ``<stage>_wrapper`` per production call site, delegating to the provider."""
    return types.SimpleNamespace(**{name: _wrapper(method) for name, method in kernel_calls.WRAPPERS.items()})


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, indexer_topk=0):
    """FlashMLA ``nv_dev`` ``flash_mla_sparse_fwd`` over the torch provider: ``(out, max_logits, lse)`` plus
    ``lse_indexer`` (over the first ``indexer_topk`` slots, no sink) when ``indexer_topk > 0``."""
    width = min(int(d_v), kv.shape[-1])
    out, max_logits, lse = Kernels.provider.sparse_attn_fwd(q, kv, indices, sm_scale, d_v=width,
                                                             attn_sink=attn_sink, topk_length=topk_length)
    if indexer_topk <= 0:
        return out, max_logits, lse
    _, _, lse_indexer = Kernels.provider.sparse_attn_fwd(q, kv, indices[..., :indexer_topk].contiguous(), sm_scale,
                                                         d_v=width)
    return out, max_logits, lse, lse_indexer


def _stub_modules(dsa: types.SimpleNamespace) -> dict:
    """``{module name: stand-in}`` for the kernel packages that are not importable here (``dsa``: the stand-in
    ``cudnn.DSA``)."""
    out = {}
    if importlib.util.find_spec("cudnn") is None or not torch.cuda.is_available():
        cudnn = types.ModuleType("cudnn")
        cudnn.DSA = dsa
        cudnn.__doc__ = "dsv4-parity stand-in: cudnn.DSA over the torch kernel provider"
        out["cudnn"] = cudnn
    if importlib.util.find_spec("flash_mla") is None or not torch.cuda.is_available():
        flash_mla = types.ModuleType("flash_mla")
        flash_mla.flash_mla_sparse_fwd = flash_mla_sparse_fwd
        flash_mla.__doc__ = "dsv4-parity stand-in: flash_mla_sparse_fwd over the torch kernel provider"
        out["flash_mla"] = flash_mla
    return out


@contextlib.contextmanager
def _modules(stubs: dict) -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _validation_without_cuda(mg: Megatron):
    utils = sys.modules["megatron.core.utils"]

    def _validate_dsa_kernel_backend_dependencies(dsa_kernel_backend: str) -> None:
        missing = utils._missing_cudnn_dsa_kernel_dependencies() if dsa_kernel_backend == "cudnn" else []
        if missing:
            raise ValueError(f"dsa_kernel_backend={dsa_kernel_backend}: missing {', '.join(missing)}")

    return _validate_dsa_kernel_backend_dependencies


def _post_init_on_declared_device(config_cls):
    """``config_cls.__post_init__`` with ``torch.cuda.is_available()`` read True (the ``inline`` validation of the
    oldest API generation asserts a CUDA device, then the SM100 capability declared on a CPU, then that the kernel
    packages import): only while the config validates itself, never during a forward or backward."""
    original = config_cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        with patched(torch.cuda, "is_available", lambda: True):
            return original(self, *args, **kwargs)

    return __post_init__


def validation_shim(mg: Megatron, cpu: bool) -> contextlib.AbstractContextManager:
    """The fused-path config check of ``mg``'s API generation, run without a CUDA device: ``function`` — production's
    ``_validate_dsa_kernel_backend_dependencies`` checks only that the two packages import; ``inline`` — the config's
    ``__post_init__`` sees a CUDA device on a CPU (:func:`_post_init_on_declared_device`)."""
    tc = mg.modules["megatron.core.transformer.transformer_config"]
    if mg.generation.validation == "function":
        return patched(tc, "_validate_dsa_kernel_backend_dependencies", _validation_without_cuda(mg))
    if not cpu:
        return contextlib.nullcontext()
    cls = tc.MLATransformerConfig
    return patched(cls, "__post_init__", _post_init_on_declared_device(cls))


STANDINS = ("cudnn.DSA -> torch kernel provider", "flash_mla_sparse_fwd -> torch kernel provider (d_v <= key width)",
            "device capability (10, 0) on CPU", "nvtx no-op on CPU", "backend validation without CUDA")
#: the validation shim's note per API generation (``generations.Generation.validation``)
VALIDATION_NOTES = {"function": "backend validation without CUDA",
                    "inline": "config validation sees a CUDA device (torch.cuda.is_available during __post_init__)"}


def standins(mg: Megatron) -> tuple[str, ...]:
    """The stand-ins of this provider for ``mg``'s API generation (the run row)."""
    return STANDINS[:-1] + (VALIDATION_NOTES[mg.generation.validation],)


@contextlib.contextmanager
def installed(mg: Megatron) -> Iterator[None]:
    """Install the stand-ins and shims for the block (a forward and its backward)."""
    cpu = not torch.cuda.is_available()
    dsa = dsa_namespace()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_modules(_stub_modules(dsa)))
        stack.enter_context(validation_shim(mg, cpu))
        if cpu:
            stack.enter_context(patched(torch.cuda, "get_device_capability", lambda *a, **k: DEVICE_CAPABILITY))
            stack.enter_context(patched(torch.cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext()))
        # production's fused module calls the stand-ins, also where the real packages are importable (a GPU host)
        stack.enter_context(kernel_calls.installed(dsa, "torch", flash_mla_sparse_fwd, "torch"))
        yield
