"""The reference on CUDA: the same numbers as on the CPU (float64), and the low-precision policy on the GPU."""

from __future__ import annotations

import pytest
import torch

from cases.tensors import materialize
from reference import attention_layer

from .helpers import GOLDEN_PATH, case_of, run_with_grads, thd_layout, tiny_config
from .test_golden import golden_errors, golden_selection, golden_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def to_cuda(case):
    return {**case, "params": {k: v.cuda() for k, v in case["params"].items()}, "x": case["x"].cuda(),
            "dO": case["dO"].cuda()}


@pytest.mark.parametrize("name", ["window_r0", "csa_r4_sparse_mean", "csa_r4_dense_mean", "hca_r128"])
def test_golden_on_cuda(name):
    if not GOLDEN_PATH.exists():
        pytest.skip(f"golden file not found at {GOLDEN_PATH}")
    case = torch.load(GOLDEN_PATH, weights_only=True)["cases"][name]
    selection = golden_selection(case)
    gpu = to_cuda(case)
    config = golden_config(case)
    params = {k: v.clone().requires_grad_(True) for k, v in gpu["params"].items()}
    x = gpu["x"].transpose(0, 1).contiguous().requires_grad_(True)
    res = attention_layer(x, params, config, topk_indices=None if selection is None else selection[0].cuda())
    res.objective(gpu["dO"].transpose(0, 1)).backward()
    grads = {"x": x.grad.transpose(0, 1).cpu(), **{k: p.grad.cpu() for k, p in params.items()}}
    res.out, res.indexer_loss = res.out.cpu(), None if res.indexer_loss is None else res.indexer_loss.cpu()
    errs = golden_errors(case, res, grads)
    assert max(errs.values()) <= 1e-10, errs


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_thd_padded_cuda_equals_cpu(ratio):
    config = tiny_config(ratio)
    layout = thd_layout([6, 0, 131, 3], [8, 0, 136, 4], slack=2, capacity=None)
    case = case_of(config, layout)
    cpu = run_with_grads(attention_layer, case, materialize(case, "cpu"))
    gpu = run_with_grads(attention_layer, case, materialize(case, "cuda"))
    for key, value in cpu.items():
        other = gpu[key].cpu()
        if value.is_floating_point():
            finite = torch.isfinite(value)
            assert torch.equal(finite, torch.isfinite(other)), key
            assert max_abs(value[finite] - other[finite]) <= 1e-12 * max(1.0, max_abs(value[finite])), key
        else:
            assert torch.equal(value, other), key


def test_bfloat16_on_cuda_follows_the_precision_policy():
    config = tiny_config(4, sparse=False)
    layout = thd_layout([40, 9])
    low = materialize(case_of(config, layout, dtype="bfloat16"), "cuda")
    ref = materialize(case_of(config, layout), "cpu")
    with torch.no_grad():
        a = attention_layer(low.inputs["hidden"], low.params, config, low.packed_seq_params)
        b = attention_layer(ref.inputs["hidden"], ref.params, config, ref.packed_seq_params)
    assert a.out.dtype == torch.bfloat16 and a.lse.dtype == a.indexer_loss.dtype == torch.float32
    assert float((a.out.double().cpu() - b.out).abs().max()) <= 6e-2 * float(b.out.abs().max())


@pytest.mark.parametrize("ratio", [0, 4])
def test_thd_offsets_are_read_from_the_gpu_once_per_layer(ratio):
    """``thd.on_host``: the layer reads the packing's row offsets from the GPU once and hands its nested THD calls a
    host copy (each ``thd.segments`` of a device tensor would wait for the GPU). Same numbers as the run handed the
    offsets on the device; control: the offsets are on the device to begin with."""
    import dataclasses

    from reference import thd

    config = tiny_config(ratio)
    case = case_of(config, thd_layout([6, 0, 131, 3], [8, 0, 136, 4], slack=2, capacity=None))
    tensors = materialize(case, "cuda")
    psp = tensors.packed_seq_params
    assert psp.cu_seqlens_q.is_cuda                            # the control: offsets on the device
    host = thd.on_host(psp)
    assert host.cu_seqlens_q.device.type == "cpu" and torch.equal(host.cu_seqlens_q, psp.cu_seqlens_q.cpu())
    assert thd.on_host(host) is host                          # already on the host: nothing to read
    reads = []
    original = thd._host_list
    thd._host_list = lambda value, field: reads.append(value.device.type) or original(value, field)
    try:
        on_device = run_with_grads(attention_layer, case, tensors)
    finally:
        thd._host_list = original
    assert reads and set(reads) == {"cpu"}                     # every segments() read a host copy
    handed_host = run_with_grads(attention_layer, case, dataclasses.replace(tensors, packed_seq_params=host))
    for key, value in on_device.items():
        assert torch.equal(value, handed_host[key]), key


def test_malformed_device_offsets_are_still_named_after_on_host():
    """``thd.on_host`` copies offsets of different shapes or dtypes apart, so ``thd.segments`` still names the bad
    field (control: valid device offsets come back stacked and equal)."""
    from cases.errors import CaseError
    from cases.layout import PackedSeqParams
    from reference import thd

    good = PackedSeqParams(torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda"),
                           torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda"), 4)
    assert thd.segments(thd.on_host(good), 9) == thd.segments(good, 9)
    bad = PackedSeqParams(torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda"),
                          torch.tensor([0.0, 4.0], device="cuda"), 4)
    with pytest.raises(CaseError, match="cu_seqlens_q_padded"):
        thd.segments(thd.on_host(bad), 9)


def test_ordered_gather_gradient_does_not_wait_for_the_gpu():
    """On CUDA ``sum_rows_in_order`` is one segmented reduction (``sum_runs_by_segments``): nothing is read back,
    so on a GPU shared by several workers the gather's backward never waits for it. CUDA's sync debug mode warns
    "called a synchronizing CUDA operation" at every synchronising call; the failure names the lines that did. Only
    that text counts: turning the mode on warns too ("Synchronization debug mode is a prototype feature ..."), which
    an earlier version of this test counted as a wait (2 on an H100, 2026-12-07). Controls: ``torch.unique`` with
    counts (a data-dependent output size) warns, and so does the rank-by-rank schedule (it reads its schedule
    once)."""
    import warnings

    from reference.sparse_attention import row_runs, sum_rows_in_order, sum_runs_by_rank

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 40, (600,), generator=g).cuda()
    values = torch.randn(600, 64, generator=g, dtype=torch.float64).cuda()
    runs = row_runs(ids, 40)
    torch.cuda.synchronize()

    def syncs(fn) -> list:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [f"{w.filename}:{w.lineno}" for w in seen if "called a synchronizing" in str(w.message)]

    assert len(syncs(lambda: torch.unique(ids, return_counts=True))) >= 1
    assert len(syncs(lambda: sum_runs_by_rank(values, *runs))) == 1
    waits = syncs(lambda: sum_rows_in_order(values, ids, 40))
    assert waits == [], f"{len(waits)} synchronising calls: {waits}"


def test_both_gather_gradient_schedules_agree_bit_for_bit_on_the_gpu():
    """CUDA's segmented schedule and the CPU's rank-by-rank one give the same bits on the GPU, and the same as the
    CPU's (float64, float32, bfloat16; magnitudes far apart, ``-0.0`` entries; control: the reversed order differs)."""
    from reference.sparse_attention import row_runs, sum_runs_by_rank, sum_runs_by_segments

    from .test_gather_rows import bits

    g = torch.Generator().manual_seed(5)
    M, rows, D = 3000, 50, 64
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        values = (torch.randn(M, D, generator=g) * torch.exp(3 * torch.randn(M, 1, generator=g))).to(dtype)
        values[torch.rand(M, D, generator=g) < 0.2] = -0.0
        ids = torch.randint(-2, rows, (M,), generator=g)
        on_cpu = sum_runs_by_rank(values, *row_runs(ids, rows))
        cv, ci = values.cuda(), ids.cuda()
        segments = sum_runs_by_segments(cv, *row_runs(ci, rows)).cpu()
        by_rank = sum_runs_by_rank(cv, *row_runs(ci, rows)).cpu()
        reversed_order = sum_runs_by_segments(cv.flip(0), *row_runs(ci.flip(0), rows)).cpu()
        assert torch.equal(bits(segments), bits(by_rank)), dtype
        assert torch.equal(bits(segments), bits(on_cpu)), dtype
        assert not torch.equal(reversed_order, segments), dtype
