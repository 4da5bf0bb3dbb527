"""``torch.autograd.gradcheck`` (float64) of core attention and the whole layer, r = 0 / 4 / 128, dense and sparse loss.

Each check wraps the implementation as a function of plain tensors. The attention output is checked against every
input and parameter; the indexer loss only against the indexer parameters, because its teacher is detached on
purpose (spec §5.2: a finite difference through the backbone would move the teacher, autograd must not).
Top-k selections are piecewise constant: the tiny shapes keep every score far from a tie at eps = 1e-6.
Fast-mode gradcheck probes each input tensor along one random direction (the per-stage checks in the other files
run the element-wise mode where it is cheap).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from reference import attention_layer, core_attention

from .helpers import bshd, case_of, materialized, thd_layout, tiny_config

LAYER_CASES = {"r0": (tiny_config(0), 7), "r4_sparse": (tiny_config(4), 13),
               "r4_dense": (tiny_config(4, sparse=False), 13), "r4_dense_mode": (tiny_config(4, dense_mode=True), 13),
               "r128": (tiny_config(128), 130)}


def functional(fn, leaves, fixed, select):
    """``fn(**fixed, **leaves)`` as a function of the tensors of ``leaves`` (positional) for gradcheck, which
    probes each of them separately. Returns ``(function, inputs)``."""
    names = list(leaves)

    def wrapped(*values):
        return select(fn(**fixed, **dict(zip(names, values))))

    return wrapped, tuple(leaves[n] for n in names)


def layer_fn(config, psp=None):
    def run(hidden, **params):
        return attention_layer(hidden, params, config, psp)
    return run


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_gradcheck_layer_output(name):
    config, seq = LAYER_CASES[name]
    t = materialized(case_of(config, bshd(1, seq)))
    fn, inputs = functional(layer_fn(config), {"hidden": t.inputs["hidden"], **t.params}, {}, lambda r: r.out)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@pytest.mark.parametrize("name", ["r4_sparse", "r4_dense"])
def test_gradcheck_layer_indexer_loss_wrt_indexer_parameters(name):
    config, seq = LAYER_CASES[name]
    t = materialized(case_of(config, bshd(2, seq)))
    trained = [n for n in t.params if n.startswith("core_attention.indexer.")]
    fixed = {"hidden": t.inputs["hidden"].detach(), **{n: p.detach() for n, p in t.params.items() if n not in trained}}
    fn, inputs = functional(layer_fn(config), {n: t.params[n] for n in trained}, fixed, lambda r: r.indexer_loss)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@pytest.mark.parametrize("name", ["r0", "r4_sparse", "r128"])
def test_gradcheck_core_attention(name):
    config, seq = LAYER_CASES[name]
    t = materialized(case_of(config, bshd(1, seq), scope="core"))

    def run(query, kv, hidden, q_latent, **params):
        return core_attention(query, kv, hidden, q_latent, params, config)

    fn, inputs = functional(run, {**t.inputs, **t.params}, {}, lambda r: (r.out, r.lse))
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def test_gradcheck_thd_layer_real_rows():
    config = tiny_config(4)
    layout = thd_layout([5, 0, 9], [8, 0, 9], slack=2)
    t = materialized(case_of(config, layout))
    real = t.real_rows
    fn, inputs = functional(layer_fn(config, t.packed_seq_params), {"hidden": t.inputs["hidden"], **t.params}, {},
                            lambda r: r.out[real])
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def test_gradcheck_negative_control_detects_a_planted_stop_gradient(monkeypatch):
    """Planting a detach on the compressed KV (a wrong backward) must make the layer gradcheck fail.

    Probed through the compressor's norm weight alone (16 numbers): on failure gradcheck re-runs the failing input
    element by element to report it, which must stay cheap.
    """
    core_module = importlib.import_module("reference.core_attention")
    original = core_module.compress_with_params
    monkeypatch.setattr(core_module, "compress_with_params", lambda *a, **k: original(*a, **k).detach())
    config, seq = LAYER_CASES["r128"]
    t = materialized(case_of(config, bshd(1, seq)))
    probe = "core_attention.compressor.norm.weight"
    fixed = {"hidden": t.inputs["hidden"].detach(), **{n: p.detach() for n, p in t.params.items() if n != probe}}
    fn, inputs = functional(layer_fn(config), {probe: t.params[probe]}, fixed, lambda r: r.out)
    assert not torch.autograd.gradcheck(fn, inputs, fast_mode=True, raise_exception=False)
    monkeypatch.setattr(core_module, "compress_with_params", original)  # control of the control: passes unplanted
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)
