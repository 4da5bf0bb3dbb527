"""The provider hooks of the parity engine under the names the GPU tooling uses, and an implementation object that
carries them (``--impl fused.providers``). ``fused`` itself exports the engine's hooks (``use_backend``,
``available_providers``, plus :func:`use_provider` / :func:`executed` from here), so plain ``--impl fused`` works
with ``--provider auto|torch|cudnn|flashmla``; this module stays for the tools that name it.

Selectable names, best first:

* ``cudnn`` — the production kernels: cuDNN DSA (``cudnn`` provider) and FlashMLA (``flashmla``) are **required**
  for every stage they implement; a stage they decline (bf16 only, sm90's refusal of the dense loss, ...) raises
  :class:`fused.plan.StageUnsupported`, which the engine reports as ``unsupported`` — never a silent fallback.
  Stages neither implements (the teacher LSE) run on ``torch``, and the plan record says so
  (:data:`fused.plan.SELECTIONS`).
* ``torch`` — the contract-exact PyTorch kernels for every stage (CPU or GPU).
* ``auto`` — each call takes the first provider that accepts it (``fused.plan``): on a GPU machine with the
  packages that is cudnn + flashmla where supported and torch elsewhere, recorded per stage.

Any other registered provider name (``flashmla``) selects it as in :func:`fused.use_backend`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from . import attention_layer, compressor, core_attention, indexer  # noqa: F401 - the implementation's public API
from .plan import SELECTIONS, Plan, executed, selection_reason, topk_tie_rule, use_backend  # noqa: F401 - hooks

PRODUCTION = SELECTIONS["cudnn"]


def production_available() -> Optional[str]:
    """``None`` if both production providers can run here, else why not."""
    return selection_reason("cudnn")


def available_providers() -> list[str]:
    """The usable selections of ``cudnn`` / ``torch``, best first (``["torch"]`` on a CPU machine)."""
    return (["cudnn"] if production_available() is None else []) + ["torch"]


@contextlib.contextmanager
def use_provider(name: str) -> Iterator[Plan]:
    """Run the fused path under the named selection (module docstring); :func:`executed` reports what ran."""
    with use_backend(name) as plan:
        yield plan


def plan(case: Any, provider: str) -> dict[str, str]:
    """Known-unsupported cases fail fast (``NotImplementedError``); otherwise the engine uses :func:`executed`."""
    if provider == "cudnn":
        reason = production_available()
        if reason is not None:
            raise NotImplementedError(f"the production kernels are unavailable here: {reason}")
    return {}
