"""The composition's hand-written backward ops (RoPE, Hadamard, the compressor's overlap window) against autograd of
the plain formula: ``gradcheck`` in float64, and bit-identity / one-rounding checks in low precision. Each check
has a negative control: a backward with the classic mistake (rotation not inverted, window halves swapped) fails."""

from __future__ import annotations

import pytest
import torch

from cases.profiles import TINY_CONFIG
from fused import ops
from fused.compressor import _OverlapWindow, _overlap

CONFIG = TINY_CONFIG.replace(compress_ratio=4)  # YaRN frequencies; Dr = 16


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _angles(rows: int, dtype=torch.float64):
    positions = torch.arange(rows, dtype=torch.float64).view(-1, 1) * 7.0
    angle = positions.unsqueeze(-1) * ops.inv_freq(CONFIG)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def _turn(cos, sin):
    return torch.complex(cos, sin)


def _plain_rope(x, cos, sin):
    """The textbook formula autograd differentiates through slices / stack / cat."""
    r = 2 * cos.shape[-1]
    rope = x[..., -r:].to(cos.dtype)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], -1)


def test_rope_backward_is_the_inverse_rotation():
    cos, sin = _angles(6)
    x = torch.randn(6, 3, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops._Rotate.apply(t, _turn(cos, sin)), (x,))
    assert torch.allclose(ops._Rotate.apply(x, _turn(cos, sin)), _plain_rope(x, cos, sin), rtol=0, atol=1e-15)


def test_rope_bf16_rounds_once_like_autograd_of_the_plain_formula():
    cos, sin = _angles(6, torch.float32)
    x = torch.randn(6, 3, 24).bfloat16().requires_grad_(True)
    g = torch.randn(6, 3, 24).bfloat16()
    y = ops._Rotate.apply(x, _turn(cos, sin))
    ours = torch.autograd.grad(y, x, g)[0]
    plain_y = _plain_rope(x, cos, sin)
    plain = torch.autograd.grad(plain_y, x, g)[0]
    assert y.dtype == ours.dtype == torch.bfloat16
    # fp32 math rounded once to bf16: equal but where the fp32 values straddle a bf16 rounding boundary
    for a, b in ((y, plain_y), (ours, plain)):
        assert (a.float() - b.float()).abs().le(b.float().abs() * 2 ** -8 + 1e-30).all()
        assert (a == b).float().mean() > 0.98
    assert torch.equal(y[..., :-16], x[..., :-16])  # the nope dims pass through untouched


def test_rope_negative_control_a_forward_rotation_as_backward_fails_gradcheck():
    cos, sin = _angles(6)

    class NotInverted(ops._Rotate):
        @staticmethod
        def backward(ctx, grad):
            (turn,) = ctx.saved_tensors
            return ops._rotate(grad, turn), None

    x = torch.randn(6, 3, 24, dtype=torch.float64, requires_grad=True)
    assert not torch.autograd.gradcheck(lambda t: NotInverted.apply(t, _turn(cos, sin)), (x,), raise_exception=False)


def test_apply_rope_inverse_undoes_it():
    x = torch.randn(5, 2, 24, dtype=torch.float64)
    pos = torch.arange(5).view(-1, 1)
    back = ops.apply_rope(ops.apply_rope(x, pos, CONFIG), pos, CONFIG, inverse=True)
    assert torch.allclose(back, x, atol=1e-12)


def test_hadamard_gradcheck_and_orthogonality():
    x = torch.randn(4, 3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops.hadamard, (x,))
    y = ops.hadamard(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))  # scaled Sylvester matrix: orthogonal
    assert torch.allclose(ops.hadamard(y), x)  # and symmetric, so it is its own inverse


def test_hadamard_bf16_rounds_once():
    x = torch.randn(7, 32).bfloat16()
    exact = (x.double() @ ops._sylvester(32) * 32 ** -0.5)
    assert torch.equal(ops.hadamard(x), exact.float().bfloat16())
    assert not torch.equal((x @ ops._sylvester(32).bfloat16()) * torch.tensor(32 ** -0.5).bfloat16(),
                           exact.float().bfloat16())  # negative control: rounding the sums and the scale twice


def _plain_overlap(t, first, fill, d):
    prev = torch.roll(t[..., :d], shifts=1, dims=0)
    prev = torch.where(first.view((-1,) + (1,) * (t.dim() - 1)), torch.full_like(prev, fill), prev)
    return torch.cat([prev, t[..., d:]], dim=1)


@pytest.mark.parametrize("shape", [(5, 4, 6), (5, 4, 2, 6), (1, 4, 6)], ids=["thd", "sbhd", "one_row"])
def test_overlap_window_matches_roll_where_cat_and_its_gradient(shape):
    first = torch.zeros(shape[0], dtype=torch.bool)
    first[0] = True
    if shape[0] > 3:
        first[3] = True  # a second segment starts
    t = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.equal(_overlap(t, first, float("-inf"), 3), _plain_overlap(t, first, float("-inf"), 3))
    assert torch.autograd.gradcheck(lambda x: _overlap(x, first, 0.0, 3), (t,))
    g = torch.randn(_plain_overlap(t, first, 0.0, 3).shape, dtype=torch.float64)
    ours = torch.autograd.grad(_overlap(t, first, 0.0, 3), t, g)[0]
    assert torch.equal(ours, torch.autograd.grad(_plain_overlap(t, first, 0.0, 3), t, g)[0])


def test_overlap_negative_control_halves_swapped_in_backward_fails_gradcheck():
    class Swapped(_OverlapWindow):
        @staticmethod
        def backward(ctx, grad):
            g = _OverlapWindow.backward(ctx, grad)[0]
            d = g.shape[-1] // 2
            return torch.cat([g[..., d:], g[..., :d]], -1), None, None, None

    first = torch.tensor([True, False, False, True, False]).view(-1, 1, 1)
    t = torch.randn(5, 4, 6, dtype=torch.float64, requires_grad=True)
    assert not torch.autograd.gradcheck(lambda x: Swapped.apply(x, first, 0.0, 3), (t,), raise_exception=False)
