"""Stand-in ``gather-backward-atomic``: the backward of production's unfused KV gather runs PyTorch's atomic
``scatter_add`` instead of its deterministic sort, on CUDA, with the same values.

``unfused_compressed_sparse_attn`` (``csa.py``) gathers each query row's keys as
``torch.gather(kv.unsqueeze(0).expand(rows, -1, -1), 1, idx.unsqueeze(-1).expand(-1, -1, hn))``. Its backward
scatters ``rows x width x hn`` gradients into zeros of the expanded ``[rows, n_kv, hn]`` (``aten.scatter_add`` along
dim 1 with that index). The harness runs with ``torch.use_deterministic_algorithms(True)``
(``parity.engine.configure_torch``; production's own default is off), under which CUDA ``scatter_add`` becomes an
``index_put_`` with accumulation over ``rows x width x hn`` materialised int64 indices and a cub radix sort of them:
tens of GB and most of the unfused backward's time on kernel-size cases, and ``RuntimeError: cub sort does not
support sorting more than INT_MAX elements`` once ``rows x width x hn > 2**31 - 1`` (gate cases ``fe59be1d4d86``:
4,092 rows x 1,152 slots x 512, and ``e0e0647850c7``: 3,856 x 1,092 x 512).

The values are the same either way: each element of the ``[rows, n_kv, hn]`` buffer receives at most one non-zero
term (a row's valid ids are distinct; its invalid slots, clamped to id 0, carry exact zeros: their scores are masked
to ``-inf`` and their weights are 0), so no sum depends on order; only the sign of an exact zero can differ.

:func:`atomic_kv_scatter` is a dispatch mode over the unfused provider's block (forward and backward). It notes the
index of each forward ``gather`` of that shape (:func:`is_kv_gather`: the source expanded over the rows, which is
what makes each buffer element receive one term), and each backward ``scatter_add`` with that same index
(:func:`is_kv_scatter`) runs with deterministic algorithms off, the flag put back after it, also when it raised. A
scatter of the same shape whose forward gather read an unexpanded source (ids may repeat in a row: its sums depend on
order) keeps the deterministic path. It acts on the op, not on the autograd graph: an earlier version hooked the
``GatherBackward0`` nodes of the layer output's graph and, on the H200 (2026-12-06, ``.ci/probes/gather_backward.py
e0e0647850c7``), found none there while the backward still ran that scatter and raised.
``DSV4_MEGATRON_DETERMINISTIC_GATHER=1`` keeps PyTorch's deterministic path (diagnostic).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ENV = "DSV4_MEGATRON_DETERMINISTIC_GATHER"
NOTE = ("gather-backward-atomic (CUDA, deterministic mode: the unfused KV gather's backward scatters with atomics "
        "instead of a sort of rows x width x hn indices; same values, each buffer element gets one non-zero term)")
_SCATTER_ADD = (torch.ops.aten.scatter_add, torch.ops.aten.scatter_add_)
_GATHER = torch.ops.aten.gather


def enabled() -> bool:
    return os.environ.get(ENV, "") in ("", "0")


def is_kv_gather(args: tuple, cuda_only: bool = True) -> bool:
    """``gather(source [rows, n_kv, hn], 1, index [rows, width, hn])`` with ``source`` expanded over the rows (stride
    0) and ``index`` over its last dim: production's KV gather, forward."""
    if len(args) < 3:
        return False
    source, dim, index = args[:3]
    if not (isinstance(source, torch.Tensor) and isinstance(index, torch.Tensor)) or dim not in (1, -2):
        return False
    return (source.dim() == 3 and index.dim() == 3 and (source.is_cuda or not cuda_only) and source.stride(0) == 0
            and index.stride(-1) == 0 and index.shape[0] == source.shape[0])


def _key(index: torch.Tensor) -> tuple:
    """An index tensor as autograd hands it from the forward to the backward (same storage, shape and strides)."""
    return index.data_ptr(), tuple(index.shape), tuple(index.stride())


def is_kv_scatter(args: tuple, cuda_only: bool = True) -> bool:
    """``scatter_add(self [rows, n_kv, hn], 1, index [rows, width, hn], src [rows, width, hn])`` with ``index``
    expanded along its last dim (stride 0): the shape of the backward of production's KV gather (the mode also asks
    that its forward gather was :func:`is_kv_gather`)."""
    if len(args) < 4:
        return False
    target, dim, index, src = args[:4]
    if not all(isinstance(t, torch.Tensor) for t in (target, index, src)) or dim not in (1, -2):
        return False
    return (target.dim() == 3 and index.dim() == 3 and (target.is_cuda or not cuda_only)
            and index.stride(-1) == 0 and index.shape[0] == target.shape[0] and index.shape[-1] == target.shape[-1]
            and tuple(src.shape) == tuple(index.shape))


class _AtomicKvScatter(TorchDispatchMode):
    """Runs the backward scatter of each :func:`is_kv_gather` with deterministic algorithms off; counts them in
    ``made_atomic``."""

    def __init__(self, cuda_only: bool = True):
        super().__init__()
        self.cuda_only = cuda_only
        self.made_atomic = 0
        self.gathers: set = set()  # _key of the index of each KV gather of the block's forward

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Not a reason for TorchDynamo to leave production's compiled functions eager (it skips frames while a
        user dispatch mode is active)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is _GATHER and is_kv_gather(args, self.cuda_only):
            self.gathers.add(_key(args[2]))
        elif (func.overloadpacket in _SCATTER_ADD and torch.are_deterministic_algorithms_enabled()
                and is_kv_scatter(args, self.cuda_only) and _key(args[2]) in self.gathers):
            warn = torch.is_deterministic_algorithms_warn_only_enabled()
            torch._C._set_deterministic_algorithms(False)
            try:
                result = func(*args, **kwargs)
            finally:
                torch._C._set_deterministic_algorithms(True, warn_only=warn)
            self.made_atomic += 1
            return result
        return func(*args, **kwargs)


@contextlib.contextmanager
def atomic_kv_scatter(*, cuda_only: bool = True) -> Iterator[Optional[_AtomicKvScatter]]:
    """The stand-in over a block (the unfused provider's forward and backward): yields the mode (its
    ``made_atomic`` count), or None where it does nothing (the diagnostic set, or with ``cuda_only`` no CUDA: the
    CPU scatter has no sort)."""
    if not enabled() or (cuda_only and not torch.cuda.is_available()):
        yield None
        return
    with _AtomicKvScatter(cuda_only) as mode:
        yield mode
