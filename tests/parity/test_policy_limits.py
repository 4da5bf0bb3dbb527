"""Limits that cannot go vacuous (issue 17): rule 3's similarity floor never drops below the policy's fixed minimum
(``1 - similarity_cap``) however poor the same-dtype noise run (the old adaptive floor ``1 - f² (1 - sim_noise)``
accepted a cosine of -0.49); the ``sign_split`` section is validated."""

import dataclasses
import json

import pytest
import torch

from cases.errors import CaseError
from parity import policy as P
from parity.judge.verdict import judge_numeric


def _tensors():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(4096, generator=g, dtype=torch.float64)
    p = r + 1.2 * torch.randn(4096, generator=g, dtype=torch.float64)   # a noise run with 1 - cos ~ 0.4
    a = -0.49 * r + 0.87 * torch.randn(4096, generator=g, dtype=torch.float64)  # cosine ~ -0.49
    return a, r, p


def _tol(**changes):
    tol = P.load().tolerance("grad_indexer", "bfloat16", "torch")
    base = dict(noise_floor_ratio=1e9, rmse_ratio=1e9, scale_ratio=1e9)
    return dataclasses.replace(tol, **{**base, **changes})


def test_capped_similarity_floor_rejects_a_negative_cosine():
    a, r, p = _tensors()
    verdict, rule, rows, _ = judge_numeric("g", "grad_indexer", a, r, p, torch.bfloat16, _tol(), 64)
    assert verdict == "fail" and rule == "similarity"
    cos = next(row for row in rows if row.metric == "cosine")
    assert cos.threshold == pytest.approx(1 - P.load().tolerance("grad_indexer", "bfloat16").similarity_cap)


def test_without_the_cap_the_adaptive_floor_is_vacuous():
    """Negative control: with the cap lifted, the same tensors pass rule 3 (the defect the cap removes)."""
    a, r, p = _tensors()
    verdict, _, rows, _ = judge_numeric("g", "grad_indexer", a, r, p, torch.bfloat16,
                                        _tol(noise_floor_ratio=24.0, similarity_cap=float("inf")), 64)
    cos = next(row for row in rows if row.metric == "cosine")
    assert cos.threshold < -0.49 and cos.passed


def test_every_policy_entry_caps_the_similarity_below_1():
    pol = P.load()
    for cls, by_dtype in pol.data["classes"].items():
        for dtype in by_dtype:
            assert pol.tolerance(cls, dtype).similarity_cap < 1


def test_a_cap_of_1_is_refused(tmp_path):
    data = json.loads(P.POLICY_PATH.read_text())
    data["classes"]["grad_indexer"]["bfloat16"]["*"]["similarity_cap"] = 1.0
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CaseError) as err:
        P.load(path)
    assert err.value.field == "policy.classes.grad_indexer.bfloat16.*.similarity_cap"


def test_a_malformed_sign_split_section_names_the_field(tmp_path):
    data = json.loads(P.POLICY_PATH.read_text())
    data["sign_split"]["window"] = 8
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CaseError) as err:
        P.load(path)
    assert err.value.field == "policy.sign_split.window"
