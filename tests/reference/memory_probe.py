"""What the reference's autograd graph keeps for backward: a saved-tensor probe, and the 32K-token Pro estimate.

:class:`SavedTensors` is a ``torch.autograd.graph.saved_tensors_hooks`` that records every tensor autograd saves
(the block inputs that ``torch.utils.checkpoint`` saves included) and counts the bytes of the distinct storages
behind them, i.e. the memory the graph holds between forward and backward.

``python -m tests.reference.memory_probe`` measures it at Pro head counts on the CPU for a few small T, fits
``bytes(T) = a + b T + c T^2`` per workload and extrapolates to a 32K-token pack (see :func:`main`).
"""

from __future__ import annotations

import argparse
import time
from typing import Iterable

import torch

from cases.case import Case
from cases.layout import ThdLayout
from cases.profiles import PRO_CONFIG
from cases.tensors import materialize
from reference import attention_layer, core_attention


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Records what autograd saves inside the ``with`` block: ``shapes`` of every saved tensor, ``bytes`` of the
    distinct storages behind them (storages in ``exclude``, e.g. the leaves, are not counted)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.excluded = {storage_key(t) for t in exclude}
        self.storages: dict[int, int] = {}
        self.first_saved: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # storage -> a tensor saved from it
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._held: list[torch.Tensor] = []  # keeps each storage alive while probing: no data pointer is reused
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "SavedTensors":
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._held = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._held.append(t)
        self.shapes.append((tuple(t.shape), t.dtype))
        key = storage_key(t)
        if key not in self.excluded:
            self.storages[key] = t.untyped_storage().nbytes()
            self.first_saved.setdefault(key, (tuple(t.shape), t.dtype))
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def saw_shape(self, shape: tuple[int, ...]) -> bool:
        return any(s == tuple(shape) for s, _ in self.shapes)

    def top_storages(self, count: int = 8) -> list[tuple[int, tuple[int, ...], torch.dtype]]:
        """The ``count`` largest counted storages: ``(bytes, shape, dtype)`` of the first tensor saved from each."""
        top = sorted(self.storages.items(), key=lambda kv: -kv[1])[:count]
        return [(n, *self.first_saved[key]) for key, n in top]

    def largest(self) -> tuple[int, tuple[int, ...], torch.dtype]:
        """``(bytes, shape, dtype)`` of the largest saved tensor (by its own elements, not its storage)."""
        return max(((torch.Size(s).numel() * torch.empty((), dtype=d).element_size(), s, d) for s, d in self.shapes),
                   default=(0, (), torch.float32))


def graph_bytes(case: Case, tensors=None, *, exclude_outputs: bool = False, backward: bool = True
                ) -> tuple[int, SavedTensors]:
    """Run ``case`` forward under the probe; return the saved bytes beyond the inputs and parameters (and beyond
    the returned outputs when ``exclude_outputs``), and the probe. ``backward`` then runs (and checks) backward;
    otherwise the graph is just dropped. ``tensors``: the case's tensors if already materialised."""
    t = materialize(case) if tensors is None else tensors
    leaves = [*t.inputs.values(), *t.params.values()]
    with SavedTensors(exclude=leaves) as probe:
        if case.scope == "layer":
            res = attention_layer(t.inputs["hidden"], t.params, case.config, t.packed_seq_params,
                                  training=case.training)
        else:
            i = t.inputs
            res = core_attention(i["query"], i["kv"], i["hidden"], i["q_latent"], t.params, case.config,
                                 t.packed_seq_params, training=case.training)
    if exclude_outputs:
        for out in (res.out, res.lse, res.index_scores):
            if out is not None:
                probe.storages.pop(storage_key(out), None)
    saved = probe.bytes
    if backward:
        res.objective(t.grad_output).backward()
    return saved, probe


def fit(tokens: list[int], values: list[float]) -> tuple[float, float, float]:
    """Exact ``a + b T + c T^2`` through three points."""
    A = torch.tensor([[1.0, T, T * T] for T in tokens], dtype=torch.float64)
    a, b, c = torch.linalg.solve(A, torch.tensor(values, dtype=torch.float64)).tolist()
    return a, b, c


def pro_pack_tensors(config, dtype: str, tokens: int, segment: int = 0, device: str = "cpu"):
    """A Pro pack of ``tokens`` rows in segments of ``segment`` rows (0: one segment), layer scope: its case and
    tensors on ``device``."""
    segment = segment or tokens
    cu = tuple(range(0, tokens + 1, segment))
    layout = ThdLayout(cu, cu, tokens, None).validate()
    case = Case(config=config, layout=layout, scope="layer", training=True, seed=0, dtype=dtype)
    return case, materialize(case, device)


def cuda_peak(config, dtype: str, tokens: int, segment: int) -> dict:
    """Layer fwd + bwd of a Pro pack on the GPU: peak allocated bytes, and the bytes of the case's tensors."""
    torch.cuda.empty_cache()
    case, t = pro_pack_tensors(config, dtype, tokens, segment, "cuda")
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        res = attention_layer(t.inputs["hidden"], t.params, config, t.packed_seq_params, training=True)
        after_forward = torch.cuda.memory_allocated() - held
        res.objective(t.grad_output).backward()
        torch.cuda.synchronize()
        status = "ok"
    except torch.OutOfMemoryError:
        after_forward, status = None, "oom"
    return {"status": status, "inputs_bytes": held, "graph_after_forward": after_forward,
            "peak_bytes": torch.cuda.max_memory_allocated()}


def main() -> None:
    import reference.numerics as numerics

    ap = argparse.ArgumentParser(description="Saved-tensor bytes of the reference at Pro shapes, extrapolated.")
    ap.add_argument("--tokens", type=int, nargs=3, default=[256, 512, 1024])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--target", type=int, default=32768)
    ap.add_argument("--segment", type=int, default=4096, help="segment length of the target pack")
    ap.add_argument("--workloads", nargs="+", default=["r4-sparse", "r4-dense", "r128", "r0"])
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="list the largest saved storages at the largest T")
    ap.add_argument("--cuda", action="store_true", help="measure the peak of a --target pack on the GPU instead")
    args = ap.parse_args()
    numerics.CHECKPOINT_BLOCKS = not args.no_checkpoint
    if args.cuda:
        for name in args.workloads:
            ratio = int(name.split("-")[0][1:])
            config = PRO_CONFIG.replace(compress_ratio=ratio, dsa_indexer_use_sparse_loss=not name.endswith("dense"))
            start = time.perf_counter()
            r = cuda_peak(config, args.dtype, args.target, args.segment)
            gib = {k: None if v is None else round(v / 2**30, 2) for k, v in r.items() if k != "status"}
            print(f"{name} {args.dtype} T={args.target} segments of {args.segment or args.target} recompute="
                  f"{numerics.CHECKPOINT_BLOCKS}: {r['status']} GiB {gib} ({time.perf_counter() - start:.1f} s)",
                  flush=True)
        return
    for name in args.workloads:
        ratio = int(name.split("-")[0][1:])
        config = PRO_CONFIG.replace(compress_ratio=ratio, dsa_indexer_use_sparse_loss=not name.endswith("dense"))
        saved = []
        for T in args.tokens:
            case, tensors = pro_pack_tensors(config, args.dtype, T)
            b, probe = graph_bytes(case, tensors, backward=False)
            saved.append(b)
            size, shape, dtype = probe.largest()
            print(f"{name:9s} T={T:5d}: saved {b / 2**20:9.1f} MiB ({b / T / 2**10:7.1f} KiB/row); largest saved "
                  f"tensor {shape} {dtype}", flush=True)
            if args.breakdown and T == args.tokens[-1]:
                for n, shape, dtype in probe.top_storages():
                    print(f"    {n / T / 2**10:8.1f} KiB/row  {shape} {dtype}")
            del case, tensors, probe
        a, b, c = fit(args.tokens, saved)
        segs = args.target // args.segment
        est = a + segs * (b * args.segment + c * args.segment ** 2)
        one = a + b * args.target + c * args.target ** 2
        print(f"{name:9s} fit ({args.dtype}): a={a / 2**20:.1f} MiB  b={b / 2**10:.2f} KiB/row  c={c:.3f} B/row^2 -> "
              f"{args.target} tokens: {est / 2**30:.2f} GiB in {segs}x{args.segment} segments, "
              f"{one / 2**30:.2f} GiB as one sequence", flush=True)


if __name__ == "__main__":
    main()
