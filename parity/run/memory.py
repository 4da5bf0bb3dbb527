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


def host_available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


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
