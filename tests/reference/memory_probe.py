"""What the reference's autograd graph keeps for backward: a saved-tensor probe, and the 32K-token Pro estimate.

:class:`SavedTensors` is a ``torch.autograd.graph.saved_tensors_hooks`` that records every tensor autograd saves
(the block inputs that ``torch.utils.checkpoint`` saves included) and counts the bytes of the distinct storages
behind them, i.e. the memory the graph holds between forward and backward.

``python -m tests.reference.memory_probe`` measures it at Pro head counts on the CPU for a few small T, fits
``bytes(T) = a + b T + c T^2`` per workload and extrapolates to a 32K-token pack (see :func:`main`).
"""

from __future__ import annotations

import argparse
from typing import Iterable

import torch

from cases.case import Case
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
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._held: list[torch.Tensor] = []  # keeps every storage alive, so no data pointer is reused while probing
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "SavedTensors":
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._held.append(t)
        self.shapes.append((tuple(t.shape), t.dtype))
        key = storage_key(t)
        if key not in self.excluded:
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def saw_shape(self, shape: tuple[int, ...]) -> bool:
        return any(s == tuple(shape) for s, _ in self.shapes)

    def largest(self) -> tuple[int, tuple[int, ...], torch.dtype]:
        """``(bytes, shape, dtype)`` of the largest saved tensor (by its own elements, not its storage)."""
        return max(((torch.Size(s).numel() * torch.empty((), dtype=d).element_size(), s, d) for s, d in self.shapes),
                   default=(0, (), torch.float32))


def graph_bytes(case: Case, *, exclude_outputs: bool = False) -> tuple[int, SavedTensors]:
    """Run ``case`` forward under the probe; return the saved bytes beyond the inputs and parameters (and beyond
    the returned outputs when ``exclude_outputs``), and the probe. The graph is freed by a backward pass."""
    t = materialize(case)
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
    res.objective(t.grad_output).backward()
    return saved, probe


def fit(tokens: list[int], values: list[float]) -> tuple[float, float, float]:
    """Exact ``a + b T + c T^2`` through three points."""
    A = torch.tensor([[1.0, T, T * T] for T in tokens], dtype=torch.float64)
    a, b, c = torch.linalg.solve(A, torch.tensor(values, dtype=torch.float64)).tolist()
    return a, b, c


def main() -> None:
    from cases.layout import ThdLayout
    import reference.numerics as numerics

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs=3, default=[256, 512, 1024])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--target", type=int, default=32768)
    ap.add_argument("--segment", type=int, default=4096, help="segment length of the target pack")
    ap.add_argument("--no-checkpoint", action="store_true")
    args = ap.parse_args()
    numerics.CHECKPOINT_BLOCKS = not args.no_checkpoint
    torch.set_num_threads(2)
    for ratio, loss in ((4, "sparse"), (4, "dense"), (128, "none"), (0, "none")):
        config = PRO_CONFIG.replace(compress_ratio=ratio, dsa_indexer_use_sparse_loss=loss != "dense")
        saved = []
        for T in args.tokens:
            layout = ThdLayout((0, T), (0, T), T, None).validate()
            case = Case(config=config, layout=layout, scope="layer", training=True, seed=0, dtype=args.dtype)
            b, probe = graph_bytes(case)
            saved.append(b)
            big = probe.largest()
            print(f"r{ratio} {loss:6s} T={T:5d}: saved {b / 2**20:9.1f} MiB ({b / T / 2**10:7.1f} KiB/row); "
                  f"largest {big[1]} {big[2]}", flush=True)
        a, b, c = fit(args.tokens, saved)
        segs = args.target // args.segment
        est = a + segs * (b * args.segment + c * args.segment ** 2)
        one = a + b * args.target + c * args.target ** 2
        print(f"r{ratio} {loss:6s} fit: a={a / 2**20:.1f} MiB  b={b / 2**10:.2f} KiB/row  c={c:.2f} B/row^2 -> "
              f"{args.target} tokens: {est / 2**30:.1f} GiB in {segs}x{args.segment} segments, "
              f"{one / 2**30:.1f} GiB as one sequence ({args.dtype})", flush=True)


if __name__ == "__main__":
    main()
