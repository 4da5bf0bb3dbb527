"""``python -m parity.seed_sweep``: a small sample of the 1,000-case false-failure sweep (README "Tolerance policy")."""

import json

from parity import policy as P
from parity import seed_sweep


def test_sweep_cases_reseed_the_shapes_with_indexer_gradients():
    cases = seed_sweep.sweep_cases("smoke", "bfloat16", 9)
    assert len(cases) == 9 and len({c.seed for c in cases}) == 9
    assert all(seed_sweep.trains_indexer(c) and c.dtype == "bfloat16" for c in cases)
    shapes = {c.replace(seed=0).id for c in cases}
    assert 1 < len(shapes) <= 9


def test_a_small_sample_passes_clean(tmp_path, capsys):
    assert seed_sweep.main(["--cases", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out and "grad_indexer:" in out
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sum(r["type"] == "case" for r in rows) == 2


def test_the_sweep_fails_under_a_policy_too_strict(tmp_path, capsys):
    """Negative control: the same sample under a grad_indexer noise-floor ratio of 0.01 fails (exit 1)."""
    data = json.loads(P.POLICY_PATH.read_text())
    data["classes"]["grad_indexer"]["bfloat16"]["*"]["noise_floor_ratio"] = 0.01
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(data))
    assert seed_sweep.main(["--cases", "2", "--out", str(tmp_path / "run"), "--policy", str(policy)]) == 1
    assert "fail: " in capsys.readouterr().out
