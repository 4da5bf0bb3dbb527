"""The tolerance policy file (parity/policy.json) and its loader."""

import json

import pytest

from cases.errors import CaseError
from parity import policy


def test_every_class_and_dtype_has_an_entry_with_its_measured_worst_case():
    pol = policy.load()
    for cls in policy.TOLERANCED_CLASSES:
        for dtype in ("float64", "float32", "bfloat16"):
            tol = pol.tolerance(cls, dtype, "torch")
            assert tol.noise_floor_ratio > 0 and tol.ulps >= 0
            assert tol.measured, f"{cls}/{dtype} does not record what it was set from"


def test_provider_falls_back_to_star_and_specific_entries_win(tmp_path):
    data = json.loads(policy.POLICY_PATH.read_text())
    entry = dict(data["classes"]["out"]["bfloat16"]["*"], noise_floor_ratio=9.0)
    data["classes"]["out"]["bfloat16"]["cudnn"] = entry
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    pol = policy.load(path)
    assert pol.tolerance("out", "bfloat16", "cudnn").noise_floor_ratio == 9.0
    assert pol.tolerance("out", "bfloat16", "torch").noise_floor_ratio != 9.0
    assert pol.tolerance("out", "bfloat16", "cudnn").source == "out/bfloat16/cudnn"


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["classes"]["out"]["float64"]["*"].pop("ulps"), "policy.classes.out.float64.*.ulps"),
    (lambda d: d["classes"]["lse"]["bfloat16"]["*"].update(cosine_eps=-1), "policy.classes.lse.bfloat16.*.cosine_eps"),
    (lambda d: d["classes"]["loss"]["float32"]["*"].pop("measured"), "policy.classes.loss.float32.*.measured"),
    (lambda d: d["classes"].update(bogus={}), "policy.classes.bogus"),
    (lambda d: d["classes"].pop("topk"), "policy.classes.topk"),
])
def test_malformed_policy_names_the_field(tmp_path, mutate, field):
    data = json.loads(policy.POLICY_PATH.read_text())
    mutate(data)
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CaseError) as err:
        policy.load(path)
    assert err.value.field == field


def test_unreadable_policy(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(CaseError, match="not valid JSON"):
        policy.load(bad)
    with pytest.raises(CaseError, match="not found"):
        policy.load(tmp_path / "missing.json")
