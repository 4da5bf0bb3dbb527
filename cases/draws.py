"""The standard-normal-like draw every case tensor starts from: counter-based, made on the device the case runs on.

Tensor ``name`` of a case with seed ``seed`` uses the SplitMix64 stream of :class:`cases.rng.Rng` ``(seed, name)``
(state: the first 8 bytes of the sha256 of ``"{seed}/{name}"``, little endian). Output ``n`` of that stream
(``n = 1, 2, ...``) is a pure function of the state and ``n``, so every element is computed independently::

    z_n = mix64(state + n * 0x9E3779B97F4A7C15)                 (64-bit wrapping arithmetic, SplitMix64's mix)
    element i of the flattened tensor: its four 32-bit halves of z_{2i+1} and z_{2i+2}, v_1 .. v_4, give
    x_i = sqrt(3) * ((v_1 + v_2 + v_3 + v_4 + 2) / 2**32 - 2)

``x`` is the Irwin-Hall sum of four uniforms ``(v + 1/2) / 2**32`` on ``(0, 1)``, centred and scaled to unit
variance: symmetric, unimodal, bounded by ``±2·sqrt(3) ≈ ±3.46`` (a normal's tails beyond that carry 5e-4 of its
mass). Every step is exact integer arithmetic or an exactly representable float64 value, except the final
multiplication by ``sqrt(3)``, one correctly rounded IEEE operation. So the values are bit-identical on every device
(CPU, CUDA), thread count and machine, and a case drawn on the GPU needs no host draw and no host-to-device copy.

Integers are torch ``int64`` (two's complement, wrapping multiplication); SplitMix64's logical right shifts are
arithmetic shifts masked to the shifted-in width.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from .rng import GOLDEN, MIX, stream_state

GENERATOR = "splitmix64-irwin-hall-4"
"""This draw's name, recorded in each run's environment (``env.generator``)."""
BLOCK = {"cpu": 1 << 17, "cuda": 1 << 22}
"""Elements drawn at once, per device type: on the CPU a block's int64 temporaries stay in cache (every step is one
pass over them, in place); on a GPU they bound the temporaries' memory (~20 B an element)."""
SQRT3 = math.sqrt(3.0)
LOW32 = (1 << 32) - 1


def _signed(value: int) -> int:
    """``value`` mod 2**64 as a signed 64-bit integer (how torch's int64 holds it)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _xor_shifted(z: torch.Tensor, bits: int, scratch: torch.Tensor) -> None:
    """``z ^= z >>> bits`` (logical shift) on int64 ``z``, in place, through ``scratch`` (like ``z``)."""
    torch.bitwise_right_shift(z, bits, out=scratch)
    scratch &= (1 << (64 - bits)) - 1
    z ^= scratch


def _mix(z: torch.Tensor, scratch: torch.Tensor) -> None:
    """SplitMix64's output function, in place on int64 ``z``."""
    _xor_shifted(z, 30, scratch)
    z *= _signed(MIX[0])
    _xor_shifted(z, 27, scratch)
    z *= _signed(MIX[1])
    _xor_shifted(z, 31, scratch)


def standard_normal(seed: int, name: str, numel: int, device: Union[str, torch.device] = "cpu",
                    start: int = 0) -> torch.Tensor:
    """Elements ``[start, start + numel)`` of tensor ``name``'s draw (module docstring), float64 ``[numel]`` on
    ``device``."""
    device = torch.device(device)
    state = _signed(stream_state(seed, name))
    out = torch.empty(numel, dtype=torch.float64, device=device)
    block = BLOCK.get(device.type, BLOCK["cuda"])
    z = torch.empty(2 * min(block, numel), dtype=torch.int64, device=device)
    scratch = torch.empty_like(z)
    for a in range(0, numel, block):
        b = min(numel, a + block)
        n = 2 * (b - a)
        zb, sb = z[:n], scratch[:n]
        torch.arange(2 * (start + a) + 1, 2 * (start + b) + 1, dtype=torch.int64, device=device, out=zb)
        zb *= _signed(GOLDEN)
        zb += state
        _mix(zb, sb)
        torch.bitwise_right_shift(zb, 32, out=sb)
        sb &= LOW32
        zb &= LOW32
        zb += sb                                              # v_1 + v_2 of each output, exact in int64
        x = out[a:b]
        torch.sum(zb.view(-1, 2), dim=1, out=sb[:b - a])      # + v_3 + v_4 of the next output: < 2**35
        x.copy_(sb[:b - a])                                   # exact in float64
        x.add_(2.0).mul_(2.0 ** -32).sub_(2.0).mul_(SQRT3)
    return out
