"""What the machine says when a GPU runs out of memory: a condition of the device and of what shares it, never the
behaviour of the code under test on a case (the engine keeps such a case an ``error``; the worker pool re-runs it alone
on its device). The engine, the worker pool and the backward-origin check all read this one list."""

from __future__ import annotations

import re
from typing import Optional


#: What torch, CUDA and the CUDA libraries say when the GPU runs out of memory (lower case): the type name of
#: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class), whose message starts "CUDA out of
#: memory. Tried to allocate"; the CUDA runtime's "out of memory" (``cudaErrorMemoryAllocation``: "CUDA error: out of
#: memory"); cuBLAS's and cuDNN's allocation failures (``CUBLAS_STATUS_ALLOC_FAILED``: torch's ``cublasCreate(handle)``
#: on a GPU whose memory other workers hold, seen on the H100 gate of 2026-12-06; ``CUDNN_STATUS_ALLOC_FAILED``).
OUT_OF_MEMORY_MARKERS = ("outofmemoryerror", "out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def says_out_of_memory(text: str) -> bool:
    """Whether ``text`` (an exception's message, a case row's) says the device ran out of memory
    (:data:`OUT_OF_MEMORY_MARKERS`, any case)."""
    text = text.lower()
    return any(marker in text for marker in OUT_OF_MEMORY_MARKERS)


_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"([0-9][0-9.]*) (bytes|KiB|MiB|GiB|TiB)"


def _bytes(match) -> int:
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def least_need(text: str) -> Optional[tuple[int, int]]:
    """``(bytes, capacity)`` from torch's CUDA out-of-memory message: a lower bound of the GPU memory the failing
    process needed (what PyTorch had allocated for it when it failed, ``Of the allocated memory A is allocated by
    PyTorch``, else everything it held, ``this process has P memory in use``, plus what it asked for, ``Tried to
    allocate X``) and the GPU's ``total capacity``. None where the text is not that message. Another process's memory
    (``Process N has …``) and the process's cached-but-free blocks are not counted: a re-run alone does not hold them."""
    asked = re.search(r"Tried to allocate " + _SIZE, text)
    total = re.search(r"has a total capacity of " + _SIZE, text)
    held = re.search(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch", text) or \
        re.search(r"this process has " + _SIZE + r" memory in use", text)
    if not (asked and total and held):
        return None
    return _bytes(held) + _bytes(asked), _bytes(total)


def beyond_device(text: str) -> Optional[str]:
    """A sentence when torch's out-of-memory ``text`` shows that the case needs more than the whole GPU (a re-run
    alone on it would run out again), else None."""
    need = least_need(text)
    if need is None or need[0] <= need[1]:
        return None
    return f"needs at least {_gib(need[0], up=True)} GiB of GPU memory (held + asked when it ran out), more than the " \
           f"GPU's {_gib(need[1])} GiB: a larger GPU runs it"


def does_not_fit(stage: str, text: str) -> Optional[str]:
    """The ``unsupported`` message of a case whose implementation run does not fit the GPU even alone on it (torch's
    out-of-memory ``text``: past the capacity by its own numbers, or out of memory in a re-run alone), or None where
    ``text`` is not torch's message. Whole GiB (the need rounded up, the capacity down), so it is one unsupported reason
    per GPU model and stage (:func:`reports.coverage_gate.reason_key` reads integers as ``N``)."""
    need = least_need(text)
    if need is None:
        return None
    return (f"{stage}: does not fit the GPU's {_gib(need[1])} GiB even alone: needs at least {_gib(need[0], up=True)} "
            f"GiB of GPU memory (held + asked when it ran out); a larger GPU runs it")


def _gib(n: int, up: bool = False) -> int:
    gib = 1 << 30
    return -(-n // gib) if up else n // gib
