"""The parity engine's view of the fused providers (the hooks of ``parity/impls.py``), and an implementation object
that carries them: ``--impl fused.providers`` (until ``fused/__init__.py`` re-exports these hooks itself).

Selectable names, best first:

* ``cudnn`` — the production kernels: cuDNN DSA (``cudnn`` provider) and FlashMLA (``flashmla``) are **required**
  for every stage they implement; a stage they decline (bf16 only, sm90's refusal of the dense loss, ...) raises
  :class:`fused.plan.StageUnsupported`, which the engine reports as ``unsupported`` — never a silent fallback.
  Stages neither implements (the teacher LSE) run on ``torch``, and the plan record says so.
* ``torch`` — the contract-exact PyTorch kernels for every stage (CPU or GPU).
* ``auto`` — each call takes the first provider that accepts it (``fused.plan``): on a GPU machine with the
  packages that is cudnn + flashmla where supported and torch elsewhere, recorded per stage.

Any other registered provider name (``flashmla``) selects it as in :func:`fused.use_backend`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from . import attention_layer, compressor, core_attention, indexer  # noqa: F401 - the implementation's public API
from .plan import Plan, load_provider, use_backend

PRODUCTION = ("cudnn", "flashmla")
_last: dict[str, Optional[Plan]] = {"plan": None}


def production_available() -> Optional[str]:
    """``None`` if both production providers can run here, else why not."""
    reasons = [f"{n}: {r}" for n in PRODUCTION for r in [load_provider(n)[1]] if r is not None]
    return "; ".join(reasons) or None


def available_providers() -> list[str]:
    """Selectable providers usable on this machine, best first (``--provider auto`` takes the first)."""
    return (["cudnn"] if production_available() is None else []) + ["torch"]


@contextlib.contextmanager
def use_provider(name: str) -> Iterator[Plan]:
    """Run the fused path under the named selection (module docstring); the plan is kept for :func:`executed`."""
    if name == "cudnn":
        ctx = use_backend("auto", require=PRODUCTION)
    else:
        ctx = use_backend(name)
    with ctx as plan:
        _last["plan"] = plan
        yield plan


def executed() -> dict[str, str]:
    """``{stage: provider}`` that ran in the last :func:`use_provider` block (empty if none ran)."""
    plan = _last["plan"]
    return dict(plan.record) if plan is not None else {}


def plan(case: Any, provider: str) -> dict[str, str]:
    """Known-unsupported cases fail fast (``NotImplementedError``); otherwise the engine uses :func:`executed`."""
    if provider == "cudnn":
        reason = production_available()
        if reason is not None:
            raise NotImplementedError(f"the production kernels are unavailable here: {reason}")
    return {}
