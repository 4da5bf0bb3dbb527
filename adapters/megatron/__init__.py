"""``--impl megatron``: Megatron-LM ``dev``'s DSv4 hybrid attention (the production code) as an implementation under
test, with no edit of Megatron's files.

Public API (ARCHITECTURE.md): ``attention_layer``, ``core_attention`` (production's layer / core attention; every
output field is production's own tensor, read by recorders); ``indexer`` (production's lightning indexer: the module
alone on the ``unfused`` provider, the eval core forward stopped once the kernels have scored on the fused ones) and
``query_latent`` (the ``qr`` production's layer hands its core attention): what sign-split observes a case's indexer
heads through. ``compressor`` is not provided.

Harness hooks (``parity/impls.py``): ``use_backend(provider=..., require=...)`` and ``available_providers()`` —
providers ``unfused`` / ``emulated`` / ``cudnn`` (:mod:`adapters.megatron.providers`); ``observe_kernels(observer)``
— every kernel call of production's fused path inside ``observer(stage, provider)`` (as ``fused.observe_kernels``;
:mod:`adapters.megatron.kernel_calls`); ``precision(case)`` — the
dtype production computes a case in (float32 islands in float64 runs); ``raised_in_own_code(exc)`` — where an
exception arose inside production's own code (that revision's behaviour: a ``fail``, not an ``error``);
``describe()`` — Megatron's revision and the
stand-ins in use (the run row); ``known_deviations`` — the registry of production behaviour that differs from the
contract (``known_deviations.json``, :mod:`parity.deviations.known`; an entry holds at the CP sizes its ``cp`` lists, default
``[1]``); ``use_context_parallel(n)`` — the calls inside run production's THD context-parallel branch with ``n``
rank processes (``--cp N``, :mod:`adapters.megatron.cp`), ``context_parallel_size()`` the current ``n``;
``TOPK_TIE_RULE = "arbitrary"`` (``torch.topk`` among exact ties).

Where Megatron comes from: ``DSV4_MEGATRON`` (set by ``--megatron PATH``) or the pinned snapshot
(:mod:`adapters.megatron.source`).
"""

from .cp import layout as context_parallel_layout
from .cp import size as context_parallel_size
from .cp import use_context_parallel
from .layer import attention_layer, core_attention, indexer, query_latent
from .kernel_calls import observe_kernels
from .providers import available_providers, describe, gate_paths, provider_name, use_backend
from .source import MegatronSourceError

#: declared top-k tie behaviour: production uses torch.topk (dsa.py), arbitrary among exact ties
TOPK_TIE_RULE = "arbitrary"


def check_ready() -> None:
    """Locate and import Megatron-LM now: a missing path, a checkout without DSv4 code or a revision whose API
    differs raises :class:`MegatronSourceError` (one line, naming where it looked)."""
    from .providers import megatron

    megatron()


def raised_in_own_code(exc: BaseException):
    """``file:line`` (under ``megatron/``) where ``exc`` was raised inside production's own code, else None: the
    innermost frame outside torch and site-packages lies in the imported Megatron-LM tree. Such an exception is that
    revision's behaviour on the case (the engine reports a ``fail``, rule ``raised``); one raised in the adapter, its
    stand-ins or the harness stays an ``error``."""
    import os
    import traceback

    from .loader import loaded

    mg = loaded()
    if mg is None:
        return None
    root = str(mg.source.root) + os.sep
    remote = getattr(exc, "remote_raised", None)  # a context-parallel rank's exception (adapters.megatron.cp)
    if isinstance(remote, dict) and remote.get("file"):
        name, line = str(remote["file"]), remote.get("line")
    else:
        frame = next((f for f in reversed(traceback.extract_tb(exc.__traceback__))
                      if "/site-packages/" not in f.filename and "/torch/" not in f.filename), None)
        if frame is None:
            return None
        name, line = frame.filename, frame.lineno
    return f"{os.path.relpath(name, root)}:{line}" if os.path.abspath(name).startswith(root) else None


def precision(case) -> str:
    """The precision production computes ``case`` in: float64 cases keep float32 islands (RoPE tables, YaRN ramp,
    ``.float()`` attention / indexer / loss math, fp32 sink and ``ape``), so they are judged at float32 level."""
    from .promote import enabled

    if enabled():  # DSV4_MEGATRON_PROMOTE=1: the islands promoted, judged at float64 level (diagnostic)
        return case.dtype
    return "float32" if case.dtype == "float64" else case.dtype


__all__ = ["MegatronSourceError", "TOPK_TIE_RULE", "attention_layer", "available_providers", "check_ready",
           "context_parallel_layout", "context_parallel_size", "core_attention", "describe", "gate_paths", "indexer",
           "known_deviations", "observe_kernels",
           "precision", "provider_name", "query_latent", "raised_in_own_code", "use_backend", "use_context_parallel"]


def known_deviations() -> list:
    """The committed registry (``known_deviations.json``) of production behaviour that differs from the contract:
    the entries that hold at the current CP size (an entry's ``cp``, default ``[1]``: production's 1-rank path)."""
    import json
    from pathlib import Path

    from .cp import size

    entries = json.loads(Path(__file__).with_name("known_deviations.json").read_text(encoding="utf-8"))["entries"]
    return [e for e in entries if size() in e.get("cp", [1])]
