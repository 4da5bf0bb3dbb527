"""Backend plan: provider selection per stage, the record of what ran, required providers, open registration."""

from __future__ import annotations

import pytest
import torch

import fused
from fused import plan as plan_mod
from fused.kernels.torch_provider import TorchKernels
from cases.tensors import materialize

from .helpers import bshd_case, thd_case

PATH_B_SPARSE = {"indexer_forward", "indexer_top_k", "compactify", "sparse_attn_fwd", "sparse_attn_score_recompute",
                 "indexer_backward", "sparse_attn_bwd"}


class CountingKernels(TorchKernels):
    """A provider registered from a test: the torch kernels, counting calls, declining wide sparse forwards."""

    name = "counting"
    calls: dict = {}

    def support_sparse_attn_fwd(self, arguments):
        return "this test provider only takes 2 heads" if arguments["q"].shape[1] > 2 else None

    def __getattribute__(self, item):
        if item in TorchKernels.stages:
            CountingKernels.calls[item] = CountingKernels.calls.get(item, 0) + 1
        return super().__getattribute__(item)


@pytest.fixture
def counting_provider():
    saved = dict(plan_mod.PROVIDERS)
    CountingKernels.calls = {}
    fused.register_provider("counting", CountingKernels, before="torch")
    try:
        yield CountingKernels
    finally:
        plan_mod.PROVIDERS.clear()
        plan_mod.PROVIDERS.update(saved)
        plan_mod._INSTANCES.pop("counting", None)


def forward_backward(case):
    t = materialize(case)
    params = {k: v.detach().requires_grad_(True) for k, v in t.params.items()}
    res = fused.attention_layer(t.inputs["hidden"].detach().requires_grad_(True), params, case.config,
                                t.packed_seq_params, training=case.training)
    res.objective(t.grad_output).backward()
    return res


def test_record_names_every_stage_of_path_b():
    with fused.use_backend("torch") as plan:
        forward_backward(bshd_case(4, 2, 13))
    assert set(plan.record) == PATH_B_SPARSE
    assert set(plan.record.values()) == {"torch"}


def test_record_of_the_dense_loss_and_of_path_a_and_c():
    with fused.use_backend("torch") as dense:
        forward_backward(thd_case(4, [(9, 12), (8, 8)], dsa_indexer_use_sparse_loss=False))
    assert {"csa_teacher_lse", "dense_attn_score_recompute", "dense_indexer_backward"} <= set(dense.record)
    assert "sparse_attn_score_recompute" not in dense.record
    with fused.use_backend("torch") as path_a:
        forward_backward(bshd_case(128, 1, 130))
    assert set(path_a.record) == {"sparse_attn_fwd", "sparse_attn_bwd"}
    with fused.use_backend("torch") as path_c:
        forward_backward(bshd_case(4, 1, 13, training=False))
    assert "indexer_backward" not in path_c.record and "compactify" in path_c.record


def test_observers_see_every_kernel_call_with_its_provider_and_nest():
    """``observe_kernels``: every call runs inside each open observer (outer entered first, exited last), the
    record and the observations agree; after the block nothing is observed (negative control)."""
    import contextlib

    seen = []

    def observer(tag):
        @contextlib.contextmanager
        def observe(stage, provider):
            seen.append(("enter", tag, stage, provider))
            yield
            seen.append(("exit", tag, stage, provider))
        return observe

    case = bshd_case(4, 2, 13)
    with fused.observe_kernels(observer("outer")), fused.observe_kernels(observer("inner")):
        with fused.use_backend("torch") as plan:
            forward_backward(case)
    assert plan_mod._OBSERVERS == []
    assert {(stage, provider) for _e, _t, stage, provider in seen} == set(plan.record.items())
    first = seen[:4]
    assert [(e, t) for e, t, _s, _p in first] == [("enter", "outer"), ("enter", "inner"), ("exit", "inner"),
                                                  ("exit", "outer")]
    count = len(seen)
    with fused.use_backend("torch"):
        forward_backward(case)
    assert len(seen) == count


def test_required_provider_that_is_unavailable_raises_a_clear_error():
    fused.register_provider("missing", "fused.kernels.no_such_module:Nothing")
    try:
        with pytest.raises(fused.BackendUnavailable, match="required provider 'missing' is unavailable"):
            with fused.use_backend("auto", require=("missing",)):
                pass
    finally:
        plan_mod.PROVIDERS.pop("missing")
    with pytest.raises(fused.BackendUnavailable, match="unknown provider"):
        fused.use_backend("nope").__enter__()


def test_registered_provider_runs_without_touching_the_composition(counting_provider):
    """auto puts it before torch; it runs every stage it accepts and the record says so."""
    case = bshd_case(4, 1, 13, num_attention_heads=2)
    with fused.use_backend("auto") as plan:
        forward_backward(case)
    assert set(plan.record.values()) == {"counting"}
    assert counting_provider.calls["sparse_attn_fwd"] >= 1


def test_auto_falls_back_past_a_declining_provider_and_records_it(counting_provider):
    with fused.use_backend("auto") as plan:
        forward_backward(bshd_case(4, 1, 13, num_attention_heads=4))
    assert plan.record["sparse_attn_fwd"] == "torch"          # declined: 4 heads
    assert plan.record["indexer_forward"] == "counting"


def test_a_requested_provider_never_degrades_silently(counting_provider):
    with pytest.raises(fused.StageUnsupported, match="only takes 2 heads") as info:
        with fused.use_backend("counting"):
            forward_backward(bshd_case(4, 1, 13, num_attention_heads=4))
    assert info.value.stage == "sparse_attn_fwd" and info.value.provider == "counting"
    with pytest.raises(fused.StageUnsupported):
        with fused.use_backend("auto", require=("counting",)):
            forward_backward(bshd_case(4, 1, 13, num_attention_heads=4))


def test_per_stage_mapping(counting_provider):
    with fused.use_backend({"indexer_top_k": "counting"}) as plan:
        forward_backward(bshd_case(4, 1, 13))
    assert plan.record["indexer_top_k"] == "counting"
    with pytest.raises(ValueError, match="unknown stage"):
        fused.use_backend({"not_a_stage": "torch"}).__enter__()


def test_the_default_plan_is_auto_and_the_context_restores_it():
    before = fused.current_plan()
    with fused.use_backend("torch") as plan:
        assert fused.current_plan() is plan
    assert fused.current_plan() is before and before.provider == "auto"


def test_gpu_providers_are_optional_imports():
    reasons = fused.available_providers()
    assert reasons["torch"] is None
    if not torch.cuda.is_available():
        assert reasons["cudnn"] is not None and reasons["flashmla"] is not None


# ---- the parity engine's hooks on the fused module (parity/impls.py) ------------------------------------------------
def test_available_providers_lists_every_selection_best_first_with_reasons():
    reasons = fused.available_providers()
    assert list(reasons)[0] == "cudnn" and list(reasons)[-1] == "torch"
    assert set(plan_mod.PROVIDERS) <= set(reasons)
    usable = [name for name, why in reasons.items() if why is None]
    assert usable[-1] == "torch"
    if not torch.cuda.is_available():  # the engine's "auto" then runs every stage on torch
        assert usable == ["torch"]
        assert "flashmla" in reasons["cudnn"] and "cudnn" in reasons["cudnn"]  # the production pair, both named


class _StageKernels(TorchKernels):
    """A provider implementing one stage only (the torch math), available or not."""

    stages = frozenset({"indexer_top_k"})
    missing = False

    @classmethod
    def unavailable_reason(cls):
        return "not installed here" if cls.missing else None


class _TopkA(_StageKernels):
    name = "topk_a"


class _TopkB(_StageKernels):
    name = "topk_b"
    stages = frozenset({"compactify"})


@pytest.fixture
def pair_selection(monkeypatch):
    """A selection ``pair`` = two one-stage providers, as ``cudnn`` = cudnn + flashmla."""
    monkeypatch.setattr(plan_mod, "PROVIDERS", dict(plan_mod.PROVIDERS))
    monkeypatch.setattr(plan_mod, "SELECTIONS", {**plan_mod.SELECTIONS, "pair": ("topk_a", "topk_b")})
    for cls in (_TopkA, _TopkB):
        fused.register_provider(cls.name, cls)
    yield
    for cls in (_TopkA, _TopkB):
        plan_mod._INSTANCES.pop(cls.name, None)
        plan_mod._UNAVAILABLE.pop(cls.name, None)
    _TopkB.missing = False


def test_a_selection_requires_each_of_its_providers_and_records_what_ran(pair_selection):
    assert fused.available_providers()["pair"] is None
    with fused.use_backend("pair") as plan:
        forward_backward(bshd_case(4, 1, 13))
    assert plan.record["indexer_top_k"] == "topk_a" and plan.record["compactify"] == "topk_b"
    assert plan.record["sparse_attn_fwd"] == "torch"  # a stage neither implements
    assert fused.executed() == plan.record
    # negative control: one member missing -> the selection is unavailable, never a silent fallback
    plan_mod._INSTANCES.pop("topk_b", None)
    _TopkB.missing = True
    assert "topk_b: not installed here" in fused.available_providers()["pair"]
    with pytest.raises(fused.BackendUnavailable, match="topk_b"):
        with fused.use_backend("pair"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_plain_fused_is_an_engine_implementation_with_providers():
    from parity.engine import RunOptions, run_case
    from parity.impls import ImplError, load

    impl = load("fused")
    assert impl.has_providers and impl.providers() == fused.available_providers()
    with pytest.raises(ImplError, match="unavailable here: cudnn: .*flashmla"):
        impl.check_provider("cudnn")
    impl.check_provider("torch")
    case = bshd_case(4, 1, 13, dtype="float64")
    result = run_case(case, impl, load("reference"), RunOptions(impl="fused", provider="auto", device="cpu"))
    assert result.outcome == "pass", result.message
    assert result.plan and set(result.plan.values()) == {"torch"}
    with pytest.raises(fused.BackendUnavailable, match="flashmla"):  # the engine's --provider cudnn hook
        with fused.use_backend("cudnn"):
            pass
