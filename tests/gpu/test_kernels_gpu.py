"""GPU-only: the cudnn / flashmla providers against the torch provider on identical inputs, and CUDA-graph replay
under re-packing. Skipped unless a CUDA device with cudnn-frontend and FlashMLA is present (never on CPU CI)."""

from __future__ import annotations

import pytest
import torch

from fused.plan import load_provider

REASONS = [r for r in (load_provider("cudnn")[1], load_provider("flashmla")[1]) if r]
pytestmark = pytest.mark.skipif(bool(REASONS), reason="; ".join(REASONS) or "GPU providers available")


@pytest.fixture(scope="module")
def kernel_rows():
    from fused import gpu_checks
    calls = gpu_checks.build_calls(torch.device("cuda"), div=8)
    rows, _ = gpu_checks.run_calls(calls, timing=False, capture=False, log=lambda *_: None)
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
    from fused import graph_replay
    rep = graph_replay.check(ratio=4, scope="layer", provider="auto", require=("cudnn", "flashmla"))
    assert rep["capture"]["ok"], rep["capture"]
    assert rep["passed"], [(p["packing"], p["matches_eager"], p.get("differs_from_capture_packing"))
                           for p in rep["packings"]]
