"""Where the workers of one run go: how many (``--workers N|auto``), which device each sees, how many threads.

``dsv4-parity run --workers N|auto`` starts ``N`` worker processes (:class:`parity.run.worker.WorkerPool`); the order
they take the cases in is :mod:`parity.run.shard`'s. Nothing here imports torch: the command line plans the slots
before torch is loaded to start the workers early (:mod:`parity.run.prestart`), and checks the plan once it is.

* **auto** (:func:`auto_workers`) = on CUDA ``gpus × per_gpu`` with ``per_gpu = clamp(cores // (2 × gpus), 1, 6)``
  (16 cores and one GPU: 6 workers; 2 cores: 1), else 1. Several workers per GPU because a GPU sweep is host-bound
  (first-call kernel JIT compiles, CPU-side tensor draws) while the GPU mostly idles; a case that runs out of GPU
  memory while sharing its GPU is re-run alone on it (:class:`parity.run.worker.WorkerPool`). With one worker nothing
  changes: the cases run in suite order, in-process on CPU and in one unpinned child on CUDA (as before
  ``--workers``).
* **Pinning**: worker ``i`` of a multi-worker CUDA run gets ``CUDA_VISIBLE_DEVICES=<token i mod #devices>`` (the
  token as the parent sees it: an index or a GPU/MIG UUID from the parent's own ``CUDA_VISIBLE_DEVICES``), so it
  sees exactly one GPU as ``cuda:0``; more workers than GPUs share them round-robin. A CPU worker of a
  multi-worker run is a plain CPU process.
* **Threads**: intra-op threads per worker — 1 on CPU (N single-threaded processes), ``cores // N`` on CUDA (the
  host-side work of N GPU workers must not oversubscribe the cores). ``--threads`` overrides both. On CPU the
  thread count changes the summation order of parallel reductions, so two CPU runs agree bit for bit only at the
  same thread count (``--workers 1 --threads 1`` against ``--workers 2``); on CUDA it does not matter.
  A case's tensors are drawn on its device (:mod:`cases.draws`), so a GPU worker needs no host threads for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from parity.run.usage import parse_workers


def visible_cuda_devices(env_value: Optional[str], device_count: int) -> list[str]:
    """The CUDA device tokens this process sees, as ``CUDA_VISIBLE_DEVICES`` would name them to a child.

    ``env_value`` is the parent's ``CUDA_VISIBLE_DEVICES`` (``None`` = unset: ``0 .. device_count-1``); its entries
    (indices or UUIDs) are kept up to ``device_count``, the number CUDA actually enumerates.
    """
    if env_value is None:
        return [str(i) for i in range(device_count)]
    tokens = [t.strip() for t in env_value.split(",") if t.strip()]
    return tokens[:device_count]


def _cuda_tokens() -> list[str]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return visible_cuda_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), count)


#: ``auto`` on CUDA: at most this many workers per GPU, and at least this many cores per worker. Measured on the
#: H200 (16 cores, one GPU; ``bench --sections gate``, ``reports/baselines/h200/bench/``): the warm PR gate took 184 s
#: with 4 workers, 159 s with 6, 164 s with 8 (the same 197 pass / 23 unsupported each time).
AUTO_MAX_PER_GPU = 6
AUTO_CORES_PER_WORKER = 2


def auto_workers(device: str, gpus: int, cores: int) -> int:
    """The ``--workers auto`` count: on CUDA ``gpus × per_gpu``, ``per_gpu = clamp(cores // (2 × gpus), 1, 6)``;
    on CPU (or with no visible GPU) 1.

    Why several workers per GPU: a GPU sweep such as ``gate`` is host-bound, not GPU-bound. Its time goes to
    first-call CuTe-DSL JIT compiles (tens of kernels at 5-17 s each, single-threaded; ``fused.kernels.compile_cache``
    lets the workers compile each once and later runs load them) and to ~1 s of CPU-side tensor draws per case, while the GPU mostly idles;
    more processes per GPU overlap that host work. The bounds: one worker per 2 cores at most (one per GPU at
    least), so each keeps cores for its draws and compiles (:func:`plan_slots` gives it ``cores // workers``
    threads, and its draws twice that); at most 6 share one GPU (past 6 the 16-core H200 host got slower again),
    which bounds the GPU memory that concurrent cases hold (a case that still runs
    out of GPU memory while sharing is re-run alone on its GPU by :class:`parity.run.worker.WorkerPool`). On CPU one
    worker, as before: the cases are compute-bound there, so more processes would only split the same cores.
    """
    if device != "cuda" or gpus < 1:
        return 1
    per_gpu = min(AUTO_MAX_PER_GPU, max(1, cores // (AUTO_CORES_PER_WORKER * gpus)))
    return gpus * per_gpu


def resolve_workers(workers: Union[int, str], device: str, tokens: Optional[Sequence[str]] = None,
                    cpu_count: Optional[int] = None) -> int:
    """The worker count: an explicit N, or ``auto`` (:func:`auto_workers` over the visible CUDA devices and cores)."""
    workers = parse_workers(workers)
    if workers != "auto":
        return int(workers)
    if device != "cuda":
        return 1
    tokens = _cuda_tokens() if tokens is None else tokens
    return auto_workers(device, len(tokens), cpu_count or os.cpu_count() or 1)


@dataclass(frozen=True)
class Slot:
    """Where worker ``index`` runs: ``device`` is the label recorded in the results (``cpu``, ``cuda:<token>``),
    ``env`` the environment overrides of its process (pinning and thread counts)."""

    index: int
    device: str
    env: dict = field(default_factory=dict, hash=False, compare=False)
    threads: Optional[int] = None


def plan_slots(workers: int, device: str, *, threads: Optional[int] = None,
               tokens: Optional[Sequence[str]] = None, cpu_count: Optional[int] = None) -> list[Slot]:
    """One :class:`Slot` per worker (see the module docstring for pinning and threads).

    A single worker is never pinned and keeps the default thread count unless ``threads`` is given: one worker is
    the run as it was before sharding.
    """
    cores = cpu_count or os.cpu_count() or 1
    if device == "cuda":
        tokens = list(_cuda_tokens() if tokens is None else tokens) or ["0"]
        per_worker = threads if threads is not None else (None if workers == 1 else max(1, cores // workers))
    else:
        tokens = []
        per_worker = threads if threads is not None else (None if workers == 1 else 1)
    slots = []
    for i in range(workers):
        env = {}
        if per_worker is not None:
            env.update({"DSV4_PARITY_THREADS": str(per_worker), "OMP_NUM_THREADS": str(per_worker),
                        "MKL_NUM_THREADS": str(per_worker)})
        if device == "cuda":
            token = tokens[i % len(tokens)]
            if workers > 1:
                env["CUDA_VISIBLE_DEVICES"] = token
            label = f"cuda:{token}"
        else:
            label = "cpu"
        slots.append(Slot(index=i, device=label, env=env, threads=per_worker))
    return slots
