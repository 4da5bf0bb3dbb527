"""Providers of ``--impl megatron`` and the per-call context that runs production.

* ``unfused`` — production's PyTorch path (``dsa_kernel_backend="none"``), CPU and GPU;
* ``emulated`` — production's fused composition (``dsa_kernel_backend="cudnn"``: Paths A/B/C, THD capacity padding,
  compaction, local -> global) over this project's contract-exact torch kernels standing in for ``cudnn.DSA`` and
  ``flash_mla`` (:mod:`adapters.megatron.emulated`), on any device;
* ``cudnn`` — production's fused path over the real kernels (cudnn-frontend ``cudnn.DSA``, FlashMLA), CUDA sm90 /
  sm100, with the FlashMLA bridge as its one stand-in (:mod:`adapters.megatron.real_kernels`).

``auto`` is ``unfused``. The provider is chosen with :func:`use_backend` (the harness's hook); the object it yields has
``record`` (``{stage: provider}``: ``torch`` for both CPU providers, the policy's key for the torch kernels;
``cudnn+flashmla`` for the real kernels, the policy's ``cudnn`` key).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import logging
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from cases.vocabulary import Unsupported

from . import gather_backward, generations, promote, real_kernels, standins
from .build import Built, build
from .loader import Megatron, load

PROVIDERS = ("unfused", "emulated", "cudnn")
_PROVIDER: contextvars.ContextVar[str] = contextvars.ContextVar("megatron_provider", default="unfused")
_PREPARED: set[int] = set()


class MegatronUnavailable(Unsupported, RuntimeError):
    """A provider that cannot run here (the harness reports the case ``unsupported``)."""


def current() -> str:
    return _PROVIDER.get()


def megatron() -> Megatron:
    """The imported Megatron-LM (``DSV4_MEGATRON`` or the snapshot), with the process-wide stand-ins in place."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        mg = load(None)  # locate reads DSV4_MEGATRON itself, so its messages name where the path came from
    if id(mg) not in _PREPARED:
        logging.getLogger("megatron").setLevel(logging.ERROR)  # config notes (e.g. derived head dims) on stderr
        _prepare(mg)
        _PREPARED.add(id(mg))
    return mg


def _prepare(mg: Megatron) -> None:
    """Stand-ins that hold for the whole process: the Hadamard rotation without ``fast_hadamard_transform`` and the
    eager ``_q_rms_norm``."""
    dsa = mg.module("dsa")
    if getattr(dsa, "hadamard_transform", None) is None:
        mg.module("csa").rotate_activation = standins.make_rotate_activation(promote=False)
        mg.standins.append("hadamard (exact fp32 matmul; no fast_hadamard_transform)")
    hybrid = mg.module("deepseek_v4_hybrid_attention")
    compiled = hybrid._q_rms_norm
    eager = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(compiled, "__wrapped__", None)
    if eager is not None:
        hybrid._q_rms_norm = eager
        mg.standins.append("q-rms-norm-eager (@torch.compile _q_rms_norm run without dynamo)")


def available_providers() -> dict:
    """``{provider: None if usable here, else why not}``."""
    try:
        mg = megatron()
        base = None
    except ValueError as exc:
        mg, base = None, str(exc)
    return {"unfused": base, "emulated": base or emulated_reason(mg),
            "cudnn": base or real_kernels.unavailable_reason()}


def emulated_reason(mg: Megatron) -> Optional[str]:
    """Why the emulated provider cannot drive ``mg``'s fused path, or None: production calls a ``cudnn.DSA`` wrapper
    the stand-in has no contract-exact torch kernel for (``generations.wrapper_calls``)."""
    from . import kernel_calls  # noqa: PLC0415

    calls = generations.wrapper_calls(mg.fused())
    unknown = [name for name in calls if name not in kernel_calls.WRAPPERS]
    if unknown:
        return (f"production's fused path at {mg.source.revision} calls cudnn.DSA.{', cudnn.DSA.'.join(unknown)}, "
                f"which the emulated stand-in does not provide (adapters/megatron/kernel_calls.py: WRAPPERS)")
    return None


@dataclass
class Handle:
    """What :func:`use_backend` yields: ``record`` = ``{stage: provider}`` that ran."""

    provider: str
    record: dict = field(default_factory=dict)


@contextlib.contextmanager
def use_backend(provider: str = "auto", require=()) -> Iterator[Handle]:
    """Select the provider for the calls inside the block (``auto``: :func:`provider_name`)."""
    name = provider_name(provider)
    if name not in PROVIDERS:
        raise ValueError(f"megatron has no provider {provider!r} (known: {', '.join(PROVIDERS)})")
    why = real_kernels.unavailable_reason() if name == "cudnn" else None
    if why is not None:
        raise MegatronUnavailable(why)
    token = _PROVIDER.set(name)
    handle = Handle(name, {f"megatron.{name}": "cudnn+flashmla" if name == "cudnn" else "torch"})
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(promote.mode())
            stack.enter_context(promote.float64_case(False))  # the block's mark, set by run_context's case
            stack.enter_context(standins.no_stream_capture(not torch.cuda.is_available()))  # forward and backward
            # production's modules are imported (and its tree put on sys.path) before a provider patches them: a
            # fresh worker process enters this block before its first case builds the layer
            mg = megatron()
            if name == "emulated":  # forward and backward both call the kernel stand-ins
                from . import emulated  # noqa: PLC0415 — imports fused.kernels only for this provider

                stack.enter_context(emulated.installed(mg))
            elif name == "cudnn":
                stack.enter_context(real_kernels.installed())
            elif name == "unfused":  # the KV gather's backward scatter, atomic on CUDA (gather-backward-atomic)
                stack.enter_context(gather_backward.atomic_kv_scatter())
            yield handle
    finally:
        _PROVIDER.reset(token)


@contextlib.contextmanager
def run_context(provider: str, config, like: torch.Tensor, training: bool) -> Iterator[tuple[Megatron, Built]]:
    """Production's layer for ``config`` in ``like``'s dtype on its device, in train/eval mode, with the per-call
    stand-ins in place; yields ``(megatron, built)``."""
    mg = megatron()
    device = like.device.type
    backend = "cudnn" if provider in ("emulated", "cudnn") else "none"
    wide = like.dtype == torch.float64 and promote.enabled()
    promote.mark(wide)  # float32 islands promoted for this case's forward and backward (diagnostic)
    with contextlib.ExitStack() as stack:
        stack.enter_context(standins.cpu_device_calls(device == "cpu"))
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            built = build(mg, config, like.dtype, backend, device, promoted=wide)
        built.module.train(training)
        yield mg, built


def describe(provider: Optional[str] = None) -> dict:
    """For the run row: Megatron's revision (and ``upstream_revision``, the upstream commit it is: what the
    known-deviation registry's revision ranges name), where it came from, the provider and every stand-in it uses
    (the real kernels' versions with ``cudnn``; with ``emulated`` the ``architecture`` it declares to production)."""
    mg = megatron()
    name = provider_name(provider or current())
    used = list(mg.standins)
    if not mg.has_te:
        used.append("plain-linear (no TransformerEngine)")
    from . import cp  # noqa: PLC0415 — cp imports this module

    used.append("process-group (1-rank gloo)" if cp.size() == 1 else
                f"process-group ({cp.size()}-rank gloo CP group over a FileStore, 1-rank tp)")
    used.append("no-weight-init (perform_initialization=False: every parameter is the case's own, by name)")
    declared = {}
    if not torch.cuda.is_available():
        used.append("cpu-device (torch.cuda.current_device)")
        used.append("no-stream-capture (torch.cuda.is_current_stream_capturing -> False)")
    elif name == "unfused" and gather_backward.enabled():
        used.append(gather_backward.NOTE)
    if name == "emulated":
        from . import emulated  # noqa: PLC0415

        used += [f"emulated: {note}" for note in emulated.standins(mg)]
        major, minor = emulated.DEVICE_CAPABILITY  # the capability production's code reads (its branches follow it)
        declared = {"architecture": f"sm{major}{minor}"}
    if name == "cudnn":
        used += [f"cudnn: {note}" for note in real_kernels.STANDINS]
    parallel = {}
    if cp.size() > 1:  # production's THD CP branch over N rank processes, and its stand-ins
        parallel = {"cp": cp.describe(cp.size())}
        used += [f"cp: {note}" for note in parallel["cp"]["standins"]]
    return {"revision": mg.source.revision, "upstream_revision": _upstream(mg.source),
            "megatron_root": str(mg.source.root), "megatron_origin": mg.source.origin,
            "api_generation": mg.generation.name, "provider": name, "standins": used, "te": mg.has_te, **declared,
            **({"kernels": real_kernels.versions()} if name == "cudnn" else {}), **parallel}


@functools.lru_cache(maxsize=None)
def _upstream(src) -> Optional[str]:
    from .source import upstream_revision  # noqa: PLC0415

    return upstream_revision(src)


def provider_name(provider: str) -> str:
    """The provider a request selects: ``auto`` (and the generic ``torch`` / ``none``) select ``unfused``, which runs
    every case on any device; the real kernels are asked for by name (``make parity`` passes ``--provider cudnn`` on
    a GPU runner with the kernels installed)."""
    return "unfused" if provider in ("auto", "none", "torch") else provider


def gate_paths(provider: str = "auto") -> list:
    """Production's paths a gate runs, one run each (``dsv4-parity gate``, ``make parity``): its unfused PyTorch path
    (its default, ``dsa_kernel_backend="none"``) and its fused path — ``provider`` when that names a fused-path
    provider (``cudnn`` / ``emulated``), else ``cudnn`` where the real kernels run here, else ``emulated``."""
    if provider in ("cudnn", "emulated"):
        fused = provider
    else:
        fused = "cudnn" if real_kernels.unavailable_reason() is None else "emulated"
    return ["unfused", fused]
