"""Metamorphic oracles: each holds for the reference and the fused path, and each catches its planted bug."""

import pytest

from parity import impls
from cli.main import main
from parity.engine import RunOptions
from parity.oracles.metamorphic import ORACLES, applicable, run_oracle
from tests.parity.helpers import pick

# (oracle, case features, fake that breaks the property)
CASES = [
    ("thd-pack", dict(layout="thd", loss="sparse", sequences="2-3", scope="layer"), "reference_global_row_term"),
    ("padding-poison", dict(layout="thd", alignment_padding=True, loss="sparse", scope="layer"),
     "reference_pad_value_leak"),
    ("unpadded", dict(layout="thd", alignment_padding=True, scope="layer", ratio="4"), "reference_pad_value_leak"),
    ("capacity", dict(layout="thd", ratio="4", capacity="production"), "reference_capacity_dependent"),
    ("identical-segments", dict(layout="thd", identical_segments=True, ratio="4"), "reference_global_row_term"),
    ("determinism", dict(layout="thd", ratio="4", loss="sparse"), "reference_nondeterministic"),
]


def check(oracle, impl, case):
    return run_oracle(oracle, case, impls.load(impl), RunOptions(impl=impl))


@pytest.mark.parametrize("oracle, features, fake", CASES, ids=[c[0] for c in CASES])
def test_oracle_holds_for_reference_and_fused_and_catches_its_planted_bug(oracle, features, fake):
    case = pick(**features)
    assert applicable(oracle, case)
    for impl in ("reference", "fused"):
        result = check(oracle, impl, case)
        assert result.outcome == "pass", (impl, result.message)
        assert result.tensors and all(t.verdict == "pass" for t in result.tensors)
    broken = check(oracle, f"tests.parity.fakes:{fake}", case)
    assert broken.outcome == "fail", broken.message
    assert broken.first_failure["tensor"].split(":")[-1] == "out"


@pytest.mark.parametrize("oracle", ["padding-poison", "unpadded"])
def test_fused_core_scope_survives_poisoned_padding(oracle):
    case = pick(layout="thd", alignment_padding=True, scope="core", dtype="float32")
    assert check(oracle, "reference", case).outcome == "pass"
    result = check(oracle, "fused", case)
    assert result.outcome == "pass", result.message


def test_oracles_decline_cases_they_do_not_apply_to():
    bshd = pick(layout="bshd", ratio="0", dtype="float32")
    for name in ("thd-pack", "padding-poison", "padding-dout", "unpadded", "capacity", "identical-segments"):
        assert not applicable(name, bshd)
        assert check(name, "reference", bshd).outcome == "unsupported"
    assert applicable("determinism", bshd)
    # test_graph_replay.py, test_padding_dout.py, and cp below (production's CP: tests/adapters/test_megatron_cp.py)
    assert set(ORACLES) == {c[0] for c in CASES} | {"graph-replay", "padding-dout", "cp"}


def test_the_cp_oracle_needs_context_parallelism_and_catches_a_rank_offset_term():
    case = pick(layout="thd", ratio="4", loss="sparse", scope="layer", dtype="float32")
    assert check("cp", "reference", case).outcome == "unsupported"  # no use_context_parallel hook
    exact = check("cp", "tests.parity.fakes:reference_cp_exact", case)
    assert exact.outcome == "pass", exact.message
    assert {t.rule for t in exact.tensors} >= {"noise", "exact"}  # floats by the noise floor, the top-k exactly
    broken = check("cp", "tests.parity.fakes:reference_cp_rank_term", case)
    assert broken.outcome == "fail" and broken.first_failure["tensor"] == "cp2:out", broken.message
    assert not applicable("cp", pick(layout="bshd", ratio="0", dtype="float32"))


def test_oracle_from_the_cli(tmp_path, capsys):
    case = pick(layout="thd", ratio="0", dtype="float32")
    code = main(["run", "--suite", "smoke", "--case-id", case.id, "--oracle", "thd-pack", "--impl", "reference",
                 "--out", str(tmp_path / "o"), "--quiet"])
    assert code == 0 and "1 cases: 1 passed" in capsys.readouterr().out
    assert main(["metamorphic", "--list"]) == 0
    assert "thd-pack" in capsys.readouterr().out
    assert main(["run", "--oracle", "nosuch", "--impl", "reference", "--out", str(tmp_path / "x")]) == 2
