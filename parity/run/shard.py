"""Sharding one sweep over the devices of one machine: how many workers, where each runs, which case goes first.

``dsv4-parity run --workers N|auto`` starts ``N`` worker processes (:class:`parity.run.worker.WorkerPool`):

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
* **Order**: :func:`by_cost` — a shared queue, most expensive case first, every idle worker taking the next one.
  That is Graham's LPT list scheduling driven by the *measured* finish times, so a wrong estimate costs at most
  one case's imbalance at the end of the sweep instead of a whole static shard.

The cost estimate (:func:`estimate_cost`) only has to *rank* cases; its unit is "multiply-adds of one float32
run on the device", roughly::

    cost = Σ_runs dtype_factor(run) · 3 (forward + backward) · Σ_sequences L · per_row(L)

    per_row(L) = n·D·2·(win + cmp)                  sparse attention: QKᵀ and PV over the key set (spec §4.1)
               + nI·dI·vis                            indexer scores over every visible compressed key (r=4)
               + n·D·|St|                             teacher logits of the indexer KL loss (training, r=4)
               + compressors + indexer projections   per-token GEMMs of core attention (r>1)
               + [scope layer] Hd·Rq + Rq·n·D + Hd·D + n·D·Ro + G·Ro·Hd     q / kv / grouped output projections

with ``win`` = mean window keys per row, ``vis`` = mean causally visible compressed keys, ``cmp`` = ``min(K, vis)``
with an indexer else ``vis`` (0 for r=0), ``St`` = ``cmp`` (sparse loss) or ``vis`` (dense loss). The runs are
the engine's (:mod:`parity.engine`): the implementation in the case dtype, the float64 truth and, unless the case
is float64, the same-dtype noise run. ``dtype_factor`` is the relative cost of one multiply-add in that dtype on
the device (:data:`DTYPE_FACTOR`). The per-case fixed overhead (Python dispatch, first-call warm-up, comparison)
is left out: a constant does not change the order. It is what dominates the ``tiny`` CPU cases (a 2-token case can
take longer than a 300-token one: rank correlation of estimate and measured duration over the smoke suite ≈ 0.3),
so the estimate matters for the ``kernel`` / production cases of a GPU sweep, where the work is the FLOPs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from cases.case import Case

from parity.run.usage import parse_workers

#: Relative cost of one multiply-add per dtype, per device kind. CUDA: bf16 on tensor cores vs fp32 / fp64 on the
#: CUDA cores (H100/H200: ~990 vs ~67 dense TFLOP/s, fp64 half of fp32 outside tensor-core GEMMs). CPU: fp32 SIMD,
#: fp64 half the lanes, bf16 mostly emulated through fp32 conversions.
DTYPE_FACTOR = {
    "cuda": {"bfloat16": 1.0, "float32": 8.0, "float64": 16.0},
    "cpu": {"bfloat16": 3.0, "float32": 1.0, "float64": 2.0},
}


# ---- worker count and placement --------------------------------------------------------------------------------------
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


# ---- cost estimate and order ----------------------------------------------------------------------------------------
def _mean_capped(length: int, cap: float, ratio: int) -> float:
    """Mean over rows ``i < length`` of ``min(cap, (i+1)/ratio)`` (continuous approximation): the keys a row sees
    in a causal window of ``cap`` (ratio 1) or among ``ratio``-compressed keys capped at ``cap``."""
    if length <= 0:
        return 0.0
    top = length / ratio  # the last row's count
    if top <= cap:
        return (length + 1) / (2.0 * ratio)
    ramp = cap * ratio  # rows before the cap is reached
    return (ramp * cap / 2.0 + (length - ramp) * cap) / length


def _sequences(case: Case) -> list[int]:
    """Sequence lengths whose rows do the work: BSHD ``B × [S]``; THD the padded segments (slack rows: no keys)."""
    lay = case.layout
    if case.is_thd:
        return [L for L in lay.padded_lengths if L > 0]
    return [lay.seq_len] * lay.batch


def per_row_macs(case: Case, length: int) -> float:
    """Multiply-adds of one query row of a sequence of ``length`` rows, forward (see the module docstring)."""
    c = case.config
    n, D, Hd, Rq = c.num_attention_heads, c.v_head_dim, c.hidden_size, c.q_lora_rank
    r, K = c.compress_ratio, c.dsa_indexer_topk
    win = _mean_capped(length, c.csa_window_size, 1)
    vis = _mean_capped(length, float("inf"), r) if r > 1 else 0.0
    cmp = _mean_capped(length, K, r) if c.has_indexer else vis
    macs = n * D * 2.0 * (win + cmp)
    if r > 1:
        macs += 2.0 * c.coff * D * Hd  # compressor: wkv and wgate
    if c.has_indexer:
        nI, dI = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        macs += nI * dI * vis + Rq * nI * dI + Hd * nI + 2.0 * 2 * dI * Hd
    if case.computes_loss:
        macs += n * D * (cmp if c.dsa_indexer_use_sparse_loss else vis)
    if case.scope == "layer":
        macs += Hd * Rq + Rq * n * D + Hd * D + n * D * c.o_lora_rank + c.o_groups * c.o_lora_rank * Hd
    return macs


def estimate_cost(case: Case, device: str = "cpu") -> float:
    """Estimated work of one case on ``device`` (``cpu`` / ``cuda``), in float32 multiply-adds; ranks cases only."""
    factors = DTYPE_FACTOR["cuda" if device == "cuda" else "cpu"]
    run_dtypes = ["float64", "float64"] if case.dtype == "float64" else [case.dtype, "float64", case.dtype]
    work = sum(L * per_row_macs(case, L) for L in _sequences(case))
    return 3.0 * work * sum(factors[d] for d in run_dtypes)


def by_cost(cases: Sequence[Case], device: str = "cpu") -> list[Case]:
    """``cases`` most expensive first (ties: suite order), the dispatch order of a multi-worker run."""
    indexed = list(enumerate(cases))
    indexed.sort(key=lambda item: (-estimate_cost(item[1], device), item[0]))
    return [case for _, case in indexed]


__all__ = ["AUTO_CORES_PER_WORKER", "AUTO_MAX_PER_GPU", "DTYPE_FACTOR", "Slot",
           "auto_workers", "by_cost", "estimate_cost", "parse_workers", "per_row_macs", "plan_slots", "resolve_workers", "visible_cuda_devices"]
