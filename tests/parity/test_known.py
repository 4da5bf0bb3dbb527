"""Known deviations (parity/known.py): a registered failure becomes ``known``, an unregistered one stays a failure,
a registered case that passes is flagged ``fixed?``; JUnit shows ``known`` as an expected failure."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from cases.errors import CaseError
from cases.suites import load_suite
from parity import known
from parity.junit import write_junit
from parity.results import CaseResult, counts, summary_line
from parity.verdict import TensorResult

CASE = next(c for c in load_suite("smoke") if c.layout.kind == "thd" and c.scope == "core")


def entry(**over):
    base = {"id": "e1", "upstream": "x.py:1", "reason": "r", "evidence": "e", "providers": ["*"],
            "architectures": ["cpu"], "revisions": ["*"], "match": {"layout": "thd", "scope": "core"},
            "expect": {"tensors": ["grad/*"]}}
    base.update(over)
    return base


def failed(*names, outcome="fail", message="m"):
    tensors = [TensorResult(n, "grad_input", "float32", [1], "fail", "structure") for n in names]
    return CaseResult(case=CASE, outcome=outcome, decided_by="structure", message=message, tensors=tensors)


def test_a_registered_failure_is_known():
    r = failed("grad/query", "grad/kv")
    known.apply(r, [entry()], "unfused", "cpu", "rev")
    assert r.outcome == "known" and r.known["id"] == "e1" and r.known["was"] == "fail"


def test_an_unexplained_failure_stays_a_failure():
    """Negative control: a failing tensor outside the entry's patterns."""
    r = failed("grad/query", "out")
    known.apply(r, [entry()], "unfused", "cpu", "rev")
    assert r.outcome == "fail" and r.known is None


def test_two_matching_entries_explain_one_case_together():
    """Two independent deviations in one case: each failing tensor is explained by one entry, so the case is known
    under both ids. Negative controls: a tensor neither explains keeps it a failure; an entry that does not match
    the case cannot contribute."""
    loss = entry(id="loss", expect={"tensors": ["indexer_loss", "grad/core_attention.indexer.*"]})
    leak = entry(id="leak", expect={"tensors": ["contract/padding_dout"]})
    r = failed("indexer_loss", "grad/core_attention.indexer.linear_wq_b.weight", "contract/padding_dout")
    known.apply(r, [loss, leak], "unfused", "cpu", "rev")
    assert r.outcome == "known" and r.known["id"] == "loss+leak"
    r = failed("indexer_loss", "contract/padding_dout", "out")
    known.apply(r, [loss, leak], "unfused", "cpu", "rev")
    assert r.outcome == "fail"
    r = failed("indexer_loss", "contract/padding_dout")
    known.apply(r, [loss, entry(id="leak", providers=["emulated"], expect={"tensors": ["contract/*"]})],
                "unfused", "cpu", "rev")
    assert r.outcome == "fail"


def test_an_entry_of_another_provider_or_architecture_does_not_match():
    for kwargs in ({"providers": ["emulated"]}, {"architectures": ["sm90"]}, {"revisions": ["abc"]}):
        r = failed("grad/query")
        known.apply(r, [entry(**kwargs)], "unfused", "cpu", "rev")
        assert r.outcome == "fail"


def test_an_error_is_matched_by_its_message():
    r = failed(outcome="error", message="megatron run: RuntimeError: expected scalar type Float")
    known.apply(r, [entry(expect={"error": "expected scalar type"})], "unfused", "cpu", "rev")
    assert r.outcome == "known"
    r = failed(outcome="error", message="megatron run: KeyError: x")
    known.apply(r, [entry(expect={"error": "expected scalar type"})], "unfused", "cpu", "rev")
    assert r.outcome == "error"


def test_a_registered_case_that_passes_is_flagged_fixed():
    r = CaseResult(case=CASE, outcome="pass", decided_by="noise_floor")
    known.apply(r, [entry()], "unfused", "cpu", "rev")
    assert r.outcome == "pass" and r.known["status"] == "fixed?"


def test_a_malformed_registry_names_the_field():
    with pytest.raises(CaseError, match=r"entries\[0\]\.expect"):
        known.validate([entry(expect={})], "reg")
    with pytest.raises(CaseError, match="duplicate id"):
        known.validate([entry(), entry()], "reg")


def test_known_counts_and_junit(tmp_path):
    c = counts(["pass", "known", "fail"])
    assert c["known"] == 1 and "known" not in counts(["pass"])
    assert summary_line(c, 2).endswith("1 failed, 0 errors, 0 unsupported, 1 known, 2 fixed?")
    r = failed("grad/query")
    known.apply(r, [entry()], "unfused", "cpu", "rev")
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"type": "run", "suite": "smoke"}) + "\n" + json.dumps(r.case_row()) + "\n")
    suite = ET.parse(write_junit(path, tmp_path / "junit.xml")).getroot()
    skipped = suite.find("testcase/skipped")
    assert suite.get("skipped") == "1" and suite.get("failures") == "0"
    assert skipped is not None and skipped.get("message") == "known deviation: e1"


def test_kl_support_is_trivial_when_no_real_row_sees_two_compressed_keys():
    """Segments of fewer than 2r real tokens give every real row at most one compressed key: the indexer KL is
    identically 0 there, so loss deviations cannot show (``kl_support`` lets an entry say it needs support)."""
    cases = {c.id: c for c in load_suite("smoke")}
    trivial = known.case_features(cases["bcf15df26658"])  # THD segments of 7 real tokens, r = 4
    assert trivial["compressed_rows"] == "some" and trivial["kl_support"] == "trivial"
    assert known.case_features(cases["17768d41d2ee"])["kl_support"] == "some"  # a 16-token segment
    r0 = next(c for c in cases.values() if c.config.compress_ratio == 0)
    assert known.case_features(r0)["kl_support"] == "trivial"
