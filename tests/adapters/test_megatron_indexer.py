"""Production's lightning indexer (``adapters.megatron.indexer``): its scores are the core forward's eval
``index_scores`` bit for bit, so sign-split observes a case's heads through it (one indexer call a head instead of one
case forward). On the unfused provider it is the indexer module alone; on the fused providers it is the core forward
stopped once the kernels have scored (no sparse attention runs)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from adapters.megatron import layer
from cases.errors import CaseError
from cases.tensors import materialize
from parity.impls import load
from parity.judge import sign_split

from tests.adapters.test_megatron import needs_megatron
from tests.parity.test_sign_split_probe import Counting, _case

pytestmark = needs_megatron


@pytest.fixture(scope="module")
def megatron():
    return load("megatron")


def _observe(impl, case, tensors, provider, indexer="keep"):
    api = Counting(impl.api, indexer=indexer)
    active, probe = sign_split.observe(api, case, tensors, impl.context(provider))
    return active, probe, api.calls


@pytest.mark.parametrize("thd", [False, True], ids=["bshd", "thd"])
def test_core_heads_go_through_productions_indexer_with_the_core_forwards_pattern(megatron, thd):
    case = _case("core", thd)
    tensors = materialize(case, "cpu")
    active, probe, calls = _observe(megatron, case, tensors, "unfused")
    plain, plain_probe, _ = _observe(megatron, case, tensors, "unfused", indexer=None)
    heads = case.config.dsa_indexer_n_heads
    assert (probe, plain_probe) == ("indexer", "core_attention")
    assert calls["core_attention"] == 2 and calls["indexer"] == heads + 1
    assert torch.equal(active, plain)
    assert 0 < int(active.sum()) < active.numel()


@pytest.mark.parametrize("thd", [False, True], ids=["bshd", "thd"])
def test_layer_heads_go_through_the_indexer_on_productions_own_query_latent(megatron, thd):
    """``query_latent`` is the ``qr`` production's layer hands its core attention: with it the indexer gives the
    layer forward's scores bit for bit, two layer forwards and one cut short instead of one a head."""
    case = _case("layer", thd)
    tensors = materialize(case, "cpu")
    active, probe, calls = _observe(megatron, case, tensors, "unfused")
    plain, plain_probe, _ = _observe(megatron, case, tensors, "unfused", indexer=None)
    assert (probe, plain_probe) == ("indexer", "attention_layer")
    assert calls["attention_layer"] == 2 and calls["query_latent"] == 1
    assert calls["indexer"] == case.config.dsa_indexer_n_heads + 1
    assert torch.equal(active, plain)
    qr = megatron.api.query_latent(tensors.inputs["hidden"], tensors.params, case.config, tensors.packed_seq_params)
    lead = (tensors.inputs["hidden"].shape[0],) if thd else tuple(tensors.inputs["hidden"].shape[:2])
    assert tuple(qr.shape) == lead + (case.config.q_lora_rank,)


@pytest.mark.parametrize("scope,thd", [("core", False), ("core", True), ("layer", False), ("layer", True)],
                         ids=["core-bshd", "core-thd", "layer-bshd", "layer-thd"])
def test_the_fused_path_observes_through_its_core_forward_stopped_after_scoring(megatron, scope, thd):
    """On the emulated provider every head after the agreement check goes through ``indexer`` (the core forward cut
    short), and the pattern is the per-head case forward's."""
    case = _case(scope, thd)
    tensors = materialize(case, "cpu")
    active, probe, calls = _observe(megatron, case, tensors, "emulated")
    plain, plain_probe, plain_calls = _observe(megatron, case, tensors, "emulated", indexer=None)
    entry = sign_split.entry_point(case)
    heads = case.config.dsa_indexer_n_heads
    assert (probe, plain_probe) == ("indexer", entry)
    assert calls[entry] == 2 and calls["indexer"] == heads + 1 and plain_calls[entry] == heads
    assert torch.equal(active, plain)
    assert 0 < int(active.sum()) < active.numel()


def _records(monkeypatch) -> list:
    """Every :class:`recorders.Record` the adapter fills from now on, in order."""
    seen, honest = [], layer.recorders.recording

    @contextlib.contextmanager
    def spying(mg, **kwargs):
        with honest(mg, **kwargs) as record:
            seen.append(record)
            yield record
    monkeypatch.setattr(layer.recorders, "recording", spying)
    return seen


@pytest.mark.parametrize("thd", [False, True], ids=["bshd", "thd"])
def test_the_fused_indexer_gives_the_core_forwards_scores_and_runs_no_attention(megatron, monkeypatch, thd):
    """``indexer`` on the emulated provider: the eval core forward's ``index_scores`` and ``topk_indices`` bit for
    bit, and production's sparse attention (its FlashMLA adapter, which records ``lse``) never ran; the core forward
    itself (control) runs it. Control for the agreement: another ``q_latent`` gives other scores."""
    case = _case("core", thd)
    tensors = materialize(case, "cpu")
    inputs, psp, c = tensors.inputs, tensors.packed_seq_params, case.config
    seen = _records(monkeypatch)
    with megatron.context("emulated")():
        scores, topk = megatron.api.indexer(inputs["hidden"], inputs["q_latent"], tensors.params, c, psp)
        forward = megatron.api.core_attention(inputs["query"], inputs["kv"], inputs["hidden"], inputs["q_latent"],
                                              tensors.params, c, psp, training=False)
        other, _ = megatron.api.indexer(inputs["hidden"], inputs["q_latent"].flip(0), tensors.params, c, psp)
    assert sign_split.same_bits(scores, forward.index_scores) and torch.equal(topk, forward.topk_indices)
    assert not sign_split.same_bits(other, forward.index_scores)
    assert "fused_scores" in seen[0] and "lse" not in seen[0]
    assert "lse" in seen[1]


def test_a_mask_one_row_late_is_caught_and_not_used(megatron, monkeypatch):
    """Negative control: the BSHD causal mask shifted by one row (a compressed entry visible one row early) gives
    other scores than the core forward's, so sign-split does not use the indexer; the pattern is unchanged."""
    case = _case("core", False)
    tensors = materialize(case, "cpu")
    plain, _, _ = _observe(megatron, case, tensors, "unfused", indexer=None)
    honest = layer._visible_compressed
    monkeypatch.setattr(layer, "_visible_compressed", lambda rows, r, device: torch.cat(
        [honest(rows, r, device)[1:], torch.zeros(1, rows // r, device=device)]))
    active, probe, calls = _observe(megatron, case, tensors, "unfused")
    assert probe == "core_attention" and calls["indexer"] == 1
    assert torch.equal(active, plain)
