"""Backend plan: which kernel provider runs each stage of the fused path, and a record of what actually ran.

Usage::

    with fused.use_backend(provider="auto", require=("cudnn",)) as plan:
        out = fused.core_attention(...)
    plan.record          # {"indexer_forward": "cudnn", "sparse_attn_fwd": "flashmla", ...}

``provider`` is ``"auto"``, a selection name (:data:`SELECTIONS`), a provider name, or a mapping
``{stage: provider}`` (stages left out are ``"auto"``).

* ``"cudnn"`` (a selection): the production kernels — ``"auto"`` with the cuDNN DSA (``cudnn``) and FlashMLA
  (``flashmla``) providers both **required** (below). Stages neither implements (the teacher LSE) run on ``torch``.

* ``"auto"``: for each call, the first provider in :data:`PROVIDERS` order that is available, implements the stage
  and whose ``check_support`` accepts the arguments; ``torch`` (last) accepts everything.
* a name: that provider runs every stage it implements; if it declines a call (kernel shape support) the call
  raises :class:`StageUnsupported` — a requested backend never degrades silently. Stages it has no kernel for run
  as under ``"auto"`` (and the record says so).
* ``require``: each named provider must be available when the block is entered (else :class:`BackendUnavailable`)
  and must run every stage it implements (a decline raises :class:`StageUnsupported`).

Providers are registered by dotted path (``"module:Class"``) so that GPU providers are imported only when asked for;
:func:`register_provider` adds one without touching the composition.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Union

from cases.vocabulary import Unsupported

from .kernels import contracts
from .kernels.base import STAGES, KernelSet, bind_arguments

#: Provider registry, in "auto" priority order: name -> "module:Class" (or a KernelSet subclass).
PROVIDERS: dict[str, Union[str, type]] = {
    "flashmla": "fused.kernels.flashmla_provider:FlashMLAKernels",
    "cudnn": "fused.kernels.cudnn_provider:CudnnKernels",
    "torch": "fused.kernels.torch_provider:TorchKernels",
}

#: Selection names that stand for a set of required providers (what ``--provider cudnn`` means to the engine).
SELECTIONS: dict[str, tuple[str, ...]] = {"cudnn": ("cudnn", "flashmla")}

_INSTANCES: dict[str, KernelSet] = {}
_UNAVAILABLE: dict[str, str] = {}


class BackendError(RuntimeError):
    """Base class of plan errors."""


class BackendUnavailable(BackendError, Unsupported):
    """A requested provider cannot be loaded or cannot run on this machine."""


class StageUnsupported(BackendError, Unsupported):
    """A requested provider declined a call (kernel shape support). ``stage``, ``provider``, ``reason``."""

    def __init__(self, stage: str, provider: str, reason: str):
        self.stage, self.provider, self.reason = stage, provider, reason
        super().__init__(f"{provider} does not support this {stage} call: {reason}")


def register_provider(name: str, target: Union[str, type], *, before: Optional[str] = "torch") -> None:
    """Add (or replace) provider ``name``; in "auto" order it goes just before ``before`` (``None``: last)."""
    global PROVIDERS
    items = [(k, v) for k, v in PROVIDERS.items() if k != name]
    at = next((i for i, (k, _) in enumerate(items) if k == before), len(items))
    items.insert(at, (name, target))
    PROVIDERS = dict(items)
    _INSTANCES.pop(name, None)
    _UNAVAILABLE.pop(name, None)


def load_provider(name: str) -> tuple[Optional[KernelSet], Optional[str]]:
    """``(instance, None)`` or ``(None, reason it is unavailable)``."""
    if name in _INSTANCES:
        return _INSTANCES[name], None
    if name in _UNAVAILABLE:
        return None, _UNAVAILABLE[name]
    if name not in PROVIDERS:
        return None, f"unknown provider {name!r} (registered: {', '.join(PROVIDERS)})"
    target = PROVIDERS[name]
    try:
        if isinstance(target, str):
            module, _, cls_name = target.partition(":")
            target = getattr(importlib.import_module(module), cls_name)
        reason = target.unavailable_reason()
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        reason = f"cannot import {PROVIDERS[name]}: {type(exc).__name__}: {exc}"
    if reason is not None:
        _UNAVAILABLE[name] = reason
        return None, reason
    _INSTANCES[name] = target()
    return _INSTANCES[name], None


def selection_reason(name: str) -> Optional[str]:
    """``None`` if selection / provider ``name`` can run here, else why not."""
    if name in SELECTIONS:
        reasons = [f"{p}: {r}" for p in SELECTIONS[name] for r in [load_provider(p)[1]] if r is not None]
        return "; ".join(reasons) or None
    return load_provider(name)[1]


def available_providers() -> dict[str, Optional[str]]:
    """Every selectable name -> ``None`` if it can run here, else the reason it cannot; **best first** (the
    selections, then the registered providers in "auto" order, ``torch`` last). The parity engine's hook
    (``parity/impls.py``): the usable names are ``[n for n, why in available_providers().items() if why is None]``,
    on a CPU machine ``["torch"]``, so ``auto`` runs every stage on ``torch`` there."""
    names = list(SELECTIONS) + [n for n in PROVIDERS if n not in SELECTIONS]
    return {name: selection_reason(name) for name in names}


class Plan:
    """One backend selection and the record of which provider ran each stage under it."""

    def __init__(self, provider: Union[str, Mapping[str, str]] = "auto", require: tuple = ()):
        if isinstance(provider, str):
            if provider != "auto" and provider not in PROVIDERS:
                raise BackendUnavailable(f"unknown provider {provider!r} (registered: auto, {', '.join(PROVIDERS)})")
        else:
            unknown = sorted(set(provider) - set(STAGES))
            if unknown:
                raise ValueError(f"unknown stage(s) {unknown} (stages: {', '.join(STAGES)})")
        self.provider = provider if isinstance(provider, str) else dict(provider)
        self.require = tuple(require)
        self.record: dict[str, str] = {}

    def check_required(self) -> None:
        missing = {name: reason for name in self.require for reason in [load_provider(name)[1]] if reason is not None}
        if len(missing) == 1:
            (name, reason), = missing.items()
            raise BackendUnavailable(f"required provider {name!r} is unavailable: {reason}")
        if missing:
            raise BackendUnavailable(f"required providers {', '.join(map(repr, missing))} are unavailable: "
                                     + "; ".join(f"{n}: {r}" for n, r in missing.items()))

    def _choice(self, stage: str) -> str:
        return self.provider if isinstance(self.provider, str) else self.provider.get(stage, "auto")

    def _auto(self) -> list[KernelSet]:
        return [inst for inst in (load_provider(n)[0] for n in PROVIDERS) if inst is not None]

    def select(self, stage: str, arguments: Optional[dict] = None) -> KernelSet:
        """The provider that runs this call of ``stage`` (recorded); ``arguments``: the call's, by name."""
        arguments = arguments or {}
        forced = [n for n in self.require if stage in load_provider(n)[0].stages] if self.require else []
        choice = self._choice(stage)
        if not forced and choice != "auto":
            inst, reason = load_provider(choice)
            if inst is None:
                raise BackendUnavailable(f"provider {choice!r} is unavailable: {reason}")
            if stage in inst.stages:
                forced = [choice]
        if forced:
            inst = load_provider(forced[0])[0]
            reason = inst.check_support(stage, **arguments)
            if reason is not None:
                raise StageUnsupported(stage, inst.name, reason)
            return self._note(stage, inst)
        declined = []
        for inst in self._auto():
            if stage not in inst.stages:
                continue
            reason = inst.check_support(stage, **arguments)
            if reason is None:
                return self._note(stage, inst)
            declined.append(f"{inst.name}: {reason}")
        raise StageUnsupported(stage, "auto", "; ".join(declined) or "no provider implements it")

    def _note(self, stage: str, inst: KernelSet) -> KernelSet:
        ran = self.record.get(stage)
        if ran is None:
            self.record[stage] = inst.name
        elif inst.name not in ran.split("+"):
            self.record[stage] = f"{ran}+{inst.name}"
        return inst

    def topk_alignment(self) -> int:
        """Index width the sparse-attention forward callers pad to: the strictest of the candidate providers."""
        candidates = [load_provider(n)[0] for n in self.require] + self._auto()
        return max((c.topk_alignment for c in candidates if c is not None and "sparse_attn_fwd" in c.stages),
                   default=128)


_DEFAULT_PLAN = Plan("auto")
_CURRENT: contextvars.ContextVar[Optional[Plan]] = contextvars.ContextVar("fused_plan", default=None)
#: Plans of the open ``use_backend`` blocks, process-wide: autograd runs CUDA backward passes on its own device
#: threads, which do not inherit the caller's context variables; they see the innermost open block through this.
_ACTIVE: list[Plan] = []
_LAST: list[Plan] = []  # the most recently opened block (:func:`executed`)


def current_plan() -> Plan:
    return _CURRENT.get() or (_ACTIVE[-1] if _ACTIVE else _DEFAULT_PLAN)


@contextlib.contextmanager
def use_backend(provider: Union[str, Mapping[str, str]] = "auto", require: tuple = ()) -> Iterator[Plan]:
    """Run the fused path under a new :class:`Plan` (see the module docstring); yields the plan.

    A selection name (``"cudnn"``) becomes ``"auto"`` with its providers added to ``require``."""
    require = tuple(require)
    if isinstance(provider, str) and provider in SELECTIONS:
        provider, require = "auto", tuple(dict.fromkeys(SELECTIONS[provider] + require))
    plan = Plan(provider, require)
    plan.check_required()
    _LAST[:] = [plan]
    token = _CURRENT.set(plan)
    _ACTIVE.append(plan)
    try:
        yield plan
    finally:
        _ACTIVE.remove(plan)
        _CURRENT.reset(token)


def topk_tie_rule(record: Mapping[str, str]) -> str:
    """The top-k tie rule of a run with plan ``record``: ``"lower-index"`` when every provider that ran
    ``indexer_top_k`` declares it (:attr:`KernelSet.topk_tie_rule`), else ``"arbitrary"`` (also when no top-k
    ran). The parity engine's hook (``parity/impls.py``)."""
    ran = [n for n in str(record.get("indexer_top_k", "")).split("+") if n]
    providers = [load_provider(n)[0] for n in ran]
    if ran and all(p is not None and p.topk_tie_rule == "lower-index" for p in providers):
        return "lower-index"
    return "arbitrary"


def executed() -> dict[str, str]:
    """``{stage: provider}`` that ran in the most recently opened :func:`use_backend` block (empty if none)."""
    return dict(_LAST[0].record) if _LAST else {}


#: Kernel-call observers of the open :func:`observe_kernels` blocks, process-wide (as :data:`_ACTIVE`: autograd's
#: device threads run backward kernel calls too), outermost first.
_OBSERVERS: list[Callable[[str, str], ContextManager]] = []


@contextlib.contextmanager
def observe_kernels(observer: Callable[[str, str], ContextManager]) -> Iterator[None]:
    """Within the block, every kernel call of the fused path runs inside ``observer(stage, provider_name)``, a
    context manager the dispatcher enters after it chose the provider and exits when the provider returned (or
    raised): the one place to time, count, profile or trace kernel calls without touching a provider.

    Example: ``with observe_kernels(lambda stage, provider: torch.profiler.record_function(stage)): step()``.
    Blocks nest (the innermost observer is entered last, closest to the call); a call that fails its argument
    contract or finds no provider is not observed. Not thread-local: calls from every thread are observed."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


class _Kernels:
    """``kernels.<stage>(...)``: the composition's single entry point to a kernel. Each call: its arguments are
    bound by name, the stage's argument contract is enforced (:func:`fused.kernels.contracts.check`, before and
    whatever the provider), the plan selects a provider (its ``check_support``), the provider executes it."""

    def __getattr__(self, stage: str) -> Any:
        if stage not in STAGES:
            raise AttributeError(f"no kernel stage {stage!r}")

        def call(*args: Any, **kwargs: Any) -> Any:
            arguments = bind_arguments(stage, args, kwargs)
            contracts.check(stage, arguments)
            provider = current_plan().select(stage, arguments)
            if not _OBSERVERS:
                return provider.execute(stage, arguments)
            with contextlib.ExitStack() as observed:
                for observer in list(_OBSERVERS):
                    observed.enter_context(observer(stage, provider.name))
                return provider.execute(stage, arguments)

        call.__name__ = stage
        return call


kernels = _Kernels()
