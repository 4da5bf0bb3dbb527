"""The kernel-level checks' decision on the CPU: the committed H200 kernel table replayed through the policy's
``kernels`` rules (same decision strength: every committed measurement still passes), each rule's teeth, the
``measured`` blocks, the policy validation, and the GPU script's own calls run with the torch provider on both
sides (every compared tensor has a rule; a wrong "kernel" fails)."""

import copy
import csv
import json

import pytest
import torch

from cases.errors import CaseError
from fused.kernels.torch_provider import TorchKernels
from parity import kernel_checks, policy as policy_mod
from parity.judge.kernel_rules import STAGE_RULES, KernelRule, judge_row, kernel_metrics, rule_for
from reports.baselines import BASELINES_ROOT

TABLE = BASELINES_ROOT / "h200" / "kernels" / "kernel_parity.csv"


def committed_rows():
    with TABLE.open() as fh:
        return [r for r in csv.DictReader(fh) if r["outcome"] in ("pass", "fail")]


def test_every_committed_h200_kernel_measurement_passes_the_policy_rules():
    rows = committed_rows()
    assert len(rows) == 64 and {r["stage"] for r in rows} == set(STAGE_RULES)
    verdicts = [(r["stage"], r["call"], r["tensor"], *judge_row(r)) for r in rows]
    assert [v for v in verdicts if not v[3]] == []
    assert all(r["outcome"] == "pass" for r in rows)  # the table's own verdicts agree


@pytest.mark.parametrize("rule", ["scores", "probs", "dense", "attn_out", "attn_lse", "attn_grad", "indexer_grad",
                                  "exact"])
def test_each_rule_fails_a_measurement_past_one_of_its_bounds(rule):
    row = next(r for r in committed_rows() if rule_for(r["stage"], r["tensor"]) == rule)
    kr = KernelRule.from_policy(rule)
    assert judge_row(row)[0]
    for metric, _, bound, _ in kr.bounds({k: 0.0 for k in ("max_abs", "mixed", "rel_l2", "cosine")}):
        bad = dict(row, **{metric: str(bound - 1e-3 if metric == "cosine" else bound * 1.01 + 1e-9)})
        ok, message = judge_row(bad)
        assert not ok and metric in message, (rule, metric, message)
    assert not judge_row(dict(row, nan="3"))[0]  # a NaN fails every rule


def test_measured_blocks_are_the_worst_committed_rows():
    kernels = policy_mod.default().section("kernels")
    worst: dict = {}
    for r in committed_rows():
        name = rule_for(r["stage"], r["tensor"])
        if name is None:
            continue
        entry = worst.setdefault(name, {"rows": 0})
        entry["rows"] += 1
        for metric in ("mixed", "rel_l2", "max_abs"):
            entry[metric] = max(entry.get(metric, 0.0), float(r[metric]))
        entry["cosine"] = min(entry.get("cosine", 1.0), float(r["cosine"]))
    assert set(worst) == set(kernels["rules"])
    for name, rule in kernels["rules"].items():
        measured = rule["measured"]
        assert measured["rows"] == worst[name]["rows"], name
        for metric in set(measured) & {"mixed", "rel_l2", "max_abs", "cosine"}:
            assert measured[metric] == pytest.approx(worst[name][metric], rel=1e-3, abs=1e-12), (name, metric)


def test_rule_table_names_policy_rules_and_rejects_unknown_tensors():
    rules = set(policy_mod.default().section("kernels")["rules"])
    named = {rule for by_tensor in STAGE_RULES.values() for rule in by_tensor.values() if rule}
    assert named <= rules
    assert rule_for("indexer_backward", "inplace_arg3") == "indexer_grad" and rule_for("compactify", "inf_pattern") \
        == "exact"
    with pytest.raises(CaseError, match="no rule for tensor 'dq' of stage 'compactify'"):
        rule_for("compactify", "dq")


def test_kernel_metrics_use_parity_metrics():
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0])
    m = kernel_metrics(a, b)
    assert m["n"] == 3 and m["max_abs"] == 1.0 and m["mixed"] == pytest.approx(0.2) and m["nan"] == 0
    assert m["rel_l2"] == pytest.approx(1 / 21 ** 0.5) and m["max_rel"] == pytest.approx(0.25)
    assert kernel_metrics(a, b, torch.tensor([True, True, False]))["max_abs"] == 0.0
    assert kernel_metrics(a[:0], b[:0])["n"] == 0
    assert kernel_metrics(torch.tensor([float("nan"), 1.0]), torch.ones(2))["nan"] == 1


def _policy_with(mutate):
    data = copy.deepcopy(dict(policy_mod.default().data))
    mutate(data["kernels"])
    return data


@pytest.mark.parametrize("mutate, field", [
    (lambda k: k["rules"]["scores"].pop("mixed"), "kernels.rules.scores"),
    (lambda k: k["rules"]["indexer_grad"].update(cosine=1.5), "kernels.rules.indexer_grad.cosine"),
    (lambda k: k["rules"]["dense"].update(atol=1e-3), "kernels.rules.dense.atol"),
    (lambda k: k["rules"]["probs"].pop("measured"), "kernels.rules.probs.measured"),
    (lambda k: k["rules"]["exact"].update(exact="yes"), "kernels.rules.exact.exact"),
    (lambda k: k.pop("graph_replay"), "kernels.graph_replay"),
    (lambda k: k["capture"].update(rel_l2=-1), "kernels.capture.rel_l2"),
])
def test_policy_validation_names_the_malformed_kernels_field(tmp_path, mutate, field):
    policy_mod.validate(copy.deepcopy(dict(policy_mod.default().data)))  # control: the shipped policy is valid
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(_policy_with(mutate)))
    with pytest.raises(CaseError) as info:
        policy_mod.load(path)
    assert field in str(info.value)


def test_a_missing_rule_is_a_clear_error(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(_policy_with(lambda k: k["rules"].pop("attn_lse"))))
    with pytest.raises(CaseError, match="kernels.rules.attn_lse"):
        KernelRule.from_policy("attn_lse", policy_mod.load(path))


# ---- the GPU script's calls, torch provider on both sides (CPU, shrunk) ----------------------------------------------
class WrongKernels(TorchKernels):
    """A "kernel" with two planted bugs: scores off by 1e-3 relative, one compacted index moved."""

    def indexer_forward(self, *args, **kwargs):
        res = super().indexer_forward(*args, **kwargs)
        return dict(res, scores=res["scores"] * (1 + 1e-3))

    def compactify(self, *args, **kwargs):
        res = super().compactify(*args, **kwargs)
        ids = res["indices"].clone()
        ids[0, 0] += 1
        return dict(res, indices=ids)


@pytest.fixture(scope="module")
def cheap_calls():
    """Every call of the script except the large sparse-attention ones (seconds each on a CPU), shrunk 64x."""
    calls = kernel_checks.build_calls(torch.device("cpu"), div=64)
    return [c for c in calls if c.stage not in ("sparse_attn_fwd", "sparse_attn_bwd") or "H16" in c.label
            or "H32" in c.label]


def _rows(call, kernel):
    args, kwargs = call.make()
    ka, kk = kernel_checks._clone(args, kwargs, call.inplace)
    res_k = getattr(kernel, call.stage)(*ka, **kk)
    ta, tkw = kernel_checks._clone(args, kwargs, call.inplace)
    res_t = getattr(TorchKernels(), call.stage)(*ta, **tkw)
    return kernel_checks.compare_call(call, dict(stage=call.stage, call=call.label), (res_k, ka), (res_t, ta))


def test_the_scripts_calls_pass_with_the_torch_provider_as_kernel(cheap_calls):
    assert {c.stage for c in cheap_calls} == set(STAGE_RULES)
    rows = [r for c in cheap_calls for r in _rows(c, TorchKernels())]
    assert [(r["stage"], r["tensor"], r["message"]) for r in rows if r["outcome"] != "pass"] == []
    assert {(r["stage"], r["tensor"]) for r in rows} >= {("indexer_forward", "scores"), ("compactify", "indices"),
                                                         ("dense_indexer_backward", "inplace_arg5")}


def test_the_scripts_calls_catch_a_wrong_kernel(cheap_calls):
    failed = {(r["stage"], r["tensor"]) for c in cheap_calls if c.stage in ("indexer_forward", "compactify")
              for r in _rows(c, WrongKernels()) if r["outcome"] == "fail"}
    assert failed == {("indexer_forward", "scores"), ("compactify", "indices")}
