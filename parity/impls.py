"""Implementations the engine can compare, by name: ``reference``, ``fused``, or any importable ``module[:attr]``.

An implementation is an object (usually a module) exposing the public API of ARCHITECTURE.md
(``attention_layer``, ``core_attention``). Optional hooks, looked up by name (``fused``'s conventions):

* ``use_backend(provider=..., require=(...))`` — a context manager selecting the kernel provider(s); the object it
  yields has ``record``: ``{stage: provider}`` of what actually ran (the ``plan`` field of a result);
* ``available_providers()`` — ``{name: None if usable here else the reason}`` (or a list of usable names);
* ``precision(case)`` — the dtype the implementation computes ``case`` in when below the case dtype (production's
  float32 islands in a float64 run): its noise floor and tolerances are then that dtype's (default: the case dtype);
* ``describe()`` — a dict for the run row (e.g. the revision of the code under test and the stand-ins in use);
* ``known_deviations()`` — the registry of known behaviour that differs from the contract (:mod:`parity.known`).

Without ``use_backend`` the provider is ignored (the reference has none; its provider reads ``"none"``).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

BUILTIN = {"reference": "reference", "fused": "fused", "megatron": "adapters.megatron"}


class ImplError(ValueError):
    """An implementation or provider that cannot be used (a CLI usage error)."""


def is_unsupported(exc: BaseException) -> bool:
    """Architecture or kernel limits: ``NotImplementedError``, or an exception class named ``*Unsupported*`` /
    ``*Unavailable*`` (fused's ``StageUnsupported``, ``BackendUnavailable``)."""
    return isinstance(exc, NotImplementedError) or any(
        "Unsupported" in k.__name__ or "Unavailable" in k.__name__ for k in type(exc).__mro__)


@dataclass
class Implementation:
    name: str
    api: Any

    def _hook(self, name: str) -> Optional[Callable]:
        fn = getattr(self.api, name, None)
        return fn if callable(fn) else None

    @property
    def has_providers(self) -> bool:
        return self._hook("use_backend") is not None

    def providers(self) -> dict:
        """``{provider: None or why it is unavailable}`` (empty without providers)."""
        fn = self._hook("available_providers")
        if fn is None:
            return {}
        found = fn()
        return dict(found) if isinstance(found, dict) else {name: None for name in found}

    def resolve_provider(self, provider: str) -> str:
        """The provider to request: ``"none"`` without providers, else as given (``auto`` picks per stage)."""
        return provider if self.has_providers else "none"

    def check_ready(self) -> None:
        """Raise (a ``ValueError``) if the implementation cannot run at all here (its ``check_ready`` hook, e.g.
        the code under test cannot be found or imported): a usage error, before any case runs."""
        fn = self._hook("check_ready")
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

    def provider_name(self, provider: str) -> str:
        """The provider that ``provider`` (e.g. ``auto``) selects, as the implementation names it."""
        fn = self._hook("provider_name")
        return str(fn(provider)) if fn is not None else provider

    def precision(self, case) -> str:
        """The dtype this implementation computes ``case`` in (the case dtype unless it declares otherwise)."""
        fn = self._hook("precision")
        return str(fn(case)) if fn is not None else case.dtype

    def describe(self) -> dict:
        """What the run row records about the implementation (empty without a ``describe`` hook)."""
        fn = self._hook("describe")
        return dict(fn()) if fn is not None else {}

    def context(self, provider: str, require: Optional[str] = None) -> Callable[[], ContextManager]:
        fn = self._hook("use_backend")
        if fn is None or provider == "none":
            return contextlib.nullcontext
        required = (require,) if require else ()
        return lambda: fn(provider=provider, require=required)


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
