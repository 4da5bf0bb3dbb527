"""The kernel seam of ``--impl megatron``'s fused path (:mod:`adapters.megatron.kernel_calls`), the FlashMLA bridge of
the ``cudnn`` provider (:mod:`adapters.megatron.real_kernels`) and production's config refusal, on CPU. The real
kernels run only on a GPU (``tests/gpu``); here the bridge is checked against a recording stand-in with
sgl-flash-mla's signature, and observation through the ``emulated`` provider."""

from __future__ import annotations

import contextlib
import inspect
import math
import types

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


def _torch_sgl_forward(calls):
    """sgl-flash-mla's signature over the torch provider (``out, max_logits, lse``), recording each call."""
    from fused.kernels.torch_provider import TorchKernels

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False):
        calls.append({"use_legacy": use_legacy, "width": indices.shape[-1]})
        return TorchKernels().sparse_attn_fwd(q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink,
                                              topk_length=topk_length)

    return flash_mla_sparse_fwd


def _flash_inputs(rows=5, heads=64, d=512, n_kv=700, width=640, seed=0):
    """FlashMLA-shaped inputs: ``q [rows, heads, d]`` bf16, ``kv [n_kv, 1, d]``, ``indices [rows, 1, width]`` int32
    with invalid slots (``-1`` and ``>= n_kv``) among the first 512, row 1 with no valid slot among the first 512."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, d, generator=g).to(torch.bfloat16)
    kv = torch.randn(n_kv, 1, d, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, n_kv, (rows, 1, width), generator=g, dtype=torch.int32)
    idx[0, 0, 3], idx[2, 0, 7], idx[3, 0, 100] = -1, n_kv, n_kv + 5
    idx[1, 0, :512] = -1
    idx[4, 0, 600:] = -1  # -1 padding at the end, as production pads the width
    sink = torch.randn(heads, generator=g)
    return q, kv, idx, sink


def _expected_lse_indexer(q, kv, idx, scale, k):
    """The nv_dev contract written out in float64: natural-log LSE over the first ``k`` slots, no sink, +inf empty."""
    keys = idx[:, 0, :k].long()
    valid = (keys >= 0) & (keys < kv.shape[0])
    gathered = kv[:, 0].double()[keys.clamp(0, kv.shape[0] - 1)]  # [rows, k, d]
    logits = torch.einsum("rhd,rkd->rhk", q.double(), gathered) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


def _matches(got, want) -> bool:
    finite = torch.isfinite(want)
    return bool(torch.equal(torch.isposinf(got), torch.isposinf(want))) and \
        bool(torch.allclose(got[finite].double(), want[finite], rtol=0, atol=1e-4))


def test_the_bridge_computes_nv_devs_lse_indexer_beside_the_real_kernel():
    """``indexer_topk = 512``: sgl-flash-mla's ``out / max_logits / lse`` unchanged (one call, full width,
    ``use_legacy``), plus ``lse_indexer`` as nv_dev defines it: first 512 slots, invalid slots out, no sink, +inf on
    the row with no valid slot. Negative controls: the same check rejects an LSE over every slot, one with the sink
    and a log2 one."""
    calls = []
    q, kv, idx, sink = _flash_inputs()
    scale = 512 ** -0.5
    bridge = real_kernels.flash_mla_bridge(_torch_sgl_forward(calls), legacy=True)
    out, max_logits, lse, lse_indexer = bridge(q, kv, idx, scale, attn_sink=sink, indexer_topk=512)
    assert calls == [{"use_legacy": True, "width": 640}]
    ref_out, _, ref_lse = _torch_sgl_forward([])(q, kv, idx, scale, attn_sink=sink)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert lse_indexer.dtype == torch.float32 and lse_indexer.shape == (5, 64)
    want = _expected_lse_indexer(q, kv, idx, scale, 512)
    assert torch.isposinf(want[1]).all()
    assert _matches(lse_indexer, want)
    # negative controls: wrong definitions of the partial LSE are told apart by the same check
    assert not _matches(_expected_lse_indexer(q, kv, idx, scale, 640), want)  # every slot
    with_sink = torch.logaddexp(want, sink.double().view(1, -1)).masked_fill(torch.isposinf(want), float("inf"))
    assert not _matches(with_sink, want)
    assert not _matches(want / math.log(2.0), want)


def test_an_index_buffer_narrower_than_indexer_topk_is_never_snapshotted():
    q, kv, idx, _ = _flash_inputs(width=384)
    got = real_kernels.lse_indexer(q, kv, idx, 0.1, 512)
    assert torch.isposinf(got).all() and got.shape == (5, 64)


@pytest.mark.parametrize("heads, d, k, message", [
    (64, 512, 256, "indexer_topk must be 0, 512, 1024, or 2048, got 256"),
    (64, 512, 4, "got 4"),
    (128, 512, 2048, "indexer_topk == 2048 is not supported for h_q == 128"),
    (128, 576, 512, "requires d_qk == 512"),
])
def test_what_nv_dev_refuses_is_a_kernel_refusal_before_any_kernel_runs(heads, d, k, message):
    calls = []
    bridge = real_kernels.flash_mla_bridge(_torch_sgl_forward(calls), legacy=True)
    q = torch.zeros(2, heads, d, dtype=torch.bfloat16)
    with pytest.raises(real_kernels.KernelRefused, match=message) as refused:
        bridge(q, q[:, :1], torch.zeros(2, 1, 640, dtype=torch.int32), 1.0, indexer_topk=k)
    assert isinstance(refused.value, Unsupported) and "nv_dev refuses" in str(refused.value)
    assert calls == []


@pytest.mark.parametrize("heads, k", [(64, 512), (64, 1024), (64, 2048), (128, 512), (128, 1024)])
def test_what_nv_dev_accepts_runs(heads, k):
    """Negative control of the refusals: the (h_q, indexer_topk) pairs nv_dev b7643bd accepts with d_qk = 512."""
    calls = []
    bridge = real_kernels.flash_mla_bridge(_torch_sgl_forward(calls), legacy=True)
    q, kv, _, _ = _flash_inputs(heads=heads, n_kv=40)
    idx = torch.arange(k + 128, dtype=torch.int32).remainder(40).view(1, 1, -1).expand(5, 1, -1).contiguous()
    assert len(bridge(q, kv, idx, 0.1, indexer_topk=k)) == 4 and len(calls) == 1


def test_indexer_topk_with_topk_length_is_declined_not_guessed():
    bridge = real_kernels.flash_mla_bridge(_torch_sgl_forward([]), legacy=True)
    q, kv, idx, _ = _flash_inputs()
    with pytest.raises(real_kernels.BridgeRefused, match="topk_length"):
        bridge(q, kv, idx, 0.1, topk_length=torch.full((5,), 64, dtype=torch.int32), indexer_topk=512)


@needs_megatron
def test_productions_flash_mla_adapter_returns_the_bridged_lse_indexer(monkeypatch):
    """Production's own ``_csa_fwd_flash_mla`` (the snapshot's; Path B before 608545cfc6 calls it with
    ``indexer_topk=K``) over the bridge, declared sm90: it pads the width to 128 and returns ``(out, lse,
    lse_indexer)`` with the bridge's partial LSE; with ``indexer_topk >= TopK`` it returns ``lse`` itself.
    Negative control: a bridge with a wrong partial LSE (the sink folded in) changes what production returns."""
    import importlib

    from adapters.megatron import providers

    fused = importlib.import_module(providers.megatron().generation.fused_module_name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())
    q, kv, idx, sink = _flash_inputs(width=520)  # K = 512 + a window of 8: padded to 640 by production
    flat_q, flat_kv, flat_idx = q, kv[:, 0], idx[:, 0]
    scale = 512 ** -0.5

    def run(partial):
        calls = []
        bridge = real_kernels.flash_mla_bridge(_torch_sgl_forward(calls), legacy=True, partial_lse=partial)
        with kernel_calls.installed(types.SimpleNamespace(), "cudnn", bridge, "flashmla"):
            got = fused._csa_fwd_flash_mla(flat_q, flat_kv, flat_idx, scale, attn_sink=sink, indexer_topk=512)
            whole = fused._csa_fwd_flash_mla(flat_q, flat_kv, flat_idx[:, :512], scale, attn_sink=sink,
                                             indexer_topk=512)
        return got, whole, calls

    (out, lse, lse_indexer), (_, whole_lse, whole_indexer), calls = run(real_kernels.lse_indexer)
    assert [c["width"] for c in calls] == [640, 512]
    assert _matches(lse_indexer, _expected_lse_indexer(q, kv, idx, scale, 512))
    assert torch.equal(whole_indexer, whole_lse)  # K >= TopK: production's own fallback to lse

    def with_sink(*args):
        return torch.logaddexp(real_kernels.lse_indexer(*args), sink.view(1, -1))

    (_, _, wrong), _, _ = run(with_sink)
    assert not _matches(wrong, _expected_lse_indexer(q, kv, idx, scale, 512))


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
