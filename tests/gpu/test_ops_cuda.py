"""CUDA only: the Hadamard transform's 16-bit GEMM with the scale in its fp32 epilogue (``fused.ops._transform``)
against the fp32 GEMM + scale + cast it replaces. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from fused import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_low_precision_gemm_agrees_with_the_fp32_gemm():
    torch.manual_seed(0)
    x = torch.randn(4096, 8, 128, device="cuda").bfloat16().requires_grad_(True)
    y = ops.hadamard(x)
    fp32 = ((x.detach().float() @ ops._sylvester_on(128, x.device, torch.float32)) * 128 ** -0.5).bfloat16()
    # the same exact products summed in fp32 in another order: at most one bf16 ulp apart, almost always equal
    ulp = (fp32.float().abs() * 2 ** -7).clamp_min(2 ** -133)
    assert ((y.float() - fp32.float()).abs() <= ulp).all()
    assert (y == fp32).float().mean() > 0.99
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    assert torch.allclose(dx.float(), ops.hadamard(g).float())  # H symmetric: backward = forward of the grad
    assert not torch.equal(y, x.detach())  # negative control: the transform did something
    twice = ((x.detach() @ ops._sylvester_on(128, x.device, torch.bfloat16)) * 128 ** -0.5).bfloat16()
    assert (twice != fp32).float().mean() > 0.05  # negative control: rounding the sums, then the scale, differs


def test_graph_replay_timing_and_a_host_read_that_breaks_capture():
    from bench.breakdown import graph_replay_ms, host_syncs

    x = torch.randn(256, 256, device="cuda", requires_grad=True)

    def step():
        torch.autograd.grad((x @ x).square().sum(), x)

    def step_with_host_read():
        if float((x * 2).sum()) > -1e30:  # a .item(): syncs, and cannot be captured
            step()

    ok = graph_replay_ms(step)
    assert ok["error"] is None and ok["ms"] > 0
    bad = graph_replay_ms(step_with_host_read)
    assert bad["ms"] is None and bad["error"]
    assert host_syncs(step)["count"] == 0 and host_syncs(step_with_host_read)["count"] >= 1
