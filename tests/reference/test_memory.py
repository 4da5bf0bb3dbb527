"""Block recomputation (``reference.numerics.per_block``): what the autograd graph keeps per query row, and that
recomputing the blocks in backward changes no bit of any output or gradient."""

from __future__ import annotations

import math

import pytest
import torch

import reference.numerics as numerics
from reference import attention_layer

from .helpers import bshd, case_of, materialized, run_with_grads, thd_layout, tiny_config
from .memory_probe import graph_bytes

W, K, D, NI = 8, 4, 16, 2  # window, top-k, head dim, indexer heads of the probed layer
BLOCK = 64
TOKENS = (256, 512, 1024)


def holds(probe, rows: int, a: int, b: int) -> bool:
    """Whether the graph saved a ``rows x a x b``-element tensor whose last two dims are ``(a, b)`` or ``(b, a)``
    (matmul may save an operand transposed or with its leading dims flattened)."""
    return any(math.prod(shape) == rows * a * b and sorted(shape[-2:]) == sorted((a, b))
               for shape, _ in probe.shapes)


def probe_tokens(sparse: bool) -> tuple[dict[int, int], list[str]]:
    """Saved bytes (beyond the leaves and the returned outputs) of core attention on one sequence of each length in
    ``TOKENS``, and which per-block intermediates the graph kept."""
    config = tiny_config(4, sparse=sparse, csa_window_size=W, dsa_indexer_topk=K, dsa_indexer_n_heads=NI)
    assert config.v_head_dim == D
    saved, kept = {}, set()
    for T in TOKENS:
        saved[T], probe = graph_bytes(case_of(config, bshd(1, T), scope="core"), exclude_outputs=True)
        if holds(probe, BLOCK, W + K, D):
            kept.add("gathered keys [B, s, W+K, D]")
        if holds(probe, BLOCK, NI, T // 4):
            kept.add("ReLU(dots) [B, s, nI, n_comp]")
    return saved, sorted(kept)


def growth(saved: dict[int, int]) -> float:
    """``(bytes(4T) - bytes(2T)) / (bytes(2T) - bytes(T))``: 2 when linear in T, 4 when quadratic."""
    a, b, c = (saved[T] for T in TOKENS)
    return (c - b) / (b - a)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse_loss", "dense_loss"])
def test_graph_keeps_block_inputs_only_and_grows_linearly(sparse, monkeypatch):
    monkeypatch.setattr(numerics, "ROW_CHUNK", BLOCK)
    saved, kept = probe_tokens(sparse)
    assert kept == []
    assert growth(saved) <= 2.05
    # negative control: without recomputation the same probe sees the block intermediates, and they grow
    # quadratically (ReLU(dots) has a column per compressed entry)
    monkeypatch.setattr(numerics, "CHECKPOINT_BLOCKS", False)
    saved_all, kept_all = probe_tokens(sparse)
    assert kept_all == ["ReLU(dots) [B, s, nI, n_comp]", "gathered keys [B, s, W+K, D]"]
    assert growth(saved_all) >= 2.5
    per_row = {name: (s[TOKENS[-1]] - s[TOKENS[-2]]) / (TOKENS[-1] - TOKENS[-2])
               for name, s in (("recomputed", saved), ("saved", saved_all))}
    assert 3 * per_row["recomputed"] < per_row["saved"], per_row


def bitwise_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [key for key in a if not torch.equal(a[key], b[key])]


@pytest.mark.parametrize("ratio,sparse,dtype", [(0, True, "float64"), (4, True, "float64"), (4, False, "float64"),
                                                (128, True, "float64"), (4, True, "bfloat16")])
def test_recomputation_changes_no_bit(ratio, sparse, dtype, monkeypatch):
    monkeypatch.setattr(numerics, "ROW_CHUNK", 5)
    config = tiny_config(ratio, sparse=sparse)
    case = case_of(config, thd_layout([13, 0, 134 if ratio == 128 else 22], [16, 0, 136 if ratio == 128 else 24],
                                      slack=2), dtype=dtype)
    t = materialized(case)
    recomputed = run_with_grads(attention_layer, case, t)
    monkeypatch.setattr(numerics, "CHECKPOINT_BLOCKS", False)
    kept = run_with_grads(attention_layer, case, t)
    assert recomputed.keys() == kept.keys() and "grad/hidden" in kept
    assert bitwise_differences(recomputed, kept) == []
    # negative control: the comparison sees a one-ulp change of one input element
    with torch.no_grad():
        hidden = t.inputs["hidden"]
        hidden[0, 0] *= 1 + torch.finfo(hidden.dtype).eps
    assert {"out", "grad/hidden"} <= set(bitwise_differences(kept, run_with_grads(attention_layer, case, t)))
