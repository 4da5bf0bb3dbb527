"""What the machine says when a GPU runs out of memory: a condition of the device and of what shares it, never the
behaviour of the code under test on a case (the engine keeps such a case an ``error``; the worker pool re-runs it alone
on its device). No imports: the engine, the worker pool and the backward-origin check all read this one list."""

from __future__ import annotations


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
