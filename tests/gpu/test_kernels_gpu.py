"""GPU-only: the cudnn / flashmla providers against the torch provider on identical inputs (parity.kernel_checks),
and CUDA-graph replay under re-packing (the graph-replay oracle). Skipped unless a CUDA device with cudnn-frontend and FlashMLA is present (never on CPU CI)."""

from __future__ import annotations

import pytest
import torch

from cases.case import Case
from cases.layout import ThdLayout
from cases.profiles import KERNEL_CONFIG
from fused.plan import load_provider

REASONS = [r for r in (load_provider("cudnn")[1], load_provider("flashmla")[1]) if r]
pytestmark = pytest.mark.skipif(bool(REASONS), reason="; ".join(REASONS) or "GPU providers available")


@pytest.fixture(scope="module")
def kernel_rows():
    from parity import kernel_checks
    calls = kernel_checks.build_calls(torch.device("cuda"), div=8)
    rows, _ = kernel_checks.run_calls(calls, timing=False, capture=False, log=lambda *_: None)
    return rows


@pytest.mark.parametrize("stage", ["indexer_forward", "indexer_top_k", "compactify", "sparse_attn_fwd",
                                   "sparse_attn_bwd", "sparse_attn_score_recompute", "sparse_indexer_score_recompute",
                                   "indexer_backward", "dense_attn_score_recompute", "dense_indexer_score_recompute",
                                   "dense_indexer_backward"])
def test_kernel_matches_torch_provider(kernel_rows, stage):
    rows = [r for r in kernel_rows if r["stage"] == stage]
    assert rows, f"no call of {stage} ran"
    bad = [f"{r['call']} {r['tensor']}: {r['outcome']} {r['message']}" for r in rows if r["outcome"] != "pass"]
    assert not bad, bad


@pytest.mark.slow
def test_graph_replay_under_repacking():
    """The graph-replay oracle on the production kernels: a 2048-row buffer of 4 segments (r4, sparse loss)."""
    from parity import impls
    from parity.engine import RunOptions
    from parity.oracles.metamorphic import run_oracle

    layout = ThdLayout(cu_seqlens=(0, 700, 1000, 1500, 1900), cu_seqlens_padded=(0, 704, 1024, 1536, 1984),
                       total_tokens=2048, compressed_capacity=512)
    case = Case(config=KERNEL_CONFIG.replace(compress_ratio=4, dsa_indexer_use_sparse_loss=True), layout=layout,
                dtype="bfloat16", training=True, scope="layer", seed=7, device="cuda", profile="kernel").validate()
    result = run_oracle("graph-replay", case, impls.load("fused"), RunOptions(provider="cudnn", device="cuda"))
    assert result.outcome == "pass", result.message
    assert sum(t.name.endswith(":control") for t in result.tensors) == 4 and set(result.plan.values()) - {"torch"}
