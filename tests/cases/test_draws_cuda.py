"""The draws on a GPU: bit-identical to the CPU's (:mod:`cases.draws`), so a case id means the same tensors on both."""

from __future__ import annotations

import pytest
import torch

from cases import materialize
from cases.draws import standard_normal
from cases.suites import load_suite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_draw_is_bit_identical_on_cpu_and_cuda():
    for count, start in [(1, 0), (1000, 0), ((1 << 22) + 5, 3)]:
        cpu = standard_normal(9, "w", count, "cpu", start=start)
        assert torch.equal(standard_normal(9, "w", count, "cuda", start=start).cpu(), cpu), count
    assert not torch.equal(standard_normal(9, "v", 1000, "cuda").cpu(), standard_normal(9, "w", 1000))


@pytest.mark.parametrize("suite", ["smoke", "gate"])
def test_materialize_on_cuda_equals_the_cpu(suite):
    cases = load_suite(suite)
    picked = [c for c in cases if c.is_thd][:2] + [c for c in cases if not c.is_thd][:1]
    for case in picked:
        a, b = materialize(case, "cpu", padding_scale=3.0), materialize(case, "cuda", padding_scale=3.0)
        for group in ("params", "inputs"):
            for name, x in getattr(a, group).items():
                assert torch.equal(getattr(b, group)[name].cpu(), x), (case.id, name)
        assert torch.equal(b.grad_output.cpu(), a.grad_output) and torch.equal(b.real_rows.cpu(), a.real_rows)
