"""Sign-split's probe (parity/judge/sign_split.py): a core case is observed through the implementation's public
``indexer`` only where that gives the core forward's ``index_scores`` bit for bit; the pattern is the same either way."""

from __future__ import annotations

import types

import pytest
import torch

from cases.suites import load_suite
from cases.tensors import api_inputs, materialize
from parity.impls import load
from parity.judge import sign_split


def _case(scope: str, thd: bool):
    """The smoke case of that scope and layout with the most rows (its pattern has both signs)."""
    cases = [c for c in load_suite("smoke") if sign_split.applies(c) and c.scope == scope and c.is_thd == thd]
    return max(cases, key=lambda c: c.layout.num_tokens)


class Counting:
    """The fused API with its entry points counted; ``indexer`` / ``query_latent`` optionally replaced or removed
    (None)."""

    def __init__(self, api, indexer="keep", query_latent="keep"):
        self.api, self.calls = api, {"core_attention": 0, "attention_layer": 0, "indexer": 0, "query_latent": 0}
        self._replaced = {}
        for name, value in (("indexer", indexer), ("query_latent", query_latent)):
            if value is None:
                setattr(self, name, None)
            elif value != "keep":
                self._replaced[name] = value

    def __getattr__(self, name):
        target = self.__dict__["_replaced"].get(name) or getattr(self.api, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return target(*args, **kwargs)
        return counted


@pytest.mark.parametrize("scope", ["core", "layer"])
@pytest.mark.parametrize("thd", [False, True], ids=["bshd", "thd"])
def test_heads_probed_through_the_indexer_give_the_case_forwards_pattern(scope, thd):
    """Heads 1.. go through ``indexer`` (a layer case on the implementation's ``query_latent``, read once): the case
    forward's pattern, with two forwards of the case's entry point instead of one a head."""
    case = _case(scope, thd)
    fused = load("fused")
    tensors = materialize(case, "cpu")
    fast = Counting(fused.api)
    active, probe = sign_split.observe(fast, case, tensors, fused.context("torch"))
    plain = Counting(fused.api, indexer=None)
    reference_active, plain_probe = sign_split.observe(plain, case, tensors, fused.context("torch"))
    heads, entry = case.config.dsa_indexer_n_heads, sign_split.entry_point(case)
    assert (probe, plain_probe) == ("indexer", entry)
    # head 0 alone and all heads at once both ways, then heads 1.. through the indexer
    assert fast.calls[entry] == 2 and fast.calls["indexer"] == heads + 1
    assert fast.calls["query_latent"] == (1 if scope == "layer" else 0)
    assert plain.calls[entry] == heads and plain.calls["indexer"] == 0
    assert torch.equal(active, reference_active)
    assert 0 < int(active.sum()) < active.numel()


def test_an_indexer_that_differs_from_the_core_forward_is_not_used():
    """Negative control: an ``indexer`` whose scores are off by one ulp somewhere is caught on head 0, and every head
    is observed through the core forward again."""
    case = _case("core", True)
    fused = load("fused")
    tensors = materialize(case, "cpu")

    def off_by_an_ulp(*args, **kwargs):
        scores, ids = fused.api.indexer(*args, **kwargs)
        scores = scores.clone()
        finite = torch.isfinite(scores) & (scores != 0)
        first = finite.flatten().nonzero()[0]
        flat = scores.view(-1)
        flat[first] = torch.nextafter(flat[first], torch.full_like(flat[first], float("inf")))
        return scores, ids

    api = Counting(fused.api, indexer=off_by_an_ulp)
    active, probe = sign_split.observe(api, case, tensors, fused.context("torch"))
    plain, _ = sign_split.observe(Counting(fused.api, indexer=None), case, tensors, fused.context("torch"))
    assert probe == "core_attention"
    assert api.calls["indexer"] == 1 and api.calls["core_attention"] == case.config.dsa_indexer_n_heads
    assert torch.equal(active, plain)


def test_a_layer_case_without_the_implementations_query_latent_keeps_the_layer_forward():
    """The indexer alone is no use at layer scope without the query latent the layer itself computes."""
    case = _case("layer", True)
    fused = load("fused")
    api = Counting(fused.api, query_latent=None)
    _, probe = sign_split.observe(api, case, materialize(case, "cpu"), fused.context("torch"))
    assert probe == "attention_layer" and api.calls["indexer"] == 0
    assert api.calls["attention_layer"] == case.config.dsa_indexer_n_heads


@pytest.mark.parametrize("thd", [False, True], ids=["bshd", "thd"])
def test_a_query_latent_other_than_the_layers_is_caught(thd):
    """Negative control: a ``query_latent`` that is not the one the layer computes (the public API's drawn
    ``q_latent``, or the layer's own scaled by 1 + 2^-7) gives other scores on head 0, so the layer forward observes
    every head and the pattern is the layer forward's."""
    case = _case("layer", thd)
    fused = load("fused")
    tensors = materialize(case, "cpu")
    plain = sign_split.observe(Counting(fused.api, indexer=None), case, tensors, fused.context("torch"))[0]
    for wrong in (lambda *a, **k: api_inputs(case, tensors)[1],
                  lambda *a, **k: fused.api.query_latent(*a, **k) * (1 + 2 ** -7)):
        api = Counting(fused.api, query_latent=wrong)
        active, probe = sign_split.observe(api, case, tensors, fused.context("torch"))
        assert probe == "attention_layer" and api.calls["indexer"] == 1
        assert torch.equal(active, plain)


def test_same_bits():
    a = torch.tensor([1.0, float("-inf")])
    assert sign_split.same_bits(a, a.clone())
    assert not sign_split.same_bits(a, a.double())
    assert not sign_split.same_bits(a, torch.tensor([1.0, 0.0]))
    assert not sign_split.same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not sign_split.same_bits(a, None)


def _plain_pattern(case, tensors, fused):
    return sign_split.observe(Counting(fused.api, indexer=None), case, tensors, fused.context("torch"))[0]


def test_an_indexer_right_on_head_0_alone_is_not_used():
    """Negative control (found by review): an ``indexer`` that matches the core forward while only head 0 has
    weights, and is off otherwise, fails the all-heads check and is not used."""
    case = _case("core", True)
    fused = load("fused")
    tensors = materialize(case, "cpu")

    def right_on_head_0_only(hidden, q_latent, params, config, psp=None):
        others = params[sign_split.WEIGHTS][1:]
        if bool((others == 0).all()):
            return fused.api.indexer(hidden, q_latent, params, config, psp)
        return fused.api.indexer(hidden, -q_latent, params, config, psp)

    api = Counting(fused.api, indexer=right_on_head_0_only)
    active, probe = sign_split.observe(api, case, tensors, fused.context("torch"))
    assert probe == "core_attention" and api.calls["indexer"] == 2
    assert torch.equal(active, _plain_pattern(case, tensors, fused))


@pytest.mark.parametrize("fails_at, how", [(0, "raise"), (3, "raise"), (3, "none")])
def test_an_indexer_that_raises_leaves_the_heads_to_the_core_forward(fails_at, how):
    """An optional entry point that raises (another signature, a layout it declines) decides nothing: the core
    forward observes the heads from there on, and the pattern is the core forward's (found by review: the case
    became ``error`` or ``unsupported``)."""
    case = _case("core", True)
    fused = load("fused")
    tensors = materialize(case, "cpu")
    calls = []

    def declines(*args, **kwargs):
        calls.append(1)
        if len(calls) > fails_at + (1 if fails_at else 0):
            if how == "none":
                return None, None
            raise NotImplementedError("this indexer declines THD")
        return fused.api.indexer(*args, **kwargs)

    active, probe = sign_split.observe(Counting(fused.api, indexer=declines), case, tensors, fused.context("torch"))
    assert probe == "core_attention"
    assert torch.equal(active, _plain_pattern(case, tensors, fused))
