"""The shared vocabulary (``cases.vocabulary``) and the implementation hooks (``parity.impls``)."""

from __future__ import annotations

import contextlib
import types

import fused
from cases.vocabulary import OUTCOMES, TENSOR_CLASSES, TOLERANCED_CLASSES, Unsupported
from parity import impls, policy
from parity.run import junit, results
from reports import drift, load, markdown, summary


def test_the_vocabulary_is_defined_once():
    assert results.OUTCOMES is OUTCOMES and load.OUTCOMES is OUTCOMES and summary.OUTCOMES is OUTCOMES
    assert policy.TOLERANCED_CLASSES is TOLERANCED_CLASSES and drift.TENSOR_CLASSES is TENSOR_CLASSES
    assert junit.OUTCOMES is OUTCOMES and markdown.OUTCOMES is OUTCOMES


def test_unsupported_is_a_type_not_a_name():
    """fused's declines are ``Unsupported``; a class merely *named* like one is an error (negative control)."""
    assert impls.is_unsupported(fused.StageUnsupported("sparse_attn_fwd", "cudnn", "bf16 only"))
    assert impls.is_unsupported(fused.BackendUnavailable("no GPU"))
    assert impls.is_unsupported(NotImplementedError("not yet"))

    class KernelLimit(Unsupported):
        pass

    class LooksUnsupported(RuntimeError):
        pass

    assert impls.is_unsupported(KernelLimit("head dim 80"))
    assert not impls.is_unsupported(LooksUnsupported("a real error"))
    assert not impls.is_unsupported(RuntimeError("CUDA error"))


def test_provider_hooks_protocol():
    """An implementation has providers iff it has both hooks; its context calls ``use_backend``."""
    calls = []

    @contextlib.contextmanager
    def use_backend(provider="auto", require=()):
        calls.append((provider, require))
        yield types.SimpleNamespace(record={})

    full = types.SimpleNamespace(use_backend=use_backend, available_providers=lambda: ["torch"])
    impl = impls.Implementation("x", full)
    assert impl.has_providers and impl.providers() == {"torch": None}
    with impl.context("torch", "torch")():
        pass
    assert calls == [("torch", ("torch",))]
    half = impls.Implementation("y", types.SimpleNamespace(use_backend=use_backend))
    assert not half.has_providers and half.providers() == {} and half.resolve_provider("torch") == "none"
    assert impls.load("fused").has_providers and not impls.load("reference").has_providers
