"""The memory pre-check of a run: refuse, before the first case, cases whose working set cannot fit.

A case's run holds at once (lower bounds; the real peak adds activations saved for backward):

* the float64 **draws** of its inputs, parameters and output gradient (:func:`cases.tensors.materialize` draws on
  the host, then casts) — :func:`input_bytes`;
* the float64 **truth run**: those inputs again with their gradients (twice the draws), and its **outputs**
  (:func:`output_shapes`): ``out``, ``lse``, ``topk_indices`` and above all ``index_scores``, ``[B, S, S // 4]`` /
  ``[T, max_seqlen // 4]`` — quadratic in the sequence length, 80 GB in float64 for one 200,000-token sequence.

:func:`check_memory` compares that with what the host offers (``MemAvailable``) and, on CUDA, the GPU's memory;
the message names the largest tensor.
"""

from __future__ import annotations

import math
from typing import Optional

from cases.case import Case
from cases.errors import CaseError
from cases.layout import ThdLayout
from cases.tensors import input_shapes, output_shape, parameter_shapes

from parity.run.host import host_available_bytes

FLOAT64 = 8


def input_bytes(case: Case) -> int:
    """Bytes of a case's inputs, parameters and output gradient drawn in float64 (how :func:`cases.tensors.materialize`
    draws them, on the host, before casting)."""
    shapes = [*input_shapes(case).values(), *parameter_shapes(case.config, case.scope).values(), output_shape(case)]
    return FLOAT64 * sum(math.prod(s) for s in shapes)


def output_shapes(case: Case) -> dict[str, tuple]:
    """The shapes of what an implementation returns for ``case`` (``cases.outputs.AttentionOutput``)."""
    c, lay = case.config, case.layout
    rows = (lay.total_tokens,) if isinstance(lay, ThdLayout) else (lay.batch, lay.seq_len)
    shapes = {"out": output_shape(case), "lse": rows + (c.num_attention_heads,)}
    if c.has_indexer:
        shapes["topk_indices"] = rows + (c.dsa_indexer_topk,)
        shapes["index_scores"] = rows + (lay.max_seqlen // c.compress_ratio,)
    return shapes


def working_set(case: Case) -> dict[str, int]:
    """Bytes of the float64 truth run's parts: ``inputs`` (the draws), ``gradients`` (as many), one entry per
    output (:func:`output_shapes`)."""
    drawn = input_bytes(case)
    parts = {"inputs": drawn, "gradients": drawn}
    parts.update({name: FLOAT64 * math.prod(shape) for name, shape in output_shapes(case).items()})
    return parts


def device_total_bytes() -> Optional[int]:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _need(case: Case, where: str, device: str) -> tuple[int, str]:
    """``(bytes, what)`` the case needs in ``where`` (host / GPU): on CUDA the host holds only the draws."""
    if where == "host" and device == "cuda":
        return input_bytes(case), "its float64 input draws"
    parts = working_set(case)
    name, largest = max(((k, v) for k, v in parts.items() if k not in ("inputs", "gradients")),
                        key=lambda item: item[1], default=("inputs", parts["inputs"]))
    shape = output_shapes(case).get(name)
    what = "its float64 truth run: inputs, gradients and outputs"
    if shape is not None:
        what += f"; {name} {list(shape)} alone {largest / 2**30:.1f} GiB"
    return sum(parts.values()), what


def check_memory(cases, device: str, host: Optional[int] = None, gpu: Optional[int] = None) -> None:
    """Refuse (:class:`CaseError` on ``case``) cases whose working set (module docstring) exceeds what the host —
    and on CUDA the GPU — offers. Only catches cases that cannot fit: the real peak is higher."""
    host = host_available_bytes() if host is None else host
    gpu = (device_total_bytes() if device == "cuda" else None) if gpu is None else gpu
    for where, available in (("host", host), ("GPU", gpu)):
        if not available:
            continue
        too_big = [(c, *_need(c, where, device)) for c in cases]
        too_big = [item for item in too_big if item[1] > available]
        if too_big:
            case, need, what = max(too_big, key=lambda item: item[1])
            raise CaseError("case", f"{len(too_big)} case(s) cannot fit in {where} memory, e.g. {case.id}: at least "
                                    f"{need / 2**30:.1f} GiB ({what}) against {available / 2**30:.1f} GiB "
                                    "available; run them on a larger machine or leave them out (--case-id)")


# ---- expected GPU peak of a case: the worker pool's memory admission ------------------------------------------------
#: Production's unfused path (``--impl megatron --provider unfused``, ``csa.py`` ``unfused_compressed_sparse_attn``)
#: gathers each query row's keys from ``kv.unsqueeze(0).expand(rows, n_kv, hn)``; autograd's gather backward builds
#: the dense ``[rows, n_kv, hn]`` gradient of that view (:func:`unfused_gather_bytes`). Its peak as a multiple of that
#: buffer, from the H100 gate of 2026-12-06 (``reports/baselines/h100/megatron-pr-gate-20261206``: torch's
#: out-of-memory messages bound a case's need from below), by the compressed keys a row gathers
#: (:func:`_compressed_keys_per_row`): 4.2–6.4 × where they are 512 or more (top-k 512, r = 4 dense mode: 8 cases of
#: 3.4–4.1k rows ran out of memory alone on 79 GiB), under 4.0 × at top-k 128 / 256 (cases of the same buffer,
#: 19.7 GiB, ran alone) and under 5.6 × at r = 0 / 128 (the largest that ran alone: 14–16 GiB of buffer), taken as 4.
UNFUSED_PEAK_PER_GATHER = {"512_keys_and_up": 6.5, "other": 4.0}


def unfused_gather_bytes(case: Case) -> int:
    """Bytes of the ``[rows, n_kv, hn]`` gradient production's unfused sparse attention builds in its backward:
    ``rows`` the query rows of all sequences (BSHD ``B·S``, THD ``T``), ``n_kv`` the keys of all of them (the raw
    rows plus the compressed ones: BSHD ``B·(S + S // r)``, THD ``T`` + the compressed capacity), ``hn`` the value
    head dim, in the case dtype."""
    import torch

    c, lay = case.config, case.layout
    r = c.compress_ratio
    if isinstance(lay, ThdLayout):
        rows = lay.total_tokens
        compressed = (lay.compressed_capacity if lay.compressed_capacity is not None
                      else sum(n // r for n in lay.padded_lengths)) if r > 1 else 0
        keys = rows + compressed
    else:
        rows = lay.batch * lay.seq_len
        keys = lay.batch * (lay.seq_len + (lay.seq_len // r if r > 1 else 0))
    return rows * keys * c.v_head_dim * getattr(torch, case.dtype).itemsize


def _compressed_keys_per_row(case: Case) -> int:
    """The compressed keys production's unfused attention gathers for a row at most: the top-k with an indexer,
    every visible compressed key without one (dense mode, r = 128: the longest sequence's ``L // r``), none at r = 0."""
    c = case.config
    if c.has_indexer:
        return c.dsa_indexer_topk
    return case.layout.max_seqlen // c.compress_ratio if c.compress_ratio > 1 else 0


#: A measured peak times this, plus :data:`MEASURED_SLACK` bytes, is its expected peak. The peak is what the
#: caching allocator held from the GPU where the baseline kept it, else PyTorch's largest allocation (then the
#: allocator's cached-but-free blocks come on top: 1.26× the allocations at the median on the H100's fused gate of
#: 2026-12-07, up to 1.53× on its cases that ran out of memory beside others); the libraries' own workspaces come on
#: top of either (:func:`reports.baselines.measured_peaks`).
MEASURED_MARGIN = 1.15
MEASURED_SLACK = 512 << 20


def expected_gpu_bytes(case: Case, impl: str, provider: Optional[str],
                       measured: Optional[dict] = None) -> int:
    """The GPU memory a case is expected to hold at its peak under ``impl`` / ``provider``, for the worker pool's
    memory admission (:class:`parity.run.worker.WorkerPool`); 0 where nothing is known (it fits beside any cases
    that leave the GPU within its capacity).

    * ``measured`` (``{case_id: bytes}``, a baseline's ``memory.csv`` of the same path on the same GPU, read by the
      CLI): the case's peak there × :data:`MEASURED_MARGIN` + :data:`MEASURED_SLACK`;
    * else production's unfused path (``auto`` is that path for ``megatron``): :data:`UNFUSED_PEAK_PER_GATHER` ×
      :func:`unfused_gather_bytes`;
    * else 0: the fused paths and our own implementations, six of whose cases share an H200 without running out
      of memory (the gates of 2026-12-04)."""
    if measured and case.id in measured:
        return int(MEASURED_MARGIN * measured[case.id]) + MEASURED_SLACK
    if impl != "megatron" or provider not in (None, "auto", "unfused"):
        return 0
    factor = UNFUSED_PEAK_PER_GATHER["512_keys_and_up" if _compressed_keys_per_row(case) >= 512 else "other"]
    return int(factor * unfused_gather_bytes(case))


def admission_capacity(total: Optional[int], workers_on_device: int) -> Optional[int]:
    """The bytes a GPU of ``total`` bytes lends the jobs of its ``workers_on_device`` workers: its memory less
    1 GiB per worker for each process's CUDA context and libraries (None where ``total`` is unknown)."""
    if not total:
        return None
    return max(0, total - workers_on_device * (1 << 30))
