"""Stand-ins for the parts of Megatron-LM's environment a CPU machine lacks, each used only when the real part is
absent and each recorded (the run row lists them).

* ``paged_stash``: ``megatron/core/transformer/moe/ops/paged_stash.py`` imports ``triton`` unguarded (MoE only, never
  called by attention). Without triton an empty module takes its place in ``sys.modules``; a fake top-level
  ``triton`` would break torch's own inductor, so only that one module is replaced.
* ``plain-linear``: TransformerEngine's ``TELinear`` (the spec's ``backend.linear()``), when TE is not importable:
  :class:`PlainLinear`, ``y = x W^T`` returning ``(y, None)`` like Megatron's linears.
* ``hadamard``: ``rotate_activation`` (``dsa.py``) needs the CUDA package ``fast_hadamard_transform`` and bf16; the
  exact Hadamard matmul ``x H_d d^-1/2`` in fp32 math stands in (float64 math when the islands are promoted).
* ``cpu-device``: ``torch.cuda.current_device()`` used as an allocation device (parameters, RoPE tables) reads
  ``"cpu"`` while a CPU case runs.
* ``no-stream-capture``: ``torch.cuda.is_current_stream_capturing()`` reads False without CUDA (the CPU build of torch
  raises there; the oldest API generation's unfused THD indexer loss asks, forward and backward).
* ``process-group``: a 1-rank gloo default group over a ``HashStore`` for tensor and context parallelism.
* ``q-rms-norm-eager``: ``@torch.compile _q_rms_norm`` runs with dynamo disabled (compiling costs 10-20 s per new
  shape on CPU and needs a C++ compiler); the function's own body computes the same values.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Iterator

import torch

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install_paged_stash(used: list[str]) -> None:
    """Before importing Megatron: the MoE ``paged_stash`` Triton module, when triton is absent."""
    if has_module("triton") or PAGED_STASH in sys.modules:
        return
    stub = types.ModuleType(PAGED_STASH)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.__doc__ = "dsv4-parity stand-in: MoE paged-stash Triton kernels (triton is not installed)"

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError("paged_stash Triton kernels are a dsv4-parity stand-in (no triton)")

    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _unavailable
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[PAGED_STASH] = stub
    used.append("paged_stash (no triton)")


class PlainLinear(torch.nn.Module):
    """TELinear's place without TransformerEngine: weight ``[out, in]``, ``forward(x) -> (x W^T, None)``.
    Takes (and ignores) Megatron's parallelism keywords; TP size is 1 here."""

    def __init__(self, input_size: int, output_size: int, *, config=None, init_method=None, bias: bool = False,
                 skip_bias_add: bool = False, **_ignored):
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        if init_method is not None:
            init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor):
        y = torch.nn.functional.linear(x, self.weight)
        if self.bias is None:
            return y, None
        return (y, self.bias) if self.skip_bias_add else (y + self.bias, None)

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: nothing is delayed here."""


def hadamard_matrix(d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Sylvester Hadamard ``H_d`` (``d`` a power of two), entries ±1."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def make_rotate_activation(promote: bool):
    """The stand-in for ``rotate_activation``: ``x H_d d^-1/2`` computed in fp32 (float64 with ``promote``), returned
    in ``x``'s dtype, as the CUDA kernel (fp32 accumulation, one rounding)."""

    def rotate_activation(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        math_dtype = torch.float64 if (promote and x.dtype == torch.float64) else torch.float32
        h = hadamard_matrix(d, math_dtype, x.device)
        return (torch.matmul(x.to(math_dtype), h) * d ** -0.5).to(x.dtype)

    return rotate_activation


@contextlib.contextmanager
def cpu_device_calls(active: bool) -> Iterator[None]:
    """``torch.cuda.current_device()`` returns ``"cpu"`` inside the block (only when ``active``)."""
    if not active:
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


@contextlib.contextmanager
def no_stream_capture(active: bool) -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` returns False inside the block (only when ``active``: no CUDA,
    where the CPU build of torch raises; the oldest API generation's unfused THD loss asks, forward and backward)."""
    if not active:
        yield
        return
    original = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original


def one_rank_group():
    """A 1-rank gloo process group over an in-memory store (no environment variables, no sockets to peers). Megatron's
    linears look their group up only when ``torch.distributed`` is initialised, so this initialises the default group
    of this process (once) when nothing else has."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD
