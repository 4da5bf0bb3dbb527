"""Orthonormal Walsh-Hadamard rotation of the indexer's q and k (spec §2, §3, ``rotate_activation``).

``rotate_activation(x) = x @ H_d / sqrt(d)`` with ``H_d`` the Sylvester-ordered Hadamard matrix
(``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``, i.e. ``H[i, j] = (-1)**popcount(i & j)``). ``H_d / sqrt(d)`` is
symmetric and orthogonal, so it leaves the indexer's dot products unchanged in exact arithmetic.
"""

from __future__ import annotations

import functools

import torch

from .numerics import compute_dtype


@functools.lru_cache(maxsize=None)
def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The ``d x d`` Sylvester Hadamard matrix (entries +-1); ``d`` must be a power of two. A constant of its
    arguments, built once per ``(d, dtype, device)`` (read-only: no caller writes to it)."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two size, got {d}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    block = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=dtype, device=device)
    while h.shape[0] < d:
        h = torch.kron(block, h)
    return h


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """``x @ H / sqrt(d)`` over the last dim of ``x [..., d]``; computed in float32/64, returned in ``x.dtype``."""
    d = x.shape[-1]
    work = compute_dtype(x.dtype)
    h = hadamard_matrix(d, work, x.device)
    return ((x.to(work) @ h) * d ** -0.5).to(x.dtype)
