"""Known deviations: registered behaviour of an implementation that differs from the contract, each an executable
model of what it computes instead, and the outcome a case gets from them.

An implementation offers a registry with a ``known_deviations()`` hook: a list of entries (dicts, usually loaded
from a committed JSON file; schema below). After a case is judged against the contract, :func:`apply` takes the
entries that *match* it (implementation × provider × architecture × case features) and *hold* at the run's revision
(:func:`holds_at`), and judges the case again:

* an entry with a **model** (``expect.model``, one of :data:`parity.deviations.known_models.MODELS`) turns the contract's
  expectation into the documented deviant one; the implementation is judged against it with the normal policy and
  rules (several matching entries compose: two independent deviations in one case). Outcomes:

  - ``known`` — the implementation matches the model within tolerance (it fails the contract): ``known = {"id",
    "status": "reproduced", ...}`` (neither pass nor fail: it does not fail the run; JUnit shows an expected failure);
  - ``fail`` — it differs from both the contract and the model: the message names the entry and the distance of the
    first offending tensor to each, ``known = {"id", "status": "exceeded", ...}``;
  - ``fixed?`` — it now matches the contract (and not the model): the outcome stays ``pass``, ``known = {"id",
    "status": "fixed?"}`` flags it, so the registry stays true. A case on which an entry's model is
    indistinguishable from the contract is no evidence either way and is not flagged;

* an entry that cannot be modelled (a crash: ``expect.raises``) turns an ``error`` into ``known`` only when the
  exception's type **and** the raising frame in production's code (file, function, line range at the registered
  revisions) match; an error message alone never does. A matching case that passes is flagged ``fixed?``.

A failure no entry explains stays a failure; an entry that matches the case but is not registered at the run's
revision is named in the message (it does not apply there).

Entry fields::

    id            short name (unique)
    upstream      file:line of the production code (at the newest verified revision)
    reason        what differs from the contract, and why
    evidence      how it was reproduced (case ids, numbers, revisions)
    providers     ["unfused", "emulated", ...] or ["*"]
    architectures ["cpu", "sm90", "sm100", ...] or ["*"] (the architecture the implementation runs or declares)
    revisions     {"verified": [upstream commit ids], "introduced": id | null, "fixed": id | null}: where the entry is
                  known to hold. It applies at a verified revision and at ``introduced``; with an ancestry resolver
                  (``is_ancestor(a, b)``, the revision-range tooling) at every revision from ``introduced`` up to
                  ``fixed`` (excluded); never at ``fixed``. Ids are hex upstream commits, compared by prefix (>= 7)
    match         {feature: value | [values]} over cases.coverage.features(case) plus the derived features
                  ``compressed_rows`` ("none" | "some"), ``padding_rows`` (bool: alignment padding or a dummy tail) and
                  ``kl_support`` ("trivial" | "some": whether some real row sees two compressed keys)
    expect        {"model": name} (a deviation model), or {"raises": {"type": exception class name, "file": path
                  suffix, "function": name, "lines": [first, last] | {revision: [first, last]}}} for a crash
    cases         ids of ``smoke`` (else ``nightly``, else ``gate``) cases that reproduce the entry on a CPU provider
                  (its test; required when a CPU provider is listed, optional for a GPU-only entry)
"""

from __future__ import annotations

import itertools
import math
import re
import traceback
from typing import Callable, Iterable, Optional

import torch

from cases.case import Case
from cases.coverage import features
from cases.errors import CaseError

from parity.deviations import known_models
from parity.judge.padding_dout import TENSOR as CONTRACT
from parity.run.results import FLOAT_MAX

REQUIRED = ("id", "upstream", "reason", "evidence", "providers", "architectures", "revisions", "match", "expect")
#: the optional fields of an entry: the cases that show it, the CP sizes it holds at, a prose model of a deviation
OPTIONAL = ("cases", "cp", "model")
_ARCH = re.compile(r"\*|sm\d+")
RAISES = ("type", "file", "function", "lines")
#: at most this many matching model entries are combined on one case (their subsets are tried)
MAX_COMBINED = 5
_HEX = re.compile(r"[0-9a-f]{7,40}")


# ---- the registry ---------------------------------------------------------------------------------------------------
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
        # a misspelt field or value would make the entry silently match nothing (or, an empty match, everything)
        unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise CaseError(f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(REQUIRED + OPTIONAL)})")
        for field in ("providers", "architectures"):
            values = entry[field]
            if not (isinstance(values, list) and values and all(isinstance(v, str) and v for v in values)):
                raise CaseError(f"{where}.{field}", f"must be a non-empty list of names, got {values!r}")
        bad = [a for a in entry["architectures"] if not _ARCH.fullmatch(a)]
        if bad:
            raise CaseError(f"{where}.architectures", f"{bad[0]!r} is not an architecture ('*' or smNN, e.g. sm90)")
        if not isinstance(entry["match"], dict) or not entry["match"]:
            raise CaseError(f"{where}.match", "must name at least one case feature (an empty match is every case)")
        _validate_expect(entry["expect"], f"{where}.expect")
        _validate_revisions(entry["revisions"], f"{where}.revisions")
    return entries


def _validate_expect(expect, where: str) -> None:
    if not isinstance(expect, dict) or len(expect) != 1 or not ({"model", "raises"} & set(expect)):
        raise CaseError(where, "needs exactly one of 'model' (a deviation model) or 'raises' (a crash's exception "
                        "type and raising frame)")
    if "model" in expect:
        if expect["model"] not in known_models.MODELS:
            raise CaseError(f"{where}.model", f"unknown model {expect['model']!r} (known: "
                            f"{', '.join(known_models.MODELS)})")
        return
    raises = expect["raises"]
    if not isinstance(raises, dict) or any(k not in raises for k in RAISES):
        raise CaseError(f"{where}.raises", f"needs {', '.join(RAISES)} (a message alone never matches a crash)")
    lines = raises["lines"]
    ranges = lines.items() if isinstance(lines, dict) else [("", lines)]
    for rev, span in ranges:
        if rev and not _HEX.fullmatch(str(rev)):
            raise CaseError(f"{where}.raises.lines", f"keys must be hex commit ids, got {rev!r}")
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(n, int) for n in span)
                and 0 < span[0] <= span[1]):
            raise CaseError(f"{where}.raises.lines" + (f".{rev}" if rev else ""),
                            f"must be [first, last] line numbers (or {{revision: [first, last]}}), got {span!r}")


def _validate_revisions(revs, where: str) -> None:
    if not isinstance(revs, dict) or not isinstance(revs.get("verified"), list) or not revs["verified"]:
        raise CaseError(where, "must be {\"verified\": [upstream commit ids, ...], \"introduced\": id|null, "
                        "\"fixed\": id|null} (the revisions the entry is known to hold at)")
    for key in ("introduced", "fixed"):
        if revs.get(key) is not None and not _HEX.fullmatch(str(revs[key])):
            raise CaseError(f"{where}.{key}", f"must be a hex commit id or null, got {revs[key]!r}")
    for i, rev in enumerate(revs["verified"]):
        if not _HEX.fullmatch(str(rev)):
            raise CaseError(f"{where}.verified[{i}]", f"must be a hex commit id, got {rev!r}")
        if revs.get("fixed") and _same(rev, revs["fixed"]):
            raise CaseError(f"{where}.verified[{i}]", "is the commit that fixed it")


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


def matches_case(entry: dict, feats: dict, provider: str, arch: str) -> bool:
    """Whether ``entry`` is about this case: its provider, architecture and features (not yet its revision)."""
    if not _listed(provider, entry["providers"]) or not _listed(arch, entry["architectures"]):
        return False
    return all(key in feats and _listed(feats[key], want) for key, want in entry["match"].items())


def _same(a: str, b: str) -> bool:
    a, b = str(a).lower(), str(b).lower()
    return min(len(a), len(b)) >= 7 and (a.startswith(b) or b.startswith(a))


def revision_id(revision: str) -> Optional[str]:
    """The hex commit id of a revision string: the string itself when it is one (``d48bd6be0a``, a 40-hex sha), or
    the id that ends a snapshot's name (``snapshot megatron-lm-dev-<id>``); None for anything else — above all a
    tree that is no git checkout (``checkout <path> (not a git work tree)``), whose path may hold hex by chance
    (``…/megatron-d48bd6be0a-with-my-patch``: found by review, every entry held there)."""
    text = str(revision).strip().lower()
    if _HEX.fullmatch(text):
        return text
    snapshot = re.fullmatch(r"snapshot \S*-([0-9a-f]{7,40})", text)
    return snapshot.group(1) if snapshot else None


def holds_at(entry: dict, revision: str, is_ancestor: Optional[Callable[[str, str], Optional[bool]]] = None) -> bool:
    """Whether ``entry`` is registered at ``revision`` (see ``revisions`` in the module docstring)."""
    rev = revision_id(revision)
    if rev is None:
        return False
    revs = entry["revisions"]
    fixed, introduced = revs.get("fixed"), revs.get("introduced")
    if fixed and _same(rev, fixed):
        return False
    if any(_same(rev, v) for v in revs["verified"]) or (introduced and _same(rev, introduced)):
        return True
    if is_ancestor is None or not introduced:
        return False
    after = is_ancestor(introduced, rev)
    before_fix = True if not fixed else (is_ancestor(fixed, rev) is False)
    return bool(after) and before_fix


def matches(entry: dict, feats: dict, provider: str, arch: str, revision: str) -> bool:
    """:func:`matches_case` and :func:`holds_at`."""
    return matches_case(entry, feats, provider, arch) and holds_at(entry, revision)


# ---- crashes: the exception type and production's raising frame ------------------------------------------------------
def raised(exc: BaseException) -> dict:
    """What a crash matcher compares: the exception's class names (its MRO) and the raising frame, the innermost
    frame outside torch and site-packages (``file`` the full path, ``function``, ``line``). An exception that carries
    ``remote_raised`` (the code under test ran in another process, e.g. a context-parallel rank) gives that
    process's exception and frame instead."""
    remote = getattr(exc, "remote_raised", None)
    if isinstance(remote, dict) and remote.get("type"):
        return dict(remote)
    frame = None
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/site-packages/" not in f.filename and "/torch/" not in f.filename:
            frame = f
            break
    out = {"type": type(exc).__name__, "types": [k.__name__ for k in type(exc).__mro__]}
    if frame is not None:
        out.update(file=frame.filename, function=frame.name, line=frame.lineno)
    return out


def _lines(want: dict, revision: str) -> Optional[list]:
    """The registered line range of a crash at ``revision`` (``lines``: one ``[first, last]`` for every registered
    revision, or ``{revision: [first, last]}``; None where none is registered)."""
    lines = want["lines"]
    if not isinstance(lines, dict):
        return lines
    rev = revision_id(revision)
    return next((span for key, span in lines.items() if rev and _same(rev, key)), None)


def raises_match(entry: dict, crash: Optional[dict], revision: str = "") -> bool:
    """Whether ``crash`` (:func:`raised`) is the entry's: the exception type (or a subclass) and the raising frame's
    file (path suffix), function and line range at ``revision``."""
    want = entry["expect"].get("raises")
    if not want or not crash or "file" not in crash:
        return False
    span = _lines(want, revision)
    if span is None:
        return False
    path = "/" + str(crash["file"]).replace("\\", "/").lstrip("/")
    first, last = span
    return (want["type"] in crash.get("types", [crash.get("type")]) and path.endswith("/" + want["file"].lstrip("/"))
            and crash["function"] == want["function"] and first <= int(crash["line"]) <= last)


def _frame(crash: Optional[dict]) -> str:
    if not crash or "file" not in crash:
        return "no frame"
    short = "/".join(str(crash["file"]).split("/")[-2:])
    return f"{crash['type']} in {crash['function']} at {short}:{crash['line']}"


# ---- models: judging a case against an entry's deviant expectation --------------------------------------------------
def _rel_l2(a: Optional[torch.Tensor], r: Optional[torch.Tensor]) -> Optional[float]:
    """``||a - r|| / ||r||`` over the finite entries of ``r`` (float64); 0 when both are absent or all zero."""
    if a is None and r is None:
        return 0.0
    if a is None or r is None:
        present = a if a is not None else r
        if not present.is_floating_point():
            return None
        return 0.0 if not bool((present != 0).any()) else math.inf
    if not (a.is_floating_point() and r.is_floating_point()) or a.shape != r.shape:
        return None
    a64, r64 = a.detach().double().cpu(), r.detach().double().cpu()
    keep = torch.isfinite(r64)
    diff = torch.where(keep, a64 - r64, 0.0)
    if not bool(torch.isfinite(diff).all()):
        return math.inf
    num, den = float(diff.norm()), float(torch.where(keep, r64, 0.0).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _contract_distance(runs, expect) -> Optional[float]:
    """The padding-dO-only run's distance to an expectation: ``||a - r|| / ||r||`` over every gradient together
    (``r`` the model's; the contract's is 0, so the norm is the model's when that is the contract's)."""
    impl = runs.contract
    if impl is None:
        return None
    truth = expect.contract[0] if expect.contract is not None else None
    num = den = 0.0
    for name in dict.fromkeys([n for n in impl.names if n.startswith("grad/")] +
                              (truth.names if truth is not None else [])):
        a = impl[name]
        r = truth[name] if truth is not None else None
        a64 = a.detach().double().cpu() if a is not None else None
        r64 = r.detach().double().cpu() if r is not None else None
        if a64 is not None:
            num += float(((a64 - r64) if r64 is not None else a64).pow(2).sum())
        elif r64 is not None:
            num += float(r64.pow(2).sum())
        if r64 is not None:
            den += float(r64.pow(2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else (0.0 if num == 0 else math.inf)


def _distance(runs, expect, name: str) -> Optional[float]:
    if name == CONTRACT:
        return _contract_distance(runs, expect)
    return _rel_l2(runs.impl[name], expect.truth[name])


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else ("inf" if math.isinf(x) or x >= FLOAT_MAX else f"{x:.3g}")


class _Judged:
    """One judgement of the case against the composed models of ``entries``."""

    def __init__(self, runs, ctx, base, entries: list[dict]):
        self.entries = entries
        self.expect = known_models.expectation(base, [e["expect"]["model"] for e in entries], ctx)
        self.tensors, _, self.outcome, self.decided_by, self.first, self.message = runs.judge(self.expect)

    @property
    def failed(self) -> list[str]:
        return [t.name for t in self.tensors if t.failed]


def _judgements(runs, entries: list[dict]) -> tuple[list[_Judged], object]:
    ctx = known_models.ModelContext(runs.case, runs.tensors, runs.reference,
                                       cp_layout=getattr(runs, "cp_layout", None))
    base = known_models.Expectation.of_contract(runs.truth, runs.noise)
    out = []
    for size in range(len(entries), 0, -1):
        for subset in itertools.combinations(entries, size):
            out.append(_Judged(runs, ctx, base, list(subset)))
    return out, base


def _distances(runs, base, judged: _Judged, contract_failed: list[str]) -> dict:
    """``{tensor: {"contract": d, "model": d}}`` for every tensor failing either judgement (strict JSON: an infinite
    distance is the largest double, as in the results stream)."""
    names = list(dict.fromkeys(contract_failed + judged.failed))
    return {n: {"contract": _json(_distance(runs, base, n)), "model": _json(_distance(runs, judged.expect, n))}
            for n in names}


def _json(x: Optional[float]) -> Optional[float]:
    return None if x is None or math.isnan(x) else (FLOAT_MAX if math.isinf(x) else x)


def _ident(entries: list[dict]) -> str:
    return "+".join(e["id"] for e in entries)


def _record(entries: list[dict], status: str, **extra) -> dict:
    return {"id": _ident(entries), "status": status, "upstream": "; ".join(e["upstream"] for e in entries), **extra}


def _apply_models(result, entries: list[dict], runs) -> None:
    contract_failed = [t.name for t in result.tensors if t.failed]
    judged, base = _judgements(runs, entries[:MAX_COMBINED])
    passing = [j for j in judged if j.outcome == "pass"]
    if passing:  # the largest combination of matching entries whose model the implementation matches
        best = passing[0]
        result.known = _record(best.entries, "reproduced", was=result.outcome, message=result.message,
                               models=list(best.expect.models),
                               distances=_distances(runs, base, best, contract_failed))
        result.outcome, result.decided_by = "known", "known"
        result.message = f"known deviation {_ident(best.entries)} (matches its model): {result.message}"
        return
    best = min(judged, key=lambda j: (len(j.failed), -len(j.entries)))
    dist = _distances(runs, base, best, contract_failed)
    first = (best.first or {}).get("tensor") or (best.failed[0] if best.failed else None)
    where = ""
    if first in dist:
        where = (f"{first} {_metric(first)} {_fmt(dist[first]['model'])} from the model, "
                 f"{_fmt(dist[first]['contract'])} from the contract; ")
    result.known = _record(best.entries, "exceeded", was=result.outcome, message=result.message,
                           models=list(best.expect.models), distances=dist)
    result.decided_by, result.first_failure = best.decided_by, best.first
    result.message = (f"differs from the contract and from the model of known deviation {_ident(best.entries)}: "
                      f"{where}{best.message}")


def _metric(name: str) -> str:
    return "rel. distance" if name == CONTRACT else "rel_l2"


def _flag_fixed(result, entries: list[dict], runs) -> None:
    """A passing case: the entries whose model the implementation no longer matches are flagged ``fixed?``."""
    if runs is None:
        return
    ctx = known_models.ModelContext(runs.case, runs.tensors, runs.reference,
                                       cp_layout=getattr(runs, "cp_layout", None))
    base = known_models.Expectation.of_contract(runs.truth, runs.noise)
    gone = [e for e in entries if _Judged(runs, ctx, base, [e]).outcome != "pass"]
    _fixed(result, gone)


def _fixed(result, entries: list[dict]) -> None:
    if not entries:
        return
    ident = _ident(entries)
    result.known = _record(entries, "fixed?")
    result.message = f"known deviation {ident} did not reproduce (fixed upstream? update the registry)"


# ---- the outcome ----------------------------------------------------------------------------------------------------
def apply(result, entries: Iterable[dict], provider: str, arch: str, revision: str, runs=None,
          raised: Optional[dict] = None,
          is_ancestor: Optional[Callable[[str, str], Optional[bool]]] = None) -> None:
    """Set ``result.outcome`` / ``result.known`` / ``result.message`` per the module docstring (in place).

    ``runs``: the engine's :class:`parity.engine.CaseRuns` of the case (``judge(expectation)``, ``reference(...)``;
    None when the case never got to a comparison); ``raised``: :func:`raised` of the implementation's exception for
    an ``error``. Several entries explaining one case together give the id ``a+b``."""
    feats = case_features(result.case)
    about = [e for e in entries if matches_case(e, feats, provider, arch)]
    if not about:
        return
    here = [e for e in about if holds_at(e, revision, is_ancestor)]
    elsewhere = [e for e in about if e not in here]
    crashes = [e for e in here if "raises" in e["expect"]]
    models = [e for e in here if "model" in e["expect"]]
    crashed = result.outcome == "error" or (result.outcome == "fail" and result.decided_by == "raised")
    if crashed:  # an exception: the harness's error, or production raising in its own code (rule ``raised``)
        hit = next((e for e in crashes if raises_match(e, raised, revision)), None)
        if hit is not None:
            result.known = _record([hit], "reproduced", was=result.outcome, message=result.message, raised=raised)
            result.outcome, result.decided_by = "known", "known"
            result.message = f"known deviation {hit['id']} (its exception and raising frame): {result.message}"
        elif crashes:
            want = "; ".join(f"{e['id']}: {e['expect']['raises']['type']} in {e['expect']['raises']['function']} "
                             f"at {e['expect']['raises']['file'].split('/')[-1]}:"
                             f"{_lines(e['expect']['raises'], revision)}" for e in crashes)
            result.message += f" [not the registered crash ({_frame(raised)}; registered: {want})]"
    elif result.outcome == "fail" and models and runs is not None:
        _apply_models(result, models, runs)
    elif result.outcome == "pass" and (crashes or models):
        _fixed(result, crashes)
        if result.known is None:
            _flag_fixed(result, models, runs)
    if elsewhere and result.outcome in ("fail", "error"):
        result.message += (f" [known deviation {_ident(elsewhere)} matches this case but is not registered at "
                           f"revision {revision or 'unknown'}]")


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
    """``reproduced`` / ``exceeded`` / ``fixed?`` / None of a case row."""
    known = row.get("known") or {}
    return known.get("status")


__all__ = ["apply", "architecture", "case_features", "holds_at", "matches", "matches_case", "raised",
           "raises_match", "registry_for", "revision_id", "status_of", "validate"]
