"""``dsv4-parity calibrate``: the measured worst case behind every tolerance of the policy.

Reads ``results.jsonl`` files of runs of a correct implementation, groups the gating metrics by
(tensor class, case dtype, provider key) and prints, per group, the worst value of each metric, its case, and a
suggested threshold (``margin`` × worst, never tighter than the current one would be pointless to suggest). With
``--write`` the worst values are recorded in the policy entries' ``measured`` blocks — the thresholds themselves are
edited by hand, so a tolerance change is always a reviewed diff.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from cases.errors import CaseError

from parity.impls import policy_provider
from parity.policy import POLICY_PATH, validate
from parity.run.stream import StreamError, read_stream

# metric -> how to take the worst: "max" of the value, or "min" (similarities)
GATED = {"noise_floor_ratio": "max", "rmse_ratio": "max", "scale_ratio": "max", "cosine": "min",
         "tensor_sim": "min", "tied_gap_ratio": "max"}


def _rows(path: Path) -> list[dict]:
    try:
        return read_stream(path)
    except StreamError as exc:
        raise CaseError("results", str(exc)) from None


def _worse(metric: str, value: float, than: float) -> bool:
    return value > than if GATED[metric] == "max" else value < than


def measure(paths: Sequence[Path], include_failures: bool = False) -> tuple[dict, dict]:
    """``({(class, dtype, provider): {metric: (worst, case_id)}}, {source: n_cases})`` over the passing cases
    (``include_failures``: also the failing ones — a failure is a finding to fix, not a tolerance to widen)."""
    worst: dict = defaultdict(dict)
    sources = {}
    for path in paths:
        cases, run = {}, {}
        for row in _rows(Path(path)):
            kind = row.get("type")
            if kind == "run":
                run = row
            elif kind == "case":
                if row.get("outcome") == "pass" or (include_failures and row.get("outcome") == "fail"):
                    case = row.get("case") if isinstance(row.get("case"), dict) else {}
                    cases[row.get("case_id")] = (str(case.get("dtype", "?")),
                                                 policy_provider(row.get("plan") or {}, run.get("provider", "torch")))
            elif kind == "metric" and row.get("metric") in GATED and row.get("case_id") in cases and \
                    isinstance(row.get("value"), (int, float)) and isinstance(row.get("tensor_class"), str):
                dtype, provider = cases[row["case_id"]]
                key = (row["tensor_class"], dtype, provider)
                value = float(row["value"])
                best = worst[key].get(row["metric"])
                if best is None or _worse(row["metric"], value, best[0]):
                    worst[key][row["metric"]] = (value, row["case_id"])
        sources[f"{run.get('suite', '?')} {run.get('impl', '?')}@{run.get('run_id', Path(path).name)}"] = len(cases)
    return dict(worst), sources


def calibrate(paths: Sequence[Path], *, write: bool = False, policy_path: Optional[str] = None,
              margin: float = 2.0, include_failures: bool = False) -> int:
    worst, sources = measure(paths, include_failures)
    if not worst:
        print("no metric rows found")
        return 1
    for (cls, dtype, provider), metrics in sorted(worst.items()):
        for metric, (value, case_id) in sorted(metrics.items()):
            if GATED[metric] == "min":
                suggestion = f"eps >= {margin * (1 - value):.3g}"
            else:
                suggestion = f"<= {margin * value:.3g}"
            print(f"{cls:<13} {dtype:<9} {provider:<6} {metric:<18} worst {value:.6g}  ({case_id})  "
                  f"suggest {suggestion}")
    if write:
        path = Path(policy_path) if policy_path else POLICY_PATH
        data = json.loads(path.read_text())
        stamp = _dt.date.today().isoformat()
        source = "; ".join(f"{k} ({n} cases)" for k, n in sources.items())
        merged: dict = {}  # id(entry) -> (entry, {metric: worst}); several groups may share a "*" entry
        for (cls, dtype, provider), metrics in worst.items():
            by_dtype = data["classes"].get(cls, {})
            entry = (by_dtype.get(dtype) or by_dtype.get("*") or {})
            entry = entry.get(provider) or entry.get("*")
            if entry is None:
                continue
            _, acc = merged.setdefault(id(entry), (entry, {}))
            for metric, (value, _case) in metrics.items():
                if math.isfinite(value) and (metric not in acc or _worse(metric, value, acc[metric])):
                    acc[metric] = value
        for entry, acc in merged.values():
            # similarities are recorded as the eps they used (1 - worst), under the threshold's name
            shown = {(f"{k}_eps" if GATED[k] == "min" else k): float(f"{(1 - v) if GATED[k] == 'min' else v:.4g}")
                     for k, v in acc.items()}
            entry["measured"] = {**dict(sorted(shown.items())), "from": f"{source}, {stamp}"}
        validate(data)
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"updated the measured blocks of {path}")
    return 0
