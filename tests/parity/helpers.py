"""Pick suite cases by their coverage features (ids change when a suite is regenerated; features do not)."""

from __future__ import annotations

from cases.coverage import features
from cases.suites import load_suite


def rows(case) -> int:
    lay = case.layout
    return lay.total_tokens if case.is_thd else lay.batch * lay.seq_len


def pick(suite: str = "smoke", *, exclude=(), **want):
    """The smallest case of ``suite`` whose features include ``want`` (booleans or strings)."""
    hits = []
    for case in load_suite(suite):
        f = features(case)
        if case.id in exclude:
            continue
        if all(str(f.get(k)) == str(v) if not isinstance(v, bool) else f.get(k) is v for k, v in want.items()):
            hits.append(case)
    assert hits, f"no {suite} case has {want}"
    return min(hits, key=rows)
