"""Failure messages say where: the index of the greatest difference, and for THD its segment, position and head."""

from __future__ import annotations

import torch

from cases.tensors import materialize
from parity import impls
from parity.engine import RunOptions, run_case
from parity.judge.location import where_worst
from tests.parity.helpers import pick


def _thd_case_with_padding():
    case = pick(layout="thd", scope="core")
    kinds = case.layout.row_kinds()
    assert "pad" in kinds or "slack" in kinds, "the test needs a THD case with non-real rows"
    return case


def test_thd_worst_element_is_named_by_segment_position_and_head():
    case = _thd_case_with_padding()
    mask = materialize(case).real_rows
    heads = case.config.num_attention_heads
    r = torch.randn(case.layout.total_tokens, heads, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    bounds, kinds = case.layout.cu_seqlens_padded, case.layout.row_kinds()
    segment = case.layout.num_segments - 1
    row = bounds[segment] + 1 if kinds[bounds[segment] + 1] == "real" else bounds[segment]
    a = r.clone()
    a[row, heads - 1] += 0.5
    a[kinds.index("pad") if "pad" in kinds else kinds.index("slack"), 0] += 100.0  # negative control: not compared
    msg = where_worst(case, "lse", a, r, mask)
    assert msg == (f"; greatest absolute difference at index ({row}, {heads - 1}) "
                   f"(segment {segment}, position {row - bounds[segment]}, head {heads - 1})"), msg


def test_bshd_and_non_row_tensors():
    case = pick(layout="bshd", scope="core")
    lay = case.layout
    mask = materialize(case).real_rows
    r = torch.zeros(lay.batch, lay.seq_len, case.config.num_attention_heads, 4, dtype=torch.float64)
    a = r.clone()
    a[lay.batch - 1, lay.seq_len - 1, 1, 3] = float("nan")  # a NaN is the greatest difference
    a[0, 0, 0, 0] = 1.0
    assert where_worst(case, "out", a, r, mask).endswith(
        f"index ({lay.batch - 1}, {lay.seq_len - 1}, 1, 3) (batch {lay.batch - 1}, position {lay.seq_len - 1}, head 1)")
    g = torch.zeros(3, 5, dtype=torch.float64)
    assert where_worst(case, "grad/core_attention.attn_sink", g + torch.eye(3, 5) * torch.arange(3.0).view(3, 1), g,
                       None).endswith("index (2, 2)")
    assert where_worst(case, "lse", r[..., 0], r[..., 0], mask & False) == ""  # nothing compared


def test_a_failing_thd_case_names_the_segment():
    case = pick(dtype="bfloat16", layout="thd", scope="core", ratio="0")
    biased = run_case(case, impls.load("tests.parity.fakes:fused_bias"), impls.load("reference"),
                      RunOptions(impl="tests.parity.fakes:fused_bias"))
    out = next(t for t in biased.tensors if t.name == "out")
    assert out.verdict == "fail" and "greatest absolute difference at index (" in out.message, out.message
    assert ", head " in out.message and "segment " in out.message, out.message
    assert "greatest absolute difference" in biased.first_failure["message"]
    passing = run_case(case, impls.load("fused"), impls.load("reference"), RunOptions())
    assert passing.outcome == "pass" and not any(t.message for t in passing.tensors)  # negative control


def test_a_gradient_on_padding_rows_is_located():
    """The structure rule names the first non-zero padding-row gradient, a row that is padding of its segment."""
    import re

    case = pick(layout="thd", alignment_padding=True, scope="layer")
    result = run_case(case, impls.load("tests.parity.fakes:reference_pad_grad_leak"), impls.load("reference"),
                      RunOptions(impl="tests.parity.fakes:reference_pad_grad_leak"))
    found = re.search(r"first at index \((\d+), \d+\) \(segment (\d+), position (\d+)\)",
                      result.first_failure["message"])
    assert found, result.first_failure["message"]
    row, segment, position = map(int, found.groups())
    bounds = case.layout.cu_seqlens_padded
    assert case.layout.row_kinds()[row] == "pad" and bounds[segment] + position == row
    assert position >= case.layout.real_lengths[segment]
