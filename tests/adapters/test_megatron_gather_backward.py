"""Stand-in ``gather-backward-atomic`` (:mod:`adapters.megatron.gather_backward`), on CPU with the CUDA check off:
only production's KV-gather pattern is hooked, deterministic algorithms are off exactly while its backward node runs
and restored after (also after a backward that raised), and the gradients are those of the unhooked graph; and stand-in ``no-weight-init``'s guard (every production parameter
comes from the case)."""

from __future__ import annotations

import pytest
import torch

from adapters.megatron import gather_backward


def _kv_gather(kv, idx):
    """``unfused_compressed_sparse_attn``'s gather and use of the keys (csa.py), invalid slots masked."""
    rows, hn = idx.shape[0], kv.shape[-1]
    gathered = torch.gather(kv.unsqueeze(0).expand(rows, -1, -1), 1,
                            idx.clamp(min=0).long().unsqueeze(-1).expand(-1, -1, hn))
    scores = gathered.sum(-1).masked_fill(idx < 0, float("-inf"))
    return (torch.softmax(scores, -1).unsqueeze(-1) * gathered).sum(1)


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _inputs():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(9, 4, generator=g, requires_grad=True)
    idx = torch.tensor([[0, 1, -1, -1], [2, 0, 5, -1], [8, 7, 6, 0]])
    return kv, idx


def test_only_the_kv_gather_is_hooked_and_the_flag_is_off_only_inside_it(deterministic):
    kv, idx = _inputs()
    out = _kv_gather(kv, idx)
    plain = torch.gather(kv, 0, torch.zeros(3, 4, dtype=torch.long))  # negative control: no expanded input
    seen = []
    probe = out.sum() + plain.sum()
    probe.register_hook(lambda g: seen.append(("before", torch.are_deterministic_algorithms_enabled())))
    assert gather_backward.install(probe, cuda_only=False) == 1
    assert gather_backward.install(probe) == 0  # on CPU the default leaves the graph alone
    hooks = []
    for node in gather_backward._nodes(probe.grad_fn):
        if node.name() == "GatherBackward0" and gather_backward._is_kv_gather(node, cuda_only=False):
            node.register_prehook(lambda g: hooks.append(torch.are_deterministic_algorithms_enabled()))
    torch.autograd.grad(probe, [kv])
    assert seen == [("before", True)] and hooks == [False]
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()


def test_the_gradients_are_those_of_the_unhooked_graph(deterministic):
    kv, idx = _inputs()
    want, = torch.autograd.grad(_kv_gather(kv, idx).pow(2).sum(), [kv])
    out = _kv_gather(kv, idx).pow(2).sum()
    assert gather_backward.install(out, cuda_only=False) == 1
    got, = torch.autograd.grad(out, [kv])
    assert torch.equal(got, want)


def test_the_flag_is_restored_after_a_backward_that_raised_inside_the_node(deterministic):
    kv, idx = _inputs()
    out = _kv_gather(kv, idx).sum()
    gather_backward.install(out, cuda_only=False)
    for node in gather_backward._nodes(out.grad_fn):
        if node.name() == "GatherBackward0":
            node.register_prehook(lambda g: (_ for _ in ()).throw(RuntimeError("planted")))
    with pytest.raises(RuntimeError, match="planted"), gather_backward.restored():
        torch.autograd.grad(out, [kv])
    assert torch.are_deterministic_algorithms_enabled()


def test_without_deterministic_mode_or_with_the_diagnostic_nothing_is_hooked(deterministic, monkeypatch):
    kv, idx = _inputs()
    monkeypatch.setenv(gather_backward.ENV, "1")
    assert gather_backward.install(_kv_gather(kv, idx).sum(), cuda_only=False) == 0
    monkeypatch.delenv(gather_backward.ENV)
    torch.use_deterministic_algorithms(False)
    assert gather_backward.install(_kv_gather(kv, idx).sum(), cuda_only=False) == 0


def test_a_production_parameter_the_case_lacks_is_an_error_not_uninitialised_memory():
    """The layer is built with ``perform_initialization=False`` (stand-in ``no-weight-init``): every parameter must
    come from the case. Negative control: the full set passes, at layer and at core scope."""
    import types

    from adapters.megatron.layer import CORE_PREFIX, _check_covered

    built = types.SimpleNamespace(names=("linear_q_down_proj.weight", "core_attention.attn_sink"))
    _check_covered(built, {"linear_q_down_proj.weight": 0, "core_attention.attn_sink": 0})
    _check_covered(built, {"attn_sink": 0}, CORE_PREFIX)
    with pytest.raises(RuntimeError, match="linear_q_down_proj.weight"):
        _check_covered(built, {"core_attention.attn_sink": 0})
    with pytest.raises(RuntimeError, match="core_attention.attn_sink"):
        _check_covered(built, {}, CORE_PREFIX)
