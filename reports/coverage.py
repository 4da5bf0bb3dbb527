"""The suite's coverage matrix, from the ``features`` dict of each ``case`` row.

For every feature key, every value seen, the number of cases per outcome. A boolean feature whose ``true`` (or
``false``) side no case reached is listed with zero cases and flagged as a gap: that is the cell a suite misses.
Non-scalar values (lists, objects) are shown as compact JSON.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from cases.vocabulary import OUTCOMES


def cell(value: Any) -> str:
    """The display / grouping label of a feature value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _sort_key(value: Any) -> tuple:
    if isinstance(value, bool):
        return (0, int(value), "")
    if isinstance(value, (int, float)):
        return (1, float(value), "")
    try:  # numbers recorded as strings ("4", "128") still sort numerically
        return (1, float(value), "")
    except (TypeError, ValueError):
        return (2, 0.0, cell(value))


def coverage(cases: pd.DataFrame) -> list[dict[str, Any]]:
    """``[{feature, values: [{value, label, total, pass, fail, error, unsupported, gap}], kind}]``, features sorted."""
    seen: dict[str, dict[str, dict[str, Any]]] = {}
    for features, outcome in zip(cases["features"], cases["outcome"]):
        for key, value in (features or {}).items():
            label = cell(value)
            entry = seen.setdefault(key, {}).setdefault(label, {"value": value, "label": label, "total": 0,
                                                               **{o: 0 for o in OUTCOMES}, "gap": False})
            entry["total"] += 1
            entry[outcome] += 1
    groups = []
    for key in sorted(seen):
        values = seen[key]
        booleans = all(isinstance(v["value"], bool) for v in values.values())
        if booleans:
            for flag in (False, True):
                label = cell(flag)
                values.setdefault(label, {"value": flag, "label": label, "total": 0, **{o: 0 for o in OUTCOMES},
                                          "gap": True})
        ordered = sorted(values.values(), key=lambda v: _sort_key(v["value"]))
        groups.append({"feature": key, "kind": "bool" if booleans else "value", "values": ordered})
    return groups


def gaps(groups: list[dict[str, Any]]) -> list[str]:
    """``feature=value`` cells no case covers."""
    return [f"{g['feature']}={v['label']}" for g in groups for v in g["values"] if v["gap"]]
