"""Stand-in ``gather-backward-atomic``: the backward of production's unfused KV gather runs PyTorch's atomic
``scatter_add`` instead of its deterministic sort, on CUDA, with the same values.

``unfused_compressed_sparse_attn`` (``csa.py``) gathers each query row's keys as
``torch.gather(kv.unsqueeze(0).expand(rows, -1, -1), 1, idx.unsqueeze(-1).expand(-1, -1, hn))``. Its backward
(``GatherBackward0``) scatters ``rows x width x hn`` gradients into zeros of the expanded ``[rows, n_kv, hn]``. The
harness runs with ``torch.use_deterministic_algorithms(True)`` (``parity.engine.configure_torch``; production's own
default is off), under which CUDA ``scatter_add_`` becomes an ``index_put_`` with accumulation over
``rows x width x hn`` materialised int64 indices and a cub radix sort of them: tens of GB and most of the unfused
backward's time on kernel-size cases, and ``RuntimeError: cub sort does not support sorting more than INT_MAX
elements`` once ``rows x width x hn > 2**31 - 1`` (gate case ``fe59be1d4d86``: 4,092 rows x 1,152 slots x 512).

The values are the same either way: each element of the ``[rows, n_kv, hn]`` buffer receives at most one non-zero
term (a row's valid ids are distinct; its invalid slots, clamped to id 0, carry exact zeros: their scores are masked
to ``-inf`` and their weights are 0), so no sum depends on order; only the sign of an exact zero can differ.

:func:`install` hooks every ``GatherBackward0`` node of that shape (input expanded along dim 0, ``dim == 1``, index
expanded along its last dim) in a graph: a pre-hook turns deterministic algorithms off for that node, a post-hook
restores them; :func:`restored` puts the flag back if a backward stopped in between. ``DSV4_MEGATRON_DETERMINISTIC_
GATHER=1`` keeps PyTorch's deterministic path (diagnostic).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

ENV = "DSV4_MEGATRON_DETERMINISTIC_GATHER"
NOTE = ("gather-backward-atomic (CUDA, deterministic mode: the unfused KV gather's backward scatters with atomics "
        "instead of a sort of rows x width x hn indices; same values, each buffer element gets one non-zero term)")


def enabled() -> bool:
    return os.environ.get(ENV, "") in ("", "0")


def _nodes(root) -> Iterator:
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        todo.extend(fn for fn, _ in node.next_functions)


def _is_kv_gather(node, cuda_only: bool = True) -> bool:
    """A ``GatherBackward0`` of ``gather(x.expand(rows, ...), 1, idx.expand(..., hn))`` (production's KV gather)."""
    if node.name() != "GatherBackward0":
        return False
    try:
        source, index, dim = node._saved_self, node._saved_index, node._saved_dim
    except (AttributeError, RuntimeError):
        return False
    return (dim == 1 and source.dim() == 3 and index.dim() == 3 and (source.is_cuda or not cuda_only)
            and source.stride(0) == 0
            and index.stride(-1) == 0 and index.shape[0] == source.shape[0])


def install(output: torch.Tensor, *, cuda_only: bool = True) -> int:
    """Hook the KV gathers in ``output``'s graph (none unless deterministic algorithms are on and, with
    ``cuda_only``, the tensors are on CUDA: the CPU scatter has no sort); returns how many were hooked."""
    if not (enabled() and (output.is_cuda or not cuda_only) and output.grad_fn is not None
            and torch.are_deterministic_algorithms_enabled()):
        return 0
    hooked = 0
    for node in _nodes(output.grad_fn):
        if not _is_kv_gather(node, cuda_only):
            continue
        saved: list = []

        def pre(_grads, saved=saved):
            saved.append(torch.is_deterministic_algorithms_warn_only_enabled())
            torch.use_deterministic_algorithms(False)

        def post(_inputs, _outputs, saved=saved):
            torch.use_deterministic_algorithms(True, warn_only=saved.pop() if saved else True)

        node.register_prehook(pre)
        node.register_hook(post)
        hooked += 1
    return hooked


@contextlib.contextmanager
def restored() -> Iterator[None]:
    """The deterministic-algorithms flag as it was at entry, again at exit (a backward that raised inside a hooked
    node never ran its post-hook)."""
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) \
                != (on, warn):
            torch.use_deterministic_algorithms(on, warn_only=warn)
