"""The tolerance policy: one JSON file (``parity/policy.json``) for every numeric threshold of the verdict.

Layout::

    {"scalar_numel": 64,                      # tensors this small use the per-element ULP floor (sink grad, loss)
     "classes": {CLASS: {DTYPE: {PROVIDER: ENTRY}}},   # "*" is the fallback at the dtype and provider levels
     "topk": {DTYPE or "*": {"margin_factor": 1.0,    # score noise δ = margin_factor · (observed noise + floor)
                             "ulps": 4}},              # ULP floor of the score noise (parity/judge/topk.py)
     "metamorphic": {DTYPE: {"ulps": 64}},     # the ``ulp`` rule of the oracles (parity/oracles/metamorphic.py)
     "kernels": {"rules": {RULE: {"mixed": 1e-4, "rel_l2": ..., "cosine": ..., "exact": true, "measured": {...}}},
                 "capture": {"rel_l2": 1e-3, "measured": {...}},        # kernel-level checks (parity/judge/kernel_rules.py)
                 "graph_replay": {"rel_l2": 2e-2, "measured": {...}}},  # the graph-replay oracle
     "sign_split": {"window_ulps": 8,          # the indexer ReLU's ambiguity window (parity/judge/sign_split.py)
                    "max_elements": 268435456}}  # largest activation pattern observed (rows × heads × ids)

``CLASS`` is a tensor class (``out lse index_scores topk loss grad_input grad_param grad_indexer``), ``DTYPE`` the case dtype,
``PROVIDER`` the fused kernel provider (``torch``, ``cudnn``, ...). An ``ENTRY`` holds the thresholds of the layered
verdict (:mod:`parity.judge.verdict`) and the measured worst case each was set from::

    {"noise_floor_ratio": 3.0,   # rule 2: max|a - r| / (max|p - r| + ulps·eps·max|r|) <= this
     "ulps": 2,                  # the ULP floor of rules 2 and 4, in units of the *case* dtype's epsilon
     "scalar_ulps": 8,           # optional (0): per-element ULPs added for tiny tensors (sink gradient, loss)
     "atol": 1e-30,              # optional (0): absolute floor, absorbs underflow noise where the reference is 0
     "cosine_eps": 1e-3,         # rule 3: 1 - cosine <= max(this, noise_floor_ratio² · (1 - cosine of the noise run))
     "tensor_sim_eps": 1e-3,     # rule 3: likewise for tensor_sim
     "rmse_ratio": 3.0,          # rule 4: rmse(a - r) / (rmse(p - r) + floor) <= this
     "scale_ratio": 3.0,         # rule 4: |‖a‖/‖r‖ - 1| / (same of p + scale_floor · eps) <= this
     "scale_floor": 0.25,        # optional (default 0.25): systematic bias tolerated for free, in eps
     "similarity_cap": 0.1,      # optional (default 0.1): rule 3 never allows 1 - cosine / 1 - tensor_sim above
                                 #   this, however poor the noise run (the similarity floor's fixed minimum)
     "measured": {"noise_floor_ratio": 1.2, "cosine_eps": 2e-5, ..., "from": "smoke fused@<run> (47 cases), ..."}}

``dsv4-parity calibrate`` refreshes the ``measured`` blocks from result files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from cases.errors import CaseError
from cases.vocabulary import TOLERANCED_CLASSES

POLICY_PATH = Path(__file__).with_name("policy.json")
THRESHOLD_KEYS = ("noise_floor_ratio", "ulps", "cosine_eps", "tensor_sim_eps", "rmse_ratio", "scale_ratio")
OPTIONAL_KEYS = {"scalar_ulps": 0.0, "scale_floor": 0.25, "atol": 0.0, "similarity_cap": 0.1}


@dataclass(frozen=True)
class Tolerance:
    """The thresholds for one (tensor class, dtype, provider)."""

    noise_floor_ratio: float
    ulps: float
    cosine_eps: float
    tensor_sim_eps: float
    rmse_ratio: float
    scale_ratio: float
    scalar_ulps: float = 0.0
    scale_floor: float = 0.25
    atol: float = 0.0
    similarity_cap: float = 0.1
    measured: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""  # "class/dtype/provider" of the entry used


@dataclass(frozen=True)
class Policy:
    data: Mapping[str, Any]
    path: str = ""

    @property
    def scalar_numel(self) -> int:
        return int(self.data.get("scalar_numel", 64))

    def tolerance(self, tensor_class: str, dtype: str, provider: str = "*") -> Tolerance:
        """The entry for ``tensor_class`` × ``dtype`` × ``provider``, falling back to ``"*"`` per level."""
        classes = self.data["classes"]
        if tensor_class not in classes:
            raise KeyError(f"policy has no tensor class {tensor_class!r}")
        by_dtype = classes[tensor_class]
        dkey = dtype if dtype in by_dtype else "*"
        if dkey not in by_dtype:
            raise KeyError(f"policy has no entry for {tensor_class}/{dtype}")
        by_provider = by_dtype[dkey]
        pkey = provider if provider in by_provider else "*"
        entry = by_provider[pkey]
        values = {k: float(entry[k]) for k in THRESHOLD_KEYS}
        for key, default in OPTIONAL_KEYS.items():
            values[key] = float(entry.get(key, default))
        return Tolerance(**values, measured=entry.get("measured", {}), source=f"{tensor_class}/{dkey}/{pkey}")

    def section(self, name: str) -> Mapping[str, Any]:
        return self.data.get(name, {})

    def topk(self, dtype: str) -> Mapping[str, float]:
        """Top-k protocol knobs: ``margin_factor`` (clear iff margin > factor · score noise) for ``dtype``."""
        sec = self.section("topk")
        return {**sec.get("*", {}), **sec.get(dtype, {})}

    def metamorphic_ulps(self, dtype: str) -> float:
        sec = self.section("metamorphic")
        return float(sec.get(dtype, sec.get("*", {})).get("ulps", 64))

    def kernel_entry(self, name: str) -> Mapping[str, Any]:
        """``kernels.rules.<name>`` (a kernel-check rule), or ``kernels.capture`` / ``kernels.graph_replay``."""
        sec = self.section("kernels")
        entry = sec.get(name) if name in KERNEL_LIMITS else sec.get("rules", {}).get(name)
        if entry is None:
            where = f"kernels.{name}" if name in KERNEL_LIMITS else f"kernels.rules.{name}"
            raise CaseError(f"policy.{where}", f"missing in {self.path or 'the policy'}")
        return entry


KERNEL_BOUNDS = ("mixed", "rel_l2", "cosine")
KERNEL_LIMITS = ("capture", "graph_replay")


def _check_bound(value: Any, at: str, upper: Optional[float] = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (upper and value > upper):
        raise CaseError(at, f"must be a number in [0, {upper or 'inf'}], got {value!r}")


def validate_kernels(section: Any, where: str = "policy.kernels") -> None:
    """Raise :class:`CaseError` naming the first malformed field of the ``kernels`` section."""
    if not isinstance(section, Mapping) or not isinstance(section.get("rules"), Mapping):
        raise CaseError(f"{where}.rules", "missing or not an object")
    for name, rule in section["rules"].items():
        at = f"{where}.rules.{name}"
        if not isinstance(rule, Mapping):
            raise CaseError(at, "not an object")
        unknown = set(rule) - set(KERNEL_BOUNDS) - {"exact", "measured", "why"}
        if unknown:
            raise CaseError(f"{at}.{sorted(unknown)[0]}", f"unknown field (known: exact, {', '.join(KERNEL_BOUNDS)})")
        for key in KERNEL_BOUNDS:
            if key in rule:
                _check_bound(rule[key], f"{at}.{key}", 1.0 if key == "cosine" else None)
        if "exact" in rule and not isinstance(rule["exact"], bool):
            raise CaseError(f"{at}.exact", f"must be true or false, got {rule['exact']!r}")
        if not rule.get("exact") and not any(key in rule for key in KERNEL_BOUNDS):
            raise CaseError(at, "a rule needs at least one bound (exact, mixed, rel_l2, cosine): one without can "
                                "never fail")
        if not isinstance(rule.get("measured"), Mapping):
            raise CaseError(f"{at}.measured", "every rule records the measured worst case it was set from")
    for name in KERNEL_LIMITS:
        entry = section.get(name)
        if not isinstance(entry, Mapping):
            raise CaseError(f"{where}.{name}", "missing or not an object")
        _check_bound(entry.get("rel_l2"), f"{where}.{name}.rel_l2")
        if not isinstance(entry.get("measured"), Mapping):
            raise CaseError(f"{where}.{name}.measured", "records the measured worst case it was set from")


def validate(data: Any, where: str = "policy") -> None:
    """Raise :class:`CaseError` naming the first malformed field."""
    if not isinstance(data, Mapping) or not isinstance(data.get("classes"), Mapping):
        raise CaseError(f"{where}.classes", "missing or not an object")
    for cls, by_dtype in data["classes"].items():
        if cls not in TOLERANCED_CLASSES:
            raise CaseError(f"{where}.classes.{cls}", f"unknown tensor class (known: {', '.join(TOLERANCED_CLASSES)})")
        for dtype, by_provider in by_dtype.items():
            for provider, entry in by_provider.items():
                at = f"{where}.classes.{cls}.{dtype}.{provider}"
                for key in THRESHOLD_KEYS + tuple(OPTIONAL_KEYS):
                    if key in OPTIONAL_KEYS and isinstance(entry, Mapping) and key not in entry:
                        continue
                    value = entry.get(key) if isinstance(entry, Mapping) else None
                    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                        raise CaseError(f"{at}.{key}", f"must be a non-negative number, got {value!r}")
                if entry.get("similarity_cap", 0.0) >= 1:
                    raise CaseError(f"{at}.similarity_cap", "must be below 1 (else a negative cosine can pass)")
                if not isinstance(entry.get("measured"), Mapping):
                    raise CaseError(f"{at}.measured", "every entry records the measured worst case it was set from")
    for key, value in (data.get("sign_split") or {}).items():
        if key not in ("window_ulps", "max_elements"):
            raise CaseError(f"{where}.sign_split.{key}", "unknown key (known: window_ulps, max_elements)")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise CaseError(f"{where}.sign_split.{key}", f"must be a non-negative number, got {value!r}")
    for cls in TOLERANCED_CLASSES:
        if cls not in data["classes"]:
            raise CaseError(f"{where}.classes.{cls}", "missing tensor class")
    if "kernels" in data:
        validate_kernels(data["kernels"], f"{where}.kernels")


def load(path: Union[str, Path, None] = None) -> Policy:
    path = Path(path) if path else POLICY_PATH
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CaseError("policy", f"file {path} not found") from None
    except json.JSONDecodeError as exc:
        raise CaseError("policy", f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    validate(data)
    return Policy(data, str(path))


_DEFAULT: Optional[Policy] = None


def default() -> Policy:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = load()
    return _DEFAULT
