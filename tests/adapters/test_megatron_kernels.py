"""The kernel seam of ``--impl megatron``'s fused path (:mod:`adapters.megatron.kernel_calls`), the FlashMLA bridge of
the ``cudnn`` provider (:mod:`adapters.megatron.real_kernels`) and production's config refusal, on CPU. The real
kernels run only on a GPU (``tests/gpu``); here the bridge is checked against a recording stand-in with
sgl-flash-mla's signature, and observation through the ``emulated`` provider."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from adapters.megatron import kernel_calls, real_kernels
from cases.vocabulary import Unsupported

from .test_megatron import needs_megatron


def _sgl_forward(calls):
    """A stand-in with sgl-flash-mla 1.0.0's ``flash_mla_sparse_fwd`` signature (no ``indexer_topk``)."""

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False,
                             return_log2_lse=None):
        calls.append({"d_v": d_v, "use_legacy": use_legacy, "topk_length": topk_length, "attn_sink": attn_sink})
        return q, None, None

    return flash_mla_sparse_fwd


@pytest.mark.parametrize("legacy", [True, False])
def test_the_bridge_drops_indexer_topk_zero_and_adds_use_legacy_only_on_sm90(legacy):
    calls = []
    bridge = real_kernels.flash_mla_bridge(_sgl_forward(calls), legacy=legacy)
    assert "indexer_topk" in inspect.signature(bridge).parameters  # the nv_dev signature production calls
    q = torch.zeros(2, 64, 8)
    out = bridge(q, q, q, 0.5, d_v=512, attn_sink="sink", topk_length=None, indexer_topk=0)
    assert out[0] is q
    assert calls == [{"d_v": 512, "use_legacy": legacy, "topk_length": None, "attn_sink": "sink"}]


def test_the_bridge_refuses_a_positive_indexer_topk_instead_of_emulating_it():
    calls = []
    bridge = real_kernels.flash_mla_bridge(_sgl_forward(calls), legacy=True)
    with pytest.raises(Unsupported, match="indexer_topk=4"):
        bridge(None, None, None, 1.0, indexer_topk=4)
    assert calls == []


def test_without_cuda_the_cudnn_provider_names_why():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert "CUDA" in real_kernels.unavailable_reason()


def test_observers_see_each_call_with_its_stage_and_nest():
    seen = []

    def observer(tag):
        def enter(stage, provider):
            seen.append((tag, stage, provider))
            return contextlib.nullcontext()
        return enter

    namespace = type("DSA", (), {"indexer_forward_wrapper": staticmethod(lambda x: x + 1), "version": 7})()
    dsa = kernel_calls.ObservedDSA(namespace, "cudnn")
    assert dsa.indexer_forward_wrapper(1) == 2 and seen == []  # no observer: a plain call
    with kernel_calls.observe_kernels(observer("outer")), kernel_calls.observe_kernels(observer("inner")):
        assert dsa.indexer_forward_wrapper(1) == 2
        assert dsa.version == 7  # not a wrapper: passed through, not observed
    assert seen == [("outer", "indexer_forward", "cudnn"), ("inner", "indexer_forward", "cudnn")]
    assert dsa.indexer_forward_wrapper(2) == 3 and len(seen) == 2  # the observers are gone after the block


def _smoke_case(predicate):
    from cases.suites import load_suite

    return next(c for c in load_suite("smoke") if predicate(c))


@needs_megatron
def test_the_emulated_fused_path_is_observed_stage_by_stage():
    from parity.engine import RunOptions, run_case
    from parity.impls import load

    case = _smoke_case(lambda c: c.id == "9a8dbea368d1")  # r = 4 training with the indexer loss (issue 18's subset)
    impl, ref = load("megatron"), load("reference")
    seen = []
    with kernel_calls.observe_kernels(lambda stage, provider: seen.append((stage, provider)) or
                                      contextlib.nullcontext()):
        result = run_case(case, impl, ref, RunOptions(impl="megatron", provider="emulated", device="cpu"))
    assert result.outcome == "pass", result.message
    stages = {stage for stage, _ in seen}
    assert {"sparse_attn_fwd", "indexer_forward", "indexer_top_k", "sparse_attn_bwd"} <= stages
    assert {provider for _, provider in seen} == {"torch"}


@needs_megatron
def test_production_config_validation_refusing_a_case_is_unsupported(monkeypatch):
    """The emulated provider declared as sm90: production's own validation refuses the r = 4 dense indexer loss
    (``transformer_config.py``), the case is ``unsupported`` with production's message. Negative control: the same
    case at the default sm100 declaration runs."""
    from adapters.megatron import emulated
    from parity.engine import RunOptions, run_case
    from parity.impls import load

    case = _smoke_case(lambda c: c.config.compress_ratio == 4 and not c.config.csa_dense_mode and c.training
                       and not c.config.dsa_indexer_use_sparse_loss and c.dtype == "float32"
                       and c.layout.kind == "bshd")
    impl, ref = load("megatron"), load("reference")
    options = RunOptions(impl="megatron", provider="emulated", device="cpu")
    assert run_case(case, impl, ref, options).outcome != "unsupported"
    monkeypatch.setattr(emulated, "DEVICE_CAPABILITY", (9, 0))
    from adapters.megatron import build

    monkeypatch.setattr(build, "_CACHE", {})
    refused = run_case(case, impl, ref, options)
    assert refused.outcome == "unsupported", refused.message
    assert "SM90" in refused.message and "config validation" in refused.message


def test_an_unavailable_provider_is_unsupported_not_an_error():
    from adapters.megatron.providers import MegatronUnavailable

    assert issubclass(MegatronUnavailable, Unsupported)


@needs_megatron
def test_a_gate_case_without_compressed_rows_is_known_not_an_error():
    """A small ``gate`` case on CPU through production's fused composition (emulated): BSHD with no compressed row
    (production runs no indexer; sign-split then has no pattern to observe and must not crash): ``known`` under the
    entry that explains it. (Two entries explaining one case together: tests/parity/test_known.py; on the gate,
    case 0d586ccc3f12 — measured, not run here: 64 indexer heads of sign-split probes take minutes on a CPU.)"""
    from cases.suites import find_case
    from parity.engine import RunOptions, run_case
    from parity.impls import load

    impl, ref = load("megatron"), load("reference")
    options = RunOptions(impl="megatron", provider="emulated", device="cpu")
    expected = {"a9bc87569a3e": "no-indexer-output-without-compressed-rows"}
    for case_id, entry in expected.items():
        result = run_case(find_case("gate", case_id), impl, ref, options)
        assert result.outcome == "known", (case_id, result.outcome, result.message)
        assert result.known["id"] == entry


@needs_megatron
def test_a_fresh_process_can_enter_the_cudnn_provider_before_its_first_case(tmp_path):
    """A worker process enters ``use_backend("cudnn")`` before any case imported Megatron: the provider must import
    production (and put its tree on ``sys.path``) before it patches production's kernel globals. Run in a fresh
    interpreter with the real kernels replaced by the torch stand-ins (the availability check and the packages are
    the only GPU parts). Negative control: the kernel seam alone, before the provider imported production, refuses."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "fresh.py"
    script.write_text(
        "import contextlib, sys\n"
        "from adapters.megatron import emulated, kernel_calls, providers, real_kernels\n"
        "real_kernels.unavailable_reason = lambda: None\n"
        "real_kernels.installed = lambda: kernel_calls.installed(emulated.dsa_namespace(), 'cudnn',\n"
        "                                                       emulated.flash_mla_sparse_fwd, 'flashmla')\n"
        "if sys.argv[1] == 'seam-only':\n"
        "    with kernel_calls.installed(emulated.dsa_namespace(), 'cudnn', emulated.flash_mla_sparse_fwd, 'x'):\n"
        "        pass\n"
        "with providers.use_backend('cudnn') as handle:\n"
        "    print('entered', handle.record)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    ok = subprocess.run([sys.executable, str(script), "provider"], capture_output=True, text=True, env=env, cwd=root)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "entered {'megatron.cudnn': 'cudnn+flashmla'}" in ok.stdout
    bare = subprocess.run([sys.executable, str(script), "seam-only"], capture_output=True, text=True, env=env,
                          cwd=root)
    assert bare.returncode != 0 and "before Megatron-LM is imported" in bare.stderr
