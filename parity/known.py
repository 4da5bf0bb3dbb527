"""Known deviations: registered behaviour of an implementation that differs from the contract, and the ``known``
outcome they give a case.

An implementation offers a registry with a ``known_deviations()`` hook: a list of entries (dicts, usually loaded
from a committed JSON file; schema below). After a case is decided, :func:`apply` looks for entries that *match* it
(implementation × provider × architecture × revision × case features):

* the case failed or errored and a matching entry *explains* it (every failing tensor matches the entry's tensor
  patterns, or the error message matches its ``error`` pattern), or several matching entries do together (each
  failing tensor matched by one of them: two independent deviations in one case) → outcome ``known`` (neither pass nor fail: it does
  not fail the run; JUnit shows it as an expected failure), ``known = {"id", "status": "reproduced", ...}``;
* the case passed and an entry matches it → the entry no longer reproduces: the outcome stays ``pass`` and
  ``known = {"id", "status": "fixed?"}`` flags it, so the registry stays true;
* a failure no entry explains stays a failure.

Entry fields::

    id            short name (unique)
    upstream      file:line of the production code
    reason        what differs from the contract, and why
    evidence      how it was reproduced (case ids, numbers)
    providers     ["unfused", "emulated", ...] or ["*"]
    architectures ["cpu", "sm90", "sm100", ...] or ["*"]
    revisions     substrings of the implementation's revision (``describe()["revision"]``) or ["*"]
    match         {feature: value | [values]} over cases.coverage.features(case) plus the derived features
                  ``compressed_rows`` ("none" | "some"), ``padding_rows`` (bool: alignment padding or a dummy tail) and
                  ``kl_support`` ("trivial" | "some": whether some real row sees two compressed keys)
    expect        {"error": regex} for a crash (an ``error``, or a ``fail`` with rule ``raised``: the code under test
                  raised in its own code), or {"tensors": [fnmatch patterns]} for failing tensors
    cases         ids of ``smoke`` (else ``nightly``) cases that reproduce the entry on a CPU provider (its test;
                  required when a CPU provider is listed, optional for a GPU-only entry)
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable, Optional

import torch

from cases.case import Case
from cases.coverage import features
from cases.errors import CaseError

REQUIRED = ("id", "upstream", "reason", "evidence", "providers", "architectures", "revisions", "match", "expect")


def validate(entries, source: str) -> list[dict]:
    """The entries of a registry, checked (a malformed entry names its field)."""
    if not isinstance(entries, list):
        raise CaseError(f"{source}.entries", "must be a list of entries")
    seen = set()
    for i, entry in enumerate(entries):
        where = f"{source}.entries[{i}]"
        if not isinstance(entry, dict):
            raise CaseError(where, "must be an object")
        missing = [k for k in REQUIRED if k not in entry]
        if missing:
            raise CaseError(f"{where}.{missing[0]}", "missing")
        if entry["id"] in seen:
            raise CaseError(f"{where}.id", f"duplicate id {entry['id']!r}")
        seen.add(entry["id"])
        expect = entry["expect"]
        if not isinstance(expect, dict) or not (("error" in expect) ^ ("tensors" in expect)):
            raise CaseError(f"{where}.expect", "needs exactly one of 'error' (regex) or 'tensors' (patterns)")
    return entries


def case_features(case: Case) -> dict:
    """Coverage features plus the derived ``compressed_rows``, ``padding_rows`` and ``kl_support`` (``trivial`` when no
    real query row sees two compressed keys: the indexer KL over them is identically 0, so a deviation of the loss or
    its gradient cannot show)."""
    feats = dict(features(case))
    r = case.config.compress_ratio
    layout = case.layout
    if layout.kind == "bshd":
        lengths = [layout.seq_len]
    else:
        pad = layout.cu_seqlens_padded
        lengths = [pad[i + 1] - pad[i] for i in range(len(pad) - 1)]
    feats["compressed_rows"] = "some" if r > 1 and any(n >= r for n in lengths) else "none"
    feats["padding_rows"] = bool(feats.get("alignment_padding") or feats.get("dummy_tail"))
    real = [layout.seq_len] if layout.kind == "bshd" else list(layout.real_lengths)
    feats["kl_support"] = "some" if r > 1 and any(n >= 2 * r for n in real) else "trivial"
    return feats


def _listed(value, allowed) -> bool:
    allowed = allowed if isinstance(allowed, list) else [allowed]
    return "*" in allowed or value in allowed or str(value) in [str(a) for a in allowed]


def matches(entry: dict, feats: dict, provider: str, arch: str, revision: str) -> bool:
    if not _listed(provider, entry["providers"]) or not _listed(arch, entry["architectures"]):
        return False
    revs = entry["revisions"]
    if "*" not in revs and not any(r in revision for r in revs):
        return False
    return all(key in feats and _listed(feats[key], want) for key, want in entry["match"].items())


def _covers(entry: dict, tensor: str) -> bool:
    """Whether ``tensor`` matches one of the entry's expected failing-tensor patterns."""
    return any(fnmatch.fnmatchcase(tensor, pattern) for pattern in entry["expect"].get("tensors", ()))


def explains(entry: dict, result) -> bool:
    """Whether ``entry`` accounts for every failure of a failed / errored result."""
    expect = entry["expect"]
    if result.outcome == "error" or (result.outcome == "fail" and result.decided_by == "raised"):
        return "error" in expect and re.search(expect["error"], result.message or "") is not None
    if result.outcome != "fail" or "tensors" not in expect:
        return False
    failed = [t.name for t in result.tensors if t.failed]
    if not failed:  # a case-level structure problem
        return False
    return all(_covers(entry, name) for name in failed)


def explaining(entries: list[dict], result) -> list[dict]:
    """The matching entries that together account for a failed / errored result: one entry that explains it alone,
    else (two independent deviations in one case) a set of tensor entries in which every failing tensor matches
    some entry's patterns, each entry accounting for at least one of them; ``[]`` when the failures are not all
    explained."""
    single = next((e for e in entries if explains(e, result)), None)
    if single is not None:
        return [single]
    failed = [t.name for t in result.tensors if t.failed] if result.outcome == "fail" else []
    if not failed:
        return []
    used: list[dict] = []
    for name in failed:
        entry = next((e for e in entries if _covers(e, name)), None)
        if entry is None:
            return []
        if entry not in used:
            used.append(entry)
    return used if len(used) > 1 else []


def apply(result, entries: Iterable[dict], provider: str, arch: str, revision: str) -> None:
    """Set ``result.outcome = "known"`` / ``result.known`` per the module docstring (in place). Several entries
    explaining one case together give the id ``a+b``."""
    feats = case_features(result.case)
    matching = [e for e in entries if matches(e, feats, provider, arch, revision)]
    if not matching:
        return
    if result.outcome in ("fail", "error"):
        found = explaining(matching, result)
        if found:
            ident = "+".join(e["id"] for e in found)
            result.known = {"id": ident, "status": "reproduced", "upstream": "; ".join(e["upstream"] for e in found),
                            "was": result.outcome, "message": result.message}
            result.outcome, result.decided_by = "known", "known"
            result.message = f"known deviation {ident}: {result.message}"
            return
    elif result.outcome == "pass":
        entry = matching[0]
        result.known = {"id": entry["id"], "status": "fixed?", "upstream": entry["upstream"]}
        result.message = (f"known deviation {entry['id']} did not reproduce (fixed upstream? update "
                          "the registry)")


def architecture(device: str) -> str:
    """``cpu`` or ``sm<major><minor>`` of the current CUDA device."""
    if device != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def registry_for(impl) -> list[dict]:
    """An implementation's registry, validated (empty without a ``known_deviations`` hook)."""
    fn = impl.optional_hook("known_deviations")
    return validate(fn(), f"{impl.name} known deviations") if fn is not None else []


def status_of(row: dict) -> Optional[str]:
    """``reproduced`` / ``fixed?`` / None of a case row."""
    known = row.get("known") or {}
    return known.get("status")
