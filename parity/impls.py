"""Implementations the engine can compare, by name: ``reference``, ``fused``, or any importable ``module[:attr]``.

An implementation is an object (usually a module) exposing the public API of ARCHITECTURE.md
(``attention_layer``, ``core_attention``). One with kernel providers also satisfies :class:`ProviderHooks`
(``fused``'s conventions). Without them the provider is ignored (the reference has none; its provider reads
``"none"``). Optional hooks, looked up by name:

* ``use_activation_pattern(active, window, scores=None)`` — a context manager differentiating the indexer's ReLU
  at another implementation's activation pattern and the indexer KL at its index scores (sign- and score-split,
  :mod:`parity.judge.sign_split`; the reference has it);
* ``topk_tie_rule(record)`` — the declared top-k tie rule of a run (``parity.judge.topk.TIE_RULES``) given its plan
  record; without it the attribute ``TOPK_TIE_RULE``; without either ``"arbitrary"`` (only the value-based
  top-k protocol applies). ``reference`` declares ``lower-index``; ``fused`` per provider (``torch``:
  ``lower-index``, ``cudnn``: ``arbitrary``).
* ``precision(case)`` — the dtype the implementation computes ``case`` in when below the case dtype (production's
  float32 islands in a float64 run): its noise floor and tolerances are then that dtype's (default: the case dtype);
* ``provider_name(provider)`` — the provider that ``provider`` (e.g. ``auto``) selects, as the implementation names it;
* ``gate_paths(provider)`` — the providers a gate runs, one run each (``dsv4-parity gate``): the implementation's
  production paths (default: ``[provider]``);
* ``describe()`` — a dict for the run row (e.g. the revision of the code under test and the stand-ins in use);
* ``known_deviations()`` — the registry of known behaviour that differs from the contract (:mod:`parity.deviations.known`);
* ``use_context_parallel(n)`` — a context manager running the calls inside it with ``n`` context-parallel ranks
  (``--cp N``; megatron: production's THD CP branch over ``n`` rank processes);
* ``context_parallel_layout(case)`` — how the current CP ranks partition ``case`` (``{"size", "local", "d_window"}``,
  None at one rank): what a known deviation's model of the CP branch needs (:mod:`parity.deviations.known_models`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Mapping, Optional, Protocol, Union, runtime_checkable

from cases.vocabulary import Unsupported

from parity.judge.topk import TIE_RULES

BUILTIN = {"reference": "reference", "fused": "fused", "megatron": "adapters.megatron"}


class ImplError(ValueError):
    """An implementation or provider that cannot be used (a CLI usage error)."""


def is_unsupported(exc: BaseException) -> bool:
    """Architecture or kernel limits: :class:`cases.vocabulary.Unsupported` (fused's ``StageUnsupported``,
    ``BackendUnavailable``) or ``NotImplementedError``."""
    return isinstance(exc, (Unsupported, NotImplementedError))


@runtime_checkable
class ProviderHooks(Protocol):
    """The hooks of an implementation with kernel providers (both required; ``fused`` has them)."""

    def use_backend(self, provider: str = "auto", require: tuple = ()) -> ContextManager[Any]:
        """A context manager selecting the kernel provider(s); the object it yields has ``record``:
        ``{stage: provider}`` of what actually ran (the ``plan`` field of a result)."""

    def available_providers(self) -> Union[Mapping[str, Optional[str]], Iterable[str]]:
        """``{name: None if usable here else the reason}`` (or a list of usable names)."""


@dataclass
class Implementation:
    name: str
    api: Any

    @property
    def hooks(self) -> Optional[ProviderHooks]:
        """The implementation's provider hooks, or ``None`` if it has no kernel providers."""
        return self.api if isinstance(self.api, ProviderHooks) else None

    @property
    def has_providers(self) -> bool:
        return self.hooks is not None

    def providers(self) -> dict:
        """``{provider: None or why it is unavailable}`` (empty without providers)."""
        if self.hooks is None:
            return {}
        found = self.hooks.available_providers()
        return dict(found) if isinstance(found, dict) else {name: None for name in found}

    def resolve_provider(self, provider: str) -> str:
        """The provider to request: ``"none"`` without providers, else as given (``auto`` picks per stage)."""
        return provider if self.has_providers else "none"

    def check_ready(self) -> None:
        """Raise (a ``ValueError``) if the implementation cannot run at all here (its ``check_ready`` hook, e.g.
        the code under test cannot be found or imported): a usage error, before any case runs."""
        fn = self.optional_hook("check_ready")
        if fn is not None:
            fn()

    def check_provider(self, provider: str) -> None:
        """Raise :class:`ImplError` if a named provider cannot run here (a setup error, not a case outcome)."""
        if provider in ("auto", "none") or not self.has_providers:
            return
        known = self.providers()
        if known and provider not in known:
            raise ImplError(f"{self.name} has no provider {provider!r} (known: {', '.join(known)})")
        if known.get(provider):
            raise ImplError(f"provider {provider!r} is unavailable here: {known[provider]}")

    def optional_hook(self, name: str) -> Optional[Callable]:
        """The implementation's callable ``name`` (module docstring), or None."""
        fn = getattr(self.api, name, None)
        return fn if callable(fn) else None

    def tie_rule(self, record: Optional[dict] = None) -> str:
        """The declared top-k tie rule of a run with plan ``record`` (module docstring)."""
        fn = self.optional_hook("topk_tie_rule")
        rule = fn(record or {}) if fn is not None else getattr(self.api, "TOPK_TIE_RULE", "arbitrary")
        if rule not in TIE_RULES:
            raise ImplError(f"{self.name} declares top-k tie rule {rule!r} (known: {', '.join(TIE_RULES)})")
        return rule

    def provider_name(self, provider: str) -> str:
        """The provider that ``provider`` (e.g. ``auto``) selects, as the implementation names it."""
        fn = self.optional_hook("provider_name")
        return str(fn(provider)) if fn is not None else provider

    def gate_paths(self, provider: str) -> list[str]:
        """The providers a gate of this implementation runs, one run each (the ``gate_paths`` hook; default the one
        ``provider`` asked for)."""
        fn = self.optional_hook("gate_paths")
        return [str(p) for p in fn(provider)] if fn is not None else [provider]

    def precision(self, case) -> str:
        """The dtype this implementation computes ``case`` in (the case dtype unless it declares otherwise)."""
        fn = self.optional_hook("precision")
        return str(fn(case)) if fn is not None else case.dtype

    def raised_in_own_code(self, exc: BaseException) -> Optional[str]:
        """Where (``file:line``) ``exc`` was raised inside the code under test itself — the implementation's own
        behaviour on the case (a ``fail`` with rule ``raised``), not a harness or adapter error — or None (its
        ``raised_in_own_code`` hook; without one every exception is an ``error``)."""
        fn = self.optional_hook("raised_in_own_code")
        if fn is None:
            return None
        try:
            where = fn(exc)
        except Exception:  # noqa: BLE001 — a broken hook leaves the exception an error
            return None
        return str(where) if where else None

    def describe(self, provider: Optional[str] = None) -> dict:
        """What the run row records about the implementation (empty without a ``describe`` hook); ``provider``
        (the run's) is passed to a hook that takes it, so provider-specific stand-ins are recorded too."""
        fn = self.optional_hook("describe")
        if fn is None:
            return {}
        takes = provider is not None and "provider" in inspect.signature(fn).parameters
        return dict(fn(provider=provider) if takes else fn())

    def cp_layout(self, case) -> Optional[dict]:
        """How the implementation partitions ``case`` over its current context-parallel ranks (its
        ``context_parallel_layout(case)`` hook: ``{"size", "local", "d_window"}``, see
        :class:`parity.deviations.known_models.ModelContext`), or None (no hook, or one rank)."""
        fn = self.optional_hook("context_parallel_layout")
        found = fn(case) if fn is not None else None
        return dict(found) if found else None

    def parallel(self, cp: int) -> ContextManager:
        """The context running this implementation with ``cp`` context-parallel ranks (``--cp``; 1: a no-op);
        :class:`ImplError` when it has no ``use_context_parallel`` hook or refuses the size."""
        if int(cp) == 1:
            return contextlib.nullcontext()
        fn = self.optional_hook("use_context_parallel")
        if fn is None:
            raise ImplError(f"--cp {cp}: implementation {self.name!r} has no context parallelism (--impl megatron has)")
        try:
            return fn(int(cp))
        except ValueError as exc:
            raise ImplError(str(exc)) from None

    def context(self, provider: str, require: Optional[str] = None) -> Callable[[], ContextManager]:
        hooks = self.hooks
        if hooks is None or provider == "none":
            return contextlib.nullcontext
        required = (require,) if require else ()
        return lambda: hooks.use_backend(provider=provider, require=required)


    def activation_context(self, active, window: float, scores=None) -> Optional[Callable[[], ContextManager]]:
        """Sign-split context factory for ``active`` (and score-split for ``scores``), or None if this
        implementation has no such hook."""
        fn = self.optional_hook("use_activation_pattern")
        return None if fn is None else (lambda: fn(active, window, scores))


def policy_provider(record: Optional[dict], requested: str) -> str:
    """The policy's provider key for a run: ``torch`` if every stage ran on the torch provider, ``cudnn`` if any ran
    on a GPU kernel provider (cuDNN / FlashMLA), else the requested provider (``none`` for the reference)."""
    if record:
        ran = {p for value in record.values() for p in str(value).split("+")}
        return "torch" if ran <= {"torch"} else "cudnn"
    return requested if requested not in ("auto",) else "torch"


def load(name: str) -> Implementation:
    """Resolve ``reference`` / ``fused`` / ``package.module`` / ``package.module:attribute``."""
    target = BUILTIN.get(name, name)
    module_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImplError(f"cannot import implementation {name!r}: {exc}") from None
    if attr:
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            raise ImplError(f"implementation {name!r}: {module_name} has no attribute {attr!r}") from None
    missing = [f for f in ("attention_layer", "core_attention") if not callable(getattr(obj, f, None))]
    if missing:
        raise ImplError(f"implementation {name!r} lacks {', '.join(missing)} (not written yet?)")
    return Implementation(name, obj)
