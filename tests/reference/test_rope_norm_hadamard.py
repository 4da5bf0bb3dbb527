"""RoPE (partial, pair-interleaved, inverse, plain / YaRN), RMS norms and the Hadamard rotation (spec §1.4, §3)."""

from __future__ import annotations

import math

import pytest
import torch

from reference.hadamard import hadamard_matrix, rotate_activation
from reference.norms import head_rms_norm, rms_norm
from reference.rope import apply_rope, layer_inv_freq, plain_inv_freq, yarn_inv_freq

from .helpers import tiny_config


def complex_rope_oracle(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int):
    """The pair rotation written as a complex product: (u[2j] + i u[2j+1]) * exp(i p w_j) on the last rope_dim."""
    nope, u = x[..., :-rope_dim], x[..., -rope_dim:]
    z = torch.complex(u[..., 0::2], u[..., 1::2])
    z = z * torch.polar(torch.ones_like(inv_freq), positions.double().unsqueeze(-1) * inv_freq)
    return torch.cat((nope, torch.view_as_real(z).flatten(-2)), dim=-1)


def test_rope_is_the_pair_interleaved_complex_rotation_of_the_last_dims():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 2, 24, dtype=torch.float64)
    inv = plain_inv_freq(8, 10000.0)
    pos = torch.arange(7).view(1, 7, 1)
    got = apply_rope(x, pos, inv)
    assert torch.allclose(got, complex_rope_oracle(x, pos, inv, 8), rtol=0, atol=1e-14)
    assert torch.equal(got[..., :16], x[..., :16]), "nope dims pass through"
    # negative control: the rotate-half (non-interleaved) convention is a different map
    half = torch.cat((x[..., 16:20], x[..., 20:24]), -1)
    wrong = torch.cat((x[..., :16], complex_rope_oracle(
        torch.stack((half[..., :4], half[..., 4:]), -1).flatten(-2), pos, inv, 8)), -1)
    assert not torch.allclose(got, wrong, atol=1e-6)


def test_inverse_rope_undoes_rope_and_scores_depend_on_relative_position():
    torch.manual_seed(1)
    inv = yarn_inv_freq(8, 40000.0, 4.0, 65536, 32.0, 1.0)
    x = torch.randn(5, 9, 16, dtype=torch.float64)
    pos = torch.arange(9).view(1, 9)
    back = apply_rope(apply_rope(x, pos, inv), pos, inv, inverse=True)
    assert torch.allclose(back, x, rtol=0, atol=1e-14)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    dot = lambda i, j: float(apply_rope(q, torch.tensor(i), inv) @ apply_rope(k, torch.tensor(j), inv))
    assert dot(7, 3) == pytest.approx(dot(4, 0), abs=1e-13)
    # negative control: rotating again (instead of the inverse) does not undo it
    assert not torch.allclose(apply_rope(apply_rope(x, pos, inv), pos, inv), x, atol=1e-3)


def test_yarn_frequencies_match_the_worked_numbers_of_the_spec():
    """Base 40000, Lorig 65536, Dr 64, factor 4: low=17, high=28 (spec §1.4)."""
    extra = plain_inv_freq(64, 40000.0)
    omega = yarn_inv_freq(64, 40000.0, 4.0, 65536, 32.0, 1.0)
    j = torch.arange(32)
    assert torch.equal(omega[j <= 17], extra[j <= 17])
    assert torch.allclose(omega[j >= 28], extra[j >= 28] / 4, rtol=1e-15, atol=0)
    mid = (j > 17) & (j < 28)
    ramp = (j[mid].double() - 17) / 11.0
    assert torch.allclose(omega[mid], extra[mid] / 4 * ramp + extra[mid] * (1 - ramp), rtol=1e-15, atol=0)
    # pro variant base 160000: low=15, high=25
    pro = yarn_inv_freq(64, 160000.0, 4.0, 65536, 32.0, 1.0)
    ex_pro = plain_inv_freq(64, 160000.0)
    assert torch.equal(pro[:16], ex_pro[:16]) and not torch.equal(pro[16], ex_pro[16])
    assert torch.allclose(pro[25:], ex_pro[25:] / 4, rtol=1e-15, atol=0)


def test_layer_frequencies_plain_for_window_layers_yarn_for_compressed_layers():
    assert torch.equal(layer_inv_freq(tiny_config(0)), plain_inv_freq(8, 10000.0))
    for r in (4, 128):
        c = tiny_config(r)
        assert torch.equal(layer_inv_freq(c), yarn_inv_freq(8, c.csa_compress_rotary_base, c.rotary_scaling_factor,
                                                            c.original_max_position_embeddings, 32.0, 1.0))
    assert not torch.equal(layer_inv_freq(tiny_config(0)), layer_inv_freq(tiny_config(4)))  # control


def test_rms_norms():
    torch.manual_seed(2)
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(rms_norm(x, w, 1e-6), want, rtol=1e-14, atol=0)
    assert torch.allclose(head_rms_norm(x, 1e-6), want / w, rtol=1e-14, atol=0)
    assert not torch.allclose(rms_norm(x, w, 1e-6), x / x.norm(dim=-1, keepdim=True) * w, atol=1e-3)  # control
    low = rms_norm(x.to(torch.bfloat16), w.to(torch.bfloat16), 1e-6)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.double(), want, rtol=2e-2, atol=2e-2)


def test_hadamard_is_the_sylvester_matrix_and_orthonormal():
    d = 16
    h = hadamard_matrix(d)
    popcount = lambda v: bin(v).count("1")
    want = torch.tensor([[(-1.0) ** popcount(i & j) for j in range(d)] for i in range(d)], dtype=torch.float64)
    assert torch.equal(h, want)
    torch.manual_seed(3)
    q, k = torch.randn(5, d, dtype=torch.float64), torch.randn(7, d, dtype=torch.float64)
    assert torch.allclose(rotate_activation(q) @ rotate_activation(k).T, q @ k.T, rtol=0, atol=1e-13)
    assert torch.allclose(rotate_activation(rotate_activation(q)), q, rtol=0, atol=1e-14)
    assert not torch.allclose(rotate_activation(q), q @ want.T[torch.randperm(d)] / math.sqrt(d), atol=1e-3)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(12)


@pytest.mark.parametrize("stage", ["rope", "inverse_rope", "rms_norm", "head_rms_norm", "hadamard"])
def test_gradcheck_elementwise_stages(stage):
    torch.manual_seed(4)
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    inv = yarn_inv_freq(8, 40000.0, 4.0, 65536, 32.0, 1.0)
    pos = torch.arange(3).view(1, 3)
    fns = {"rope": (lambda a: apply_rope(a, pos, inv), (x,)),
           "inverse_rope": (lambda a: apply_rope(a, pos, inv, inverse=True), (x,)),
           "rms_norm": (lambda a, b: rms_norm(a, b, 1e-6), (x, w)),
           "head_rms_norm": (lambda a: head_rms_norm(a, 1e-6), (x,)),
           "hadamard": (rotate_activation, (x,))}
    fn, args = fns[stage]
    assert torch.autograd.gradcheck(fn, args)


def test_gradcheck_negative_control_catches_a_wrong_gradient():
    """gradcheck itself must fail on a function whose backward is wrong (detached rotation part)."""
    x = torch.randn(2, 16, dtype=torch.float64, requires_grad=True)
    inv = plain_inv_freq(8, 10000.0)

    def wrong(a):
        out = apply_rope(a, torch.arange(2), inv)
        return torch.cat((out[..., :8], out[..., 8:].detach() + 0 * a[..., 8:]), -1)

    assert not torch.autograd.gradcheck(wrong, (x,), raise_exception=False)
