"""Which implementations ``dsv4-parity bench`` measures (``--impl``), with which provider, and where their kernels
are observed — by the hooks of :mod:`parity.impls`, never by importing an implementation's package.

* :func:`parse_impls` — ``"fused,megatron"`` → ``["fused", "megatron"]``; an implementation that cannot be loaded
  or cannot run here at all (its ``check_ready`` hook) is one :class:`CaseError` naming ``impl``.
* :func:`bench_impl` — one implementation with the provider the bench runs it on (:func:`bench_provider`) and its
  kernel observation hook ``observe_kernels(observer)`` (same contract as ``fused.observe_kernels``: every kernel
  call runs inside ``observer(stage, provider)``), or ``None`` where it offers none.

* :func:`parse_providers` — ``--provider``: one name for every implementation (``cudnn``), or per implementation
  (``fused=torch,megatron=emulated``); a name no selected implementation knows is a :class:`CaseError` on
  ``provider``.

Provider mapping (:func:`bench_provider`, per implementation): an implementation without providers runs on
``none``; ``auto`` stays ``auto`` for an implementation that picks per stage itself (``provider_name("auto")`` is
``auto``: fused), and otherwise becomes ``cudnn`` where that provider is usable here and the kernels are observable,
else the implementation's own default (``provider_name("auto")``: megatron's ``unfused``); any other name goes
through ``provider_name`` and must be one of the implementation's providers — a name it lacks, or one unusable here
(cudnn without a GPU), makes its rows ``unsupported`` with the reason, never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

from cases.errors import CaseError


def parse_impls(text: Optional[str]) -> list[str]:
    """The ``--impl`` list (default ``fused``), each loadable and ready here (else a :class:`CaseError` on ``impl``).
    The reference is not listed: it runs beside them as the baseline (``--no-reference`` drops it)."""
    from parity.impls import load

    names: list[str] = []
    for name in (t.strip() for t in (text or "fused").split(",")):
        if name and name not in names:
            names.append(name)
    if not names:
        raise CaseError("impl", "needs at least one implementation (e.g. fused or fused,megatron)")
    for name in names:
        if name == "reference":
            raise CaseError("impl", "the reference runs beside every --impl as the baseline; name the "
                                    "implementations to compare with it (e.g. fused,megatron)")
        try:
            load(name).check_ready()
        except ValueError as exc:  # ImplError, a missing Megatron checkout (MegatronSourceError)
            raise CaseError("impl", " ".join(str(exc).split())) from None
    return names


def _knows(impl, provider: str) -> bool:
    """Is ``provider`` one of ``impl``'s providers (after its ``provider_name``), or ``auto``?"""
    return provider == "auto" or not impl.has_providers or impl.provider_name(provider) in impl.providers()


def parse_providers(text: Optional[str], impls: list[str]) -> dict[str, str]:
    """``--provider`` → ``{implementation: requested provider}`` for ``impls`` (and ``fused``, which the stages,
    breakdown and harness sections measure): ``"cudnn"`` for all, or ``"fused=torch,megatron=emulated"`` (an
    implementation not named gets ``auto``; so does fused, when only the other sections measure it, for a name it
    lacks)."""
    from parity.impls import load

    text = (text or "auto").strip()
    loaded = {name: load(name) for name in dict.fromkeys([*impls, "fused"])}
    if "=" not in text:
        if "," in text or not any(_knows(impl, text) for impl in loaded.values()):
            raise CaseError("provider", f"{text!r} is a provider of none of {', '.join(loaded)} (one name, or "
                                        "per implementation: fused=torch,megatron=emulated)")
        # fused measured only as the other sections' baseline (not named in --impl) keeps auto for a name it lacks
        return {name: text if name in impls or _knows(impl, text) else "auto" for name, impl in loaded.items()}
    out = {name: "auto" for name in loaded}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, provider = (t.strip() for t in item.partition("="))
        if not sep or name not in impls:
            raise CaseError("provider", f"{item!r}: use <impl>=<provider> with an --impl name "
                                        f"({', '.join(impls)})")
        if not _knows(loaded[name], provider):
            raise CaseError("provider", f"{name} has no provider {provider!r} (known: "
                                        f"{', '.join(['auto', *loaded[name].providers()])})")
        out[name] = provider
    return out


@dataclass
class BenchImpl:
    """One implementation as the bench runs it: ``provider`` to request, ``unavailable`` (why its rows cannot run
    here, else None) and ``observe_kernels`` (its kernel observation hook, or None)."""

    name: str
    impl: object  # parity.impls.Implementation
    provider: str
    unavailable: Optional[str]
    observe_kernels: Optional[Callable[[Callable[[str, str], ContextManager]], ContextManager]]

    @property
    def api(self):
        return self.impl.api

    def context(self) -> Callable[[], ContextManager]:
        return self.impl.context(self.provider)


def bench_provider(impl, requested: str) -> tuple[str, Optional[str]]:
    """``(provider to request, None or why it cannot run here)`` for ``--provider requested`` (module docstring)."""
    if not impl.has_providers:
        return "none", None
    known = impl.providers()
    if requested == "auto":
        own = impl.provider_name("auto")
        if own == "auto":
            return "auto", None
        if "cudnn" in known and known["cudnn"] is None and impl.optional_hook("observe_kernels") is not None:
            return "cudnn", None
        return own, known.get(own)
    name = impl.provider_name(requested)
    if name not in known:
        return name, f"{impl.name} has no provider {requested!r} (known: {', '.join(known)})"
    return name, (f"provider {name!r} of {impl.name} is unavailable here: {known[name]}" if known[name] else None)


def bench_impl(name: str, requested: str) -> BenchImpl:
    """``name`` loaded, with its provider for ``--provider requested`` and its kernel hook."""
    from parity.impls import load

    impl = load(name)
    provider, why = bench_provider(impl, requested)
    return BenchImpl(name, impl, provider, why, impl.optional_hook("observe_kernels"))


def no_kernels_note(b: BenchImpl) -> str:
    """Why a row of ``b`` has no kernel sum."""
    if b.observe_kernels is None:
        return f"{b.name} has no observe_kernels hook: its kernels are not timed"
    return f"no kernels observed: {b.name} on provider {b.provider!r} made no kernel call through observe_kernels"
