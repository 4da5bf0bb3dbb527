"""What the reference's autograd graph keeps for backward: a saved-tensor probe, and the 32K-token Pro estimate.

:class:`SavedTensors` is a ``torch.autograd.graph.saved_tensors_hooks`` that records every tensor autograd saves
(the block inputs that ``torch.utils.checkpoint`` saves included) and counts the bytes of the distinct storages
behind them, i.e. the memory the graph holds between forward and backward.

``python -m tests.reference.memory_probe`` measures it at Pro shapes on the CPU for a few small T, fits
``bytes(T) = a + b T + c T^2`` per workload and extrapolates to a 32K-token pack; ``--peak`` measures the peak
resident memory of the whole fwd + bwd instead (saved graph + gradients + one block's working set).
"""

from __future__ import annotations

import argparse
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

    def top_storages(self, count: int = 8) -> list[tuple[int, tuple[int, ...], torch.dtype]]:
        """The ``count`` largest counted storages: ``(bytes, shape, dtype)`` of the first tensor saved from each."""
        top = sorted(self.storages.items(), key=lambda kv: -kv[1])[:count]
        return [(n, *self.first_saved[key]) for key, n in top]

    def largest(self) -> tuple[int, tuple[int, ...], torch.dtype]:
        """``(bytes, shape, dtype)`` of the largest saved tensor (by its own elements, not its storage)."""
        return max(((torch.Size(s).numel() * d.itemsize, s, d) for s, d in self.shapes),
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


def rss(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def peak_rss(case: Case, tensors) -> int:
    """Peak resident bytes of layer fwd + bwd above the resident memory before it (``VmHWM`` reset first)."""
    base = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    res = attention_layer(tensors.inputs["hidden"], tensors.params, case.config, tensors.packed_seq_params,
                          training=True)
    res.objective(tensors.grad_output).backward()
    return rss("VmHWM") - base


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
    ap.add_argument("--peak", action="store_true",
                    help="measure the peak resident memory of fwd + bwd (Linux VmHWM) instead of the saved bytes")
    args = ap.parse_args()
    numerics.CHECKPOINT_BLOCKS = not args.no_checkpoint
    for name in args.workloads:
        ratio = int(name.split("-")[0][1:])
        config = PRO_CONFIG.replace(compress_ratio=ratio, dsa_indexer_use_sparse_loss=not name.endswith("dense"))
        saved = []
        for T in args.tokens:
            case, tensors = pro_pack_tensors(config, args.dtype, T)
            if args.peak:
                saved.append(peak_rss(case, tensors))
                print(f"{name:9s} T={T:5d}: peak {saved[-1] / 2**20:9.1f} MiB above the inputs", flush=True)
                continue
            b, probe = graph_bytes(case, tensors, backward=False)
            saved.append(b)
            size, shape, dtype = probe.largest()
            print(f"{name:9s} T={T:5d}: saved {b / 2**20:9.1f} MiB ({b / T / 2**10:7.1f} KiB/row); largest saved "
                  f"tensor {shape} {dtype}", flush=True)
            if args.breakdown and T == args.tokens[-1]:
                for n, shape, dtype in probe.top_storages():
                    print(f"    {n / T / 2**10:8.1f} KiB/row  {shape} {dtype}")
            del case, tensors, probe
        if args.peak:  # the per-block working set is constant: project with the slope of the two largest T
            slope = (saved[2] - saved[1]) / (args.tokens[2] - args.tokens[1])
            est = saved[2] + slope * (args.target - args.tokens[2])
            print(f"{name:9s} peak ({args.dtype}): {slope / 2**20:.2f} MiB/row -> {args.target} tokens as one "
                  f"sequence: {est / 2**30:.1f} GiB above the inputs", flush=True)
            continue
        a, b, c = fit(args.tokens, saved)
        segs = args.target // args.segment
        est = a + segs * (b * args.segment + c * args.segment ** 2)
        one = a + b * args.target + c * args.target ** 2
        print(f"{name:9s} fit ({args.dtype}): a={a / 2**20:.1f} MiB  b={b / 2**10:.2f} KiB/row  c={c:.3f} B/row^2 -> "
              f"{args.target} tokens: {est / 2**30:.2f} GiB in {segs}x{args.segment} segments, "
              f"{one / 2**30:.2f} GiB as one sequence", flush=True)


if __name__ == "__main__":
    main()
