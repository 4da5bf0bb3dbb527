"""JUnit XML for CI, written from ``results.jsonl`` (one ``testcase`` per case).

``fail`` → ``<failure>``, ``error`` → ``<error>``, ``unsupported`` → ``<skipped>``, ``known`` (a registered known
deviation, an expected failure) → ``<skipped message="known deviation: <id>">``; the message is the first failure
and the body holds the repro command, so a CI page shows how to re-run exactly that case.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from cases.vocabulary import OUTCOMES

from parity.run.stream import read_rows


def _label(case: dict) -> str:
    config, layout = case.get("config", {}), case.get("layout", {})
    return (f"{layout.get('kind', '?')}.r{config.get('compress_ratio', '?')}.{case.get('scope', '?')}."
            f"{case.get('dtype', '?')}")


def write_junit(results: Path, target: Path) -> Path:
    everything = read_rows(results)
    rows = [row for row in everything if row.get("type") == "case"]
    run = next((row for row in everything if row.get("type") == "run"), {})
    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    suite = ET.Element("testsuite", name=f"dsv4-parity.{run.get('suite', 'run')}", tests=str(len(rows)),
                       failures=str(counts["fail"]), errors=str(counts["error"]),
                       skipped=str(counts["unsupported"] + counts["known"]),
                       time=f"{sum(float(r.get('duration_s') or 0) for r in rows):.3f}")
    props = ET.SubElement(suite, "properties")
    for key in ("run_id", "impl", "against", "provider"):
        ET.SubElement(props, "property", name=key, value=str(run.get(key, "")))
    for row in rows:
        tc = ET.SubElement(suite, "testcase", classname=f"dsv4_parity.{_label(row.get('case', {}))}",
                           name=row["case_id"], time=f"{float(row.get('duration_s') or 0):.3f}")
        body = f"{row.get('message', '')}\nrepro: {row.get('repro', '')}"
        if row["outcome"] == "fail":
            ET.SubElement(tc, "failure", message=row.get("message", ""), type=row.get("decided_by", "")).text = body
        elif row["outcome"] == "error":
            ET.SubElement(tc, "error", message=row.get("message", ""), type="error").text = body
        elif row["outcome"] == "unsupported":
            ET.SubElement(tc, "skipped", message=row.get("message", ""))
        elif row["outcome"] == "known":
            known = row.get("known") or {}
            ET.SubElement(tc, "skipped", message=f"known deviation: {known.get('id', '?')}",
                          type="xfail").text = body
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(target, encoding="utf-8", xml_declaration=True)
    return target
