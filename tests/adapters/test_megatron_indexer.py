"""Production's lightning indexer alone (``adapters.megatron.indexer``): on the unfused provider its scores are the
core forward's eval ``index_scores`` bit for bit, so sign-split observes a core case's heads through it (one indexer
call a head instead of one core forward); on the fused providers it declines and the core forward observes them."""

from __future__ import annotations

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


def test_the_fused_paths_decline_and_the_core_forward_observes(megatron):
    case = _case("core", True)
    tensors = materialize(case, "cpu")
    with megatron.context("emulated")(), pytest.raises(CaseError, match="unfused provider"):
        megatron.api.indexer(tensors.inputs["hidden"], tensors.inputs["q_latent"], tensors.params, case.config,
                             tensors.packed_seq_params)
    _, probe, calls = _observe(megatron, case, tensors, "emulated")
    assert probe == "core_attention" and calls["core_attention"] == case.config.dsa_indexer_n_heads


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
