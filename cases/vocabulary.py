"""The vocabulary every layer shares: the outcomes of a case, the tensor classes, the suite names, the "unsupported"
exception.

Defined here once (``cases/`` is the ground floor: the implementations, the engine and the reports all import it);
standard library only, so the command line checks its arguments with it before it loads torch.
"""

from __future__ import annotations

from .errors import CaseError

#: A case's outcome (``results.jsonl`` field ``outcome``): ``pass`` / ``fail`` (numeric or structural) / ``error``
#: (an exception, a crashed worker) / ``unsupported`` (the implementation declined the case, or it needs a GPU) /
#: ``known`` (a registered known deviation of the implementation: an expected failure, ``parity/deviations/known.py``).
OUTCOMES = ("pass", "fail", "error", "unsupported", "known")
#: Outcomes counted even when zero (``known`` appears only when some case has it, as in the ``end`` row).
ALWAYS_COUNTED = ("pass", "fail", "error", "unsupported")

#: Tensor classes (``results.jsonl`` field ``tensor_class``), in report order. ``grad_indexer``: the gradients of
#: ``core_attention.indexer.*``, trained only by the KL loss.
TENSOR_CLASSES = ("out", "lse", "index_scores", "topk", "loss", "grad_input", "grad_param", "grad_indexer",
                  "contract")
#: The classes judged by numeric tolerances (``parity/policy.json`` has an entry for each); ``contract`` tensors are
#: judged exactly (``contract/padding_dout``: every gradient 0).
TOLERANCED_CLASSES = TENSOR_CLASSES[:-1]


#: The stored case suites (``cases/suites/<name>.json``, :data:`cases.suites.SUITES`) and the subsets selected from
#: one of them (:data:`cases.suites.SUBSETS`), by name: what ``--suite`` accepts.
STORED_SUITES = ("smoke", "gate", "nightly", "production")
SUITE_SUBSETS = ("gate-cpu",)
SUITE_NAMES = STORED_SUITES + SUITE_SUBSETS


def check_suite(name: str) -> str:
    """``name`` if it names a suite (stored or subset); else :class:`cases.errors.CaseError` on ``suite``."""
    if name not in SUITE_NAMES:
        raise CaseError("suite", f"unknown suite {name!r} (known: {', '.join(SUITE_NAMES)})")
    return name


class Unsupported(Exception):
    """An implementation declines a case: an architecture or kernel limit, or a provider that cannot run here.

    The engine reports the case as ``unsupported`` (not ``error``). Implementations raise a subclass (fused's
    ``StageUnsupported`` and ``BackendUnavailable``); ``NotImplementedError`` is read the same way."""


def outcome_counts(found) -> dict[str, int]:
    """``{outcome: count}`` in :data:`OUTCOMES` order from a mapping (or pandas value counts); ``known`` only when
    some case has it."""
    return {o: int(found.get(o, 0)) for o in OUTCOMES if o in ALWAYS_COUNTED or found.get(o, 0)}
