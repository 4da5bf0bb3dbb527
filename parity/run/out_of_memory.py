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


def first_failure(row: dict) -> dict:
    """A case row's ``first_failure`` ({} where it has none): where torch's own message is kept."""
    return row["first_failure"] if isinstance(row.get("first_failure"), dict) else {}


def says_out_of_memory(text: str) -> bool:
    """Whether ``text`` (an exception's message, a case row's) says the device ran out of memory
    (:data:`OUT_OF_MEMORY_MARKERS`, any case)."""
    text = text.lower()
    return any(marker in text for marker in OUT_OF_MEMORY_MARKERS)


_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"([0-9][0-9.]*) (bytes|KiB|MiB|GiB|TiB)"


def _bytes(match) -> int:
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def asked(text: str) -> Optional[int]:
    """The bytes torch's out-of-memory ``text`` says the failing request asked for (``Tried to allocate X``)."""
    match = re.search(r"Tried to allocate " + _SIZE, text)
    return _bytes(match) if match else None


def least_need(text: str) -> Optional[tuple[int, int]]:
    """``(bytes, capacity)`` from torch's CUDA out-of-memory message: a lower bound of the GPU memory the failing
    process needed (what PyTorch had allocated for it when it failed, ``Of the allocated memory A is allocated by
    PyTorch``, else everything it held, ``this process has P memory in use``, plus what it asked for, ``Tried to
    allocate X``) and the GPU's ``total capacity``. None where the text is not that message. Another process's memory
    (``Process N has …``) and the process's cached-but-free blocks are not counted: a re-run alone does not hold them."""
    request = asked(text)
    total = re.search(r"has a total capacity of " + _SIZE, text)
    held = re.search(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch", text) or \
        re.search(r"this process has " + _SIZE + r" memory in use", text)
    if request is None or not (total and held):
        return None
    return _bytes(held) + request, _bytes(total)


def beyond_device(text: str) -> Optional[str]:
    """A sentence when torch's out-of-memory ``text`` shows that the case needs more than the whole GPU (a re-run
    alone on it would run out again), else None."""
    need = least_need(text)
    if need is None or need[0] <= need[1]:
        return None
    return f"needs at least {_gib(need[0], up=True)} GiB of GPU memory (held + asked when it ran out), more than the " \
           f"GPU's {_gib(need[1])} GiB: a larger GPU runs it"


#: How close to the GPU's capacity torch's lower bound of a case's need must come for an out-of-memory in a re-run alone
#: to mean the case does not fit the GPU (1c5cbcb11f97 on an H100: 78.05 of 79.18 GiB by the bound, out of memory
#: alone; context and cached blocks make the rest). Further below, the memory was held elsewhere.
ALONE_NEAR_CAPACITY = 0.9


def plausible_need(text: str, alone: bool) -> bool:
    """Whether torch's out-of-memory ``text`` shows a case that does not fit its GPU, the implementation's real need
    and not a fault: the one request asked for no more than the GPU has (a request past the whole card is a size or
    overflow fault, an ``error``), and either held + asked exceeds the capacity, or, for a run ``alone`` on the GPU
    (the pool's re-run, a GPU with one worker), comes within :data:`ALONE_NEAR_CAPACITY` of it with no other process
    named as holding memory (``Process N has … memory in use``: someone else's memory, not the case's need)."""
    need, request = least_need(text), asked(text)
    if need is None or request is None or request > need[1]:
        return False
    if need[0] > need[1]:
        return True
    return alone and need[0] >= ALONE_NEAR_CAPACITY * need[1] and not re.search(r"Process \d+ has ", text)


def does_not_fit(stage: str, text: str) -> Optional[str]:
    """The ``unsupported`` message of a case whose implementation run does not fit the GPU even alone on it (torch's
    out-of-memory ``text``: past the capacity by its own numbers, or out of memory in a re-run alone), or None where
    ``text`` is not torch's message (:func:`plausible_need` decides whether it applies). Whole GiB (the need rounded up,
    the capacity down): :func:`reports.coverage_gate.reason_key` reads integers as ``N``, so it is one unsupported
    reason per stage, whatever the GPU and the need; a baseline belongs to one GPU model, which keeps it honest."""
    need = least_need(text)
    if need is None:
        return None
    return (f"{stage}: does not fit the GPU's {_gib(need[1])} GiB even alone: needs at least {_gib(need[0], up=True)} "
            f"GiB of GPU memory (held + asked when it ran out); a larger GPU runs it")


def _gib(n: int, up: bool = False) -> int:
    gib = 1 << 30
    return -(-n // gib) if up else n // gib
